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

A notebook of the earlier layout (``my_work/NN_name.ipynb``, a copy of an exercise) is moved to
``my_work/exercises/``, where its links work, unless a file is already there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from course_lib.grading.notebooks import fingerprint

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


def _move_flat_layout(dest: Path, repo: Path, report: Report) -> None:
    exercises = dest / "exercises"
    for old in sorted(dest.glob("*.ipynb")):
        new = exercises / old.name
        if (repo / "exercises" / old.name).exists() and not new.exists():
            exercises.mkdir(parents=True, exist_ok=True)
            old.rename(new)
            report.moved.append(f"{old} -> {new}")


def sync(dest: Path, repo: Path = REPO) -> Report:
    """Bring the learner's folder ``dest`` up to date with ``repo``'s notebooks, never overwriting an edit."""
    report = Report()
    dest.mkdir(parents=True, exist_ok=True)
    _move_flat_layout(dest, repo, report)
    record_path = dest / RECORD
    record = _read_record(record_path)
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
