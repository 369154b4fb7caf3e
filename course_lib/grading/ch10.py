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

import contextlib
import hashlib
import math
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from course_lib.failures import checkpoint_interval
from course_lib.failures.restart import ResumableSampler, RunSettings, batch_of, build, train_step
from course_lib.grading.cases import ranks
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


ONCE = ("the model's weights", "the optimizer's state", "the scheduler's state")
"""Pieces every data-parallel rank holds alike after an all-reduced step: written once, by one rank."""
PER_RANK = ("the random generator's state",)
"""Pieces that differ between ranks (the generator is seeded by rank): written by every rank. The sampler's
position happens to be equal on every rank here and is not counted either way."""


def _pieces(model: Any, optimizer: Any, scheduler: Any) -> dict[str, list[Any]]:
    """The pieces of this rank's state the count looks for in what it saves: tensors (matched by value) or dicts."""
    moments = [t for state in optimizer.state_dict()["state"].values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim()]
    return {"the model's weights": [t for t in model.state_dict().values() if t.dim()],
            "the optimizer's state": moments, "the scheduler's state": [scheduler.state_dict()],
            "the random generator's state": [torch.get_rng_state()]}


def _occurrences(obj: Any, item: Any) -> int:
    """How many times ``item`` (a tensor, by value; or a dict, by equality) occurs in ``obj``'s containers."""
    if isinstance(item, torch.Tensor) and isinstance(obj, torch.Tensor):
        return int(obj.shape == item.shape and obj.dtype == item.dtype and torch.equal(obj, item))
    if isinstance(item, dict) and isinstance(obj, dict) and obj.keys() == item.keys() and obj == item:
        return 1
    if isinstance(obj, dict):
        return sum(_occurrences(v, item) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_occurrences(v, item) for v in obj)
    return 0


@contextlib.contextmanager
def _saving(root: Path, record: Callable[[str, Any], None]) -> Iterator[None]:
    """While the learner's code runs: ``record(file, obj)`` for every ``torch.save`` to a path, however the
    learner reached the function (``torch.serialization``'s writer and ``_save``, which every ``torch.save`` of the
    zip format goes through in torch 2.13); ``file`` relative to ``root`` where it lies inside."""
    ser = torch.serialization
    opener, save, paths = ser._open_zipfile_writer, ser._save, []

    def opening(f: Any) -> Any:
        paths.append(Path(f) if isinstance(f, str | os.PathLike) else None)
        return opener(f)

    def saving(obj: Any, *args: Any, **kwargs: Any) -> Any:
        path = paths[-1] if paths else None
        if path is not None:
            record(str(path.relative_to(root)) if path.is_relative_to(root) else str(path), obj)
        return save(obj, *args, **kwargs)
    ser._open_zipfile_writer, ser._save = opening, saving
    try:
        yield
    finally:
        ser._open_zipfile_writer, ser._save = opener, save


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
    pieces, written = _pieces(model, optimizer, scheduler), []
    digest = hashlib.sha256(pickle.dumps([t.numpy().tobytes() for t in pieces[PER_RANK[0]]])).hexdigest()
    with _saving(root, lambda file, obj: written.append((file, {k: min(_occurrences(obj, item) for item in items)
                                                                for k, items in pieces.items()}))):
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
    return {"losses": losses, "ref": ref[0], "same": same, "files": files, "written": written, "digest": digest}


def _who_wrote_what(got: list[dict[str, Any]]) -> None:
    """The rules values cannot show: every file was written by torch.save; a piece the ranks hold alike is written
    once in all, a piece that differs by every rank once."""
    files, saved = got[0]["files"], {f for g in got for f, _ in g["written"]}
    unseen = sorted(set(files) - saved)
    if unseen:
        raise CheckFailed(f"{unseen} were written without torch.save (the check reads what each rank passes to "
                          "torch.save: write every file of the checkpoint with it)")
    for piece in ONCE:
        by = [r for r, g in enumerate(got) for _, counts in g["written"] for _ in range(counts[piece])]
        if len(by) != 1:
            raise CheckFailed(f"{piece}: written {len(by)} time(s) (by ranks {by}); every data-parallel rank holds it "
                              "alike, so one rank writes it, once")
    alike = len({g["digest"] for g in got}) == 1
    for piece in PER_RANK:
        for r, g in enumerate(got):
            n = sum(counts[piece] for _, counts in g["written"])
            if not alike and n != 1:
                raise CheckFailed(f"{piece} of rank {r}: written {n} time(s) by rank {r}; it differs between ranks, "
                                  "so every rank writes its own, once")


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
        _who_wrote_what(got)
        files = got[0]["files"]
        params = sum(v.numel() for v in build(settings, 0, world_size)[0].state_dict().values())
        total = sum(files.values())
        if total > 1.5 * 12 * params:  # 12 P bytes (weights + AdamW's m, v) once, plus small per-rank pieces
            raise CheckFailed(f"the checkpoint holds {total:,} bytes for {params:,} parameters: more than 12 bytes a "
                              f"parameter once (weights, m, v) -- the replicated state is written by every rank")
        return (f"bit-exact after a restart at step {stop_at} on {world_size} ranks; the shared pieces written once, "
                f"each rank's generator by that rank; {total:,} bytes written")
    return run_check("checkpoint", body)


def expected_wall(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float, work_s: float) -> float:
    """Daly's expected wall time of a run of ``work_s`` seconds of work: each segment of w seconds (``interval_s``,
    the last one what is left) and its checkpoint take w / goodput(w, C, M, R) on average (failures are memoryless:
    the segments add up)."""
    full, last = divmod(work_s, interval_s)
    segments = [interval_s] * int(full) + ([last] if last > 0 else [])
    return sum(w / checkpoint_interval.goodput(w, cost_s, mtbf_s, restart_s) for w in segments)


def _goodput(fn: Callable, args: tuple[float, ...], generator: torch.Generator) -> float:
    got = fn(*args, generator)
    if isinstance(got, bool) or not isinstance(got, float) or not 0 < got <= 1:
        raise CheckFailed(f"simulated_goodput must return a float in (0, 1], got {got!r}")
    return got


SHORT_RUNS = ((3000.0, 100.0, 2000.0, 200.0, 500.0), (600.0, 60.0, 2000.0, 120.0, 1500.0))
"""(interval, cost, MTBF, restart, work) of runs that end in a shorter segment: less work than one interval, and
two intervals and a half."""


def check_simulated_goodput(fn: Callable, cases: tuple[tuple[float, float, float, float], ...] = (
        (1200.0, 60.0, 11_000.0, 600.0), (300.0, 60.0, 11_000.0, 0.0), (6000.0, 30.0, 4000.0, 300.0)),
        failures: int = 3000, short: tuple[tuple[float, float, float, float, float], ...] = SHORT_RUNS,
        runs: int = 2000, seed: int = 0) -> CheckResult:
    """cases: (interval, cost, MTBF, restart), seconds; each simulated over ``failures`` x MTBF of work against
    Daly's goodput. short: (interval, cost, MTBF, restart, work) runs whose last segment is shorter than the
    interval, each simulated ``runs`` times: their mean wall time (work / goodput) against ``expected_wall``."""
    def body() -> str:
        for tau, c, m, r in cases:
            expected = checkpoint_interval.goodput(tau, c, m, r)
            got = _goodput(fn, (tau, c, m, r, failures * m), torch.Generator().manual_seed(seed))
            # the waste per failure has a standard deviation below (tau + C + R) (a segment, its checkpoint and
            # a restart at most lost at once): over F failures the goodput's standard error is below
            # (tau + C + R) / (M sqrt(F)); 5 of those leaves a correct simulation one failure in 10^6
            bound = 5 * (tau + c + r) / (m * math.sqrt(failures))
            if abs(got - expected) > bound:
                raise CheckFailed(f"interval {tau:g} s, C {c:g} s, MTBF {m:g} s, restart {r:g} s: simulated "
                                  f"{got:.4f}, Daly's expectation {expected:.4f} (more than {bound:.4f} apart)")
        g = torch.Generator().manual_seed(seed)
        for tau, c, m, r, work in short:
            walls = torch.tensor([work / _goodput(fn, (tau, c, m, r, work), g) for _ in range(runs)],
                                 dtype=torch.float64)
            expected = expected_wall(tau, c, m, r, work)
            # the mean of `runs` independent walls: 5 standard errors (measured) leave a correct simulation
            # about one failure in 10^6
            bound = 5 * float(walls.std()) / math.sqrt(runs)
            if abs(float(walls.mean()) - expected) > bound:
                last = work % tau or tau
                raise CheckFailed(f"{work:g} s of work in segments of {tau:g} s (the last one {last:g} s, then "
                                  f"its checkpoint of {c:g} s), MTBF {m:g} s, restart {r:g} s: the mean "
                                  f"wall time over {runs} runs (work / your goodput) is {float(walls.mean()):.1f} "
                                  f"s, Daly's expectation {expected:.1f} s (more than {bound:.1f} apart)")
        return (f"{len(cases)} long runs within the statistical error of Daly's expected goodput; {len(short)} runs "
                "that end in a shorter segment within that of their expected wall time")
    return run_check("simulated_goodput", body)


@contextlib.contextmanager
def _events(log: list[tuple[str, str]], root: Path) -> Iterator[None]:
    """While the learner's loop runs: ("draw", "") for every batch drawn from a ``ResumableSampler``, ("step", "")
    for every optimizer step, ("save", file) for every ``torch.save``, in order."""
    draw = ResumableSampler.__next__

    def drawing(self: ResumableSampler) -> list[int]:
        log.append(("draw", ""))
        return draw(self)
    hook = register_optimizer_step_pre_hook(lambda *args: log.append(("step", "")))
    ResumableSampler.__next__ = drawing  # type: ignore[method-assign]
    try:
        with _saving(root, lambda file, obj: log.append(("save", file))):
            yield
    finally:
        ResumableSampler.__next__ = draw  # type: ignore[method-assign]
        hook.remove()


def _prefetching(rank: int, world_size: int, fn: Callable, folder: str, settings: RunSettings,
                 stop_at: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    ref = _uninterrupted(rank, world_size, settings)[0]
    runs: list[list[tuple[str, str]]] = [[], []]
    with _events(runs[0], Path(folder)):
        fn(rank, world_size, replace(settings, steps=stop_at), Path(folder), 0)
    with _events(runs[1], Path(folder)):
        losses = fn(rank, world_size, settings, Path(folder), 1)
    return {"losses": losses, "ref": ref, "runs": runs}


def _loop_problem(events: list[tuple[str, str]], first: int, rank: int, every: int) -> str | None:
    """What an attempt's events (its steps numbered from ``first``) break of the shipped loop: the batch of step
    s + 1 drawn before step s trains; rank{rank}.pt saved once after each step s with (s + 1) % every == 0, and
    nothing else saved."""
    draws, step, saved = 0, first, set()
    for kind, what in events:
        if kind == "draw":
            draws += 1
        elif kind == "step":
            if draws < step - first + 2:
                return (f"step {step} trained before the batch of step {step + 1} was drawn: the fixed loop keeps "
                        "the prefetching (the next batch is drawn before the current step trains)")
            step += 1
        elif what != f"rank{rank}.pt" or step % every or step in saved:
            return (f"saved {what!r} after step {step - 1}: the fixed loop writes the same files as the shipped one, "
                    f"rank{rank}.pt once after every step s with (s + 1) % {every} == 0")
        else:
            saved.add(step)
    due = {s + 1 for s in range(first, step) if (s + 1) % every == 0}
    if saved != due:
        return (f"saved after steps {sorted(s - 1 for s in saved)}, the shipped loop after steps "
                f"{sorted(s - 1 for s in due)}: the fixed loop writes the same files")
    return None


def check_train_prefetching(fn: Callable, world_size: int = 2, stop_at: int = 4,
                            settings: RunSettings = SETTINGS) -> CheckResult:
    """Attempt 0 stops after ``stop_at`` steps, attempt 1 resumes: the same losses as the uninterrupted run, and,
    in both attempts, on every rank, the shipped loop's order (each batch drawn before the step before it trains)
    and files (rank{r}.pt after every ``settings.every`` steps)."""
    def body() -> str:
        with tempfile.TemporaryDirectory() as d:
            got = launch_check(_prefetching, world_size, fn, d, settings, stop_at, timeout=120,
                               hang_hint=": did every rank reach the same save?")
        losses, ref = got[0]["losses"], got[0]["ref"]
        if not isinstance(losses, list) or len(losses) != settings.steps - stop_at:
            raise CheckFailed(f"the resumed attempt must return the losses of steps {stop_at}..{settings.steps - 1}"
                              f" ({settings.steps - stop_at} floats), got {losses!r:.80}")
        expect_equal(losses, ref[stop_at:], f"losses after resuming at step {stop_at} (the uninterrupted run's)")
        for rank, g in enumerate(got):
            for attempt, (events, first) in enumerate(zip(g["runs"], (0, stop_at), strict=True)):
                problem = _loop_problem(events, first, rank, settings.every)
                if problem:
                    raise CheckFailed(f"rank {rank}, attempt {attempt}: {problem}")
        return (f"resumed at step {stop_at}: the same losses as the uninterrupted run, the shipped loop's prefetching "
                "and files")
    return run_check("train_prefetching", body)


EXERCISES = [
    Exercise("checkpoint", "A checkpoint that resumes bit for bit: shared pieces once, per-rank pieces per rank",
             4, "checkpoint", check_checkpoint, hidden=[{"stop_at": 4}],
             allowed=("course_lib.failures.restart.ResumableSampler",)),
    Exercise("simulated_goodput", "The checkpoint interval: simulate failures, compare with Daly's formula", 3,
             "simulated_goodput", check_simulated_goodput,
             hidden=[{"cases": ((60.0, 10.0, 1000.0, 50.0), (20_000.0, 600.0, 36_000.0, 1200.0)),
                      "short": ((1000.0, 50.0, 5000.0, 300.0, 300.0), (400.0, 40.0, 1500.0, 100.0, 1000.0)),
                      "seed": 1}]),
    Exercise("train_prefetching", "Find the bug: a resume that goes wrong after a restart", 3, "train_prefetching",
             check_train_prefetching, hidden=[{"stop_at": 2}],
             allowed=(*(f"course_lib.failures.restart.{name}" for name in (
                 "build", "batch_of", "train_step", "capture_state", "restore_state", "ResumableSampler")),)),
]


def _goodput_classes(calls: list[dict]) -> set[str]:
    out = {"long runs against Daly's goodput"}
    for call in calls:
        for tau, _, m, r in call["cases"]:
            out |= {"failures during restarts" if r else "instant restarts"} | (
                {"an interval longer than the MTBF"} if tau > m else set())
        for tau, _, _, _, work in call["short"]:
            out.add("less work than one interval" if work < tau else "several segments, the last one shorter")
    return out


CASE_CLASSES = {
    "checkpoint": lambda calls: {c for call in calls for c in ranks(call["world_size"])}
    | {"a restart mid-run", "what each rank wrote"},
    "simulated_goodput": _goodput_classes,
    "train_prefetching": lambda calls: {c for call in calls for c in ranks(call["world_size"])}
    | {"a restart mid-run", "the loop's draws, steps and saves"},
}


guard_visible_checks(globals(), EXERCISES)
