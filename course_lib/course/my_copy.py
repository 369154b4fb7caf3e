"""The learner's own copy of the course, in a folder git ignores: what ``make lab`` opens.

    python -m course_lib.course.my_copy              # make my-copy; make lab runs it first
    python -m course_lib.course.my_copy --dest DIR   # another folder (make my-copy MY_WORK=DIR)

Why: JupyterLab saves an open notebook by itself (autosave, every two minutes), so running a chapter changes the
file it was opened from. Were that a tracked notebook, the next ``git pull`` that brings a new version of it
would stop ("your local changes would be overwritten"). ``make lab`` therefore serves ``my_work/`` only:
``my_work/notebooks/`` (the chapters) and ``my_work/exercises/`` (where the answers go), laid out as in the
repository so the links between chapters and exercises work. The tracked notebooks are out of the server's
reach; nothing a learner runs or saves there shows in ``git status``.

For each notebook of ``notebooks/`` and ``exercises/`` (its *course version*) and its copy in ``my_work/``:

* no copy yet: copied (after a ``git pull``, new chapters arrive this way);
* the copy has the course version's cells (type and source; :func:`course_lib.grading.notebooks.fingerprint`):
  nothing to do, whatever its outputs (running is not editing);
* the course version changed, and the copy still has the cells it was copied with (recorded in
  ``my_work/.copies.json``): the learner only ran it, so it is replaced by the new version;
* otherwise the learner edited it: kept as it is, never overwritten; when the course version changed since it
  was copied, every run says so and names the course version to compare with. (A copy without a record, made by
  hand, counts as a copy of the course version of the day.)

A notebook of an earlier layout is moved where the course's own is, unless a file is already there: a copy of an
exercise at ``my_work/NN_name.ipynb`` into ``my_work/exercises/``, where its links work, and an exercise under the
chapter's own name (``exercises/03_zero_fsdp.ipynb``) to the exercise's name (``03_zero_fsdp_exercises.ipynb``).

It also writes ``my_work/Makefile``: JupyterLab's terminal starts in ``my_work/`` (``make lab`` starts the server
there), and ``make grade NB=exercises/01_collectives_exercises.ipynb`` typed there grades the learner's copy
through the course's own Makefile.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from course_lib.grading.notebooks import exercise_name, fingerprint

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("notebooks", "exercises")
RECORD = ".copies.json"  # {"notebooks/00_budgets.ipynb": fingerprint of the cells it was copied with}


@dataclass
class Report:
    """What :func:`sync` did, path by path (relative to the learner's folder)."""

    copied: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # edited by the learner while the course version changed
    moved: list[str] = field(default_factory=list)  # "old -> new", from the earlier flat layout

    def lines(self, dest: Path, repo: Path) -> list[str]:
        out = [f"copied: {dest / p}" for p in self.copied]
        out += [f"updated (you had not edited it): {dest / p}" for p in self.updated]
        out += [f"moved: {m}" for m in self.moved]
        out += [f"kept (yours, edited): {dest / p}; the course's new version is {repo / p}" for p in self.kept]
        return out


def _cells(path: Path) -> str | None:
    """The fingerprint of a notebook's cells, or None when it is not a readable notebook."""
    try:
        return fingerprint(nbformat.read(path, as_version=4))
    except (OSError, ValueError, KeyError, AttributeError):  # NotJSONError is a ValueError
        return None


def _read_record(path: Path) -> dict[str, str]:
    """The fingerprints the copies were made with; an unreadable record counts as none (edits are still kept)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _course_exercise(name: str, repo: Path) -> str | None:
    """The course's exercise a learner's file of that name is a copy of (its earlier name too), or None."""
    return next((n for n in (name, exercise_name(name)) if (repo / "exercises" / n).exists()), None)


def _move_earlier_layouts(dest: Path, repo: Path, report: Report, record: dict[str, str]) -> None:
    exercises = dest / "exercises"
    for old in sorted([*dest.glob("*.ipynb"), *exercises.glob("*.ipynb")]):
        name = _course_exercise(old.name, repo)
        new = exercises / name if name else old
        if new != old and not new.exists():
            exercises.mkdir(parents=True, exist_ok=True)
            old.rename(new)
            report.moved.append(f"{old} -> {new}")
            was = record.pop(f"exercises/{old.name}", None)
            if was is not None and old.parent == exercises:
                record[f"exercises/{new.name}"] = was


MAKEFILE = """\
# Written by `make my-copy` (course_lib/course/my_copy.py): the course's commands from your copy, where JupyterLab's
# terminal starts. `make grade NB=exercises/01_collectives_exercises.ipynb` grades your copy of that notebook.
COURSE := {course}
.PHONY: grade my-copy
grade:
\t@nb="$(NB)"; if [ -e "$$nb" ]; then nb="$$(cd "$$(dirname "$$nb")" && pwd)/$$(basename "$$nb")"; fi; \\
\t$(MAKE) --no-print-directory -C "$(COURSE)" grade NB="$$nb" MY_WORK="$(CURDIR)" GRADE_ARGS="$(GRADE_ARGS)"
my-copy:
\t@$(MAKE) --no-print-directory -C "$(COURSE)" my-copy MY_WORK="$(CURDIR)"
"""
"""``NB`` is a path in this folder when it is one here, else the course's (``my_work/exercises/...``, as the
chapters write it, works from both)."""


def sync(dest: Path, repo: Path = REPO) -> Report:
    """Bring the learner's folder ``dest`` up to date with ``repo``'s notebooks, never overwriting an edit."""
    report = Report()
    dest.mkdir(parents=True, exist_ok=True)
    record_path = dest / RECORD
    record = _read_record(record_path)
    _move_earlier_layouts(dest, repo, report, record)
    (dest / "Makefile").write_text(MAKEFILE.format(course=repo.resolve()))
    for folder in FOLDERS:
        for source in sorted((repo / folder).glob("*.ipynb")):
            rel = f"{folder}/{source.name}"
            copy, course = dest / rel, _cells(source)
            mine = _cells(copy) if copy.exists() else None
            if copy.exists() and mine == course:
                record[rel] = course
                continue
            if copy.exists() and mine != record.setdefault(rel, course):
                if record[rel] != course:  # edited, and the course has a newer version: say so (every time)
                    report.kept.append(rel)
                continue
            (report.updated if copy.exists() else report.copied).append(rel)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, copy)
            record[rel] = course
    record_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.course.my_copy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=REPO / "my_work", help="the learner's folder (git-ignored)")
    parser.add_argument("--repo", type=Path, default=REPO, help="the course whose notebooks are copied")
    args = parser.parse_args(argv)
    report = sync(args.dest, args.repo)
    for line in report.lines(args.dest, args.repo):
        print(line)
    print(f"your copy: {args.dest}/notebooks (the chapters) and {args.dest}/exercises (your answers); "
          "git ignores it, so `git pull` never touches it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
