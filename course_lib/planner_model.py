"""The planner's model of one candidate: its memory (worst GPU) and its step time, split by where it goes.

* **Memory**: ``memory.training_memory`` of the candidate's layout, for the stages that can be worst (the first
  two and the last two: under ``pp_layers.ends_split`` the middle stages hold the same blocks and fewer
  micro-batches in flight), their activations scaled to the schedule's own peak in flight
  (``peak_in_flight``, as ``schedules.peak_in_flight`` counts them: interleaved 1F1B holds 1 + (p-1)/(p v)
  times 1F1B's on rank 0, as Korthikanti et al. 2022 state; ZB-H1 holds p on every rank until its W).
  FlashAttention-era activations (no s x s score matrix, no dropout masks: ``activation_formula="adapted"``)
  are the default; ``Assumptions(attention_memory="paper")`` uses Korthikanti et al.'s Table 2 (its 5as/h term,
  dropout).
* **Compute**: 2 FLOPs per multiply-add of the active parameters at ``Assumptions.gemm_efficiency`` of the peak
  (expert GEMMs at the efficiency of the rows each expert receives). An MoE layer's active matmul weights are
  attention + router h E + the shared experts' MLP of n_s f_e + top_k routed MLPs of f_e (``expert_d_ff``,
  DeepSeekMoE's fine-grained experts); the first ``Assumptions.dense_layers`` blocks are dense MLPs of d_ff
  (DeepSeek-V3's first 3); attention 4 h s per token and layer
  forward, halved for the causal mask (a FlashAttention kernel skips the masked blocks), at
  ``attention_efficiency``; memory-bound kernels moving the saved activations ``elementwise_passes`` times at
  the memory bandwidth. Backward twice the forward, plus the recomputed forward (selective: the core attention;
  full: the whole layer). The slowest rank sets the pace (its blocks, and the LM head on the last stage).
* **Communication** (``cost.collective_time`` on each link): TP/SP 4 all-reduce equivalents per layer and
  micro-batch (6 with full recompute), ``tp_overlap`` of them hidden (Megatron-LM's ``--tp-comm-overlap``; off
  by default); CP's K,V ring (per TP rank: its own K/V heads) behind the attention of the block in flight;
  EP's dispatch and combine all-to-all over NVLink for the ranks of the node and the network for the rest,
  ``ep_overlap`` hidden, over the MoE layers only; node-limited routing (DeepSeek-V3's: the model's
  ``topk_group`` = M of its ``n_group`` groups, or ``Assumptions.node_limit``) sends a token once per node it
  reaches, at most M x ceil(nodes / n_group) nodes; DP/ZeRO collectives hierarchical (within the node on
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
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Literal

from course_lib import cost
from course_lib.hardware import GPU, Link
from course_lib.memory import (
    GiB,
    MemoryBudget,
    ParallelLayout,
    Recompute,
    layer_activation_bytes,
    params_per_rank,
    training_memory,
)
from course_lib.mesh import DEFAULT_ORDER, MeshShape
from course_lib.model import GPTConfig, attention_params, mlp_params, shared_expert_params
from course_lib.parallel.config import ZERO_WITH_PIPELINE
from course_lib.pp_layers import ends_split

Schedule = Literal["1f1b", "interleaved", "zb_h1"]
SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "zb_h1")
_COST_NAME = {"1f1b": "one_f_one_b", "interleaved": "interleaved_one_f_one_b", "zb_h1": "zb_h1"}

VOCAB_MULTIPLE = 128
"""Megatron-LM's ``--make-vocab-size-divisible-by`` default: the vocabulary is padded to a multiple of 128 x tp."""


@lru_cache(maxsize=1_000)
def padded_config(cfg: GPTConfig, tp: int) -> GPTConfig:
    """``cfg`` with its vocabulary padded for ``tp`` (``padded_vocab``): the model each TP degree trains."""
    return replace(cfg, vocab_size=padded_vocab(cfg.vocab_size, tp))


def padded_vocab(vocab_size: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The vocabulary Megatron-LM trains: ``vocab_size`` rounded up to a multiple of ``multiple`` x ``tp``
    (50257 at tp 8 -> 51200), so that every TP rank holds an equal, aligned slice of the embedding and head."""
    step = multiple * tp
    return -(-vocab_size // step) * step


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs; ``intra`` links GPUs of one node, ``inter`` is each GPU's share of the
    network between nodes (a DGX H100 has one 400 Gb/s NIC per GPU); ``source`` says where the node's shape
    comes from (each link's own numbers have theirs in ``hardware.LINKS``)."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu: GPU
    intra: Link
    inter: Link
    source: str = ""

    def __post_init__(self) -> None:
        for what in ("nodes", "gpus_per_node"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster {self.name!r}: {what} must be an int >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        return replace(self, nodes=nodes)


@dataclass(frozen=True)
class Candidate:
    """One way to run the job. ``sp`` (sequence parallelism) is on whenever tp > 1, as Megatron recommends;
    ``schedule`` "1f1b", "interleaved" (``v`` model chunks per rank) or "zb_h1"; the blocks per (virtual) stage
    are ``pp_layers.ends_split`` (equal when they divide)."""

    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    zero: int = 1
    micro_batch: int = 1
    recompute: Recompute = "selective"
    schedule: Schedule = "1f1b"
    v: int = 1

    @cached_property
    def shape(self) -> MeshShape:
        return MeshShape(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)

    @property
    def schedule_label(self) -> str:
        return f"interleaved v={self.v}" if self.schedule == "interleaved" else self.schedule

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches each pipeline runs per step: global batch / (dp x micro-batch)."""
        return global_batch // (self.dp * self.micro_batch)

    def split(self, n_layer: int) -> list[int]:
        """Blocks per virtual stage (pp x v of them), ``pp_layers.ends_split``: what ``apply_pp(split=...)`` cuts."""
        return ends_split(n_layer, self.pp * self.v)

    def rank_layers(self, n_layer: int) -> list[int]:
        """Blocks each pipeline rank holds: its v chunks r, r + p, ... (Megatron-LM's interleaving)."""
        return list(_rank_layers(self.pp, self.v, n_layer))

    def layout(self, global_batch: int, n_layer: int) -> ParallelLayout:
        return _layout(self, global_batch, n_layer)

    def _layout(self, global_batch: int, n_layer: int) -> ParallelLayout:
        layers = self.rank_layers(n_layer)
        return ParallelLayout(dp=self.dp, zero=self.zero, tp=self.tp, sp=self.tp > 1, pp=self.pp,
                              microbatches=self.microbatches(global_batch), cp=self.cp, ep=self.ep,
                              split=None if len(set(layers)) == 1 else tuple(layers))

    def __str__(self) -> str:
        extra = "".join(f" {k}={getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) > 1)
        sched = f" {self.schedule_label}" if self.pp > 1 else ""
        return (f"dp={self.dp} tp={self.tp} pp={self.pp}{extra} zero={self.zero} mb={self.micro_batch} "
                f"recompute={self.recompute}{sched}")


@lru_cache(maxsize=10_000)
def _rank_layers(pp: int, v: int, n_layer: int) -> tuple[int, ...]:
    split = ends_split(n_layer, pp * v)
    return tuple(sum(split[r::pp]) for r in range(pp))


@lru_cache(maxsize=100_000)
def _layout(cand: Candidate, global_batch: int, n_layer: int) -> ParallelLayout:
    return cand._layout(global_batch, n_layer)


def refusal(cfg: GPTConfig, cand: Candidate, m: int) -> str:
    """Why the search leaves ``cand`` out ("" when it does not): combinations the libraries refuse or the
    schedule cannot run. ZeRO-2 with a pipeline: the course library's own rule and message
    (``parallel.config.ZERO_WITH_PIPELINE``, DeepSpeed's: its pipeline engine runs ZeRO-1 only, sharded
    gradients would be reduce-scattered for every micro-batch of every stage). ZeRO-3 with a pipeline is
    planned in torchtitan's form (``zero3_with_pipeline``); the library's composition refuses it, so
    ``library_rules`` does too. Interleaved 1F1B needs m a multiple of p (``schedules.interleaved_one_f_one_b``);
    ZB-H1's bubble formula holds for m >= p."""
    if cand.pp > 1 and cand.zero == 2:
        return ZERO_WITH_PIPELINE.format(stage=cand.zero, extra="")
    if cand.schedule == "interleaved" and (cand.pp == 1 or m % cand.pp or cfg.n_layer < cand.pp * cand.v):
        return f"interleaved v={cand.v} needs pp > 1, m={m} a multiple of pp={cand.pp} and pp x v <= n_layer"
    if cand.schedule == "zb_h1" and m < cand.pp:
        return f"ZB-H1 needs m >= pp (m={m}, pp={cand.pp})"
    return ""


Formula = Literal["flash", "paper"]


@dataclass(frozen=True)
class Assumptions:
    """What the time and memory model assumes; change them to see how the ranking moves. Every field is checked.

    * ``efficiency``: matrix multiplies run at this fraction of the GPU's dense peak (large GEMMs), less for
      small local GEMMs (``gemm_rows_half``, ``gemm_cols_half``: see ``gemm_efficiency``);
    * ``attention_efficiency``: the fraction of peak the fused attention kernel reaches (FlashAttention-2, Dao
      2023: 50-73 % of an A100's peak forward, less backward and on H100 without FlashAttention-3's
      asynchrony: 0.5);
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
    * ``dense_layers``: the first k blocks of an MoE model are dense MLPs of ``d_ff`` (DeepSeek-V3's first 3;
      ``GPTConfig`` has no field for them, so the planner carries it). Priced in compute, FLOPs and active
      parameters; the memory and DP bytes still count those blocks as MoE blocks (see ``predict``);
    * ``headroom``: the memory budget's own headroom; ``usable_memory``: the fraction of the GPU the job may use;
    * ``attention_memory``: "flash" (no s x s scores, no dropout) or "paper" (Korthikanti et al. 2022, Table 2).
    """

    efficiency: float = 0.75
    gemm_rows_half: float = 256.0
    gemm_cols_half: float = 128.0
    attention_efficiency: float = 0.5
    elementwise_passes: float = 2.0
    grad_overlap: float = 1.0
    zero3_overlap: float = 0.5
    tp_overlap: float = 0.0
    ep_overlap: float = 0.0
    node_limit: int | None = None
    dense_layers: int = 0
    headroom: float = 0.10
    usable_memory: float = 1.0
    attention_memory: Formula = "flash"

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
        if isinstance(self.dense_layers, bool) or not isinstance(self.dense_layers, int) or self.dense_layers < 0:
            raise ValueError(f"Assumptions.dense_layers={self.dense_layers!r} must be an int >= 0 (leading blocks)")
        if self.attention_memory not in ("flash", "paper"):
            raise ValueError(f"Assumptions.attention_memory={self.attention_memory!r}: 'flash' or 'paper'")

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


# ------------------------------------------------------------------------------------------------ memory


def peak_in_flight(schedule: str, p: int, m: int, v: int = 1) -> list[int]:
    """Per rank r, the most (chunk, micro-batch) activations held at once, in closed form: 1F1B min(p - r, m);
    interleaved min(2(p-1-r) + (v-1)p + 1, m v) (its warm-up forwards and the one in steady state); ZB-H1
    min(p, m) on every rank (a micro-batch is held until its W). ``schedules.peak_in_flight`` of the library's
    schedules gives the same numbers (tests/test_planner.py checks it)."""
    if schedule == "interleaved":
        return [min(2 * (p - 1 - r) + (v - 1) * p + 1, m * v) for r in range(p)]
    if schedule == "zb_h1":
        return [min(p, m)] * p
    return [min(p - r, m) for r in range(p)]


@lru_cache(maxsize=10_000)
def _in_flight_factor(schedule: str, p: int, m: int, v: int) -> list[float]:
    """Per rank: the schedule's peak activations in flight over 1F1B's min(p - r, m) (whole-stage units)."""
    return [peak / v / min(p - r, m) for r, peak in enumerate(peak_in_flight(schedule, p, m, v))]


STATE_PARTS = ("parameters", "gradients", "optimizer_state", "communication")
"""The parts of a stage's budget that recomputation does not change (the others: activations, temporary)."""


@lru_cache(maxsize=100_000)
def _budget(cfg: GPTConfig, lay: ParallelLayout, stage: int, micro_batch: int, seq_len: int, recompute: Recompute,
            formula: Formula) -> MemoryBudget:
    return training_memory(cfg, stage=stage, micro_batch=micro_batch, seq_len=seq_len, recompute=recompute,
                           layout=lay, headroom=0.0, activation_formula="adapted" if formula == "flash" else "paper",
                           dropout=formula == "paper")


def zero3_with_pipeline(zero: int, pp: int) -> bool:
    """ZeRO-3 composed with a pipeline as torchtitan composes FSDP2 with ``torch.distributed.pipelining``: the
    parameters (and the optimizer state) stay sharded and are all-gathered for every micro-batch's forward and
    backward, but each stage accumulates its gradients unsharded across its micro-batches and reduce-scatters
    them once, after the last one (so it holds its full gradients, as under ZeRO-1)."""
    return zero == 3 and pp > 1


@lru_cache(maxsize=10_000)
def _budget_layouts(lay: ParallelLayout) -> tuple[ParallelLayout, ParallelLayout, ParallelLayout]:
    """The keys of ``_stage_memory``'s calls: ``lay`` with m capped at pp; that with dp = ep = 1, ZeRO-0 (the
    activations); the layout whose gradients the stage holds (ZeRO-1's, unsharded, under
    ``zero3_with_pipeline``; else the first)."""
    states = replace(lay, microbatches=min(lay.m, lay.pp) if lay.pp > 1 else 1)
    grads = replace(states, zero=1) if zero3_with_pipeline(lay.zero, lay.pp) else states
    return states, replace(states, dp=1, ep=1, zero=0), grads


def worst_stages(pp: int) -> list[int]:
    """The stages that can be worst: the first two and the last two (under ``pp_layers.ends_split`` the middle
    stages hold the same blocks as the second and fewer micro-batches in flight)."""
    return sorted({0, min(1, pp - 1), max(pp - 2, 0), pp - 1})


@lru_cache(maxsize=100_000)
def _stage_memory(cfg: GPTConfig, lay: ParallelLayout, micro_batch: int, seq_len: int, recompute: Recompute,
                  formula: Formula) -> tuple[tuple[int, dict[str, float]], ...]:
    """``training_memory`` of each of the ``worst_stages`` without headroom, by part, from two cached calls per
    stage: the model states and buffers (``STATE_PARTS``: they do not depend on recomputation, so one call
    serves the three) and the activations and temporaries (they depend on neither dp, ep nor ZeRO, so one call
    with dp = ep = 1, ZeRO-0 serves every data-parallel split). A stage's budget sees m only through its
    micro-batches in flight, min(pp - stage, m) (1 when pp = 1), so m is capped at pp in both keys."""
    states_key, acts_key, grads_key = _budget_layouts(lay)
    out = []
    for stage in worst_stages(lay.pp):
        states = _budget(cfg, states_key, stage, micro_batch, seq_len, "none", formula)
        acts = _budget(cfg, acts_key, stage, micro_batch, seq_len, recompute, formula)
        grads = _budget(cfg, grads_key, stage, micro_batch, seq_len, "none", formula)
        out.append((stage, {k: (grads if k == "gradients" else states if k in STATE_PARTS else acts)[k]
                            for k in states}))
    return tuple(out)


@lru_cache(maxsize=100_000)
def _memory(cfg: GPTConfig, cand: Candidate, global_batch: int, seq_len: int, formula: Formula,
            headroom: float) -> MemoryBudget:
    lay = cand.layout(global_batch, cfg.n_layer)
    factors = _in_flight_factor(cand.schedule, cand.pp, lay.m, cand.v) if cand.pp > 1 else (1.0,)
    worst, worst_total = None, 0.0
    for stage, budget in _stage_memory(cfg, lay, cand.micro_batch, seq_len, cand.recompute, formula):
        parts = dict(budget)
        parts["activations"] *= factors[stage]
        parts["headroom"] = headroom * sum(parts.values())
        total = sum(parts.values())
        if worst is None or total > worst_total:
            worst, worst_total = (stage, parts), total
    stage, parts = worst
    return MemoryBudget(parts, label=f"{cfg.name} | {cand} | per GPU",
                        notes=[f"activations: {formula}", f"worst pipeline stage: {stage} of {cand.pp}"])


# ------------------------------------------------------------------------------------------------ communication


def _time(link: Link, op: cost.Collective, nbytes: float, n: int) -> float:
    """A collective of ``nbytes`` over ``n`` ranks on ``link``: the alpha-beta ring time of ``cost.collective_time``."""
    return cost.collective_time(op, nbytes, n, link.alpha, link.beta)


@lru_cache(maxsize=10_000)
def group_span(shape: MeshShape, axes: tuple[str, ...], gpus_per_node: int) -> tuple[int, int]:
    """(ranks, nodes) of rank 0's group along ``axes``: how many GPUs talk, on how many nodes."""
    ranks = _group_of_rank0(shape, axes)
    return len(ranks), len({r // gpus_per_node for r in ranks})


def _group_of_rank0(shape: MeshShape, axes: tuple[str, ...]) -> list[int]:
    """``shape.group_ranks(0, *axes)``, by arithmetic for Megatron's order (tp-cp-ep-dp-pp: dense strides 1, tp,
    tp cp, tp cp dp; the expert reading numbers the dp x cp ranks i = ep + EP edp, at rank tp i)."""
    if shape.order != DEFAULT_ORDER:
        return shape.group_ranks(0, *axes)
    if axes == ("ep",):
        return [shape.tp * i for i in range(shape.ep)]
    if axes == ("edp",):
        return [shape.tp * shape.ep * k for k in range(shape.dp * shape.cp // shape.ep)]
    strides = {"tp": 1, "cp": shape.tp, "dp": shape.tp * shape.cp, "pp": shape.tp * shape.cp * shape.dp}
    ranks = [0]
    for a in axes:
        ranks = [r + i * strides[a] for r in ranks for i in range(getattr(shape, a))]
    return sorted(ranks)


def group_time(cl: Cluster, op: cost.Collective, nbytes: float, span: tuple[int, int]) -> float:
    """``op`` over the group ``ranks``, hierarchical as NCCL's multi-rail rings and trees behave: within each node
    (k ranks of the group there) on ``cl.intra``, then across the N nodes with V/k bytes per GPU on ``cl.inter``
    (every GPU its own NIC); one node: a ring on ``cl.intra``. all_reduce = reduce_scatter + all_gather."""
    n, nodes = span
    if n == 1:
        return 0.0
    if op == "all_reduce":
        return 2 * group_time(cl, "reduce_scatter", nbytes, span)
    if nodes == 1:
        return _time(cl.intra, op, nbytes, n)
    k = n // nodes
    return (_time(cl.intra, op, nbytes, k) if k > 1 else 0.0) + _time(cl.inter, op, nbytes / k, nodes)


def _all_to_all(cl: Cluster, span: tuple[int, int], token_bytes: float, tokens: float, top_k: int,
                node_limit: int | None) -> float:
    """One dispatch (or combine) of ``tokens`` tokens per rank to ``top_k`` experts each, spread evenly over the
    group: the share for ranks of this node over NVLink, the rest over the network, both at once (the slower
    sets the time). Node-limited routing sends a token once per destination node: E[distinct other nodes] of
    top_k uniform picks over N nodes, N (1 - (1 - 1/N)^k) (N - 1)/N, capped at M."""
    n, nodes = span
    k = n // nodes
    intra = tokens * top_k * (k - 1) / n * token_bytes
    if node_limit is None:
        inter = tokens * top_k * (n - k) / n * token_bytes
    else:
        distinct = nodes * (1 - (1 - 1 / nodes) ** top_k) * (nodes - 1) / nodes
        inter = tokens * min(distinct, node_limit) * token_bytes
    t_intra = (k - 1) * cl.intra.alpha + intra / cl.intra.beta if k > 1 else 0.0
    t_inter = (nodes - 1) * cl.inter.alpha + inter / cl.inter.beta if nodes > 1 else 0.0
    return max(t_intra, t_inter)


# ------------------------------------------------------------------------------------------------ the MoE model


@lru_cache(maxsize=1_000)
def layer_matmul_params(cfg: GPTConfig, dense: bool = False) -> tuple[int, int]:
    """(dense part, active routed experts): the matmul weights one token meets in one block. Dense block:
    attention + the MLP of d_ff, no experts. MoE block (DeepSeekMoE, Dai et al. 2024): attention + the router
    h x E + the shared experts' MLP of n_s f_e, and top_k routed MLPs of f_e = ``expert_d_ff``."""
    if not cfg.n_expert or dense:
        return attention_params(cfg) + mlp_params(cfg), 0
    return (attention_params(cfg) + cfg.d_model * cfg.n_expert + shared_expert_params(cfg),
            cfg.top_k * mlp_params(cfg, cfg.expert_ffn_dim))


def leading_dense(cfg: GPTConfig, dense_layers: int) -> int:
    """How many of the first blocks are dense: ``dense_layers`` of an MoE model (at most n_layer), 0 otherwise."""
    return min(dense_layers, cfg.n_layer) if cfg.n_expert else 0


@lru_cache(maxsize=1_000)
def active_params(cfg: GPTConfig, dense_layers: int = 0) -> int:
    """Matmul weights a token uses: every block's ``layer_matmul_params`` (the first ``dense_layers`` dense) plus
    the LM head v x h (the real vocabulary): 6 x this per token is the model-FLOPs count of MFU (PaLM)."""
    d = leading_dense(cfg, dense_layers)
    return (d * sum(layer_matmul_params(cfg, dense=True)) + (cfg.n_layer - d) * sum(layer_matmul_params(cfg))
            + cfg.vocab_size * cfg.d_model)


@lru_cache(maxsize=1_000)
def dense_twin(cfg: GPTConfig) -> GPTConfig:
    """The same model with dense MLPs of d_ff (what a leading dense block of an MoE model is)."""
    return replace(cfg, n_expert=0, n_shared_expert=0, expert_d_ff=None, n_group=1, topk_group=None,
                   capacity_factor=None)


def rank_dense_layers(cand: Candidate, n_layer: int, dense_layers: int) -> list[int]:
    """Per pipeline rank, how many of the first ``dense_layers`` blocks it holds (its chunks r, r + p, ...)."""
    return list(_rank_dense_layers(cand.pp, cand.v, n_layer, dense_layers))


@lru_cache(maxsize=10_000)
def _rank_dense_layers(pp: int, v: int, n_layer: int, dense_layers: int) -> tuple[int, ...]:
    out, start = [0] * pp, 0
    for j, n in enumerate(ends_split(n_layer, pp * v)):
        out[j % pp] += max(0, min(start + n, dense_layers) - start)
        start += n
    return tuple(out)


def route_node_limit(cfg: GPTConfig, nodes: int, override: int | None = None) -> int | None:
    """The most nodes one token's experts lie on (None: no limit). ``override`` (``Assumptions.node_limit``)
    wins; else the model's node-limited routing: ``topk_group`` = M of ``n_group`` contiguous groups, each group
    on ceil(nodes / n_group) of the EP group's nodes (the experts are laid out in rank order), so M x that."""
    if override is not None:
        return override
    if not cfg.n_expert or cfg.topk_group is None or cfg.topk_group == cfg.n_group:
        return None
    return min(nodes, cfg.topk_group * -(-nodes // cfg.n_group))


# ------------------------------------------------------------------------------------------------ predict


@lru_cache(maxsize=10_000)
def _saved_bytes(cfg: GPTConfig, micro_batch: int, s_local: int, tp: int) -> float:
    """What one layer saves for backward (FlashAttention-era, no dropout): the bytes its memory-bound kernels move."""
    return layer_activation_bytes(cfg, micro_batch, s_local, tp=tp, sp=tp > 1, formula="adapted", dropout=False)


@lru_cache(maxsize=100_000)
def _params_per_rank(cfg: GPTConfig, lay: ParallelLayout, stage: int) -> dict[str, float]:
    return params_per_rank(cfg, lay, stage)


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
    mem = _memory(pcfg, cand, global_batch, seq_len, assume.attention_memory, assume.headroom)
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
    attn_mb = tokens_mb * attn / (cl.gpu.peak_flops * assume.attention_efficiency)

    def layer_time(c: GPTConfig, dense_w: int, experts_w: int) -> float:
        saved = _saved_bytes(c, b, s_local, t)
        return (tokens_mb * 2 * (dense_w / rate + experts_w / rate_e) + attn_mb
                + assume.elementwise_passes * saved / cl.gpu.mem_bandwidth)

    layer_mb = layer_time(pcfg, dense_w, experts_w)
    n_dense = rank_dense_layers(cand, cfg.n_layer, leading_dense(cfg, assume.dense_layers))
    dense_mb = layer_time(dense_twin(pcfg), *layer_matmul_params(cfg, dense=True)) if any(n_dense) else 0.0

    def fwd_bwd(layer: float) -> float:
        return 3 * layer + {"none": 0.0, "selective": attn_mb, "full": layer}[cand.recompute]

    logits = 4 * rows * pcfg.vocab_size / t  # fp32 logits of this rank's vocabulary slice
    head_mb = tokens_mb * 2 * pcfg.vocab_size * h / rate + assume.elementwise_passes * logits / cl.gpu.mem_bandwidth
    layers = cand.rank_layers(cfg.n_layer)
    per_rank = [(n - d) * fwd_bwd(layer_mb) + d * fwd_bwd(dense_mb) + (3 * head_mb if r == p - 1 else 0.0)
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
        kv = 2 * rows * math.ceil(cfg.kv_heads / t) * cfg.head_dim * 2
        link = cl.inter if ranks("cp")[1] > 1 else cl.intra
        ring = 3 * (c - 1) * (link.alpha + kv / link.beta) * n_layers
        cp_s = m * max(0.0, ring - 3 * attn_mb * n_layers)

    # EP: dispatch + combine, forward and backward, of this rank's tokens (s/(cp tp) with SP) in each MoE layer,
    # ep_overlap hidden
    ep_s = 0.0
    if cand.ep > 1:
        span = ranks("ep")
        one = _all_to_all(cl, span, 2 * h, rows / t, cfg.top_k, route_node_limit(cfg, span[1], assume.node_limit))
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
        counts = _params_per_rank(pcfg, cand.layout(global_batch, cfg.n_layer), slow)
        dense_b, expert_b = 2 * (counts["embedding"] + counts["blocks"] + counts["head"]), 2 * counts["experts"]
        dense_r = ranks("dp", "cp")
        expert_r = ranks("edp") if cand.ep > 1 else dense_r

        def coll(op: cost.Collective) -> float:
            return group_time(cl, op, dense_b, dense_r) + (group_time(cl, op, expert_b, expert_r) if expert_b
                                                           else 0.0)

        rs, ag = coll("reduce_scatter"), coll("all_gather")
        hide_b, hide_f = assume.grad_overlap * t_bwd_mb, assume.grad_overlap * t_fwd_mb
        if cand.zero == 0:  # one all-reduce (RS + AG) behind the last backward
            dp_s = max(0.0, rs + ag - hide_b)
        elif cand.zero == 1:  # RS behind the last backward, AG of the updated weights behind the next forward
            dp_s = max(0.0, rs - hide_b) + max(0.0, ag - hide_f)
        elif cand.zero == 2:  # sharded gradients cannot accumulate whole: one RS per micro-batch
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
    flops = 3 * (2 * active_params(cfg, assume.dense_layers) + cfg.n_layer * attn) * tokens
    peak = cl.world_size * cl.gpu.peak_flops * pred.step_s
    pred.mfu = flops / peak
    pred.mfu_full_attention = (flops + 3 * cfg.n_layer * attn * tokens) / peak
    pred.reasons = _reasons(pred, cl, ranks("tp"))
    return pred


def _reasons(p: Prediction, cl: Cluster, tp_span: tuple[int, int]) -> list[str]:
    c, sec, step = p.candidate, p.seconds, p.step_s
    out = [f"{p.memory.total / GiB:.1f} GiB of {p.usable_bytes / GiB:.0f} GiB per GPU"
           + ("" if p.fits else " (does not fit)")]
    shares = sorted(((v / step, k) for k, v in sec.items() if k != "compute" and v > 0), reverse=True)
    if shares:
        out.append("largest overhead: " + ", ".join(f"{k} {f:.0%}" for f, k in shares[:2]) + " of the step")
    else:
        out.append("no exposed communication or bubble")
    if c.tp > 1:
        out.append(f"TP over {'NVLink inside a node' if tp_span[1] == 1 else 'the network'}")
    return out
