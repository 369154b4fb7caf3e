"""Exercise notebooks are generated from solution notebooks: one source of truth.

In a solution, the code a learner must write sits between ``### BEGIN SOLUTION`` and ``### END SOLUTION``; an
optional hint follows BEGIN (``### BEGIN SOLUTION hint: walk the ring n-1 times``). The exercise replaces each
block by ``raise NotImplementedError("<hint>")`` at the block's indentation and clears every output.

    python -m course_lib.grading.notebooks            # regenerate exercises/ from solutions/
    python -m course_lib.grading.notebooks --check    # exit 1 if exercises/ is out of date
    python -m course_lib.grading.notebooks --force    # also overwrite exercises whose code was edited

Each exercise records a fingerprint of the code it was generated with (``metadata.course.generated``). An exercise
whose code no longer matches its fingerprint, and that git does not show committed as it is, was edited by
someone -- a learner working in place -- and is kept (reported, exit 1) unless ``--force``: regenerating never
silently destroys a learner's work.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat

BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION(?:\s+hint:\s*(?P<hint>.*))?$")
END = re.compile(r"^\s*### END SOLUTION\s*$")
REPO = Path(__file__).resolve().parents[2]
SUFFIX = "_exercises"
"""A chapter's exercise notebook is named after it with this suffix (``03_zero_fsdp_exercises.ipynb``; its solution
too): the two never open as two tabs of the same name, where answers land in the chapter."""


def exercise_name(chapter_notebook: str) -> str:
    """``03_zero_fsdp.ipynb`` (or ``03_zero_fsdp``) -> ``03_zero_fsdp_exercises.ipynb``."""
    return f"{chapter_notebook.removesuffix('.ipynb')}{SUFFIX}.ipynb"


def chapter_topic(exercise_notebook: str) -> str:
    """``03_zero_fsdp_exercises.ipynb`` -> ``zero_fsdp``: the topic both notebooks are named after."""
    return exercise_notebook.removesuffix(".ipynb").removesuffix(SUFFIX)[3:]


def strip_source(source: str) -> str:
    """Replace every solution block of a cell's source by a ``raise NotImplementedError``."""
    out, inside = [], False
    for line in source.splitlines():
        begin = BEGIN.match(line)
        if begin and not inside:
            inside = True
            hint = (begin.group("hint") or "write your solution here").strip().replace('"', "'")
            out.append(f'{begin.group("indent")}raise NotImplementedError("{hint}")')
        elif END.match(line) and inside:
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("### BEGIN SOLUTION without ### END SOLUTION")
    return "\n".join(out)


def make_exercise(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The exercise version of a solution notebook (a new object; the input is not modified): solution blocks
    replaced, outputs and cell metadata (except tags) cleared, the notebook's kernelspec and language_info kept."""
    nb = nbformat.from_dict(solution)
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k == "tags"}  # drop execution timestamps
        if cell.cell_type == "code":
            cell.source = strip_source(cell.source)
            cell.outputs = []
            cell.execution_count = None
    # language_info as the solution's kernel wrote it: with less, JupyterLab fills it in on opening and the
    # exercise opens modified ("Save changes?" on closing an untouched notebook).
    nb.metadata = {"kernelspec": solution.metadata.get("kernelspec", {}),
                   "language_info": solution.metadata.get("language_info", {"name": "python"}),
                   "course": {**solution.metadata.get("course", {}), "kind": "exercise",
                              "generated": fingerprint(nb)}}
    return nb


def fingerprint(nb: nbformat.NotebookNode) -> str:
    """A short hash of a notebook's cells (type and source; outputs do not count: running is not editing)."""
    cells = json.dumps([[c.cell_type, c.source] for c in nb.cells])
    return hashlib.sha256(cells.encode()).hexdigest()[:16]


def edited_by_hand(path: Path) -> bool:
    """True when the exercise at ``path`` no longer has the code it was generated with (or has no fingerprint)
    and git does not vouch for it: a file committed as it is was shipped by the repository (a merge of two
    generated versions, say), not written by a learner."""
    nb = nbformat.read(path, as_version=4)
    if nb.metadata.get("course", {}).get("generated") == fingerprint(nb):
        return False
    return not _committed_as_is(path)


def _committed_as_is(path: Path) -> bool:
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args, "--", path.name], cwd=path.parent, capture_output=True, text=True,
                              timeout=30)

    try:
        tracked, status = git("ls-files", "--error-unmatch"), git("status", "--porcelain")
    except (OSError, subprocess.TimeoutExpired):
        return False
    return tracked.returncode == 0 and status.returncode == 0 and not status.stdout.strip()


def exercise_path(solution_path: Path, exercises_dir: Path) -> Path:
    return exercises_dir / solution_path.name


def sync(solutions_dir: Path = REPO / "solutions", exercises_dir: Path = REPO / "exercises",
         check: bool = False, force: bool = False, kept: list[Path] | None = None) -> list[Path]:
    """Write (or, with ``check``, compare) the exercise of every solution. Returns the stale/written paths; an
    exercise whose code was edited by hand is not written (unless ``force``) but appended to ``kept``."""
    changed = []
    kept = [] if kept is None else kept
    for sol in sorted(solutions_dir.glob("*.ipynb")):
        expected = nbformat.writes(make_exercise(nbformat.read(sol, as_version=4))) + "\n"
        target = exercise_path(sol, exercises_dir)
        if target.exists() and target.read_text() == expected:
            continue
        if not check and not force and target.exists() and edited_by_hand(target):
            kept.append(target)
            continue
        changed.append(target)
        if not check:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(expected)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report exercises that are out of date")
    parser.add_argument("--force", action="store_true", help="overwrite exercises whose code was edited too")
    parser.add_argument("--solutions", type=Path, default=REPO / "solutions", help="the solution notebooks")
    parser.add_argument("--exercises", type=Path, default=REPO / "exercises", help="where the exercises go")
    args = parser.parse_args(argv)
    kept: list[Path] = []
    changed = sync(args.solutions, args.exercises, check=args.check, force=args.force, kept=kept)
    for path in changed:
        print(f"{'out of date' if args.check else 'wrote'}: {_shown(path)}")
    for path in kept:
        print(f"kept: {_shown(path)} has code edited since it was generated. To keep your work, copy it first"
              " (make my-copy, then work in my_work/exercises/); to overwrite it, run make exercises FORCE=1.")
    return 1 if (args.check and changed) or kept else 0


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


if __name__ == "__main__":
    sys.exit(main())
