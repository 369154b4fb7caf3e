"""Running a pipeline schedule without processes: when each action runs and what each rank holds.

``simulate`` runs every rank's list in order with given costs: a rank starts its next action when
the rank is free and the action's inputs are there. Dependencies: F on stage s needs F on s - 1 (+
``comm`` when s - 1 is on another rank); B (or I) on s needs F on s and the B (or I) of s + 1 (+
``comm``), the last stage only its own F; W needs I on the same stage. SEND/RECV take no rank time:
a transfer lasts ``comm`` from the end of the action that produced it, or from its SEND when the
schedule has transfers (the receive is assumed posted in time, as torch's runtime does by batching
it with the previous action).

Memory: ``peak_in_flight[r]`` counts the (stage, micro-batch) pairs whose activations rank r holds
at worst: a pair enters with its F and leaves with its B, or, when B is split, with its W (W still
reads the stored layer inputs, so we count it as holding them: the conservative choice). With
``v > 1`` each pair is one model chunk, 1/v of the rank's layers: divide by v for full-stage
micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from course_lib.parallel.schedules import (
    Action,
    Kind,
    Schedule,
    Timeline,
    execute,
    schedule_shape,
    validate,
)


@dataclass(frozen=True)
class Simulation:
    """The timed run of a schedule. Times are in the unit of the costs given to ``simulate``."""

    timeline: Timeline  # per rank: (start, end, action) of each compute action, in order
    makespan: float  # when the last rank finishes
    busy: list[float]  # per rank: total compute time
    peak_in_flight: list[int]  # per rank: most (stage, micro-batch) pairs held at once (module doc)

    @property
    def bubble_fraction(self) -> float:
        """Idle over total rank-time, p * makespan (GPipe's (p-1)/(m+p-1) for uniform stages)."""
        total = len(self.busy) * self.makespan
        return (total - sum(self.busy)) / total

    @property
    def bubble_ratio(self) -> float:
        """Idle time over compute time (Megatron-LM's bubble / ideal: (p-1)/m for 1F1B)."""
        total = len(self.busy) * self.makespan
        return (total - sum(self.busy)) / sum(self.busy)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most (stage, micro-batch) pairs held between F and B (or W); see the module."""
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

    ``cost_b`` is the full backward; when B is split, W costs ``cost_w`` (default cost_b / 2) and I
    the rest, so the default costs give F = I = W = 1. ``comm`` is the time of one point-to-point
    transfer between ranks (none between stages on the same rank).
    ``per_stage_costs[s] = (cost_f, cost_b, cost_w)`` overrides the costs for each (virtual) stage,
    e.g. measured ones.
    """
    p, m, v = schedule_shape(schedule)
    validate(schedule, p, m, v)
    n_stages = p * v
    if per_stage_costs is None:
        w = cost_b / 2 if cost_w is None else cost_w
        per_stage_costs = [(cost_f, cost_b, w)] * n_stages
    if len(per_stage_costs) != n_stages:
        raise ValueError(f"per_stage_costs needs one (cost_f, cost_b, cost_w) per stage: "
                         f"{n_stages}, got {len(per_stage_costs)}")
    for s, (f, b, w) in enumerate(per_stage_costs):
        if min(f, b, w) < 0 or w > b:
            raise ValueError(f"stage {s}: costs must be >= 0 with cost_w <= cost_b "
                             f"(W is part of B), got {(f, b, w)}")
    if all(f + b == 0 for f, b, _ in per_stage_costs):
        raise ValueError("every action costs 0: nothing to time")
    if comm < 0:
        raise ValueError(f"comm must be >= 0, got {comm}")

    def duration(a: Action) -> float:
        f, b, w = per_stage_costs[a.stage]
        return {Kind.F: f, Kind.B: b, Kind.I: b - w, Kind.W: w}[a.kind]

    timeline = execute(schedule, n_stages, duration, comm)
    return Simulation(
        timeline=timeline,
        makespan=max(end for rank in timeline for _, end, _ in rank),
        busy=[sum(end - start for start, end, _ in rank) for rank in timeline],
        peak_in_flight=peak_in_flight(schedule),
    )
