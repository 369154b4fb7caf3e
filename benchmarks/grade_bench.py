"""How long grading takes: a small class graded one notebook at a time and with ``--jobs``.

    python benchmarks/grade_bench.py                              # 3 learners x chapters 00, 01, 06; jobs 1 and 2
    python benchmarks/grade_bench.py --learners 30 --chapters 00 --jobs 2
    python benchmarks/grade_bench.py --isolation both             # each kernel isolated, and not, to compare

Each learner hands in the solution notebook of each chapter (full marks: every check runs, the slowest case). It
prints, per setting, the wall time of the class, the median seconds per notebook (each notebook's own wall time,
which grows when notebooks share the cores) and the load average before and after: on a shared machine the
numbers move with what else runs, so read them with the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from course_lib.grading import gradebook, grader

REPO = Path(__file__).resolve().parents[1]


def make_class(root: Path, learners: int, chapters: list[str]) -> Path:
    """``root/class/learnerK/NN.ipynb``: the solution of each chapter for each learner."""
    folder = root / "class"
    for k in range(learners):
        (folder / f"learner{k}").mkdir(parents=True)
        for ch in chapters:
            shutil.copy(next((REPO / "solutions").glob(f"{ch}_*.ipynb")), folder / f"learner{k}" / f"{ch}.ipynb")
    return folder


def timed(folder: Path, jobs: int, isolated: grader.Isolated | None) -> tuple[float, list[float], int, int, list[str]]:
    seconds: list[float] = []
    original = grader.grade_notebook

    def recording(*args, **kwargs):  # each notebook's own wall time
        report = original(*args, **kwargs)
        seconds.append(report.seconds)
        return report

    grader.grade_notebook = recording
    try:
        start = time.monotonic()
        rows = gradebook.grade_class(folder, progress=False, jobs=jobs, isolated=isolated)
        wall = time.monotonic() - start
    finally:
        grader.grade_notebook = original
    lost = sorted({f"{r.chapter}/{r.exercise}: {r.reason[:120]}" for r in rows if r.points < r.max})
    return wall, seconds, sum(r.points for r in rows), sum(r.max for r in rows), lost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--chapters", nargs="+", default=["00", "01", "06"])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--isolation", choices=["on", "off", "both"], default="off",
                        help="kernels in their own namespaces (course_lib.grading.isolation), or not, or both")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        folder = make_class(Path(root), args.learners, args.chapters)
        n = args.learners * len(args.chapters)
        print(f"{args.learners} learner(s) x chapters {' '.join(args.chapters)} = {n} notebooks, "
              f"{os.cpu_count()} CPU(s)")
        modes = {"on": [True], "off": [False], "both": [False, True]}[args.isolation]
        for jobs, isolate in ((j, m) for j in args.jobs for m in modes):
            isolated = grader.isolation_for(isolate, [folder], default=isolate)
            before = os.getloadavg()[0]
            wall, seconds, points, best, lost = timed(folder, jobs, isolated)
            mode = "isolated" if isolated else "not isolated"
            print(f"--jobs {jobs} {mode}: class {wall:.0f} s, median {statistics.median(seconds):.1f} s per notebook "
                  f"(min {min(seconds):.1f}, max {max(seconds):.1f}), {points}/{best} points, load average "
                  f"{before:.1f} -> {os.getloadavg()[0]:.1f}")
            for reason in lost:  # a solution that loses points: a timeout under load, or a stale copy
                print(f"    lost: {reason}")


if __name__ == "__main__":
    main()
