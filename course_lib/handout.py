"""The learners' handout: the course without its solutions.

    python -m course_lib.handout handout/          # or: make handout (OUT=handout/)

Writes a folder a teacher can zip, push to a learners' repository or copy onto a JupyterHub:

* ``notebooks/`` (the chapters, executed, outputs included) and ``exercises/`` (generated from the solutions, with
  every ``### BEGIN SOLUTION`` block replaced by a hint and no outputs);
* ``course_lib/`` whole, ``course_lib/grading/`` included: the exercises' visible self-checks call it. This means the
  hidden test cases ship too (they are parameters in ``course_lib/grading/chNN.py``, not answers); a learner who
  reads them learns which settings are tested, not the code to write;
* ``README.md``, ``Makefile``, ``pyproject.toml``, ``environment.yml``, ``LICENSE``, so ``make lab`` works there.

Never copied: ``solutions/``, ``tests/`` (its grading fixtures are worked wrong answers next to right ones),
``benchmarks/``, ``.venv``, caches. In the handout ``make lab`` works; ``make test`` and ``make exercises`` need the
teacher's copy of the course.

The handout is refused while ``exercises/`` is out of date with ``solutions/`` (run ``make exercises`` first), and
checked after writing: no notebook in it contains a solution block.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from course_lib.grading import notebooks

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("notebooks", "exercises", "course_lib")
FILES = ("README.md", "Makefile", "pyproject.toml", "environment.yml", "LICENSE")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.egg-info")
SOLUTION_MARK = "### BEGIN SOLUTION"


class HandoutError(RuntimeError):
    pass


def solution_leaks(folder: Path) -> list[Path]:
    """Notebooks under ``folder`` that still contain a solution block, and any ``solutions`` folder."""
    leaks = [p for p in folder.rglob("*.ipynb") if SOLUTION_MARK in p.read_text(errors="replace")]
    return leaks + [p for p in folder.rglob("solutions") if p.is_dir()]


def write_handout(out: Path, repo: Path = REPO) -> list[Path]:
    """Copy the learners' part of ``repo`` into ``out`` (which must not exist or be empty). Returns what was copied."""
    stale = notebooks.sync(repo / "solutions", repo / "exercises", check=True)
    if stale:
        raise HandoutError(f"exercises/ is out of date with solutions/ ({', '.join(p.name for p in stale)}): "
                           "run `make exercises` first")
    if out.exists() and any(out.iterdir()):
        raise HandoutError(f"{out} is not empty: give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in FOLDERS:
        copied.append(Path(shutil.copytree(repo / name, out / name, ignore=IGNORED)))
    for name in FILES:
        if (repo / name).exists():
            copied.append(Path(shutil.copy2(repo / name, out / name)))
    leaks = solution_leaks(out)
    if leaks:
        raise HandoutError(f"solutions found in the handout: {[str(p) for p in leaks]}")
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.handout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="a new (or empty) folder for the handout")
    args = parser.parse_args(argv)
    try:
        copied = write_handout(args.out)
    except HandoutError as exc:
        print(f"handout: {exc}", file=sys.stderr)
        return 1
    print(f"wrote the handout to {args.out}: {', '.join(p.name for p in copied)} (no solutions/, no tests/)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
