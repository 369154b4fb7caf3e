"""DeepSpeed-Ulysses: context parallelism by re-splitting the heads over the ranks.

Attention is independent per head (Jacobs et al. 2023, arXiv:2309.14509): one **all-to-all** turns
q, k, v from *sequence-sharded* [B, H, s/cp, d] into *head-sharded* [B, H/cp, s, d], each rank
attends over the whole sequence for its heads, and a second all-to-all turns the output back (a
permutation of blocks: its backward is the inverse all-to-all). An all-to-all of X bytes sends
(cp-1)/cp X per rank (``collectives.all_to_all``: *measured*); with e bytes an element and
``n = B (s/cp) d e``, per rank and layer::

    forward   q (H heads), k, v (H_kv each) to heads, the output (H) back:  (cp-1)/cp n (2H + 2H_kv)
    backward  the same four tensors' gradients, the other way:             (cp-1)/cp n (2H + 2H_kv)

against the ring's 2 H_kv n per step for cp - 1 steps. Ulysses' bytes per rank *fall* as 1/cp, the
ring's stay ~constant, but an all-to-all cannot hide behind the attention it feeds, and **cp must
divide H_kv** (and H): rank r needs its K/V heads whole (GQA: query head j reads K/V head
``j // (H / H_kv)``). Past that, replicate K/V heads or use the ring, or both: USP (Fang & Zhao
2024) runs Ulysses inside a node, the ring across nodes. Load balance is free (each rank attends
over the *whole* sequence for H/cp heads); masks come from the kernel's ``mask(q_pos, k_pos)``
(``cp_attention.BlockAttention``), so document masking works as in the ring. Chapter 06.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.parallel.cp_attention import AttentionStats, BlockAttention, check_qkv
from course_lib.runtime import collectives

__all__ = ["AllToAll", "UlyssesExchange", "check_ulysses_heads", "ulysses_attention",
           "ulysses_bytes_per_rank"]


def check_ulysses_heads(n_head: int, n_kv_head: int, cp: int) -> None:
    """Raise unless cp divides both the query and the K/V heads (each rank takes whole heads)."""
    if n_head % cp or n_kv_head % cp:
        fits = [d for d in range(1, n_kv_head + 1) if n_kv_head % d == 0 and n_head % d == 0]
        raise ValueError(f"Ulysses splits the heads over the cp={cp} ranks, but {n_head} query "
                         f"heads and {n_kv_head} K/V heads do not both divide by {cp}: use cp in "
                         f"{fits} (cp <= n_kv_head), or the ring (algorithm='ring'), which has no "
                         "such limit")


def ulysses_bytes_per_rank(seq_len: int, batch: int, n_head: int, n_kv_head: int, head_dim: int,
                           cp: int, element_size: int) -> dict[str, int]:
    """Bytes one rank sends per layer, each way: (cp-1)/cp x B (s/cp) d e x (2H + 2H_kv)."""
    local = batch * (seq_len // cp) * head_dim * element_size
    each = (cp - 1) * local * (2 * n_head + 2 * n_kv_head) // cp
    return {"forward": each, "backward": each}


def _all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, group: comm.Group) -> torch.Tensor:
    """Send chunk j of ``split_dim`` to group rank j; join what rank j sent along ``cat_dim``."""
    n = dist.get_world_size(group)
    chunks = [c.contiguous() for c in x.chunk(n, split_dim)]
    return torch.cat(collectives.all_to_all(chunks, group), cat_dim)


class AllToAll(torch.autograd.Function):
    """``_all_to_all(x, split_dim, cat_dim)``; backward the inverse (split ``cat_dim``, join
    ``split_dim``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split_dim: int, cat_dim: int,
                group: comm.Group) -> torch.Tensor:
        ctx.dims, ctx.group = (split_dim, cat_dim), group
        return _all_to_all(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        split_dim, cat_dim = ctx.dims
        return _all_to_all(grad.contiguous(), cat_dim, split_dim, ctx.group), None, None, None


class UlyssesExchange:
    """The two re-splits of [B, H, s/cp, d] tensors, overridable (a mutation test's seam)."""

    def to_heads(self, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        """[B, H, s/cp, d] sequence shards -> [B, H/cp, s, d] head shards (tokens in rank order)."""
        return AllToAll.apply(x, 1, 2, group)

    def to_sequence(self, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        """Head-sharded [B, H/cp, s, d] -> sequence-sharded [B, H, s/cp, d]."""
        return AllToAll.apply(x, 2, 1, group)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                      n_chunks: int = 1, causal: bool = True, group: comm.Group = None,
                      kernel: BlockAttention | None = None, stats: AttentionStats | None = None,
                      exchange: UlyssesExchange | None = None) -> torch.Tensor:
    """Attention of this rank's q [B, H, T, d] over all k, v [B, H_kv, T, d] by two all-to-alls.

    ``pos`` [cp, T]: every rank's global positions (the mask reads them, so any layout works;
    ``n_chunks`` is accepted for the ring's signature and unused). The attention itself is the
    kernel's block forward over the whole sequence (autograd does its backward; a flash kernel in
    production). ``stats.pairs``: the visible (q, k) pairs this rank computes, for H/cp heads -- the
    same on every rank.
    """
    check_qkv(q, k, v, pos, n_chunks, group)
    cp = dist.get_world_size(group)
    check_ulysses_heads(q.shape[1], k.shape[1], cp)
    kernel = kernel or BlockAttention()
    exchange = exchange or UlyssesExchange()
    qh, kh, vh = (exchange.to_heads(t, group) for t in (q, k, v))
    flat = pos.flatten()  # the gathered tokens, in rank order
    mask = kernel.mask(flat, flat) if causal else None
    if stats is not None:
        stats.pairs += int(mask.sum()) if mask is not None else flat.numel() ** 2
        stats.blocks += 1
    out, _ = kernel.forward(qh, kh, vh, 1.0 / math.sqrt(q.shape[-1]), mask)
    return exchange.to_sequence(out, group)
