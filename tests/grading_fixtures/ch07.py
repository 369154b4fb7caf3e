"""Wrong answers for chapter 07 (mixture of experts and expert parallelism). The launched ones run on real ranks:
this module is shipped to them by value (as a notebook cell's functions are)."""

import math
import sys

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _keep(chosen, order, E, capacity, rounds=True):
    """keep [T, k]: the queues filled token by token in ``order``, round by round (or a token's k choices at once)."""
    T, k = chosen.shape
    queue = chosen[order].T.reshape(-1) if rounds else chosen[order].reshape(-1)
    place = (F.one_hot(queue, E).cumsum(0) - 1).gather(1, queue[:, None])[:, 0]
    keep = torch.empty(T, k, dtype=torch.bool)
    keep[order] = (place.view(k, T).T if rounds else place.view(T, k)) < capacity
    return keep


def _by_priority(logits):
    return logits.softmax(-1).amax(-1).sort(descending=True, stable=True).indices


def bpr_token_order(logits, k, capacity_factor):
    """The chapter's queue (token after token, a token's choices together): no priority at all."""
    T, E = logits.shape
    chosen = logits.topk(k, dim=-1).indices
    return chosen, _keep(chosen, torch.arange(T), E, math.ceil(capacity_factor * T * k / E), rounds=False)


def bpr_token_major(logits, k, capacity_factor):
    """Tokens by priority, but each token's k choices queued together: a second choice beats others' first."""
    T, E = logits.shape
    chosen = logits.topk(k, dim=-1).indices
    return chosen, _keep(chosen, _by_priority(logits), E, math.ceil(capacity_factor * T * k / E), rounds=False)


def bpr_priority_by_logit(logits, k, capacity_factor):
    """The priority is the top logit, not the top router probability."""
    T, E = logits.shape
    chosen = logits.topk(k, dim=-1).indices
    order = logits.amax(-1).sort(descending=True, stable=True).indices
    return chosen, _keep(chosen, order, E, math.ceil(capacity_factor * T * k / E))


def bpr_capacity_floor(logits, k, capacity_factor):
    """floor instead of ceil: one slot short whenever cf*T*k/E is not an integer."""
    T, E = logits.shape
    chosen = logits.topk(k, dim=-1).indices
    return chosen, _keep(chosen, _by_priority(logits), E, math.floor(capacity_factor * T * k / E))


def bpr_unstable_ties(logits, k, capacity_factor):
    """Equal priorities in reverse token order (the later token first)."""
    T, E = logits.shape
    chosen = logits.topk(k, dim=-1).indices
    rev = torch.arange(T - 1, -1, -1)
    order = rev[logits[rev].softmax(-1).amax(-1).sort(descending=True, stable=True).indices]
    return chosen, _keep(chosen, order, E, math.ceil(capacity_factor * T * k / E))


def bpr_by_counting(logits, k, capacity_factor):
    """Right: the specification's loops, slot counters per expert."""
    T, E = logits.shape
    chosen = logits.topk(k, dim=-1).indices.tolist()
    p = logits.softmax(-1).amax(-1).tolist()
    tokens = sorted(range(T), key=lambda t: (-p[t], t))
    left, keep = [math.ceil(capacity_factor * T * k / E)] * E, torch.zeros(T, k, dtype=torch.bool)
    for j in range(k):
        for t in tokens:
            if left[chosen[t][j]] > 0:
                left[chosen[t][j]] -= 1
                keep[t, j] = True
    return torch.tensor(chosen), keep


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


def _dispatch_by_key(x, key, n_expert):
    """The solution's dispatch, with the rows sorted and counted by ``key`` (a destination slot) instead of expert."""
    world = dist.get_world_size()
    send = torch.bincount(key, minlength=n_expert)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    counts = recv.view(world, n_expert // world)
    out = x.new_empty(int(counts.sum()), x.shape[1])
    dist.all_to_all_single(out, x[torch.argsort(key, stable=True)].contiguous(), counts.sum(1).tolist(),
                           send.view(world, -1).sum(1).tolist())
    return out, counts


def dispatch_round_robin_placement(x, expert, n_expert):
    """Places expert e on rank e % world (round robin) instead of the block of n_local consecutive experts."""
    world = dist.get_world_size()
    return _dispatch_by_key(x, (expert % world) * (n_expert // world) + expert // world, n_expert)


def dispatch_counts_transposed(x, expert, n_expert):
    """Reads the received counts as [n_local, world] and transposes: counts[s, j] is no longer source s's."""
    out, counts = _dispatch_by_key(x, expert, n_expert)
    world, n_local = counts.shape
    return out, counts.reshape(-1).view(n_local, world).T.contiguous()


def dispatch_received_by_expert(x, expert, n_expert):
    """Regroups the received rows by local expert (all sources of expert 0 first): the spec keeps them by source
    rank, then by expert."""
    out, counts = _dispatch_by_key(x, expert, n_expert)
    world, n_local = counts.shape
    chunks = out.split(counts.reshape(-1).tolist())
    return torch.cat([chunks[s * n_local + j] for j in range(n_local) for s in range(world)]), counts


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


def combine_weights_unsorted(y, counts, expert, token, weight, n_tokens):
    """Reorders the token ids to the dispatch order but not the router weights: each row gets another's weight."""
    order = torch.argsort(expert, stable=True)
    back = _way_back(y, counts, expert)
    return y.new_zeros(n_tokens, y.shape[1]).index_add(0, token[order], weight[:, None] * back)


def combine_overwrites(y, counts, expert, token, weight, n_tokens):
    """Writes each row into its token's output (index assignment): a token's second expert overwrites its first."""
    order = torch.argsort(expert, stable=True)
    out = y.new_zeros(n_tokens, y.shape[1])
    out[token[order]] = weight[order, None] * _way_back(y, counts, expert)
    return out


def combine_in_bf16(y, counts, expert, token, weight, n_tokens):
    """Sends the expert outputs back in bfloat16 to halve the bytes: the output is no longer the layer's."""
    order = torch.argsort(expert, stable=True)
    back = _way_back(y.to(torch.bfloat16), counts, expert).float()
    return y.new_zeros(n_tokens, y.shape[1]).index_add(0, token[order], weight[order, None] * back)


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


def f_from_probabilities(probs, chosen, alpha):
    """Uses the mean router probability for f_i too: alpha E sum P_i^2 ignores which experts were chosen."""
    P = probs.mean(0)
    return alpha * probs.shape[1] * (P * P).sum()


def f_first_choice_only(probs, chosen, alpha):
    """Counts only each token's first choice (Switch's top-1 f_i) although k experts were chosen."""
    E = probs.shape[1]
    f = torch.bincount(chosen[:, 0], minlength=E).float() / chosen.shape[0]
    return alpha * E * (f * probs.mean(0)).sum()


def p_summed_over_tokens(probs, chosen, alpha):
    """P_i as the sum of the router probabilities over tokens, not their mean: T times too large."""
    E = probs.shape[1]
    f = torch.bincount(chosen.reshape(-1), minlength=E).float() / chosen.numel()
    return alpha * E * (f * probs.sum(0)).sum()


def loss_detached(probs, chosen, alpha):
    """Computes the loss from probs.detach(): the right value, but the router gets no gradient from it."""
    E = probs.shape[1]
    f = torch.bincount(chosen.reshape(-1), minlength=E).float() / chosen.numel()
    return alpha * E * (f * probs.detach().mean(0)).sum()


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


def offset_along_experts(counts, capacity):
    """The exclusive cumulative sum over experts (dim 1) instead of over ranks (dim 0)."""
    if capacity is None:
        return counts.clone()
    offset = counts.cumsum(1) - counts
    return (capacity - offset).clamp(min=0).minimum(counts)


def no_clamp_at_zero(counts, capacity):
    """Forgets clamp(min=0): a rank that queues after the expert is full keeps a negative number."""
    if capacity is None:
        return counts.clone()
    return (capacity - (counts.cumsum(0) - counts)).minimum(counts)


def last_rank_first(counts, capacity):
    """Queues the ranks from the last one: the drops fall on rank 0's tokens instead of the last rank's."""
    if capacity is None:
        return counts.clone()
    offset = counts.flip(0).cumsum(0).flip(0) - counts
    return (capacity - offset).clamp(min=0).minimum(counts)


def capacity_off_by_one(counts, capacity):
    """Keeps positions < C - 1 (one slot short per expert), reading 'position < C' as 'position + 1 < C'."""
    if capacity is None:
        return counts.clone()
    offset = counts.cumsum(0) - counts
    return (capacity - 1 - offset).clamp(min=0).minimum(counts)


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


def bias_proportional_to_imbalance(bias, chosen, rate):
    """Moves the bias by rate * (mean load - load_i), not by its sign: steps grow with the batch."""
    counts = torch.bincount(chosen.reshape(-1), minlength=bias.numel())
    dist.all_reduce(counts)
    load = counts.float()
    return bias + rate * (load.mean() - load)


def bias_counts_reduced_to_rank_0(bias, chosen, rate):
    """Sums the counts with dist.reduce to rank 0 only: the other ranks update from partial counts."""
    counts = torch.bincount(chosen.reshape(-1), minlength=bias.numel())
    dist.reduce(counts, dst=0)
    load = counts.float()
    return bias + rate * torch.sign(load.mean() - load)


def bias_first_choice_only(bias, chosen, rate):
    """Counts only each token's first expert: the load ignores the other k - 1 choices."""
    counts = torch.bincount(chosen[:, 0], minlength=bias.numel())
    dist.all_reduce(counts)
    load = counts.float()
    return bias + rate * torch.sign(load.mean() - load)


WRONG = {
    "batch_priority_routing": [bpr_token_order, bpr_token_major, bpr_priority_by_logit, bpr_capacity_floor,
                               bpr_unstable_ties],
    "dispatch": [unsorted_rows, counts_not_exchanged, dispatch_round_robin_placement, dispatch_counts_transposed,
                 dispatch_received_by_expert],
    "combine": [combine_in_dispatch_order, combine_without_weights, combine_by_all_gather, combine_weights_unsorted,
                combine_overwrites, combine_in_bf16],
    "load_balancing_loss": [f_not_divided_by_k, without_e_factor, f_from_probabilities, f_first_choice_only,
                            p_summed_over_tokens, loss_detached],
    "kept_counts": [inclusive_offset, no_cap_per_rank, offset_along_experts, no_clamp_at_zero, last_rank_first,
                    capacity_off_by_one],
    "update_expert_bias": [bias_from_local_counts, bias_sign_flipped, bias_averaged_over_ranks,
                           bias_proportional_to_imbalance, bias_counts_reduced_to_rank_0, bias_first_choice_only],
}
RIGHT = {"batch_priority_routing": [bpr_by_counting]}
