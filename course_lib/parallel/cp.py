"""Context parallelism as an in-place transform of the model: ``apply_cp(model, group)``.

Every example's sequence is split over the cp ranks of a group, s/cp tokens each
(``shard_sequence``; zig-zag by default: chunks r and 2cp-1-r, equal work under the causal mask).
All is per token but attention, which becomes ring attention over the group (``cp_attention``: K,V
blocks passed around the ring, merged by their log-sum-exp; Liu et al. 2023), and the positions:
the learned position embedding and RoPE read each token's *global* position. Per layer and rank,
forward: cp - 1 sends of one K,V block, 2 (s/cp) b n_kv d_head bytes each (GQA: the K/V heads).

No parameter changes (each is recorded ``Replicate()`` on "cp"): a cp rank's gradient is its
tokens' share of the mean, and data parallelism averages over ``dp+cp`` (Megatron-LM's gradient
group). The attention function is a parameter (``cp_attention.ring_attention``,
``allgather_attention``, or ``cp_ulysses``'s all-to-all); the composition picks it by name.
Chapter 06 builds ring attention in the notebook first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.layers import Attention, apply_rope, rope_cos_sin
from course_lib.parallel.contract import require_member
from course_lib.parallel.cp_attention import (
    AttentionStats,
    BlockAttention,
    Layout,
    all_positions,
    check_sequence,
    chunks_per_rank,
    ring_attention,
)
from course_lib.parallel.placement import Replicate, set_placement

Attend = Callable[..., torch.Tensor]
"""``(q, k, v, positions, n_chunks, causal, group, kernel, stats) -> output``: ring, all-gather or
Ulysses."""


class CPContext:
    """What a model's attention layers share: the group, the layout, the attention function, the
    running batch's positions (``begin``: called by the model's forward, or by the composed step on
    every pipeline rank, whose later stages do not run the model's forward)."""

    def __init__(self, group: comm.Group, layout: Layout = "zigzag",
                 attend: Attend = ring_attention, causal: bool = True,
                 kernel: BlockAttention | None = None, max_len: int | None = None) -> None:
        chunks_per_rank(layout)  # validates the name
        self.group, self.layout, self.attend_fn, self.causal = group, layout, attend, causal
        self.kernel = kernel or BlockAttention()
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.max_len = max_len
        self.positions: torch.Tensor | None = None  # [cp, T_local]
        self.stats = AttentionStats()
        self.hooks: list[Any] = []  # apply_cp's pre-hooks

    def begin(self, seq_len: int, device: torch.device | str | None = None) -> None:
        """A batch of full sequences of ``seq_len`` tokens starts: every rank's global positions."""
        if self.max_len is not None and seq_len > self.max_len:
            raise ValueError(f"{seq_len // self.size} tokens per rank x cp={self.size} exceeds "
                             f"seq_len={self.max_len}")
        check_sequence(seq_len, self.size, self.layout)
        self.positions = all_positions(seq_len, self.size, self.layout, device)

    def local_positions(self) -> torch.Tensor:
        """The global positions of this rank's tokens in the batch now running."""
        if self.positions is None:
            raise RuntimeError("no batch is running: the positions are set by CPContext.begin")
        return self.positions[self.rank]

    def embedding_positions(self, n: int) -> torch.Tensor:
        """What the learned position embedding reads for this rank's ``n`` tokens: their global
        positions (a seam: a first pipeline stage at chunk-local positions 0..n-1 is a variant)."""
        mine = self.local_positions()
        if mine.numel() != n:
            raise ValueError(f"the position embedding got {n} positions, this rank holds "
                             f"{mine.numel()} tokens")
        return mine

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attend_fn(q, k, v, self.positions, chunks_per_rank(self.layout), self.causal,
                              self.group, self.kernel, self.stats)


class CPAttention(nn.Module):
    """The GPT's attention with the same projections (same names), attending over the cp group."""

    def __init__(self, attn: Attention, ctx: CPContext) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = attn.n_head, attn.n_kv_head
        self.head_dim, self.rope = attn.head_dim, attn.rope
        self.q_proj, self.k_proj = attn.q_proj, attn.k_proj
        self.v_proj, self.o_proj = attn.v_proj, attn.o_proj
        self.ctx = ctx

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE at the tokens' *global* positions (a seam: forgetting that is a variant)."""
        cos, sin = rope_cos_sin(positions.numel(), self.head_dim, positions=positions.cpu())
        cos, sin = cos.to(q.device), sin.to(q.device)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = self.rotary(q, k, self.ctx.local_positions())
        y = self.ctx.attend(q.contiguous(), k.contiguous(), v.contiguous())
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def apply_cp(model: nn.Module, group: comm.Group, *, layout: Layout = "zigzag",
             attend: Attend = ring_attention, causal: bool = True,
             kernel: BlockAttention | None = None, context: CPContext | None = None,
             attention: Callable[[Attention, CPContext], nn.Module] = CPAttention) -> CPContext:
    """Context parallelism of ``model`` over ``group``, in place: the model then runs on this rank's
    s/cp tokens and is still a GPT a pipeline can cut.

    * every block's attention attends over the group: a tensor-parallel one (already transformed)
      gets the context, the plain one becomes ``attention(attn, ctx)`` (``CPAttention``);
    * the model's forward first sets every rank's global positions (a forward pre-hook), and the
      learned position embedding reads them (a pre-hook on ``pos_emb``);
    * every parameter is recorded ``Replicate()`` on "cp".

    Returns the ``CPContext`` the layers share (``context``: one built by the caller, a variant)."""
    require_member(group, "apply_cp")
    ctx = context or CPContext(group, layout, attend, causal, kernel, max_len=model.config.seq_len)
    for p in model.parameters():  # the sequence is split, not the weights
        set_placement(p, "cp", Replicate())
    for block in model.blocks:
        if hasattr(block.attn, "context"):  # a TensorParallelAttention: its heads, over the cp ring
            block.attn.context = ctx
        else:
            block.attn = attention(block.attn, ctx)
    ctx.hooks.append(model.register_forward_pre_hook(
        lambda _m, args: ctx.begin(args[0].shape[1] * ctx.size, args[0].device)))
    if model.pos_emb is not None:
        ctx.hooks.append(model.pos_emb.register_forward_pre_hook(
            lambda _m, args: (ctx.embedding_positions(args[0].numel()),)))
    return ctx
