"""Times the teacher's guide and the README state, measured here and stored with the machine they were measured on.

    .venv/bin/python -m course_lib.grading.timings run-all              # every chapter and solution notebook
    .venv/bin/python -m course_lib.grading.timings run-all notebooks/03_zero_fsdp.ipynb
    .venv/bin/python -m course_lib.grading.timings grading --learners 30 --jobs 2    # isolated and not
    .venv/bin/python -m course_lib.grading.timings make-test            # times `make test` here (20 minutes)
    .venv/bin/python -m course_lib.grading.timings make-test --target test-fast     # times `make test-fast`
    .venv/bin/python -m course_lib.grading.timings make-test --seconds 1718 1897 1731 --source "CI, ..."

* ``run-all``: each notebook as JupyterLab's Run All runs it (nbclient, a fresh kernel, the notebook's folder, no
  file written): the seconds from the first cell sent to the last cell's reply (the kernel's start apart), and the
  most rank processes alive at once (the processes the launcher's forkserver, or torchrun, started).
* ``grading``: a class of ``--learners`` copies of chapter ``--chapter``'s solution (full marks: every check runs)
  graded ``--jobs`` at a time as ``make grade NB=folder/`` does: the canary, then the class; isolated and not.
* ``make-test``: ``make test``'s wall time (``make test-fast``'s with ``--target test-fast``), or times measured
  elsewhere (``--seconds``, with their ``--source``).

Each record keeps the machine's cores, the load average (1 min) before and after, and the date: on a shared
machine a time means little without them. They are written to ``STORE``; ``python -m
course_lib.grading.teaching_table`` writes the guide's tables and the README's ``make test`` line from it, and a
test fails when they differ from it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat
import psutil

from course_lib.grading import canary, gradebook, grader
from course_lib.grading.notebooks import REPO

STORE = REPO / "docs" / "timings.json"


def machine() -> dict[str, Any]:
    return {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version()}


def _conditions(load_before: float) -> dict[str, Any]:
    return {"cores": os.cpu_count(), "load": [round(load_before, 1), round(os.getloadavg()[0], 1)],
            "date": dt.date.today().isoformat()}


def load() -> dict[str, Any]:
    """The stored measurements (an empty record when there are none yet)."""
    try:
        return json.loads(STORE.read_text())
    except (OSError, ValueError):
        return {"run_all": {}, "grading": {}, "make_test": {}}


def save(record: dict[str, Any]) -> None:
    record["machine"] = machine()
    STORE.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def _ranks(kernel: int) -> int:
    """Rank processes alive now: the kernel's descendants below its own children (the launcher's forkserver, or
    torchrun's agent, starts them; its resource tracker starts none)."""
    try:
        below = [p for child in psutil.Process(kernel).children() for p in child.children(recursive=True)]
    except psutil.Error:
        return 0
    return len(below)


def execute(path: Path, sample: Callable[[int], None] | None = None, interval: float = 0.05) -> tuple[float, float]:
    """Run ``path`` as Run All does, calling ``sample(kernel_pid)`` every ``interval`` s meanwhile; returns (kernel
    start seconds, Run All seconds). A cell that raises (and is not tagged to) raises ``CellExecutionError``."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # the launcher's nbval mode
    start, done = time.monotonic(), threading.Event()
    with client.setup_kernel(env=env):
        kernel_start = time.monotonic() - start
        pid = client.km.provisioner.process.pid

        def watch() -> None:
            while not done.is_set():
                sample(pid)
                time.sleep(interval)

        if sample is not None:
            threading.Thread(target=watch, daemon=True).start()
        start = time.monotonic()
        try:
            for i, cell in enumerate(nb.cells):
                client.execute_cell(cell, i)
        finally:
            done.set()
        return kernel_start, time.monotonic() - start


def run_all(path: Path) -> dict[str, Any]:
    """One notebook's Run All record: seconds, kernel start, the most ranks at once, the conditions."""
    peak = [0]
    before = os.getloadavg()[0]
    kernel_start, seconds = execute(path, lambda pid: peak.__setitem__(0, max(peak[0], _ranks(pid))))
    return {"seconds": round(seconds, 1), "kernel_start_s": round(kernel_start, 1), "ranks": peak[0],
            **_conditions(before)}


def make_class(root: Path, learners: int, chapter: str) -> Path:
    """``root/class/learnerK/NN.ipynb``: the solution of ``chapter`` for each learner."""
    solution, full = canary.reference(chapter) or (None, False)
    if solution is None or not full:
        raise SystemExit(f"chapter {chapter} has no solution here: the grading time needs the teacher's copy")
    folder = root / "class"
    for k in range(learners):
        (folder / f"learner{k:02d}").mkdir(parents=True)
        shutil.copy(solution, folder / f"learner{k:02d}" / f"{chapter}.ipynb")
    return folder


def grading(learners: int, chapter: str, jobs: int, isolate: bool) -> dict[str, Any]:
    """Grade a class of ``learners`` copies of the chapter's solution as ``make grade NB=folder/`` does."""
    with tempfile.TemporaryDirectory(prefix="course_timings_") as root:
        folder = make_class(Path(root), learners, chapter)
        isolated = grader.isolation_for(isolate, [folder], default=isolate)
        seconds: list[float] = []
        original = grader.grade_notebook

        def recording(*args: Any, **kwargs: Any) -> grader.NotebookReport:
            report = original(*args, **kwargs)
            seconds.append(report.seconds)
            return report

        before = os.getloadavg()[0]
        grader.grade_notebook = recording
        try:
            start = time.monotonic()
            stop = canary.check([chapter], isolated=isolated, jobs=jobs, progress=False)
            canary_s = time.monotonic() - start
            rows = [] if stop else gradebook.grade_class(folder, progress=False, jobs=jobs, isolated=isolated)
            wall = time.monotonic() - start
        finally:
            grader.grade_notebook = original
    if stop:
        raise SystemExit(stop)
    return {"learners": learners, "chapter": chapter, "jobs": jobs, "isolated": isolated is not None,
            "seconds": round(wall, 1), "canary_s": round(canary_s, 1),
            "median_notebook_s": round(statistics.median(seconds[1:]), 1),
            "points": [sum(r.points for r in rows), sum(r.max for r in rows)], **_conditions(before)}


MAKE_TARGETS = {"test": "make_test", "test-fast": "make_test_fast"}
"""The make targets whose time is stored, and their key in the store."""


def make_test(target: str = "test") -> dict[str, Any]:
    before, start = os.getloadavg()[0], time.monotonic()
    done = subprocess.run(["make", target], cwd=REPO)
    if done.returncode:
        raise SystemExit(f"make {target} failed (exit {done.returncode}): not recorded")
    return {"seconds": [round(time.monotonic() - start)], "source": "measured here by this script",
            **_conditions(before)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.timings", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("run-all", help="Run All of notebooks (default: every chapter and solution)")
    one.add_argument("notebooks", nargs="*", type=Path)
    cls = sub.add_parser("grading", help="grade a class of one chapter's solutions, isolated and not")
    cls.add_argument("--learners", type=int, default=30)
    cls.add_argument("--chapter", default="00")
    cls.add_argument("--jobs", type=int, default=2)
    cls.add_argument("--isolation", choices=["on", "off", "both"], default="both")
    mt = sub.add_parser("make-test", help="time `make test`, or record times measured elsewhere")
    mt.add_argument("--seconds", type=float, nargs="+", help="times measured elsewhere (then give --source)")
    mt.add_argument("--source", help="where --seconds were measured (e.g. CI, its last three runs)")
    mt.add_argument("--target", choices=list(MAKE_TARGETS), default="test", help="the make target timed")
    args = parser.parse_args(argv)
    record = load()
    if args.what == "run-all":
        paths = args.notebooks or sorted([*(REPO / "notebooks").glob("*.ipynb"), *(REPO / "solutions").glob("*.ipynb")])
        for path in paths:
            key = path.resolve().relative_to(REPO).as_posix()
            record["run_all"][key] = run_all(path)
            save(record)
            print(f"{key}: {record['run_all'][key]}", flush=True)
    elif args.what == "grading":
        for isolate in {"on": [True], "off": [False], "both": [False, True]}[args.isolation]:
            got = grading(args.learners, args.chapter, args.jobs, isolate)
            record["grading"]["isolated" if got["isolated"] else "not isolated"] = got
            save(record)
            print(got, flush=True)
    else:
        if args.seconds and not args.source:
            parser.error("--seconds needs --source: where were they measured?")
        key = MAKE_TARGETS[args.target]
        record[key] = ({"seconds": [round(s) for s in args.seconds], "source": args.source,
                        "date": dt.date.today().isoformat()} if args.seconds else make_test(args.target))
        save(record)
        print(record[key])
    return 0


if __name__ == "__main__":
    sys.exit(main())
