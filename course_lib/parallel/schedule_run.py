"""Running a pipeline schedule (``course_lib.parallel.schedules``) in order without any process: checked, timed, and
given its transfers.

``add_send_recv`` inserts the transfers into a builder's compute-only schedule, for an executor on real ranks.
Its execution model, which ``validate`` checks: a ``RECV`` posts a non-blocking receive (``irecv``) and
the compute action that needs the data waits for it; a ``SEND`` posts a non-blocking send (``isend``) that the
executor waits for later (at the end of the step). Every transfer has one ``SEND`` after the action that
produces the data and one ``RECV`` before the action that consumes it, and on each link (src rank, dst rank) the
receives are posted in the order of the sends: messages match in order, with no tags, as NCCL requires.
Under this model a schedule that passes ``validate`` cannot deadlock.

``simulate`` runs every rank's list in order with given costs: a rank starts its next action when the rank is
free and the action's inputs are there. Dependencies: F on stage s needs F on s - 1 (+ ``comm`` when s - 1 is on
another rank); B (or I) on s needs F on s and the B (or I) of s + 1 (+ ``comm``), the last stage only its own F;
W needs I on the same stage. SEND/RECV take no rank time: a transfer lasts ``comm`` from the end of the action
that produced it, or from its SEND when the schedule has transfers (the receive is assumed posted in time, as
torch's runtime does by batching it with the previous action).

Memory: ``peak_in_flight[r]`` counts the (stage, micro-batch) pairs whose activations rank r holds at worst: a
pair enters with its F and leaves with its B, or, when B is split, with its W (W still reads the stored layer
inputs, so we count it as holding them: the conservative choice). With ``v > 1`` each pair is one model chunk,
1/v of the rank's layers: divide by v for full-stage micro-batches.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from course_lib.parallel.schedules import Action, Kind, Schedule, ScheduleError, check_positive

# ------------------------------------------------------------------------------------------ dependencies


def _inputs(a: Action, n_stages: int) -> list[tuple[Action, ...]]:
    """What compute action ``a`` waits for: one entry per input, each a tuple of alternatives (B or I)."""
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
    """The SEND that must follow compute action ``a``, if its output goes to a stage on another rank."""
    if a.kind is Kind.F and a.stage < n_stages - 1 and (a.stage + 1) % p != a.stage % p:
        return _send_of(a)
    if a.kind in (Kind.B, Kind.I) and a.stage > 0 and (a.stage - 1) % p != a.stage % p:
        return _send_of(a)
    return None


def _shape(schedule: Schedule) -> tuple[int, int, int]:
    """(p, m, v) read off a schedule: ranks, micro-batches, virtual stages per rank."""
    actions = [a for rank in schedule for a in rank]
    if not actions:
        raise ScheduleError("the schedule has no actions")
    p = len(schedule)
    n_stages = 1 + max(a.stage for a in actions)
    return p, 1 + max(a.microbatch for a in actions), -(-n_stages // p)


# -------------------------------------------------------------------------------------------- execution


Timeline = list[list[tuple[float, float, Action]]]


def _execute(schedule: Schedule, n_stages: int, duration: Callable[[Action], float], comm: float) -> Timeline:
    """Run every rank's list in order; return each rank's (start, end, action) for its compute actions.

    Expects a schedule that passed validate's per-action checks. Raises ScheduleError if the ranks stop with
    actions left (a deadlock), naming what each one waits for.
    """
    p = len(schedule)
    present = {a for actions in schedule for a in actions}
    explicit = any(not a.is_compute for a in present)
    finished: dict[Action, float] = {}  # end time of compute actions, post time of SENDs
    clock = [0.0] * p
    next_index = [0] * p
    timeline: Timeline = [[] for _ in range(p)]

    def inputs_at(a: Action) -> tuple[float, list[Action]]:
        """When the inputs of ``a`` are there, and what it still waits for (the producer, or its SEND)."""
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
        raise ScheduleError("deadlock: every rank left waits for an input never produced: " + "; ".join(stuck))
    return timeline


# ------------------------------------------------------------------------------------------- validation


def validate(schedule: Schedule, p: int, m: int, v: int = 1) -> None:
    """Raise ScheduleError (a ValueError) unless ``schedule`` is a correct pipeline schedule.

    Checks: p lists; every action on the rank of its stage (s % p) with indices in range; on every stage and
    micro-batch one F and either one B or one I and one W; F before its B/I and I before its W; if the schedule
    has transfers, exactly the needed ones, each SEND after its producer, each RECV before its consumer, and
    on each link the receives in the order of the sends; finally that running the ranks in order finishes
    (no deadlock, so every cross-stage dependency is satisfiable).
    """
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
                raise ScheduleError(f"rank {r}: {a} is out of range (m={m} micro-batches, {n_stages} stages)")
            if a.stage % p != r:
                raise ScheduleError(f"rank {r}: {a} belongs to stage {a.stage}, which lives on rank {a.stage % p}")
            if a in position:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            position[a] = i
    _check_compute(position, m, n_stages)
    if len(position) > sum(a.is_compute for a in position):
        _check_transfers(schedule, position, n_stages)
    _execute(schedule, n_stages, lambda a: 1.0, comm=0.0)


def _check_compute(position: dict[Action, int], m: int, n_stages: int) -> None:
    for s in range(n_stages):
        for j in range(m):
            f, b, i, w = (Action(kind, j, s) for kind in (Kind.F, Kind.B, Kind.I, Kind.W))
            if f not in position:
                raise ScheduleError(f"missing {f}: stage {s} never runs the forward of micro-batch {j}")
            if (b in position) == (i in position) or (i in position) != (w in position):
                raise ScheduleError(f"stage {s}, micro-batch {j} needs one backward: either {b}, or {i} and {w}")
            backward = b if b in position else i
            if position[backward] < position[f]:
                raise ScheduleError(f"{backward} runs before {f}: a backward needs its own forward's activations")
            if w in position and position[w] < position[i]:
                raise ScheduleError(f"{w} runs before {i}: W needs the output gradient that I receives")


def _check_transfers(schedule: Schedule, position: dict[Action, int], n_stages: int) -> None:
    p = len(schedule)
    sends = [s for a in position if a.is_compute and (s := _remote_send(a, n_stages, p)) is not None]
    expected = Counter(sends + [_recv_of(s) for s in sends])
    actual = Counter(a for a in position if not a.is_compute)
    if actual != expected:
        missing, extra = expected - actual, actual - expected
        raise ScheduleError(
            f"transfers do not match the cross-rank dependencies: missing {sorted(map(str, missing))}, "
            f"not needed {sorted(map(str, extra))}"
        )
    for send in sends:
        producer = Action(Kind.F, send.microbatch, send.stage)
        if send.kind is Kind.SEND_B:
            producer = _backward_input(send.microbatch, send.stage, position)
        if position[send] < position[producer]:
            raise ScheduleError(f"{send} must come after {producer}, which produces the data it sends")
        recv = _recv_of(send)
        consumer = Action(Kind.F, recv.microbatch, recv.stage)
        if recv.kind is Kind.RECV_B:
            consumer = _backward_input(recv.microbatch, recv.stage, position)
        if position[recv] > position[consumer]:
            raise ScheduleError(f"{recv} must come before {consumer}, which needs the data it receives")
    for src, actions in enumerate(schedule):
        for dst in range(p):
            sent = [_recv_of(a) for a in actions if a.kind in (Kind.SEND_F, Kind.SEND_B) and a.peer_stage % p == dst]
            received = [a for a in schedule[dst] if a.kind in (Kind.RECV_F, Kind.RECV_B) and a.peer_stage % p == src]
            if sent != received:
                raise ScheduleError(
                    f"link rank {src} -> rank {dst}: receives posted as {list(map(str, received))} but sends go "
                    f"out as {list(map(str, sent))} (messages match in order, so a receive would get the wrong "
                    f"tensor)"
                )


def _backward_input(microbatch: int, stage: int, present: dict[Action, int]) -> Action:
    """The action that computes stage ``stage``'s input gradient: its B, or its I when B is split."""
    b = Action(Kind.B, microbatch, stage)
    return b if b in present else Action(Kind.I, microbatch, stage)


# -------------------------------------------------------------------------------------- send / recv


def add_send_recv(schedule: Schedule) -> Schedule:
    """Insert the point-to-point transfers into a compute-only schedule, for an executor on real ranks.

    Each SEND goes right after the action producing its data. Each RECV goes right before the action that
    consumes its data, or earlier when needed so that on every link the receives are posted in the order of
    the sends (a RECV posts an ``irecv``, so posting early never blocks).
    """
    if any(not a.is_compute for rank in schedule for a in rank):
        raise ValueError("add_send_recv expects a compute-only schedule (F, B, I, W), it already has transfers")
    p, m, v = _shape(schedule)
    validate(schedule, p, m, v)
    n_stages = p * v
    index = {a: i for actions in schedule for i, a in enumerate(actions)}  # position in its rank's list
    sends_after: dict[Action, Action] = {}
    by_link: defaultdict[tuple[int, int], list[tuple[Action, int]]] = defaultdict(list)  # (recv, consumer index)
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
        for recv, consumer_index in reversed(messages):  # a RECV must precede its own and all later consumers
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
    """Insert one ``REDUCE_GRAD`` per stage, right after the stage's last action that writes weight gradients:
    its last ``B``, or its last ``W`` when the backward is split (Zero Bubble).

    With data parallelism on top of the pipeline, a stage's gradients are complete once its last micro-batch's
    weight gradient is in: the all-reduce (or reduce-scatter) over the data-parallel group can start there and
    overlap the rest of the schedule (the other stages' drain), instead of waiting for the end of the step, as
    Megatron-LM and torchtitan do. Placing it after the last ``I`` instead would reduce gradients that the
    pending ``W`` passes have not written yet -- the reduced gradient would miss them (a bug
    ``torch.distributed.pipelining`` once had with zero-bubble schedules).
    """
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


# --------------------------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Simulation:
    """The timed run of a schedule. Times are in the unit of the costs given to ``simulate``."""

    timeline: Timeline  # per rank: (start, end, action) of each compute action, in order
    makespan: float  # when the last rank finishes
    busy: list[float]  # per rank: total compute time
    peak_in_flight: list[int]  # per rank: most (stage, micro-batch) activations held at once (see module doc)

    @property
    def bubble_fraction(self) -> float:
        """Idle time over total rank-time, p * makespan (GPipe's (p-1)/(m+p-1) for uniform stages)."""
        total = len(self.busy) * self.makespan
        return (total - sum(self.busy)) / total

    @property
    def bubble_ratio(self) -> float:
        """Idle time over compute time (Megatron-LM's bubble / ideal: (p-1)/m for 1F1B)."""
        total = len(self.busy) * self.makespan
        return (total - sum(self.busy)) / sum(self.busy)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most (stage, micro-batch) pairs between their F and their B (or W): see module doc."""
    peaks = []
    for actions in schedule:
        held = peak = 0
        for a in actions:
            held += {Kind.F: 1, Kind.B: -1, Kind.W: -1}.get(a.kind, 0)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def simulate(
    schedule: Schedule,
    cost_f: float = 1.0,
    cost_b: float = 2.0,
    cost_w: float | None = None,
    comm: float = 0.0,
    per_stage_costs: Sequence[tuple[float, float, float]] | None = None,
) -> Simulation:
    """Time ``schedule`` (validated first) with each rank running its list in order.

    ``cost_b`` is the full backward; when B is split, W costs ``cost_w`` (default cost_b / 2) and I the rest,
    so the default costs give F = I = W = 1. ``comm`` is the time of one point-to-point transfer between ranks
    (none between stages on the same rank). ``per_stage_costs[s] = (cost_f, cost_b, cost_w)`` overrides the
    costs for each (virtual) stage, e.g. measured ones.
    """
    p, m, v = _shape(schedule)
    validate(schedule, p, m, v)
    n_stages = p * v
    if per_stage_costs is None:
        w = cost_b / 2 if cost_w is None else cost_w
        per_stage_costs = [(cost_f, cost_b, w)] * n_stages
    if len(per_stage_costs) != n_stages:
        raise ValueError(
            f"per_stage_costs needs one (cost_f, cost_b, cost_w) per stage: {n_stages}, got {len(per_stage_costs)}"
        )
    for s, (f, b, w) in enumerate(per_stage_costs):
        if min(f, b, w) < 0 or w > b:
            raise ValueError(f"stage {s}: costs must be >= 0 with cost_w <= cost_b (W is part of B), got {(f, b, w)}")
    if all(f + b == 0 for f, b, _ in per_stage_costs):
        raise ValueError("every action costs 0: nothing to time")
    if comm < 0:
        raise ValueError(f"comm must be >= 0, got {comm}")

    def duration(a: Action) -> float:
        f, b, w = per_stage_costs[a.stage]
        return {Kind.F: f, Kind.B: b, Kind.I: b - w, Kind.W: w}[a.kind]

    timeline = _execute(schedule, n_stages, duration, comm)
    return Simulation(
        timeline=timeline,
        makespan=max(end for rank in timeline for _, end, _ in rank),
        busy=[sum(end - start for start, end, _ in rank) for rank in timeline],
        peak_in_flight=peak_in_flight(schedule),
    )
