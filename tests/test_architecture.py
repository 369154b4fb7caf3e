"""The library's shape, read from its source (ast, nothing imported): what a learner must open to read one axis,
which layer may import which, where gradients are reduced, and how many class-valued parameters it has.

* Reading paths: each axis module's transitive import closure inside ``course_lib`` (less what every learner
  already knows: the GPT and the comm layer) stays within its budget and pulls in no other axis module.
* Layers: a module imports only from its own layer or those below (no cycle between modules either).
* Only data parallelism reduces gradients: every call of a reducing collective outside the data-parallel
  modules is one of the listed, non-gradient reductions (a loss, a norm, TP's f/g on activations, ...).
* Class-valued parameters (``type[...]``, or a default that is a class): at most ``MAX_CLASS_VALUED``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from course_lib.course import reading

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "course_lib"


LAYERS = ["core", "runtime", "parallel", "estimates", "measure", "planner", "failures", "serving", "debug", "viz",
          "grading", "course"]
"""Bottom to top: a module may import its own package and the packages before it. ``core`` is the top level
(the GPT, comm, data, the baseline)."""

DATA_PARALLEL = {"dp", "dp_reduce", "sharded_optimizer", "zero", "zero_unit", "sharding", "fsdp2",
                 "fsdp2_pipeline"}
"""The data-parallel modules of ``course_lib.parallel``: the only ones that may reduce gradients."""

NOT_GRADIENTS = {  # (module, function) -> what the reduction is, outside the data-parallel modules
    ("contract", "reduce_losses"): "the per-step losses, averaged over the data ranks",
    ("tp_comm", "all_reduce_sum"): "TP's g: the row-parallel activations (and f's backward: their gradient)",
    ("tp_comm", "reduce_scatter_along"): "SP's reduce-scatter of activations (or of their gradient)",
    ("tp_layers", "forward"): "the vocab-parallel cross-entropy's max, target logit and denominator",
    ("placement_ops", "grad_norm"): "the squares of the gradient norm, summed over the axes that split them",
    ("moe_mesh", "add_stage_losses"): "the router losses of the stages, summed over pp and averaged over dp",
    ("cp_attention", "backward"): "the all-gather attention's dK, dV: activation gradients, reduce-scattered",
}
REDUCING = {"all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_flat"}

MAX_CLASS_VALUED = 12
"""Today: the forms runs.train_dp and train_zero take, the unit factories of ZeRO and FSDP2, the pipeline's
executor, CP's attention module, EP's layer, serving's engine (2), the optimizer class of ZeRO-1 (2, as
``ZeroRedundancyOptimizer``'s), the baseline's model class, the grading's refused exception class."""


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module(p): p for p in LIB.rglob("*.py")}


@functools.cache
def _trees() -> dict[str, ast.Module]:
    """Every module's syntax tree, parsed when a test first asks (not at collection, in every pytest process)."""
    return {m: ast.parse(p.read_text()) for m, p in MODULES.items()}


@functools.cache
def _imports(mod: str) -> frozenset[str]:
    """Every course_lib module ``mod`` imports (module level and inside functions)."""
    pkg = mod if MODULES[mod].name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(_trees()[mod]):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out |= {base, *(f"{base}.{a.name}" for a in node.names)}
    return frozenset(m for m in out if m in MODULES)


def _closure(mod: str) -> set[str]:
    seen, todo = set(), [mod]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += _imports(m) - seen
    return seen


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and (LIB / parts[1]).is_dir() else "core"


def test_every_axis_reads_within_its_budget_and_alone():
    report = []
    axis_files = {str(reading.path_of(m).relative_to(ROOT)) for m in reading.AXES.values()}
    for axis, budget in reading.BUDGET.items():
        path = reading.reading_path(axis)
        total = sum(n for _, n in path)
        others = sorted({f for f, _ in path[1:]} & axis_files)
        if total > budget or others:
            report.append(f"{axis}: {total} lines (budget {budget}), other axes {others}")
    assert not report, report
    assert reading.reading_path("dp")[0][0] == "course_lib/parallel/dp.py"


def test_the_reading_path_is_what_the_module_imports():
    """The path holds the axis's own imports (and theirs), never what it does not import."""
    tp = [f for f, _ in reading.reading_path("tp")]
    assert "course_lib/parallel/tp_layers.py" in tp and "course_lib/parallel/tp_comm.py" in tp
    assert not any(f.endswith(("tp_overlap.py", "runs.py", "oracles.py", "cp_attention.py")) for f in tp), tp
    assert "course_lib/model.py" not in tp  # what every learner knows


def test_no_import_runs_up_a_layer_and_no_module_cycle():
    upward = [f"{m} ({_layer(m)}) imports {i} ({_layer(i)})" for m in MODULES for i in _imports(m)
              if LAYERS.index(_layer(i)) > LAYERS.index(_layer(m))]
    assert not upward, upward
    cycles = [m for m in MODULES if any(m in _closure(i) for i in _imports(m) if i != m)]
    assert not cycles, f"modules on an import cycle: {sorted(cycles)}"


def _reductions() -> list[tuple[str, str, str]]:
    """(module, enclosing function, callee) for every reducing collective called in course_lib.parallel."""
    out = []
    for mod, tree in _trees().items():
        if not mod.startswith("course_lib.parallel."):
            continue
        for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            for call in [n for n in ast.walk(fn) if isinstance(n, ast.Call)]:
                name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
                if name in REDUCING:
                    out.append((mod.rsplit(".", 1)[1], fn.name, name))
    return out


def test_only_data_parallelism_reduces_gradients():
    found = _reductions()
    assert any(m in DATA_PARALLEL for m, _, _ in found), "the scan found no reduction at all: it is broken"
    outside = sorted({(m, f) for m, f, _ in found if m not in DATA_PARALLEL} - set(NOT_GRADIENTS))
    assert not outside, (f"reducing collectives outside the data-parallel modules {sorted(DATA_PARALLEL)}: "
                         f"{outside}; reduce gradients through dp_reduce, or list a non-gradient reduction")
    stale = sorted(set(NOT_GRADIENTS) - {(m, f) for m, f, _ in found})
    assert not stale, f"listed reductions that no longer exist: {stale}"


def _class_valued() -> list[str]:
    classes = {n.name for t in _trees().values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    out = []
    for mod, tree in _trees().items():
        for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
            defaults = [None] * (len(fn.args.posonlyargs) + len(fn.args.args) - len(fn.args.defaults))
            defaults += [*fn.args.defaults, *fn.args.kw_defaults]
            for a, d in zip(args, defaults, strict=True):
                typed = a.annotation is not None and ast.unparse(a.annotation).startswith("type[")
                if typed or (isinstance(d, ast.Name) and d.id in classes):
                    out.append(f"{mod}.{fn.name}({a.arg})")
    return out


def test_few_class_valued_parameters():
    found = _class_valued()
    assert found, "the scan found none: it is broken (runs.train_dp takes data_parallel=DataParallel)"
    assert len(found) <= MAX_CLASS_VALUED, found
