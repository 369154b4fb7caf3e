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


class _GAllReducesBackward(torch.autograd.Function):
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


def g_all_reduces_backward_too(x):
    """Sums the gradient again in backward: t x too large."""
    return _GAllReducesBackward.apply(x)


def g_outside_autograd(x):
    """A bare dist.all_reduce in place: the input is modified and autograd never sees the sum."""
    out = x * 1.0
    with torch.no_grad():
        dist.all_reduce(out)
    return out


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


WRONG = {
    "reduce_from_region": [g_all_reduces_backward_too, g_outside_autograd],
    "copy_to_region": [f_without_backward_all_reduce, f_averages_instead_of_sums, f_all_reduces_forward_too],
    "tp_mlp": [mlp_bias_added_on_every_rank, mlp_without_f],
    "vocab_parallel_cross_entropy": [ce_gathers_the_logits, ce_without_the_global_max],
}
