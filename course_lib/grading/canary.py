"""The canary: before a class is graded, the course's own solution of each chapter goes through the same grader.

A grader that cannot start a kernel (a sandbox hiding the interpreter, a broken installation) scores every
submission 0, and each row then reads like the learner's failure. So before the first submission, each chapter
of the class is graded once from the course's own solution (``solutions/``), with the same sandbox, time limits
and parallelism. Unless it scores full marks, nothing is graded: one line names the cause and the fix, the exit
status is ``EXIT_STATUS``, and no gradebook is written. In a learners' handout (no ``solutions/``) the canary is
the blank exercise notebook, which must at least be graded (every exercise answered "not implemented").
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from course_lib.grading import grader
from course_lib.grading.notebooks import REPO

EXIT_STATUS = 3
"""The CLIs' exit status when the canary fails (0 graded, 1 --strict and not full marks, 2 a usage error)."""


def reference(chapter: str, repo: Path = REPO) -> tuple[Path, bool] | None:
    """The notebook the canary grades for ``chapter`` and whether it must score full marks: the solution, else
    the exercise (a handout); None when the course has neither."""
    for folder, full in (("solutions", True), ("exercises", False)):
        found = sorted((repo / folder).glob(f"{chapter}_*.ipynb"))
        if found:
            return found[0], full
    return None


def fix_for(report: grader.NotebookReport, time_limit: float, isolated: bool) -> str:
    """What to do about a canary that did not score as it must, from why it failed."""
    if report.failure == grader.NEVER_STARTED:
        return ("run `make setup` (it reinstalls the course's environment and kernel), then grade again"
                + ("; if it persists, --no-isolation tells the sandbox from the installation" if isolated else ""))
    if report.failure == grader.DIED:
        return "free memory or grade fewer notebooks at once (--jobs 1), then grade again"
    if report.failure == grader.TIMED_OUT:
        load = os.getloadavg()[0]
        return (f"the machine is too busy for {time_limit:g} s a notebook (load average {load:.1f}): raise "
                "--time-limit or lower --jobs")
    return ("the course's own checks fail on this machine: bring the course up to date (`git status`, "
            "`make exercises`) and run `make test-fast`; raise --cell-timeout if a check ran out of time")


def verdict(chapter: str, path: Path, full: bool, report: grader.NotebookReport, time_limit: float,
            isolated: bool) -> str | None:
    """None when the canary graded as it must; else the one line that stops the run."""
    if full and report.points == report.max_points and not report.failure:
        return None
    if not full and not report.failure:
        return None
    what = report.problems[0] if report.problems else next(
        f"{s.points}/{s.max_points} on {s.key}: {s.reason}" for s in report.scores if s.points < s.max_points)
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return (f"grading stopped, no score written: the course's own {'solution' if full else 'exercise'} of chapter "
            f"{chapter} ({rel}) scored {report.points}/{report.max_points} through the same "
            f"{'sandbox' if isolated else 'grader'}: {what}. Fix: {fix_for(report, time_limit, isolated)}.")


def check(chapters: Iterable[str], time_limit: float = grader.NOTEBOOK_TIMEOUT_S,
          cell_timeout: float = grader.CELL_TIMEOUT_S, isolated: grader.Isolated | None = None, jobs: int = 1,
          progress: bool = True) -> str | None:
    """Grade each chapter's reference notebook (``jobs`` at a time) as the class will be; None when all passed,
    else the first failing chapter's line."""
    todo = [(ch, *ref) for ch in sorted(set(chapters)) if (ref := reference(ch)) is not None]

    def one(item: tuple[str, Path, bool]) -> str | None:
        chapter, path, full = item
        report = grader.grade_notebook(path, time_limit, min(cell_timeout, time_limit), isolated)
        line = verdict(chapter, path, full, report, time_limit, isolated is not None)
        if line is None and progress:
            print(f"canary: chapter {chapter}'s {'solution' if full else 'blank exercise'} graded "
                  f"{report.points}/{report.max_points} {'isolated' if isolated else 'not isolated'} in "
                  f"{report.seconds:.1f} s: the grader works here", flush=True)
        return line

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return next((line for line in pool.map(one, todo) if line), None)
