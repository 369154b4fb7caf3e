"""Wrong answers for chapter 04 (tensor parallelism). They run on real ranks: this module is shipped to them by value
(as a notebook cell's functions are), so the ranks need not import the tests package."""

import sys

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import comm
from course_lib.parallel import tp_comm

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _seq(x, gather):
    n = dist.get_world_size()
    front = x.movedim(1, 0).contiguous()
    out = torch.empty((front.shape[0] * n if gather else front.shape[0] // n, *front.shape[1:]))
    (comm.all_gather if gather else comm.reduce_scatter)(out, front)
    return out.movedim(0, 1)


class _Enter(torch.autograd.Function):
    """All-gather along dim 1 forward; backward reduce-scatters (``reduce_back``) or keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, reduce_back):
        ctx.reduce_back = reduce_back
        return _seq(x, True)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_back:
            return _seq(grad, False), None
        return grad.chunk(dist.get_world_size(), 1)[dist.get_rank()].contiguous(), None


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _seq(x, False)

    @staticmethod
    def backward(ctx, grad):
        return _seq(grad, True)


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, scale):
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad)
        return grad * ctx.scale, None


def _sp(x, norm_w, w1, b1, w2, b2, sync=True, scale=1.0, reduce_back=True, bias_inside=False):
    if sync:
        norm_w, b2 = _SumGrad.apply(norm_w, scale), _SumGrad.apply(b2, scale)
    h = F.gelu(F.linear(_Enter.apply(F.rms_norm(x, (x.shape[-1],), norm_w, eps=1e-5), reduce_back), w1, b1))
    if bias_inside:
        return _Leave.apply(F.linear(h, w2, b2))
    return _Leave.apply(F.linear(h, w2)) + b2


def sp_forgets_replicated_grads(x, norm_w, w1, b1, w2, b2):
    """The bug SP brings: norm_w's and b2's gradients stay this rank's tokens' (the replicas drift apart)."""
    return _sp(x, norm_w, w1, b1, w2, b2, sync=False)


def sp_averages_replicated_grads(x, norm_w, w1, b1, w2, b2):
    """All-reduces the replicated gradients and divides by t, as data parallelism would."""
    return _sp(x, norm_w, w1, b1, w2, b2, scale=1.0 / dist.get_world_size())


def sp_gather_backward_slices(x, norm_w, w1, b1, w2, b2):
    """g's backward (the all-gather's) keeps this rank's slice of its own gradient instead of reduce-scattering
    the ranks'."""
    return _sp(x, norm_w, w1, b1, w2, b2, reduce_back=False)


def sp_bias_before_leave(x, norm_w, w1, b1, w2, b2):
    """Adds b2 before the reduce-scatter: the bias is summed t times."""
    return _sp(x, norm_w, w1, b1, w2, b2, bias_inside=True)


class _LeaveOwnTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _seq(x, False)

    @staticmethod
    def backward(ctx, grad):
        n, r = dist.get_world_size(), dist.get_rank()
        return torch.cat([grad if i == r else torch.zeros_like(grad) for i in range(n)], 1)


def sp_leave_backward_zero_pads(x, norm_w, w1, b1, w2, b2):
    """g's backward puts this rank's gradient at its own tokens and zeros elsewhere, instead of all-gathering:
    every rank's partial sum fed every token, so each needs every token's gradient."""
    normed = F.rms_norm(x, (x.shape[-1],), _SumGrad.apply(norm_w, 1.0), eps=1e-5)
    h = F.gelu(F.linear(_Enter.apply(normed, True), w1, b1))
    return _LeaveOwnTokens.apply(F.linear(h, w2)) + _SumGrad.apply(b2, 1.0)


def _dim0(x, gather, world=None):
    """All-gather (or reduce-scatter) along dim 0 as it comes: the batch, not the sequence."""
    n = world or dist.get_world_size()
    out = torch.empty((x.shape[0] * n if gather else x.shape[0] // n, *x.shape[1:]))
    (comm.all_gather if gather else comm.reduce_scatter)(out, x.contiguous())
    return out


class _EnterBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _dim0(x, True)

    @staticmethod
    def backward(ctx, grad):
        return _dim0(grad, False)


class _LeaveBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _dim0(x, False)

    @staticmethod
    def backward(ctx, grad):
        return _dim0(grad, True)


def sp_gathers_along_the_batch(x, norm_w, w1, b1, w2, b2):
    """Gathers and scatters along dim 0 as the collectives come: the ranks' shards stacked as extra sequences of
    s/t tokens. Token by token the MLP gives the same values; the sequences are never whole."""
    normed = F.rms_norm(x, (x.shape[-1],), _SumGrad.apply(norm_w, 1.0), eps=1e-5)
    h = F.gelu(F.linear(_EnterBatch.apply(normed), w1, b1))
    return _LeaveBatch.apply(F.linear(h, w2)) + _SumGrad.apply(b2, 1.0)


class _EnterTwo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.cat(_dim0(x, True, world=2).chunk(2), dim=1)

    @staticmethod
    def backward(ctx, grad):
        return _dim0(torch.cat(grad.chunk(2, dim=1)), False, world=2)


class _LeaveTwo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _dim0(torch.cat(x.chunk(2, dim=1)), False, world=2)

    @staticmethod
    def backward(ctx, grad):
        return torch.cat(_dim0(grad, True, world=2).chunk(2), dim=1)


def sp_assumes_two_ranks(x, norm_w, w1, b1, w2, b2):
    """Right on 2 ranks: the sequence is cut and joined in 2 chunks whatever the world size."""
    normed = F.rms_norm(x, (x.shape[-1],), _SumGrad.apply(norm_w, 1.0), eps=1e-5)
    h = F.gelu(F.linear(_EnterTwo.apply(normed), w1, b1))
    return _LeaveTwo.apply(F.linear(h, w2)) + _SumGrad.apply(b2, 1.0)


class _EnterAndFc1(torch.autograd.Function):
    """g and fc1 in one, saving only the s/t shard (Megatron-LM's form): the shard is gathered again in
    backward."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return F.linear(_seq(x, True), w, b)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        full = _seq(x, True)
        return _seq(grad @ w, False), grad.flatten(0, 1).t() @ full.flatten(0, 1), grad.sum((0, 1))


def sp_regathers_in_backward(x, norm_w, w1, b1, w2, b2):
    """Right, and the memory-saving way: fc1 keeps the shard and re-gathers it in backward (two all-gathers)."""
    normed = F.rms_norm(x, (x.shape[-1],), _SumGrad.apply(norm_w, 1.0), eps=1e-5)
    h = F.gelu(_EnterAndFc1.apply(normed, w1, b1))
    return _Leave.apply(F.linear(h, w2)) + _SumGrad.apply(b2, 1.0)


def _emb_rows(ids, weight, mask=True, hi_inclusive=False):
    n = weight.shape[0]
    local = ids - dist.get_rank() * n
    rows = F.embedding(local.clamp(0, n - 1), weight)
    if not mask:
        return rows
    outside = (local < 0) | ((local > n) if hi_inclusive else (local >= n))
    return rows * ~outside.unsqueeze(-1)


def emb_clamps_without_masking(ids, weight):
    """Clamps the shifted ids into the shard but never zeroes the foreign ones: every rank adds an edge row."""
    return tp_comm.reduce_from_tensor_parallel_region(_emb_rows(ids, weight, mask=False))


def emb_ids_modulo_shard(ids, weight):
    """Looks up ids % (V/t) on every rank: each rank adds a row, whether the id is its own or not."""
    return tp_comm.reduce_from_tensor_parallel_region(F.embedding(ids % weight.shape[0], weight))


def emb_mask_off_by_one(ids, weight):
    """Treats local id V/t as inside the shard: the first id of the next shard is also looked up here."""
    return tp_comm.reduce_from_tensor_parallel_region(_emb_rows(ids, weight, hi_inclusive=True))


def emb_sums_the_gradient_too(ids, weight):
    """g, then f: an all-reduce backward as well, so the shard's gradient is t times one process's."""
    return _SumOver.apply(tp_comm.reduce_from_tensor_parallel_region(_emb_rows(ids, weight)), None)


def emb_hard_coded_vocabulary(ids, weight):
    """The shard's first id written for a vocabulary of 16: rank * 16 / t."""
    n = weight.shape[0]
    local = ids - dist.get_rank() * (16 // dist.get_world_size())
    outside = (local < 0) | (local >= n)
    rows = F.embedding(local.clamp(0, n - 1), weight) * ~outside.unsqueeze(-1)
    return tp_comm.reduce_from_tensor_parallel_region(rows)


def emb_gathers_the_table(ids, weight):
    """Right values and gradients, but all-gathers the whole V x h table to look the ids up."""
    n, r = dist.get_world_size(), dist.get_rank()
    table = torch.empty((n * weight.shape[0], weight.shape[1]))
    comm.all_gather(table, weight.detach().contiguous())
    parts = list(table.chunk(n))
    parts[r] = weight
    return F.embedding(ids, torch.cat(parts))


class _MaskedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        n = weight.shape[0]
        local = ids - dist.get_rank() * n
        inside = (local >= 0) & (local < n)
        out = torch.zeros((*ids.shape, weight.shape[1]))
        out[inside] = weight[local[inside]]
        comm.all_reduce(out)
        ctx.save_for_backward(local, inside)
        ctx.rows = n
        return out

    @staticmethod
    def backward(ctx, grad):
        local, inside = ctx.saved_tensors
        dw = torch.zeros((ctx.rows, grad.shape[-1])).index_add_(0, local[inside], grad[inside])
        return None, dw


def emb_as_one_function(ids, weight):
    """Right: one autograd.Function, boolean indexing forward, index_add of the gradient rows backward."""
    return _MaskedLookup.apply(ids, weight)


class _SumOver(torch.autograd.Function):
    """Megatron's f over ``group`` (None: every rank): identity forward, the gradient summed backward."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumBothOver(torch.autograd.Function):
    """Both K/V gradients in one all-reduce (coalesced)."""

    @staticmethod
    def forward(ctx, wk, wv, group):
        ctx.group, ctx.n = group, wk.numel()
        return wk.view_as(wk), wv.view_as(wv)

    @staticmethod
    def backward(ctx, gk, gv):
        flat = torch.cat([gk.reshape(-1), gv.reshape(-1)])
        comm.all_reduce(flat, group=ctx.group)
        return flat[:ctx.n].view_as(gk), flat[ctx.n:].view_as(gv), None


def _holders(n_kv_head):
    t, r = dist.get_world_size(), dist.get_rank()
    if n_kv_head % t == 0:
        return None
    per = t // n_kv_head
    return [dist.new_group(list(range(k * per, (k + 1) * per))) for k in range(n_kv_head)][r // per]


def _pairs():
    r = dist.get_rank()
    return [dist.new_group([k, k + 1]) for k in range(0, dist.get_world_size(), 2)][r // 2]


def _gqa(x, wq, wk, wv, wo, n_head, n_kv_head, reduce="holders", interleave=False, f=True, split=False):
    t, r = dist.get_world_size(), dist.get_rank()
    b, s, h = x.shape
    d = h // n_head
    group = _holders(n_kv_head)
    if group is not None and reduce == "pairs":
        group = _pairs()
        wk, wv = _SumOver.apply(wk, group), _SumOver.apply(wv, group)
    elif group is not None and reduce == "holders":
        wk, wv = _SumOver.apply(wk, group), _SumOver.apply(wv, group)
    elif group is not None and reduce == "coalesced":
        wk, wv = _SumBothOver.apply(wk, wv, group)
    elif group is not None and reduce == "world":
        wk, wv = _SumOver.apply(wk, None), _SumOver.apply(wv, None)
    if f:
        x = tp_comm.copy_to_tensor_parallel_region(x)
    q, k, v = (F.linear(x, w).view(b, s, -1, d).transpose(1, 2) for w in (wq, wk, wv))
    q_heads = torch.arange(q.shape[1]) + r * q.shape[1]
    if interleave:
        reads = torch.arange(q.shape[1]) % k.shape[1]
    else:
        first = r * k.shape[1] if n_kv_head % t == 0 or split else r // (t // n_kv_head)
        reads = q_heads // (n_head // n_kv_head) - first
    y = F.scaled_dot_product_attention(q, k.index_select(1, reads), v.index_select(1, reads), is_causal=True)
    return tp_comm.reduce_from_tensor_parallel_region(F.linear(y.transpose(1, 2).reshape(b, s, -1), wo))


def gqa_kv_grads_not_summed(x, wq, wk, wv, wo, n_head, n_kv_head):
    """A replicated K/V head keeps each rank's own share of its gradient: the copies step apart."""
    return _gqa(x, wq, wk, wv, wo, n_head, n_kv_head, reduce="none")


def gqa_kv_grads_summed_over_all_ranks(x, wq, wk, wv, wo, n_head, n_kv_head):
    """Sums the K/V gradients over all t ranks: adds the gradients of other heads to this one."""
    return _gqa(x, wq, wk, wv, wo, n_head, n_kv_head, reduce="world")


def gqa_heads_interleaved(x, wq, wk, wv, wo, n_head, n_kv_head):
    """Local query head i reads local K/V head i % n_kv_local: groups are contiguous (q // (n_head / n_kv))."""
    return _gqa(x, wq, wk, wv, wo, n_head, n_kv_head, interleave=True)


def gqa_without_f(x, wq, wk, wv, wo, n_head, n_kv_head):
    """No f before the projections: x's gradient stays this rank's heads' share."""
    return _gqa(x, wq, wk, wv, wo, n_head, n_kv_head, f=False)


def gqa_sums_over_pairs_of_ranks(x, wq, wk, wv, wo, n_head, n_kv_head):
    """Sums a replicated head's gradient over pairs of neighbouring ranks: right while each head has 2 holders."""
    return _gqa(x, wq, wk, wv, wo, n_head, n_kv_head, reduce="pairs")


def gqa_assumes_the_heads_split(x, wq, wk, wv, wo, n_head, n_kv_head):
    """Takes rank r's first K/V head to be r x (its K/V heads), as when t divides n_kv_head, also when the heads
    are replicated: the query heads read a head this rank does not hold."""
    return _gqa(x, wq, wk, wv, wo, n_head, n_kv_head, split=True)


def gqa_coalesced_kv_reduce(x, wq, wk, wv, wo, n_head, n_kv_head):
    """Right: both K/V gradients summed over the holders in one all-reduce."""
    return _gqa(x, wq, wk, wv, wo, n_head, n_kv_head, reduce="coalesced")


def ce_gathers_the_logits(logits, targets):
    """Right loss, but all-gathers the b*s*V logits."""
    return F.cross_entropy(_Enter.apply(logits, False), targets)  # dim 1 of [N, V/t]: gathered, sliced backward


def ce_without_the_global_max(logits, targets):
    """Skips the max: exp overflows for large logits, and 2 all-reduces instead of 3."""
    rank, width = dist.get_rank(), logits.shape[-1]
    local = targets - rank * width
    mine = (local >= 0) & (local < width)
    tl = logits.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) * mine
    ta = tl.detach().clone()
    comm.all_reduce(ta)
    s = logits.exp().sum(-1)
    sa = s.detach().clone()
    comm.all_reduce(sa)
    return ((s + (sa - s.detach())).log() - (tl + (ta - tl.detach()))).mean()


def _ce(logits, targets, *, global_max=True, mask=True, join_sum=True, vocab=None):
    rank, width = dist.get_rank(), logits.shape[-1]
    zmax = logits.detach().max(dim=-1).values
    comm.all_reduce(zmax, op=comm.ReduceOp.MAX if global_max else comm.ReduceOp.SUM)
    z = logits - (zmax if global_max else logits.detach().max(dim=-1).values).unsqueeze(-1)
    local = targets - rank * (width if vocab is None else vocab // dist.get_world_size())
    mine = (local >= 0) & (local < width)
    target_local = z.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) * (mine if mask else 1)
    target_all = target_local.detach().clone()
    comm.all_reduce(target_all)
    target = target_local + (target_all - target_local.detach())
    sum_local = z.exp().sum(dim=-1)
    sum_all = sum_local.detach().clone()
    comm.all_reduce(sum_all)
    total = sum_local + (sum_all - sum_local.detach()) if join_sum else sum_all
    return (total.log() - target).mean()


def ce_local_max(logits, targets):
    """Each rank shifts by its own max (the MAX all-reduce's result unused): the ranks' exponentials are summed on
    different scales."""
    return _ce(logits, targets, global_max=False)


def ce_target_logit_unmasked(logits, targets):
    """Every rank contributes the clamped lookup of the target, held or not: the target logit is summed t times."""
    return _ce(logits, targets, mask=False)


def ce_sum_outside_autograd(logits, targets):
    """The all-reduced sum of exponentials used as a constant: the shard's gradient loses the softmax term."""
    return _ce(logits, targets, join_sum=False)


def ce_hard_coded_vocabulary(logits, targets):
    """The shard's first column written for a vocabulary of 64: rank * 64 / t."""
    return _ce(logits, targets, vocab=64)


RIGHT = {"sp_region": [sp_regathers_in_backward], "vocab_parallel_embedding": [emb_as_one_function],
         "gqa_attention": [gqa_coalesced_kv_reduce]}
"""Correct answers other than the solution's: each must score full marks."""

WRONG = {
    "sp_region": [sp_forgets_replicated_grads, sp_averages_replicated_grads, sp_gather_backward_slices,
                  sp_bias_before_leave, sp_leave_backward_zero_pads, sp_gathers_along_the_batch, sp_assumes_two_ranks],
    "vocab_parallel_embedding": [emb_clamps_without_masking, emb_ids_modulo_shard, emb_mask_off_by_one,
                                 emb_sums_the_gradient_too, emb_gathers_the_table, emb_hard_coded_vocabulary],
    "gqa_attention": [gqa_kv_grads_not_summed, gqa_kv_grads_summed_over_all_ranks, gqa_heads_interleaved,
                      gqa_without_f, gqa_sums_over_pairs_of_ranks, gqa_assumes_the_heads_split],
    "vocab_parallel_cross_entropy": [ce_gathers_the_logits, ce_without_the_global_max, ce_local_max,
                                     ce_target_logit_unmasked, ce_sum_outside_autograd, ce_hard_coded_vocabulary],
}
