"""Wrong answers for chapter 07 (mixture of experts and expert parallelism). The launched ones run on real ranks:
this module is shipped to them by value (as a notebook cell's functions are)."""

import math
import sys

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _positions(chosen, E):
    mask = F.one_hot(chosen.reshape(-1), E)
    return (mask.cumsum(0) - 1).gather(1, chosen.reshape(-1, 1)).view_as(chosen)


def capacity_floor(logits, k, capacity_factor):
    """floor instead of ceil: one slot short whenever cf*T*k/E is not an integer."""
    T, E = logits.shape
    top, chosen = logits.topk(k, dim=-1)
    return chosen, top.softmax(-1), _positions(chosen, E) < math.floor(capacity_factor * T * k / E)


def slot_major_queue(logits, k, capacity_factor):
    """Queues every first choice before any second choice (GShard's priority), not token order."""
    T, E = logits.shape
    top, chosen = logits.topk(k, dim=-1)
    pos = _positions(chosen.T.contiguous(), E).T
    return chosen, top.softmax(-1), pos < math.ceil(capacity_factor * T * k / E)


def softmax_over_all_experts(logits, k, capacity_factor):
    """Weights from the softmax over all E logits (not renormalised over the k selected)."""
    T, E = logits.shape
    chosen = logits.topk(k, dim=-1).indices
    weights = logits.softmax(-1).gather(1, chosen)
    return chosen, weights, _positions(chosen, E) < math.ceil(capacity_factor * T * k / E)


def unsorted_rows(x, expert, n_expert):
    """Forgets to sort the rows by expert: rows reach the wrong ranks."""
    world = dist.get_world_size()
    n_local = n_expert // world
    send = torch.bincount(expert, minlength=n_expert)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    counts = recv.view(world, n_local)
    out = x.new_empty(int(counts.sum()), x.shape[1])
    dist.all_to_all_single(out, x.contiguous(), counts.sum(1).tolist(), send.view(world, n_local).sum(1).tolist())
    return out, counts


def counts_not_exchanged(x, expert, n_expert):
    """Returns its own send counts as if they were the receive counts (and sizes the receive by them)."""
    world = dist.get_world_size()
    n_local = n_expert // world
    order = torch.argsort(expert, stable=True)
    send = torch.bincount(expert, minlength=n_expert).view(world, n_local)
    rank = dist.get_rank()
    counts = send[rank:rank + 1].repeat(world, 1)
    return x[order], counts


def _way_back(y, counts, expert):
    """The expert outputs of this rank's assignments, in the order it dispatched them (sorted by expert)."""
    world, n_local = counts.shape
    sent = torch.bincount(expert, minlength=world * n_local).view(world, n_local).sum(1).tolist()
    back = y.new_empty(expert.numel(), y.shape[1])
    dist.all_to_all_single(back, y.contiguous(), sent, counts.sum(1).tolist())
    return back


def combine_in_dispatch_order(y, counts, expert, token, weight, n_tokens):
    """Forgets that the rows come back sorted by expert: adds them to the tokens in the original order."""
    back = _way_back(y, counts, expert)
    return y.new_zeros(n_tokens, y.shape[1]).index_add(0, token, weight[:, None] * back)


def combine_without_weights(y, counts, expert, token, weight, n_tokens):
    """Sums the k expert outputs of a token without its router weights."""
    order = torch.argsort(expert, stable=True)
    return y.new_zeros(n_tokens, y.shape[1]).index_add(0, token[order], _way_back(y, counts, expert))


def combine_by_all_gather(y, counts, expert, token, weight, n_tokens):
    """Gathers every rank's expert outputs instead of one all-to-all back (refused: moves W x the bytes)."""
    out = [torch.empty_like(y) for _ in range(counts.shape[0])]
    dist.all_gather(out, y)
    return y.new_zeros(n_tokens, y.shape[1])


def f_not_divided_by_k(probs, chosen, alpha):
    """f_i = counts / T: k times too large for top-k."""
    T, E = probs.shape
    f = torch.bincount(chosen.reshape(-1), minlength=E).float() / T
    return alpha * E * (f * probs.mean(0)).sum()


def without_e_factor(probs, chosen, alpha):
    """Forgets the factor E: uniform routing gives alpha / E."""
    E = probs.shape[1]
    f = torch.bincount(chosen.reshape(-1), minlength=E).float() / chosen.numel()
    return alpha * (f * probs.mean(0)).sum()


def inclusive_offset(counts, capacity):
    """The draft's bug: the offset includes the rank's own assignments."""
    if capacity is None:
        return counts.clone()
    return (capacity - counts.cumsum(0)).clamp(min=0).minimum(counts)


def no_cap_per_rank(counts, capacity):
    """Caps every rank at C on its own, forgetting that the ranks share each expert's queue."""
    if capacity is None:
        return counts.clone()
    return counts.clamp(max=capacity)


def bias_from_local_counts(bias, chosen, rate):
    """Updates from this rank's own counts: the ranks' biases drift apart and none is the batch's."""
    load = torch.bincount(chosen.reshape(-1), minlength=bias.numel()).float()
    return bias + rate * torch.sign(load.mean() - load)


def bias_sign_flipped(bias, chosen, rate):
    """Raises the bias of the busy experts (sign(load - mean)): the imbalance grows."""
    counts = torch.bincount(chosen.reshape(-1), minlength=bias.numel())
    dist.all_reduce(counts)
    load = counts.float()
    return bias + rate * torch.sign(load - load.mean())


def bias_averaged_over_ranks(bias, chosen, rate):
    """Each rank updates from its own loads, then the biases are averaged: the mean of signs, not the sign of the
    batch's load."""
    load = torch.bincount(chosen.reshape(-1), minlength=bias.numel()).float()
    new = bias + rate * torch.sign(load.mean() - load)
    dist.all_reduce(new)
    return new / dist.get_world_size()


WRONG = {
    "top_k_with_capacity": [capacity_floor, slot_major_queue, softmax_over_all_experts],
    "dispatch": [unsorted_rows, counts_not_exchanged],
    "combine": [combine_in_dispatch_order, combine_without_weights, combine_by_all_gather],
    "load_balancing_loss": [f_not_divided_by_k, without_e_factor],
    "kept_counts": [inclusive_offset, no_cap_per_rank],
    "update_expert_bias": [bias_from_local_counts, bias_sign_flipped, bias_averaged_over_ranks],
}
