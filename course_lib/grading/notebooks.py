"""Exercise notebooks are generated from solution notebooks: one source of truth.

In a solution, the code a learner must write sits between ``### BEGIN SOLUTION`` and ``### END SOLUTION``; an
optional hint follows BEGIN (``### BEGIN SOLUTION hint: walk the ring n-1 times``). The exercise replaces each
block by ``raise NotImplementedError("<hint>")`` at the block's indentation and clears every output.

    python -m course_lib.grading.notebooks            # regenerate exercises/ from solutions/
    python -m course_lib.grading.notebooks --check    # exit 1 if exercises/ is out of date
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION(?:\s+hint:\s*(?P<hint>.*))?$")
END = re.compile(r"^\s*### END SOLUTION\s*$")
REPO = Path(__file__).resolve().parents[2]


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
    """The exercise version of a solution notebook (a new object; the input is not modified)."""
    nb = nbformat.from_dict(solution)
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k == "tags"}  # drop execution timestamps
        if cell.cell_type == "code":
            cell.source = strip_source(cell.source)
            cell.outputs = []
            cell.execution_count = None
    nb.metadata = {"kernelspec": solution.metadata.get("kernelspec", {}), "language_info": {"name": "python"},
                   "course": {**solution.metadata.get("course", {}), "kind": "exercise"}}
    return nb


def exercise_path(solution_path: Path, exercises_dir: Path) -> Path:
    return exercises_dir / solution_path.name


def sync(solutions_dir: Path = REPO / "solutions", exercises_dir: Path = REPO / "exercises",
         check: bool = False) -> list[Path]:
    """Write (or, with ``check``, compare) the exercise of every solution. Returns the stale/written paths."""
    changed = []
    for sol in sorted(solutions_dir.glob("*.ipynb")):
        expected = nbformat.writes(make_exercise(nbformat.read(sol, as_version=4))) + "\n"
        target = exercise_path(sol, exercises_dir)
        if not target.exists() or target.read_text() != expected:
            changed.append(target)
            if not check:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(expected)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report exercises that are out of date")
    args = parser.parse_args(argv)
    changed = sync(check=args.check)
    for path in changed:
        print(f"{'out of date' if args.check else 'wrote'}: {path.relative_to(REPO)}")
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
