"""Tensor parallelism on paper: the collectives of one training step and the bytes and activations they imply,
for the ``TensorParallel`` wrapper of ``course_lib.parallel.tp`` with ``gpt_plan`` (checked against what
``comm.recording()`` logs and what ``MemoryTracker`` measures in tests/test_tp.py).

Per transformer block and rank, with V = b*s*h activation elements (ring bytes, ``comm``)::

    TP       forward  2 all-reduces of V (after attention, after MLP)    backward  2 all-reduces of V (the f's)
    TP + SP  forward  2 all-gathers + 2 reduce-scatters of V            backward  the same, reversed, plus the
                                                                                  re-gather of each region's
                                                                                  s/t input: 2 all-gathers of V

An all-reduce is a reduce-scatter plus an all-gather, so TP moves 4 x 2(t-1)/t x V bytes a block and step and
TP + SP, which saves only the s/t input shard of its column-parallel linears (Megatron-LM's form), that plus
2 x (t-1)/t x V for the re-gathers (overlapped with the input-gradient GEMMs in backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from course_lib.model_config import GPTConfig

__all__ = ["PlannedCollective", "block_bytes_per_rank", "layer_activation_bytes_tp", "step_collectives"]


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
    """Every collective of one training step of the GPT under ``TensorParallel`` with ``gpt_plan``, in call order.

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
    from course_lib.estimates.activation_memory import layer_activation_bytes

    return layer_activation_bytes(cfg, micro_batch, cfg.seq_len, tp=t, sp=sequence_parallel, formula="adapted",
                                  element_bytes=element_bytes)
