"""A planner for real clusters: every valid mesh for a model, pruned by memory, ranked by predicted step time.

It follows the seven steps the Ultra-Scale Playbook summaries (and Viacheslav Dubrov's "Scaling LLMs with
multi-GPU and multi-node parallelism") give for choosing a layout, as code:

1. the model states and activations of one GPU (``memory.training_memory``) must fit, with headroom;
2. tensor parallelism inside a node first, where NVLink is (TP talks twice per layer, forward and backward);
3. pipeline stages across nodes when the model still does not fit (the bubble (p-1)/m costs compute);
4. context parallelism when long sequences make activations too big (a ring of K,V blocks hides behind
   attention compute);
5. expert parallelism for mixture-of-experts models (all-to-all of the routed tokens);
6. data parallelism (with ZeRO) for the rest of the GPUs, its gradient traffic hidden behind backward where it can;
7. micro-batch size and recomputation to trade memory for time, then measure.

Every candidate (dp, tp, pp, cp, ep, ZeRO stage, micro-batch, recompute) that ``MeshShape.validate`` accepts
is priced with a simple, stated model (``predict``): compute at an assumed fraction of the GPU's peak,
communication by the alpha-beta model of ``cost.py`` on the link each group really uses (a group whose ranks
share a node uses the intra-node link, otherwise the inter-node one; GPUs and links from ``hardware.py``),
minus the part each kind can overlap, plus the pipeline bubble. Its numbers are predictions: the ranking and the
reasons matter more than the digits.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from course_lib import cost, hardware
from course_lib.hardware import GPU, Link
from course_lib.memory import GiB, MemoryBudget, ParallelLayout, Recompute, params_per_rank, training_memory
from course_lib.mesh import MeshError, MeshShape, divisors
from course_lib.model import PRESETS, GPTConfig, block_params

# ------------------------------------------------------------------------------------------------ hardware

H100 = hardware.gpu("H100 80GB")
A100 = hardware.gpu("A100 80GB")


def _time(link: Link, op: cost.Collective, nbytes: float, n: int) -> float:
    """A collective of ``nbytes`` over ``n`` ranks on ``link``: the alpha-beta ring time of ``cost.collective_time``."""
    return cost.collective_time(op, nbytes, n, link.alpha, link.beta)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs; ``intra`` links GPUs of one node, ``inter`` is each GPU's share of the
    network between nodes (a DGX H100 has one 400 Gb/s NIC per GPU)."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu: GPU
    intra: Link
    inter: Link

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        return Cluster(self.name, nodes, self.gpus_per_node, self.gpu, self.intra, self.inter)


CLUSTERS: dict[str, Cluster] = {
    # DGX H100: 8 GPUs on NVLink 4 (450 GB/s a direction), one InfiniBand NDR NIC (50 GB/s) per GPU.
    "dgx-h100": Cluster("dgx-h100", 1, 8, H100, hardware.link("NVLink 4 (H100)"),
                        hardware.link("InfiniBand NDR 400G")),
    # The same GPUs in PCIe servers on a commodity network (one 100 Gb/s NIC per node, shared by its 8 GPUs):
    # same GPU count, very different links.
    "pcie-h100-ethernet": Cluster("pcie-h100-ethernet", 1, 8, H100, hardware.link("PCIe 5.0 x16"),
                                  hardware.link("Ethernet 100G").shared_by(8)),
}


def cluster(name: str, nodes: int) -> Cluster:
    """A preset of ``CLUSTERS`` with ``nodes`` nodes."""
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster {name!r}; choose one of {sorted(CLUSTERS)}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an int >= 1, got {nodes!r}")
    return CLUSTERS[name].with_nodes(nodes)


# ------------------------------------------------------------------------------------------------ candidates


@dataclass(frozen=True)
class Candidate:
    """One way to run the job. ``sp`` (sequence parallelism) is on whenever tp > 1, as Megatron recommends."""

    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    zero: int = 1
    micro_batch: int = 1
    recompute: Recompute = "selective"

    @property
    def shape(self) -> MeshShape:
        return MeshShape(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)

    def layout(self, global_batch: int) -> ParallelLayout:
        return ParallelLayout(dp=self.dp, zero=self.zero, tp=self.tp, sp=self.tp > 1, pp=self.pp,
                              microbatches=self.microbatches(global_batch), cp=self.cp, ep=self.ep)

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches each pipeline runs per step: global batch / (dp x micro-batch)."""
        return global_batch // (self.dp * self.micro_batch)

    def __str__(self) -> str:
        extra = "".join(f" {k}={getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) > 1)
        return (f"dp={self.dp} tp={self.tp} pp={self.pp}{extra} zero={self.zero} mb={self.micro_batch} "
                f"recompute={self.recompute}")


@dataclass
class Prediction:
    """Predicted memory and step time of one candidate, the time split by where it goes (seconds)."""

    candidate: Candidate
    memory: MemoryBudget
    fits: bool
    seconds: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    reasons: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return sum(self.seconds.values())


@dataclass(frozen=True)
class Assumptions:
    """What the time model assumes; change them to see how the ranking moves.

    * ``efficiency``: matrix multiplies run at this fraction of the GPU's dense peak;
    * ``grad_overlap``: DP gradient reduction hides behind the backward of the last micro-batch, parameter
      all-gathers (ZeRO-1/2 after the step, ZeRO-3 before each use) behind the forward of the first one;
      ``grad_overlap`` is the fraction of that compute the traffic can use;
    * TP / SP collectives sit on the critical path (no overlap); the pipeline's point-to-point sends too;
    * CP's K,V ring overlaps with the attention of the block in flight.
    """

    efficiency: float = 0.75
    gemm_rows_half: float = 256.0
    gemm_cols_half: float = 128.0
    grad_overlap: float = 1.0
    headroom: float = 0.10
    usable_memory: float = 1.0  # fraction of the GPU's memory the job may use (the budget has its own headroom)

    def gemm_efficiency(self, rows: int, cols: int) -> float:
        """Fraction of peak a layer's matrix multiplies reach on one GPU: ``efficiency`` for large ones, less
        when the local GEMM is small -- ``rows`` tokens of a micro-batch on this rank (b*s/cp), ``cols`` the
        hidden size on this rank (h/tp): x/(x + x_half) for each, a saturating curve (larger GEMMs have more
        arithmetic intensity and fill the GPU's waves better)."""
        return self.efficiency * rows / (rows + self.gemm_rows_half) * cols / (cols + self.gemm_cols_half)


def candidates(cfg: GPTConfig, world: int, global_batch: int, seq_len: int, *,
               zero_stages: Sequence[int] = (0, 1, 2, 3), micro_batches: Sequence[int] = (1, 2, 4),
               recomputes: Sequence[Recompute] = ("none", "selective", "full"),
               max_cp: int = 16, fixed: dict[str, int] | None = None) -> Iterable[Candidate]:
    """Every (dp, tp, pp, cp, ep, zero, micro-batch, recompute) with dp x tp x pp x cp = world that
    ``MeshShape.validate`` accepts for the model, the batch and the sequence; ``fixed`` pins some degrees
    (``{"dp": 48}``: the question a weak-scaling study asks -- how to split the rest between TP and PP)."""
    fixed = fixed or {}
    for tp, pp, cp in itertools.product(divisors(world), repeat=3):
        if world % (tp * pp * cp) or cp > max_cp:
            continue
        dp = world // (tp * pp * cp)
        if any({"dp": dp, "tp": tp, "pp": pp, "cp": cp}.get(k, v) != v for k, v in fixed.items()):
            continue
        eps = [e for e in divisors(dp * cp) if cfg.n_expert and cfg.n_expert % e == 0] or [1]
        for ep, mb in itertools.product(eps, micro_batches):
            try:
                MeshShape(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep).validate(cfg, global_batch=global_batch,
                                                                       micro_batch=mb, seq_len=seq_len, sp=tp > 1)
            except MeshError:
                continue
            for zero, rc in itertools.product(zero_stages, recomputes):
                yield Candidate(dp, tp, pp, cp, ep, zero, mb, rc)


# ------------------------------------------------------------------------------------------------ the time model


def _spans_nodes(shape: MeshShape, axis: str, gpus_per_node: int) -> bool:
    """Whether the group of rank 0 along ``axis`` has ranks on more than one node (node = rank // gpus_per_node)."""
    return len({r // gpus_per_node for r in shape.group_ranks(0, axis)}) > 1


def predict(cfg: GPTConfig, cl: Cluster, global_batch: int, seq_len: int, cand: Candidate,
            assume: Assumptions = Assumptions()) -> Prediction:
    """Memory of the worst GPU and the step time of ``cand``, split into compute, each axis's exposed
    communication and the pipeline bubble; tokens/s and MFU (model FLOPs only, as in PaLM)."""
    lay = cand.layout(global_batch)
    mem = training_memory(cfg, micro_batch=cand.micro_batch, seq_len=seq_len, recompute=cand.recompute,
                          layout=lay, headroom=assume.headroom)
    fits = mem.total <= assume.usable_memory * cl.gpu.bytes
    shape, gpn, world = cand.shape, cl.gpus_per_node, cl.world_size
    link = {a: cl.inter if _spans_nodes(shape, a, gpn) else cl.intra for a in ("tp", "cp", "dp", "pp")}
    m = cand.microbatches(global_batch)
    b, s, h, L = cand.micro_batch, seq_len, cfg.d_model, cfg.n_layer
    s_local, layers_stage = s // cand.cp, L // cand.pp
    attn = 4 * h * s  # one layer's attention scores + weighted sum, forward FLOPs per token (not halved)
    layer_fwd = 2 * block_params(cfg, active_only=True) + attn
    head_fwd = 2 * cfg.vocab_size * h  # the LM head on the last stage (the input embedding is a lookup)
    extra = {"none": 0.0, "selective": attn, "full": layer_fwd}[cand.recompute]  # recomputed forward, per layer
    eff = assume.gemm_efficiency(b * s_local, h // cand.tp)
    rate = cl.gpu.peak_flops * eff

    # one micro-batch on one GPU of the last stage, the slowest (its layers and the LM head), its 1/(tp cp) share
    t_fwd_mb = b * s * (layers_stage * layer_fwd + head_fwd) / (cand.tp * cand.cp) / rate
    t_bwd_mb = b * s * (layers_stage * (2 * layer_fwd + extra) + 2 * head_fwd) / (cand.tp * cand.cp) / rate
    t_mb = t_fwd_mb + t_bwd_mb
    compute = m * t_mb
    fwd_per_token = L * layer_fwd + head_fwd

    # TP/SP: per layer 2 all-reduces forward, 2 backward (+2 when the forward is recomputed) of b*s/cp*h bf16
    tp_s = 0.0
    if cand.tp > 1:
        per_mb = (4 + (2 if cand.recompute == "full" else 0)) * layers_stage
        tp_s = m * per_mb * _time(link["tp"], "all_reduce", b * s_local * h * 2, cand.tp)

    # CP: cp-1 ring steps of one K,V block (2 * b * s/cp * h_kv bf16) per layer, forward and twice backward,
    # hidden behind the attention of the block in flight
    cp_s = 0.0
    if cand.cp > 1:
        kv = 2 * b * s_local * cfg.kv_heads * cfg.head_dim * 2
        ring = 3 * (cand.cp - 1) * (link["cp"].alpha + kv / link["cp"].beta) * layers_stage
        attn_compute = b * s * 3 * attn * layers_stage / (cand.tp * cand.cp) / rate
        cp_s = m * max(0.0, ring - attn_compute)

    # EP: dispatch + combine all-to-all of the routed tokens, forward and backward, over the ep ranks
    ep_s = 0.0
    if cand.ep > 1:
        routed = b * s_local * cfg.top_k * h * 2 / cand.tp
        ep_link = cl.inter if len({r // gpn for r in shape.group_ranks(0, "ep")}) > 1 else cl.intra
        ep_s = m * 4 * layers_stage * _time(ep_link, "all_to_all", routed, cand.ep)

    # PP: the bubble (p-1)/m of the ideal time (1F1B), and one activation send per micro-batch and direction
    pp_s = bubble = 0.0
    if cand.pp > 1:
        bubble = cost.bubble_ratio("one_f_one_b", cand.pp, m) * (compute + tp_s + cp_s + ep_s)
        act = b * s_local * h * 2 / (cand.tp if cand.tp > 1 else 1)
        pp_s = 2 * m * (link["pp"].alpha + act / link["pp"].beta)

    # DP / ZeRO over dp x cp: gradients reduced (ZeRO-0/1 all-reduce as reduce-scatter + all-gather of the
    # updated parameters; ZeRO-2 the same; ZeRO-3 also gathers the parameters for the forward and backward)
    n_dp = cand.dp * cand.cp
    dp_s = 0.0
    if n_dp > 1:
        p_rank = sum(params_per_rank(cfg, lay).values())
        dense_link = cl.inter if len({r // gpn for r in shape.group_ranks(0, "dp", "cp")}) > 1 else cl.intra
        grad_bytes = p_rank * 2
        reduce = _time(dense_link, "reduce_scatter", grad_bytes, n_dp)
        gather = _time(dense_link, "all_gather", grad_bytes, n_dp)
        hide_b, hide_f = assume.grad_overlap * t_bwd_mb, assume.grad_overlap * t_fwd_mb
        if cand.zero == 3:  # gathers before every forward and backward of every micro-batch: 3 Psi in all
            dp_s = max(0.0, reduce - hide_b) + m * (max(0.0, gather - t_fwd_mb) + max(0.0, gather - t_bwd_mb))
        else:
            dp_s = max(0.0, reduce - hide_b) + max(0.0, gather - hide_f)

    pred = Prediction(cand, mem, fits)
    pred.seconds = {"compute": compute, "tp": tp_s, "cp": cp_s, "ep": ep_s, "pp_bubble": bubble, "pp_p2p": pp_s,
                    "dp": dp_s}
    pred.tokens_per_s = global_batch * s / pred.step_s
    model_flops = 3 * fwd_per_token * global_batch * s  # MFU: model FLOPs only (no recompute)
    pred.mfu = model_flops / pred.step_s / (world * cl.gpu.peak_flops)
    pred.reasons = _reasons(pred, cl, link)
    return pred


def _reasons(p: Prediction, cl: Cluster, link: dict[str, Link]) -> list[str]:
    c, sec, step = p.candidate, p.seconds, p.step_s
    out = [f"{p.memory.total / GiB:.1f} GiB of {cl.gpu.bytes / GiB:.0f} GiB per GPU"
           + ("" if p.fits else " (does not fit)")]
    shares = sorted(((v / step, k) for k, v in sec.items() if k != "compute" and v > 0), reverse=True)
    if shares:
        out.append("largest overhead: " + ", ".join(f"{k} {f:.0%}" for f, k in shares[:2]) + " of the step")
    else:
        out.append("no exposed communication or bubble")
    if c.tp > 1:
        out.append(f"TP over {'NVLink inside a node' if link['tp'] is cl.intra else 'the inter-node network'}")
    return out


@dataclass
class PlanResult:
    """The ranked candidates that fit, and how many were rejected by memory."""

    ranked: list[Prediction]
    rejected_memory: int
    considered: int

    def table(self, top: int = 10) -> list[dict[str, object]]:
        rows = []
        for i, p in enumerate(self.ranked[:top], 1):
            c = p.candidate
            rows.append({"rank": i, "dp": c.dp, "tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep, "zero": c.zero,
                         "mb": c.micro_batch, "recompute": c.recompute, "GiB/GPU": round(p.memory.total / GiB, 1),
                         "step_s": round(p.step_s, 3), "MFU": round(p.mfu, 3), "why": "; ".join(p.reasons[1:])})
        return rows


def plan(cfg: GPTConfig | str, cl: Cluster, global_batch: int, seq_len: int, *,
         assume: Assumptions = Assumptions(), **space: object) -> PlanResult:
    """Enumerate (``candidates``), prune by memory, rank by predicted step time (fastest first)."""
    cfg = PRESETS[cfg] if isinstance(cfg, str) else cfg
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    preds, rejected, considered = [], 0, 0
    for cand in candidates(cfg, cl.world_size, global_batch, seq_len, **space):
        considered += 1
        p = predict(cfg, cl, global_batch, seq_len, cand, assume)
        if p.fits:
            preds.append(p)
        else:
            rejected += 1
    preds.sort(key=lambda p: (p.step_s, p.memory.total))
    return PlanResult(preds, rejected, considered)


# ------------------------------------------------------------------------------------------------ references

# Megatron-LM's weak-scaling runs on H100 (Megatron-Core r0.8.0, its README's table): GPT models with
# seq 2048, vocabulary 131072, untied embeddings, MHA, 4h GELU MLP; DP 48 throughout.
# (name, heads, hidden, layers, TP, PP, GPUs, global batch, published MFU)
MEGATRON_WEAK_SCALING: list[tuple[str, int, int, int, int, int, int, int, float]] = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 0.41),
    ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 0.47),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 0.49),
    ("32B", 56, 7168, 48, 8, 1, 384, 192, 0.46),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 0.42),
    ("119B", 80, 10240, 92, 8, 4, 1536, 768, 0.43),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 0.44),
    ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 0.48),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 0.47),
]


def megatron_config(name: str, heads: int, hidden: int, layers: int) -> GPTConfig:
    return GPTConfig(name=f"megatron-{name}", vocab_size=131072, seq_len=2048, n_layer=layers, n_head=heads,
                     d_model=hidden)


MEGATRON_SPACE: dict[str, tuple] = {"zero_stages": (1,), "recomputes": ("selective",), "micro_batches": (1, 2, 4)}
"""The search space of those runs: Megatron's distributed optimizer (ZeRO-1), selective recomputation."""


@dataclass(frozen=True)
class PublishedCheck:
    """One published run against the planner: its pick with DP fixed as in the study (``pinned``) and, left
    free, the 1-based place of the published mesh among its ranked candidates (None: not among them)."""

    name: str
    gpus: int
    tp: int
    pp: int
    mfu: float
    pinned: Prediction
    free_place: int | None


def check_megatron(cluster_name: str = "dgx-h100") -> list[PublishedCheck]:
    """Every row of ``MEGATRON_WEAK_SCALING`` planned on ``cluster_name`` (seq 2048, ``MEGATRON_SPACE``)."""
    out = []
    for name, heads, h, layers, tp, pp, gpus, gb, mfu in MEGATRON_WEAK_SCALING:
        cfg, cl = megatron_config(name, heads, h, layers), cluster(cluster_name, gpus // 8)
        pinned = plan(cfg, cl, gb, 2048, fixed={"dp": 48, "cp": 1}, **MEGATRON_SPACE).ranked[0]
        meshes = [(q.candidate.tp, q.candidate.pp, q.candidate.cp) for q in plan(cfg, cl, gb, 2048,
                                                                                **MEGATRON_SPACE).ranked]
        place = meshes.index((tp, pp, 1)) + 1 if (tp, pp, 1) in meshes else None
        out.append(PublishedCheck(name, gpus, tp, pp, mfu, pinned, place))
    return out


def fewest_gpus(cfg: GPTConfig, cl: Cluster, global_batch: int, seq_len: int, max_nodes: int = 1024,
                **space: object) -> tuple[int, Prediction] | None:
    """The smallest number of nodes (a power of two) on which some candidate fits, and the fastest one there."""
    nodes = 1
    while nodes <= max_nodes:
        res = plan(cfg, cl.with_nodes(nodes), global_batch, seq_len, **space)
        if res.ranked:
            return nodes * cl.gpus_per_node, res.ranked[0]
        nodes *= 2
    return None


__all__ = [
    "A100",
    "CLUSTERS",
    "GPU",
    "H100",
    "MEGATRON_SPACE",
    "MEGATRON_WEAK_SCALING",
    "Assumptions",
    "Candidate",
    "Cluster",
    "Link",
    "PlanResult",
    "Prediction",
    "PublishedCheck",
    "candidates",
    "check_megatron",
    "cluster",
    "fewest_gpus",
    "megatron_config",
    "plan",
    "predict",
]

