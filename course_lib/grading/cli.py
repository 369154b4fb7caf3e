"""The grader's command line, ``python -m course_lib.grading``: what it does and its exit statuses are
``course_lib.grading.grader``'s docstring (printed by ``--help``). A folder (a class) is graded only after the
canary (``course_lib.grading.canary``) has graded the course's own solutions through the same sandbox."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from course_lib.grading import canary, grader


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading", description=grader.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="notebooks or folders of notebooks")
    parser.add_argument("--out", type=Path, help="write the reports as JSON here")
    parser.add_argument("--timeout", type=float, default=grader.NOTEBOOK_TIMEOUT_S, help="seconds per notebook")
    parser.add_argument("--cell-timeout", type=float, default=grader.CELL_TIMEOUT_S, help="seconds per cell")
    parser.add_argument("--strict", action="store_true", help="exit 1 unless every notebook scores full marks")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (default 1)")
    parser.add_argument("--my-work", type=Path, default=grader.MY_WORK,
                        help="the learner's copy of the course (default my_work/ in the course)")
    parser.add_argument("--as-named", action="store_true",
                        help="grade the course's own exercise even where the learner has a copy in --my-work")
    grader.add_isolation_flags(parser, "default: on when a folder is given")
    args = parser.parse_args(argv)
    for i, path in enumerate(args.paths):
        args.paths[i], note = grader.learners_copy(path, args.my_work, args.as_named)
        if note:
            print(note, flush=True)
    try:
        folders = [p for p in args.paths if p.is_dir()]
        hidden = [*folders, *([args.out.parent] if args.out else [])]
        isolated = grader.isolation_for(args.isolation, hidden, bool(folders))
        if folders:
            stop = canary.check(grader.chapters_of(args.paths).values(), args.timeout, args.cell_timeout, isolated,
                                args.jobs)
            if stop:
                print(f"error: {stop}", file=sys.stderr)
                return canary.EXIT_STATUS
        reports = grader.grade(args.paths, args.timeout, args.cell_timeout, jobs=args.jobs, isolated=isolated)
    except grader.UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not reports:
        print(f"no notebook found in {', '.join(map(str, args.paths))}", file=sys.stderr)
        return 2
    total, best = sum(r.points for r in reports), sum(r.max_points for r in reports)
    print(f"total: {total}/{best} points over {len(reports)} notebook(s)")
    if args.out:
        args.out.write_text(json.dumps([{**asdict(r), "points": r.points, "max_points": r.max_points}
                                        for r in reports], indent=2))
    return 1 if args.strict and total < best else 0
