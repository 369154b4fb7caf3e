"""The planner's model of one candidate: its memory (worst GPU) and its step time, split by where it goes.

Its parts, one concept a file: the search space (``planner_candidate``: cluster, candidate, refusals), the
memory (``planner_memory``), the groups and collectives (``planner_comm``), the MoE's weights and routing
(``planner_moe``); this file holds the assumptions and ``predict``, and re-exports the others.

* **Memory** (``planner_memory``): ``memory.training_memory`` of the candidate's layout, for the stages that can
  be worst (the first two and the last two: under ``pp_layers.ends_split`` the middle stages hold the same blocks
  and fewer micro-batches in flight), their activations scaled to the schedule's own peak in flight
  (``peak_in_flight``, as ``schedule_run.peak_in_flight`` counts them: interleaved 1F1B holds 1 + (p-1)/(p v)
  times 1F1B's on rank 0, as Korthikanti et al. 2022 state; ZB-H1 holds p on every rank until its W); under
  ZeRO-3 with a pipeline each stage holds its gradients whole (``zero3_with_pipeline``). FlashAttention-era
  activations (no s x s score matrix, no dropout masks: ``activation_formula="adapted"``) are the default;
  ``Assumptions(attention_memory="paper")`` uses Korthikanti et al.'s Table 2 (its 5as/h term, dropout). Model
  states at 16 bytes per parameter (mixed precision with Adam), or 8 with ``Assumptions(precision="bf16")``.
* **Compute**: 2 FLOPs per multiply-add of the active parameters at ``Assumptions.gemm_efficiency`` of the peak
  (expert GEMMs at the efficiency of the rows each expert receives). An MoE layer's active matmul weights are
  attention + router h E + the shared experts' MLP of n_s f_e + top_k routed MLPs of f_e (``expert_d_ff``,
  DeepSeekMoE's fine-grained experts); the first ``Assumptions.dense_layers`` blocks are dense MLPs of d_ff
  (DeepSeek-V3's first 3); attention 4 h s per token and layer forward, halved for the causal mask (a
  FlashAttention kernel skips the masked blocks), at ``attention_efficiency``, slower on short blocks
  (``hardware.attention_length_factor``: FlashAttention-2's measured speed by length; with CP each rank's blocks
  are s/cp long); memory-bound kernels moving the saved activations ``elementwise_passes`` times at the memory
  bandwidth. Backward twice the forward, plus the recomputed forward (selective: the core attention; full: the
  whole layer). The slowest rank sets the pace (its blocks, and the LM head on the last stage).
* **Communication** (``cost.collective_time`` on each link): TP/SP 4 all-reduce equivalents per layer and
  micro-batch (6 with full recompute), ``tp_overlap`` of them hidden (Megatron-LM's ``--tp-comm-overlap``; off
  by default); CP's K,V ring (per TP rank: its own K/V heads) behind the attention of the block in flight;
  EP's dispatch and combine all-to-all over NVLink for the ranks of the node and the network for the rest,
  ``ep_overlap`` hidden, over the MoE layers only; node-limited routing (DeepSeek-V3's: the model's
  ``topk_group`` = M of its ``n_group`` groups, or ``Assumptions.node_limit``) sends a token once per node it
  reaches, at most M x ceil(nodes / n_group) nodes, as a de-duplicating dispatcher does without a limit
  (``Assumptions.ep_dedup``: DeepEP, HybridEP); DP/ZeRO collectives hierarchical (within the node on
  NVLink, then across nodes with 1/k of the bytes per GPU), ZeRO-2's reduce-scatter per micro-batch, ZeRO-3's
  gathers and reduce-scatter per micro-batch with ``zero3_overlap`` hidden (with a pipeline, torchtitan's
  form, ``zero3_with_pipeline``: the gathers per micro-batch, one reduce-scatter per step); the pipeline's sends.
* **Bubble**: ``cost.bubble_ratio`` of the schedule (1F1B (p-1)/m, interleaved (p-1)/(v m), ZB-H1 (p-1)/(3m))
  times the slowest rank's compute and exposed per-micro-batch communication.

MFU counts model FLOPs only (PaLM's definition: no recomputation, the real vocabulary, causal attention);
``Prediction.mfu_full_attention`` counts the attention without the causal halving, as Megatron-LM's throughput
formula (Narayanan et al. 2021) does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from course_lib.estimates import cost
from course_lib.estimates.accounting import ring_kv_bytes_tp
from course_lib.estimates.activation_memory import layer_activation_bytes
from course_lib.estimates.hardware import attention_length_factor
from course_lib.estimates.layout import ParallelLayout
from course_lib.estimates.memory_budget import GiB, MemoryBudget
from course_lib.model_config import GPTConfig, dense_twin
from course_lib.planner.candidate import (
    _COST_NAME,
    SCHEDULES,
    VOCAB_MULTIPLE,
    Candidate,
    Cluster,
    Schedule,
    padded_config,
    padded_vocab,
    refusal,
    zero3_with_pipeline,
)
from course_lib.planner.comm import _all_to_all, group_span, group_time
from course_lib.planner.memory import Formula, Precision, _memory, peak_in_flight, stage_params
from course_lib.planner.moe import (
    active_params,
    layer_matmul_params,
    leading_dense,
    rank_dense_layers,
    route_node_limit,
)


@dataclass(frozen=True)
class Assumptions:
    """What the time and memory model assumes; change them to see how the ranking moves. Every field is checked.

    * ``efficiency``: matrix multiplies run at this fraction of the GPU's dense peak (large GEMMs), less for
      small local GEMMs (``gemm_rows_half``, ``gemm_cols_half``: see ``gemm_efficiency``);
    * ``attention_efficiency``: the fraction of peak the fused attention kernel reaches (FlashAttention-2, Dao
      2023: 50-73 % of an A100's peak forward, less backward and on H100 without FlashAttention-3's
      asynchrony: 0.5), at long sequences; shorter blocks are slower by ``attention_length_factor`` (with
      ``attention_by_length``, the default; False: one speed at every length);
    * ``elementwise_passes``: the memory-bound kernels (norms, activations, residual adds, RoPE, the loss) move
      each tensor a layer saves for backward this many times in the forward (written once, read once: 2) at
      the GPU's memory bandwidth, twice that in the backward; the fp32 logits likewise;
    * ``grad_overlap``: the fraction of the last micro-batch's backward (and the first one's forward) that the
      DP gradient reduce-scatter (and the parameter all-gather) can hide behind;
    * ``zero3_overlap``: the fraction of each micro-batch's forward/backward that ZeRO-3's per-micro-batch
      gathers and reduce-scatter hide behind (PyTorch FSDP prefetches one block ahead);
    * ``tp_overlap``: the fraction of TP/SP traffic hidden behind GEMMs (0: on the critical path; Megatron-LM's
      ``--tp-comm-overlap`` with userbuffers, which its H100 weak-scaling runs use, hides much of it);
    * ``ep_overlap``: the fraction of EP's dispatch/combine all-to-all hidden behind compute (DeepSeek-V3's
      DualPipe overlaps them; a plain MoE layer does not: 0);
    * ``node_limit``: None, the model's own routing (``GPTConfig.topk_group``, see ``route_node_limit``); M,
      node-limited routing at M nodes whatever the model says (each token to at most M nodes, sent once per
      node and forwarded inside it over NVLink, DeepSeek-V3's M = 4);
    * ``ep_dedup``: the dispatcher sends a token once per destination node and forwards it there over NVLink
      (DeepEP's internode kernels, NVIDIA's HybridEP), with or without node-limited routing; False: each of a
      token's top_k copies bound for another node crosses the network;
    * ``dense_layers``: the first k blocks of an MoE model are dense MLPs of ``d_ff`` (DeepSeek-V3's first 3;
      ``GPTConfig`` has no field for them, so the planner carries it). Priced in compute, FLOPs, active
      parameters, the model states and the DP bytes (``ParallelLayout.dense``); their activations are still
      counted as an MoE block's;
    * ``headroom``: the memory budget's own headroom; ``usable_memory``: the fraction of the GPU the job may use;
    * ``attention_memory``: "flash" (no s x s scores, no dropout) or "paper" (Korthikanti et al. 2022, Table 2);
    * ``precision``: the model states' bytes per parameter (``memory.bytes_per_param`` with Adam): "mixed",
      2 + 2 + 12 = 16 (bf16 weights and gradients, fp32 master weights and moments: ZeRO's K = 12,
      Rajbhandari et al. 2020) or "bf16", 2 + 2 + 4 = 8 (the model built in bf16, Adam's moments bf16 like the
      weights: no master copy, as NeMo AutoModel's benchmark recipes train).
    """

    efficiency: float = 0.75
    gemm_rows_half: float = 256.0
    gemm_cols_half: float = 128.0
    attention_efficiency: float = 0.5
    attention_by_length: bool = True
    elementwise_passes: float = 2.0
    grad_overlap: float = 1.0
    zero3_overlap: float = 0.5
    tp_overlap: float = 0.0
    ep_overlap: float = 0.0
    node_limit: int | None = None
    ep_dedup: bool = False
    dense_layers: int = 0
    headroom: float = 0.10
    usable_memory: float = 1.0
    attention_memory: Formula = "flash"
    precision: Precision = "mixed"

    def __post_init__(self) -> None:
        def check(name: str, low: float, high: float, low_open: bool) -> None:
            x = getattr(self, name)
            ok = isinstance(x, (int, float)) and not isinstance(x, bool) and (low < x if low_open else low <= x)
            if not ok or x > high:
                side = "(" if low_open else "["
                raise ValueError(f"Assumptions.{name}={x!r} must be in {side}{low}, {high}]")

        check("efficiency", 0.0, 1.0, True)
        check("attention_efficiency", 0.0, 1.0, True)
        check("elementwise_passes", 0.0, math.inf, False)
        check("usable_memory", 0.0, 1.0, True)
        for name in ("grad_overlap", "zero3_overlap", "tp_overlap", "ep_overlap"):
            check(name, 0.0, 1.0, False)
        for name in ("gemm_rows_half", "gemm_cols_half", "headroom"):
            check(name, 0.0, math.inf, False)
        if self.node_limit is not None and (isinstance(self.node_limit, bool) or not isinstance(self.node_limit, int)
                                            or self.node_limit < 1):
            raise ValueError(f"Assumptions.node_limit={self.node_limit!r} must be None or an int >= 1 (nodes)")
        for name in ("attention_by_length", "ep_dedup"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Assumptions.{name}={getattr(self, name)!r} must be True or False")
        if isinstance(self.dense_layers, bool) or not isinstance(self.dense_layers, int) or self.dense_layers < 0:
            raise ValueError(f"Assumptions.dense_layers={self.dense_layers!r} must be an int >= 0 (leading blocks)")
        if self.attention_memory not in ("flash", "paper"):
            raise ValueError(f"Assumptions.attention_memory={self.attention_memory!r}: 'flash' or 'paper'")
        if self.precision not in ("mixed", "bf16"):
            raise ValueError(f"Assumptions.precision={self.precision!r}: 'mixed' (fp32 master weights and Adam "
                             "moments, 16 bytes per parameter) or 'bf16' (all 16-bit, 8 bytes)")

    def gemm_efficiency(self, rows: float, cols: float) -> float:
        """Fraction of peak a layer's matrix multiplies reach on one GPU: ``efficiency`` for large ones, less
        when the local GEMM is small -- ``rows`` tokens of a micro-batch on this rank (b*s/cp), ``cols`` the
        hidden size on this rank (h/tp): x/(x + x_half) for each, a saturating curve (larger GEMMs have more
        arithmetic intensity and fill the GPU's waves better)."""
        return self.efficiency * rows / (rows + self.gemm_rows_half) * cols / (cols + self.gemm_cols_half)


@dataclass
class Prediction:
    """Predicted memory and step time of one candidate, the time split by where it goes (seconds)."""

    candidate: Candidate
    memory: MemoryBudget
    fits: bool
    usable_bytes: float
    seconds: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    mfu_full_attention: float = 0.0
    reasons: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return sum(self.seconds.values())


# ------------------------------------------------------------------------------------------------ predict


@lru_cache(maxsize=10_000)
def _saved_bytes(cfg: GPTConfig, micro_batch: int, s_local: int, tp: int) -> float:
    """What one layer saves for backward (FlashAttention-era, no dropout): the bytes its memory-bound kernels move."""
    return layer_activation_bytes(cfg, micro_batch, s_local, tp=tp, sp=tp > 1, formula="adapted", dropout=False)


def _params_per_rank(cfg: GPTConfig, lay: ParallelLayout, stage: int) -> dict[str, float]:
    return stage_params(cfg, lay.tp, lay.pp, lay.ep, lay.split, lay.dense, stage)


def predict(cfg: GPTConfig, cl: Cluster, global_batch: int, seq_len: int, cand: Candidate,
            assume: Assumptions | None = None, *, time_if_fits_only: bool = False) -> Prediction:
    """Memory of the worst GPU and the step time of ``cand``, split into compute, each axis's exposed
    communication and the pipeline bubble; tokens/s and MFU (see the module docstring for every formula).
    ``time_if_fits_only``: leave the time out (``seconds`` empty) when the memory does not fit (the search)."""
    assume = assume or Assumptions()
    shape = cand.shape
    if shape.world_size != cl.world_size:
        raise ValueError(f"candidate {cand} uses tp x cp x dp x pp = {shape.world_size} GPUs, but cluster "
                         f"{cl.name!r} has {cl.world_size} ({cl.nodes} nodes x {cl.gpus_per_node}): choose degrees "
                         f"whose product is {cl.world_size}, or cl.with_nodes({shape.world_size // cl.gpus_per_node})"
                         if shape.world_size % cl.gpus_per_node == 0 else
                         f"candidate {cand} uses {shape.world_size} GPUs, but cluster {cl.name!r} has "
                         f"{cl.world_size}: choose degrees whose product is {cl.world_size}")
    m = cand.microbatches(global_batch)
    if m < 1 or global_batch % (cand.dp * cand.micro_batch):
        raise ValueError(f"global batch {global_batch} does not split into dp x micro_batch = {cand.dp} x "
                         f"{cand.micro_batch} x whole micro-batches: choose a batch that is a multiple of "
                         f"{cand.dp * cand.micro_batch}")
    pcfg = padded_config(cfg, cand.tp)
    n_lead = leading_dense(cfg, assume.dense_layers)
    mem = _memory(pcfg, cand, global_batch, seq_len, assume.attention_memory, assume.headroom, assume.precision,
                  n_lead)
    usable = assume.usable_memory * cl.gpu.bytes
    if time_if_fits_only and mem.total > usable:
        return Prediction(cand, mem, False, usable)
    gpn, p, t, c = cl.gpus_per_node, cand.pp, cand.tp, cand.cp
    b, s, h = cand.micro_batch, seq_len, cfg.d_model
    s_local, rows = s // c, b * (s // c)

    # forward of one layer on one micro-batch (this rank's 1/(tp cp) share): GEMMs of the dense part and of the
    # active experts, causal attention at its kernel's efficiency, memory-bound kernels moving the saved tensors
    attn = 2 * h * s  # QK^T and AV, 4 h s multiply-add FLOPs per token, halved by the causal mask
    dense_w, experts_w = layer_matmul_params(cfg)
    rate = cl.gpu.peak_flops * assume.gemm_efficiency(rows, h / t)
    rate_e = rate
    if cfg.n_expert:
        expert_rows = rows * cfg.top_k * cand.ep / cfg.n_expert  # tokens each local expert receives
        rate_e = cl.gpu.peak_flops * assume.gemm_efficiency(expert_rows, h / t)
    tokens_mb = b * s / (t * c)
    attn_rate = assume.attention_efficiency * (attention_length_factor(s, c) if assume.attention_by_length else 1.0)
    attn_mb = tokens_mb * attn / (cl.gpu.peak_flops * attn_rate)

    def layer_time(c: GPTConfig, dense_w: int, experts_w: int) -> float:
        saved = _saved_bytes(c, b, s_local, t)
        return (tokens_mb * 2 * (dense_w / rate + experts_w / rate_e) + attn_mb
                + assume.elementwise_passes * saved / cl.gpu.mem_bandwidth)

    layer_mb = layer_time(pcfg, dense_w, experts_w)
    n_dense = rank_dense_layers(cand, cfg.n_layer, n_lead)
    dense_mb = layer_time(dense_twin(pcfg), *layer_matmul_params(cfg, dense=True)) if any(n_dense) else 0.0

    def fwd_bwd(layer: float) -> float:
        return 3 * layer + {"none": 0.0, "selective": attn_mb, "full": layer}[cand.recompute]

    logits = 4 * rows * pcfg.vocab_size / t  # fp32 logits of this rank's vocabulary slice
    head_mb = tokens_mb * 2 * pcfg.vocab_size * h / rate + assume.elementwise_passes * logits / cl.gpu.mem_bandwidth
    layers = cand.rank_layers(cfg.n_layer)
    moe_fb, dense_fb = fwd_bwd(layer_mb), fwd_bwd(dense_mb)
    per_rank = [(n - d) * moe_fb + d * dense_fb + (3 * head_mb if r == p - 1 else 0.0)
                for r, (n, d) in enumerate(zip(layers, n_dense, strict=True))]
    slow = max(range(p), key=per_rank.__getitem__)
    t_mb = per_rank[slow]
    t_fwd_mb = (layers[slow] - n_dense[slow]) * layer_mb + n_dense[slow] * dense_mb + (head_mb if slow == p - 1
                                                                                         else 0.0)
    t_bwd_mb = t_mb - t_fwd_mb
    compute = m * t_mb
    n_layers, n_moe = layers[slow], layers[slow] - n_dense[slow]

    def ranks(*axes: str) -> tuple[int, int]:
        return group_span(shape, axes, gpn)

    # TP/SP: per layer 2 all-reduce equivalents forward, 2 backward (+2 recomputed), tp_overlap hidden
    tp_s = 0.0
    if t > 1:
        per_mb = (4 + (2 if cand.recompute == "full" else 0)) * n_layers
        tp_s = (1 - assume.tp_overlap) * m * per_mb * group_time(cl, "all_reduce", rows * h * 2, ranks("tp"))

    # CP: cp-1 ring steps of this TP rank's K,V block per layer, forward and twice backward, behind attention
    cp_s = 0.0
    if c > 1:
        kv = ring_kv_bytes_tp(cfg, s, b, t, c, 2)  # the library's own block
        link = cl.inter if ranks("cp")[1] > 1 else cl.intra
        ring = 3 * (c - 1) * (link.alpha + kv / link.beta) * n_layers
        cp_s = m * max(0.0, ring - 3 * attn_mb * n_layers)

    # EP: dispatch + combine, forward and backward, of this rank's tokens (s/(cp tp) with SP) in each MoE layer,
    # ep_overlap hidden
    ep_s = 0.0
    if cand.ep > 1:
        span = ranks("ep")
        one = _all_to_all(cl, span, 2 * h, rows / t, cfg.top_k, route_node_limit(cfg, span[1], assume.node_limit),
                          assume.ep_dedup)
        ep_s = (1 - assume.ep_overlap) * m * 4 * n_moe * one

    # PP: the schedule's bubble over the slowest rank's per-micro-batch work; v sends per micro-batch and direction
    pp_s = bubble = 0.0
    if p > 1:
        bubble = cost.bubble_ratio(_COST_NAME[cand.schedule], p, m, cand.v) * (compute + tp_s + cp_s + ep_s)
        act = rows * h * 2 / t
        link = cl.inter if ranks("pp")[1] > 1 else cl.intra
        pp_s = 2 * m * cand.v * (link.alpha + act / link.beta)

    # DP / ZeRO over dp x cp (experts over dp x cp / ep), hierarchical collectives of bf16 gradients/parameters
    dp_s = 0.0
    if cand.dp * c > 1:
        counts = _params_per_rank(pcfg, cand.layout(global_batch, cfg.n_layer, n_lead), slow)
        dense_b, expert_b = 2 * (counts["embedding"] + counts["blocks"] + counts["head"]), 2 * counts["experts"]
        dense_r = ranks("dp", "cp")
        expert_r = ranks("edp") if cand.ep > 1 else dense_r

        def coll(op: cost.Collective) -> float:
            return group_time(cl, op, dense_b, dense_r) + (group_time(cl, op, expert_b, expert_r) if expert_b
                                                           else 0.0)

        rs, ag = coll("reduce_scatter"), coll("all_gather")
        hide_b, hide_f = assume.grad_overlap * t_bwd_mb, assume.grad_overlap * t_fwd_mb
        if cand.zero_stage == 0:  # one all-reduce (RS + AG) behind the last backward
            dp_s = max(0.0, rs + ag - hide_b)
        elif cand.zero_stage == 1:  # RS behind the last backward, AG of the updated weights behind the next forward
            dp_s = max(0.0, rs - hide_b) + max(0.0, ag - hide_f)
        elif cand.zero_stage == 2:  # sharded gradients cannot accumulate whole: one RS per micro-batch
            dp_s = m * max(0.0, rs - hide_b) + max(0.0, ag - hide_f)
        elif p == 1:  # ZeRO-3: per micro-batch AG before forward, AG before backward and RS after it
            o = assume.zero3_overlap
            dp_s = m * (max(0.0, ag - o * t_fwd_mb) + max(0.0, ag + rs - o * t_bwd_mb))
        else:  # ZeRO-3 with a pipeline (zero3_with_pipeline): the AGs per micro-batch, one RS behind the last
            o = assume.zero3_overlap
            dp_s = m * (max(0.0, ag - o * t_fwd_mb) + max(0.0, ag - o * t_bwd_mb)) + max(0.0, rs - hide_b)

    pred = Prediction(cand, mem, mem.total <= usable, usable)
    pred.seconds = {"compute": compute, "tp": tp_s, "cp": cp_s, "ep": ep_s, "pp_bubble": bubble, "pp_p2p": pp_s,
                    "dp": dp_s}
    tokens = global_batch * s
    pred.tokens_per_s = tokens / pred.step_s
    # model FLOPs (PaLM's count, ``cost.training_flops_per_token``), and less the masked half of attention
    full = cost.training_flops_per_token(active_params(cfg, assume.dense_layers), cfg.n_layer, h, s) * tokens
    peak = cl.world_size * cl.gpu.peak_flops * pred.step_s
    pred.mfu = (full - 3 * cfg.n_layer * attn * tokens) / peak
    pred.mfu_full_attention = full / peak
    pred.reasons = _reasons(pred, cl, ranks("tp"))
    return pred


def _reasons(p: Prediction, cl: Cluster, tp_span: tuple[int, int]) -> list[str]:
    c, sec, step = p.candidate, p.seconds, p.step_s
    out = [f"{p.memory.total / GiB:.1f} GiB of {p.usable_bytes / GiB:.0f} GiB per GPU"
           + ("" if p.fits else " (does not fit)")]
    shares = sorted([(v / step, k) for k, v in sec.items() if k != "compute" and v > 0], reverse=True)
    if shares:
        out.append("largest overhead: " + ", ".join([f"{k} {f:.0%}" for f, k in shares[:2]]) + " of the step")
    else:
        out.append("no exposed communication or bubble")
    if c.tp > 1:
        out.append(f"TP over {'NVLink inside a node' if tp_span[1] == 1 else 'the network'}")
    return out


__all__ = [
    "SCHEDULES",
    "VOCAB_MULTIPLE",
    "Assumptions",
    "Candidate",
    "Cluster",
    "Formula",
    "Prediction",
    "Schedule",
    "active_params",
    "dense_twin",
    "layer_matmul_params",
    "leading_dense",
    "padded_config",
    "padded_vocab",
    "peak_in_flight",
    "predict",
    "rank_dense_layers",
    "refusal",
    "route_node_limit",
    "zero3_with_pipeline",
]
