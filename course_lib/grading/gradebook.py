"""Grade a class: a folder of submissions in, a gradebook CSV and a summary per exercise out.

    python -m course_lib.grading.gradebook submissions/ --out gradebook.csv
    python -m course_lib.grading.gradebook submissions/ --out gradebook.csv --time-limit 300 --strict
    python -m course_lib.grading.gradebook submissions/ --jobs 4                 # four notebooks at a time
    python -m course_lib.grading.gradebook submissions/ --shard 2/3 --out part2.csv   # this machine's third
    python -m course_lib.grading.gradebook --merge part1.csv part2.csv part3.csv --out gradebook.csv

The folder holds notebooks, one per learner and chapter, under any file name. The learner is, for a notebook
inside a sub-folder, the sub-folder's name (``alice/whatever.ipynb`` -> ``alice``); else the file's stem without
its chapter (``alice.ipynb``, ``alice_01.ipynb``, ``ch05-alice.ipynb`` -> ``alice``); a stem that is nothing but a
chapter (``01_collectives_exercises.ipynb``: one learner's own folder) is the learner named by the folder. The
chapter is read from the notebook's metadata (``course.chapter``, which every exercise notebook carries), else from
its content (the cell importing ``course_lib.grading.chNN``), else from a two-digit chapter number in the file
name (``bob_01.ipynb``, ``ch05-carol.ipynb``).

Speed and scale: ``--jobs N`` grades N notebooks at once (each in its own kernel; N = the cores you can spare,
each notebook starts up to 4 ranks). ``--shard i/n`` (1 <= i <= n) grades only every n-th submission, starting
with the i-th of the sorted list, so n machines (a Slurm array, a CI matrix) split a class; ``--merge`` joins their
CSVs into one gradebook with its summary and totals, as if graded at once.

Each submission is graded by ``course_lib.grading.grader.grade_notebook``: copied into a temporary folder of its
own, executed by papermill in a child process, then scored by the chapter's hidden checks. A submission that is not
a notebook (invalid JSON), has no chapter, or runs past the time limit scores 0 on every exercise with the reason;
grading goes on with the next one.

Outputs:

* ``gradebook.csv``: one row per learner, chapter and exercise: ``learner, chapter, exercise, points, max, reason``.
* ``gradebook_summary.csv`` (next to it) and the same table printed: per chapter and exercise, how many
  submissions passed out of how many, and the most common failure reasons with their counts.
* ``gradebook_totals.csv`` and the printed table per learner: each exercise's points, and the learner's total.

Before the first submission, the canary (``course_lib.grading.canary``): each chapter of the class is graded once
from the course's own solution, through the same sandbox and limits. Unless it scores full marks (a kernel that
cannot start, a sandbox that hides what the kernel needs, a machine too busy for the time limit), the run stops
with one line naming the cause and the fix, and writes no gradebook: a grader failure never reads as the class's.

Exit status: 0 when every submission was graded, whatever the scores (a partial score is a grade, not a crash);
with ``--strict``, 1 unless every submission has full marks; 2 for a usage error; 3 when the canary failed.

Trust model (read this before grading work you did not write):

* Isolated by default (``--isolation``; ``--no-isolation`` for trusted work): each kernel runs in its own Linux
  namespaces (``course_lib.grading.isolation``): no network but its own loopback, every file read-only but its
  temporary folder, a private ``/tmp``, the class folder, the gradebook's folder, ``solutions/`` and ``tests/``
  hidden, a memory limit per process, a process limit (a pids cgroup where one can be made, and a watchdog), the
  time limit, and secrets dropped from its environment. The results are signed with a key made for the run and
  given to the kernel only when the grading cell starts: a results file the notebook wrote itself is refused.
* Not stopped: a kernel exploit (one kernel for all), CPU time and disk bandwidth taken from other jobs (only the
  time limit bounds them), memory summed over a notebook's ranks, and a notebook that hooks its own kernel (the
  hidden checks run there: it can read their settings and patch them before the grading cell runs). Review
  surprising full marks.
* Where the machine refuses namespaces (some containers), one warning line says so and the notebooks run with
  your rights: then grade untrusted work in a container or a throw-away account holding only the course and one
  submission (one ``docker run --network none`` per submission).
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import astuple, dataclass, fields
from importlib.util import find_spec
from pathlib import Path

import nbformat

from course_lib.grading import canary, grader
from course_lib.grading.notebooks import chapter_topic

CHAPTER_IN_NAME = re.compile(r"(?<!\d)(\d{2})(?!\d)")
SUMMARY_REASONS = 3
EXERCISES_DIR = Path(__file__).resolve().parents[2] / "exercises"


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


def _topics() -> dict[str, str]:
    """Chapter -> the topic of its exercise notebook's name ("01" -> "collectives")."""
    return {p.stem[:2]: chapter_topic(p.name) for p in EXERCISES_DIR.glob("[0-9][0-9]_*.ipynb")}


def learner_of(path: Path, folder: Path) -> str:
    """A sub-folder's name; else the file's stem without its chapter number (and the chapter's topic); a stem that
    is only a chapter belongs to the learner the folder is named after."""
    rel = path.relative_to(folder)
    if len(rel.parts) > 1:
        return rel.parts[0]
    stem, chapter = rel.stem, chapter_from_name(path)
    if chapter is None:
        return stem
    topic = re.escape(_topics().get(chapter, ""))
    rest = re.sub(rf"(?i)(?:ch(?:apter)?[ _-]?)?(?<!\d){chapter}(?!\d)(?:[ _-]*{topic})?(?:[ _-]*exercises)?" if topic
                  else rf"(?i)(?:ch(?:apter)?[ _-]?)?(?<!\d){chapter}(?!\d)", "", stem, count=1).strip(" _-.")
    return rest or folder.resolve().name


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


def _read(path: Path) -> nbformat.NotebookNode | Exception:
    try:
        return nbformat.read(path, as_version=4)
    except Exception as exc:  # invalid JSON, not a notebook, unreadable: the learner's problem, not the grader's
        return exc


def _chapter(path: Path, nb: nbformat.NotebookNode | Exception) -> str | None:
    if isinstance(nb, Exception):
        return chapter_from_name(path)
    declared = str(nb.metadata.get("course", {}).get("chapter", ""))
    return declared if is_chapter(declared) else grader.chapter_from_content(nb) or chapter_from_name(path)


def submission_chapter(path: Path) -> str | None:
    """The chapter a submission is graded as (metadata, content, file name), or None."""
    return _chapter(path, _read(path))


def grade_submission(path: Path, learner: str, time_limit: float = grader.NOTEBOOK_TIMEOUT_S,
                     cell_timeout: float = grader.CELL_TIMEOUT_S, isolated: grader.Isolated | None = None) -> \
        list[GradeRow]:
    """Grade one learner's notebook (its kernel in a sandbox when ``isolated``); never raises for problems in the
    submission."""
    nb = _read(path)
    chapter = _chapter(path, nb)
    if isinstance(nb, Exception):
        first_line = (str(nb).splitlines() or [""])[0][:200]
        return _zero_rows(learner, chapter, f"not a readable notebook ({type(nb).__name__}: {first_line})")
    if chapter is None:
        return _zero_rows(learner, None, "cannot tell the chapter: no metadata course.chapter, no cell importing "
                                         "course_lib.grading.chNN, no chapter number in the file name (e.g. "
                                         "01_alice.ipynb)")
    nb.metadata.setdefault("course", {})["chapter"] = chapter
    staging = Path(tempfile.mkdtemp(prefix="course_gradebook_"))  # the grader copies it again into its own folder
    try:
        staged = staging / f"{chapter}_submission.ipynb"
        nbformat.write(nb, staged)
        report = grader.grade_notebook(staged, timeout=time_limit, cell_timeout=min(cell_timeout, time_limit),
                                       isolated=isolated)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [GradeRow(learner, chapter, s.key, s.points, s.max_points, s.reason) for s in report.scores]


def shard_of(paths: list[Path], shard: tuple[int, int] | None) -> list[Path]:
    """Shard ``(i, n)``, 1 <= i <= n: the i-th, (i+n)-th, ... of ``paths`` (sorted); all of them for None."""
    if shard is None:
        return paths
    i, n = shard
    return paths[i - 1::n]


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/3"`` -> (2, 3); raises ``ValueError`` with the fix unless 1 <= i <= n."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: write i/n with whole numbers, e.g. --shard 1/4") from None
    if not 1 <= i <= n:
        raise ValueError(f"--shard {text!r}: need 1 <= i <= n (the i-th of n machines), e.g. --shard 1/{max(n, 1)}")
    return i, n


def grade_class(folder: Path, time_limit: float = grader.NOTEBOOK_TIMEOUT_S,
                cell_timeout: float = grader.CELL_TIMEOUT_S, progress: bool = True, jobs: int = 1,
                shard: tuple[int, int] | None = None, isolated: grader.Isolated | None = None) -> list[GradeRow]:
    """Grade every notebook under ``folder`` (or this ``shard`` of them), ``jobs`` at a time, each kernel in a
    sandbox when ``isolated``; the rows come in the submissions' sorted order whatever the order they finish in."""
    paths = shard_of(find_submissions(folder), shard)

    def one(path: Path) -> list[GradeRow]:
        return grade_submission(path, learner_of(path, folder), time_limit, cell_timeout, isolated)

    results: dict[Path, list[GradeRow]] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # each job waits on its own papermill process
        futures = {pool.submit(one, path): path for path in paths}
        for done, future in enumerate(as_completed(futures), 1):
            path = futures[future]
            results[path] = future.result()
            if progress:
                graded = results[path]
                print(f"[{done}/{len(paths)}] {learner_of(path, folder)}: {path.relative_to(folder)}: "
                      f"{sum(r.points for r in graded)}/{sum(r.max for r in graded)} points", flush=True)
    return [row for path in paths for row in results[path]]


@dataclass(frozen=True)
class LearnerTotal:
    learner: str
    points: int
    max: int
    chapters: str


def totals(rows: list[GradeRow]) -> list[LearnerTotal]:
    """Per learner, in the gradebook's order: points, the maximum, the chapters submitted."""
    out = []
    for learner in dict.fromkeys(r.learner for r in rows):
        mine = [r for r in rows if r.learner == learner]
        chapters = " ".join(sorted({r.chapter for r in mine if r.chapter}))
        out.append(LearnerTotal(learner, sum(r.points for r in mine), sum(r.max for r in mine), chapters))
    return out


def learner_table(rows: list[GradeRow]) -> str:
    """Per learner: one line per exercise (chapter, exercise, points) and the total."""
    lines = []
    for t in totals(rows):
        lines.append(f"{t.learner}: {t.points}/{t.max} points (chapters {t.chapters or 'none'})")
        for r in (r for r in rows if r.learner == t.learner):
            mark = "pass" if r.points == r.max and r.max else "FAIL"
            lines.append(f"    {r.chapter or '--'} {r.exercise or '(no chapter)':<30} {r.points}/{r.max} {mark}")
    return "\n".join(lines)


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


def totals_path(gradebook: Path) -> Path:
    return gradebook.with_name(f"{gradebook.stem}_totals.csv")


def write_totals(rows: list[GradeRow], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([f.name for f in fields(LearnerTotal)])
        writer.writerows(astuple(t) for t in totals(rows))


def read_gradebook(path: Path) -> list[GradeRow]:
    """The rows of a gradebook CSV written by ``write_gradebook`` (a shard's, for ``--merge``)."""
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header != [f.name for f in fields(GradeRow)]:
            raise ValueError(f"{path}: not a gradebook CSV (its header is {header}; expected "
                             f"{[f.name for f in fields(GradeRow)]})")
        return [GradeRow(a, b, c, int(d), int(e), g) for a, b, c, d, e, g in reader]


def merge(parts: list[Path]) -> list[GradeRow]:
    """The shards' rows as one gradebook, sorted by learner then chapter (exercises in their chapter's order);
    a (learner, chapter, exercise) graded in two shards is an error (the same class split twice?)."""
    rows: list[GradeRow] = []
    seen: dict[tuple[str, str, str], Path] = {}
    for part in parts:
        for row in read_gradebook(part):
            key = (row.learner, row.chapter, row.exercise)
            if key in seen and row.exercise:
                raise ValueError(f"{row.learner}, chapter {row.chapter}, {row.exercise} is in both {seen[key]} and "
                                 f"{part}: merge the shards of one split (--shard 1/n ... n/n), each once")
            seen[key] = part
            rows.append(row)
    return sorted(rows, key=lambda r: (r.learner, r.chapter))  # stable: each chapter's exercises keep their order


def write_all(rows: list[GradeRow], out: Path) -> None:
    """The gradebook, its summary and its totals next to it; the summary and the per-learner table printed."""
    summary = summarize(rows)
    write_gradebook(rows, out)
    write_summary(summary, summary_path(out))
    write_totals(rows, totals_path(out))
    print(learner_table(rows))
    print(summary_table(summary))
    print(f"{len({r.learner for r in rows})} learner(s): gradebook in {out}, summary in {summary_path(out)}, "
          f"totals in {totals_path(out)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.gradebook", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, nargs="?",
                        help="a folder of submissions (notebooks, any names, sub-folders ok)")
    parser.add_argument("--out", type=Path, default=Path("gradebook.csv"),
                        help="the gradebook CSV (default gradebook.csv); the summary goes to <out>_summary.csv, the "
                             "totals per learner to <out>_totals.csv")
    parser.add_argument("--time-limit", type=float, default=grader.NOTEBOOK_TIMEOUT_S,
                        help=f"seconds per submission (default {grader.NOTEBOOK_TIMEOUT_S:g})")
    parser.add_argument("--cell-timeout", type=float, default=grader.CELL_TIMEOUT_S,
                        help=f"seconds per cell (default {grader.CELL_TIMEOUT_S:g})")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (default 1)")
    parser.add_argument("--shard", help="i/n: grade only the i-th of n equal parts of the class (1 <= i <= n)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="CSV",
                        help="join these shards' gradebook CSVs into --out (grades nothing)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 unless every submission has full marks (default: exit 0 with the scores)")
    grader.add_isolation_flags(parser, "the default")
    args = parser.parse_args(argv)
    if args.merge:
        if args.folder is not None:
            parser.error("--merge joins CSVs: give no folder")
        missing = [str(p) for p in args.merge if not p.is_file()]
        if missing:
            parser.error(f"no such gradebook CSV: {', '.join(missing)}")
        try:
            rows = merge(args.merge)
        except ValueError as err:
            parser.error(str(err))
    else:
        if args.folder is None or not args.folder.is_dir():
            parser.error(f"{args.folder} is not a folder" if args.folder else "give a folder of submissions")
        if args.jobs < 1:
            parser.error(f"--jobs {args.jobs}: need at least 1")
        try:
            shard = parse_shard(args.shard) if args.shard else None
        except ValueError as err:
            parser.error(str(err))
        if not find_submissions(args.folder):
            parser.error(f"no notebooks under {args.folder}")
        isolated = grader.isolation_for(args.isolation, [args.folder, args.out.resolve().parent], default=True)
        mine = shard_of(find_submissions(args.folder), shard)
        stop = canary.check(filter(None, map(submission_chapter, mine)), args.time_limit, args.cell_timeout,
                            isolated, args.jobs)
        if stop:
            print(f"error: {stop}", file=sys.stderr)
            return canary.EXIT_STATUS
        rows = grade_class(args.folder, args.time_limit, args.cell_timeout, jobs=args.jobs, shard=shard,
                           isolated=isolated)
    write_all(rows, args.out)
    full = bool(rows) and all(r.points == r.max and r.max > 0 for r in rows)
    return 0 if full or not args.strict else 1


if __name__ == "__main__":
    raise SystemExit(main())
