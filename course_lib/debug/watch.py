"""Any launch target run on its ranks with the instruments attached, and what they found.

``run(fn, world_size, *args, instruments=Instruments(...))`` launches ``on_rank``, which attaches on each rank
the flight recorder (``comm.watching``) and the loop observers asked for (``loop.observing``: replica checksums,
batch fingerprints, the non-finite watch), then calls ``fn(rank, world_size, *args)`` unchanged -- a
``runs.train_*`` or a function of your own. A watchdog thread on each rank writes its recorder's trace to a folder
when a call has been in flight for ``stall_s`` (as NCCL's watchdog dumps the Flight Recorder on its timeout), and
every rank writes it again when ``fn`` returns; so when the launch ends in a hang (``RankTimeout``) or a crash
(``RankError``), the traces of every rank are on disk and ``run`` turns them into a ``HangReport`` and the first
desync instead of raising. ``torch_recorder=True`` also turns on PyTorch's own Flight Recorder
(``TORCH_FR_BUFFER_SIZE``) and dumps it beside ours, for ``python -m torch.distributed.flight_recorder.fr_trace``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from course_lib.debug.checksums import BatchFingerprints, ChecksumReport, ReplicaChecksums
from course_lib.debug.desync import Desync, first_desync
from course_lib.debug.hang import HangReport, hang_report
from course_lib.debug.nonfinite import NonFinite, NonFiniteWatch
from course_lib.debug.recorder import FlightRecorder, Trace
from course_lib.parallel.loop import Batch, LoopObserver, observing
from course_lib.runtime.launch import RankError, RankTimeout, launch
from course_lib.runtime.mesh import MeshShape

TORCH_DUMPS = "torch_fr"
"""The sub-folder of PyTorch's Flight Recorder dumps (``rank_<r>``, the prefix its analyser infers)."""


@dataclass(frozen=True)
class Instruments:
    """What ``on_rank`` attaches: the recorder (``capacity`` entries), ``checksums`` of the replicas of this mesh
    shape every ``every`` steps, ``batches`` (fingerprints of each rank's data), the ``nonfinite`` watch; the
    watchdog's ``stall_s``; ``torch_recorder``: PyTorch's Flight Recorder too."""

    recorder: bool = True
    capacity: int = 4000
    checksums: MeshShape | None = None
    every: int = 1
    batches: bool = False
    nonfinite: bool = False
    stall_s: float = 2.0
    torch_recorder: bool = False


@dataclass
class RankReport:
    """What one rank's instruments found, and what ``fn`` returned."""

    rank: int
    result: Any
    trace: Trace | None
    checksums: list[ChecksumReport] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    nonfinite: NonFinite | None = None


class _Steps(LoopObserver):
    """Tells the recorder which step its calls belong to."""

    def __init__(self, recorder: FlightRecorder) -> None:
        self.recorder = recorder

    def batch(self, step: int, micro: Batch) -> None:
        self.recorder.step = step


def on_rank(rank: int, world_size: int, instruments: Instruments, folder: str, fn: Callable[..., Any],
            *args: Any, **kwargs: Any) -> RankReport:
    """The per-rank body: ``fn(rank, world_size, *args, **kwargs)`` with the instruments attached."""
    ins = instruments
    if ins.torch_recorder:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(ins.capacity)  # read when the first collective is recorded
    recorder = FlightRecorder(ins.capacity) if ins.recorder else None
    checks = ReplicaChecksums(ins.checksums, ins.every) if ins.checksums is not None else None
    batches = BatchFingerprints() if ins.batches else None
    nonfinite = NonFiniteWatch() if ins.nonfinite else None
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        if recorder is not None:
            stack.enter_context(recorder.recording())
            stack.enter_context(observing(_Steps(recorder)))
            threading.Thread(target=_watchdog, args=(recorder, rank, folder, ins, stop), daemon=True).start()
            stack.callback(stop.set)
        for o in (checks, batches, nonfinite):
            if o is not None:
                stack.enter_context(observing(o))
        result = fn(rank, world_size, *args, **kwargs)
    trace = recorder.trace(rank, finished=True) if recorder is not None else None
    if trace is not None:
        _dump(trace, folder, rank, ins.torch_recorder)
    return RankReport(rank, result, trace, checks.reports if checks else [], batches.fingerprints if batches else [],
                      nonfinite.first if nonfinite else None)


def _watchdog(recorder: FlightRecorder, rank: int, folder: str, ins: Instruments, stop: threading.Event) -> None:
    dumped = None
    while not stop.wait(0.05):
        stalled = recorder.stalled(ins.stall_s)
        if stalled is not None and stalled != dumped:
            _dump(recorder.trace(rank), folder, rank, ins.torch_recorder)
            dumped = stalled


def _dump(trace: Trace, folder: str, rank: int, torch_recorder: bool) -> None:
    path = Path(folder, f"rank{rank}.trace")
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(trace))
    os.replace(tmp, path)
    if torch_recorder:
        Path(folder, TORCH_DUMPS).mkdir(exist_ok=True)
        Path(folder, TORCH_DUMPS, f"rank_{rank}").write_bytes(torch._C._distributed_c10d._dump_fr_trace())


@dataclass
class Watched:
    """A watched launch: ``reports`` per rank when it finished (else None), every rank's ``traces`` found on
    disk, the ``hang`` report of a launch that hung, the ``error`` of one that failed, the first ``desync``."""

    reports: list[RankReport] | None
    traces: dict[int, Trace]
    hang: HangReport | None = None
    error: str | None = None
    desync: Desync | None = None
    folder: str | None = None

    @property
    def results(self) -> list[Any]:
        if self.reports is None:
            raise RuntimeError(f"the launch did not finish: {self.error or self.hang}")
        return [r.result for r in self.reports]

    def checksum_alarm(self) -> ChecksumReport | None:
        """The first check whose copies disagreed (every rank computes the same reports), or None."""
        reports = self.reports[0].checksums if self.reports else []
        return next((c for c in reports if c.alarm), None)


def run(fn: Callable[..., Any], world_size: int, *args: Any, instruments: Instruments = Instruments(),
        timeout: float | None = None, folder: str | None = None, **kwargs: Any) -> Watched:
    """Launch ``fn`` on ``world_size`` ranks with ``instruments`` (module docstring); the traces go to ``folder``
    (default: a temporary one, removed after, unless PyTorch's dumps are asked for)."""
    keep = folder is not None or instruments.torch_recorder
    folder = folder or tempfile.mkdtemp(prefix="course_watch_")
    try:
        reports = launch(on_rank, world_size, instruments, folder, fn, *args, timeout=timeout, **kwargs)
    except RankTimeout as err:
        traces = read_traces(folder)
        report = hang_report(list(traces.values()), world_size, err.stacks)
        return Watched(None, traces, report, None, report.desync, folder if keep else None)
    except RankError as err:
        traces = read_traces(folder)
        return Watched(None, traces, None, str(err).split("\n")[0], first_desync(list(traces.values())),
                       folder if keep else None)
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    traces = {r.rank: r.trace for r in reports if r.trace is not None}
    return Watched(reports, traces, None, None, first_desync(list(traces.values())), folder if keep else None)


def read_traces(folder: str) -> dict[int, Trace]:
    """Every rank's last trace written to ``folder``."""
    out = {}
    for path in Path(folder).glob("rank*.trace"):
        trace = pickle.loads(path.read_bytes())
        out[trace.rank] = trace
    return dict(sorted(out.items()))
