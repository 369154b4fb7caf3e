"""Wrong answers for chapter 02 (data parallelism). The launched ones run on real ranks: this module is shipped to
them by value (as a notebook cell's functions are), so the ranks need not import the tests package."""

import contextlib
import sys

import cloudpickle
import torch.distributed as dist

from course_lib.model import lm_loss

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ----------------------------------------------------------------------------------------------------------------
# assign_buckets


def buckets_in_forward_order(sizes, cap):
    """Fills the buckets from the first parameter: the first bucket would wait for the end of backward."""
    buckets, current, total = [], [], 0
    for i in range(len(sizes)):
        current.append(i)
        total += sizes[i]
        if total >= cap:
            buckets.append(current)
            current, total = [], 0
    return buckets + ([current] if current else [])


def buckets_never_exceed_the_cap(sizes, cap):
    """Closes a bucket *before* the tensor that would exceed the cap (not DDP's rule)."""
    buckets, current, total = [], [], 0
    for i in reversed(range(len(sizes))):
        if current and total + sizes[i] > cap:
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += sizes[i]
    return buckets + ([current] if current else [])


def buckets_close_only_above_the_cap(sizes, cap):
    """Closes when the bucket holds more than cap bytes, not at least cap."""
    buckets, current, total = [], [], 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        total += sizes[i]
        if total > cap:
            buckets.append(current)
            current, total = [], 0
    return buckets + ([current] if current else [])


def buckets_drop_the_last_partial_one(sizes, cap):
    """Forgets the last bucket when it is not full: its gradients would never be reduced."""
    buckets, current, total = [], [], 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        total += sizes[i]
        if total >= cap:
            buckets.append(current)
            current, total = [], 0
    return buckets


def buckets_indices_in_definition_order(sizes, cap):
    """DDP's buckets, each listing its parameters in definition order instead of the order backward fills it."""
    buckets, current, total = [], [], 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        total += sizes[i]
        if total >= cap:
            buckets.append(sorted(current))
            current, total = [], 0
    return buckets + ([sorted(current)] if current else [])


# ----------------------------------------------------------------------------------------------------------------
# average_gradients


def average_forgets_to_divide(model, group=None):
    """Sums the gradients: N times too large."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def average_divides_by_the_global_world_size(model, group=None):
    """Divides by all ranks, not by the ranks of the group: wrong as soon as the group is a sub-group."""
    n = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= n


def average_on_rank_zero_only(model, group=None):
    """Reduces to rank 0 and divides there: the other replicas keep their local gradients."""
    n = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.reduce(p.grad, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            p.grad /= n


def average_a_copy(model, group=None):
    """All-reduces a copy of each gradient and drops it: .grad is never changed."""
    n = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.clone()
            dist.all_reduce(g, group=group)
            g /= n


def average_ignores_frozen_parameters(model, group=None):
    """All-reduces every parameter's .grad, even None (a frozen parameter)."""
    n = dist.get_world_size(group)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
        p.grad /= n


# ----------------------------------------------------------------------------------------------------------------
# accumulation_step


def step_loss_not_divided_by_m(model, optimizer, micro):
    """Gradients m times too large (a bug real pipeline code has had; SGD shows it)."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i, (x, y) in enumerate(micro):
        with model.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
            loss = lm_loss(model(x), y)
            loss.backward()
        total += loss.item() / len(micro)
    model.finish_gradient_sync()
    optimizer.step()
    return total


def step_communicates_on_every_micro_batch(model, optimizer, micro):
    """Averages after every micro-batch instead of using no_sync: the same gradients, m times the traffic."""
    m = len(micro)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in micro:
        loss = lm_loss(model(x), y) / m
        loss.backward()
        model.finish_gradient_sync()
        total += loss.item()
    optimizer.step()
    return total


def step_without_no_sync(model, optimizer, micro):
    """Never enters no_sync: every micro-batch's forward arms a synchronising backward."""
    m = len(micro)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in micro:
        loss = lm_loss(model(x), y) / m
        loss.backward()
        total += loss.item()
    model.finish_gradient_sync()
    optimizer.step()
    return total


def step_zeroes_inside_the_loop(model, optimizer, micro):
    """Zeroes the gradients before every micro-batch: only the last one counts."""
    m = len(micro)
    total = 0.0
    for i, (x, y) in enumerate(micro):
        optimizer.zero_grad(set_to_none=True)
        with model.no_sync() if i < m - 1 else contextlib.nullcontext():
            loss = lm_loss(model(x), y) / m
            loss.backward()
        total += loss.item()
    model.finish_gradient_sync()
    optimizer.step()
    return total


def step_forgets_finish_gradient_sync(model, optimizer, micro):
    """Steps on the local gradients: the replicas drift apart."""
    m = len(micro)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i, (x, y) in enumerate(micro):
        with model.no_sync() if i < m - 1 else contextlib.nullcontext():
            loss = lm_loss(model(x), y) / m
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total


def step_returns_the_loss_tensor(model, optimizer, micro):
    """Right training, but returns a tensor (that keeps the graph alive) instead of a float."""
    m = len(micro)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i, (x, y) in enumerate(micro):
        with model.no_sync() if i < m - 1 else contextlib.nullcontext():
            loss = lm_loss(model(x), y) / m
            loss.backward()
        total = total + loss.detach()
    model.finish_gradient_sync()
    optimizer.step()
    return total


# ----------------------------------------------------------------------------------------------------------------
# dp_bytes_per_step


def bytes_one_phase(n_params, bytes_per_grad, n, accumulation):
    """(n-1)/n V: a reduce-scatter only, not the all-gather that follows."""
    return (n - 1) / n * n_params * bytes_per_grad


def bytes_every_micro_batch(n_params, bytes_per_grad, n, accumulation):
    """Counts an all-reduce per micro-batch, as if no_sync did not exist."""
    return accumulation * 2 * (n - 1) / n * n_params * bytes_per_grad


def bytes_2v(n_params, bytes_per_grad, n, accumulation):
    """The large-N limit 2V for every N (wrong for small N, and for N = 1)."""
    return 2 * n_params * bytes_per_grad


def bytes_divided_by_accumulation(n_params, bytes_per_grad, n, accumulation):
    """Spreads one step's bytes over the micro-batches: the bytes of one micro-batch, not of the step."""
    return 2 * (n - 1) / n * n_params * bytes_per_grad / accumulation


def bytes_ring_with_n_plus_one(n_params, bytes_per_grad, n, accumulation):
    """2 n / (n + 1) V: the ring's factor off by one rank."""
    return 2 * n / (n + 1) * n_params * bytes_per_grad


# ----------------------------------------------------------------------------------------------------------------
# overlap_buckets


def _overlap(params, buckets, *, divide=True, per_parameter=False, in_finish=False, reset=True, out_of_order=False,
             wait_in_hook=False):
    import torch

    n = dist.get_world_size()
    bucket_of = {id(params[j]): b for b, bucket in enumerate(buckets) for j in bucket}
    state = {"missing": [len(b) for b in buckets], "next": 0, "in_flight": []}

    def launch(k):
        if per_parameter:
            for j in buckets[k]:
                state["in_flight"].append(([j], params[j].grad, dist.all_reduce(params[j].grad, async_op=True)))
        else:
            flat = torch.cat([params[j].grad.reshape(-1) for j in buckets[k]])
            state["in_flight"].append((buckets[k], flat, dist.all_reduce(flat, async_op=True)))
        if wait_in_hook:
            state["in_flight"][-1][2].wait()

    def hook(p):
        state["missing"][bucket_of[id(p)]] -= 1
        if out_of_order:
            if state["missing"][bucket_of[id(p)]] == 0:
                launch(bucket_of[id(p)])
            return
        while not in_finish and state["next"] < len(buckets) and state["missing"][state["next"]] == 0:
            launch(state["next"])
            state["next"] += 1

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        if in_finish:
            for k in range(len(buckets)):
                launch(k)
        for idx, flat, work in state["in_flight"]:
            work.wait()
            if divide:
                flat /= n
            if flat is not params[idx[0]].grad:
                for j, g in zip(idx, flat.split([params[j].numel() for j in idx]), strict=True):
                    params[j].grad.copy_(g.view_as(params[j]))
        if reset:
            state.update(missing=[len(b) for b in buckets], next=0, in_flight=[])

    return finish


def overlap_never_resets(params, buckets):
    """The given version unchanged: finish() keeps the counters, so from the second step no bucket is launched."""
    return _overlap(params, buckets, reset=False)


def overlap_all_in_finish(params, buckets):
    """Buckets, but every all-reduce starts in finish(), after backward: nothing overlaps."""
    return _overlap(params, buckets, in_finish=True)


def overlap_forgets_to_divide(params, buckets):
    """Sums the gradients over the ranks and never divides by N."""
    return _overlap(params, buckets, divide=False)


def overlap_one_all_reduce_per_parameter(params, buckets):
    """Overlaps, but all-reduces each gradient on its own: as many calls as tensors, not one per bucket."""
    return _overlap(params, buckets, per_parameter=True)


def overlap_launches_out_of_order(params, buckets):
    """Launches each bucket as soon as it is complete, whatever the buckets before it: the ranks can issue the
    all-reduces in different orders (a collective mismatch) when buckets complete out of order."""
    return _overlap(params, buckets, out_of_order=True)


def overlap_resets_before_finish_waits(params, buckets):
    """Resets the counters at the start of finish(), then waits: right, except that the in-flight list is emptied
    before its all-reduces are waited on and written back."""
    finish = _overlap(params, buckets, reset=False)

    def early_reset():
        cells = finish.__closure__
        state = next(c.cell_contents for c in cells if isinstance(c.cell_contents, dict))
        state.update(missing=[len(b) for b in buckets], next=0, in_flight=[])
        finish()
    return early_reset


def overlap_waits_in_the_hook(params, buckets):
    """Waits for each bucket's all-reduce inside the hook that launched it: right values, but backward stalls."""
    return _overlap(params, buckets, wait_in_hook=True)


WRONG = {
    "assign_buckets": [buckets_in_forward_order, buckets_never_exceed_the_cap, buckets_close_only_above_the_cap,
                       buckets_drop_the_last_partial_one, buckets_indices_in_definition_order],
    "average_gradients": [average_forgets_to_divide, average_divides_by_the_global_world_size,
                          average_on_rank_zero_only, average_a_copy, average_ignores_frozen_parameters],
    "accumulation_step": [step_loss_not_divided_by_m, step_communicates_on_every_micro_batch, step_without_no_sync,
                          step_zeroes_inside_the_loop, step_forgets_finish_gradient_sync, step_returns_the_loss_tensor],
    "dp_bytes_per_step": [bytes_one_phase, bytes_every_micro_batch, bytes_2v, bytes_divided_by_accumulation,
                          bytes_ring_with_n_plus_one],
    "overlap_buckets": [overlap_all_in_finish, overlap_forgets_to_divide, overlap_one_all_reduce_per_parameter,
                        overlap_launches_out_of_order, overlap_waits_in_the_hook],
    "fixed_overlap_buckets": [overlap_never_resets, overlap_forgets_to_divide, overlap_resets_before_finish_waits,
                              overlap_all_in_finish, overlap_launches_out_of_order],
}
