"""The math of context parallelism: blockwise attention, log-sum-exp merge, layouts, ring attention.

Context parallelism splits every example's *sequence* over the ``cp`` ranks of a group; only
attention mixes tokens. Ring attention (Liu, Zaharia & Abbeel 2023, arXiv:2310.01889) keeps the
local queries and passes the K,V blocks around a ring, each of the cp - 1 transfers overlapped with
attention over the block at hand. Blocks merge exactly by their log-sum-exp (online softmax: Milakov
& Gimelshein 2018; FlashAttention, Dao et al. 2022)::

    lse = m + log(exp(lse_1 - m) + exp(lse_2 - m)),  m = max(lse_1, lse_2)
    o   = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2

Every exponent is <= 0 (no overflow); a row that saw no key has lse = -inf, weight 0 (never NaN).
Causal masks: a (q chunk, k chunk) block is skipped when no key is visible, unmasked when all are,
masked only on the diagonal. In the **contiguous** layout rank r's queries (chunk r, length c) see
c^2 r + c(c + 1)/2 keys: the last rank does (2cp - 1)/cp x the mean work, rank 0 almost none. The
**zig-zag** layout (Megatron-LM; Brandon et al. 2023's "Striped Attention" is the cyclic variant)
gives rank r chunks r and 2cp - 1 - r of 2cp: equal work. Backward recomputes ``P = exp(s - lse)``
per block from the saved ``o`` and ``lse`` (FlashAttention-2, Dao 2023); a block's dK, dV ride the
ring with its K, V back to their owner. The ring carries GQA's n_kv heads. Chapter 06 derives it.
"""

from __future__ import annotations

import math
import time
from typing import Literal

import torch
import torch.distributed as dist

from course_lib import comm

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[Layout, ...] = ("contiguous", "zigzag")


# --------------------------------------------------------------------------------------------------
# Layouts: which global positions a rank holds


def chunks_per_rank(layout: Layout) -> int:
    """1 chunk per rank (contiguous) or 2 (zig-zag)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: use one of {LAYOUTS}")
    return 1 if layout == "contiguous" else 2


def chunk_ids(rank: int, cp: int, layout: Layout) -> tuple[int, ...]:
    """Rank ``rank``'s chunks: (r,) of cp chunks, or (r, 2cp - 1 - r) of 2cp chunks (zig-zag)."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside a context-parallel group of {cp}")
    return (rank,) if chunks_per_rank(layout) == 1 else (rank, 2 * cp - 1 - rank)


def check_sequence(seq_len: int, cp: int, layout: Layout) -> int:
    """Raise unless ``seq_len`` splits into equal chunks; return the chunk length."""
    n = cp * chunks_per_rank(layout)
    if cp < 1 or seq_len < n or seq_len % n:
        raise ValueError(f"a sequence of {seq_len} tokens does not split into {n} equal chunks "
                         f"({layout} layout, cp={cp}): use a length divisible by {n}")
    return seq_len // n


def positions(seq_len: int, rank: int, cp: int, layout: Layout,
              device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (int64, ascending within each chunk) of the tokens rank ``rank`` holds."""
    c = check_sequence(seq_len, cp, layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                      for i in chunk_ids(rank, cp, layout)])


def all_positions(seq_len: int, cp: int, layout: Layout,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """[cp, seq_len / cp]: row r holds the positions of rank r."""
    return torch.stack([positions(seq_len, r, cp, layout, device) for r in range(cp)])


def shard_sequence(t: torch.Tensor, rank: int, cp: int, layout: Layout,
                   dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``t`` along ``dim`` (inputs, targets, anything per token)."""
    return t.index_select(dim, positions(t.shape[dim], rank, cp, layout, t.device))


def unshard_sequence(parts: list[torch.Tensor], layout: Layout, dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_sequence``: the per-rank pieces (in rank order) back in sequence order."""
    cp = len(parts)
    seq_len = sum(p.shape[dim] for p in parts)
    order = torch.cat([positions(seq_len, r, cp, layout) for r in range(cp)])
    joined = torch.cat(parts, dim=dim)
    return joined.index_select(dim, torch.argsort(order).to(joined.device))


def causal_pairs(seq_len: int, cp: int, layout: Layout) -> list[int]:
    """Unmasked (q, k) pairs per rank, causal mask: the sum of (p + 1) over its query positions p.

    Contiguous: rank r holds positions [rc, (r+1)c), so pairs = c^2 (2r + 1)/2 + c/2; the last rank
    does (2cp - 1)/cp x the mean for large c. Zig-zag: each rank does s(s + 1)/(2cp), the mean."""
    return [int((positions(seq_len, r, cp, layout) + 1).sum()) for r in range(cp)]


def imbalance(pairs: list[int]) -> float:
    """max / mean of per-rank work (1 = balanced; the slowest rank sets the step time)."""
    return max(pairs) / (sum(pairs) / len(pairs))


# --------------------------------------------------------------------------------------------------
# One block: forward with (out, lse), backward by recomputation


def expand_kv(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """[B, H_kv, T, d] -> [B, H, T, d]: K/V head g serves the query heads [g*rep, (g+1)*rep)."""
    b, h_kv, s, d = t.shape
    if n_head == h_kv:
        return t
    if n_head % h_kv:
        raise ValueError(f"{n_head} query heads do not share {h_kv} K/V heads evenly")
    return t[:, :, None].expand(b, h_kv, n_head // h_kv, s, d).reshape(b, n_head, s, d)


def reduce_kv(t: torch.Tensor, n_kv_head: int) -> torch.Tensor:
    """Adjoint of ``expand_kv``: sum the gradients of the query heads that share a K/V head."""
    b, h, s, d = t.shape
    return t if h == n_kv_head else t.view(b, n_kv_head, h // n_kv_head, s, d).sum(2)


class BlockAttention:
    """The per-block operations ring attention is made of, as overridable methods (the seams tests
    and exercises inject bugs through). Shapes: q [B, H, Tq, d]; k, v [B, H_kv, Tk, d]; lse [B, H,
    Tq]; mask [Tq, Tk] bool, True = visible, or None = all visible."""

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Causal visibility from *global* positions: key k is visible to query q if p_k <= p_q."""
        return k_pos[None, :] <= q_pos[:, None]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention of q over one block: (softmax(s) v, logsumexp(s)), s = scale q k^T.

        Stable: exp(s - m) with m the row max; a fully masked row gives out 0 and lse -inf (no NaN),
        also in autograd's backward (``allgather_attention``): a row with a visible key has a
        denominator >= 1 (its max term is exp(0)), so only an empty row's 0 is replaced, by 1 -- a
        tiny clamp instead would turn dO / tiny into inf and 0 x inf into NaN once |dO| > 4."""
        s = scale * q @ expand_kv(k, q.shape[1]).transpose(-1, -2)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        m = s.amax(-1, keepdim=True).detach()
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        seen = denom > 0
        safe = torch.where(seen, denom, torch.ones_like(denom))
        out = (p @ expand_kv(v, q.shape[1])) / safe
        lse = torch.where(seen, m + safe.log(), torch.full_like(denom, float("-inf")))
        return out, lse.squeeze(-1)

    def merge(self, out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
              block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Combine two partial results by the log-sum-exp rule, every exponent shifted to <= 0."""
        new = torch.logaddexp(lse, block_lse)
        safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))  # both -inf: no NaN
        w_old, w_new = torch.exp(lse - safe)[..., None], torch.exp(block_lse - safe)[..., None]
        return w_old * out + w_new * block_out, new

    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 mask: torch.Tensor | None, d_out: torch.Tensor, lse: torch.Tensor,
                 delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) of one block from the *final* lse and delta = rowsum(dO * O), recomputing P:
        ``dS = P * (dO V^T - delta)``, ``dQ = dS K``, ``dK = dS^T Q``, ``dV = P^T dO``."""
        h = q.shape[1]
        ke, ve = expand_kv(k, h), expand_kv(v, h)
        s = scale * q @ ke.transpose(-1, -2)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        p = torch.exp(s - safe[..., None])
        dv = p.transpose(-1, -2) @ d_out
        ds = p * (d_out @ ve.transpose(-1, -2) - delta[..., None])
        dq = scale * ds @ ke
        dk = scale * ds.transpose(-1, -2) @ q
        return dq, reduce_kv(dk, k.shape[1]), reduce_kv(dv, k.shape[1])

    def kv_for_backward_step(self, step: int, received: torch.Tensor,
                             own: torch.Tensor) -> torch.Tensor:
        """The K,V block the backward recomputes with at ``step``: the ring's (``own`` at 0)."""
        return received


class DocumentMaskAttention(BlockAttention):
    """Packed sequences: several documents share one row of ``seq_len`` tokens, and a token attends
    only to the earlier tokens of its own document -- a block-diagonal causal mask (what Llama 3
    trains with; FlexAttention's ``document_mask``). ``doc_starts``: the global position where each
    document begins (0 first), the same for every row of the batch. The mask reads global positions,
    so it works unchanged in the ring (which then also skips every block that crosses a document
    boundary: less work, and a new load balance), the all-gather form and Ulysses."""

    def __init__(self, doc_starts: list[int]) -> None:
        if not doc_starts or doc_starts[0] != 0 or sorted(set(doc_starts)) != list(doc_starts):
            raise ValueError(f"doc_starts must be increasing positions starting at 0, "
                             f"got {doc_starts}")
        self.starts = torch.tensor(doc_starts)

    def document(self, pos: torch.Tensor) -> torch.Tensor:
        """The document index of each global position."""
        return torch.searchsorted(self.starts.to(pos.device), pos, right=True) - 1

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        same = self.document(q_pos)[:, None] == self.document(k_pos)[None, :]
        return super().mask(q_pos, k_pos) & same


class EmulatedDeviceAttention(BlockAttention):
    """Blocks that cost an **emulated device** time: ``seconds_per_pair`` x visible (q, k) pairs in
    forward, twice that in backward (as a host waits for a GPU kernel), the real computation
    included in that time. The sleep costs no CPU, so cp ranks run side by side on a 2-core machine
    and step times follow the work per rank, not the OS scheduler. ``n_head``: when set, a pair
    costs in proportion to the heads the block computes (q.shape[1] / n_head), so Ulysses' blocks of
    H/cp heads cost what they compute."""

    def __init__(self, seconds_per_pair: float, n_head: int | None = None) -> None:
        self.seconds_per_pair, self.n_head = seconds_per_pair, n_head

    def _pairs(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> float:
        pairs = int(mask.sum()) if mask is not None else q.shape[2] * k.shape[2]
        return pairs * (q.shape[1] / self.n_head if self.n_head else 1)

    def _until(self, start: float, seconds: float) -> None:
        """Sleep until ``seconds`` after ``start``: the host's real compute runs inside the emulated
        kernel time (as a CPU prepares the next launch while the GPU computes), so a block costs
        exactly its emulated time whenever that exceeds the real one."""
        time.sleep(max(0.0, seconds - (time.perf_counter() - start)))

    def forward(self, q, k, v, scale, mask):
        start = time.perf_counter()
        out = super().forward(q, k, v, scale, mask)
        self._until(start, self.seconds_per_pair * self._pairs(q, k, mask))
        return out

    def backward(self, q, k, v, scale, mask, d_out, lse, delta):
        start = time.perf_counter()
        out = super().backward(q, k, v, scale, mask, d_out, lse, delta)
        self._until(start, 2 * self.seconds_per_pair * self._pairs(q, k, mask))
        return out


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        causal: bool = True) -> torch.Tensor:
    """Full attention on one process (SDPA), the oracle: q [B, H, T, d]; k, v [B, H_kv, T, d]."""
    h = q.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(q, expand_kv(k, h), expand_kv(v, h),
                                                            is_causal=causal)


# --------------------------------------------------------------------------------------------------
# Work accounting


class AttentionStats:
    """What one rank's attention did (forward): unmasked (q, k) pairs, blocks computed, skipped."""

    def __init__(self) -> None:
        self.pairs = 0
        self.blocks = 0
        self.skipped = 0


def _block_plan(kernel: BlockAttention, q_pos: torch.Tensor, k_pos: torch.Tensor, n_chunks: int,
                causal: bool) -> list[tuple[slice, slice, torch.Tensor | None, int]]:
    """(q slice, k slice, mask or None, unmasked pairs) of every sub-block with visible pairs."""
    tq, tk = q_pos.numel() // n_chunks, k_pos.numel() // n_chunks
    plan = []
    for i in range(n_chunks):
        for j in range(n_chunks):
            qs, ks = slice(i * tq, (i + 1) * tq), slice(j * tk, (j + 1) * tk)
            if not causal:
                plan.append((qs, ks, None, tq * tk))
                continue
            m = kernel.mask(q_pos[qs], k_pos[ks])
            visible = int(m.sum())
            if visible == 0:
                plan.append((qs, ks, m, 0))  # skipped: kept in the plan only so that it is counted
            else:
                plan.append((qs, ks, None if visible == m.numel() else m, visible))
    return plan


# --------------------------------------------------------------------------------------------------
# Ring attention as an autograd Function


def ring_peers(group: comm.Group) -> tuple[int, int, int, int]:
    """(rank in group, group size, global rank of the next, of the previous rank in the ring)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)

    def glob(i: int) -> int:
        return i if group is None else dist.get_global_rank(group, i)

    return r, n, glob((r + 1) % n), glob((r - 1) % n)


def ring_shift(t: torch.Tensor, nxt: int, prv: int, group: comm.Group) -> tuple[torch.Tensor, list]:
    """Start sending ``t`` to the next rank and receiving the previous rank's (same shape)."""
    incoming = torch.empty_like(t)
    return incoming, [comm.isend(t, nxt, group), comm.irecv(incoming, prv, group)]


class RingAttentionFunction(torch.autograd.Function):
    """out = softmax(q k^T / sqrt(d) [+ causal mask]) v over the whole sequence, from local chunks.

    ``pos`` [cp, T_local]: the global positions of every rank's tokens (row r for rank r of
    ``group``); ``n_chunks``: contiguous chunks per rank (1 contiguous, 2 zig-zag), the granularity
    at which fully masked blocks are skipped. Forward: cp - 1 sends of one K,V block (2 x B x H_kv x
    T_local x d elements). Backward: cp - 1 sends of the K,V block and cp sends of its fp32 dK,dV
    accumulator (the last one brings it home).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                n_chunks: int, causal: bool, group: comm.Group, kernel: BlockAttention,
                stats: AttentionStats | None) -> torch.Tensor:
        r, n, nxt, prv = ring_peers(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack((k, v)).contiguous()
        for step in range(n):
            if step < n - 1:
                incoming, works = ring_shift(kv, nxt, prv, group)  # overlaps this step's compute
            blocks = _block_plan(kernel, pos[r], pos[(r - step) % n], n_chunks, causal)
            for qs, ks, mask, pairs in blocks:
                if stats is not None:
                    stats.pairs += pairs
                    stats.blocks += pairs > 0
                    stats.skipped += pairs == 0
                if pairs == 0:
                    continue
                b_out, b_lse = kernel.forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                              scale, mask)
                out[:, :, qs], lse[:, :, qs] = kernel.merge(out[:, :, qs], lse[:, :, qs],
                                                            b_out, b_lse)
            if step < n - 1:
                for w in works:
                    w.wait()
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse, pos)
        ctx.config = (n_chunks, causal, group, kernel, scale)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, k, v, out, lse, pos = ctx.saved_tensors
        n_chunks, causal, group, kernel, scale = ctx.config
        r, n, nxt, prv = ring_peers(group)
        d_out = d_out.contiguous()
        delta = (d_out * out).sum(-1)
        dq = torch.zeros_like(q, dtype=torch.float32)
        own = torch.stack((k, v)).contiguous()
        kv = own
        dkv = torch.zeros_like(own, dtype=torch.float32)  # the held block's dK, dV, in fp32
        for step in range(n):
            if step < n - 1:
                incoming, works = ring_shift(kv, nxt, prv, group)
            use = kernel.kv_for_backward_step(step, kv, own)
            blocks = _block_plan(kernel, pos[r], pos[(r - step) % n], n_chunks, causal)
            for qs, ks, mask, pairs in blocks:
                if pairs == 0:
                    continue
                dq_b, dk_b, dv_b = kernel.backward(q[:, :, qs], use[0][:, :, ks], use[1][:, :, ks],
                                                   scale, mask, d_out[:, :, qs], lse[:, :, qs],
                                                   delta[:, :, qs])
                dq[:, :, qs] += dq_b
                dkv[0][:, :, ks] += dk_b
                dkv[1][:, :, ks] += dv_b
            if n > 1:
                # on to the block's next holder
                incoming_grad, grad_works = ring_shift(dkv, nxt, prv, group)
                for w in grad_works + (works if step < n - 1 else []):
                    w.wait()
                dkv = incoming_grad
                if step < n - 1:
                    kv = incoming
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                   n_chunks: int = 1, causal: bool = True, group: comm.Group = None,
                   kernel: BlockAttention | None = None,
                   stats: AttentionStats | None = None) -> torch.Tensor:
    """Ring attention: local q [B, H, T, d] over all ranks' k, v [B, H_kv, T, d]."""
    check_qkv(q, k, v, pos, n_chunks, group)
    kernel = kernel or BlockAttention()
    return RingAttentionFunction.apply(q, k, v, pos, n_chunks, causal, group, kernel, stats)


# --------------------------------------------------------------------------------------------------
# The all-gather form (Llama 3's and PyTorch's default): gather all K,V, attend locally


class AllGatherKV(torch.autograd.Function):
    """kv [2, B, H_kv, T, d] -> all ranks' kv [cp, 2, B, H_kv, T, d]; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, group: comm.Group) -> torch.Tensor:
        n = dist.get_world_size(group)
        kv = kv.contiguous()
        full = torch.empty(n * kv.numel(), dtype=kv.dtype, device=kv.device)
        comm.all_gather(full, kv.flatten(), group=group)
        ctx.group = group
        return full.view(n, *kv.shape)

    @staticmethod
    def backward(ctx, d_full: torch.Tensor):
        d_kv = torch.empty(d_full[0].numel(), dtype=d_full.dtype, device=d_full.device)
        comm.reduce_scatter(d_kv, d_full.contiguous().flatten(), group=ctx.group)
        return d_kv.view(d_full.shape[1:]), None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                        n_chunks: int = 1, causal: bool = True, group: comm.Group = None,
                        kernel: BlockAttention | None = None,
                        stats: AttentionStats | None = None) -> torch.Tensor:
    """Attention of this rank's q over the all-gathered K,V (one collective of (cp-1)/cp x cp K,V
    blocks per rank instead of cp - 1 ring steps; memory for the whole sequence's K,V). Autograd
    does the backward."""
    check_qkv(q, k, v, pos, n_chunks, group)
    kernel = kernel or BlockAttention()
    full = AllGatherKV.apply(torch.stack((k, v)), group)  # [cp, 2, B, H_kv, T, d]
    k_all, v_all = (torch.cat(list(full[:, i].unbind(0)), dim=2) for i in (0, 1))
    r = dist.get_rank(group)
    mask = kernel.mask(pos[r], pos.flatten()) if causal else None
    if stats is not None:
        stats.pairs += int(mask.sum()) if mask is not None else q.shape[2] * k_all.shape[2]
        stats.blocks += 1
    out, _ = kernel.forward(q, k_all, v_all, 1.0 / math.sqrt(q.shape[-1]), mask)
    return out


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, n_chunks: int,
              group: comm.Group) -> None:
    """Raise unless q [B, H, T, d], k, v [B, H_kv, T, d] and pos [cp, T] agree (T split into
    ``n_chunks``)."""
    n = dist.get_world_size(group)
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q [B, H, T, d] and k, v [B, H_kv, T, d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch, tokens or "
                         f"head_dim, or {q.shape[1]} query heads do not share {k.shape[1]} K/V "
                         "heads evenly")
    if tuple(pos.shape) != (n, q.shape[2]):
        raise ValueError(f"positions must be [cp={n}, T_local={q.shape[2]}], "
                         f"got {tuple(pos.shape)}")
    if q.shape[2] % n_chunks:
        raise ValueError(f"{q.shape[2]} local tokens do not split into {n_chunks} chunks")
