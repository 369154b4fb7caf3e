"""Wrong answers for chapter 04 (tensor parallelism). They run on real ranks: this module is shipped to them by value
(as a notebook cell's functions are), so the ranks need not import the tests package."""

import sys

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import comm
from course_lib.parallel import tp

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _seq(x, gather):
    n = dist.get_world_size()
    front = x.movedim(1, 0).contiguous()
    out = torch.empty((front.shape[0] * n if gather else front.shape[0] // n, *front.shape[1:]))
    (comm.all_gather if gather else comm.reduce_scatter)(out, front)
    return out.movedim(0, 1)


class _Enter(torch.autograd.Function):
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


def sp_gbar_backward_slices(x, norm_w, w1, b1, w2, b2):
    """g-bar's backward keeps this rank's slice of its own gradient instead of reduce-scattering the ranks'."""
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


class _EnterAndFc1(torch.autograd.Function):
    """g-bar and fc1 in one, saving only the s/t shard (Megatron-LM's form): the shard is gathered again in
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


class _Buggy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def f_without_backward_all_reduce(x):
    """The bug of the exercise, unchanged."""
    return _Buggy.apply(x)


class _FAveraged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        comm.all_reduce(grad)
        return grad / dist.get_world_size()


def f_averages_instead_of_sums(x):
    """The colleague's f as given: divides by t, as data parallelism would (the ranks used the same X, their
    gradients add up)."""
    return _FAveraged.apply(x)


class _FBothWays(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.detach().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        comm.all_reduce(grad)
        return grad


def f_all_reduces_forward_too(x):
    """Sums in forward as well: f's forward is the identity (X is already the same on every rank)."""
    return _FBothWays.apply(x)


def mlp_bias_added_on_every_rank(x, w1, b1, w2, b2):
    """Adds b2 before g: the bias is summed t times."""
    h = F.gelu(F.linear(tp.copy_to_tensor_parallel_region(x), w1, b1))
    return tp.reduce_from_tensor_parallel_region(F.linear(h, w2, b2))


def mlp_without_f(x, w1, b1, w2, b2):
    """No f: the input gradient stays this rank's partial sum."""
    h = F.gelu(F.linear(x, w1, b1))
    return tp.reduce_from_tensor_parallel_region(F.linear(h, w2)) + b2


def ce_gathers_the_logits(logits, targets):
    """Right loss, but all-gathers the b*s*V logits."""
    return F.cross_entropy(tp.gather_from_tensor_parallel_region(logits), targets)


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


RIGHT = {"sp_region": [sp_regathers_in_backward]}
"""Correct answers other than the solution's: each must score full marks."""

WRONG = {
    "sp_region": [sp_forgets_replicated_grads, sp_averages_replicated_grads, sp_gbar_backward_slices,
                  sp_bias_before_leave, sp_leave_backward_zero_pads],
    "copy_to_region": [f_without_backward_all_reduce, f_averages_instead_of_sums, f_all_reduces_forward_too],
    "tp_mlp": [mlp_bias_added_on_every_rank, mlp_without_f],
    "vocab_parallel_cross_entropy": [ce_gathers_the_logits, ce_without_the_global_max],
}
