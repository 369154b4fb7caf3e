"""The grader: run a learner's notebook with papermill, then the chapter's hidden checks, and score it.

    python -m course_lib.grading exercises/01_collectives_exercises.ipynb          # one notebook
    python -m course_lib.grading submissions/ --out report.json           # a class's folder
    python -m course_lib.grading submissions/ --strict                    # exit 1 unless every mark is earned
    python -m course_lib.grading submissions/ --jobs 2                    # two notebooks at a time

The course's own blank exercise (``exercises/NN_..._exercises.ipynb``) named while the learner has a copy in
``my_work/exercises/`` grades that copy, and says so in one line (``--as-named`` grades the course's copy, and says
so when the learner's copy was edited): JupyterLab serves ``my_work/``, where the answers are.

Exit status: 0 once the notebooks are graded, whatever they scored (the score is printed and written with
``--out``); with ``--strict``, 1 unless every notebook has full marks (for CI); 2 for a usage error, when no
notebook was found, or for a path that does not exist, is not a notebook, or is a notebook whose chapter cannot be
told (one line on stderr says which); 3 when a folder (a class) was given and the canary failed: the course's own
solution, graded first through the same sandbox, did not score full marks (``course_lib.grading.canary``).
The chapter is ``metadata.course.chapter``, else the chapter whose checks a cell imports, else the file name's
leading ``NN_``.

What an answer may use: each exercise names the ``course_lib`` objects its answer may use (``Exercise.allowed`` in
``course_lib/grading/chNN.py``: the comm layer, what the exercise hands the learner). Any other object of the library
(or of ``torch.distributed.pipelining``) scores 0 for that exercise, with a reason that names it and what is allowed:
before the checks run when the answer's code reaches it (an import anywhere in the cell or inside a function or
method, an alias, a subclass or an inherited method, an attribute chain, ``getattr``, ``importlib``, ``__import__``
or ``sys.modules`` with constant strings: ``course_lib.grading.allowlist``), and while the checks run when the
answer's code calls the library's however it got hold of it (a name built at run time, a copied code object:
``course_lib.grading.runtime_guard``), on the ranks too. The notebook's self-checks refuse the same.

How a notebook is graded:

1. It is copied into a temporary folder (the learner's file is never modified). Every code cell gets the
   ``raises-exception`` tag, so one broken cell costs only the exercises that need it, and a last cell is appended
   that runs the hidden checks in the notebook's own namespace and writes their results, one exercise at a time
   (``course_lib.grading.in_kernel``).
2. papermill executes the copy in a child process (``course_lib.grading.papermill_child``), with the chapter's
   parameters injected (another seed, other sizes: a hard-coded answer does not pass), a time limit per cell (the
   kernel is interrupted and execution goes on) and one for the whole notebook (the child, its kernel and any ranks
   it started are killed).
3. Each exercise scores its points only if its visible check *and* all hidden checks pass. A missing result scores 0
   with the reason, which tells the grader's failures from the notebook's: the kernel never started (an
   installation or sandbox problem, not the learner's), the kernel died while running cell N, the notebook timed
   out. A notebook whose every exercise has its result is never reported dead (the kernel's own shutdown after the
   last cell is not a death).

Untrusted submissions: ``--isolation`` (the default for a folder) runs each kernel in its own Linux namespaces
(``course_lib.grading.isolation``: no network, the files read-only, the other submissions, the output and the
answer keys hidden, memory and process limits); where the machine refuses namespaces, one warning line says so and
the notebooks run with the rights of the user who runs the grader (``--no-isolation`` asks for that). The results
the grading cell writes are signed with a key made for this run and handed to the kernel only as the grading cell
starts: a results file written by the notebook itself is refused. The papermill child and the kernel are killed by
the kernel when the grader dies (``prctl(PR_SET_PDEATHSIG)``).
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import nbformat
import psutil

from course_lib.grading import isolation
from course_lib.grading.in_kernel import chapter_module, sign
from course_lib.grading.notebooks import fingerprint
from course_lib.grading.papermill_child import KEY_SLOT, RUNNING, STARTED

CELL_TIMEOUT_S = 120
NOTEBOOK_TIMEOUT_S = 600
NEVER_STARTED, DIED, TIMED_OUT, NOT_EXECUTED, FORGED = "never started", "died", "timed out", "not executed", "forged"
"""``NotebookReport.failure``: why results are missing (empty when the grading cell wrote them all)."""


@dataclass
class ExerciseScore:
    key: str
    title: str
    points: int
    max_points: int
    ok: bool
    reason: str


@dataclass
class NotebookReport:
    notebook: str
    chapter: str
    scores: list[ExerciseScore] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    failure: str = ""

    @property
    def points(self) -> int:
        return sum(s.points for s in self.scores)

    @property
    def max_points(self) -> int:
        return sum(s.max_points for s in self.scores)

    def table(self) -> str:
        rows = [(s.key, f"{s.points}/{s.max_points}", "pass" if s.ok else "FAIL", s.reason) for s in self.scores]
        w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
             for i, h in enumerate(("exercise", "points", "result"))]
        lines = [f"{self.notebook} (chapter {self.chapter}): {self.points}/{self.max_points} points"]
        lines += [f"  ! {p}" for p in self.problems]
        lines.append(f"  {'exercise'.ljust(w[0])}  {'points'.ljust(w[1])}  {'result'.ljust(w[2])}  reason")
        lines += [f"  {k.ljust(w[0])}  {p.ljust(w[1])}  {r.ljust(w[2])}  {why}" for k, p, r, why in rows]
        return "\n".join(lines)


def read_results(path: Path, key: str) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The results the grading cell wrote, or nothing and why: no file, or one this run's key did not sign."""
    if not path.exists():
        return {}, None
    try:
        data = json.loads(path.read_text())
        results, mac = data["results"], data["mac"]
        valid = isinstance(results, dict) and hmac.compare_digest(sign(results, key), str(mac))
    except (ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        return {}, "the results file was not written by the grading cell (not signed with this run's key): refused"
    return results, None


# ----------------------------------------------------------------------------------------------------------------
# The grader process


CHAPTER_IN_CODE = re.compile(r"course_lib\.grading(?: import |\.)ch(\d{2})\b")


def _graded(chapter: str) -> bool:
    return len(chapter) == 2 and chapter.isdigit() and find_spec(f"course_lib.grading.ch{chapter}") is not None


def chapter_from_content(nb: nbformat.NotebookNode) -> str | None:
    """The chapter whose checks the notebook imports (``from course_lib.grading import ch05``)."""
    for cell in nb.cells:
        for m in CHAPTER_IN_CODE.findall(cell.source if cell.cell_type == "code" else ""):
            if _graded(m):
                return m
    return None


def notebook_chapter(path: Path, nb: nbformat.NotebookNode) -> str:
    """``metadata.course.chapter``, else the chapter whose checks a cell imports, else the file name's NN_."""
    declared = str(nb.metadata.get("course", {}).get("chapter", ""))
    for chapter in (declared, chapter_from_content(nb) or "", path.name[:2]):
        if _graded(chapter):
            return chapter
    raise ValueError(f"{path}: cannot tell the chapter: no metadata course.chapter, no cell importing "
                     "course_lib.grading.chNN, and the name does not start with a graded chapter (NN_topic.ipynb)")


def _prepare(nb: nbformat.NotebookNode, chapter: str, results_path: Path) -> nbformat.NotebookNode:
    for cell in nb.cells:
        if cell.cell_type == "code":
            tags = cell.metadata.setdefault("tags", [])
            if "raises-exception" not in tags:
                tags.append("raises-exception")
    nb.cells.append(nbformat.v4.new_code_cell(
        "from course_lib.grading.in_kernel import run_hidden_checks\n"
        f"run_hidden_checks({chapter!r}, globals(), {str(results_path)!r}, key={KEY_SLOT})"))
    return nb


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill the papermill child, its kernel (its own session) and anything the kernel started (ranks)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in [*family, psutil.Process(proc.pid)] if proc.poll() is None else family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=5)


def _execute(src: Path, dst: Path, parameters: dict[str, Any], cwd: Path, timeout: float, cell_timeout: float,
             key: str, sandbox: isolation.Sandbox | None) -> tuple[str, str] | None:
    """Run papermill on ``src`` in a child process (the key on its stdin); return (failure kind, the problem in
    words) or None."""
    cmd = [sys.executable, "-m", "course_lib.grading.papermill_child", "--execute", str(src), str(dst),
           json.dumps(parameters), str(cell_timeout), json.dumps(sandbox and asdict(sandbox))]
    env = {**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1", "JUPYTER_RUNTIME_DIR": str(cwd)}
    env.pop("PYTEST_CURRENT_TEST", None)
    proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        out, _ = proc.communicate(key + "\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        return TIMED_OUT, f"the notebook did not finish within {timeout:g} s and was stopped"
    return None if proc.returncode == 0 else _why(out)


def _why(out: str) -> tuple[str, str]:
    """What a failed papermill child's output says: the kernel never started, died in a cell, or something else."""
    lines = out.strip().splitlines() or ["(no output)"]
    sandbox_says = [line.split(isolation.MARK, 1)[1].strip() for line in lines if isolation.MARK in line]
    if STARTED not in out:
        errors = [line for line in lines if re.match(r"^\w*(Error|Exception)\b", line)]
        detail = (sandbox_says or errors or lines)[-1][:300]
        return NEVER_STARTED, f"the kernel never started ({detail}): the grader's set-up, not the notebook"
    if "DeadKernelError" in out or "Kernel died" in out:
        cell = [line.removeprefix(RUNNING).strip() for line in lines if line.startswith(RUNNING)]
        where = f" cell {cell[-1]}" if cell else " the notebook"
        return DIED, f"the kernel died while running{where}" + "".join(f" ({s})" for s in sandbox_says[-1:])
    return NOT_EXECUTED, "the notebook could not be executed: " + lines[-1][:300]


def grade_notebook(path: Path, timeout: float = NOTEBOOK_TIMEOUT_S, cell_timeout: float = CELL_TIMEOUT_S,
                   isolated: Isolated | None = None) -> NotebookReport:
    """Grade one notebook, its kernel in a sandbox when ``isolated``; never raises for problems in the notebook."""
    start = time.monotonic()
    nb = nbformat.read(path, as_version=4)
    chapter = notebook_chapter(path, nb)
    module = chapter_module(chapter)
    report = NotebookReport(str(path), chapter)
    work = Path(tempfile.mkdtemp(prefix="course_grade_"))
    try:
        results_path = work / "results.json"
        src, dst = work / path.name, work / f"executed_{path.name}"
        nbformat.write(_prepare(nb, chapter, results_path), src)
        key = secrets.token_hex(32)
        sandbox = isolated and isolation.Sandbox(str(work), [str(h) for h in isolated.hidden], isolated.memory_bytes,
                                                 isolated.processes, [str(k) for k in isolated.keep])
        try:
            failed = _execute(src, dst, getattr(module, "GRADER_PARAMETERS", {}), work, timeout, cell_timeout, key,
                              sandbox)
        finally:
            if sandbox:
                isolation.remove_cgroup(sandbox.cgroup)
        results, forged = read_results(results_path, key)
        if forged:
            failed = FORGED, forged
        elif failed and all(ex.key in results for ex in module.EXERCISES):
            failed = None  # every exercise has its result: whatever happened after, nothing was lost
        problem = failed[1] if failed else None
        if failed:
            report.failure = failed[0]
            report.problems.append(failed[1])
        for ex in module.EXERCISES:
            res = results.get(ex.key)
            if res is None:
                reason = problem or "the grading cell did not run"
                report.scores.append(ExerciseScore(ex.key, ex.title, 0, ex.points, False, reason))
            else:
                pts = ex.points if res["ok"] else 0
                report.scores.append(ExerciseScore(ex.key, ex.title, pts, ex.points, res["ok"], res["message"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report.seconds = time.monotonic() - start
    return report


def find_notebooks(paths: list[Path]) -> list[Path]:
    """The notebooks of ``paths`` (folders searched recursively, checkpoints skipped); raises ``UsageError`` naming
    a path that does not exist or is not a notebook."""
    for p in paths:
        if not p.exists():
            raise UsageError(f"{p}: no such file or folder")
        if p.is_file() and p.suffix != ".ipynb":
            raise UsageError(f"{p}: not a notebook (expected an .ipynb file or a folder of them)")
    return [nb for p in paths for nb in (sorted(p.rglob("*.ipynb")) if p.is_dir() else [p])
            if ".ipynb_checkpoints" not in nb.parts]


class UsageError(ValueError):
    """A path the grader cannot grade: the CLI prints it on one line and exits 2."""


REPO = Path(__file__).resolve().parents[2]
MY_WORK = REPO / "my_work"


def _cells_changed(nb: nbformat.NotebookNode) -> bool:
    return nb.metadata.get("course", {}).get("generated") != fingerprint(nb)


def learners_copy(path: Path, my_work: Path = MY_WORK, as_named: bool = False) -> tuple[Path, str | None]:
    """The notebook to grade for ``path``, and the line that says which when it matters: the learner's copy in
    ``my_work/exercises/`` when ``path`` is the course's untouched exercise of the same name (unless
    ``as_named``)."""
    try:
        name = path.resolve().relative_to((REPO / "exercises").resolve())
    except ValueError:
        return path, None
    mine = my_work / "exercises" / name
    if not (mine.is_file() and path.is_file()) or _cells_changed(nbformat.read(path, as_version=4)):
        return path, None  # no copy, or the course's copy is where this learner works
    if not as_named:
        return mine, f"grading your copy {mine}: {path} is the course's untouched copy (--as-named grades it)"
    try:
        edited = fingerprint(nbformat.read(mine, as_version=4)) != fingerprint(nbformat.read(path, as_version=4))
    except Exception:  # an unreadable copy: whatever it holds, it is not the course's
        edited = True
    return path, (f"grading {path}, the course's untouched copy, as named: your edited copy {mine} is not graded"
                  if edited else None)


TEACHER_ONLY = [REPO / "solutions", REPO / "tests"]
"""Hidden from every isolated kernel: the answer keys and the tests' fixtures."""


@dataclass(frozen=True)
class Isolated:
    """How to isolate the kernels of one run: what they must not see (besides ``TEACHER_ONLY``), the limits, and
    what they must see wherever it lies (the course, Python, its packages: ``isolation.kept_paths``)."""

    hidden: tuple[Path, ...] = ()
    memory_bytes: int = 8 << 30
    processes: int = 256
    keep: tuple[Path, ...] = ()


def isolation_for(wanted: bool | None, hidden: list[Path], default: bool) -> Isolated | None:
    """``Isolated`` when asked for (``wanted``) or by ``default``, and the machine allows it; None otherwise, with
    one warning line on stderr when it was wanted and cannot be had."""
    if not (default if wanted is None else wanted):
        return None
    how = isolation.available()
    if how.flags is None:
        print(f"warning: grading WITHOUT isolation: {how.reason}; submissions run with your rights (grade untrusted "
              "work in a container or a throw-away account, or pass --no-isolation to silence this)",
              file=sys.stderr, flush=True)
        return None
    needed = [REPO, Path(sys.prefix).resolve()]  # a folder holding the course or Python cannot be hidden
    return Isolated(tuple(dict.fromkeys(p.resolve() for p in [*TEACHER_ONLY, *hidden]
                                        if not any(n == p.resolve() or p.resolve() in n.parents for n in needed))),
                    keep=tuple(map(Path, isolation.kept_paths())))


def chapters_of(paths: list[Path]) -> dict[Path, str]:
    """Each notebook of ``paths`` and its chapter; ``UsageError`` for one that cannot be read or told."""
    found = {}
    for nb in find_notebooks(paths):
        try:
            content = nbformat.read(nb, as_version=4)
        except Exception as err:  # not JSON, not a notebook
            raise UsageError(f"{nb}: not a readable notebook ({type(err).__name__})") from None
        try:
            found[nb] = notebook_chapter(nb, content)
        except ValueError as err:
            raise UsageError(str(err)) from None
    return found


def grade(paths: list[Path], timeout: float = NOTEBOOK_TIMEOUT_S, cell_timeout: float = CELL_TIMEOUT_S,
          progress: bool = True, jobs: int = 1, isolated: Isolated | None = None) -> list[NotebookReport]:
    """Grade the notebooks of ``paths``, ``jobs`` at a time (each in its own papermill process); reports in the
    notebooks' order. A notebook whose chapter cannot be told raises ``UsageError`` before anything runs."""
    notebooks = list(chapters_of(paths))

    def one(i_nb: tuple[int, Path]) -> NotebookReport:
        i, nb = i_nb
        report = grade_notebook(nb, timeout, cell_timeout, isolated)
        if progress:
            print(f"[{i}/{len(notebooks)}] {report.table()}", flush=True)
        return report

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, enumerate(notebooks, 1)))


def add_isolation_flags(parser: argparse.ArgumentParser, default: str) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--isolation", dest="isolation", action="store_true", default=None,
                       help=f"run each kernel in its own namespaces (no network, read-only files, limits; {default})")
    group.add_argument("--no-isolation", dest="isolation", action="store_false",
                       help="run the kernels with your own rights (trusted work only)")
