"""What each axis sends and stores, on paper: the formulas the measured runs are checked against.

* data parallelism: B = b m N rows a step; a ring all-reduce of V gradient bytes sends 2 (N-1)/N V a rank;
* ZeRO (Rajbhandari et al. 2020): 2 (N-1)/N V a step for stages 0-2, 3 (N-1)/N V for stage 3, exact for this
  implementation's padded units (``comm_bytes_per_step``);
* tensor parallelism (Megatron-LM; Korthikanti et al. 2022 for SP): every collective of one step
  (``step_collectives``: per block 2 all-reduces of b s h forward and 2 backward, or SP's all-gathers and
  reduce-scatters of the same bytes, plus its backward re-gathers) and the activations a rank keeps;
* context parallelism: each of cp - 1 ring steps sends 2 (s/cp) b n_kv d_head bytes of K,V; activations fall
  as 1/cp;
* expert parallelism: dispatch and combine each carry T k h bytes a layer forward; what a rank keeps.

Measured bytes come from ``comm``'s log; these functions are what a chapter prints next to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from course_lib import comm
from course_lib.estimates.activation_memory import layer_activation_bytes, model_activation_bytes
from course_lib.model_config import GPTConfig, param_count
from course_lib.parallel.zero import check_stage


@dataclass(frozen=True)
class PlannedCollective:
    """One collective a TP step issues: ``op``, its ``tensor_bytes`` (``comm``'s V: the all-reduced tensor, the
    gathered output, the reduce-scatter input), the ``phase`` and the layer that issues it; ``regather``: SP's
    backward all-gather of a region's saved s/t input (what DTensor's ``SequenceParallel``, which keeps the
    gathered input instead, does not issue)."""

    op: str
    tensor_bytes: int
    phase: Literal["forward", "backward", "sync"]
    where: str
    regather: bool = False


def step_collectives(cfg: GPTConfig, batch: int, t: int, sequence_parallel: bool = False,
                     element_bytes: int = 4) -> list[PlannedCollective]:
    """Every collective of one training step of the GPT under ``tp.apply_tp`` with ``gpt_plan``, in call order.

    With V = batch * seq_len * d_model * element_bytes:

    * forward: the embedding's g (all-reduce V; SP: reduce-scatter V); per block attention and MLP each an
      all-reduce of V (SP: all-gather V in, reduce-scatter V out); the LM head's f (nothing; SP: all-gather V);
      the loss's 3 all-reduces of batch * seq_len fp32 scalars (max, target logit, sum of exponentials);
    * backward, in reverse: LM head all-reduce V (SP: the re-gather of its input, all-gather V, then the
      reduce-scatter of its input gradient), per block MLP then attention: an all-reduce of V each (SP: the
      all-gather of the output gradient, the re-gather of the input, the reduce-scatter of the input
      gradient), the embedding nothing (SP: all-gather V);
    * sync: one all-reduce of every partial gradient (under SP the norms, learned positions and row biases;
      replicated GQA K/V when t does not divide n_kv_head), when there is any.
    """
    n_tok = batch * cfg.seq_len
    v = n_tok * cfg.d_model * element_bytes
    sp = sequence_parallel
    enter, leave = ("all_gather", "reduce_scatter") if sp else (None, "all_reduce")
    enter_back = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
    leave_back = "all_gather" if sp else None
    out: list[PlannedCollective] = []

    def add(op: str | None, nbytes: int, phase: Literal["forward", "backward", "sync"], where: str,
            regather: bool = False) -> None:
        if op is not None and t > 1:
            out.append(PlannedCollective(op, nbytes, phase, where, regather))

    add(leave, v, "forward", "tok_emb")
    for i in range(cfg.n_layer):
        for part in ("attn", "mlp"):
            add(enter, v, "forward", f"blocks.{i}.{part}")
            add(leave, v, "forward", f"blocks.{i}.{part}")
    add(enter, v, "forward", "lm_head")
    for _ in range(3):
        add("all_reduce", n_tok * 4, "forward", "loss")
    for op in enter_back:  # under SP (all-gather = the re-gather of the saved shard, reduce-scatter)
        add(op, v, "backward", "lm_head", regather=op == "all_gather")
    for i in reversed(range(cfg.n_layer)):
        for part in ("mlp", "attn"):
            add(leave_back, v, "backward", f"blocks.{i}.{part}")
            for op in enter_back:
                add(op, v, "backward", f"blocks.{i}.{part}", regather=op == "all_gather")
    add(leave_back, v, "backward", "tok_emb")
    h, hkv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    partial = 0
    if sp:
        norm = 2 * h if cfg.norm == "layernorm" else h
        partial += (2 * cfg.n_layer + 1) * norm + (cfg.seq_len * h if cfg.pos == "learned" else 0)
        partial += 2 * cfg.n_layer * h if cfg.bias else 0  # o_proj and fc2 biases
    if cfg.kv_heads % t:
        partial += cfg.n_layer * 2 * (h * hkv + (hkv if cfg.bias else 0))
    if partial:
        add("all_reduce", partial * element_bytes, "sync", "partial gradients")
    return out


def block_bytes_per_rank(batch: int, seq_len: int, d_model: int, t: int, element_bytes: int = 2,
                         sequence_parallel: bool = False) -> float:
    """Bytes one rank sends per transformer block and training step, V = b*s*h*e: TP 4 ring all-reduces
    2(t-1)/t V; TP + SP 4 all-gathers + 4 reduce-scatters (t-1)/t V (the same) plus the 2 backward re-gathers of
    the regions' s/t inputs, (t-1)/t V each: 10 (t-1)/t V in all."""
    n_half = 10 if sequence_parallel else 8
    return n_half * (t - 1) / t * batch * seq_len * d_model * element_bytes


def layer_activation_bytes_tp(cfg: GPTConfig, micro_batch: int, t: int, sequence_parallel: bool = False,
                              element_bytes: int = 4) -> float:
    """Activation bytes one transformer block of *this* implementation saves for backward, per rank:
    ``course_lib.estimates.activation_memory.layer_activation_bytes(formula="adapted", tp=t, sp=...)`` (what the
    course's eager block saves, Korthikanti et al.'s accounting with the /t parts split). Under SP the column-parallel
    linears keep only the s/t input shard (``tp_comm.sequence_parallel_linears``), so for MHA without RoPE a TP + SP
    block holds exactly 1/t of one unsplit block, the paper's (sbh/t)(34 + 5as/h) adapted. Checked against
    ``MemoryTracker`` in tests/test_tp.py."""

    return layer_activation_bytes(cfg, micro_batch, cfg.seq_len, tp=t, sp=sequence_parallel, formula="adapted",
                                  element_bytes=element_bytes)


def comm_bytes_per_step(padded_numels: Sequence[int], world_size: int, stage: int,
                        reshard_after_forward: bool | None = None, element_size: int = 4,
                        rank: int = 0) -> dict[str, int]:
    """Bytes rank ``rank`` sends per training step in this implementation, by collective (ring algorithm).

    ``padded_numels``: the units' flat sizes in ``ZeroDataParallel.units`` order (the root last): multiples of
    N in stages 1-3, so every ring chunk is equal and each all-gather or reduce-scatter of V bytes sends exactly
    (N-1)/N V; stage 0 does not pad (the all-reduce's chunks may differ by one element: ``comm.ring_bytes``).
    Stage 3 all-gathers every unit in forward, and again in backward every unit freed after forward
    (``reshard_after_forward``: None = all but the root, True = all, False = none)."""
    n = world_size

    def sent(op: str, numels: Sequence[int]) -> int:
        return sum(comm.ring_bytes(op, p, element_size, n, rank)[0] for p in numels)

    out = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    if stage == 0:
        out["all_reduce"] = sent("all_reduce", padded_numels)
        return out
    check_stage(stage)
    if any(p % n for p in padded_numels):
        raise ValueError(f"padded sizes {list(padded_numels)} must be multiples of world_size={n}")
    out["reduce_scatter"] = out["all_gather"] = sent("all_gather", padded_numels)
    if stage == 3:
        if reshard_after_forward is None:
            again = padded_numels[:-1]
        else:
            again = padded_numels if reshard_after_forward else []
        out["all_gather"] += sent("all_gather", again)
    return out


def global_batch_size(micro_batch: int, accumulation_steps: int, dp_degree: int) -> int:
    """Rows per optimizer step: B = micro-batch x accumulation steps x DP degree."""
    return micro_batch * accumulation_steps * dp_degree


def allreduce_bytes_per_rank(grad_bytes: float, n: int) -> float:
    """Bytes one rank sends per optimizer step in a ring all-reduce of all gradients: 2 (N-1)/N x V."""
    return 2 * (n - 1) / n * grad_bytes


def ring_kv_bytes(seq_len: int, batch: int, n_kv_head: int, head_dim: int, cp: int, element_size: int) -> int:
    """Bytes of the K,V block one ring step sends: 2 * (s/cp) * b * n_kv * d_head * bytes."""
    return 2 * (seq_len // cp) * batch * n_kv_head * head_dim * element_size


def ring_kv_bytes_tp(cfg: GPTConfig, seq_len: int, batch: int, tp: int, cp: int, element_size: int) -> int:
    """The ring's K,V block under TP x CP: each TP rank circulates the K/V heads its query heads read,
    ceil(n_kv / t) of them (n_kv / t when t divides n_kv; one when K/V are replicated and t >= n_kv), never
    the n_head / t query heads (what the planner prices)."""
    return ring_kv_bytes(seq_len, batch, -(-cfg.kv_heads // tp), cfg.head_dim, cp, element_size)


def ring_sends_per_layer(cp: int) -> dict[str, int]:
    """Sends per layer and rank: forward cp - 1 K,V blocks; backward cp - 1 K,V blocks and cp dK,dV blocks."""
    return {"forward_kv": cp - 1, "backward_kv": cp - 1, "backward_dkv": cp if cp > 1 else 0}


def activation_bytes_per_rank(cfg: GPTConfig, micro_batch: int, seq_len: int, cp: int,
                              element_bytes: int = 4) -> int:
    """Activation bytes one CP rank saves for backward (what ``course_lib.measure.memtrack`` measures), from the
    estimator's adapted formula at s/cp tokens (``memory.model_activation_bytes``) and what ring attention saves
    differently from PyTorch's SDPA: un-repeated K,V under GQA (2e(h - h_kv) less per token and layer), a
    contiguous attention output that o_proj saves as a copy without RoPE too (e*h more), and the positions of
    every rank [cp, s/cp] int64, shared by all layers (which replace the learned position ids).

    Everything scales with s/cp except those positions: activation memory per rank falls as 1/cp.
    """

    n = micro_batch * seq_len // cp
    e, h, layers = element_bytes, cfg.d_model, cfg.n_layer
    base = sum(model_activation_bytes(cfg, micro_batch, seq_len // cp, formula="adapted",
                                      element_bytes=e).values())
    gqa = -2 * e * n * (h - cfg.kv_heads * cfg.head_dim) * layers
    o_copy = 0 if cfg.pos == "rope" else e * n * h * layers
    pos = 8 * seq_len - (8 * seq_len // cp if cfg.pos == "learned" else 0)
    return int(base + gqa + o_copy + pos)


def dispatch_bytes(n_tokens: int, top_k: int, d_model: int, element_size: int = 4) -> int:
    """Bytes the dispatch all-to-all carries per MoE layer forward, summed over the ranks, nothing dropped:
    T * k * h * s. Combine carries the same; backward repeats both."""
    return n_tokens * top_k * d_model * element_size


def leaving_fraction(ep: int) -> float:
    """Share of a rank's dispatched rows that go to another rank under uniform routing: (ep - 1) / ep."""
    return (ep - 1) / ep


def moe_budget(cfg: GPTConfig, bytes_per_param: float = 2.0) -> dict[str, float]:
    """What an MoE stores vs what a token computes: total and active parameters (``param_count``), the bytes of
    all weights, and forward FLOPs per token of the active ones (2 per active parameter, attention scores
    excluded). For Mixtral 8x7B: 46.7B stored, 12.9B active -- not 8 x 7B = 56B, because the experts share the
    attention, embeddings and norms."""
    total, active = param_count(cfg), param_count(cfg, active_only=True)
    return {"total_params": total, "active_params": active, "weight_bytes": total * bytes_per_param,
            "forward_flops_per_token": 2 * active, "active_fraction": active / total}


def slowest_rank_load(tokens_per_expert: Sequence[int], ep: int, capacity: int | None = None) -> tuple[int, float]:
    """(rows the busiest ep rank's experts process, mean over ranks), experts placed contiguously, each expert
    capped at ``capacity``. An all-to-all step lasts as long as its slowest rank."""
    E = len(tokens_per_expert)
    if E % ep:
        raise ValueError(f"{E} experts do not divide over ep={ep} ranks")
    kept = [min(c, capacity) if capacity is not None else c for c in tokens_per_expert]
    per_rank = [sum(kept[j * E // ep:(j + 1) * E // ep]) for j in range(ep)]
    return max(per_rank), sum(per_rank) / ep
