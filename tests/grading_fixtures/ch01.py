"""Wrong answers for chapter 01 (collectives from send/recv). The launched ones run on real ranks: this module is
shipped to them by value (as a notebook cell's functions are), so the ranks need not import the tests package."""

import sys

import cloudpickle
import torch
import torch.distributed as dist

from course_lib.comm import chunk_numels

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _exchange(send, dst, recv, src):
    reqs = [dist.irecv(recv, src), dist.isend(send, dst)]
    for q in reqs:
        q.wait()


# ----------------------------------------------------------------------------------------------------------------
# ring_reduce_scatter


def rs_off_by_one_step(tensor):
    """Sends chunk (r-k) mod n at step k instead of (r-k-1): chunk r leaves first and rank r keeps a partial sum."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(tensor.reshape(-1).clone().split(chunk_numels(tensor.numel(), n)))
    for k in range(n - 1):
        send, recv = (r - k) % n, (r - k - 1) % n
        buf = torch.empty_like(chunks[recv])
        _exchange(chunks[send], (r + 1) % n, buf, (r - 1) % n)
        chunks[recv] += buf
    return chunks[r].clone()


def rs_sums_own_data_twice(tensor):
    """Adds its own chunk again at the end, 'to include itself': its contribution counts twice."""
    n, r = dist.get_world_size(), dist.get_rank()
    flat = tensor.reshape(-1)
    chunks = list(flat.clone().split(chunk_numels(flat.numel(), n)))
    for k in range(n - 1):
        send, recv = (r - k - 1) % n, (r - k - 2) % n
        buf = torch.empty_like(chunks[recv])
        _exchange(chunks[send], (r + 1) % n, buf, (r - 1) % n)
        chunks[recv] += buf
    return chunks[r] + flat.split(chunk_numels(flat.numel(), n))[r]


def rs_equal_chunks(tensor):
    """Cuts numel // n elements per chunk: with numel not divisible by n the remainder is lost."""
    n, r = dist.get_world_size(), dist.get_rank()
    size = tensor.numel() // n
    chunks = [tensor.reshape(-1)[i * size:(i + 1) * size].clone() for i in range(n)]
    for k in range(n - 1):
        send, recv = (r - k - 1) % n, (r - k - 2) % n
        buf = torch.empty_like(chunks[recv])
        _exchange(chunks[send], (r + 1) % n, buf, (r - 1) % n)
        chunks[recv] += buf
    return chunks[r]


def rs_through_rank_zero(tensor):
    """Right values the parameter-server way: everyone sends everything to rank 0, which sums and sends chunk r
    back to rank r -- (n-1) V through rank 0's link."""
    n, r = dist.get_world_size(), dist.get_rank()
    flat = tensor.reshape(-1).clone()
    sizes = chunk_numels(flat.numel(), n)
    if r == 0:
        for src in range(1, n):
            buf = torch.empty_like(flat)
            dist.recv(buf, src)
            flat += buf
        parts = flat.split(sizes)
        for dst in range(1, n):
            dist.send(parts[dst].clone(), dst)
        return parts[0].clone()
    dist.send(flat, 0)
    mine = torch.empty(sizes[r])
    dist.recv(mine, 0)
    return mine


def rs_modifies_input(tensor):
    """Works in place in the caller's tensor (a view of it): right chunk, but the input is destroyed."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(tensor.view(-1).split(chunk_numels(tensor.numel(), n)))
    for k in range(n - 1):
        send, recv = (r - k - 1) % n, (r - k - 2) % n
        buf = torch.empty_like(chunks[recv])
        _exchange(chunks[send], (r + 1) % n, buf, (r - 1) % n)
        chunks[recv] += buf
    return chunks[r].clone()


def rs_calls_dist_reduce_scatter(tensor):
    """Calls the library collective instead of building it."""
    n, r = dist.get_world_size(), dist.get_rank()
    flat = tensor.reshape(-1)
    sizes = chunk_numels(flat.numel(), n)
    out = torch.empty(sizes[r])
    dist.reduce_scatter(out, [c.clone() for c in flat.split(sizes)])
    return out


# ----------------------------------------------------------------------------------------------------------------
# ring_all_gather


def ag_off_by_one_step(chunk, numel):
    """Sends chunk (r-k-1) at step k: at step 0 it forwards a chunk it does not have yet."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = torch.zeros(numel)
    chunks = list(out.split(chunk_numels(numel, n)))
    chunks[r].copy_(chunk)
    for k in range(n - 1):
        send, recv = (r - k - 1) % n, (r - k - 2) % n
        _exchange(chunks[send].clone(), (r + 1) % n, chunks[recv], (r - 1) % n)
    return out


def ag_stores_at_senders_slot(chunk, numel):
    """Forwards correctly but writes whatever arrives from rank r-1 into rank r-1's slot, whichever chunk it is
    (wrong chunk owner): the other slots stay empty."""
    n, r = dist.get_world_size(), dist.get_rank()
    sizes = chunk_numels(numel, n)
    out = torch.zeros(numel)
    slots = list(out.split(sizes))
    slots[r].copy_(chunk)
    current = chunk.clone()
    for k in range(n - 1):
        buf = torch.empty(sizes[(r - k - 1) % n])
        _exchange(current, (r + 1) % n, buf, (r - 1) % n)
        if buf.numel() == slots[(r - 1) % n].numel():
            slots[(r - 1) % n].copy_(buf)
        current = buf
    return out


def ag_equal_chunks(chunk, numel):
    """Assumes every rank brings numel // n elements (right only when n divides numel)."""
    n, r = dist.get_world_size(), dist.get_rank()
    size = numel // n
    out = torch.zeros(numel)
    chunks = [out[i * size:(i + 1) * size] for i in range(n)]
    chunks[r].copy_(chunk[:size])
    for k in range(n - 1):
        send, recv = (r - k) % n, (r - k - 1) % n
        _exchange(chunks[send].clone(), (r + 1) % n, chunks[recv], (r - 1) % n)
    return out


def ag_own_chunk_to_everyone(chunk, numel):
    """Right values, but not a ring: each rank sends its own chunk straight to every other rank."""
    n, r = dist.get_world_size(), dist.get_rank()
    sizes = chunk_numels(numel, n)
    out = torch.empty(numel)
    chunks = list(out.split(sizes))
    chunks[r].copy_(chunk)
    for k in range(1, n):
        _exchange(chunk, (r + k) % n, chunks[(r - k) % n], (r - k) % n)
    return out


# ----------------------------------------------------------------------------------------------------------------
# ring_all_reduce_bytes


def bytes_float_formula(numel, element_size, n, rank):
    """2(n-1)/n * V for everyone: right only when n divides numel (and a float)."""
    v = numel * element_size
    return 2 * (n - 1) / n * v, 2 * (n - 1) / n * v


def bytes_one_phase(numel, element_size, n, rank):
    """Counts the reduce-scatter only, forgetting the all-gather."""
    c = chunk_numels(numel, n)
    return (numel - c[rank]) * element_size, (numel - c[(rank - 1) % n]) * element_size


def bytes_same_chunk_in_both_phases(numel, element_size, n, rank):
    """Thinks a rank skips its own chunk in both phases (the all-gather skips chunk r+1 when sending)."""
    c = chunk_numels(numel, n)
    return 2 * (numel - c[rank]) * element_size, 2 * (numel - c[rank]) * element_size


# ----------------------------------------------------------------------------------------------------------------
# pairwise_all_to_all


def a2a_no_exchange(blocks):
    """Returns its own blocks: nothing was exchanged."""
    return [b.clone() for b in blocks]


def a2a_wrong_slot(blocks):
    """Stores the block received from rank r-k in slot r+k."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = [b.clone() for b in blocks]
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        buf = torch.empty_like(blocks[src])
        _exchange(blocks[dst], dst, buf, src)
        out[dst] = buf
    return out


def a2a_forgets_own_block(blocks):
    """Exchanges correctly but leaves its own slot empty (zeros) instead of keeping blocks[r]."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = [torch.zeros_like(b) for b in blocks]
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        _exchange(blocks[dst], dst, out[src], src)
    return out


def a2a_calls_dist_all_to_all(blocks):
    """Calls the library collective instead of building it."""
    out = [torch.empty_like(b) for b in blocks]
    dist.all_to_all(out, [b.contiguous() for b in blocks])
    return out


# ----------------------------------------------------------------------------------------------------------------
# fixed_ring_all_reduce (find the bug)


def _ring_all_reduce(x, gather_shift, steps=None, gather=True):
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = x.view(-1).chunk(n)
    incoming = torch.empty_like(chunks[0])
    for k in range(n - 1 if steps is None else steps):
        _exchange(chunks[(r - k - 1) % n], (r + 1) % n, incoming, (r - 1) % n)
        chunks[(r - k - 2) % n].add_(incoming)
    for k in range((n - 1 if steps is None else steps) if gather else 0):
        _exchange(chunks[(r - k - gather_shift) % n], (r + 1) % n, incoming, (r - 1) % n)
        chunks[(r - k - gather_shift - 1) % n].copy_(incoming)
    return x


def ar_the_bug_kept(tensor):
    """The given version unchanged: its all-gather starts from chunk r-1, which is not complete on rank r."""
    return _ring_all_reduce(tensor.clone(), gather_shift=1)


def ar_fixed_in_place(tensor):
    """The right ring, but on the caller's tensor: the input is overwritten."""
    return _ring_all_reduce(tensor, gather_shift=0)


def ar_one_step_a_phase(tensor):
    """The fix, with one step in each phase (n - 1 written as 1): right on 2 ranks only."""
    return _ring_all_reduce(tensor.clone(), gather_shift=0, steps=1)


def ar_reduce_scatter_only(tensor):
    """The fix without the all-gather phase: only chunk r + 1 is the full sum on rank r."""
    return _ring_all_reduce(tensor.clone(), gather_shift=0, gather=False)


def a2a_neighbours_only(blocks):
    """Exchanges with the next and the previous rank only (the ring's neighbours): right on 2 ranks."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = [b.clone() for b in blocks]
    dst, src = (r + 1) % n, (r - 1) % n
    _exchange(blocks[dst], dst, out[src], src)
    return out


def bytes_equal_chunks(numel, element_size, n, rank):
    """Every chunk numel // n elements: the remainder never travels."""
    if n == 1:
        return 0, 0
    c = numel // n
    return 2 * (n - 1) * c * element_size, 2 * (n - 1) * c * element_size


def ar_calls_dist_all_reduce(tensor):
    """Not a ring: asks the backend."""
    out = tensor.clone()
    dist.all_reduce(out)
    return out


def ag_float32_output(chunk, numel):
    """The right ring into a float32 buffer whatever the chunks' dtype: float64 loses digits, int32 comes back
    as floats."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = torch.empty(numel)
    places = list(out.split(chunk_numels(numel, n)))
    places[r].copy_(chunk.reshape(-1))
    for k in range(n - 1):
        _exchange(places[(r - k) % n], (r + 1) % n, places[(r - k - 1) % n], (r - 1) % n)
    return out


def bytes_as_floats(numel, element_size, n, rank):
    """The right counts, as floats (the specification says ints)."""
    if n == 1:
        return 0.0, 0.0
    c = chunk_numels(numel, n)
    return (float((2 * numel - c[rank] - c[(rank + 1) % n]) * element_size),
            float((2 * numel - c[(rank - 1) % n] - c[rank]) * element_size))


def rs_leftward_ring(tensor):
    """Correct: the ring run the other way (send to r-1, receive from r+1; chunk (r+k+1) leaves at step k)."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(tensor.reshape(-1).clone().split(chunk_numels(tensor.numel(), n)))
    for k in range(n - 1):
        send, recv = (r + k + 1) % n, (r + k + 2) % n
        incoming = torch.empty_like(chunks[recv])
        _exchange(chunks[send], (r - 1) % n, incoming, (r + 1) % n)
        chunks[recv] += incoming
    return chunks[r].clone()


def ag_leftward_ring(chunk, numel):
    """Correct: the all-gather's ring run the other way round."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = torch.empty(numel, dtype=chunk.dtype)
    places = list(out.split(chunk_numels(numel, n)))
    places[r].copy_(chunk.reshape(-1))
    for k in range(n - 1):
        _exchange(places[(r + k) % n], (r - 1) % n, places[(r + k + 1) % n], (r + 1) % n)
    return out


RIGHT = {"ring_reduce_scatter": [rs_leftward_ring], "ring_all_gather": [ag_leftward_ring]}
"""Correct answers other than the solution's: each must score full marks."""

WRONG = {
    "ring_reduce_scatter": [rs_off_by_one_step, rs_sums_own_data_twice, rs_equal_chunks, rs_through_rank_zero,
                            rs_modifies_input, rs_calls_dist_reduce_scatter],
    "ring_all_gather": [ag_off_by_one_step, ag_stores_at_senders_slot, ag_equal_chunks, ag_own_chunk_to_everyone,
                        ag_float32_output],
    "ring_all_reduce_bytes": [bytes_float_formula, bytes_one_phase, bytes_same_chunk_in_both_phases,
                              bytes_as_floats, bytes_equal_chunks],
    "pairwise_all_to_all": [a2a_no_exchange, a2a_wrong_slot, a2a_forgets_own_block, a2a_calls_dist_all_to_all,
                            a2a_neighbours_only],
    "fixed_ring_all_reduce": [ar_the_bug_kept, ar_fixed_in_place, ar_calls_dist_all_reduce, ar_one_step_a_phase,
                              ar_reduce_scatter_only],
}

