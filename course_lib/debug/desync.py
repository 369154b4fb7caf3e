"""The first collective the ranks disagree on, and which rank(s) called it wrong.

Every rank of a group must issue the same collectives on it in the same order: the n-th collective of a group is
matched with the n-th on every other member, whatever each one meant (gloo and NCCL match by order). So the
recorders' entries (``recorder.Trace``) are compared group by group, position by position: all members must
agree on the op, the shapes, the dtype and the line that called it (``Entry.signature``); a member whose function
returned without calling it is missing it. A rank still blocked elsewhere is only late, not wrong.

Who is wrong, where they disagree: the members in the majority are right; on a tie (two ranks, one each way), the
other groups of the same axis (the other "tp" pairs) at the same position say what the call should have been;
with neither, a member that finished without the call is the culprit, else the report says it cannot tell.
Of several disagreements the first is the one whose calls started first. PyTorch's counterpart: the Flight
Recorder's analyser (``python -m torch.distributed.flight_recorder.fr_trace``) over the ranks' dumps.
Point-to-point calls are left out (a send matches a recv, not the same call).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from course_lib.debug.recorder import Entry, GroupKey, Trace, by_group

MISSING = "missing"
"""A member of the group that returned without making the call (its signature in ``Desync.calls`` is None)."""


@dataclass(frozen=True)
class Desync:
    """The first collective the ranks of ``ranks`` (group ``group``) disagree on: the ``position``-th on the group.
    ``calls``: each member's call there (None: it finished without it); ``kind``: what differs ("op", "shape",
    "dtype", "call site" or "missing"); ``culprits``: the ranks that called it wrong (``certain`` False: a tie
    nothing could break, every member listed)."""

    group: str
    ranks: tuple[int, ...]
    position: int
    calls: dict[int, Entry | None]
    kind: str
    culprits: tuple[int, ...]
    certain: bool

    def describe(self) -> str:
        lines = [f"first desync: collective #{self.position} of group {self.group} {list(self.ranks)} differs in "
                 f"{self.kind}; wrong: rank(s) {list(self.culprits)}" + ("" if self.certain else " (a tie)")]
        for rank, e in sorted(self.calls.items()):
            what = "finished without calling it" if e is None else f"{e.describe()} at step {e.step}, from {e.site}"
            lines.append(f"  rank {rank}: {what}")
        return "\n".join(lines)


def first_desync(traces: Sequence[Trace]) -> Desync | None:
    """The first disagreement among the ranks' recorded collectives (module docstring), or None."""
    by_rank = {t.rank: t for t in traces}
    groups = by_group(traces)
    found = []
    for key, calls in groups.items():
        where = _first_disagreement(key[1], calls, by_rank)
        if where is not None:
            found.append((key, *where))
    if not found:
        return None
    key, position, calls = min(found, key=lambda f: min(e.start for e in f[2].values() if e is not None))
    return _judge(key, position, calls, groups)


def _first_disagreement(ranks: tuple[int, ...], calls: dict[int, list[Entry]], traces: dict[int, Trace]
                        ) -> tuple[int, dict[int, Entry | None]] | None:
    """(position, each member's call) of the first position where the members disagree, or None."""
    members = [r for r in ranks if r in traces]
    at = {r: {e.group_seq: e for e in calls.get(r, [])} for r in members}
    starts = [min(at[r]) for r in members if at[r]]
    if not starts:
        return None
    last = max(k for r in members for k in at[r])
    for k in range(max(starts), last + 1):
        here: dict[int, Entry | None] = {}
        for r in members:
            if k in at[r]:
                here[r] = at[r][k]
            elif traces[r].finished:
                here[r] = None  # returned without the call
        present = [e for e in here.values() if e is not None]
        if len({e.signature for e in present}) > 1 or (present and None in here.values()):
            return k, here
    return None


def _signature(e: Entry | None) -> tuple | str:
    return MISSING if e is None else e.signature


def _judge(key: GroupKey, position: int, calls: dict[int, Entry | None],
           groups: dict[GroupKey, dict[int, list[Entry]]]) -> Desync:
    votes = Counter(_signature(e) for e in calls.values())
    (top, n), *rest = votes.most_common()
    right: tuple | str | None = top if not rest or n > rest[0][1] else None
    if right is None:
        right = _reference(key, position, calls, groups)
    certain = right is not None
    if right is None and MISSING in votes:
        right, certain = next(s for s in votes if s != MISSING), True  # the one that left without the call
    culprits = tuple(sorted(r for r, e in calls.items() if right is None or _signature(e) != right))
    wrong = calls[culprits[0]]
    other = [e for e in calls.values() if (_signature(e) == right if certain else _signature(e) != _signature(wrong))]
    good = other[0] if other else None
    return Desync(key[0], key[1], position, calls, _kind(wrong, good), culprits, certain)


def _reference(key: GroupKey, position: int, calls: dict[int, Entry | None],
               groups: dict[GroupKey, dict[int, list[Entry]]]) -> tuple | None:
    """What the other groups of the same axis and size agree on at ``position`` (None if nothing, or no
    agreement)."""
    seen: Counter = Counter()
    for other, members in groups.items():
        if other == key or other[0] != key[0] or len(other[1]) != len(key[1]):
            continue
        here = [e for es in members.values() for e in es if e.group_seq == position]
        if len(here) == len(other[1]) and len({e.signature for e in here}) == 1:
            seen[here[0].signature] += 1
    mine = {_signature(e) for e in calls.values()}
    agreed = [s for s, _ in seen.most_common() if s in mine]
    return agreed[0] if agreed else None


def _kind(wrong: Entry | None, good: Entry | None) -> str:
    if wrong is None or good is None:
        return MISSING
    for kind, a, b in (("op", wrong.op, good.op), ("shape", wrong.shapes, good.shapes),
                       ("dtype", wrong.dtype, good.dtype)):
        if a != b:
            return kind
    return "call site"
