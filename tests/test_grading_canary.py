"""Grading never reports a learner's failure for the grader's: a course in the temp folder graded isolated, the
canary that stops a class run whose kernels cannot start, and the reasons that tell "never started" from "died".

The course copies here live under the system temp folder with their own interpreter (a venv there), as a fresh
clone in ``/tmp`` has: the sandbox's private ``/tmp`` once hid that interpreter, and every submission scored 0,
"the kernel died", exit status 0.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import canary, grader, isolation, papermill_child
from tests.conftest import venv_of_this_environment

REPO = Path(__file__).resolve().parents[1]
SOLUTION = next((REPO / "solutions").glob("00_*.ipynb"))
EXERCISE = REPO / "exercises" / SOLUTION.name
KV_RIGHT, KV_WRONG = "return 2 * n_layer * n_kv_head", "return n_layer * n_kv_head"
needs_namespaces = pytest.mark.skipif(isolation.available().flags is None, reason=isolation.available().reason)


def _course_in_temp(root: Path, kernel_python: str | None = None) -> Path:
    """A course folder under ``root`` (in the temp folder): the library, chapter 00's solution and exercise, and its
    own ``.venv`` there (this environment's packages through a ``.pth`` file) with the kernel ``make setup``
    installs; ``kernel_python`` replaces the kernel's interpreter (a broken installation)."""
    course = root / "course"
    shutil.copytree(REPO / "course_lib", course / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    for path in (SOLUTION, EXERCISE):
        (course / path.parent.name).mkdir(exist_ok=True)
        shutil.copy(path, course / path.parent.name / path.name)
    python = venv_of_this_environment(course / ".venv")
    subprocess.run([python, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"], check=True,
                   capture_output=True)
    if kernel_python:
        spec = course / ".venv" / "share" / "jupyter" / "kernels" / "python3" / "kernel.json"
        spec.write_text(json.dumps({**json.loads(spec.read_text()), "argv": [kernel_python, "-m",
                                    "ipykernel_launcher", "-f", "{connection_file}"]}))
    return course


def _class(course: Path, whole: bool = True) -> Path:
    """blank (the exercise), half (the solution with kv_cache_bytes wrong), full (the solution); ``whole=False``:
    full alone."""
    folder = course / "submissions"
    folder.mkdir()
    shutil.copy(SOLUTION, folder / "full.ipynb")
    if whole:
        shutil.copy(EXERCISE, folder / "blank.ipynb")
        nb = nbformat.read(SOLUTION, as_version=4)
        (cell,) = [c for c in nb.cells if KV_RIGHT in c.source]
        cell.source = cell.source.replace(KV_RIGHT, KV_WRONG)
        nbformat.write(nb, folder / "half.ipynb")
    return folder


def _gradebook(course: Path, *args: str) -> subprocess.CompletedProcess:
    """The class grader as a teacher runs it in that course folder, with that folder's interpreter."""
    env = {**os.environ, "PYTHONPATH": str(course)}
    env.pop("PYTEST_CURRENT_TEST", None)
    return subprocess.run([course / ".venv" / "bin" / "python", "-m", "course_lib.grading.gradebook", "submissions/",
                           "--out", "gradebook.csv", "--jobs", "2", "--time-limit", "240", *args], cwd=course,
                          env=env, capture_output=True, text=True, timeout=900)


@needs_namespaces
@pytest.mark.slow
@pytest.mark.parametrize("reached", ["directly", "through a symbolic link"])
def test_a_course_in_the_temp_folder_grades_a_class_isolated(tmp_path, reached):
    """0 / partial / full with their reasons, isolated, from a course (and its interpreter) under /tmp. Reached
    through a symbolic link, the canary and one submission (what the link changes is where the interpreter is
    found: the scores' reasons are the direct run's)."""
    assert isolation._under(str(tmp_path), isolation.PRIVATE), "the test wants a course under the private /tmp"
    course = _course_in_temp(tmp_path)
    if reached != "directly":
        (tmp_path / "link").symlink_to(course)
        course = tmp_path / "link"
    _class(course, whole=reached == "directly")
    done = _gradebook(course)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "canary: chapter 00's solution graded 12/12 isolated" in done.stdout
    with (course / "gradebook.csv").open() as f:
        rows = list(csv.DictReader(f))
    points = {who: sum(int(r["points"]) for r in rows if r["learner"] == who) for who in ("blank", "half", "full")}
    if reached != "directly":
        assert points == {"blank": 0, "half": 0, "full": 12} and len({r["learner"] for r in rows}) == 1, rows
        assert "died" not in done.stdout + done.stderr
        return
    assert points == {"blank": 0, "half": 10, "full": 12}, rows
    reasons = {(r["learner"], r["exercise"]): r["reason"] for r in rows}
    assert all("not implemented" in why for (who, _), why in reasons.items() if who == "blank"), reasons
    assert reasons["half", "kv_cache_bytes"].startswith("the visible check"), reasons
    assert all("checks passed" in why for (who, ex), why in reasons.items()
               if who == "full" or (who == "half" and ex != "kv_cache_bytes")), reasons
    assert "died" not in done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--isolation", "--no-isolation"])
def test_a_kernel_that_cannot_start_stops_the_class_in_one_line(tmp_path, mode):
    """A broken interpreter path: the canary never gets a kernel; exit 3, one line with the cause and the fix,
    no gradebook written, no submission graded."""
    if mode == "--isolation" and isolation.available().flags is None:
        pytest.skip(isolation.available().reason)
    course = _course_in_temp(tmp_path, kernel_python="/nonexistent/bin/python3")
    _class(course)
    done = _gradebook(course, mode)
    assert done.returncode == canary.EXIT_STATUS, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "the kernel never started" in lines[0] and "/nonexistent/bin/python3" in lines[0], lines[0]
    assert "Fix: run `make setup`" in lines[0] and "no score written" in lines[0]
    assert not list(course.glob("gradebook*.csv")) and "points" not in done.stdout


def test_never_started_and_died_are_different_reasons():
    """Read from the papermill child's output: no "started" line means the kernel never answered."""
    never = "Traceback (most recent call last):\n  ...\nFileNotFoundError: [Errno 2] No such file: '/x/python'\n"
    kind, why = grader._why(never)
    assert kind == grader.NEVER_STARTED and "never started (FileNotFoundError: [Errno 2]" in why
    sandboxed = f"{isolation.MARK} {isolation.NO_START} [Errno 2] nope\nRuntimeError: Kernel died before replying\n"
    assert grader._why(sandboxed) == (grader.NEVER_STARTED, f"the kernel never started ({isolation.NO_START} "
                                      "[Errno 2] nope): the grader's set-up, not the notebook")
    child = papermill_child
    died = f"{child.STARTED}\n{child.RUNNING} 3 of 9\n{child.RUNNING} 4 of 9\nDeadKernelError: Kernel died\n"
    assert grader._why(died) == (grader.DIED, "the kernel died while running cell 4 of 9")


def test_the_kernels_own_shutdown_after_the_last_cell_is_not_a_death():
    """The cause of chapter 09's false "the kernel died" (4 of 21 gradings that then scored every exercise): the
    watcher saw the kernel as a zombie while jupyter_client shut it down after the last cell, because papermill's
    synchronous set-up never called the hook that marked the notebook done. It now watches only while a cell runs."""
    watch = papermill_child.KernelWatch(cells=9)
    assert watch.died(zombie_child=True) is None  # before the first cell
    watch.running = 3
    assert watch.died(zombie_child=False) is None
    assert watch.died(zombie_child=True) == "DeadKernelError: Kernel died while running cell 4 of 9"
    watch.running = None  # the last cell replied; the kernel is being shut down
    assert watch.died(zombie_child=True) is None


def test_a_notebook_whose_every_exercise_scored_is_never_reported_dead(tmp_path, monkeypatch):
    """Whatever the papermill child says after the grading cell wrote every result, nothing was lost."""
    def execute_then_die(src, dst, parameters, cwd, timeout, cell_timeout, key, sandbox):
        module = grader.chapter_module("00")
        results = {ex.key: {"ok": True, "message": "all 3 checks passed"} for ex in module.EXERCISES}
        (cwd / "results.json").write_text(json.dumps({"results": results, "mac": grader.sign(results, key)}))
        return grader.DIED, "the kernel died while running cell 9 of 9"

    monkeypatch.setattr(grader, "_execute", execute_then_die)
    report = grader.grade_notebook(SOLUTION)
    assert report.points == report.max_points and not report.problems and not report.failure, report.table()
    monkeypatch.setattr(grader, "_execute", lambda *a: (grader.DIED, "the kernel died while running cell 2 of 9"))
    report = grader.grade_notebook(SOLUTION)
    assert report.failure == grader.DIED and all("cell 2 of 9" in s.reason for s in report.scores)


def test_the_canary_names_cause_and_fix_for_each_failure(monkeypatch):
    module = grader.chapter_module("00")

    def report(failure: str = "", problem: str = "", ok: bool = True) -> grader.NotebookReport:
        return grader.NotebookReport("x", "00", [grader.ExerciseScore(ex.key, ex.title, ex.points if ok else 0,
                                                                      ex.points, ok, problem or "fine")
                                                for ex in module.EXERCISES], [problem] if problem else [], 1.0,
                                     failure)

    assert canary.verdict("00", SOLUTION, True, report(), 600, True) is None
    cases = {grader.NEVER_STARTED: "make setup", grader.DIED: "--jobs 1", grader.TIMED_OUT: "--time-limit"}
    for failure, fix in cases.items():
        line = canary.verdict("00", SOLUTION, True, report(failure, f"why {failure}", ok=False), 600, True)
        assert f"why {failure}" in line and fix in line and "\n" not in line, line
    wrong = canary.verdict("00", SOLUTION, True, report(problem="the visible check: off by 2", ok=False), 600, False)
    assert "off by 2" in wrong and "make test-fast" in wrong
    assert canary.verdict("00", EXERCISE, False, report(ok=False), 600, True) is None  # a handout's blank exercise
