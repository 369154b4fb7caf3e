"""Reading paths: the files a learner opens, in order, to read how the library builds one axis.

An axis's reading path is its module and, breadth first, every ``course_lib`` module it imports (at module level
or inside a function: both are code the axis runs), less what every learner already knows before any axis: the
GPT (START_HERE) and the instrumented comm layer (chapter 01). The sizes are read from the source when this runs,
so a chapter that prints its path never states a stale count. ``tests/test_architecture.py`` holds every axis to
its ``BUDGET`` and checks that no path holds another axis's module.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

NAMES = {"dp": "data parallelism", "zero1": "ZeRO-1", "zero": "ZeRO-2/3 (flat)", "fsdp2": "FSDP2",
         "tp": "tensor (and sequence) parallelism", "pp": "pipeline parallelism", "cp": "context parallelism",
         "ep": "expert parallelism"}
AXES = {"dp": "course_lib.parallel.dp", "zero1": "course_lib.parallel.sharded_optimizer",
        "zero": "course_lib.parallel.zero", "fsdp2": "course_lib.parallel.fsdp2", "tp": "course_lib.parallel.tp",
        "pp": "course_lib.parallel.pp", "cp": "course_lib.parallel.cp", "ep": "course_lib.parallel.ep"}
BUDGET = {"dp": 600, "zero1": 300, "zero": 1000, "fsdp2": 1000, "tp": 1200, "pp": 1400, "cp": 900, "ep": 900}
"""Lines a learner reads for each axis at most (picotron's per-axis reading is 250-380 lines)."""

KNOWN = {"course_lib", "course_lib.parallel", "course_lib.model", "course_lib.model_config", "course_lib.layers",
         "course_lib.moe", "course_lib.comm"}


def path_of(module: str) -> Path | None:
    """The source file of ``module`` (a module or a package's ``__init__``), None outside the course."""
    p = ROOT.joinpath(*module.split("."))
    for candidate in (p.with_suffix(".py"), p / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


@cache
def imports_of(module: str) -> tuple[str, ...]:
    """The ``course_lib`` modules ``module`` imports, in the order they appear."""
    path = path_of(module)
    if path is None:
        return ()
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [base, *(f"{base}.{a.name}" for a in node.names)]
    return tuple(dict.fromkeys(m for m in out if m.startswith("course_lib") and path_of(m) is not None))


def lines(module: str) -> int:
    path = path_of(module)
    return len(path.read_text().splitlines()) if path else 0


def reading_path(axis: str) -> list[tuple[str, int]]:
    """(file, lines) of the axis's module and, breadth first, what it imports, less ``KNOWN``."""
    seen, order, todo = set(), [], [AXES[axis]]
    while todo:
        module = todo.pop(0)
        if module in seen:
            continue
        seen.add(module)
        if module not in KNOWN:
            order.append(module)
        todo += [m for m in imports_of(module) if m not in seen]
    return [(str(path_of(m).relative_to(ROOT)), lines(m)) for m in order]


def describe(axis: str) -> str:
    """The reading path as a chapter prints it: each file with its lines, then the total and the budget."""
    path = reading_path(axis)
    total = sum(n for _, n in path)
    files = "\n".join(f"  {i}. {name} ({n} lines)" for i, (name, n) in enumerate(path, 1))
    within = "within" if total <= BUDGET[axis] else "OVER"
    return (f"The library's {NAMES[axis]}, in reading order:\n{files}\n  {total} lines in all, beyond the GPT "
            f"and the comm layer you know already ({within} the course's budget of {BUDGET[axis]})")
