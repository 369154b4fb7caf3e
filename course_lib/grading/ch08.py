"""Chapter 08 — composing the axes: coordinates, groups, a mesh's constraints, and a bug on four ranks.

1. ``coords_of(rank, degrees, order)``: the dense coordinates (tp, cp, dp, pp) of a rank for an axis order;
   checked against ``course_lib.mesh.MeshShape.coords`` for every rank of several meshes and orders.
2. ``group_of(rank, axes, degrees, order)``: the ranks of ``rank``'s group over ``axes`` (sorted); checked against
   ``MeshShape.group_ranks``.
3. ``mesh_problems(cfg, degrees, global_batch, micro_batch)``: the names of the constraints a mesh breaks for a
   model and a batch (a set of strings); checked on meshes that break none, one and several.
4. ``predict_mesh(cfg, degrees, gpu, global_batch, seq_len, micro_batch, zero_stage, efficiency)``: a mesh's
   model-state bytes per GPU and its step time, from the stated formulas (``predict_mesh_spec``); checked against
   the library's planner (``planner.predict``: ``memory.training_memory``'s exact per-stage count, and its time
   model on links that cost nothing) within ``MEMORY_RTOL`` and ``TIME_RTOL``, on meshes with pp > 1, cp > 1 and
   ZeRO-1/2/3.
5. ``average_dp_gradients(params, mesh)``: find the bug in a colleague's DP x TP step (the data-parallel groups
   built by hand from rank ids, right only when tp varies fastest) and fix it; run on 4 real ranks (dp=2 x tp=2,
   both axis orders, visibly too), checked against one process after one SGD step.
6. ``add_grad_reduce(schedule)``: pipeline x data parallelism as a schedule transform, one ``REDUCE_GRAD`` per
   stage right after its last weight-gradient action (B, or W under zero bubble); checked as data on 1F1B,
   interleaved and ZB-H1 schedules (with and without transfers), then on 4 real ranks: ``train_parallel`` on
   ``ParallelConfig(dp=2, pp=2, schedule="zb_h1")`` with a ``PipelineParallel`` whose ``place_grad_reduce`` is the
   learner's function, against one process (``train_baseline``).
7. ``place_parameter(name, shape, n_layer, parallel)``: where a parameter lives on a mesh and what its gradient
   needs (``ch08_placement``), checked on 4 real ranks against the placements the library's transforms record.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from course_lib import hardware, planner
from course_lib import schedules as S
from course_lib.data import global_batch, shard
from course_lib.grading import ch08_placement, core
from course_lib.grading.ch08_placement import LAUNCH_TIMEOUT_S, check_place_parameter
from course_lib.grading.core import (
    CheckFailed,
    CheckResult,
    Exercise,
    expect_close,
    expect_equal,
    guard_visible_checks,
    run_check,
)
from course_lib.memory import GiB
from course_lib.mesh import DENSE_AXES, Mesh, MeshShape
from course_lib.model import GPT, PRESETS, GPTConfig, lm_loss, param_count
from course_lib.parallel.compose import merge_composed, train_parallel
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.pp import PipelineParallel
from course_lib.schedules import Action, Kind
from course_lib.train import TrainConfig, compare, train_baseline

GRADER_PARAMETERS = {"seed": 1}

CONSTRAINTS = ("heads", "kv_heads", "ffn", "vocab", "layers", "sequence", "batch")
"""The names ``mesh_problems`` returns, one per constraint of ``MeshShape.validate`` (world size aside)."""

_MESHES = (({"tp": 2, "cp": 1, "dp": 2, "pp": 2}, "tp-cp-ep-dp-pp"),
           ({"tp": 2, "cp": 2, "dp": 3, "pp": 1}, "tp-cp-ep-dp-pp"),
           ({"tp": 4, "cp": 1, "dp": 2, "pp": 1}, "dp-tp-cp-ep-pp"),
           ({"tp": 2, "cp": 2, "dp": 2, "pp": 2}, "pp-dp-cp-ep-tp"),
           ({"tp": 2, "ep": 2, "dp": 2, "pp": 2}, "tp-ep-dp-cp-pp"))  # ep has a degree but is not a dense axis


def _shape(degrees: dict[str, int], order: str) -> MeshShape:
    return MeshShape(order=order, **{a: degrees.get(a, 1) for a in DENSE_AXES})


def check_coords_of(fn: Callable, meshes: tuple = _MESHES) -> CheckResult:
    def body() -> str:
        n = 0
        for degrees, order in meshes:
            shape = _shape(degrees, order)
            for r in range(shape.world_size):
                want = {a: shape.coords(r)[a] for a in DENSE_AXES}
                got = fn(r, dict(degrees), order)
                if not isinstance(got, dict) or set(got) != set(DENSE_AXES) or \
                        not all(type(v) is int for v in got.values()):
                    raise CheckFailed(f"coords_of({r}, {degrees}, {order!r}) must return a dict of the four axes "
                                      f"{list(DENSE_AXES)} to Python ints, got {got!r}")
                if got != want:
                    ep = " ; ep has a degree here but is not a dense axis: skip it" if degrees.get("ep", 1) > 1 else ""
                    raise CheckFailed(f"coords_of({r}, {degrees}, {order!r}): expected {want}, got {got} (the first "
                                      f"axis of the order varies fastest{ep})")
                n += 1
        return f"{n} ranks of {len(meshes)} meshes right"
    return run_check("coords_of", body)


def check_group_of(fn: Callable, meshes: tuple = _MESHES,
                   axes_list: tuple = (("tp",), ("dp",), ("pp",), ("dp", "cp"), ("tp", "pp"))) -> CheckResult:
    def body() -> str:
        n = 0
        for degrees, order in meshes:
            shape = _shape(degrees, order)
            for axes in axes_list:
                for r in range(shape.world_size):
                    want = shape.group_ranks(r, *axes)
                    got = fn(r, axes, dict(degrees), order)
                    if not isinstance(got, list) or not all(type(v) is int for v in got):
                        raise CheckFailed(f"group_of({r}, {axes}, {degrees}, {order!r}) must return a list of ints, "
                                          f"got {got!r}")
                    expect_equal(got, want, f"group_of({r}, {axes}, {degrees}, {order!r}) (sorted ranks)")
                    n += 1
        return f"{n} groups right"
    return run_check("group_of", body)


def reference_problems(cfg: GPTConfig, degrees: dict[str, int], global_batch: int, micro_batch: int) -> set[str]:
    """The chapter's rules, one name each (the grader's reference for ``mesh_problems``)."""
    tp, cp, dp, pp = (degrees.get(a, 1) for a in ("tp", "cp", "dp", "pp"))
    out = set()
    if cfg.n_head % tp:
        out.add("heads")
    if cfg.kv_heads % tp and tp % cfg.kv_heads:
        out.add("kv_heads")
    if cfg.ffn_dim % tp:
        out.add("ffn")
    if cfg.vocab_size % tp:
        out.add("vocab")
    if cfg.n_layer % pp:
        out.add("layers")
    if cp > 1 and cfg.seq_len % (2 * cp):
        out.add("sequence")
    if global_batch % (dp * micro_batch):
        out.add("batch")
    return out


_CFG = GPTConfig(vocab_size=256, seq_len=24, n_layer=4, n_head=4, n_kv_head=2, d_model=64, d_ff=192)
_CASES = (
    (_CFG, {"tp": 2, "dp": 2, "pp": 2}, 8, 1),          # fits
    (_CFG, {"tp": 4, "dp": 2}, 8, 1),                    # kv heads replicated: fits
    (_CFG, {"tp": 8}, 8, 1),                             # heads (kv 2 divides 8: replicated)
    (_CFG, {"pp": 3, "dp": 2}, 8, 1),                    # layers
    (_CFG.with_(seq_len=12), {"cp": 4, "dp": 2}, 8, 1),  # sequence: 12 % 8 (12 % 4 == 0)
    (_CFG, {"dp": 3}, 8, 1),                             # batch
    (_CFG.with_(vocab_size=250, d_ff=190), {"tp": 4}, 8, 2),  # ffn, vocab
    (GPTConfig(n_head=6, n_kv_head=3, d_model=48), {"tp": 4, "dp": 2}, 6, 2),  # heads, kv, batch
    (_CFG, {"cp": 2, "dp": 2}, 6, 1),                    # fits: cp ranks share the sequences, not the batch
)


def check_mesh_problems(fn: Callable, cases: tuple = _CASES) -> CheckResult:
    def body() -> str:
        for cfg, degrees, gb, mb in cases:
            want = reference_problems(cfg, degrees, gb, mb)
            got = fn(cfg, dict(degrees), gb, mb)
            if not isinstance(got, set) or not all(isinstance(v, str) for v in got):
                raise CheckFailed(f"mesh_problems must return a set of names from {CONSTRAINTS}, got {got!r}")
            unknown = got - set(CONSTRAINTS)
            if unknown:
                raise CheckFailed(f"unknown constraint names {sorted(unknown)}: use {CONSTRAINTS}")
            if got != want:
                missing, extra = sorted(want - got), sorted(got - want)
                wrong = ([f"{missing} broken but not returned"] if missing else []) + \
                    ([f"{extra} returned but not broken (that rule holds here)"] if extra else [])
                raise CheckFailed(f"degrees {degrees}, global batch {gb}, micro-batch {mb} (n_head={cfg.n_head}, "
                                  f"n_kv_head={cfg.kv_heads}, d_ff={cfg.ffn_dim}, vocab={cfg.vocab_size}, "
                                  f"n_layer={cfg.n_layer}, seq_len={cfg.seq_len}): expected {sorted(want)}, got "
                                  f"{sorted(got)}: {'; '.join(wrong)}")
        return f"{len(cases)} meshes: the broken constraints named exactly"
    return run_check("mesh_problems", body)


# ----------------------------------------------------------------------------------------------------------------
# A mesh's memory and step time, predicted

MEMORY_RTOL = 0.05
"""How far ``model_state_bytes`` may be from the library's estimator: the stated formula spreads every parameter
evenly over tp x pp, the estimator counts the worst pipeline stage exactly (its embedding or head, the norms TP
replicates); on the check's meshes the two differ by at most 3.3 %."""
TIME_RTOL = 0.10
"""How far ``step_s`` may be from the planner's time model on free links: 6 N D leaves out attention's own
FLOPs (12 L h s per token) and counts the embedding, which costs none; the planner times the slowest (last)
stage, head included; on the check's meshes the two differ by at most 7 %."""

IDEAL_LINK = hardware.Link("free", 0.0, float("inf"), "no latency, no bandwidth limit: an idealisation")
"""A link whose messages cost nothing: on it the planner's step time is its compute and its pipeline bubble."""


def _axes(degrees: dict[str, int]) -> tuple[int, int, int, int]:
    return tuple(degrees.get(a, 1) for a in ("tp", "cp", "dp", "pp"))  # type: ignore[return-value]


def predict_mesh_spec(cfg: GPTConfig, degrees: dict[str, int], gpu: planner.GPU, global_batch: int, seq_len: int,
                      micro_batch: int, zero_stage: int, efficiency: float) -> dict[str, float]:
    """The exercise's formulas, as the notebook states them (the grader's statement of the spec, not its judge).

    * Model states per GPU, mixed-precision AdamW (2 bytes bf16 weight + 2 bytes bf16 gradient + 12 bytes fp32
      master weight, m and v per parameter): N = ``param_count(cfg)`` parameters spread evenly over the
      tp x pp ranks of one replica, N / (tp pp) per GPU; ZeRO-k shards over the N_d = dp x cp ranks that hold
      the same shard: the optimizer states from k >= 1, the gradients from k >= 2, the weights at k = 3
      (Rajbhandari et al. 2020, Sec. 5).
    * Step time: 6 N D FLOPs for D = global_batch x seq_len tokens (Kaplan et al. 2020), over G = tp cp dp pp
      GPUs at ``efficiency`` x ``gpu.peak_flops`` each; with m = global_batch / (dp x micro_batch) micro-batches
      per pipeline, 1F1B idles (pp-1)/(m+pp-1) of the step (Narayanan et al. 2021), so
      step = 6 N D / (G peak efficiency) x (m + pp - 1) / m.
    """
    tp, cp, dp, pp = _axes(degrees)
    n, n_d = param_count(cfg), dp * cp
    per_gpu = n / (tp * pp)
    shard = [n_d if zero_stage >= k else 1 for k in (3, 2, 1)]  # weights, gradients, optimizer states
    state = per_gpu * (2 / shard[0] + 2 / shard[1] + 12 / shard[2])
    m = global_batch // (dp * micro_batch)
    ideal = 6 * n * global_batch * seq_len / (tp * cp * dp * pp * gpu.peak_flops * efficiency)
    return {"model_state_bytes": state, "step_s": ideal * (m + pp - 1) / m}


def library_prediction(cfg: GPTConfig, degrees: dict[str, int], gpu: planner.GPU, global_batch: int, seq_len: int,
                       micro_batch: int, zero_stage: int, efficiency: float) -> dict[str, float]:
    """What the library predicts for the same mesh: ``planner.predict`` of the candidate (no recomputation) on a
    cluster of ``IDEAL_LINK`` s, matrix multiplies and attention at ``efficiency`` whatever their size, no
    memory-bound kernels; model states are the
    parameters + gradients + optimizer state of its ``memory.training_memory`` budget (worst stage), the step
    is its ``step_s`` (compute and the 1F1B bubble: nothing else costs time on free links)."""
    tp, cp, dp, pp = _axes(degrees)
    cand = planner.Candidate(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero_stage, micro_batch=micro_batch, recompute="none")
    cl = planner.Cluster("free links", 1, tp * cp * dp * pp, gpu, IDEAL_LINK, IDEAL_LINK)
    assume = planner.Assumptions(efficiency=efficiency, gemm_rows_half=0.0, gemm_cols_half=0.0,
                                 attention_efficiency=efficiency, elementwise_passes=0.0)
    pred = planner.predict(cfg, cl, global_batch, seq_len, cand, assume)
    states = pred.memory["parameters"] + pred.memory["gradients"] + pred.memory["optimizer_state"]
    return {"model_state_bytes": states, "step_s": pred.step_s}


PREDICT_KEYS = ("model_state_bytes", "step_s")
# (preset, degrees, gpu, global batch, sequence, micro-batch, ZeRO stage, efficiency)
PREDICT_CASES = (
    ("llama2-70b", {"dp": 8, "tp": 8}, planner.H100, 512, 2048, 1, 1, 0.5),           # no pipeline
    ("llama2-70b", {"dp": 2, "tp": 8, "pp": 4}, planner.H100, 16, 2048, 1, 1, 0.5),   # m = 8: bubble 3/11
    ("llama2-7b", {"dp": 16}, planner.H100, 64, 1024, 1, 3, 0.5),                     # ZeRO-3 divides all by 16
    ("llama2-70b", {"dp": 4, "cp": 2, "tp": 8}, planner.H100, 64, 2048, 1, 1, 0.5),   # ZeRO over dp x cp = 8
    ("gpt3-175b", {"dp": 4, "tp": 8, "pp": 8}, planner.H100, 64, 2048, 2, 2, 0.5),    # m = 8, pp = 8: bubble 7/15
)


def _describe_case(name: str, degrees: dict[str, int], gpu: planner.GPU, gb: int, s: int, mb: int, zero: int,
                   eff: float) -> str:
    mesh = " ".join(f"{a}={v}" for a, v in degrees.items())
    return (f"{name}, {mesh}, ZeRO-{zero}, {gpu.name} at {eff:.0%}, global batch {gb} x {s} tokens, "
            f"micro-batch {mb}")


def check_predict_mesh(fn: Callable, cases: tuple = PREDICT_CASES) -> CheckResult:
    def body() -> str:
        worst = dict.fromkeys(PREDICT_KEYS, 0.0)
        for name, degrees, gpu, gb, s, mb, zero, eff in cases:
            cfg, what = PRESETS[name], _describe_case(name, degrees, gpu, gb, s, mb, zero, eff)
            got = fn(cfg, dict(degrees), gpu, gb, s, mb, zero, eff)
            if not isinstance(got, dict) or set(got) != set(PREDICT_KEYS):
                raise CheckFailed(f"{what}: predict_mesh must return a dict with exactly the keys "
                                  f"{list(PREDICT_KEYS)}, got {got!r}")
            want = library_prediction(cfg, degrees, gpu, gb, s, mb, zero, eff)
            for key, rtol in (("model_state_bytes", MEMORY_RTOL), ("step_s", TIME_RTOL)):
                value = got[key]
                if isinstance(value, bool) or not isinstance(value, numbers.Real) or value <= 0:
                    raise CheckFailed(f"{what}: {key} must be a positive Python number, got {value!r}")
                ratio = value / want[key]
                if abs(ratio - 1) > rtol:
                    unit = (lambda v: f"{v / GiB:.3g} GiB") if key == "model_state_bytes" else (lambda v: f"{v:.3g} s")
                    raise CheckFailed(f"{what}: {key} expected about {unit(want[key])} (the library's estimate, "
                                      f"within {rtol:.0%}), got {unit(value)}, {ratio:.3g} x that")
                worst[key] = max(worst[key], abs(ratio - 1))
        return (f"{len(cases)} meshes: memory within {worst['model_state_bytes']:.1%}, step time within "
                f"{worst['step_s']:.1%} of the library's estimate")
    return run_check("predict_mesh", body)


# ----------------------------------------------------------------------------------------------------------------
# DP x TP on four ranks

_RANK_CFG = GPTConfig(vocab_size=256, seq_len=8, n_layer=1, n_head=2, d_model=16)


def _dp_tp_step(rank: int, world_size: int, fn: Callable, order: str, batch: int, seed: int) -> dict[str, Any]:
    from course_lib.parallel.tp import TensorParallel

    mesh = Mesh(dp=2, tp=2, order=order)
    tp = TensorParallel(GPT(_RANK_CFG, seed=seed), mesh=mesh)
    x, y = global_batch(seed, batch, _RANK_CFG.seq_len, seed)
    xd, yd = shard(x, mesh.coord("dp"), 2), shard(y, mesh.coord("dp"), 2)
    tp.loss(tp(xd), yd).backward()
    tp.finish_gradient_sync()
    fn(list(tp.parameters()), mesh)
    with torch.no_grad():
        for p in tp.parameters():
            p -= 0.5 * p.grad
    return tp.full_parameters()


def check_average_dp_gradients(fn: Callable, orders: tuple[str, ...] = ("tp-cp-ep-dp-pp", "dp-tp-cp-ep-pp"),
                               batch: int = 4,
                               seed: int = 0, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """4 ranks, dp=2 x tp=2: each DP replica (a TP pair) trains on its half of the batch; after ``fn`` and one SGD
    step (lr 0.5) every rank's full parameters must equal one process's after the same step on the whole batch."""
    launch = functools.partial(core.launch_check, hang_hint=": did every rank call the same collectives on the "
                               "same group?")

    def body() -> str:
        ref = GPT(_RANK_CFG, seed=seed)
        x, y = global_batch(seed, batch, _RANK_CFG.seq_len, seed)
        lm_loss(ref(x), y).backward()
        with torch.no_grad():
            want = {n: p - 0.5 * p.grad for n, p in ref.named_parameters()}
        for order in orders:
            for r, got in enumerate(launch(_dp_tp_step, 4, fn, order, batch, seed, timeout=timeout)):
                for name, value in want.items():
                    expect_close(got[name], value, f"order {order!r}, rank {r}: {name} after one step "
                                 "(the average over the data-parallel replicas)", rtol=1e-4, atol=1e-6)
        return f"orders {list(orders)}: every rank equals one process after the step"
    return run_check("average_dp_gradients", body)


# ----------------------------------------------------------------------------------------------------------------
# Pipeline x data parallelism: the gradient reduction as a schedule action

# (schedule name, p, m, v): each is checked compute-only and with its transfers (``schedules.add_send_recv``)
_REDUCE_CASES = (("1f1b", 2, 4, 1), ("interleaved", 2, 4, 2), ("zb_h1", 4, 8, 1))


def _build(name: str, p: int, m: int, v: int) -> S.Schedule:
    builder = getattr(S, S.canonical_schedule(name))
    return builder(p, m, v) if v > 1 else builder(p, m)


def _weight_kind(actions: list[Action], stage: int) -> Kind:
    """W when the stage's backward is split (zero bubble), else B."""
    return Kind.W if any(a.kind is Kind.W and a.stage == stage for a in actions) else Kind.B


def _check_rank(r: int, given: list[Action], got: list[Action], what: str) -> None:
    plain = [a for a in got if a.kind is not Kind.REDUCE_GRAD]
    if plain != given:
        first = next((i for i, (a, b) in enumerate(zip(plain, given, strict=False)) if a != b),
                     min(len(plain), len(given)))
        want, have = (str(x[first]) if first < len(x) else "the end of the list" for x in (given, plain))
        raise CheckFailed(f"{what}, rank {r}: without its REDUCE_GRAD actions the list must be the input's, in "
                          f"order; at position {first} expected {want}, got {have}")
    held = {a.stage for a in given}
    foreign = sorted({a.stage for a in got if a.kind is Kind.REDUCE_GRAD} - held)
    if foreign:
        raise CheckFailed(f"{what}, rank {r}: REDUCE_GRAD of stage(s) {foreign}, which this rank does not hold "
                          f"(its stages: {sorted(held)})")
    for stage in sorted(held):
        mine = [i for i, a in enumerate(got) if a.kind is Kind.REDUCE_GRAD and a.stage == stage]
        if len(mine) != 1:
            raise CheckFailed(f"{what}, rank {r}: stage {stage} has {len(mine)} REDUCE_GRAD actions, expected "
                              "exactly one (its gradients are reduced once per step)")
        kind = _weight_kind(given, stage)
        writes = [i for i, a in enumerate(got) if a.kind is kind and a.stage == stage]
        last, at = writes[-1], mine[0]
        pending = [str(got[i]) for i in writes if i > at]
        if pending:
            why = (" (zero bubble's weight passes: the reduction must wait for the last W, not the last I)"
                   if kind is Kind.W else "")
            raise CheckFailed(f"{what}, rank {r}: stage {stage}'s REDUCE_GRAD comes before {', '.join(pending)}, "
                              f"weight-gradient work of that stage still to run{why}: the average would miss it")
        between = [str(a) for a in got[last + 1:at] if a.is_compute]
        if between:
            raise CheckFailed(f"{what}, rank {r}: stage {stage}'s REDUCE_GRAD comes after {', '.join(between)}: "
                              f"it must start right after {got[last]}, its last weight-gradient action, so that "
                              "the reduction overlaps the rest of the schedule")
        expected = Action(Kind.REDUCE_GRAD, got[last].microbatch, stage)
        if got[at] != expected:
            raise CheckFailed(f"{what}, rank {r}: expected {expected!r} (the micro-batch of {got[last]}), got "
                              f"{got[at]!r}")


def _check_transform(fn: Callable, schedule: S.Schedule, what: str) -> None:
    given = [list(rank) for rank in schedule]
    got = fn(given)
    if given != schedule:
        raise CheckFailed(f"{what}: add_grad_reduce changed its input schedule; return a new one")
    if not isinstance(got, list) or len(got) != len(schedule) or not all(isinstance(rank, list) for rank in got):
        raise CheckFailed(f"{what}: expected a list of {len(schedule)} lists (one per rank), got {got!r:.200}")
    for r, rank in enumerate(got):
        bad = next((a for a in rank if not isinstance(a, Action) or not isinstance(a.kind, Kind)
                    or type(a.microbatch) is not int or type(a.stage) is not int), None)
        if bad is not None:
            raise CheckFailed(f"{what}, rank {r}: every item must be a schedules.Action of a Kind and two ints, got "
                              f"{bad!r} (build REDUCE_GRAD as Action(Kind.REDUCE_GRAD, microbatch, stage))")
        _check_rank(r, schedule[r], rank, what)


_PP_CFG = GPTConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, bias=False)


class GradReduceProbe(PipelineParallel):
    """The pipeline the check trains: ``place_grad_reduce`` is ``transform`` (the learner's ``add_grad_reduce``),
    and before each step's data-parallel average it notes in ``problems``, for every stage of this rank, what
    went wrong in the schedule as it ran: no ``REDUCE_GRAD``, or weight-gradient actions after it (the
    all-reduce had already started, so the average misses them). Build one per run with ``with_transform``."""

    transform: ClassVar[Callable[[S.Schedule], S.Schedule]]
    problems: ClassVar[list[str]]

    @classmethod
    def with_transform(cls, fn: Callable[[S.Schedule], S.Schedule]) -> type[GradReduceProbe]:
        return type("LearnersPipeline", (cls,), {"transform": staticmethod(fn), "problems": []})

    def place_grad_reduce(self, actions: S.Schedule) -> S.Schedule:
        return type(self).transform(actions)

    def finish_gradient_sync(self) -> None:
        ran = [t.action for t in self.timelines[-1]]
        for stage in sorted(int(s) for s in self.stages):
            where = f"rank {dist.get_rank()} (pipeline stage {stage})"
            at = [i for i, a in enumerate(ran) if a.kind is Kind.REDUCE_GRAD and a.stage == stage]
            kind = _weight_kind(ran, stage)
            late = [str(a) for a in ran[at[0] + 1:] if a.kind is kind and a.stage == stage] if at else []
            if not at:
                self.problems.append(f"{where} ran no REDUCE_GRAD: its gradients were never averaged over the "
                                     "data-parallel replicas")
            elif late:
                self.problems.append(f"{where} ran {', '.join(late)} after its REDUCE_GRAD: the all-reduce had "
                                     "already started, so the data-parallel average missed those weight gradients")
        super().finish_gradient_sync()


def _pp_dp_on_rank(rank: int, world_size: int, fn: Callable, schedule: str, microbatches: int,
                   seed: int) -> tuple[Any, list[str]]:
    probe = GradReduceProbe.with_transform(fn)
    result = train_parallel(rank, world_size, _PP_CFG, TrainConfig(steps=2, global_batch=8, seed=seed),
                            ParallelConfig(dp=2, pp=2, schedule=schedule, microbatches=microbatches),
                            pipeline_class=probe)
    return result, list(probe.problems)


def _on_ranks(fn: Callable, schedule: str, microbatches: int, seed: int, timeout: float) -> str:
    what = f"on 4 ranks (dp=2 x pp=2, {schedule}, m={microbatches})"
    results = core.launch_check(_pp_dp_on_rank, 4, fn, schedule, microbatches, seed, timeout=timeout,
                                hang_hint=": does every rank's schedule still hold every transfer, once each?")
    problems = list(dict.fromkeys(p for _, found in results for p in found))  # each step notes the same
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckFailed(f"{what}: {problems[0]}{more}")
    try:
        merged = merge_composed([r for r, _ in results])
    except ValueError as err:
        raise CheckFailed(f"{what}: {err}") from None
    report = compare(train_baseline(_PP_CFG, TrainConfig(steps=2, global_batch=8, seed=seed)), merged)
    if not report.ok:
        raise CheckFailed(f"{what}: the run differs from one process: {report}")
    return f"{what} every parameter equals one process's after 2 steps"


def check_grad_reduce_on_ranks(fn: Callable, schedule: str = "zb_h1", microbatches: int = 2, seed: int = 0,
                               timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """Only the on-rank half of ``check_add_grad_reduce``: ``train_parallel`` on ``ParallelConfig(dp=2, pp=2)`` with
    ``GradReduceProbe.with_transform(fn)`` against ``train_baseline`` (parity at ``train.compare``'s tolerance)."""
    return run_check("add_grad_reduce on ranks", lambda: _on_ranks(fn, schedule, microbatches, seed, timeout))


def check_add_grad_reduce(fn: Callable, cases: tuple = _REDUCE_CASES, ranks: tuple = (("zb_h1", 2, 0),),
                          timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """``fn`` on every schedule of ``cases``, compute-only and with transfers: the input unchanged, the output a
    list per rank of ``Action`` s equal to the input once the REDUCE_GRADs are removed, one REDUCE_GRAD per
    stage, after the stage's last B (or W) with at most transfers in between, on that action's micro-batch; then
    each (schedule, m, seed) of ``ranks`` trained on 4 ranks (``check_grad_reduce_on_ranks``)."""
    def body() -> str:
        n = 0
        for name, p, m, v in cases:
            compute = _build(name, p, m, v)
            label = f"{name} p={p} m={m}" + (f" v={v}" if v > 1 else "")
            _check_transform(fn, compute, f"{label} (compute only)")
            _check_transform(fn, S.add_send_recv(compute), f"{label} (with transfers)")
            n += 2
        runs = [_on_ranks(fn, schedule, m, seed, timeout) for schedule, m, seed in ranks]
        return "; ".join([f"{n} schedules right", *runs])
    return run_check("add_grad_reduce", body)


EXERCISES = [
    Exercise("coords_of", "Rank -> coordinates for an axis order", 3, "coords_of", check_coords_of,
             hidden=[{"meshes": (({"tp": 3, "cp": 1, "dp": 2, "pp": 2}, "cp-dp-tp-ep-pp"),
                                 ({"tp": 1, "cp": 4, "dp": 1, "pp": 2}, "tp-cp-ep-dp-pp"),
                                 ({"tp": 2, "cp": 2, "dp": 2, "ep": 4}, "ep-cp-tp-dp-pp"))}],
             off_limits=("course_lib.mesh.MeshShape.coords", "course_lib.mesh.MeshShape.table")),
    Exercise("group_of", "The ranks of a group over some axes", 3, "group_of", check_group_of,
             hidden=[{"meshes": (({"tp": 3, "cp": 2, "dp": 2, "pp": 1}, "dp-cp-tp-ep-pp"),
                                 ({"tp": 2, "cp": 2, "dp": 2, "ep": 4}, "cp-ep-tp-dp-pp")),
                      "axes_list": (("cp",), ("tp", "cp", "dp"), ("dp", "pp"))}],
             off_limits=("course_lib.mesh.MeshShape.group_ranks", "course_lib.mesh.MeshShape.all_groups")),
    Exercise("mesh_problems", "Validate a mesh: which constraints break", 3, "mesh_problems", check_mesh_problems,
             hidden=[{"cases": ((GPTConfig(n_head=8, n_kv_head=1, d_model=64, seq_len=30, n_layer=6),
                                 {"tp": 2, "cp": 3, "pp": 4}, 12, 1),
                                (GPTConfig(n_head=8, d_model=64, seq_len=32, n_layer=6), {"pp": 2, "dp": 4}, 16, 2),
                                (GPTConfig(n_head=8, d_model=64, seq_len=32, n_layer=6), {"cp": 4, "dp": 2}, 10, 1))}],
             off_limits=("course_lib.mesh.MeshShape.validate",)),
    Exercise("predict_mesh", "Predict a mesh's memory and step time", 4, "predict_mesh", check_predict_mesh,
             hidden=[{"cases": (("llama3-8b", {"dp": 8, "tp": 2, "pp": 2}, planner.A100, 32, 2048, 1, 1, 0.4),
                                ("llama2-70b", {"dp": 64, "tp": 8}, planner.A100, 512, 2048, 1, 3, 0.6),
                                ("llama2-70b", {"dp": 4, "cp": 2, "tp": 8, "pp": 2}, planner.H100, 32, 2048, 1, 2,
                                 0.45))}],
             off_limits=("course_lib.planner.predict", "course_lib.planner.plan")),
    Exercise("average_dp_gradients", "Find the bug: DP x TP on four ranks", 5, "average_dp_gradients",
             check_average_dp_gradients, hidden=[{"orders": ("dp-tp-cp-ep-pp", "tp-dp-cp-ep-pp"), "batch": 8,
                                                  "seed": 2}]),
    Exercise("add_grad_reduce", "Pipeline x data parallelism: the gradient reduction in the schedule", 5,
             "add_grad_reduce", check_add_grad_reduce,
             hidden=[{"cases": (("gpipe", 4, 4, 1), ("zb_h1", 2, 3, 1), ("interleaved", 4, 8, 2), ("zb_h1", 3, 6, 1)),
                      "ranks": (("zb_h1", 4, 1),)}],
             off_limits=("course_lib.schedules.add_grad_reduce",)),
    Exercise("place_parameter", "Where a parameter lives on a mesh, and what its gradient needs", 4,
             "place_parameter", check_place_parameter, hidden=[ch08_placement.HIDDEN],
             off_limits=ch08_placement.OFF_LIMITS),
]

guard_visible_checks(globals(), EXERCISES)
