"""Grade a class: a folder of submissions in, a gradebook CSV and a summary per exercise out.

    python -m course_lib.grading.gradebook submissions/ --out gradebook.csv
    python -m course_lib.grading.gradebook submissions/ --out gradebook.csv --time-limit 300 --strict

The folder holds one notebook per learner and chapter, under any file name. The learner is the file's stem
(``alice.ipynb`` -> ``alice``) or, for a notebook inside a sub-folder, the sub-folder's name
(``alice/whatever.ipynb`` -> ``alice``). The chapter is read from the notebook's metadata (``course.chapter``, which
every exercise notebook carries) or, failing that, from a two-digit chapter number in the file name
(``bob_01.ipynb``, ``ch05-carol.ipynb``).

Each submission is graded by ``course_lib.grading.grader.grade_notebook``: copied into a temporary folder of its
own, executed by papermill in a child process, then scored by the chapter's hidden checks. A submission that is not
a notebook (invalid JSON), has no chapter, or runs past the time limit scores 0 on every exercise with the reason;
grading goes on with the next one.

Outputs:

* ``gradebook.csv``: one row per learner, chapter and exercise: ``learner, chapter, exercise, points, max, reason``.
* ``gradebook_summary.csv`` (next to it) and the same table printed: per chapter and exercise, how many
  submissions passed out of how many, and the most common failure reasons with their counts.

Exit status: 0 when every submission was graded, whatever the scores (a partial score is a grade, not a crash);
with ``--strict``, 1 unless every submission has full marks.

Trust model (read this before grading work you did not write):

* Isolation is by folder and process, not a sandbox. Each submission runs in its own temporary directory, as its
  own kernel, one after the other, and its kernel and every rank it started are killed when the time limit passes.
  That stops accidents (a notebook writing ``out.pt`` into the working directory, or never finishing) from
  touching another learner's result.
* It does not stop a hostile submission. The code runs as the user who runs the grader: it can read and write
  anything that user can (the other submissions, the gradebook, the course's files). The hidden checks are the
  modules ``course_lib/grading/chNN.py``, installed with the course and imported into the learner's own kernel,
  which also writes the results file the grader reads: a notebook that sets out to can read the hidden cases,
  patch the checks or forge its score.
* So: grade trusted learners' work as is; grade untrusted submissions inside a container or a throw-away account
  that holds only the course and that one submission (e.g. one ``docker run --network none`` per submission,
  calling this module on a folder holding just that notebook), and review surprising full marks.
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import astuple, dataclass, fields
from importlib.util import find_spec
from pathlib import Path

import nbformat

from course_lib.grading import grader

CHAPTER_IN_NAME = re.compile(r"(?<!\d)(\d{2})(?!\d)")
SUMMARY_REASONS = 3


@dataclass(frozen=True)
class GradeRow:
    """One line of the gradebook."""

    learner: str
    chapter: str
    exercise: str
    points: int
    max: int
    reason: str


def is_chapter(chapter: str) -> bool:
    """True when the course has graded exercises for ``chapter`` (a module ``course_lib.grading.chNN``)."""
    return len(chapter) == 2 and chapter.isdigit() and find_spec(f"course_lib.grading.ch{chapter}") is not None


def learner_of(path: Path, folder: Path) -> str:
    rel = path.relative_to(folder)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def chapter_from_name(path: Path) -> str | None:
    """The first two-digit number in the file name that is a graded chapter."""
    return next((m for m in CHAPTER_IN_NAME.findall(path.name) if is_chapter(m)), None)


def find_submissions(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def _zero_rows(learner: str, chapter: str | None, reason: str) -> list[GradeRow]:
    """Every exercise of the chapter at 0 points, or one row when the chapter is unknown."""
    if chapter is None:
        return [GradeRow(learner, "", "", 0, 0, reason)]
    return [GradeRow(learner, chapter, ex.key, 0, ex.points, reason)
            for ex in grader.chapter_module(chapter).EXERCISES]


def grade_submission(path: Path, learner: str, time_limit: float = grader.NOTEBOOK_TIMEOUT_S,
                     cell_timeout: float = grader.CELL_TIMEOUT_S) -> list[GradeRow]:
    """Grade one learner's notebook; never raises for problems in the submission."""
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:  # invalid JSON, not a notebook, unreadable: the learner's problem, not the grader's
        first_line = (str(exc).splitlines() or [""])[0][:200]
        return _zero_rows(learner, chapter_from_name(path),
                          f"not a readable notebook ({type(exc).__name__}: {first_line})")
    declared = str(nb.metadata.get("course", {}).get("chapter", ""))
    chapter = declared if is_chapter(declared) else chapter_from_name(path)
    if chapter is None:
        return _zero_rows(learner, None, "cannot tell the chapter: set metadata course.chapter or put the chapter "
                                         "number in the file name (e.g. 01_alice.ipynb)")
    nb.metadata.setdefault("course", {})["chapter"] = chapter
    staging = Path(tempfile.mkdtemp(prefix="course_gradebook_"))  # the grader copies it again into its own folder
    try:
        staged = staging / f"{chapter}_submission.ipynb"
        nbformat.write(nb, staged)
        report = grader.grade_notebook(staged, timeout=time_limit, cell_timeout=min(cell_timeout, time_limit))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [GradeRow(learner, chapter, s.key, s.points, s.max_points, s.reason) for s in report.scores]


def grade_class(folder: Path, time_limit: float = grader.NOTEBOOK_TIMEOUT_S,
                cell_timeout: float = grader.CELL_TIMEOUT_S, progress: bool = True) -> list[GradeRow]:
    """Grade every notebook under ``folder``, one after the other."""
    paths = find_submissions(folder)
    rows: list[GradeRow] = []
    for i, path in enumerate(paths, 1):
        learner = learner_of(path, folder)
        if progress:
            print(f"[{i}/{len(paths)}] {learner}: {path.relative_to(folder)} ...", flush=True)
        graded = grade_submission(path, learner, time_limit, cell_timeout)
        if progress:
            print(f"    {sum(r.points for r in graded)}/{sum(r.max for r in graded)} points", flush=True)
        rows += graded
    return rows


@dataclass(frozen=True)
class ExerciseSummary:
    chapter: str
    exercise: str
    passed: int
    submitted: int
    common_failures: list[tuple[str, int]]


def summarize(rows: list[GradeRow]) -> list[ExerciseSummary]:
    """Per chapter and exercise: passes out of submissions and the most frequent failure reasons."""
    keys = list(dict.fromkeys((r.chapter, r.exercise) for r in rows if r.exercise))
    out = []
    for chapter, exercise in keys:
        mine = [r for r in rows if (r.chapter, r.exercise) == (chapter, exercise)]
        failures = Counter(r.reason for r in mine if r.points < r.max)
        out.append(ExerciseSummary(chapter, exercise, sum(r.points == r.max for r in mine), len(mine),
                                   failures.most_common(SUMMARY_REASONS)))
    return out


def summary_table(summary: list[ExerciseSummary]) -> str:
    lines = []
    for s in summary:
        lines.append(f"chapter {s.chapter} {s.exercise}: {s.passed}/{s.submitted} passed")
        lines += [f"    {n} x {reason}" for reason, n in s.common_failures]
    return "\n".join(lines)


def write_gradebook(rows: list[GradeRow], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([f.name for f in fields(GradeRow)])
        writer.writerows(astuple(r) for r in rows)


def write_summary(summary: list[ExerciseSummary], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["chapter", "exercise", "passed", "submitted", "common_failures"])
        for s in summary:
            writer.writerow([s.chapter, s.exercise, s.passed, s.submitted,
                             " | ".join(f"{n} x {reason}" for reason, n in s.common_failures)])


def summary_path(gradebook: Path) -> Path:
    return gradebook.with_name(f"{gradebook.stem}_summary.csv")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.gradebook", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a folder of submissions (notebooks, any names, sub-folders ok)")
    parser.add_argument("--out", type=Path, default=Path("gradebook.csv"),
                        help="the gradebook CSV (default gradebook.csv); the summary goes to <out>_summary.csv")
    parser.add_argument("--time-limit", type=float, default=grader.NOTEBOOK_TIMEOUT_S,
                        help=f"seconds per submission (default {grader.NOTEBOOK_TIMEOUT_S:g})")
    parser.add_argument("--cell-timeout", type=float, default=grader.CELL_TIMEOUT_S,
                        help=f"seconds per cell (default {grader.CELL_TIMEOUT_S:g})")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 unless every submission has full marks (default: exit 0 with the scores)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    if not find_submissions(args.folder):
        parser.error(f"no notebooks under {args.folder}")
    rows = grade_class(args.folder, args.time_limit, args.cell_timeout)
    summary = summarize(rows)
    write_gradebook(rows, args.out)
    write_summary(summary, summary_path(args.out))
    print(summary_table(summary))
    print(f"{len({r.learner for r in rows})} learner(s): gradebook in {args.out}, "
          f"summary in {summary_path(args.out)}")
    full = bool(rows) and all(r.points == r.max and r.max > 0 for r in rows)
    return 0 if full or not args.strict else 1


if __name__ == "__main__":
    raise SystemExit(main())
