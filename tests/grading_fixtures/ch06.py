"""Wrong answers for chapter 06 (context parallelism)."""

import math

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.parallel import cp_attention as ca


def merge_without_max_shift(out1, lse1, out2, lse2):
    """The textbook weights exp(lse): overflow (inf/inf = NaN) once scores pass ~88."""
    w1, w2 = torch.exp(lse1), torch.exp(lse2)
    total = w1 + w2
    return (w1[..., None] * out1 + w2[..., None] * out2) / total[..., None], torch.log(total)


def merge_equal_weights(out1, lse1, out2, lse2):
    """Averages the two parts, ignoring how much of the softmax each holds."""
    return (out1 + out2) / 2, torch.logaddexp(lse1, lse2)


def merge_nan_for_masked_rows(out1, lse1, out2, lse2):
    """Stable for large scores, but exp(-inf - -inf) = NaN when both blocks are fully masked."""
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse)[..., None] * out1 + torch.exp(lse2 - lse)[..., None] * out2, lse


def merge_lse_as_max(out1, lse1, out2, lse2):
    """Weighs the parts right but returns max(lse1, lse2) (the running max of online softmax) as the new lse."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.exp(lse1 - safe)[..., None] * out1 + torch.exp(lse2 - safe)[..., None] * out2
    return out, torch.maximum(lse1, lse2)


def merge_weights_swapped(out1, lse1, out2, lse2):
    """Gives each part the other part's weight: exp(lse2 - lse) on out1, exp(lse1 - lse) on out2."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(lse2 - safe)[..., None] * out1 + torch.exp(lse1 - safe)[..., None] * out2, lse


def merge_masked_lse_zero(out1, lse1, out2, lse2):
    """Guards -inf by replacing the new lse with 0, and returns that 0: two empty blocks must keep lse = -inf."""
    lse = torch.logaddexp(lse1, lse2)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(lse1 - lse)[..., None] * out1 + torch.exp(lse2 - lse)[..., None] * out2, lse


def contiguous_positions(seq_len, cp, rank):
    """The contiguous layout: one chunk r of cp."""
    c = seq_len // cp
    return torch.arange(rank * c, (rank + 1) * c)


def mirror_off_by_one(seq_len, cp, rank):
    """Second chunk 2cp - r instead of 2cp - 1 - r (wraps past the end for rank 0)."""
    if seq_len % (2 * cp):
        raise ValueError("bad length")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in (rank, (2 * cp - rank) % (2 * cp))])


def no_length_check(seq_len, cp, rank):
    """Right for good lengths, silently wrong chunks for bad ones."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in (rank, 2 * cp - 1 - rank)])


def _merge(out, lse, b_out, b_lse):
    new = torch.logaddexp(lse, b_lse)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    return torch.exp(lse - safe)[..., None] * out + torch.exp(b_lse - safe)[..., None] * b_out, new


def ring_step_local_mask(q, q_pos, kv, kv_pos, out, lse, group=None):
    """The causal mask from positions inside the block (tril), not the global positions."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    incoming = torch.empty_like(kv)
    works = [comm.isend(kv, (r + 1) % n, group), comm.irecv(incoming, (r - 1) % n, group)]
    t = q.shape[2]
    visible = torch.ones(t, t, dtype=torch.bool).tril()
    b_out, b_lse = ca.BlockAttention().forward(q, kv[0], kv[1], 1 / math.sqrt(q.shape[-1]), visible)
    out, lse = _merge(out, lse, b_out, b_lse)
    for w in works:
        w.wait()
    return out, lse, incoming


def ring_step_returns_own_block(q, q_pos, kv, kv_pos, out, lse, group=None):
    """Sends and receives, but keeps its own block for the next step."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    incoming = torch.empty_like(kv)
    works = [comm.isend(kv, (r + 1) % n, group), comm.irecv(incoming, (r - 1) % n, group)]
    visible = kv_pos[None, :] <= q_pos[:, None]
    if visible.any():
        b_out, b_lse = ca.BlockAttention().forward(q, kv[0], kv[1], 1 / math.sqrt(q.shape[-1]), visible)
        out, lse = _merge(out, lse, b_out, b_lse)
    for w in works:
        w.wait()
    return out, lse, kv


def _scores(q, k, scale, mask):
    s = scale * q @ k.transpose(-1, -2)
    return s.masked_fill(~mask, float("-inf")) if mask is not None else s


def _final_probabilities(q, k, scale, mask, lse):
    """The block's P from the whole row's lse (a row that saw no key has lse -inf: taken as 0, its P is 0)."""
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(_scores(q, k, scale, mask) - safe[..., None])


class _FinalLseBackward(ca.BlockAttention):
    """The block backward written out with the final lse (the fix): its subclasses' mistakes lie elsewhere."""

    def backward(self, q, k, v, scale, mask, d_out, lse, delta):
        p = _final_probabilities(q, k, scale, mask, lse)
        ds = p * (d_out @ v.transpose(-1, -2) - delta[..., None])
        return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ d_out


class KeepsTheBlockSoftmax(ca.BlockAttention):
    """The colleague's kernel as given: P from this block's own softmax (right only when one block is all)."""

    def backward(self, q, k, v, scale, mask, d_out, lse, delta):
        p = torch.softmax(_scores(q, k, scale, mask), dim=-1).nan_to_num()
        ds = p * (d_out @ v.transpose(-1, -2) - delta[..., None])
        return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ d_out


class ForgetsDelta(ca.BlockAttention):
    """dS = P * dP, without subtracting rowsum(dO * O): the softmax's Jacobian is half written."""

    def backward(self, q, k, v, scale, mask, d_out, lse, delta):
        p = _final_probabilities(q, k, scale, mask, lse)
        ds = p * (d_out @ v.transpose(-1, -2))
        return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ d_out


class ForgetsTheScale(ca.BlockAttention):
    """Drops the 1/sqrt(d) of the scores from dQ and dK (the chain rule through s = scale q k^T)."""

    def backward(self, q, k, v, scale, mask, d_out, lse, delta):
        p = _final_probabilities(q, k, scale, mask, lse)
        ds = p * (d_out @ v.transpose(-1, -2) - delta[..., None])
        return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ d_out


class FlattensTheBatch(ca.BlockAttention):
    """The right fix with lse reshaped to [B H, T, 1]: broadcasts right for one sequence only."""

    def backward(self, q, k, v, scale, mask, d_out, lse, delta):
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).reshape(-1, lse.shape[-1], 1)
        p = torch.exp(_scores(q, k, scale, mask) - safe)
        ds = p * (d_out @ v.transpose(-1, -2) - delta[..., None])
        return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ d_out


class SumsTheUpstreamOverQueries(ca.BlockAttention):
    """dV from the column sums of P times the mean upstream row: right when every query's upstream gradient is
    the same (a loss that is a plain sum), wrong for a real loss."""

    def backward(self, q, k, v, scale, mask, d_out, lse, delta):
        p = _final_probabilities(q, k, scale, mask, lse)
        ds = p * (d_out @ v.transpose(-1, -2) - delta[..., None])
        dv = p.sum(-2)[..., None] * d_out.mean(-2, keepdim=True)
        return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, dv


class StillStale(_FinalLseBackward):
    """The right block backward, but it recomputes with the ring's received K,V block only from step 2 on: step 1
    uses this rank's own block under the received block's mask."""

    def kv_for_backward_step(self, step, received, own):
        return received if step >= 2 else own


class ForwardMaskOnly(_FinalLseBackward):
    """The right block backward, but every step recomputes with this rank's own K,V block: only the mask follows
    the ring, so from step 1 on the keys under it are the wrong ones."""

    def kv_for_backward_step(self, step, received, own):
        return own


def second_chunk_counted_from_the_end(seq_len, cp, rank):
    """The mirror chunk taken as cp + rank (the next chunk along) instead of 2 cp - 1 - rank: right for cp = 1."""
    c = seq_len // (2 * cp)
    if seq_len % (2 * cp) or seq_len == 0:
        raise ValueError("bad length")
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in (rank, cp + rank)])


def divisible_by_cp_only(seq_len, cp, rank):
    """Checks that cp divides the length, not 2 cp: a length of cp x an odd number gives chunks of unequal size."""
    if seq_len % cp or seq_len == 0:
        raise ValueError("bad length")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in (rank, 2 * cp - 1 - rank)])


def _attend(q, q_pos, kv, kv_pos, out, lse):
    visible = kv_pos[None, :] <= q_pos[:, None]
    if visible.any():
        b_out, b_lse = ca.BlockAttention().forward(q, kv[0], kv[1], 1 / math.sqrt(q.shape[-1]), visible)
        out, lse = _merge(out, lse, b_out, b_lse)
    return out, lse


def ring_step_group_ranks_as_peers(q, q_pos, kv, kv_pos, out, lse, group=None):
    """The neighbours' positions in the group passed as peers: right for the whole world, wrong in a sub-group
    (peers are global ranks)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    incoming = torch.empty_like(kv)
    works = [comm.isend(kv, (r + 1) % n, group), comm.irecv(incoming, (r - 1) % n, group)]
    out, lse = _attend(q, q_pos, kv, kv_pos, out, lse)
    for w in works:
        w.wait()
    return out, lse, incoming


def _peers(group):
    r, n = dist.get_rank(group), dist.get_world_size(group)
    return comm.global_rank(group, (r + 1) % n), comm.global_rank(group, (r - 1) % n)


def ring_step_waits_first(q, q_pos, kv, kv_pos, out, lse, group=None):
    """Right values, no overlap: the transfer is waited on before the block is attended."""
    nxt, prev = _peers(group)
    incoming = torch.empty_like(kv)
    for w in [comm.isend(kv, nxt, group), comm.irecv(incoming, prev, group)]:
        w.wait()
    out, lse = _attend(q, q_pos, kv, kv_pos, out, lse)
    return out, lse, incoming


def ring_step_attends_masked_blocks(q, q_pos, kv, kv_pos, out, lse, group=None):
    """Right values (a fully masked block adds nothing) but it computes every block, visible or not: the causal
    ring's saving thrown away."""
    nxt, prev = _peers(group)
    incoming = torch.empty_like(kv)
    works = [comm.isend(kv, nxt, group), comm.irecv(incoming, prev, group)]
    visible = kv_pos[None, :] <= q_pos[:, None]
    b_out, b_lse = ca.BlockAttention().forward(q, kv[0], kv[1], 1 / math.sqrt(q.shape[-1]), visible)
    out, lse = _merge(out, lse, b_out, b_lse)
    for w in works:
        w.wait()
    return out, lse, incoming


def ring_step_by_hand(q, q_pos, kv, kv_pos, out, lse, group=None):
    """Correct: the block attended with a hand-written softmax instead of BlockAttention, batch_isend_irecv."""
    nxt, prev = _peers(group)
    incoming = torch.empty_like(kv)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt, group), dist.P2POp(dist.irecv, incoming, prev,
                                                                                        group)])
    visible = kv_pos[None, :] <= q_pos[:, None]
    if visible.any():
        scores = (q @ kv[0].transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~visible, float("-inf"))
        b_lse = torch.logsumexp(scores, -1)
        safe = torch.where(torch.isfinite(b_lse), b_lse, torch.zeros_like(b_lse))
        b_out = torch.exp(scores - safe[..., None]) @ kv[1]
        out, lse = _merge(out, lse, b_out, b_lse)
    for w in works:
        w.wait()
    return out, lse, incoming


def _exchange(x, split_dim, cat_dim, fold=True):
    n = dist.get_world_size()
    send = torch.stack(x.chunk(n, split_dim)).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)
    if fold:
        return torch.cat(recv.unbind(0), cat_dim)
    shape = list(x.shape)
    shape[split_dim] //= n
    shape[cat_dim] *= n
    return recv.reshape(shape)  # blocks of dim 0 poured into cat_dim's place without moving them there


class _Resplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, fold):
        ctx.args = (split_dim, cat_dim, fold)
        return _exchange(x, split_dim, cat_dim, fold)

    @staticmethod
    def backward(ctx, grad):
        split_dim, cat_dim, fold = ctx.args
        return _exchange(grad.contiguous(), cat_dim, split_dim, fold), None, None, None


def _ulysses(q, k, v, causal=True, fold=True, repeat_kv=False, tile=False):
    if repeat_kv:
        k, v = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2) for t in (k, v))
    qh, kh, vh = (_Resplit.apply(t, 2, 1, fold).transpose(1, 2) for t in (q, k, v))
    if tile:  # the local K/V heads repeated as a block: local query head j reads local K/V head j % H_kv_local
        kh, vh = (t.repeat(1, qh.shape[1] // t.shape[1], 1, 1) for t in (kh, vh))
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True)
    return _Resplit.apply(out.transpose(1, 2), 1, 2, fold)


def ulysses_kv_heads_tiled(q, k, v):
    """Repeats the local K/V heads with repeat instead of repeat_interleave: right while a rank holds one K/V
    head (or the heads are MHA), wrong once it holds several."""
    return _ulysses(q, k, v, tile=True)


def ulysses_local_only(q, k, v):
    """No exchange: causal attention over this rank's own tokens only (the earlier tokens are never seen)."""
    out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                                           enable_gqa=True)
    return out.transpose(1, 2)


def ulysses_not_causal(q, k, v):
    """The re-split is right, the mask is forgotten: every query sees the later tokens too."""
    return _ulysses(q, k, v, causal=False)


def ulysses_reshape_instead_of_concatenate(q, k, v):
    """Reshapes the received [cp, b, s/cp, ...] blocks straight to [b, s, ...]: right for b = 1 only (the batch
    and the ranks' blocks get mixed)."""
    return _ulysses(q, k, v, fold=False)


def ulysses_exchange_outside_autograd(q, k, v):
    """All-to-alls on plain tensors: the output is cut off from q, k, v (no backward exchange)."""
    with torch.no_grad():
        qh, kh, vh = (_exchange(t, 2, 1).transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        return _exchange(out.transpose(1, 2), 1, 2)


def ulysses_repeats_kv_first(q, k, v):
    """Repeats the K/V heads to H before the exchange: right values, but (H - H_kv) heads too many on the wire."""
    return _ulysses(q, k, v, repeat_kv=True)


def ulysses_kv_in_one_exchange(q, k, v):
    """Right: k and v stacked into one all-to-all (three each way instead of four, the same bytes)."""
    qh = _Resplit.apply(q, 2, 1, True).transpose(1, 2)
    kh, vh = _Resplit.apply(torch.stack((k, v), 1), 3, 2, True).transpose(2, 3).unbind(1)
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    return _Resplit.apply(out.transpose(1, 2), 1, 2, True)


RIGHT = {"ring_step": [ring_step_by_hand], "ulysses_attention": [ulysses_kv_in_one_exchange]}
"""Correct answers other than the solution's: each must score full marks."""

WRONG = {
    "merge_partials": [merge_without_max_shift, merge_equal_weights, merge_nan_for_masked_rows, merge_lse_as_max,
                       merge_weights_swapped, merge_masked_lse_zero],
    "zigzag_positions": [contiguous_positions, mirror_off_by_one, no_length_check, divisible_by_cp_only,
                         second_chunk_counted_from_the_end],
    "ring_step": [ring_step_local_mask, ring_step_returns_own_block, ring_step_group_ranks_as_peers,
                  ring_step_waits_first, ring_step_attends_masked_blocks],
    "fixed_kernel": [KeepsTheBlockSoftmax, ForgetsDelta, ForgetsTheScale, StillStale, ForwardMaskOnly,
                     FlattensTheBatch, SumsTheUpstreamOverQueries],
    "ulysses_attention": [ulysses_local_only, ulysses_not_causal, ulysses_reshape_instead_of_concatenate,
                          ulysses_exchange_outside_autograd, ulysses_repeats_kv_first, ulysses_kv_heads_tiled],
}
