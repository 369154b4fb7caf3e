"""Collectives built from point-to-point messages only, so every byte goes through ``course_lib.comm``'s log.

Each function is one classic algorithm, written to be read next to its paper:

=====================  ==========================  ===============  =============================================
function               algorithm                   steps (n ranks)  bytes sent by one rank (V = the full tensor)
=====================  ==========================  ===============  =============================================
ring_reduce_scatter    ring (Patarasuk & Yuan)     n-1              (n-1)/n * V
ring_all_gather        ring                        n-1              (n-1)/n * V
ring_all_reduce        reduce-scatter + gather     2(n-1)           2(n-1)/n * V
all_to_all(_single)    pairwise exchange (Thakur)  n-1              V minus the block a rank keeps
broadcast              pipelined chain             pieces + n - 2   V (every rank but the chain's last)
tree_broadcast         binomial tree (MPICH)       ceil(log2 n)     V per child; the root: ceil(log2 n) * V
naive_all_reduce       reduce to rank 0, send back 2(n-1) at root   root (n-1) * V, the others V
=====================  ==========================  ===============  =============================================

References: P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
JPDC 2009 (the ring); R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 2005 (pairwise exchange, binomial tree, the alpha-beta costs in
``course_lib.estimates.cost``).

Conventions (the same as ``course_lib.comm``):

* Ring chunks: a tensor is flattened and cut into n chunks by ``comm.chunk_numels`` (the first numel % n chunks
  get one element more), so any numel and any n work. In a reduce-scatter, rank r sends chunk (r-k-1) mod n at
  step k and ends owning chunk r, fully reduced; in an all-gather it sends chunk (r-k) mod n at step k. The byte
  counts are then exactly ``comm.ring_bytes``. ``ring_reduce_scatter_chunks`` / ``ring_all_gather_chunks`` say
  which chunk moves when (a figure can draw the ring from them).
* Ranks: inside a ``group`` every function works with group ranks (0..n-1, the ring order) and converts to
  global ranks (what ``torch.distributed`` send/recv want) with ``torch.distributed.get_global_rank``. A
  broadcast's ``src`` is a global rank, as in ``torch.distributed.broadcast``.
* Deadlock freedom: a step that both sends and receives posts ``irecv`` then ``isend`` and waits for both before
  the next step, so no rank blocks in a send that its neighbour will only receive later (gloo and NCCL alike).
* Reduction is a sum; ``average=True`` (floating tensors) divides by n once, on the owned chunk (naive: at the
  root). Summation order is the ring's: chunk c is accumulated starting at rank c+1 and going round to rank c,
  so floating-point results can differ from ``torch.distributed.all_reduce`` (another order) in the last bits;
  integer-valued data agree exactly.

These are teaching implementations: correct for any size, dtype and group, but one message at a time on the
calling thread. Production code calls ``torch.distributed`` (NCCL picks ring or tree itself).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.comm import Group, chunk_numels

__all__ = [
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "naive_all_reduce",
    "naive_all_reduce_bytes",
    "ring_all_gather",
    "ring_all_gather_chunks",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_reduce_scatter_chunks",
    "tree_broadcast",
]


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def _group(group: Group) -> tuple[int, int, Callable[[int], int]]:
    """(size n, this rank's position in the group, group rank -> global rank)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if r < 0:
        raise ValueError("this rank is not a member of the group it was asked to communicate in")
    if group is None or group is dist.group.WORLD:
        return n, r, lambda i: i
    return n, r, lambda i: dist.get_global_rank(group, i)


def _exchange(send_buf: torch.Tensor, dst: int, recv_buf: torch.Tensor, src: int, group: Group) -> None:
    """One step: post the receive from ``src``, post the send to ``dst`` (global ranks), wait for both."""
    target = recv_buf if recv_buf.is_contiguous() else torch.empty_like(recv_buf, memory_format=torch.contiguous_format)
    outgoing = send_buf.contiguous()  # held until the send is done
    recv_work = comm.irecv(target, src, group)
    send_work = comm.isend(outgoing, dst, group)
    recv_work.wait()
    send_work.wait()
    if target is not recv_buf:
        recv_buf.copy_(target)


def _flat_work(tensor: torch.Tensor) -> torch.Tensor:
    """A flat buffer to work in: a view of ``tensor`` when it is contiguous (in place), else a contiguous copy."""
    t = tensor.detach()
    return t.view(-1) if t.is_contiguous() else t.reshape(-1).clone()


def _write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``tensor`` unless it already is a view of it."""
    t = tensor.detach()
    if not (t.is_contiguous() and flat.data_ptr() == t.data_ptr()):
        t.copy_(flat.view(t.shape))


def ring_reduce_scatter_chunks(rank: int, step: int, n: int) -> tuple[int, int]:
    """(chunk sent, chunk received) by group rank ``rank`` at ``step`` (0..n-2) of a ring reduce-scatter.

    Rank r sends chunk (r-step-1) mod n to rank r+1 and receives chunk (r-step-2) mod n from rank r-1, adding it
    to its own copy; what it receives at step k is what it sends at step k+1. After n-1 steps chunk r has passed
    through every rank and stops at rank r: rank r owns the reduced chunk r.
    """
    return (rank - step - 1) % n, (rank - step - 2) % n


def ring_all_gather_chunks(rank: int, step: int, n: int) -> tuple[int, int]:
    """(chunk sent, chunk received) by group rank ``rank`` at ``step`` (0..n-2) of a ring all-gather.

    Rank r starts with chunk r, sends chunk (r-step) mod n to rank r+1 and receives chunk (r-step-1) mod n from
    rank r-1, which it forwards at the next step. After n-1 steps every rank holds every chunk.
    """
    return (rank - step) % n, (rank - step - 1) % n


def _ring_reduce_scatter_flat(flat: torch.Tensor, n: int, r: int, glob: Callable[[int], int],
                              group: Group) -> list[torch.Tensor]:
    """In place on a flat contiguous buffer: afterwards its chunk r holds the sum over ranks. Returns the chunks."""
    chunks = list(flat.split(chunk_numels(flat.numel(), n)))
    incoming = flat.new_empty(max(c.numel() for c in chunks))  # one receive buffer, reused every step
    right, left = glob((r + 1) % n), glob((r - 1) % n)
    for step in range(n - 1):
        send, recv = ring_reduce_scatter_chunks(r, step, n)
        buf = incoming[: chunks[recv].numel()]
        _exchange(chunks[send], right, buf, left, group)
        chunks[recv].add_(buf)  # partial sum of ranks recv+1 .. r
    return chunks


def _ring_all_gather_flat(flat: torch.Tensor, n: int, r: int, glob: Callable[[int], int], group: Group) -> None:
    """In place on a flat contiguous buffer whose chunk r is this rank's: afterwards every chunk is filled."""
    chunks = list(flat.split(chunk_numels(flat.numel(), n)))
    right, left = glob((r + 1) % n), glob((r - 1) % n)
    for step in range(n - 1):
        send, recv = ring_all_gather_chunks(r, step, n)
        _exchange(chunks[send], right, chunks[recv], left, group)  # received straight into place


# ----------------------------------------------------------------------------------------------------------------
# Ring collectives


def ring_reduce_scatter(tensor: torch.Tensor, group: Group = None, *, average: bool = False) -> torch.Tensor:
    """Ring reduce-scatter: return this rank's chunk of the sum of ``tensor`` over the group's ranks.

    The tensor (same shape on every rank) is flattened and cut into n chunks by ``comm.chunk_numels``; group rank
    r gets chunk r, a new 1-D tensor of ``chunk_numels(tensor.numel(), n)[r]`` elements (``average=True``: the
    mean instead of the sum). ``tensor`` itself is not modified. With equal chunks and a tensor of shape
    (n*a, ...) this is ``torch.distributed.reduce_scatter_single``'s output, flattened.

    Algorithm (Patarasuk & Yuan 2009): n-1 steps; at step k rank r sends chunk (r-k-1) mod n to rank r+1,
    receives chunk (r-k-2) mod n from rank r-1 and adds it to its own copy. Bytes per rank: it sends every
    chunk but its own, V - |chunk r| = (n-1)/n * V for equal chunks, and receives V - |chunk r-1|
    (``comm.ring_bytes("reduce_scatter", ...)``). Alpha-beta time: (n-1) alpha + (n-1)/n * V / beta.
    """
    n, r, glob = _group(group)
    flat = tensor.detach().reshape(-1).clone()  # the work buffer; the caller's tensor stays as it was
    mine = _ring_reduce_scatter_flat(flat, n, r, glob, group)[r]
    if average:
        mine.div_(n)
    return mine.clone()  # a tensor of its own, not a view that keeps the whole buffer alive


def ring_all_gather(chunk: torch.Tensor, group: Group = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Ring all-gather: every rank gets every rank's ``chunk``, in group-rank order.

    Two ways to call it:

    * ``ring_all_gather(chunk)``: every rank's chunk has the same shape (a, ...); returns a new tensor of shape
      (n*a, ...) with rank i's chunk at rows i*a..(i+1)*a, as ``torch.distributed.all_gather_single``.
    * ``ring_all_gather(chunk, out=full)``: the inverse of ``ring_reduce_scatter``, uneven chunks allowed:
      ``full`` (any shape, contiguous) is filled with the chunks laid end to end in flat order, rank r's chunk
      holding ``comm.chunk_numels(full.numel(), n)[r]`` elements (its shape does not matter). Returns ``full``.
      So ``ring_all_gather(ring_reduce_scatter(t), out=t)`` is an all-reduce of t.

    Algorithm: n-1 steps; at step k rank r sends chunk (r-k) mod n to rank r+1 and receives chunk (r-k-1) mod n
    from rank r-1, straight into its place. Bytes per rank: sends V - |chunk r+1| = (n-1)/n * V for equal chunks
    (V = the gathered tensor), receives V - |chunk r| (``comm.ring_bytes("all_gather", ...)``).
    """
    n, r, glob = _group(group)
    if out is None:
        shape = (n * chunk.shape[0], *chunk.shape[1:]) if chunk.dim() else (n,)
        out = chunk.new_empty(shape)
    else:
        if not out.is_contiguous():
            raise ValueError("ring_all_gather: out must be contiguous (the chunks are laid out in its memory)")
        if out.dtype != chunk.dtype:
            raise ValueError(f"ring_all_gather: out is {out.dtype} but the chunk is {chunk.dtype}")
        expected = chunk_numels(out.numel(), n)[r]
        if chunk.numel() != expected:
            raise ValueError(f"ring_all_gather: rank {r} of {n} must bring {expected} elements for out of"
                             f" {out.numel()} elements (comm.chunk_numels), got {chunk.numel()}")
    flat = out.detach().view(-1)
    flat.split(chunk_numels(flat.numel(), n))[r].copy_(chunk.detach().reshape(-1))
    _ring_all_gather_flat(flat, n, r, glob, group)
    return out


def ring_all_reduce(tensor: torch.Tensor, group: Group = None, *, average: bool = False) -> torch.Tensor:
    """Ring all-reduce, in place: ``tensor`` becomes the sum (``average=True``: the mean) over the group's ranks.

    Algorithm: a ring reduce-scatter (each rank ends owning one reduced chunk) followed by a ring all-gather of
    those chunks, on the same flat buffer: 2(n-1) steps of V/n. Bytes per rank: 2(n-1)/n * V for equal chunks,
    exactly ``comm.ring_bytes("all_reduce", ...)`` otherwise. Patarasuk & Yuan (2009) show no all-reduce can send
    less per rank, which is why the ring is called bandwidth-optimal; its cost is 2(n-1) latencies:
    2(n-1) alpha + 2(n-1)/n * V / beta. Returns ``tensor``.
    """
    n, r, glob = _group(group)
    if n == 1:
        return tensor
    flat = _flat_work(tensor)
    chunks = _ring_reduce_scatter_flat(flat, n, r, glob, group)
    if average:
        chunks[r].div_(n)  # once per element, on the owner, before it is shared
    _ring_all_gather_flat(flat, n, r, glob, group)
    _write_back(tensor, flat)
    return tensor


# ----------------------------------------------------------------------------------------------------------------
# All-to-all


def all_to_all(inputs: Sequence[torch.Tensor], group: Group = None, *,
               outputs: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Pairwise-exchange all-to-all: ``inputs[j]`` goes to group rank j; returns what each rank j sent here.

    ``outputs`` (optional, one tensor per source rank) are filled in place and returned as a list; without them
    the block from rank j is assumed to have the shape and dtype of ``inputs[j]`` (true for equal splits).

    Algorithm (Thakur et al. 2005, pairwise exchange for any n): the own block is copied locally, then n-1
    steps; at step k rank r sends ``inputs[(r+k) mod n]`` to rank r+k and receives from rank r-k, so at every
    step each rank sends one block and receives one. Bytes per rank: all of ``inputs`` but the block it keeps,
    (n-1)/n * V with equal blocks (V = everything a rank sends, its own block included). Time:
    (n-1) alpha + (n-1)/n * V / beta.
    """
    n, r, glob = _group(group)
    if len(inputs) != n:
        raise ValueError(f"all_to_all: expected one input tensor per rank of the group ({n}), got {len(inputs)}")
    if outputs is None:
        outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]
    elif len(outputs) != n:
        raise ValueError(f"all_to_all: expected one output tensor per rank of the group ({n}), got {len(outputs)}")
    outputs[r].copy_(inputs[r])
    for step in range(1, n):
        dst, src = (r + step) % n, (r - step) % n
        _exchange(inputs[dst].detach(), glob(dst), outputs[src].detach(), glob(src), group)
    return list(outputs)


def all_to_all_single(input: torch.Tensor, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group: Group = None) -> torch.Tensor:
    """``all_to_all`` on one tensor split along dim 0, like ``torch.distributed.all_to_all_single``.

    Rows ``input_split_sizes[j]`` (default: input.shape[0] / n each) go to rank j; the result stacks the
    ``output_split_sizes[j]`` rows (default: the same equal split) received from rank j, in rank order. Same
    algorithm, steps and bytes as ``all_to_all``.
    """
    n, _, _ = _group(group)
    if input.dim() == 0:
        raise ValueError("all_to_all_single: input needs at least one dimension to split")
    if input_split_sizes is None or output_split_sizes is None:
        if input.shape[0] % n:
            raise ValueError(f"all_to_all_single: {input.shape[0]} rows do not split equally over {n} ranks;"
                             " pass input_split_sizes and output_split_sizes")
    in_sizes = list(input_split_sizes) if input_split_sizes is not None else [input.shape[0] // n] * n
    out_sizes = list(output_split_sizes) if output_split_sizes is not None else [input.shape[0] // n] * n
    if len(in_sizes) != n or len(out_sizes) != n or sum(in_sizes) != input.shape[0]:
        raise ValueError(f"all_to_all_single: need {n} input and output split sizes, the input ones summing to"
                         f" {input.shape[0]}; got {in_sizes} and {out_sizes}")
    output = input.new_empty((sum(out_sizes), *input.shape[1:]))
    all_to_all(list(input.split(in_sizes)), group, outputs=list(output.split(out_sizes)))
    return output


# ----------------------------------------------------------------------------------------------------------------
# Broadcast


def _src_position(src: int, group: Group) -> int:
    return src if group is None or group is dist.group.WORLD else dist.get_group_rank(group, src)


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, *, pieces: int | None = None) -> torch.Tensor:
    """Pipelined-chain broadcast, in place: every rank's ``tensor`` becomes that of global rank ``src``.

    Algorithm: the ranks form a chain in group order starting at the source (src, src+1, ..., src-1 mod n). The
    tensor is cut into ``pieces`` parts (default n, at most one per element); each rank receives part i from
    its predecessor and forwards it to its successor while it receives part i+1. The last part leaves the source
    after ``pieces`` sends and reaches the end of the chain n-2 steps later: pieces + n - 2 steps of V/pieces,
    (pieces + n - 2) alpha + (1 + (n-2)/pieces) V / beta, close to V / beta for many pieces. Bytes per rank: every
    rank but the last of the chain sends V, every rank but the source receives V -- ``comm.broadcast``'s
    convention. ``tree_broadcast`` sends fewer, larger messages (better for small tensors). Returns ``tensor``.
    """
    n, r, glob = _group(group)
    pos = (r - _src_position(src, group)) % n  # place in the chain
    if n == 1:
        return tensor
    flat = _flat_work(tensor)
    count = max(1, min(n if pieces is None else pieces, flat.numel()))
    prev, nxt = glob((r - 1) % n), glob((r + 1) % n)
    sends = []
    for part in flat.split(chunk_numels(flat.numel(), count)):
        if pos > 0:
            comm.recv(part, prev, group)
        if pos < n - 1:
            sends.append(comm.isend(part, nxt, group))  # goes out while the next part comes in
    for work in sends:
        work.wait()
    _write_back(tensor, flat)
    return tensor


def tree_broadcast(tensor: torch.Tensor, src: int, group: Group = None) -> torch.Tensor:
    """Binomial-tree broadcast (MPICH's short-message algorithm), in place from global rank ``src``.

    Algorithm: with v = (r - src) mod n the rank relative to the source, rank v receives the whole tensor from
    v minus its lowest set bit, then sends it to v + 2^j for every 2^j below that bit (the source: below n), the
    largest first. Each round doubles the ranks that have the data: ceil(log2 n) rounds of V,
    ceil(log2 n) (alpha + V / beta) -- fewer latencies than the chain, but V per round. Bytes per rank: V times
    its number of children; the source sends ceil(log2 n) * V (``cost.collective_steps("broadcast", ...)``),
    every other rank receives V. Returns ``tensor``.
    """
    n, r, glob = _group(group)
    root = _src_position(src, group)
    v = (r - root) % n
    if n == 1:
        return tensor
    flat = _flat_work(tensor)
    mask = 1
    while mask < n:  # find the parent: v with its lowest set bit cleared
        if v & mask:
            comm.recv(flat, glob((v - mask + root) % n), group)
            break
        mask <<= 1
    sends = []
    mask >>= 1
    while mask > 0:  # children v + 2^j, largest subtree first
        if v + mask < n:
            sends.append(comm.isend(flat, glob((v + mask + root) % n), group))
        mask >>= 1
    for work in sends:
        work.wait()
    _write_back(tensor, flat)
    return tensor


# ----------------------------------------------------------------------------------------------------------------
# The naive all-reduce, for comparison


def naive_all_reduce(tensor: torch.Tensor, group: Group = None, *, average: bool = False) -> torch.Tensor:
    """All-reduce through one root, in place: everyone sends its whole tensor to group rank 0, which adds them
    (in rank order) and sends the sum back to everyone (a parameter server, or MPI reduce + flat broadcast).

    Steps: the root handles 2(n-1) messages of the whole V one after the other, 2(n-1) (alpha + V / beta).
    Bytes: the root sends and receives (n-1) * V, every other rank V (``naive_all_reduce_bytes``). The total over
    all ranks equals the ring's, 2(n-1) V, but it all goes through the root's link: the busiest rank moves
    (n-1) V instead of the ring's 2(n-1)/n V, n/2 times more, growing with n while the ring's stays below 2V.
    At n=2 both send V per rank, yet the naive version still takes 2 V / beta against the ring's V / beta,
    because its two messages cannot overlap. Returns ``tensor``.
    """
    n, r, glob = _group(group)
    if n == 1:
        return tensor
    flat = _flat_work(tensor)
    root = glob(0)
    if r == 0:
        incoming = torch.empty_like(flat)
        for i in range(1, n):
            comm.recv(incoming, glob(i), group)
            flat.add_(incoming)
        if average:
            flat.div_(n)
        sends = [comm.isend(flat, glob(i), group) for i in range(1, n)]
        for work in sends:
            work.wait()
    else:
        comm.send(flat, root, group)
        comm.recv(flat, root, group)
    _write_back(tensor, flat)
    return tensor


def naive_all_reduce_bytes(numel: int, element_size: int, n: int, rank: int) -> tuple[int, int]:
    """(sent, received) bytes of group rank ``rank`` in ``naive_all_reduce``: (n-1) V each at the root (rank 0),
    V each elsewhere, V = numel * element_size. Compare ``comm.ring_bytes("all_reduce", ...)``."""
    v = numel * element_size
    if n == 1:
        return 0, 0
    return ((n - 1) * v, (n - 1) * v) if rank == 0 else (v, v)
