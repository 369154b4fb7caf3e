"""Pipeline schedules as data: one ordered list of actions per rank, checked and timed without any process.

A schedule is ``list[list[Action]]``: ``schedule[r]`` is what rank ``r`` runs, in order. The model is cut into
``n = p * v`` (virtual) stages; stage ``s`` lives on rank ``s % p`` (with ``v = 1`` stage ``s`` is rank ``s``; with
``v > 1`` this is Megatron-LM's interleaved placement, model chunk ``c`` of rank ``r`` being stage ``c * p + r``).

Actions (the letters of the literature and of ``torch.distributed.pipelining``):

* ``F`` forward of one micro-batch through one stage;
* ``B`` full backward; or split in two as in Zero Bubble (Qi et al. 2023): ``I`` backward for the input
  (the gradient the previous stage waits for) and ``W`` backward for the weights (nobody waits for it);
* ``SEND_F`` / ``RECV_F`` (activations, to the next stage) and ``SEND_B`` / ``RECV_B`` (gradients, to the
  previous stage). Their ``stage`` is the stage on *this* rank: ``SEND_F(j, s)`` sends stage s's output to
  s + 1, ``RECV_F(j, s)`` receives stage s's input from s - 1 (the same convention as torch's ``_Action``).

* ``REDUCE_GRAD`` (pipeline + data parallelism): start the data-parallel reduction of one stage's gradients,
  right after the stage's last action that writes weight gradients (``add_grad_reduce``).

The builders here return compute-only schedules. ``course_lib.schedule_run`` runs a schedule without any
process: ``validate`` (is it correct, can it deadlock), ``simulate`` (when does each action run, how many
micro-batches each rank holds), and ``add_send_recv`` / ``add_grad_reduce``, which insert the transfers and the
gradient reductions for an executor on real ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

SCHEDULE_ALIASES: dict[str, str] = {
    "gpipe": "gpipe", "afab": "gpipe",
    "1f1b": "one_f_one_b", "one_f_one_b": "one_f_one_b",
    "interleaved": "interleaved_one_f_one_b", "interleaved_1f1b": "interleaved_one_f_one_b",
    "interleaved_one_f_one_b": "interleaved_one_f_one_b",
    "zb_h1": "zb_h1", "zbh1": "zb_h1", "zero_bubble": "zb_h1",
}
"""The one schedule-name registry: every accepted name -> its canonical name, which is the builder's name in
this module and the name ``cost.bubble_fraction`` takes (the runtime, the figures and the estimator all resolve
names here)."""
SCHEDULE_NAMES: tuple[str, ...] = tuple(dict.fromkeys(SCHEDULE_ALIASES.values()))
"""The canonical names, in order."""


def canonical_schedule(name: str) -> str:
    """The canonical name of ``name`` ("1f1b" -> "one_f_one_b"); a clear ``ValueError`` for an unknown one."""
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
    """One step of a rank: ``kind`` on micro-batch ``microbatch`` through (virtual) stage ``stage``."""

    kind: Kind
    microbatch: int
    stage: int

    def __str__(self) -> str:
        """torch's notation: ``1F0`` is stage 1, forward, micro-batch 0; ``2SEND_B3`` stage 2 sends a gradient."""
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @property
    def peer_stage(self) -> int | None:
        """The stage at the other end of a transfer (its rank is ``peer_stage % p``); None for compute."""
        if self.kind in (Kind.SEND_F, Kind.RECV_B):
            return self.stage + 1
        if self.kind in (Kind.RECV_F, Kind.SEND_B):
            return self.stage - 1
        return None


Schedule = list[list[Action]]


class ScheduleError(ValueError):
    """A schedule that breaks a rule of ``validate`` (the message says which action and why)."""


# --------------------------------------------------------------------------------------------- builders


def check_positive(**values: int) -> None:
    """Every one of ``values`` (p, m, v) must be an int >= 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019), also called AFAB: all m forwards, then all m backwards, on every rank.

    Bubble fraction (p-1)/(m+p-1); every rank holds all m micro-batches' activations at the turn.
    Backwards run in micro-batch order 0..m-1, as torch's ``ScheduleGPipe`` does.
    """
    check_positive(p=p, m=m)
    return [[Action(Kind.F, j, r) for j in range(m)] + [Action(Kind.B, j, r) for j in range(m)] for r in range(p)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B, PipeDream-Flush (Narayanan et al. 2021) as in Megatron-LM: the same bubble as GPipe, less memory.

    Rank r runs min(p-1-r, m) warm-up forwards, then alternates one forward and one backward (steady state),
    then runs the backwards left (cool-down). It holds at most min(p - r, m) micro-batches. torch's
    ``Schedule1F1B`` runs the same order (p - r forwards, then backward/forward pairs) but refuses m < p, which
    Megatron-LM and this function allow.
    """
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
    """The micro-batch groups of interleaved 1F1B: a group goes through a rank's chunk 0, then the same group
    through its chunk 1, and so on, before the next group starts. Sizes, in order:

    * ``group=None``: torch 2.13's ``ScheduleInterleaved1F1B``: r = max(1, m // p) rounds of m / r micro-batches,
      m a multiple of r (p = 4: m = 6 is one group of 6, m = 10 two of 5, m = 9 is refused; m < p is one group
      of m, whose ranks wait on each other: a larger bubble than the formula's);
    * ``group=n``: Megatron-Core's ``microbatch_group_size_per_vp_stage`` (default p there): groups of n with
      p <= n <= m, the last one m % n, which must be 0 or at least p (p = 4, m = 10: n = 5 or 6, not 4).

    Both give groups of p when p divides m: Megatron-LM's older interleaved schedule, which required it.
    """
    check_positive(p=p, m=m)
    if group is None:
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(
                f"interleaved 1F1B as torch's ScheduleInterleaved1F1B runs it takes max(1, m // p) = {rounds} rounds "
                f"of equal size, which do not divide m={m} (p={p}); Megatron-Core takes m={m} with a group size "
                f"(microbatch_group_size_per_vp_stage) whose remainder is 0 or >= p"
            )
        return [m // rounds] * rounds
    check_positive(group=group)
    if not p <= group <= m:
        raise ValueError(f"a micro-batch group of interleaved 1F1B holds p <= n <= m micro-batches; got n={group}, "
                         f"p={p}, m={m}")
    last = m % group
    if 0 < last < p:
        raise ValueError(f"m={m} in groups of {group} leaves a last group of {last} < p={p} micro-batches: its "
                         f"ranks would wait on each other (Megatron-Core refuses it too)")
    return [group] * (m // group) + ([last] if last else [])


def interleaved_one_f_one_b(p: int, m: int, v: int, group: int | None = None) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): v model chunks per rank, chunk c on rank c % p.

    Each rank takes micro-batches in groups (``interleaved_groups``: of p when p divides m) through one chunk,
    then the same group through its next chunk (depth first). With the rank's m*v chunk-steps in that order
    (step k is the k-th (micro-batch, chunk) pair; its backward runs the chunks in reverse order), rank r runs:

    * warm-up: min(2(p-1-r) + (v-1)g, m*v) forwards, g the first group's size (Megatron's and torch's count);
    * then one forward and one backward at a time (1F1B); then the backwards left.

    The bubble shrinks v times: bubble/ideal = (p-1)/(v*m) whenever every group holds at least p micro-batches
    (m >= p), for v times more point-to-point messages; larger groups hold more micro-batches in flight. At
    m == p Megatron-LM runs all forwards first; this keeps the general order there, as torch does.
    """
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

    The order of F and I is 1F1B's; rank r delays its weight-gradient passes by r micro-batches (W of j runs
    right after I of j + r), and the delayed W's fill the cool-down bubble. Each rank's bubble is then
    (p-1)(T_F + T_I - T_W) instead of 1F1B's (p-1)(T_F + T_I + T_W): one third when the three costs are equal.
    That is exact (in ``simulate``) for m >= p and T_W <= min(T_F, T_I); otherwise the bubble is larger.
    Every rank holds at most min(p, m) micro-batches (counting until W), 1F1B's peak (rank 0's).
    Same order as torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank.
    """
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
