"""Chapter 01 — collectives from send/recv, checked on real ranks.

1. ``ring_reduce_scatter(tensor)``: this rank's chunk of the sum over ranks.
2. ``ring_all_gather(chunk, numel)``: every rank's chunk, laid end to end (float32, float64 and int32 chunks).
3. ``ring_all_reduce_bytes(numel, element_size, n, rank)``: the exact (sent, received) bytes of one rank in a ring
   all-reduce, as Python ints, chunks equal or not.
4. ``pairwise_all_to_all(blocks)``: the blocks every rank addressed to this one, in rank order.
5. ``fixed_ring_all_reduce(tensor)`` (find the bug): the sum over ranks, by the ring.

The launched exercises run the learner's function on ``world_size`` real gloo ranks (``course_lib.runtime.launch``,
with a time limit, so a deadlock fails the check instead of hanging it): 2, 3 and 4 ranks, sizes that the rank count
does not divide, other shapes and seeds. On the ranks the process group lets point-to-point messages through and
counts every byte (``ProcessGroup.send``/``recv``, which ``dist.send``, ``isend``, ``batch_isend_irecv`` and
``course_lib.comm`` all end in); a collective (``dist.all_reduce``, ...) raises. Chunks follow
``comm.chunk_numels``. Results are compared with one process on the same per-rank inputs (sums within rtol 1e-5,
data movement exact), inputs must be left unchanged, and the bytes must be the ring's: a right result by another
route (everyone to rank 0) is rejected with the byte counts.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from course_lib.comm import chunk_numels, ring_bytes
from course_lib.grading import core
from course_lib.grading.cases import each, ranks, several
from course_lib.grading.core import (
    CheckFailed,
    CheckResult,
    Exercise,
    expect_close,
    expect_int,
    guard_visible_checks,
    run_check,
)

GRADER_PARAMETERS = {"seed": 1}
LAUNCH_TIMEOUT_S = 30.0
"""A launched check stops the ranks after this long (below the grader's 60 s per check)."""

_TORCH_NAME = {  # ProcessGroup method -> the torch.distributed call that ends in it
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced", "allgather": "all_gather",
    "allgather_coalesced": "all_gather_coalesced", "allgather_into_tensor_coalesced": "all_gather_into_tensor",
    "_allgather_base": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all_single", "broadcast": "broadcast", "reduce": "reduce",
    "gather": "gather", "scatter": "scatter",
}


class ForbiddenCollective(RuntimeError):  # noqa: N818 - reads as what happened
    """Raised on a rank when the learner's function calls a collective instead of sending messages."""


# ----------------------------------------------------------------------------------------------------------------
# On the ranks


def _point_to_point_only(counts: dict[str, int]) -> contextlib.AbstractContextManager[None]:
    """Count the bytes of every send and receive of this process; make every collective raise."""
    def guard(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        if name not in ("send", "recv"):
            return core.refusal(ForbiddenCollective,
                           f"it called the collective dist.{_TORCH_NAME[name]}: this exercise builds the collective "
                           "from point-to-point messages only (dist.isend / dist.irecv, dist.send / dist.recv, "
                           "dist.batch_isend_irecv, or course_lib.comm's)")
        key = "sent" if name == "send" else "recv"

        def counting(self: Any, tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            counts[key] += sum(t.numel() * t.element_size() for t in tensors)
            return original(self, tensors, *args, **kwargs)
        return counting

    return core.patch_process_group(("send", "recv", *_TORCH_NAME), guard)


def _generator(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * seed + rank)


def _inputs(exercise: str, rank: int, n: int, size: Any, seed: int, dtype: str = "float32") -> tuple:
    """The arguments rank ``rank`` passes to the learner's function (the same on every process); the all-gather's
    chunk in ``dtype`` (whole numbers for an integer dtype)."""
    g = _generator(seed, rank)
    if exercise == "reduce_scatter":
        return (torch.randn(size, generator=g),)
    if exercise == "all_gather":
        chunk = torch.randn(chunk_numels(size, n)[rank], generator=g)
        return (chunk * 100).to(getattr(torch, dtype)) if dtype != "float32" else chunk, size
    if exercise == "all_to_all":
        return ([torch.randn(size, generator=g) for _ in range(n)],)
    if exercise == "all_reduce":
        return (torch.randn(size, generator=g),)
    raise ValueError(exercise)


def _run_on_rank(rank: int, world_size: int, exercise: str, fn: Callable[..., Any], size: Any,
                 seed: int, dtype: str = "float32") -> dict[str, Any]:
    """What every rank runs: the learner's function on its inputs, with the point-to-point guard on."""
    args = _inputs(exercise, rank, world_size, size, seed, dtype)
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    counts = {"sent": 0, "recv": 0}
    with _point_to_point_only(counts):
        got = fn(*args)
    after = [a for a in args if isinstance(a, torch.Tensor)]
    modified = any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    return {"got": got, "sent": counts["sent"], "recv": counts["recv"], "modified": modified}


# ----------------------------------------------------------------------------------------------------------------
# In the learner's process


_launch = functools.partial(
    core.launch_check, hang_hint=" (a receive whose send never comes, a wait() on the wrong request, or ranks posting "
    "blocking sends to each other?)", course_files=("course_lib/grading/ch01.py", "course_lib/comm.py"),
    guard_errors=("ForbiddenCollective",))
"""``launch_check(_run_on_rank, world_size, exercise, fn, size, seed, timeout=...)`` with this chapter's hang hint;
a ``ForbiddenCollective`` is reported with its own message."""


def _leftward_ring_bytes(op: str, numel: int, element_size: int, n: int, rank: int) -> tuple[int, int]:
    """(sent, received) bytes of the same ring run the other way (rank r sends to r-1, receives from r+1): a
    reduce-scatter sends every chunk but r and receives every chunk but r+1; an all-gather sends every chunk but
    r-1 and receives every chunk but r; an all-reduce is the two. ``comm.ring_bytes`` gives the rightward ring's."""
    if n == 1:
        return 0, 0
    c = chunk_numels(numel, n)
    rs = (numel - c[rank], numel - c[(rank + 1) % n])
    ag = (numel - c[(rank - 1) % n], numel - c[rank])
    sent, recv = {"reduce_scatter": rs, "all_gather": ag, "all_reduce": (rs[0] + ag[0], rs[1] + ag[1])}[op]
    return sent * element_size, recv * element_size


def _check_bytes(results: list[dict[str, Any]], op: str, numel: int, what: str, element_size: int = 4) -> list[int]:
    """Every rank's (sent, received) bytes are a ring's: the rightward ring of the specification
    (``comm.ring_bytes``) on every rank, or the same ring run leftward on every rank (as correct)."""
    n = len(results)
    got = [(res["sent"], res["recv"]) for res in results]
    rings = {direction: [count(op, numel, element_size, n, r) for r in range(n)]
             for direction, count in (("rightward", ring_bytes), ("leftward", _leftward_ring_bytes))}
    if got in rings.values():
        return [res["sent"] for res in results]
    r = next(r for r in range(n) if got[r] != rings["rightward"][r])
    want_sent, want_recv = rings["rightward"][r]
    left_sent, left_recv = rings["leftward"][r]
    raise CheckFailed(
        f"rank {r} sent {got[r][0]} bytes and received {got[r][1]}; {what} on {n} ranks over {numel} elements of "
        f"{element_size} bytes (chunks {chunk_numels(numel, n)}) sends {want_sent} and receives {want_recv} "
        f"(comm.ring_bytes({op!r}, {numel}, {element_size}, {n}, {r})), or {left_sent} and {left_recv} with the ring "
        "run the other way on every rank. The values were right: they took another route than the ring")


def _expect_unmodified(results: list[dict[str, Any]], what: str) -> None:
    for r, res in enumerate(results):
        if res["modified"]:
            raise CheckFailed(f"rank {r}: the function modified its input {what}; leave it as it was (work on a "
                              "copy: the caller may still need it)")


def _check_rs_case(fn: Callable, n: int, shape: tuple[int, ...], seed: int, timeout: float) -> str:
    numel = math.prod(shape)
    sizes = chunk_numels(numel, n)
    total = sum(_inputs("reduce_scatter", r, n, shape, seed)[0] for r in range(n)).reshape(-1)
    expected = total.split(sizes)
    results = _launch(_run_on_rank, n, "reduce_scatter", fn, shape, seed, timeout=timeout)
    for r, res in enumerate(results):
        expect_close(res["got"], expected[r], f"rank {r}'s chunk ({n} ranks, input shape {shape}, chunk sizes "
                     f"{sizes}; chunk {r} of the sum, flattened)", rtol=1e-5, atol=1e-5)
    _expect_unmodified(results, "tensor")
    sent = _check_bytes(results, "reduce_scatter", numel, "a ring reduce-scatter")
    return f"{n} ranks, shape {shape}, chunks {sizes}: every chunk right; bytes sent per rank {sent} (the ring's)"


RS_CASES = ((4, (10,)), (3, (4, 5)), (2, (7,)))
"""The visible check's (ranks, input shape): uneven chunks on 4 ranks, a 2-D input on 3, 2 ranks."""


def check_ring_reduce_scatter(fn: Callable[[torch.Tensor], torch.Tensor],
                              cases: tuple[tuple[int, tuple[int, ...]], ...] = RS_CASES, seed: int = 0,
                              timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, input shape). Rank r must return chunk r (``comm.chunk_numels``) of the flattened sum over
    ranks, as a 1-D float32 tensor, leave its input unchanged, and send and receive exactly a ring
    reduce-scatter's bytes."""
    return run_check("ring_reduce_scatter",
                     lambda: "; ".join(_check_rs_case(fn, n, tuple(shape), seed, timeout) for n, shape in cases))


def _check_ag_case(fn: Callable, n: int, numel: int, dtype: str, seed: int, timeout: float) -> str:
    sizes = chunk_numels(numel, n)
    expected = torch.cat([_inputs("all_gather", r, n, numel, seed, dtype)[0] for r in range(n)])
    results = _launch(_run_on_rank, n, "all_gather", fn, numel, seed, dtype, timeout=timeout)
    for r, res in enumerate(results):
        expect_close(res["got"], expected, f"rank {r}'s gathered tensor ({n} ranks, numel {numel}, chunk sizes "
                     f"{sizes}, {dtype} chunks: the result keeps their dtype)", rtol=0.0, atol=0.0)
    _expect_unmodified(results, "chunk")
    sent = _check_bytes(results, "all_gather", numel, "a ring all-gather", expected.element_size())
    return f"{n} ranks, numel {numel}, {dtype}: every rank has every chunk; bytes sent per rank {sent}"


AG_CASES = ((4, 10, "float32"), (3, 8, "float64"), (2, 7, "int32"))
"""The visible check's (ranks, numel, dtype): uneven chunks, 3 ranks in float64, 2 ranks of integers."""


def check_ring_all_gather(fn: Callable[[torch.Tensor, int], torch.Tensor],
                          cases: tuple[tuple[int, int, str], ...] = AG_CASES, seed: int = 0,
                          timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, numel, dtype). Every rank must return the 1-D tensor of ``numel`` elements made of the ranks'
    chunks in rank order (rank r brings ``chunk_numels(numel, n)[r]`` elements of ``dtype``), exactly, in the
    chunks' dtype, with a ring all-gather's bytes."""
    return run_check("ring_all_gather",
                     lambda: "; ".join(_check_ag_case(fn, *case, seed, timeout) for case in cases))


def _check_a2a_case(fn: Callable, n: int, block: tuple[int, ...], seed: int, timeout: float) -> str:
    inputs = [_inputs("all_to_all", r, n, block, seed)[0] for r in range(n)]
    results = _launch(_run_on_rank, n, "all_to_all", fn, block, seed, timeout=timeout)
    for r, res in enumerate(results):
        got = res["got"]
        if not isinstance(got, list | tuple) or len(got) != n:
            raise CheckFailed(f"rank {r} must return a list of {n} tensors (one per source rank), got "
                              f"{type(got).__name__}{f' of length {len(got)}' if hasattr(got, '__len__') else ''}")
        for j in range(n):
            expect_close(got[j], inputs[j][r], f"rank {r}'s block {j} of {n} (what rank {j} sent to rank {r})",
                         rtol=0.0, atol=0.0)
    _expect_unmodified(results, "blocks")
    v = n * math.prod(block) * 4
    for r, res in enumerate(results):
        want = v - math.prod(block) * 4
        if (res["sent"], res["recv"]) != (want, want):
            raise CheckFailed(f"rank {r} sent {res['sent']} bytes and received {res['recv']}; an all-to-all of "
                              f"{n} blocks of {math.prod(block)} float32 sends and receives every block but the "
                              f"one it keeps: {want} bytes each way")
    return f"{n} ranks, blocks of shape {block}: every block in its place; {v - v // n} bytes sent per rank"


A2A_CASES = ((4, (3,)), (3, (2, 2)), (2, (4,)))
"""The visible check's (ranks, block shape): 4, 3 and 2 ranks, a 2-D block."""


def check_pairwise_all_to_all(fn: Callable[[list[torch.Tensor]], list[torch.Tensor]],
                              cases: tuple[tuple[int, tuple[int, ...]], ...] = A2A_CASES, seed: int = 0,
                              timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, block shape). Rank r gets ``blocks`` (one tensor of shape ``block`` per destination rank)
    and must return a list whose j-th element is the block rank j addressed to rank r, exactly; it sends all but the
    block it keeps."""
    return run_check("pairwise_all_to_all",
                     lambda: "; ".join(_check_a2a_case(fn, n, tuple(block), seed, timeout) for n, block in cases))


def check_ring_all_reduce_bytes(fn: Callable[[int, int, int, int], tuple[int, int]],
                                cases: tuple[tuple[int, int, int], ...] = ((10, 4, 4), (1000, 2, 8), (2, 2, 1),
                                                                           (2, 4, 3), (5_000_000_000, 2, 16))
                                ) -> CheckResult:
    """``fn(numel, element_size, n, rank)`` must return (sent, received) bytes of that rank in a ring all-reduce,
    for every rank of every (numel, element_size, n) case, exactly as ``comm.ring_bytes("all_reduce", ...)``."""
    def body() -> str:
        count = 0
        for numel, es, n in cases:
            for r in range(n):
                got = fn(numel, es, n, r)
                if not isinstance(got, tuple | list) or len(got) != 2:
                    raise CheckFailed(f"ring_all_reduce_bytes({numel}, {es}, {n}, {r}) must return a pair "
                                      f"(sent, received), got {got!r}")
                want = ring_bytes("all_reduce", numel, es, n, r)
                what = (f"ring_all_reduce_bytes(numel={numel}, element_size={es}, n={n}, rank={r}) with chunks "
                        f"{chunk_numels(numel, n)[:8]}{'...' if n > 8 else ''}")
                expect_int(got[0], want[0], f"{what}: bytes sent")
                expect_int(got[1], want[1], f"{what}: bytes received")
                count += 1
        return f"{count} (case, rank) pairs exact"
    return run_check("ring_all_reduce_bytes", body)


def _check_ar_case(fn: Callable, n: int, numel: int, seed: int, timeout: float) -> str:
    if numel % n:
        raise ValueError(f"numel {numel} must be divisible by the world size {n}")
    expected = sum(_inputs("all_reduce", r, n, numel, seed)[0] for r in range(n))
    results = _launch(_run_on_rank, n, "all_reduce", fn, numel, seed, timeout=timeout)
    for r, res in enumerate(results):
        got = res["got"]
        if not isinstance(got, torch.Tensor) or got.dtype != torch.float32 or got.shape != (numel,):
            raise CheckFailed(f"rank {r} returned {type(got).__name__}"
                              f"{'' if not isinstance(got, torch.Tensor) else f' {got.dtype} {tuple(got.shape)}'}"
                              f"; expected a float32 tensor of shape ({numel},), the sum over ranks")
        expect_close(got, expected, f"rank {r}'s sum ({n} ranks, numel {numel}, chunks of {numel // n})",
                     rtol=1e-5, atol=1e-5)
    _expect_unmodified(results, "tensor")
    sent = _check_bytes(results, "all_reduce", numel, "a ring all-reduce")
    return f"{n} ranks, numel {numel}: every rank has the sum; bytes sent per rank {sent} (the ring's)"


AR_CASES = ((4, 12), (3, 9), (2, 6))
"""The visible check's (ranks, numel): 4, 3 and 2 ranks."""


def check_fixed_ring_all_reduce(fn: Callable[[torch.Tensor], torch.Tensor],
                                cases: tuple[tuple[int, int], ...] = AR_CASES, seed: int = 0,
                                timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, numel). Every rank must return the sum over ranks of the 1-D float32 inputs (``numel``
    divisible by the world size), as a float32 tensor of the same shape, leave its input unchanged, and send and
    receive exactly a ring all-reduce's bytes: 2(n-1) messages of numel/n elements."""
    return run_check("fixed_ring_all_reduce",
                     lambda: "; ".join(_check_ar_case(fn, n, numel, seed, timeout) for n, numel in cases))


POINT_TO_POINT = (*(f"course_lib.comm.{name}" for name in ("send", "recv", "isend", "irecv", "_TimedWork")),
                  "course_lib.comm.chunk_numels")
"""The comm layer's messages (and the handles its isend/irecv return) and the chunk rule: what a collective built
from messages may use."""

EXERCISES = [
    Exercise("ring_reduce_scatter", "Ring reduce-scatter from send/recv", 4, "ring_reduce_scatter",
             check_ring_reduce_scatter,
             hidden=[{"cases": ((2, (9,)),), "seed": 1}, {"cases": ((3, (2, 7)),), "seed": 2},
                     {"cases": ((4, (1003,)),), "seed": 3}],
             allowed=POINT_TO_POINT),
    Exercise("ring_all_gather", "Ring all-gather from send/recv", 3, "ring_all_gather", check_ring_all_gather,
             hidden=[{"cases": ((2, 5, "float32"),), "seed": 1}, {"cases": ((3, 1000, "float32"),), "seed": 2},
                     {"cases": ((4, 4, "float32"),), "seed": 3}, {"cases": ((3, 11, "float64"),), "seed": 4},
                     {"cases": ((2, 9, "int32"),), "seed": 5}],
             allowed=POINT_TO_POINT),
    Exercise("ring_all_reduce_bytes", "Exact bytes of a ring all-reduce", 2, "ring_all_reduce_bytes",
             check_ring_all_reduce_bytes,
             hidden=[{"cases": ((1, 4, 1), (7, 4, 2), (11, 2, 3), (3, 4, 5), (4096, 4, 4), (1001, 2, 7),
                                (6_738_415_616, 2, 64))}],
             allowed=("course_lib.comm.chunk_numels",)),
    Exercise("pairwise_all_to_all", "All-to-all by pairwise exchange", 3, "pairwise_all_to_all",
             check_pairwise_all_to_all,
             hidden=[{"cases": ((2, (5,)),), "seed": 1}, {"cases": ((3, (2, 3)),), "seed": 2},
                     {"cases": ((4, (1,)),), "seed": 3}],
             allowed=POINT_TO_POINT),
    Exercise("fixed_ring_all_reduce", "Find the bug: a ring all-reduce", 3, "fixed_ring_all_reduce",
             check_fixed_ring_all_reduce,
             hidden=[{"cases": ((2, 10),), "seed": 1}, {"cases": ((3, 999),), "seed": 2},
                     {"cases": ((4, 4),), "seed": 3}],
             allowed=POINT_TO_POINT),
]

def _ranks_of(calls: list[dict]) -> set[str]:
    sizes = [case[0] for case in each(calls)]
    return several(sizes, "world sizes").union(*(ranks(n) for n in sizes))


def _bytes_classes(calls: list[dict]) -> set[str]:
    out = several((es for _, es, _ in each(calls)), "element sizes")
    for numel, es, n in each(calls):
        out |= {"one rank" if n == 1 else "uneven chunks" if numel % n else "even chunks"}
        out |= {"fewer elements than ranks"} if numel < n else set()
        out |= {"more than 2^32 bytes"} if numel * es > 2**32 else set()
    return out


CASE_CLASSES = {
    "ring_reduce_scatter": lambda calls: _ranks_of(calls) | {"uneven chunks" for n, shape in each(calls)
                                                             if math.prod(shape) % n}
    | {"an input of several dimensions" for _, shape in each(calls) if len(shape) > 1},
    "ring_all_gather": lambda calls: _ranks_of(calls) | {"uneven chunks" for n, numel, _ in each(calls) if numel % n}
    | {"float32" if d == "float32" else "float64" if d == "float64" else "an integer dtype" for *_, d in each(calls)},
    "ring_all_reduce_bytes": _bytes_classes,
    "pairwise_all_to_all": lambda calls: _ranks_of(calls) | {"a block of several dimensions" for _, block in
                                                             each(calls) if len(block) > 1},
    "fixed_ring_all_reduce": _ranks_of,
}

guard_visible_checks(globals(), EXERCISES)
