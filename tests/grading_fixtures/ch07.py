"""Wrong answers for chapter 07 (mixture of experts and expert parallelism)."""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


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


WRONG = {
    "top_k_with_capacity": [capacity_floor, slot_major_queue, softmax_over_all_experts],
    "dispatch": [unsorted_rows, counts_not_exchanged],
    "load_balancing_loss": [f_not_divided_by_k, without_e_factor],
    "kept_counts": [inclusive_offset, no_cap_per_rank],
}
