"""Wrong answers for chapter 03 (ZeRO / FSDP). The launched ones run on real ranks: this module is shipped to
them by value (as a notebook cell's functions are), so the ranks need not import the tests package."""

import math
import sys

import cloudpickle
import torch
import torch.distributed as dist

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ----------------------------------------------------------------------------------------------------------------
# shard_range


def range_without_padding(numel, world_size, rank):
    """numel // N per rank: the last elements belong to nobody."""
    s = numel // world_size
    return rank * s, (rank + 1) * s


def range_uneven_chunks(numel, world_size, rank):
    """Chapter 01's ring chunks (the first numel % N ranks one element longer) instead of padded equal shards."""
    base, extra = divmod(numel, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def range_owner_offset(numel, world_size, rank):
    """Shard of the right neighbour: rank r takes [(r+1) S, (r+2) S) modulo the buffer."""
    padded = -(-numel // world_size) * world_size
    s = padded // world_size
    r = (rank + 1) % world_size
    return r * s, (r + 1) * s


def range_clipped_to_numel(numel, world_size, rank):
    """ceil(numel / N) a rank, the last shard cut at numel: the padding belongs to nobody."""
    s = -(-numel // world_size)
    return min(rank * s, numel), min((rank + 1) * s, numel)


def range_as_floats(numel, world_size, rank):
    """The padded bounds, as floats (numel / N rounded up with math.ceil on a float division)."""
    s = float(math.ceil(numel / world_size))
    return rank * s, (rank + 1) * s


# ----------------------------------------------------------------------------------------------------------------
# zero1_sgd_step


def zero1_forgets_to_average(param, grad, state, lr, momentum):
    """The reduce-scatter sums; nobody divides by N."""
    n, r = dist.get_world_size(), dist.get_rank()
    s = param.numel() // n
    g = torch.empty(s)
    dist.reduce_scatter_single(g, grad)
    buf = state.get("momentum_buffer")
    buf = g.clone() if buf is None else buf.mul_(momentum).add_(g)
    state["momentum_buffer"] = buf
    dist.all_gather_single(param, param[r * s:(r + 1) * s] - lr * buf)


def zero1_updates_the_full_tensor(param, grad, state, lr, momentum):
    """Plain DP with a ZeRO name: all-reduce, full momentum, every rank updates everything."""
    g = grad.clone()
    dist.all_reduce(g)
    g /= dist.get_world_size()
    buf = state.get("momentum_buffer")
    buf = g.clone() if buf is None else buf.mul_(momentum).add_(g)
    state["momentum_buffer"] = buf
    param -= lr * buf


def zero1_wrong_shard(param, grad, state, lr, momentum):
    """Applies its reduced chunk to the right neighbour's shard (owner offset off by one)."""
    n, r = dist.get_world_size(), dist.get_rank()
    s = param.numel() // n
    g = torch.empty(s)
    dist.reduce_scatter_single(g, grad)
    g /= n
    buf = state.get("momentum_buffer")
    buf = g.clone() if buf is None else buf.mul_(momentum).add_(g)
    state["momentum_buffer"] = buf
    o = (r + 1) % n
    dist.all_gather_single(param, param[o * s:(o + 1) * s] - lr * buf)


def zero1_gathers_every_gradient(param, grad, state, lr, momentum):
    """Right values, sharded state, but all-gathers every rank's whole gradient (N x the bytes) to average it."""
    n, r = dist.get_world_size(), dist.get_rank()
    s = param.numel() // n
    every = torch.empty(n * grad.numel())
    dist.all_gather_single(every, grad)
    g = every.view(n, -1).mean(0)[r * s:(r + 1) * s]
    buf = state.get("momentum_buffer")
    buf = g.clone() if buf is None else buf.mul_(momentum).add_(g)
    state["momentum_buffer"] = buf
    dist.all_gather_single(param, param[r * s:(r + 1) * s] - lr * buf)


# ----------------------------------------------------------------------------------------------------------------
# gather_unit


def zero1_hard_coded_hyperparameters(param, grad, state, lr, momentum):
    """The right ZeRO-1 step with the chapter's lr = 0.1 and momentum = 0.9 written in."""
    n, r = dist.get_world_size(), dist.get_rank()
    s = param.numel() // n
    g = torch.empty(s)
    dist.reduce_scatter_single(g, grad)
    g /= n
    buf = state.get("momentum_buffer")
    buf = g.clone() if buf is None else buf.mul_(0.9).add_(g)
    state["momentum_buffer"] = buf
    dist.all_gather_single(param, param[r * s:(r + 1) * s] - 0.1 * buf)


def _views(flat, shapes):
    out, offset = [], 0
    for shape in shapes:
        k = math.prod(shape)
        out.append(flat[offset:offset + k].view(shape))
        offset += k
    return out


def gather_then_clone(shard, numel, shapes):
    """Right values, but each parameter is a copy: twice the unit's memory, and no single buffer to free."""
    flat = torch.empty(dist.get_world_size() * shard.numel())
    dist.all_gather_single(flat, shard)
    return [v.clone() for v in _views(flat, shapes)]


def gather_into_a_float32_buffer(shard, numel, shapes):
    """One all-gather into one float32 buffer whatever the shard's dtype: a float64 unit loses its digits (and a
    bf16 one would take twice its memory)."""
    flat = torch.empty(dist.get_world_size() * shard.numel(), dtype=torch.float32)
    dist.all_gather_into_tensor(flat, shard.float())
    return _views(flat, shapes)


def gather_by_all_reduce(shard, numel, shapes):
    """A zero buffer with its own shard written in, summed by all-reduce: twice the bytes of an all-gather."""
    n, r = dist.get_world_size(), dist.get_rank()
    flat = torch.zeros(n * shard.numel())
    flat[r * shard.numel():(r + 1) * shard.numel()] = shard
    dist.all_reduce(flat)
    return _views(flat, shapes)


def gather_in_reverse_rank_order(shard, numel, shapes):
    """Stacks the gathered shards last rank first."""
    n = dist.get_world_size()
    flat = torch.empty(n * shard.numel())
    dist.all_gather_single(flat, shard)
    flat = flat.view(n, -1).flip(0).reshape(-1)
    return _views(flat, shapes)


def gather_views_of_the_unpadded_part(shard, numel, shapes):
    """Gathers the padded unit, then copies its first numel elements into a buffer of their own: views of a buffer
    without the padding, not of the gathered one."""
    flat = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype)
    dist.all_gather_single(flat, shard)
    return _views(flat[:numel].clone(), shapes)


# ----------------------------------------------------------------------------------------------------------------
# grad_shard (find the bug)


def _reduce_scatter_padded(grad, s, dtype):
    n = dist.get_world_size()
    padded = torch.zeros(n * s, dtype=dtype)
    k = min(grad.numel(), n * s)
    padded[:k] = grad[:k]
    out = torch.empty(s, dtype=dtype)
    dist.reduce_scatter_single(out, padded)
    return out / n


def shard_plus_one(grad):
    """The colleague's bug left in: numel // N + 1 elements per shard (one too many when N divides numel)."""
    return _reduce_scatter_padded(grad, grad.numel() // dist.get_world_size() + 1, grad.dtype)


def shard_rounded_down(grad):
    """numel // N per shard: the last elements are dropped."""
    return _reduce_scatter_padded(grad, max(1, grad.numel() // dist.get_world_size()), grad.dtype)


def shard_in_float32(grad):
    """The right shard, computed in a float32 buffer whatever the input's dtype."""
    return _reduce_scatter_padded(grad, -(-grad.numel() // dist.get_world_size()), torch.float32)


def shard_for_four_ranks(grad):
    """The fix with N written as 4: right on 4 ranks only."""
    n = 4
    s = -(-grad.numel() // n)
    padded = torch.zeros(dist.get_world_size() * s, dtype=grad.dtype)
    padded[:min(grad.numel(), padded.numel())] = grad[:padded.numel()]
    out = torch.empty(s, dtype=grad.dtype)
    dist.reduce_scatter_single(out, padded)
    return out / n


def shard_by_all_reduce(grad):
    """All-reduce the whole gradient, then slice: refused (ZeRO never holds the whole reduced gradient)."""
    n, r = dist.get_world_size(), dist.get_rank()
    s = -(-grad.numel() // n)
    padded = torch.zeros(n * s, dtype=grad.dtype)
    padded[:grad.numel()] = grad
    dist.all_reduce(padded)
    return padded[r * s:(r + 1) * s] / n


WRONG = {
    "shard_range": [range_without_padding, range_uneven_chunks, range_owner_offset, range_clipped_to_numel,
                    range_as_floats],
    "zero1_sgd_step": [zero1_forgets_to_average, zero1_updates_the_full_tensor, zero1_wrong_shard,
                       zero1_gathers_every_gradient, zero1_hard_coded_hyperparameters],
    "gather_unit": [gather_then_clone, gather_by_all_reduce, gather_in_reverse_rank_order,
                    gather_into_a_float32_buffer, gather_views_of_the_unpadded_part],
    "grad_shard": [shard_plus_one, shard_rounded_down, shard_in_float32, shard_by_all_reduce, shard_for_four_ranks],
}
