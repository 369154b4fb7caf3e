"""nbval's comment markers (``# NBVAL_CHECK_OUTPUT`` ...) moved out of the code a learner reads, into cell tags.

nbval reads either a comment line in the cell or the same word as a cell tag (``nbval-check-output``: nbval's
``metadata_tags``, its comment markers lower-cased with ``-`` for ``_``). A comment is the last line of a cell a
learner reads and looks like an instruction; a tag is invisible in JupyterLab unless asked for (property inspector).

    python -m course_lib.grading.nbval_tags            # convert notebooks/, solutions/ and exercises/ in place
    python -m course_lib.grading.nbval_tags --check    # exit 1, naming each notebook that still has a marker line

Re-runnable: a notebook without marker lines is left byte for byte as it is; a converted cell loses the marker
line (and the blank lines it leaves at the cell's end) and gains the tag once. The file is rewritten as nbformat
writes it (sorted keys, one-space indent), so nothing else in it changes. ``NBVAL_RAISES_EXCEPTION`` also gets
``raises-exception``, the tag nbconvert and papermill read to run on past the expected error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("notebooks", "solutions", "exercises")
TAGS = {"NBVAL_CHECK_OUTPUT": ["nbval-check-output"], "NBVAL_IGNORE_OUTPUT": ["nbval-ignore-output"],
        "NBVAL_RAISES_EXCEPTION": ["nbval-raises-exception", "raises-exception"], "NBVAL_SKIP": ["nbval-skip"]}
MARKER_LINE = re.compile(r"^\s*#\s*(?P<marker>NBVAL_[A-Z_]+)\s*$")


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def marker_lines(nb: dict) -> list[str]:
    """``cell N: NBVAL_...`` for every nbval comment line left in a notebook (as JSON)."""
    return [f"cell {i}: {m['marker']}" for i, cell in enumerate(nb["cells"])
            for m in map(MARKER_LINE.match, _source(cell).split("\n")) if m]


def convert_cell(cell: dict) -> bool:
    """Move the cell's marker lines into its tags; True when something changed. An unknown ``NBVAL_`` word raises
    (a typo nbval would ignore silently)."""
    lines = _source(cell).split("\n")
    found = [m["marker"] for m in map(MARKER_LINE.match, lines) if m]
    if not found:
        return False
    unknown = [f for f in found if f not in TAGS]
    if unknown:
        raise ValueError(f"unknown nbval marker(s) {unknown}: nbval knows {sorted(TAGS)}")
    kept = [line for line in lines if not MARKER_LINE.match(line)]
    while kept and not kept[-1].strip():
        kept.pop()
    cell["source"] = "\n".join(kept).splitlines(keepends=True)
    tags = cell.setdefault("metadata", {}).setdefault("tags", [])
    tags += [t for f in found for t in TAGS[f] if t not in tags]
    return True


def convert(path: Path) -> bool:
    """Convert one notebook in place; True when it changed."""
    nb = json.loads(path.read_text())
    changed = [convert_cell(cell) for cell in nb["cells"]]
    if any(changed):
        path.write_text(json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n")
    return any(changed)


def notebooks(repo: Path = REPO) -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (repo / folder).glob("*.ipynb"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.nbval_tags", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks (default: notebooks/, solutions/, exercises/)")
    parser.add_argument("--check", action="store_true", help="only list the notebooks that still have marker lines")
    args = parser.parse_args(argv)
    paths = args.paths or notebooks()
    if args.check:
        left = {p: marker_lines(json.loads(p.read_text())) for p in paths}
        for p, found in left.items():
            if found:
                print(f"{p}: {', '.join(found)} (run python -m course_lib.grading.nbval_tags)")
        return 1 if any(left.values()) else 0
    changed = [p for p in paths if convert(p)]
    print(f"moved nbval markers into cell tags in {len(changed)} notebook(s)"
          + "".join(f"\n  {p}" for p in changed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
