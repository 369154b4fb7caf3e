"""A planner for real clusters: every valid mesh for a model, pruned by memory, ranked by predicted step time.

It follows the seven steps the Ultra-Scale Playbook summaries (and Viacheslav Dubrov's "Scaling LLMs with
multi-GPU and multi-node parallelism") give for choosing a layout, as code:

1. the model states and activations of one GPU (``memory.training_memory``) must fit, with headroom;
2. tensor parallelism inside a node first, where NVLink is (TP talks twice per layer, forward and backward);
3. pipeline stages across nodes when the model still does not fit (1F1B, interleaved virtual stages or ZB-H1,
   each with its own bubble, ``cost.bubble_ratio``, and its own activations in flight, ``schedules``);
4. context parallelism when long sequences make activations too big (a ring of K,V blocks hides behind
   attention compute);
5. expert parallelism for mixture-of-experts models (all-to-all of the routed tokens);
6. data parallelism (with ZeRO) for the rest of the GPUs, its gradient traffic hidden behind backward where it can;
7. micro-batch size and recomputation to trade memory for time, then measure.

Every candidate that ``MeshShape.validate`` accepts (stages may hold unequal block counts: ``pp_layers.ends_split``,
which the library's pipeline cuts as its ``split``; the vocabulary is padded as Megatron-LM pads it) is priced
by ``planner_model.predict``: compute at an assumed fraction of the GPU's peak, communication by the
alpha-beta model of ``cost.py`` on the links each group really crosses, minus the part each kind can overlap
(every overlap an explicit ``Assumptions`` field), plus the pipeline bubble. Its numbers are predictions: the
ranking and the reasons matter more than the digits. An empty or impossible answer says why.

**The planner and the library.** ``plan(..., library_rules=True)`` ranks only meshes the course library composes
at toy scale (``library_refusal``: ``parallel.config.check_composable``, whose MoE refusal under a pipeline is
``parallel.config.routing_refusal``); that is what chapter 08 runs end to end. By default the planner plans real
clusters and differs, deliberately, where the library's limits are teaching limits and not the hardware's:

* ZeRO-2 with a pipeline: the same rule and message in both (``ZERO_WITH_PIPELINE``), always applied;
* ZeRO-3 with a pipeline: planned in the form torchtitan runs (its 3D FSDP2 x TP x PP: parameters and optimizer
  state sharded and gathered for every micro-batch, each stage's gradients accumulated unsharded and
  reduce-scattered once per step, ``planner_model.zero3_with_pipeline``), which is the form the library composes
  (``parallel.fsdp2_pipeline``) and NVIDIA's NeMo AutoModel runs (FSDP with PP 4 to 8 for its DeepSeek-V3 and Kimi K2
  performance rows);
* divisibility (``MeshShape.validate``): the same, except that stages may hold unequal block counts
  (``pp_layers.ends_split``, which ``train_pp(split=...)`` cuts; the composed ``parallelize`` cuts equal stages
  only, so ``library_rules`` asks for pp x v dividing n_layer) and the vocabulary is padded to 128 x tp as
  Megatron-LM pads it (the library does the same given ``GPTConfig(make_vocab_size_divisible_by=128 * tp)``);
* EP with ZeRO-2/3 or with sequence parallelism: the library refuses them (``parallel.config.EP_REFUSALS``: its
  shards over dp x cp would mix the experts the ep ranks hold; the router would see s/tp tokens), and, since the
  planner assumes SP with TP, ``library_rules`` keeps EP with tp = 1 only; NVIDIA's AutoModel runs FSDP2 x EP
  and Megatron Core EP x TP, so the planner ranks them (EP itself composes with TP, PP and CP in both);
* an MoE with capacity or the load-balancing loss, dp x cp > 1, pp > 1 and ep = 1: the library refuses it because
  no single process has the micro-batches the pipeline then sees (its parity with ``train_baseline`` would
  break); a real run accepts per-micro-batch load statistics (Megatron-LM's aux loss is per micro-batch), so the
  planner ranks it;
* TP inside a node (``gpus_per_node``): the planner's rule only (step 2), the library has no nodes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from course_lib.estimates import hardware
from course_lib.estimates.hardware import GPU, Link
from course_lib.estimates.memory_budget import GiB
from course_lib.model_config import PRESETS, GPTConfig
from course_lib.parallel.config import check_composable
from course_lib.planner.memory import states_exceed
from course_lib.planner.model import (
    SCHEDULES,
    Assumptions,
    Candidate,
    Cluster,
    Prediction,
    leading_dense,
    padded_config,
    padded_vocab,
    predict,
    refusal,
)
from course_lib.runtime.mesh import MeshError, MeshShape, divisors

# ------------------------------------------------------------------------------------------------ hardware

H100 = hardware.gpu("H100 80GB")
H800 = hardware.gpu("H800 80GB")
A100 = hardware.gpu("A100 80GB")
A100_40GB = hardware.gpu("A100 40GB")

CLUSTERS: dict[str, Cluster] = {c.name: c for c in (
    Cluster("dgx-h100", 1, 8, H100, hardware.link("NVLink 4 (H100)"), hardware.link("InfiniBand NDR 400G"),
            "NVIDIA DGX H100 user guide: 8 H100 SXM on NVLink 4 through NVSwitch, 8 ConnectX-7 400 Gb/s compute "
            "ports (one per GPU)"),
    Cluster("hgx-h800", 1, 8, H800, hardware.link("NVLink 4 (H800)"), hardware.link("InfiniBand NDR 400G"),
            "DeepSeek-V3 technical report, Sec. 3.2.2: 8 H800 per node on NVLink/NVSwitch, one 400 Gb/s "
            "InfiniBand NIC per GPU (50 GB/s)"),
    Cluster("dgx-a100-80gb", 1, 8, A100, hardware.link("NVLink 3 (A100)"), hardware.link("InfiniBand HDR 200G"),
            "NVIDIA DGX A100 user guide: 8 A100 SXM on NVLink 3 through NVSwitch, 8 ConnectX-6 200 Gb/s compute "
            "ports (one per GPU)"),
    Cluster("dgx-a100-40gb", 1, 8, A100_40GB, hardware.link("NVLink 3 (A100)"),
            hardware.link("InfiniBand HDR 200G"),
            "NVIDIA DGX A100 (the original 320 GB system): 8 A100 40GB SXM, NVLink 3, 8 ConnectX-6 200 Gb/s ports"),
    # The same GPUs in PCIe servers on a commodity network (one 100 Gb/s NIC per node, shared by its 8 GPUs):
    # same GPU count, very different links.
    Cluster("pcie-h100-ethernet", 1, 8, H100, hardware.link("PCIe 5.0 x16"),
            hardware.link("Ethernet 100G").shared_by(8),
            "a PCIe server: 8 H100 on PCIe 5.0, one 100 Gb/s Ethernet port for the node"),
)}


def cluster(name: str, nodes: int) -> Cluster:
    """A preset of ``CLUSTERS`` with ``nodes`` nodes."""
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster {name!r}; choose one of {sorted(CLUSTERS)}")
    return CLUSTERS[name].with_nodes(nodes)


# ------------------------------------------------------------------------------------------------ the search

MESH_AXES = ("dp", "tp", "pp", "cp", "ep")
FIXED_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "micro_batch", "recompute", "schedule", "v")
"""What ``fixed`` may pin: the mesh degrees and every other field of a ``Candidate``."""


def _check_space(zero_stages: Sequence[int], micro_batches: Sequence[int], recomputes: Sequence[str],
                 schedules: Sequence[str], virtual_stages: Sequence[int], max_cp: int | None,
                 fixed: dict[str, object]) -> None:
    def ints(name: str, values: Sequence[int], allowed: Iterable[int] | None = None) -> None:
        if not values:
            raise ValueError(f"{name} is empty: give at least one value")
        for x in values:
            if isinstance(x, bool) or not isinstance(x, int) or (x < 1 and allowed is None):
                raise ValueError(f"{name} must hold ints >= 1, got {x!r} in {tuple(values)}")
            if allowed is not None and x not in allowed:
                raise ValueError(f"{name} must hold values of {tuple(allowed)}, got {x!r}")

    ints("zero_stages", zero_stages, (0, 1, 2, 3))
    ints("micro_batches", micro_batches)
    ints("virtual_stages", virtual_stages)
    for name, values, allowed in (("recomputes", recomputes, ("none", "selective", "full")),
                                  ("schedules", schedules, SCHEDULES)):
        if not values or any(x not in allowed for x in values):
            raise ValueError(f"{name} must be a non-empty sequence of {allowed}, got {tuple(values)}")
    if max_cp is not None and (isinstance(max_cp, bool) or not isinstance(max_cp, int) or max_cp < 1):
        raise ValueError(f"max_cp must be an int >= 1 or None (no cap), got {max_cp!r}")
    unknown = sorted(set(fixed) - set(FIXED_KEYS))
    if unknown:
        raise ValueError(f"fixed has unknown key(s) {unknown}: it pins one of {list(FIXED_KEYS)}")


def moe_pipeline_refusal(cfg: GPTConfig, shape: MeshShape) -> str:
    """The library's MoE refusal (``parallel.config.routing_refusal``, any ep), "" when it does not apply:
    capacity or the load-balancing loss in the global scope with dp x cp > 1 and pp > 1 (the local scope,
    ``GPTConfig.capacity_scope``, composes)."""
    batch_wide = cfg.n_expert and (cfg.capacity_factor is not None or cfg.aux_loss_coef) \
        and cfg.capacity_scope == "global"
    if batch_wide and shape.pp > 1 and shape.dp * shape.cp > 1:
        return (f"an MoE with capacity or the load-balancing loss with dp x cp = {shape.dp * shape.cp} and "
                f"pp = {shape.pp}: refused by the library (config.routing_refusal), no single process has the "
                f"pipeline's micro-batches")
    return ""


def library_refusal(cfg: GPTConfig, cand: Candidate, global_batch: int, seq_len: int) -> str:
    """Why the course library would not compose ``cand`` at toy scale ("" when it would): the message of
    ``parallel.config.check_composable`` (with the vocabulary padded to 128 x tp, the planner's ``padded_vocab``)
    or of ``moe_pipeline_refusal``."""
    c = replace(cfg, seq_len=seq_len, vocab_size=padded_vocab(cfg.vocab_size, cand.tp))
    try:
        check_composable(cand.shape, c, sequence_parallel=cand.tp > 1, global_batch=global_batch,
                         microbatches=cand.microbatches(global_batch), v=cand.v, zero_stage=cand.zero_stage)
    except (MeshError, ValueError) as e:
        return "library: " + str(e)
    return moe_pipeline_refusal(cfg, cand.shape)


def candidates(cfg: GPTConfig, world: int, global_batch: int, seq_len: int, *,
               zero_stages: Sequence[int] = (0, 1, 2, 3), micro_batches: Sequence[int] = (1, 2, 4),
               recomputes: Sequence[str] = ("none", "selective", "full"),
               schedules: Sequence[str] = ("1f1b", "interleaved", "zb_h1"), virtual_stages: Sequence[int] = (2, 4),
               max_cp: int | None = None, gpus_per_node: int | None = None, fixed: dict[str, object] | None = None,
               library_rules: bool = False, problems: dict[str, int] | None = None) -> Iterable[Candidate]:
    """Every candidate with dp x tp x pp x cp = world that ``MeshShape.validate`` accepts for the model (its
    vocabulary padded for TP, ``padded_vocab``; stages of unequal block counts allowed), the batch and the
    sequence, and that ``refusal`` does not refuse; ``fixed`` pins some fields (``{"dp": 48}``: the question a
    weak-scaling study asks -- how to split the rest between TP and PP). With ``gpus_per_node``, TP stays inside
    a node (step 2). ``library_rules``: also drop what ``library_refusal`` refuses (the module docstring says where
    the two differ and why). ``problems`` (a dict) collects why meshes were dropped, for an empty plan's message.
    """
    fixed = dict(fixed or {})
    _check_space(zero_stages, micro_batches, recomputes, schedules, virtual_stages, max_cp, fixed)
    problems = {} if problems is None else problems

    def drop(reason: str) -> None:
        problems[reason] = problems.get(reason, 0) + 1

    def pinned(**values: object) -> bool:
        return not fixed or all(fixed.get(k, v) == v for k, v in values.items())

    pipes = [(sc, v) for sc in schedules for v in (virtual_stages if sc == "interleaved" else (1,))]
    for tp, pp, cp in itertools.product(divisors(world), repeat=3):
        if world % (tp * pp * cp) or (max_cp is not None and cp > max_cp):
            continue
        dp = world // (tp * pp * cp)
        if not pinned(dp=dp, tp=tp, pp=pp, cp=cp):
            continue
        if gpus_per_node is not None and tp > gpus_per_node:
            drop(f"tp={tp} > {gpus_per_node} GPUs per node (TP stays inside a node)")
            continue
        padded = padded_config(cfg, tp)
        eps = [e for e in divisors(dp * cp) if cfg.n_expert and cfg.n_expert % e == 0] or [1]
        for ep, mb in itertools.product(eps, micro_batches):
            if not pinned(ep=ep, micro_batch=mb):
                continue
            try:
                MeshShape(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep).validate(
                    padded, global_batch=global_batch, micro_batch=mb, seq_len=seq_len, sp=tp > 1,
                    uneven_layers=True)
            except MeshError as e:
                for p in e.problems:
                    drop(p)
                continue
            m = global_batch // (dp * mb)
            for (sched, v), zero, rc in itertools.product(pipes if pp > 1 else [("1f1b", 1)], zero_stages,
                                                          recomputes):
                if not pinned(zero_stage=zero, recompute=rc, schedule=sched, v=v):
                    continue
                cand = Candidate(dp, tp, pp, cp, ep, zero, mb, rc, sched, v)  # type: ignore[arg-type]
                why = refusal(cfg, cand, m) or (library_rules and library_refusal(cfg, cand, global_batch, seq_len))
                if why:
                    drop(why)
                    continue
                yield cand


# ------------------------------------------------------------------------------------------------ the plan


@dataclass
class PlanResult:
    """The ranked candidates that fit, how many were rejected by memory, and -- when none fits or none is
    valid -- ``message``: why, and what to change."""

    ranked: list[Prediction]
    rejected_memory: int
    considered: int
    message: str = ""

    def best(self) -> Prediction:
        """The fastest candidate; ``ValueError`` with ``message`` when none fits."""
        if not self.ranked:
            raise ValueError(self.message)
        return self.ranked[0]

    def place(self, **mesh: int) -> int | None:
        """1-based place of the mesh with these degrees (``place(tp=8, pp=16)``; the others any) among the
        distinct meshes (dp, tp, pp, cp, ep) of the ranking, each at its best candidate; None when absent."""
        seen: list[tuple[int, ...]] = []
        for p in self.ranked:
            key = tuple(getattr(p.candidate, a) for a in MESH_AXES)
            if key not in seen:
                seen.append(key)
                if all(getattr(p.candidate, k) == v for k, v in mesh.items()):
                    return len(seen)
        return None

    def meshes(self, top: int = 5) -> list[Candidate]:
        """The best candidate of each of the ``top`` best distinct meshes."""
        out: dict[tuple[int, ...], Candidate] = {}
        for p in self.ranked:
            out.setdefault(tuple(getattr(p.candidate, a) for a in MESH_AXES), p.candidate)
            if len(out) == top:
                break
        return list(out.values())

    def table(self, top: int = 10) -> list[dict[str, object]]:
        rows = []
        for i, p in enumerate(self.ranked[:top], 1):
            c = p.candidate
            rows.append({"rank": i, "dp": c.dp, "tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep, "zero": c.zero_stage,
                         "mb": c.micro_batch, "recompute": c.recompute, "schedule": c.schedule_label,
                         "GiB/GPU": round(p.memory.total / GiB, 1), "step_s": round(p.step_s, 3),
                         "MFU": round(p.mfu, 3), "why": "; ".join(p.reasons[1:])})
        return rows


def _no_mesh_message(cl: Cluster, closest: Prediction | None, problems: dict[str, int], fixed: dict) -> str:
    if closest is None:
        common = sorted(problems.items(), key=lambda kv: -kv[1])[:3]
        return ("no valid mesh" + (f" with fixed={fixed}" if fixed else "") + f" on {cl.world_size} GPUs: "
                + ("; ".join(f"{p} ({n} meshes)" for p, n in common) if common else "nothing to enumerate"))
    c, need = closest.candidate, closest.memory.total / closest.usable_bytes
    fixes = ["raise the number of nodes (more ways to split)"]
    fixes += [f"unpin {sorted(fixed)}"] if fixed else []
    fixes += ["allow ZeRO-3"] if c.zero_stage < 3 and c.pp == 1 else []
    fixes += ["allow full recomputation"] if c.recompute != "full" else []
    return (f"no mesh fits: the closest ({c}) needs {need:.2f}x the memory per GPU "
            f"({closest.memory.total / GiB:.1f} GiB of {closest.usable_bytes / GiB:.1f} GiB usable on "
            f"{cl.gpu.name}); " + ", ".join(fixes) + ", or use GPUs with more memory")


def plan(cfg: GPTConfig | str, cl: Cluster, global_batch: int, seq_len: int, *,
         assume: Assumptions | None = None, **space: object) -> PlanResult:
    """Enumerate (``candidates``, TP inside a node), prune by memory, rank by predicted step time (fastest first).
    Raises ``ValueError`` when no mesh is valid at all (with the constraints that failed); when none fits in
    memory the result is empty and ``message`` says how far the closest is."""
    if isinstance(cfg, str):
        if cfg not in PRESETS:
            raise ValueError(f"unknown model preset {cfg!r}; choose one of {sorted(PRESETS)}")
        cfg = PRESETS[cfg]
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    assume = assume or Assumptions()
    space.setdefault("gpus_per_node", cl.gpus_per_node)
    problems: dict[str, int] = {}
    usable = assume.usable_memory * cl.gpu.bytes
    preds: list[Prediction] = []
    unfit: list[Candidate] = []  # the rejected candidates while none fits: an empty plan names the closest
    considered = rejected = 0
    for cand in candidates(cfg, cl.world_size, global_batch, seq_len, problems=problems, **space):
        considered += 1
        lay = cand.layout(global_batch, cfg.n_layer, leading_dense(cfg, assume.dense_layers))
        if not states_exceed(padded_config(cfg, cand.tp), lay, assume.headroom, usable,
                             assume.precision):  # else its model states alone do not fit: not priced
            p = predict(cfg, cl, global_batch, seq_len, cand, assume, time_if_fits_only=True)
            if p.fits:
                preds.append(p)
                unfit.clear()
                continue
        rejected += 1
        if not preds:
            unfit.append(cand)
    fixed = dict(space.get("fixed") or {})  # type: ignore[call-overload]
    if considered == 0:
        raise ValueError(_no_mesh_message(cl, None, problems, fixed))
    preds.sort(key=lambda p: (p.step_s, p.memory.total))
    if preds:
        return PlanResult(preds, rejected, considered)
    closest = None
    for cand in unfit:  # none fits: the one that comes closest, first of equals
        p = predict(cfg, cl, global_batch, seq_len, cand, assume, time_if_fits_only=True)
        if closest is None or p.memory.total < closest.memory.total:
            closest = p
    return PlanResult(preds, rejected, considered, _no_mesh_message(cl, closest, problems, fixed))


def fewest_gpus(cfg: GPTConfig, cl: Cluster, global_batch: int, seq_len: int, max_nodes: int = 1024,
                **space: object) -> tuple[int, Prediction] | None:
    """The smallest number of nodes (a power of two) on which some candidate fits, and the fastest one there."""
    nodes = 1
    while nodes <= max_nodes:
        try:
            res = plan(cfg, cl.with_nodes(nodes), global_batch, seq_len, **space)
        except ValueError:
            res = None
        if res and res.ranked:
            return nodes * cl.gpus_per_node, res.ranked[0]
        nodes *= 2
    return None


__all__ = [
    "A100",
    "A100_40GB",
    "CLUSTERS",
    "FIXED_KEYS",
    "GPU",
    "H100",
    "H800",
    "MESH_AXES",
    "SCHEDULES",
    "Assumptions",
    "Candidate",
    "Cluster",
    "Link",
    "PlanResult",
    "Prediction",
    "candidates",
    "cluster",
    "fewest_gpus",
    "library_refusal",
    "moe_pipeline_refusal",
    "padded_vocab",
    "plan",
    "predict",
    "refusal",
]
