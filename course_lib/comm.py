"""Instrumented communication: the torch.distributed calls the course uses, each one logged.

Every call appends a ``CommRecord`` (op, group, bytes, seconds) to this process's log, so a chapter can put the
bytes a rank really moved next to the formula that predicts them, and a test can assert the counts.

Bytes on the wire, **measured** or **modelled** (``CommRecord.bytes_kind``). ``tensor_bytes`` is the size V of the
data the collective is about (the full buffer of an all-reduce, the *gathered output* of an all-gather, the *input*
of a reduce-scatter). ``sent_bytes`` and ``recv_bytes`` are what *this rank* transmits:

* point-to-point (send/recv, isend/irecv): **measured**, exact: the message is the tensor we hand to the backend;
* every backend collective below is **modelled**: the bytes its algorithm would move, not an observation of what
  gloo or NCCL really moved (the backend picks its own algorithm: trees, direct exchange, in-switch reduction);
* all-to-all: everything except the block a rank keeps for itself (the least any algorithm must move);
* all-reduce, all-gather, reduce-scatter: what the bandwidth-optimal **ring** algorithm sends (Patarasuk & Yuan
  2009; the "bus bandwidth" convention of nccl-tests): all-gather and reduce-scatter (N-1)/N * V, all-reduce
  2(N-1)/N * V. With V not divisible by N the chunks differ by one element and the count is exact per rank.
  The backend may use another algorithm (gloo often does); the from-scratch ring collectives in
  ``course_lib.runtime.collectives`` send exactly these bytes through logged send/recv (measured records), and a test
  checks that the measured sum equals the model;
* broadcast: a pipelined chain from the source: every rank but the last in the chain sends V once.

``watching(watcher)`` lets an instrument see every call as it starts and as it ends (chapter 11's flight
recorder, as PyTorch's Flight Recorder sits inside its process groups): a call that never ends is a hang.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp
Group = dist.ProcessGroup | None

MEASURED = "measured"
"""``bytes_kind`` of a point-to-point record: the bytes our own send/recv handed to the backend."""
MODELLED = "modelled"
"""``bytes_kind`` of a backend collective's record: the bytes of the algorithm's formula (ring, chain)."""
POINT_TO_POINT = ("send", "recv")


@dataclass
class CommRecord:
    """One communication call as seen by one rank. ``seconds`` is None until an async call is waited on.

    ``bytes_kind`` says where ``sent_bytes`` / ``recv_bytes`` come from: ``MEASURED`` for our own point-to-point
    messages, ``MODELLED`` for a backend collective (the formula of its algorithm). Left out, it follows the op.
    """

    op: str
    group: str
    group_size: int
    tensor_bytes: int
    sent_bytes: int
    recv_bytes: int
    seconds: float | None
    peer: int | None = None  # the other rank (global id) of a point-to-point op
    bytes_kind: str | None = None  # MEASURED or MODELLED; None: MEASURED for send/recv, MODELLED otherwise

    def __post_init__(self) -> None:
        if self.bytes_kind is None:
            self.bytes_kind = MEASURED if self.op in POINT_TO_POINT else MODELLED
        if self.bytes_kind not in (MEASURED, MODELLED):
            raise ValueError(f"bytes_kind must be {MEASURED!r} or {MODELLED!r}, got {self.bytes_kind!r}")


@dataclass(eq=False)  # logs are compared by identity: two logs with equal records are still two logs
class CommLog:
    """The records of one rank, in call order, with small helpers to count them."""

    records: list[CommRecord] = field(default_factory=list)

    def select(self, op: str | None = None, group: str | None = None, kind: str | None = None) -> list[CommRecord]:
        """The records of ``op`` in ``group`` whose bytes are ``kind`` (MEASURED / MODELLED); None: any."""
        return [r for r in self.records if (op is None or r.op == op) and (group is None or r.group == group)
                and (kind is None or r.bytes_kind == kind)]

    def count(self, op: str | None = None, group: str | None = None, kind: str | None = None) -> int:
        return len(self.select(op, group, kind))

    def sent_bytes(self, op: str | None = None, group: str | None = None, kind: str | None = None) -> int:
        return sum(r.sent_bytes for r in self.select(op, group, kind))

    def recv_bytes(self, op: str | None = None, group: str | None = None, kind: str | None = None) -> int:
        return sum(r.recv_bytes for r in self.select(op, group, kind))

    def seconds(self, op: str | None = None, group: str | None = None) -> float:
        return sum(r.seconds or 0.0 for r in self.select(op, group))

    def summary(self) -> list[dict[str, object]]:
        """One row per (op, group): calls, tensor bytes, sent and received bytes (measured or modelled), seconds."""
        rows: dict[tuple[str, str], dict[str, object]] = {}
        for r in self.records:
            row = rows.setdefault((r.op, r.group), {"op": r.op, "group": r.group, "calls": 0, "tensor_bytes": 0,
                                                    "sent_bytes": 0, "recv_bytes": 0, "bytes_kind": r.bytes_kind,
                                                    "seconds": 0.0})
            row["calls"] += 1
            row["tensor_bytes"] += r.tensor_bytes
            row["sent_bytes"] += r.sent_bytes
            row["recv_bytes"] += r.recv_bytes
            row["seconds"] += r.seconds or 0.0
        return list(rows.values())

    def table(self, timings: bool = False) -> str:
        """The summary as aligned text (without seconds unless asked: they vary from run to run)."""
        cols = ["op", "group", "calls", "tensor_bytes", "sent_bytes", "recv_bytes", "bytes_kind"] + (
            ["seconds"] if timings else [])
        rows = [[f"{row[c]:.4f}" if c == "seconds" else str(row[c]) for c in cols] for row in self.summary()]
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        return "\n".join(lines)

    def clear(self) -> None:
        self.records.clear()


_LOGS: list[CommLog] = [CommLog()]  # the process-wide log, then any active ``recording()`` blocks
_GROUP_NAMES: dict[int, str] = {}
Watcher = Callable[[str, CommRecord, "Group", tuple[torch.Tensor, ...]], None]
"""``watcher(event, record, group, tensors)``: event "start" before the backend is called, "end" once the call
(or, async, its ``wait()``) returned; ``tensors`` the call's input and output."""
_WATCHERS: list[Watcher] = []


def log() -> CommLog:
    """This process's log since it started (or since ``log().clear()``)."""
    return _LOGS[0]


@contextlib.contextmanager
def recording() -> Iterator[CommLog]:
    """Collect the calls made inside the block in a fresh log (they still go to ``log()`` too)."""
    fresh = CommLog()
    _LOGS.append(fresh)
    try:
        yield fresh
    finally:
        _LOGS[:] = [lg for lg in _LOGS if lg is not fresh]


@contextlib.contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """Call ``watcher`` at the start and the end of every call made inside the block (see ``Watcher``)."""
    _WATCHERS.append(watcher)
    try:
        yield
    finally:
        _WATCHERS.remove(watcher)


def name_group(group: dist.ProcessGroup, name: str) -> dist.ProcessGroup:
    """Give a process group the name the log shows for it ("dp", "tp", ...). Returns the group."""
    _GROUP_NAMES[id(group)] = name
    return group


def group_label(group: Group) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    return _GROUP_NAMES.get(id(group)) or f"ranks{dist.get_process_group_ranks(group)}"


def global_rank(group: Group, group_rank: int) -> int:
    """The global rank of the ``group_rank``-th member of ``group`` (what send/recv/broadcast take)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _add(record: CommRecord) -> CommRecord:
    for lg in _LOGS:
        lg.records.append(record)
    return record


def add_record(record: CommRecord) -> CommRecord:
    """Log a record made outside this module (a backend's own collective seen by a dispatch mode) as ours are:
    into ``log()`` and every open ``recording()``."""
    return _add(record)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def chunk_numels(numel: int, n: int) -> list[int]:
    """How a flat buffer of ``numel`` elements splits into n ring chunks: the first numel % n get one more."""
    base, extra = divmod(numel, n)
    return [base + (i < extra) for i in range(n)]


def ring_bytes(op: str, numel: int, element_size: int, n: int, rank: int) -> tuple[int, int]:
    """(sent, received) bytes of rank ``rank`` (position in the group) in a ring ``op`` over ``numel`` elements.

    Ring reduce-scatter: at step k rank r sends chunk (r-k-1) mod n and receives chunk (r-k-2) mod n, so it sends
    every chunk but chunk r (which it ends up owning) and receives every chunk but chunk r-1. Ring all-gather:
    at step k it sends chunk (r-k) and receives chunk (r-k-1): it sends all but chunk r+1 and receives all but
    its own chunk r. All-reduce = reduce-scatter + all-gather. Equal chunks give (n-1)/n * V per phase.
    """
    if op not in ("reduce_scatter", "all_gather", "all_reduce"):
        raise ValueError(f"no ring byte count for {op!r}; expected all_reduce, all_gather or reduce_scatter")
    if n == 1:
        return 0, 0
    c = chunk_numels(numel, n)
    rs = (numel - c[rank], numel - c[(rank - 1) % n])
    ag = (numel - c[(rank + 1) % n], numel - c[rank])
    sent, recv = {"reduce_scatter": rs, "all_gather": ag, "all_reduce": (rs[0] + ag[0], rs[1] + ag[1])}[op]
    return sent * element_size, recv * element_size


class _TimedWork:
    """An async handle whose ``wait()`` fills in the record's seconds (issue -> completion)."""

    def __init__(self, work: dist.Work, record: CommRecord, start: float, ended: Callable[[], None]) -> None:
        self._work, self._record, self._start, self._ended = work, record, start, ended

    def wait(self) -> bool:
        ok = self._work.wait()
        if self._record.seconds is None:
            self._record.seconds = time.perf_counter() - self._start
            self._ended()
        return ok

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _run(call, record: CommRecord, async_op: bool, group: Group, *tensors: torch.Tensor):
    watchers = list(_WATCHERS)
    for w in watchers:
        w("start", record, group, tensors)

    def ended() -> None:
        for w in watchers:
            w("end", record, group, tensors)

    start = time.perf_counter()
    work = call()
    _add(record)
    if async_op:
        return _TimedWork(work, record, start, ended)
    record.seconds = time.perf_counter() - start
    ended()
    return None


def _size_rank(group: Group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


# ----------------------------------------------------------------------------------------------------------------
# Collectives


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp = ReduceOp.SUM, group: Group = None,
               async_op: bool = False) -> _TimedWork | None:
    """In place: every rank ends with op(tensor of all ranks). Ring bytes per rank 2(N-1)/N * V."""
    n, r = _size_rank(group)
    sent, recv = ring_bytes("all_reduce", tensor.numel(), tensor.element_size(), n, r)
    rec = CommRecord("all_reduce", group_label(group), n, nbytes(tensor), sent, recv, None)
    return _run(lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), rec, async_op, group,
                tensor)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group = None,
               async_op: bool = False) -> _TimedWork | None:
    """``output`` (N x input, concatenated along dim 0) gets every rank's ``input``. Ring bytes (N-1)/N * V."""
    n, r = _size_rank(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected {n} x {input.numel()}")
    sent, recv = ring_bytes("all_gather", output.numel(), output.element_size(), n, r)
    rec = CommRecord("all_gather", group_label(group), n, nbytes(output), sent, recv, None)
    return _run(lambda: dist.all_gather_single(output, input, group=group, async_op=async_op), rec, async_op,
                group, input, output)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp = ReduceOp.SUM,
                   group: Group = None, async_op: bool = False) -> _TimedWork | None:
    """Rank r's ``output`` gets chunk r of op(``input`` of all ranks). Ring bytes (N-1)/N * V, V = input."""
    n, r = _size_rank(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected {n} x {output.numel()}")
    sent, recv = ring_bytes("reduce_scatter", input.numel(), input.element_size(), n, r)
    rec = CommRecord("reduce_scatter", group_label(group), n, nbytes(input), sent, recv, None)
    return _run(lambda: dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op), rec,
                async_op, group, input, output)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int] | None = None,
               input_split_sizes: Sequence[int] | None = None, group: Group = None,
               async_op: bool = False) -> _TimedWork | None:
    """Rank r sends block j of ``input`` (dim 0) to rank j and receives block j of ``output`` from rank j.
    Exact bytes: all of ``input`` but the block it keeps, (N-1)/N * V with equal splits."""
    n, r = _size_rank(group)
    row_in = nbytes(input) // max(input.shape[0], 1) if input.dim() else nbytes(input)
    row_out = nbytes(output) // max(output.shape[0], 1) if output.dim() else nbytes(output)
    keep_in = (input_split_sizes[r] * row_in) if input_split_sizes else nbytes(input) // n
    keep_out = (output_split_sizes[r] * row_out) if output_split_sizes else nbytes(output) // n
    rec = CommRecord("all_to_all", group_label(group), n, nbytes(input), nbytes(input) - keep_in,
                     nbytes(output) - keep_out, None)
    return _run(lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                               async_op=async_op), rec, async_op, group, input, output)


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op: bool = False) -> _TimedWork | None:
    """Every rank gets ``tensor`` of global rank ``src``. Chain convention: all but the last rank send V."""
    n, r = _size_rank(group)
    src_pos = dist.get_group_rank(group, src) if group is not None else src
    pos = (r - src_pos) % n  # place in the chain starting at the source
    v = nbytes(tensor)
    rec = CommRecord("broadcast", group_label(group), n, v, v if pos < n - 1 else 0, v if pos > 0 else 0, None)
    return _run(lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), rec, async_op, group,
                tensor)


def barrier(group: Group = None) -> None:
    """Wait for every rank of the group (no payload)."""
    n, _ = _size_rank(group)
    _run(lambda: dist.barrier(group=group), CommRecord("barrier", group_label(group), n, 0, 0, 0, None), False,
         group)


# ----------------------------------------------------------------------------------------------------------------
# Point to point (``peer`` is a global rank, as in torch.distributed)


def send(tensor: torch.Tensor, dst: int, group: Group = None) -> None:
    n, _ = _size_rank(group)
    rec = CommRecord("send", group_label(group), n, nbytes(tensor), nbytes(tensor), 0, None, dst)
    _run(lambda: dist.send(tensor, dst=dst, group=group), rec, False, group, tensor)


def recv(tensor: torch.Tensor, src: int, group: Group = None) -> None:
    n, _ = _size_rank(group)
    rec = CommRecord("recv", group_label(group), n, nbytes(tensor), 0, nbytes(tensor), None, src)
    _run(lambda: dist.recv(tensor, src=src, group=group), rec, False, group, tensor)


def isend(tensor: torch.Tensor, dst: int, group: Group = None) -> _TimedWork:
    n, _ = _size_rank(group)
    rec = CommRecord("send", group_label(group), n, nbytes(tensor), nbytes(tensor), 0, None, dst)
    return _run(lambda: dist.isend(tensor, dst=dst, group=group), rec, True, group, tensor)


def irecv(tensor: torch.Tensor, src: int, group: Group = None) -> _TimedWork:
    n, _ = _size_rank(group)
    rec = CommRecord("recv", group_label(group), n, nbytes(tensor), 0, nbytes(tensor), None, src)
    return _run(lambda: dist.irecv(tensor, src=src, group=group), rec, True, group, tensor)
