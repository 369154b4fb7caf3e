"""Pipeline schedules as data: an ordered list of actions per rank, built and checked without ranks.

``schedule[r]`` is what rank r runs, in order; stage s of the n = p x v stages lives on rank s % p
(v > 1: Megatron-LM's interleaved placement, chunk c of rank r is stage c p + r). Actions, named as
in the literature and ``torch.distributed.pipelining``: ``F`` forward of one micro-batch through one
stage; ``B`` its backward, or split as in Zero Bubble (Qi et al. 2023) into ``I`` (input gradient,
what the previous stage waits for) and ``W`` (weight gradient, nobody waits); ``SEND_F`` /
``RECV_F`` / ``SEND_B`` / ``RECV_B`` the transfers (``stage``: the one on this rank);
``REDUCE_GRAD`` the data-parallel reduction of one stage's gradients. The builders (``gpipe``,
``one_f_one_b``, ``interleaved_one_f_one_b``, ``zb_h1``) return compute-only schedules;
``validate`` checks one (correct, no deadlock); ``add_send_recv`` / ``add_grad_reduce`` insert the
transfers / reductions for real ranks; ``schedule_run.simulate`` times one. Chapter 05 builds them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

SCHEDULE_ALIASES: dict[str, str] = {
    "gpipe": "gpipe", "afab": "gpipe",
    "1f1b": "one_f_one_b", "one_f_one_b": "one_f_one_b",
    "interleaved": "interleaved_one_f_one_b", "interleaved_1f1b": "interleaved_one_f_one_b",
    "interleaved_one_f_one_b": "interleaved_one_f_one_b",
    "zb_h1": "zb_h1", "zbh1": "zb_h1", "zero_bubble": "zb_h1",
}
"""Every accepted name -> the canonical one, the builder's name (what every consumer resolves)."""
SCHEDULE_NAMES: tuple[str, ...] = tuple(dict.fromkeys(SCHEDULE_ALIASES.values()))


def canonical_schedule(name: str) -> str:
    """``name``'s canonical name ("1f1b" -> "one_f_one_b"); a clear ``ValueError`` if unknown."""
    if name not in SCHEDULE_ALIASES:
        raise ValueError(f"unknown schedule {name!r}: use one of {sorted(SCHEDULE_ALIASES)}")
    return SCHEDULE_ALIASES[name]


class Kind(StrEnum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (the literature's name: backward for the input)
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    REDUCE_GRAD = "REDUCE_GRAD"


COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})


@dataclass(frozen=True)
class Action:
    """A rank's step: ``kind`` on micro-batch ``microbatch`` through (virtual) stage ``stage``."""

    kind: Kind
    microbatch: int
    stage: int

    def __str__(self) -> str:  # torch's notation: 1F0 is stage 1, forward, micro-batch 0
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @property
    def peer_stage(self) -> int | None:
        """The stage at the other end of a transfer (on rank ``peer_stage % p``); None: compute."""
        if self.kind in (Kind.SEND_F, Kind.RECV_B):
            return self.stage + 1
        if self.kind in (Kind.RECV_F, Kind.SEND_B):
            return self.stage - 1
        return None


Schedule = list[list[Action]]


class ScheduleError(ValueError):
    """A schedule that breaks a rule of ``validate`` (the message says which action and why)."""


# ----------------------------------------------------------------------------------------- builders


def check_positive(**values: int) -> None:
    """Every one of ``values`` (p, m, v) must be an int >= 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019, AFAB): all m forwards, then all m backwards (in order, as torch's
    ``ScheduleGPipe``). Bubble (p-1)/(m+p-1); every rank holds all m micro-batches at the turn."""
    check_positive(p=p, m=m)
    return [[Action(Kind.F, j, r) for j in range(m)] + [Action(Kind.B, j, r) for j in range(m)]
            for r in range(p)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM): GPipe's bubble, less memory. Rank
    r runs min(p-1-r, m) warm-up forwards, then alternates F and B, then the backwards left: at most
    min(p - r, m) micro-batches in flight (torch's ``Schedule1F1B``: the same order, but m >= p)."""
    check_positive(p=p, m=m)
    schedule = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        actions = [Action(Kind.F, j, r) for j in range(warmup)]
        for j in range(m - warmup):
            actions += [Action(Kind.F, j + warmup, r), Action(Kind.B, j, r)]
        actions += [Action(Kind.B, j, r) for j in range(m - warmup, m)]
        schedule.append(actions)
    return schedule


def interleaved_groups(p: int, m: int, group: int | None = None) -> list[int]:
    """The micro-batch groups of interleaved 1F1B, in order (each passes all of a rank's chunks
    before the next starts). ``group=None``: torch 2.13's ``ScheduleInterleaved1F1B``, max(1, m //
    p) rounds of equal size (p = 4: m = 6 is one group of 6, m = 10 two of 5, m = 9 refused);
    ``group=n``: Megatron-Core's ``microbatch_group_size_per_vp_stage``, groups of p <= n <= m, the
    last m % n, 0 or >= p. Both give groups of p if p divides m (old Megatron-LM's rule)."""
    check_positive(p=p, m=m)
    if group is None:
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(
                "interleaved 1F1B as torch's ScheduleInterleaved1F1B runs it takes "
                f"max(1, m // p) = {rounds} rounds of equal size, which do not divide m={m} "
                f"(p={p}); Megatron-Core takes m={m} with a group size "
                "(microbatch_group_size_per_vp_stage) whose remainder is 0 or >= p")
        return [m // rounds] * rounds
    check_positive(group=group)
    if not p <= group <= m:
        raise ValueError("a micro-batch group of interleaved 1F1B holds p <= n <= m "
                         f"micro-batches; got n={group}, p={p}, m={m}")
    last = m % group
    if 0 < last < p:
        raise ValueError(f"m={m} in groups of {group} leaves a last group of {last} < p={p} "
                         "micro-batches: its ranks would wait on each other (Megatron-Core refuses "
                         "it too)")
    return [group] * (m // group) + ([last] if last else [])


def interleaved_one_f_one_b(p: int, m: int, v: int, group: int | None = None) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021): v chunks per rank, chunk c on rank c % p.
    Micro-batches go in groups (``interleaved_groups``) through one chunk, then the next (depth
    first); rank r runs min(2(p-1-r) + (v-1)g, m v) warm-up forwards (g the first group's size,
    Megatron's and torch's count), then alternates F and B (backwards take the chunks in reverse),
    then the rest. Bubble/ideal = (p-1)/(v m) when every group holds >= p micro-batches, for v
    times the point-to-point messages."""
    check_positive(p=p, m=m, v=v)
    groups = interleaved_groups(p, m, group)
    pairs = []  # (micro-batch, chunk) in the order the rank's forwards take them
    first = 0
    for size in groups:
        pairs += [(first + j, chunk) for chunk in range(v) for j in range(size)]
        first += size

    def step(k: int, forward: bool, r: int) -> Action:
        microbatch, chunk = pairs[k]
        if forward:
            return Action(Kind.F, microbatch, chunk * p + r)
        return Action(Kind.B, microbatch, (v - 1 - chunk) * p + r)

    total = m * v
    schedule = []
    for r in range(p):
        warmup = min(2 * (p - 1 - r) + (v - 1) * groups[0], total)
        actions = [step(k, True, r) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [step(k + warmup, True, r), step(k, False, r)]
        actions += [step(k, False, r) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with B split into I and W.

    F and I run in 1F1B's order; rank r delays its W passes by r micro-batches (W of j right after I
    of j + r), so they fill the cool-down bubble: (p-1)(T_F + T_I - T_W) per rank instead of 1F1B's
    (p-1)(T_F + T_I + T_W), a third when the three are equal; exact (``simulate``) for m >= p and
    T_W <= min(T_F, T_I), larger otherwise. At most min(p, m) micro-batches in flight (until their
    W), 1F1B's peak. Same order as torch's ``ScheduleInterleavedZeroBubble``, one stage per rank."""
    check_positive(p=p, m=m)
    schedule = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        actions = [Action(Kind.F, j, r) for j in range(warmup)]
        for j in range(m):
            if j + warmup < m:
                actions.append(Action(Kind.F, j + warmup, r))
            actions.append(Action(Kind.I, j, r))
            if j >= r:
                actions.append(Action(Kind.W, j - r, r))
        actions += [Action(Kind.W, j, r) for j in range(max(0, m - r), m)]
        schedule.append(actions)
    return schedule


def _inputs(a: Action, n_stages: int) -> list[tuple[Action, ...]]:
    """What compute action ``a`` waits for: per input, a tuple of alternatives (B or I)."""
    j, s = a.microbatch, a.stage
    if a.kind is Kind.F:
        return [(Action(Kind.F, j, s - 1),)] if s > 0 else []
    if a.kind is Kind.W:
        return [(Action(Kind.I, j, s),)]
    inputs = [(Action(Kind.F, j, s),)]
    if s < n_stages - 1:
        inputs.append((Action(Kind.B, j, s + 1), Action(Kind.I, j, s + 1)))
    return inputs


def _send_of(producer: Action) -> Action:
    kind = Kind.SEND_F if producer.kind is Kind.F else Kind.SEND_B
    return Action(kind, producer.microbatch, producer.stage)


def _recv_of(send: Action) -> Action:
    kind = Kind.RECV_F if send.kind is Kind.SEND_F else Kind.RECV_B
    return Action(kind, send.microbatch, send.peer_stage)


def _remote_send(a: Action, n_stages: int, p: int) -> Action | None:
    """The SEND that must follow compute action ``a`` if its output goes to another rank."""
    if a.kind is Kind.F and a.stage < n_stages - 1 and (a.stage + 1) % p != a.stage % p:
        return _send_of(a)
    if a.kind in (Kind.B, Kind.I) and a.stage > 0 and (a.stage - 1) % p != a.stage % p:
        return _send_of(a)
    return None


def schedule_shape(schedule: Schedule) -> tuple[int, int, int]:
    """(p, m, v) read off a schedule: ranks, micro-batches, virtual stages per rank."""
    actions = [a for rank in schedule for a in rank]
    if not actions:
        raise ScheduleError("the schedule has no actions")
    p = len(schedule)
    n_stages = 1 + max(a.stage for a in actions)
    return p, 1 + max(a.microbatch for a in actions), -(-n_stages // p)


def execute(schedule: Schedule, n_stages: int, duration: Callable[[Action], float],
            comm: float) -> Timeline:
    """Run every rank's list in order; each rank's (start, end, action) of its compute actions.
    Expects a schedule that passed validate's per-action checks; if the ranks stop with actions
    left (a deadlock), a ScheduleError names what each one waits for."""
    p = len(schedule)
    present = {a for actions in schedule for a in actions}
    explicit = any(not a.is_compute for a in present)
    finished: dict[Action, float] = {}  # end time of compute actions, post time of SENDs
    clock = [0.0] * p
    next_index = [0] * p
    timeline: Timeline = [[] for _ in range(p)]

    def inputs_at(a: Action) -> tuple[float, list[Action]]:
        """When ``a``'s inputs are there and what it still waits for (the producer or its SEND)."""
        time, missing = 0.0, []
        for alternatives in _inputs(a, n_stages):
            producer = next(d for d in alternatives if d in present)
            source = producer
            if producer.stage % p != a.stage % p and explicit:
                source = _send_of(producer)
            if source not in finished:
                missing.append(source)
            elif producer.stage % p == a.stage % p:
                time = max(time, finished[source])
            else:
                time = max(time, finished[source] + comm)
        return time, missing

    progressed = True
    while progressed:
        progressed = False
        for r, actions in enumerate(schedule):
            while next_index[r] < len(actions):
                a = actions[next_index[r]]
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    finished[a] = clock[r]
                elif a.is_compute:
                    ready, missing = inputs_at(a)
                    if missing:
                        break
                    start = max(clock[r], ready)
                    clock[r] = finished[a] = start + duration(a)
                    timeline[r].append((start, clock[r], a))
                next_index[r] += 1
                progressed = True

    stuck = []
    for r, actions in enumerate(schedule):
        if next_index[r] < len(actions):
            a = actions[next_index[r]]
            stuck.append(f"rank {r} at {a} (waits for {', '.join(map(str, inputs_at(a)[1]))})")
    if stuck:
        raise ScheduleError("deadlock: every rank left waits for an input never produced: "
                            + "; ".join(stuck))
    return timeline


def validate(schedule: Schedule, p: int, m: int, v: int = 1) -> None:
    """Raise ScheduleError (a ValueError) unless ``schedule`` is a correct pipeline schedule: p
    lists; each action on its stage's rank (s % p), indices in range; per stage and micro-batch one
    F and either one B or one I and one W; F before its B/I, I before its W; with transfers, exactly
    the needed ones, each SEND after its producer, each RECV before its consumer, on each link the
    receives in the order of the sends; and running the ranks in order finishes (no deadlock)."""
    check_positive(p=p, m=m, v=v)
    if len(schedule) != p:
        raise ScheduleError(f"expected one action list per rank, p={p} lists, got {len(schedule)}")
    n_stages = p * v
    position: dict[Action, int] = {}
    for r, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {r} item {i} is {a!r}, not an Action")
            if not (0 <= a.microbatch < m and 0 <= a.stage < n_stages):
                raise ScheduleError(f"rank {r}: {a} is out of range (m={m} micro-batches, "
                                    f"{n_stages} stages)")
            if a.stage % p != r:
                raise ScheduleError(f"rank {r}: {a} belongs to stage {a.stage}, which lives on "
                                    f"rank {a.stage % p}")
            if a in position:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            position[a] = i
    _check_compute(position, m, n_stages)
    if len(position) > sum(a.is_compute for a in position):
        _check_transfers(schedule, position, n_stages)
    execute(schedule, n_stages, lambda a: 1.0, comm=0.0)


def _check_compute(position: dict[Action, int], m: int, n_stages: int) -> None:
    for s in range(n_stages):
        for j in range(m):
            f, b, i, w = (Action(kind, j, s) for kind in (Kind.F, Kind.B, Kind.I, Kind.W))
            if f not in position:
                raise ScheduleError(f"missing {f}: stage {s} never runs the forward of "
                                    f"micro-batch {j}")
            if (b in position) == (i in position) or (i in position) != (w in position):
                raise ScheduleError(f"stage {s}, micro-batch {j} needs one backward: either {b}, "
                                    f"or {i} and {w}")
            backward = b if b in position else i
            if position[backward] < position[f]:
                raise ScheduleError(f"{backward} runs before {f}: a backward needs its own "
                                    "forward's activations")
            if w in position and position[w] < position[i]:
                raise ScheduleError(f"{w} runs before {i}: W needs the output gradient that I "
                                    "receives")


def _check_transfers(schedule: Schedule, position: dict[Action, int], n_stages: int) -> None:
    p = len(schedule)
    sends = [s for a in position
             if a.is_compute and (s := _remote_send(a, n_stages, p)) is not None]
    expected = Counter(sends + [_recv_of(s) for s in sends])
    actual = Counter(a for a in position if not a.is_compute)
    if actual != expected:
        missing, extra = expected - actual, actual - expected
        raise ScheduleError("transfers do not match the cross-rank dependencies: missing "
                            f"{sorted(map(str, missing))}, not needed {sorted(map(str, extra))}")
    for send in sends:
        producer = Action(Kind.F, send.microbatch, send.stage)
        if send.kind is Kind.SEND_B:
            producer = _backward_input(send.microbatch, send.stage, position)
        if position[send] < position[producer]:
            raise ScheduleError(f"{send} must come after {producer}, which produces the data it "
                                "sends")
        recv = _recv_of(send)
        consumer = Action(Kind.F, recv.microbatch, recv.stage)
        if recv.kind is Kind.RECV_B:
            consumer = _backward_input(recv.microbatch, recv.stage, position)
        if position[recv] > position[consumer]:
            raise ScheduleError(f"{recv} must come before {consumer}, which needs the data it "
                                "receives")
    for src, actions in enumerate(schedule):
        for dst in range(p):
            sent = [_recv_of(a) for a in actions
                    if a.kind in (Kind.SEND_F, Kind.SEND_B) and a.peer_stage % p == dst]
            received = [a for a in schedule[dst]
                        if a.kind in (Kind.RECV_F, Kind.RECV_B) and a.peer_stage % p == src]
            if sent != received:
                raise ScheduleError(
                    f"link rank {src} -> rank {dst}: receives posted as {list(map(str, received))} "
                    f"but sends go out as {list(map(str, sent))} (messages match in order, so a "
                    "receive would get the wrong tensor)")


def _backward_input(microbatch: int, stage: int, present: dict[Action, int]) -> Action:
    """What computes stage ``stage``'s input gradient: its B, or its I when B is split."""
    b = Action(Kind.B, microbatch, stage)
    return b if b in present else Action(Kind.I, microbatch, stage)


def add_send_recv(schedule: Schedule) -> Schedule:
    """Insert the point-to-point transfers into a compute-only schedule, for real ranks: each SEND
    right after the action producing its data, each RECV right before its consumer, or earlier so
    that on every link the receives are posted in the order of the sends (a RECV posts an
    ``irecv``: posting early never blocks)."""
    if any(not a.is_compute for rank in schedule for a in rank):
        raise ValueError("add_send_recv expects a compute-only schedule (F, B, I, W), it already "
                         "has transfers")
    p, m, v = schedule_shape(schedule)
    validate(schedule, p, m, v)
    n_stages = p * v
    index = {a: i for actions in schedule for i, a in enumerate(actions)}  # position in its rank
    sends_after: dict[Action, Action] = {}
    # per link (src, dst): (recv, its consumer's index)
    by_link: defaultdict[tuple[int, int], list[tuple[Action, int]]] = defaultdict(list)
    for r, actions in enumerate(schedule):
        for a in actions:
            send = _remote_send(a, n_stages, p)
            if send is None:
                continue
            sends_after[a] = send
            recv = _recv_of(send)
            consumer = Action(Kind.F, recv.microbatch, recv.stage)
            if recv.kind is Kind.RECV_B:
                consumer = _backward_input(recv.microbatch, recv.stage, index)
            by_link[r, recv.stage % p].append((recv, index[consumer]))
    recvs_before: defaultdict[tuple[int, int], list[Action]] = defaultdict(list)
    for (_, dst), messages in sorted(by_link.items()):
        slots, earliest = [], None
        # a RECV must precede its own and all later consumers
        for recv, consumer_index in reversed(messages):
            earliest = consumer_index if earliest is None else min(earliest, consumer_index)
            slots.append((earliest, recv))
        for slot, recv in reversed(slots):
            recvs_before[dst, slot].append(recv)
    result: Schedule = []
    for r, actions in enumerate(schedule):
        with_transfers: list[Action] = []
        for i, a in enumerate(actions):
            with_transfers += recvs_before[r, i]
            with_transfers.append(a)
            if a in sends_after:
                with_transfers.append(sends_after[a])
        result.append(with_transfers)
    return result


def add_grad_reduce(schedule: Schedule) -> Schedule:
    """Insert one ``REDUCE_GRAD`` per stage right after its last action writing weight gradients
    (its last ``B``, or ``W`` when split): with data parallelism the stage's reduction overlaps the
    other stages' drain, as in Megatron-LM and torchtitan. After the last ``I`` it would miss the
    pending ``W``s' gradients (a bug torch's pipelining once had)."""
    result: Schedule = []
    for actions in schedule:
        last: dict[int, int] = {}
        split = {a.stage for a in actions if a.kind is Kind.W}
        for i, a in enumerate(actions):
            if a.kind is (Kind.W if a.stage in split else Kind.B):
                last[a.stage] = i
        after = {i: Action(Kind.REDUCE_GRAD, actions[i].microbatch, s) for s, i in last.items()}
        with_reduce: list[Action] = []
        for i, a in enumerate(actions):
            with_reduce.append(a)
            if i in after:
                with_reduce.append(after[i])
        result.append(with_reduce)
    return result


Timeline = list[list[tuple[float, float, Action]]]
