"""Chapter 10 — failures at scale.

1. ``checkpoint(mode, rank, folder, model, optimizer, scheduler, sampler)``: on 2 real ranks a run stopped, saved,
   rebuilt and loaded must equal the uninterrupted one bit for bit, within the stated bytes on disk, with the
   pieces every rank holds alike written once.
2. ``simulated_goodput(interval_s, cost_s, mtbf_s, restart_s, work_s, generator)``: a simulated run's goodput
   against Daly's expectation within its statistical error.
3. ``train_prefetching(rank, world_size, settings, folder, attempt)`` (find the bug): resumed on 2 real ranks, the
   losses must equal the uninterrupted run's.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course_lib.failures import checkpoint_interval
from course_lib.failures.restart import RunSettings, batch_of, build, train_step
from course_lib.grading.core import (
    CheckFailed,
    CheckResult,
    Exercise,
    expect_equal,
    guard_visible_checks,
    launch_check,
    run_check,
)

GRADER_PARAMETERS = {"seed": 1}
SETTINGS = RunSettings(steps=6, every=2, warmup=6)


def _uninterrupted(rank: int, world_size: int, settings: RunSettings) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, optimizer, scheduler, sampler, starts = build(settings, rank, world_size)
    losses = []
    for _ in range(settings.steps):
        x, y = batch_of(next(sampler), starts, 16)
        losses.append(train_step(model, optimizer, scheduler, x, y))
    return losses, model.state_dict()


def _stop_and_resume(rank: int, world_size: int, fn: Callable, folder: str,
                     settings: RunSettings, stop_at: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    ref = _uninterrupted(rank, world_size, settings)
    root = Path(folder)
    model, optimizer, scheduler, sampler, starts = build(settings, rank, world_size)
    losses = []
    for _ in range(stop_at):
        x, y = batch_of(next(sampler), starts, 16)
        losses.append(train_step(model, optimizer, scheduler, x, y))
    dist.barrier()
    fn("save", rank, root, model, optimizer, scheduler, sampler)
    dist.barrier()
    files = {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}
    model, optimizer, scheduler, sampler, starts = build(settings, rank, world_size)
    torch.manual_seed(12345)  # a new process: its generator is anything but the saved one
    fn("load", rank, root, model, optimizer, scheduler, sampler)
    for _ in range(stop_at, settings.steps):
        x, y = batch_of(next(sampler), starts, 16)
        losses.append(train_step(model, optimizer, scheduler, x, y))
    same = all(torch.equal(v, ref[1][k]) for k, v in model.state_dict().items())
    return {"losses": losses, "ref": ref[0], "same": same, "files": files}


def check_checkpoint(fn: Callable, world_size: int = 2, stop_at: int = 2,
                      settings: RunSettings = SETTINGS) -> CheckResult:
    def body() -> str:
        with tempfile.TemporaryDirectory() as d:
            got = launch_check(_stop_and_resume, world_size, fn, d, settings, stop_at, timeout=120,
                               hang_hint=": did every rank call the same collectives (or none)?")
        for rank, g in enumerate(got):
            bad = [s for s, (a, b) in enumerate(zip(g["losses"], g["ref"], strict=True)) if a != b]
            if bad:
                raise CheckFailed(f"rank {rank}: resumed after step {stop_at}, the loss of step {bad[0]} differs "
                                  f"from the uninterrupted run's ({g['losses'][bad[0]]:.6f} vs {g['ref'][bad[0]]:.6f})"
                                  f": a piece of the state was not saved or not restored on this rank")
            if not g["same"]:
                raise CheckFailed(f"rank {rank}: same losses, but the final weights differ from the uninterrupted run")
        files = got[0]["files"]
        params = sum(v.numel() for v in build(settings, 0, world_size)[0].state_dict().values())
        total = sum(files.values())
        if total > 1.5 * 12 * params:  # 12 P bytes (weights + AdamW's m, v) once, plus small per-rank pieces
            raise CheckFailed(f"the checkpoint holds {total:,} bytes for {params:,} parameters: more than 12 bytes a "
                              f"parameter once (weights, m, v) -- the replicated state is written by every rank")
        return f"bit-exact after a restart at step {stop_at} on {world_size} ranks; {total:,} bytes written"
    return run_check("checkpoint", body)


def check_simulated_goodput(fn: Callable, cases: tuple[tuple[float, float, float, float], ...] = (
        (1200.0, 60.0, 11_000.0, 600.0), (300.0, 60.0, 11_000.0, 0.0), (6000.0, 30.0, 4000.0, 300.0)),
        failures: int = 3000, seed: int = 0) -> CheckResult:
    """cases: (interval, cost, MTBF, restart), seconds; each simulated over ``failures`` x MTBF of work."""
    def body() -> str:
        for tau, c, m, r in cases:
            expected = checkpoint_interval.goodput(tau, c, m, r)
            got = fn(tau, c, m, r, failures * m, torch.Generator().manual_seed(seed))
            if isinstance(got, bool) or not isinstance(got, float) or not 0 < got <= 1:
                raise CheckFailed(f"simulated_goodput must return a float in (0, 1], got {got!r}")
            # the waste per failure has a standard deviation below (tau + C + R) (a segment, its checkpoint and
            # a restart at most lost at once): over F failures the goodput's standard error is below
            # (tau + C + R) / (M sqrt(F)); 5 of those leaves a correct simulation one failure in 10^6
            bound = 5 * (tau + c + r) / (m * math.sqrt(failures))
            if abs(got - expected) > bound:
                raise CheckFailed(f"interval {tau:g} s, C {c:g} s, MTBF {m:g} s, restart {r:g} s: simulated "
                                  f"{got:.4f}, Daly's expectation {expected:.4f} (more than {bound:.4f} apart)")
        return f"{len(cases)} cases within the statistical error of Daly's expected goodput"
    return run_check("simulated_goodput", body)


def _prefetching(rank: int, world_size: int, fn: Callable, folder: str, settings: RunSettings,
                 stop_at: int) -> tuple[list[float], list[float]]:
    torch.set_num_threads(1)
    ref = _uninterrupted(rank, world_size, settings)[0]
    fn(rank, world_size, replace(settings, steps=stop_at), Path(folder), 0)
    losses = fn(rank, world_size, settings, Path(folder), 1)
    return losses, ref


def check_train_prefetching(fn: Callable, world_size: int = 2, stop_at: int = 4,
                            settings: RunSettings = SETTINGS) -> CheckResult:
    def body() -> str:
        with tempfile.TemporaryDirectory() as d:
            got = launch_check(_prefetching, world_size, fn, d, settings, stop_at, timeout=120,
                               hang_hint=": did every rank reach the same save?")
        losses, ref = got[0]
        if not isinstance(losses, list) or len(losses) != settings.steps - stop_at:
            raise CheckFailed(f"the resumed attempt must return the losses of steps {stop_at}..{settings.steps - 1}"
                              f" ({settings.steps - stop_at} floats), got {losses!r:.80}")
        expect_equal(losses, ref[stop_at:], f"losses after resuming at step {stop_at} (the uninterrupted run's)")
        return f"resumed at step {stop_at}: the same losses as the uninterrupted run"
    return run_check("train_prefetching", body)


EXERCISES = [
    Exercise("checkpoint", "A checkpoint that resumes bit for bit: shared pieces once, per-rank pieces per rank",
             4, "checkpoint", check_checkpoint, hidden=[{"stop_at": 4}],
             allowed=("course_lib.failures.restart.ResumableSampler",)),
    Exercise("simulated_goodput", "The checkpoint interval: simulate failures, compare with Daly's formula", 3,
             "simulated_goodput", check_simulated_goodput,
             hidden=[{"cases": ((60.0, 10.0, 1000.0, 50.0), (20_000.0, 600.0, 36_000.0, 1200.0)), "seed": 1}]),
    Exercise("train_prefetching", "Find the bug: a resume that goes wrong after a restart", 3, "train_prefetching",
             check_train_prefetching, hidden=[{"stop_at": 2}],
             allowed=(*(f"course_lib.failures.restart.{name}" for name in (
                 "build", "batch_of", "train_step", "capture_state", "restore_state", "ResumableSampler")),)),
]

guard_visible_checks(globals(), EXERCISES)
