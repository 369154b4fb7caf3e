"""Chapter 08, exercise 6 — pipeline x data parallelism: the gradient reduction as a schedule action.

``add_grad_reduce(schedule)``: checked as data on 1F1B, interleaved and ZB-H1 schedules, with and without
transfers (the input unchanged, every other action kept in its order, one ``REDUCE_GRAD`` per stage at the place
the text gives, on its micro-batch), then on 4 real ranks: ``train_parallel`` on
``ParallelConfig(MeshShape(dp=2, pp=2), schedule="zb_h1")`` with the learner's function placing the reductions,
against one process (``train_baseline``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from course_lib.grading import core
from course_lib.grading.ch08_placement import LAUNCH_TIMEOUT_S
from course_lib.grading.core import (
    CheckFailed,
    CheckResult,
    run_check,
)
from course_lib.model_config import GPTConfig
from course_lib.parallel import compose as C
from course_lib.parallel import schedules as S
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.runs import merge_composed, train_parallel
from course_lib.parallel.schedules import Action, Kind, add_send_recv
from course_lib.runtime.mesh import MeshShape
from course_lib.train import TrainConfig, compare, train_baseline

# (schedule name, p, m, v): each is checked compute-only and with its transfers (``schedule_run.add_send_recv``)
_REDUCE_CASES = (("1f1b", 2, 4, 1), ("interleaved", 2, 4, 2), ("zb_h1", 4, 8, 1))


def _build(name: str, p: int, m: int, v: int) -> S.Schedule:
    builder = getattr(S, S.canonical_schedule(name))
    return builder(p, m, v) if v > 1 else builder(p, m)


def _weight_kind(actions: list[Action], stage: int) -> Kind:
    """W when the stage's backward is split (zero bubble), else B."""
    return Kind.W if any(a.kind is Kind.W and a.stage == stage for a in actions) else Kind.B


def _check_rank(r: int, given: list[Action], got: list[Action], what: str) -> None:
    plain = [a for a in got if a.kind is not Kind.REDUCE_GRAD]
    if plain != given:
        first = next((i for i, (a, b) in enumerate(zip(plain, given, strict=False)) if a != b),
                     min(len(plain), len(given)))
        want, have = (str(x[first]) if first < len(x) else "the end of the list" for x in (given, plain))
        raise CheckFailed(f"{what}, rank {r}: without its REDUCE_GRAD actions the list must be the input's, in "
                          f"order; at position {first} expected {want}, got {have}")
    held = {a.stage for a in given}
    foreign = sorted({a.stage for a in got if a.kind is Kind.REDUCE_GRAD} - held)
    if foreign:
        raise CheckFailed(f"{what}, rank {r}: REDUCE_GRAD of stage(s) {foreign}, which this rank does not hold "
                          f"(its stages: {sorted(held)})")
    for stage in sorted(held):
        mine = [i for i, a in enumerate(got) if a.kind is Kind.REDUCE_GRAD and a.stage == stage]
        if len(mine) != 1:
            raise CheckFailed(f"{what}, rank {r}: stage {stage} has {len(mine)} REDUCE_GRAD actions, expected "
                              "exactly one (its gradients are reduced once per step)")
        kind = _weight_kind(given, stage)
        writes = [i for i, a in enumerate(got) if a.kind is kind and a.stage == stage]
        last, at = writes[-1], mine[0]
        pending = [str(got[i]) for i in writes if i > at]
        if pending:
            why = (" (zero bubble's weight passes: the reduction must wait for the last W, not the last I)"
                   if kind is Kind.W else "")
            raise CheckFailed(f"{what}, rank {r}: stage {stage}'s REDUCE_GRAD comes before {', '.join(pending)}, "
                              f"weight-gradient work of that stage still to run{why}: the average would miss it")
        between = [str(a) for a in got[last + 1:at] if a.is_compute]
        if between:
            raise CheckFailed(f"{what}, rank {r}: stage {stage}'s REDUCE_GRAD comes after {', '.join(between)}: "
                              f"it must start right after {got[last]}, its last weight-gradient action, so that "
                              "the reduction overlaps the rest of the schedule")
        expected = Action(Kind.REDUCE_GRAD, got[last].microbatch, stage)
        if got[at] != expected:
            raise CheckFailed(f"{what}, rank {r}: expected {expected!r} (the micro-batch of {got[last]}), got "
                              f"{got[at]!r}")


def _check_transform(fn: Callable, schedule: S.Schedule, what: str) -> None:
    given = [list(rank) for rank in schedule]
    got = fn(given)
    if given != schedule:
        raise CheckFailed(f"{what}: add_grad_reduce changed its input schedule; return a new one")
    if not isinstance(got, list) or len(got) != len(schedule) or not all(isinstance(rank, list) for rank in got):
        raise CheckFailed(f"{what}: expected a list of {len(schedule)} lists (one per rank), got {got!r:.200}")
    for r, rank in enumerate(got):
        bad = next((a for a in rank if not isinstance(a, Action) or not isinstance(a.kind, Kind)
                    or type(a.microbatch) is not int or type(a.stage) is not int), None)
        if bad is not None:
            raise CheckFailed(f"{what}, rank {r}: every item must be a schedules.Action of a Kind and two ints, got "
                              f"{bad!r} (build REDUCE_GRAD as Action(Kind.REDUCE_GRAD, microbatch, stage))")
        _check_rank(r, schedule[r], rank, what)


_PP_CFG = GPTConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, bias=False)


def _probe(run: C.Parallelized) -> None:
    """A last composition step: before each step's data-parallel reduction completes, check for every stage of
    this rank the schedule as it ran: no ``REDUCE_GRAD``, or weight-gradient actions after it (the all-reduce
    had already started, so the average misses them); the first problem stops the run with its reason."""
    finish = run.dp.finish_gradient_sync

    def checked() -> None:
        ran = [t.action for t in run.pipe.timelines[-1]]
        for stage in sorted(int(s) for s in run.pipe.stages):
            where = f"rank {dist.get_rank()} (pipeline stage {stage})"
            at = [i for i, a in enumerate(ran) if a.kind is Kind.REDUCE_GRAD and a.stage == stage]
            kind = _weight_kind(ran, stage)
            late = [str(a) for a in ran[at[0] + 1:] if a.kind is kind and a.stage == stage] if at else []
            if not at:
                raise CheckFailed(f"{where} ran no REDUCE_GRAD: its gradients were never averaged over the "
                                  "data-parallel replicas")
            if late:
                raise CheckFailed(f"{where} ran {', '.join(late)} after its REDUCE_GRAD: the all-reduce had "
                                  "already started, so the data-parallel average missed those weight gradients")
        finish()

    run.dp.finish_gradient_sync = checked


def _pp_dp_on_rank(rank: int, world_size: int, fn: Callable, schedule: str, microbatches: int,
                   seed: int) -> Any:
    steps = C.with_step(C.STEPS, C.pipeline_parallel, functools.partial(C.pipeline_parallel, place_grad_reduce=fn))
    return train_parallel(rank, world_size, _PP_CFG, TrainConfig(steps=2, global_batch=8, seed=seed),
                          ParallelConfig(MeshShape(dp=2, pp=2), schedule=schedule, microbatches=microbatches),
                          steps=(*steps, _probe))


def _on_ranks(fn: Callable, schedule: str, microbatches: int, seed: int, timeout: float) -> str:
    what = f"on 4 ranks (dp=2 x pp=2, {schedule}, m={microbatches})"
    try:
        results = core.launch_check(_pp_dp_on_rank, 4, fn, schedule, microbatches, seed, timeout=timeout,
                                    hang_hint=": does every rank's schedule still hold every transfer, once each?",
                                    guard_errors=(CheckFailed.__name__,))
    except CheckFailed as err:
        raise CheckFailed(f"{what}: {str(err).split(': ', 1)[-1]}") from None
    try:
        merged = merge_composed(results)
    except ValueError as err:
        raise CheckFailed(f"{what}: {err}") from None
    report = compare(train_baseline(_PP_CFG, TrainConfig(steps=2, global_batch=8, seed=seed)), merged)
    if not report.ok:
        raise CheckFailed(f"{what}: the run differs from one process: {report}")
    return f"{what} every parameter equals one process's after 2 steps"


def check_grad_reduce_on_ranks(fn: Callable, schedule: str = "zb_h1", microbatches: int = 2, seed: int = 0,
                               timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """Only the on-rank half of ``check_add_grad_reduce``: ``train_parallel`` on dp=2 x pp=2 with ``fn`` placing
    the ``REDUCE_GRAD`` actions, against ``train_baseline`` (parity at ``train.compare``'s tolerance)."""
    return run_check("add_grad_reduce on ranks", lambda: _on_ranks(fn, schedule, microbatches, seed, timeout))


def check_add_grad_reduce(fn: Callable, cases: tuple = _REDUCE_CASES, ranks: tuple = (("zb_h1", 2, 0),),
                          timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """``fn`` on every schedule of ``cases``, compute-only and with transfers: the input unchanged, the output a
    list per rank of ``Action`` s equal to the input once the REDUCE_GRADs are removed, one REDUCE_GRAD per
    stage, after the stage's last B (or W) with at most transfers in between, on that action's micro-batch; then
    each (schedule, m, seed) of ``ranks`` trained on 4 ranks (``check_grad_reduce_on_ranks``)."""
    def body() -> str:
        n = 0
        for name, p, m, v in cases:
            compute = _build(name, p, m, v)
            label = f"{name} p={p} m={m}" + (f" v={v}" if v > 1 else "")
            _check_transform(fn, compute, f"{label} (compute only)")
            _check_transform(fn, add_send_recv(compute), f"{label} (with transfers)")
            n += 2
        runs = [_on_ranks(fn, schedule, m, seed, timeout) for schedule, m, seed in ranks]
        return "; ".join([f"{n} schedules right", *runs])
    return run_check("add_grad_reduce", body)
