"""A flight recorder: every collective and point-to-point call of this rank, in a ring buffer.

As PyTorch's Flight Recorder (``TORCH_FR_BUFFER_SIZE``, dumped on a watchdog timeout with
``TORCH_NCCL_DUMP_ON_TIMEOUT``), each call the comm layer makes is an ``Entry`` from the moment it starts: its
sequence number on its group (the n-th collective of that group on this rank: what the ranks of a group must agree
on), the op, the group's ranks, the tensors' shapes and dtype, the step, where in the code it was called, and
when it started and ended. A call that never ends is what a hung rank is blocked in. Only the last ``capacity``
entries are kept (``Trace.dropped`` says how many were overwritten), as a ring buffer must: a job running for days
cannot keep them all.

``Trace`` is the picklable dump (what ``watch`` writes to disk when a call has been in flight for too long), read
by ``desync`` and ``hang``. What recording adds per call (a stack walk and an entry) is measured by
``benchmarks/debug_bench.py``; without a recorder the comm layer does nothing more.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from course_lib import comm

Frame = tuple[str, int, str]
"""(file, line, function) of one stack frame."""
_SKIP = (os.path.join("course_lib", "comm.py"), os.path.join("course_lib", "debug", "recorder.py"))


@dataclass(frozen=True)
class Entry:
    """One call as this rank made it. ``seq``: its position among all of this rank's calls; ``group_seq``: among
    this group's collectives (or its point-to-point calls: ``p2p``); ``where``: the call's stack outside the comm
    layer, innermost first; ``end`` None: the call had not returned when the trace was taken."""

    seq: int
    group_seq: int
    op: str
    group: str
    ranks: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    peer: int | None
    step: int | None
    where: tuple[Frame, ...]
    start: float
    end: float | None = None

    @property
    def p2p(self) -> bool:
        return self.op in comm.POINT_TO_POINT

    @property
    def signature(self) -> tuple:
        """What every rank of the group must agree on: op, shapes, dtype and the line that called it."""
        return self.op, self.shapes, self.dtype, self.site

    @property
    def site(self) -> str:
        """The innermost frame outside the comm layer, as ``file.py:line function``."""
        return format_frame(self.where[0]) if self.where else "?"

    def describe(self) -> str:
        shapes = ", ".join("x".join(map(str, s)) or "scalar" for s in self.shapes) or "no tensor"
        return f"{self.op} #{self.group_seq} on {self.group} {list(self.ranks)} ({shapes} {self.dtype})"


def format_frame(frame: Frame) -> str:
    file, line, func = frame
    return f"{os.path.basename(file)}:{line} {func}"


@dataclass
class Trace:
    """One rank's dump: its entries (oldest first), how many were dropped before them, whether the rank's function
    had returned (``finished``) and when the dump was taken."""

    rank: int
    entries: list[Entry]
    dropped: int = 0
    finished: bool = False
    taken: float = field(default_factory=time.time)

    def in_flight(self) -> list[Entry]:
        """The calls that had started and not returned (a blocked rank's last one is where it waits)."""
        return [e for e in self.entries if e.end is None]

    def collectives(self) -> list[Entry]:
        return [e for e in self.entries if not e.p2p]


class FlightRecorder:
    """Records this rank's calls while ``recording()`` is open (a ``comm.Watcher``). ``step``: set by whoever
    drives the loop (``watch`` does), stored with each entry."""

    def __init__(self, capacity: int = 2000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.step = capacity, None
        self._entries: deque[Entry] = deque(maxlen=capacity)
        self._open: dict[int, tuple[int, float]] = {}  # id(record) -> (seq, start) of its entry, while it runs
        self._ends: dict[int, float] = {}  # seq -> when the call returned
        self._counts: dict[tuple[str, tuple[int, ...], bool], int] = {}
        self._total = 0
        self._lock = threading.Lock()  # the watchdog thread reads while the rank records

    @contextlib.contextmanager
    def recording(self) -> Iterator[FlightRecorder]:
        with comm.watching(self):
            yield self

    def __call__(self, event: str, record: comm.CommRecord, group: comm.Group,
                 tensors: tuple[torch.Tensor, ...]) -> None:
        if event == "start":
            self._started(record, group, tensors)
        else:
            self._ended(record)

    def _started(self, record: comm.CommRecord, group: comm.Group, tensors: tuple[torch.Tensor, ...]) -> None:
        ranks = tuple(dist.get_process_group_ranks(group)) if group not in (None, dist.group.WORLD) else tuple(
            range(dist.get_world_size()))
        p2p = record.op in comm.POINT_TO_POINT
        with self._lock:
            key = (record.group, ranks, p2p)
            self._counts[key] = self._counts.get(key, 0) + 1
            entry = Entry(self._total, self._counts[key], record.op, record.group, ranks,
                          tuple(tuple(t.shape) for t in tensors), str(tensors[0].dtype).removeprefix("torch.")
                          if tensors else "-", record.peer, self.step, call_site(), time.time())
            self._total += 1
            self._entries.append(entry)
            self._open[id(record)] = entry.seq, entry.start

    def _ended(self, record: comm.CommRecord) -> None:
        with self._lock:
            seq, _ = self._open.pop(id(record), (None, 0.0))
            if seq is not None:
                self._ends[seq] = time.time()
            if len(self._ends) > 2 * self.capacity:  # forget what the ring buffer dropped
                self._ends = {s: t for s, t in self._ends.items() if s >= self._total - self.capacity}

    def stalled(self, seconds: float) -> int | None:
        """The sequence number of the oldest call in flight for more than ``seconds``, or None (cheap: what a
        watchdog polls)."""
        now = time.time()
        with self._lock:
            late = [seq for seq, start in self._open.values() if now - start > seconds]
        return min(late) if late else None

    def trace(self, rank: int | None = None, finished: bool = False) -> Trace:
        """A copy of the buffer as a ``Trace``."""
        with self._lock:
            entries = [replace(e, end=self._ends[e.seq]) if e.seq in self._ends else e for e in self._entries]
            dropped = self._total - len(entries)
        return Trace(dist.get_rank() if rank is None else rank, entries, dropped, finished)


def call_site(depth: int = 8) -> tuple[Frame, ...]:
    """The caller's stack outside the comm layer and this module, innermost first, ``depth`` frames at most."""
    frames: list[Frame] = []
    f = sys._getframe(1)
    while f is not None and len(frames) < depth:
        file = f.f_code.co_filename
        if not any(s in file for s in _SKIP):
            frames.append((file, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return tuple(frames)


GroupKey = tuple[str, tuple[int, ...]]
"""A group as every member sees it: its label in the comm log and its ranks."""


def by_group(traces: Sequence[Trace], p2p: bool = False) -> dict[GroupKey, dict[int, list[Entry]]]:
    """(label, ranks) -> rank -> that rank's collectives (or point-to-point calls) on the group, in order."""
    out: dict[GroupKey, dict[int, list[Entry]]] = {}
    for t in traces:
        for e in t.entries:
            if e.p2p == p2p:
                out.setdefault((e.group, e.ranks), {}).setdefault(t.rank, []).append(e)
    return out
