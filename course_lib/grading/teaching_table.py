"""The generated parts of the teacher's guide (``teaching.md`` in the course's docs folder, which the learners'
handout leaves out) and of the README, from what they describe: each chapter's exercises and points from the
grader's registry (``course_lib.grading.chNN.EXERCISES``), and the times ``course_lib.grading.timings`` measured
and stored (``timings.STORE``): Run All per notebook with the ranks it runs at once, grading a class, ``make test``.

    .venv/bin/python -m course_lib.grading.teaching_table            # rewrite the generated blocks in place
    .venv/bin/python -m course_lib.grading.teaching_table --check    # exit 1, naming each block that differs

A generated block sits between ``<!-- generated: NAME ... -->`` and ``<!-- end: NAME -->`` and is rewritten whole:
a row typed into it by hand, or a time the store no longer holds, fails the check. Every time it writes comes
with the cores and the load average it was measured under.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from course_lib.grading import timings
from course_lib.grading.in_kernel import chapter_module
from course_lib.grading.notebooks import exercise_name

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "teaching.md"
README = REPO / "README.md"
BEGIN = "<!-- generated: {name} by `.venv/bin/python -m course_lib.grading.teaching_table`; do not edit -->"
END = "<!-- end: {name} -->"
WIDTH = 118
LEARNERS = 30
"""The class size the guide plans for: grading times measured on fewer learners are extrapolated to it."""


def _seconds(record: dict[str, Any] | None) -> str:
    return f"{record['seconds']:.1f}" if record else "not measured"


def _conditions(records: list[dict[str, Any]]) -> str:
    """"2 cores, load average 3.9-11.4, 2026-12-03": what the records were measured under."""
    loads = [x for r in records for x in r["load"]]
    dates = sorted({r["date"] for r in records})
    cores = sorted({r["cores"] for r in records})
    return (f"{'/'.join(map(str, cores))} cores, load average (1 min) {min(loads):.1f}-{max(loads):.1f}, "
            f"{dates[0]}{' to ' + dates[-1] if len(dates) > 1 else ''}")


def run_all_table(store: dict[str, Any]) -> str:
    """One row per chapter (the start page first): Run All, ranks at once, exercises and points, the solution's
    Run All; then what the times were measured under."""
    runs = store.get("run_all", {})
    rows = ["| Chapter | Notebook | Run All (s) | Ranks at once | Exercises (points) | Exercise notebook Run All (s) |",
            "|---|---|---:|---:|---|---:|"]
    used = []
    for nb in sorted((REPO / "notebooks").glob("*.ipynb"), key=lambda p: (p.stem != "START_HERE", p.name)):
        chapter = nb.name[:2] if nb.name[:2].isdigit() else "start"
        mine = runs.get(f"notebooks/{nb.name}")
        solution = runs.get(f"solutions/{exercise_name(nb.name)}")
        used += [r for r in (mine, solution) if r]
        exercises = chapter_module(chapter).EXERCISES if chapter != "start" else []
        points = f"{len(exercises)} ({sum(ex.points for ex in exercises)})" if exercises else "-"
        rows.append(f"| {chapter} | `{nb.name}` | {_seconds(mine)} | {mine['ranks'] if mine else '-'} | {points} | "
                    f"{_seconds(solution) if exercises else '-'} |")
    measured = f"Measured on {_conditions(used)}." if used else "Not measured yet."
    return "\n".join([*rows, "", measured])


def grading_text(store: dict[str, Any]) -> str:
    """One bullet per way of grading (isolated or not): the class measured, its canary, and 30 learners from it."""
    lines = []
    for mode, g in sorted(store.get("grading", {}).items()):
        n, canary_s, wall = g["learners"], g["canary_s"], g["seconds"]
        per_class = (wall - canary_s) / n * LEARNERS + canary_s
        scaled = (f"; {LEARNERS} learners: about {per_class / 60:.0f} min (the class part scaled from {n})"
                  if n != LEARNERS else "")
        lines.append(textwrap.fill(
            f"* {mode}: {n} learners x chapter {g['chapter']}'s solution with `JOBS={g['jobs']}`: {wall:.0f} s in "
            f"all, the canary's {canary_s:.0f} s included (median {g['median_notebook_s']:.1f} s a notebook, "
            f"{g['jobs']} side by side), {g['points'][0]}/{g['points'][1]} points{scaled}. Measured on "
            f"{_conditions([g])}.", WIDTH, subsequent_indent="  ", break_on_hyphens=False))
    return "\n".join(lines) or "* Not measured yet."


def _make_time(record: dict[str, Any]) -> str:
    """"about 29-32 minutes (1718 s, 1897 s, 1731 s: <source>[, 2 cores, load average (1 min) 3.1-9.8], recorded
    <date>": a stored time of a make target, with the machine's conditions when they were measured here."""
    low, high = min(record["seconds"]), max(record["seconds"])
    span = f"{low / 60:.0f}" if round(low / 60) == round(high / 60) else f"{low / 60:.0f}-{high / 60:.0f}"
    where = f", {_conditions([record]).rsplit(', ', 1)[0]}" if "load" in record else ""
    return (f"about {span} minutes ({', '.join(f'{s:.0f} s' for s in record['seconds'])}: {record['source']}{where}, "
            f"recorded {record['date']}")


def make_test_text(store: dict[str, Any]) -> str:
    """The README's sentences on how long ``make test`` and ``make test-fast`` take, from the stored times."""
    m, fast = store.get("make_test") or {}, store.get("make_test_fast") or {}
    if not m:
        return "`make test` has not been timed yet (`.venv/bin/python -m course_lib.grading.timings make-test`)."
    text = f"It takes {_make_time(m)} by `.venv/bin/python -m course_lib.grading.timings make-test`)."
    if fast:
        text += (f" `make test-fast` takes {_make_time(fast)} by `.venv/bin/python -m course_lib.grading.timings "
                 "make-test --target test-fast`).")
    return textwrap.fill(text, WIDTH, break_on_hyphens=False)


BLOCKS: dict[str, tuple[Path, Callable[[dict[str, Any]], str]]] = {
    "run-all": (DOC, run_all_table), "grading": (DOC, grading_text), "make-test": (README, make_test_text)}


def _block(name: str) -> re.Pattern:
    return re.compile(rf"(?P<begin>{re.escape(BEGIN.format(name=name))}\n)(?P<body>.*?)"
                      rf"(?P<end>{re.escape(END.format(name=name))})", re.S)


def drift(texts: dict[Path, str] | None = None, store: dict[str, Any] | None = None) -> list[str]:
    """One line per generated block that is missing or differs from what it describes."""
    texts = texts or {path: path.read_text() for path, _ in BLOCKS.values()}
    store = timings.load() if store is None else store
    out = []
    for name, (path, make) in BLOCKS.items():
        m = _block(name).search(texts[path])
        if m is None:
            out.append(f"{path.name}: the generated block {name!r} is missing (its markers were removed)")
        elif m["body"] != make(store) + "\n":
            got, want = m["body"].splitlines(), make(store).splitlines()
            first = next((f"{a!r} instead of {b!r}" for a, b in zip(got, want, strict=False) if a != b),
                         f"{len(got)} lines instead of {len(want)}")
            out.append(f"{path.name}, block {name!r}: {first}")
    return out


def regenerate(texts: dict[Path, str], store: dict[str, Any]) -> dict[Path, str]:
    """``texts`` with every generated block rewritten."""
    texts = dict(texts)
    for name, (path, make) in BLOCKS.items():
        texts[path] = _block(name).sub(lambda m, make=make: m["begin"] + make(store) + "\n" + m["end"], texts[path])
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.teaching_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report the blocks that differ")
    args = parser.parse_args(argv)
    problems = drift()
    if args.check:
        for p in problems:
            print(p)
        return 1 if problems else 0
    texts = {path: path.read_text() for path, _ in BLOCKS.values()}
    for path, text in regenerate(texts, timings.load()).items():
        path.write_text(text)
    print(f"rewrote {len(problems)} block(s): {', '.join(p.split(':')[0] for p in problems) or 'none differed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
