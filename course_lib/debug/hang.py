"""A hang report: what each rank is blocked in, whom it waits for, and which rank everyone waits for.

From the ranks' flight-recorder dumps (``recorder.Trace``, taken by ``watch``'s watchdog while they were stuck):
a rank is *finished* (its function returned), *blocked* in the oldest call it started and never returned from, or
*running* outside any call (a loop, a sleep, a deadlock of its own). A blocked rank waits for each member of its
call's group that has not made the same call at the same position: one that has not reached it yet (its last call
on the group is earlier) or made another one there (a desync: ``desync.first_desync``); a ``recv`` waits for its
peer. Following those edges from every blocked rank ends at the ranks that block the others without being blocked
themselves -- or, when the edges close a cycle (two ranks each in a different collective), at the culprit of the
desync that made it. That is the rank to debug; the others only wait. With NCCL the same question is answered
from the Flight Recorder dumps that the watchdog writes when a collective exceeds its timeout
(``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, ``TORCH_FR_BUFFER_SIZE`` > 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from course_lib.debug.desync import Desync, first_desync
from course_lib.debug.recorder import Entry, Trace, format_frame

FINISHED, BLOCKED, RUNNING, UNKNOWN = "finished", "blocked", "running", "unknown"


@dataclass(frozen=True)
class RankState:
    """One rank at the time of the dump: ``state`` (finished, blocked, running, unknown: no dump), the ``call`` it
    is blocked in, the ranks it ``waits_for`` and why, and its Python stack when the launcher stopped it."""

    rank: int
    state: str
    call: Entry | None = None
    waits_for: tuple[int, ...] = ()
    why: str = ""
    stack: str = ""

    def describe(self) -> str:
        if self.state != BLOCKED:
            where = f": {self.stack.splitlines()[0].strip()}" if self.stack and self.state == RUNNING else ""
            return f"rank {self.rank}: {self.state}{where}"
        step = f" in step {self.call.step}" if self.call.step is not None else ""
        return (f"rank {self.rank}: blocked{step} in {self.call.describe()}, called from {self.call.site}; "
                f"waits for {list(self.waits_for)} ({self.why})")


@dataclass
class HangReport:
    """Every rank's state, the ranks everyone waits for (``root``) and the desync behind a cycle, if any."""

    ranks: list[RankState]
    root: tuple[int, ...]
    cycle: bool
    desync: Desync | None = field(default=None)

    def __str__(self) -> str:
        lines = [s.describe() for s in self.ranks]
        how = " (they wait for each other: a desync)" if self.cycle else ""
        lines.append(f"everyone waits for: rank(s) {list(self.root)}{how}")
        if self.desync is not None:
            lines.append(self.desync.describe())
        return "\n".join(lines)


def hang_report(traces: Sequence[Trace], world_size: int, stacks: Mapping[int, str] | None = None) -> HangReport:
    """The report from the ranks' dumps (a rank without one is "unknown") and, optionally, their stacks."""
    stacks = stacks or {}
    by_rank = {t.rank: t for t in traces}
    desync = first_desync(traces)
    states = [_state(r, by_rank, stacks.get(r, "")) for r in range(world_size)]
    blocked = {s.rank: s for s in states if s.state == BLOCKED}
    ends: set[int] = set()
    cycle = False
    for start in blocked:
        seen, todo = set(), [start]
        while todo:
            r = todo.pop()
            if r in seen:
                continue
            seen.add(r)
            if r not in blocked:
                ends.add(r)
            else:
                todo.extend(blocked[r].waits_for)
        cycle |= not (seen - set(blocked)) and bool(seen)
    root = tuple(sorted(ends)) if ends else (desync.culprits if desync is not None else tuple(sorted(blocked)))
    return HangReport(states, root, cycle and not ends, desync)


def _state(rank: int, traces: Mapping[int, Trace], stack: str) -> RankState:
    trace = traces.get(rank)
    if trace is None:
        return RankState(rank, UNKNOWN, stack=stack)
    if trace.finished:
        return RankState(rank, FINISHED)
    open_calls = trace.in_flight()
    if not open_calls:
        return RankState(rank, RUNNING, stack=stack)
    call = min(open_calls, key=lambda e: (e.p2p, e.seq))  # a collective first: p2p sends may be left posted
    waits, why = _waits_for(rank, call, traces)
    return RankState(rank, BLOCKED, call, waits, why, stack)


def _waits_for(rank: int, call: Entry, traces: Mapping[int, Trace]) -> tuple[tuple[int, ...], str]:
    if call.p2p:
        return (call.peer,), f"its peer of the {call.op}"
    late, other = [], []
    for m in call.ranks:
        if m == rank:
            continue
        if m not in traces:  # no dump: as far as anyone knows, not there
            late.append(m)
            continue
        theirs = [e for e in traces[m].entries if (e.group, e.ranks) == (call.group, call.ranks) and not e.p2p]
        match = next((e for e in theirs if e.group_seq == call.group_seq), None)
        if match is None:
            late.append(m)
        elif match.signature != call.signature:
            other.append((m, match))
    reasons = []
    if late:
        reasons.append(f"{late} not there yet")
    for m, e in other:
        reasons.append(f"rank {m} called {e.op} from {format_frame(e.where[0]) if e.where else '?'} there")
    return tuple(sorted(late + [m for m, _ in other])), "; ".join(reasons) or "nobody"
