"""The chapter table of the teacher's guide (``teaching.md`` in the course's docs folder, which the learners'
handout leaves out) from what it describes: each chapter's exercises and points from the
grader's registry (``course_lib.grading.chNN.EXERCISES``), the Run All times from the notebooks' own execution
timestamps (the chapter's, and its solution's for the exercise column).

    python -m course_lib.grading.teaching_table            # rewrite the table's generated columns in place
    python -m course_lib.grading.teaching_table --check    # exit 1, naming each cell that drifted

A Run All time is the span from the first code cell's start to the last one's reply, as recorded by the kernel
that executed the committed notebook ("not recorded" when its cells carry no timestamps). The other columns
(the ranks a chapter launches) are written by hand and left as they are.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from pathlib import Path

from course_lib.grading.grader import chapter_module

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "teaching.md"
ROW = re.compile(r"^\| (?P<chapter>\d\d) \| `(?P<notebook>[^`]+)` \|")
GENERATED = {2: "chapter Run All (s)", 4: "Exercises (points)", 5: "exercise notebook Run All (s)"}
"""Column index -> what the generated cell holds (columns: chapter, notebook, Run All, ranks, exercises, ...)."""


def run_all_seconds(path: Path) -> str:
    """The recorded Run All of a notebook, "12.3", or "not recorded"."""
    if not path.exists():
        return "not recorded"
    stamps = [c["metadata"]["execution"] for c in json.loads(path.read_text())["cells"]
              if c["cell_type"] == "code" and "iopub.execute_input" in c.get("metadata", {}).get("execution", {})]
    if not stamps:
        return "not recorded"

    def at(s: str) -> dt.datetime:
        return dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
    return f"{(at(stamps[-1]['shell.execute_reply']) - at(stamps[0]['iopub.execute_input'])).total_seconds():.1f}"


def expected_cells(chapter: str, notebook: str) -> dict[int, str]:
    """The generated cells of one chapter's row."""
    exercises = chapter_module(chapter).EXERCISES
    solution = next(iter(sorted((REPO / "solutions").glob(f"{chapter}_*.ipynb"))), REPO / "solutions" / "none")
    return {2: run_all_seconds(REPO / "notebooks" / notebook),
            4: f"{len(exercises)} ({sum(ex.points for ex in exercises)})",
            5: run_all_seconds(solution)}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def drift(text: str) -> list[str]:
    """One line per generated cell of the table that differs from what it describes."""
    out = []
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            cells = _cells(line)
            for col, want in expected_cells(m["chapter"], m["notebook"]).items():
                if cells[col] != want:
                    out.append(f"chapter {m['chapter']}, {GENERATED[col]}: the table says {cells[col]!r}, the "
                               f"course has {want!r}")
    return out


def regenerate(text: str) -> str:
    """``text`` with every generated cell of the table rewritten."""
    lines = []
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            cells = _cells(line)
            for col, want in expected_cells(m["chapter"], m["notebook"]).items():
                cells[col] = want
            line = "| " + " | ".join(cells) + " |"
        lines.append(line)
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report the cells that drifted")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    problems = drift(text)
    if args.check:
        for p in problems:
            print(p)
        return 1 if problems else 0
    DOC.write_text(regenerate(text))
    print(f"rewrote {len(problems)} cell(s) of {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
