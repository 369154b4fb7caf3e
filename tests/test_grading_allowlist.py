"""The allow-list: every route from a learner's answer to the library's own implementation of the exercise is
refused, before the checks run when the code shows it, while they run when it is built at run time; the refusal
scores 0 with a reason that names the object and what the exercise allows; the solutions are not refused.

Each ``Route`` is a notebook cell a learner could write (run as IPython runs a cell: ``define_in_cell``). The slow
test runs each one through its check with the allow-list off: it is a working answer, only the allow-list stops it.
"""

from __future__ import annotations

import ast
import importlib
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import allowlist, ch01, ch09, cli, grader, in_kernel, runtime_guard
from course_lib.grading.core import CheckResult, Exercise, guard_visible_checks
from tests.conftest import define_in_cell

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((REPO / "solutions").glob("*.ipynb"))


@dataclass(frozen=True)
class Route:
    chapter: str
    exercise: str
    name: str
    refused: str
    """The library object the refusal must name."""
    cell: str
    static: bool
    """Refused before the checks run (the code shows the route), else while they run."""


ROUTES = [
    # ---- chapter 09: the routes
    Route("09", "tp_kv_heads", "one_line_import", "course_lib.serving.tp_decode.kv_heads_of", """
from course_lib.serving.tp_decode import kv_heads_of as tp_kv_heads
""", static=True),
    Route("09", "verify_sampled", "one_line_import", "course_lib.serving.speculative.accept_sampled", """
from course_lib.serving.speculative import accept_sampled as verify_sampled
""", static=True),
    Route("09", "attend_over_cache", "wraps_engine_attend", "course_lib.serving.engine.attend", """
import torch
from course_lib.serving import engine

def attend_over_cache(q, k_cache, v_cache, k_new, v_new):
    k_all, v_all = torch.cat([k_cache, k_new], 1), torch.cat([v_cache, v_new], 1)
    return k_all, v_all, engine.attend(q, k_all, v_all, start=k_cache.shape[1])
""", static=True),
    Route("09", "reserve_blocks", "block_allocator_and_cache_full", "course_lib.serving.paged.BlockAllocator", """
import math
from course_lib.serving.kv_cache import CacheFull
from course_lib.serving.paged import BlockAllocator

def reserve_blocks(table, free, n_tokens, block_size):
    allocator = BlockAllocator(1)
    allocator.free_list = free
    try:
        table += allocator.allocate(max(0, math.ceil(n_tokens / block_size) - len(table)))
    except CacheFull:
        return False
    return True
""", static=True),
    Route("09", "request_metrics", "request_record_properties", "course_lib.serving.metrics.RequestRecord", """
from course_lib.serving.metrics import RequestRecord

def request_metrics(arrival_s, token_times):
    if not token_times:
        raise ValueError("no tokens")
    r = RequestRecord(0, arrival_s, 0, list(token_times))
    return {"ttft": float(r.ttft), "itl": [float(x) for x in r.itl],
            "tpot": None if r.tpot is None else float(r.tpot), "e2e": float(r.e2e)}
""", static=True),
    Route("09", "tp_kv_heads", "code_copied_into_a_new_function", "course_lib.serving.tp_decode.kv_heads_of", """
import importlib, types
_lib = importlib.import_module("course_lib.serving." + "".join(reversed("edoced_pt")))
tp_kv_heads = types.FunctionType(_lib.kv_heads_of.__code__, vars(_lib), "tp_kv_heads")
""", static=True),
    Route("09", "tp_kv_heads", "a_table_the_library_filled_at_the_cells_top_level",
          "course_lib.serving.tp_decode.kv_heads_of", """
from course_lib.serving.tp_decode import kv_heads_of

_TABLE = {}
for _t in (1, 2, 4, 8):
    for _h in (2, 4, 8, 16):
        for _kv in (1, 2, 4, 8):
            if _h % _t == 0 and _h % _kv == 0:
                for _r in range(_t):
                    _TABLE[_r, _t, _h, _kv] = kv_heads_of(_r, _t, _h, _kv)

def tp_kv_heads(rank, t, n_head, n_kv):
    return list(_TABLE[rank, t, n_head, n_kv])
""", static=True),
    Route("09", "tp_kv_heads", "name_built_at_run_time", "course_lib.serving.tp_decode.kv_heads_of", """
import importlib

def tp_kv_heads(rank, t, n_head, n_kv):
    module = importlib.import_module("".join(reversed("edoced_pt.gnivres.bil_esruoc")))
    return getattr(module, "kv_heads" + "_of")(rank, t, n_head, n_kv)
""", static=False),
    # ---- chapter 04: the routes
    Route("04", "sp_region", "imports_inside_method_bodies", "course_lib.parallel.tp_comm.all_gather_along", """
import torch
import torch.nn.functional as F
from course_lib import comm

class Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        from course_lib.parallel.tp_comm import all_gather_along
        return all_gather_along(x, 1, None)

    @staticmethod
    def backward(ctx, g):
        from course_lib.parallel.tp_comm import reduce_scatter_along
        return reduce_scatter_along(g, 1, None)

class Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        from course_lib.parallel.tp_comm import reduce_scatter_along
        return reduce_scatter_along(y, 1, None)

    @staticmethod
    def backward(ctx, g):
        from course_lib.parallel.tp_comm import all_gather_along
        return all_gather_along(g, 1, None)

class SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        comm.all_reduce(g)
        return g

def sp_region(x, norm_w, w1, b1, w2, b2):
    h = F.rms_norm(x, (x.shape[-1],), SumGrad.apply(norm_w), eps=1e-5)
    y = F.linear(F.gelu(F.linear(Enter.apply(h), w1, b1)), w2)
    return Leave.apply(y) + SumGrad.apply(b2)
""", static=True),
    Route("04", "sp_region", "sequence_parallel_linears_with_swapped_weights",
          "course_lib.parallel.tp_layers.ColumnParallelLinear", """
import torch
import torch.nn.functional as F
from course_lib import comm
from course_lib.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear

class SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        comm.all_reduce(g)
        return g

def sp_region(x, norm_w, w1, b1, w2, b2):
    col = ColumnParallelLinear(torch.zeros_like(w1), torch.zeros_like(b1), sequence_parallel=True)
    row = RowParallelLinear(torch.zeros_like(w2), None, sequence_parallel=True)
    del col.weight, col.bias, row.weight
    col.weight, col.bias, row.weight = w1, b1, w2  # the given tensors, swapped in
    h = F.rms_norm(x, (x.shape[-1],), SumGrad.apply(norm_w), eps=1e-5)
    return row(F.gelu(col(h))) + SumGrad.apply(b2)
""", static=True),
    Route("04", "sp_region", "chapter_06_all_gather_kv", "course_lib.parallel.cp_attention.AllGatherKV", """
import torch
import torch.nn.functional as F
from course_lib import comm
from course_lib.parallel.cp_attention import AllGatherKV

class Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        t = torch.distributed.get_world_size()
        send = torch.cat(y.chunk(t, dim=1)).contiguous()
        mine = y.new_empty((send.shape[0] // t, *send.shape[1:]))
        comm.reduce_scatter(mine, send)
        return mine

    @staticmethod
    def backward(ctx, g):
        t = torch.distributed.get_world_size()
        parts = g.new_empty((t * g.shape[0], *g.shape[1:]))
        comm.all_gather(parts, g.contiguous())
        return torch.cat(parts.chunk(t), dim=1)

class SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        comm.all_reduce(g)
        return g

def sp_region(x, norm_w, w1, b1, w2, b2):
    h = F.rms_norm(x, (x.shape[-1],), SumGrad.apply(norm_w), eps=1e-5)
    full = AllGatherKV.apply(h, None)  # [t, b, s/t, h]: chapter 06's K/V gather is g-bar
    full = full.permute(1, 0, 2, 3).reshape(h.shape[0], -1, h.shape[2])
    return Leave.apply(F.linear(F.gelu(F.linear(full, w1, b1)), w2)) + SumGrad.apply(b2)
""", static=True),
    Route("04", "vocab_parallel_cross_entropy", "getattr_on_a_module_name_built_from_strings",
          "course_lib.parallel.tp_layers.vocab_parallel_cross_entropy", """
import importlib

def vocab_parallel_cross_entropy(logits, targets):
    part = "layers"
    module = importlib.import_module(f"course_lib.parallel.tp_{part}")
    return getattr(module, "_".join(["vocab", "parallel", "cross", "entropy"]))(logits, targets)
""", static=True),
    Route("04", "vocab_parallel_cross_entropy", "name_built_at_run_time",
          "course_lib.parallel.tp_layers.vocab_parallel_cross_entropy", """
import importlib

def vocab_parallel_cross_entropy(logits, targets):
    names = vars(importlib.import_module(".".join(["course_lib", "parallel", "tp_" + str("layers")[::1]])))
    return names["".join(sorted("vocab_parallel_cross_entropy", key=lambda c: 0))](logits, targets)
""", static=False),
    # ---- a route built at run time, in every chapter
    Route("00", "zero_bytes_per_device", "rot13_module_name",
          "course_lib.estimates.model_states.zero_memory_per_device", """
import codecs, importlib

def zero_bytes_per_device(psi, n_d, stage, k=12):
    states = importlib.import_module(codecs.decode("pbhefr_yvo.rfgvzngrf.zbqry_fgngrf", "rot13"))
    return states.zero_memory_per_device(psi, K=k, N_d=n_d, stage=stage)
""", static=False),
    Route("01", "ring_reduce_scatter", "sys_modules_at_run_time",
          "course_lib.runtime.collectives.ring_reduce_scatter", """
import sys

def ring_reduce_scatter(tensor):
    import course_lib.runtime.collectives  # loaded, never named: sys.modules hands it over
    name = ".".join(part[::-1] for part in ("bil_esruoc", "emitnur", "sevitcelloc"))
    return getattr(sys.modules[name], "ring_reduce_scatter")(tensor)
""", static=False),
    Route("02", "dp_bytes_per_step", "code_copied_at_run_time",
          "course_lib.estimates.accounting.allreduce_bytes_per_rank", """
import base64
import importlib
import types

def dp_bytes_per_step(n_params, bytes_per_grad, n, accumulation):
    lib = importlib.import_module(base64.b64decode("Y291cnNlX2xpYi5lc3RpbWF0ZXMuYWNjb3VudGluZw==").decode())
    mine = types.FunctionType(lib.allreduce_bytes_per_rank.__code__, globals())
    return mine(n_params * bytes_per_grad, n)
""", static=False),
    Route("03", "shard_range", "dunder_import_at_run_time", "course_lib.parallel.zero_unit.shard_bounds", """
def shard_range(numel, world_size, rank):
    unit = __import__("course_lib.parallel." + "zero" + chr(95) + "unit", fromlist=["*"])
    return unit.shard_bounds(rank, -(-numel // world_size))
""", static=False),
    Route("05", "one_f_one_b_order", "exec_of_an_import", "course_lib.parallel.schedules.one_f_one_b", """
def one_f_one_b_order(p, m, rank):
    scope = {}
    exec("from course_lib.parallel.schedules import one_f_one_b as f", scope)
    return [f"{a.kind.value}{a.microbatch}" for a in scope["f"](p, m)[rank] if a.is_compute]
""", static=False),
    Route("06", "merge_partials", "in_a_thread", "course_lib.parallel.cp_attention.BlockAttention.merge", """
import importlib, threading

def merge_partials(out1, lse1, out2, lse2):
    ca = importlib.import_module("course_lib.parallel.cp_" + "attention"[::-1][::-1])
    got = []
    worker = threading.Thread(target=lambda: got.append(ca.BlockAttention().merge(out1, lse1, out2, lse2)))
    worker.start()
    worker.join()
    return got[0] if got else (out1, lse1)
""", static=False),
    Route("07", "kept_counts", "code_copied_under_another_file_name", "course_lib.parallel.ep.kept_counts", """
import importlib, types

def kept_counts(counts, capacity):
    ep = importlib.import_module("course_lib.parallel." + "pe"[::-1])
    code = ep.kept_counts.__code__.replace(co_filename="my_helpers.py")
    return types.FunctionType(code, vars(ep))(counts, capacity)
""", static=False),
    Route("08", "coords_of", "method_called_by_name", "course_lib.runtime.mesh.MeshShape", """
import importlib, operator

def coords_of(rank, degrees, order):
    mesh = importlib.import_module("course_lib.runtime." + "hsem"[::-1])
    shape = getattr(mesh, "Mesh" + "Shape".upper().title())(**{a: degrees.get(a, 1) for a in ("tp", "cp", "dp", "pp")},
                                                              order=order)
    return {a: c for a, c in operator.methodcaller("coords", rank)(shape).items() if a in ("tp", "cp", "dp", "pp")}
""", static=False),
    Route("10", "simulated_goodput", "members_listed_at_run_time",
          "course_lib.failures.checkpoint_interval.simulate_goodput", """
import importlib, inspect
import torch

def simulated_goodput(interval_s, cost_s, mtbf_s, restart_s, work_s, generator):
    module = importlib.import_module(".".join(reversed(["checkpoint_interval", "failures", "course_lib"])))
    members = dict(inspect.getmembers(module))
    seed = int(torch.randint(2**31, (1,), generator=generator))
    return members["simulate_" + "goodput"](interval_s, cost_s, mtbf_s, restart_s, work_s, seed=seed)
""", static=False),
]


def _cell(route: Route) -> dict:
    return define_in_cell(route.cell, f"/tmp/ipykernel_0/route_{route.chapter}_{route.exercise}_{route.name}.py")


def _exercise(chapter: str, key: str) -> Exercise:
    return next(ex for ex in grader.chapter_module(chapter).EXERCISES if ex.key == key)


def _ids(routes: list[Route]) -> list[str]:
    return [f"{r.chapter}-{r.exercise}-{r.name}" for r in routes]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the refused thread's
@pytest.mark.parametrize("route", ROUTES, ids=_ids(ROUTES))
def test_each_route_to_the_librarys_answer_scores_zero_naming_the_object(route):
    ex = _exercise(route.chapter, route.exercise)
    namespace = _cell(route)
    result = in_kernel.grade_exercise(ex, namespace)
    assert not result.ok, result
    assert "write it yourself" in result.message and route.refused in result.message, result.message
    assert ("the visible check" not in result.message) == route.static, result.message  # when it was refused


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES, ids=_ids(ROUTES))
def test_each_route_is_a_working_answer_without_the_allow_list(route):
    """What the allow-list stops would otherwise pass: the route reaches an implementation that works."""
    ex = _exercise(route.chapter, route.exercise)
    answer = _cell(route)[ex.function]
    result = ex.check.unguarded(answer, **ex.visible)
    assert result.ok, result


def test_every_chapter_has_a_route_built_at_run_time_refused():
    chapters = {r.chapter for r in ROUTES if not r.static}
    assert chapters >= {f"{n:02d}" for n in range(11)}, sorted(chapters)


def _library_answers():
    from tests.grading_fixtures.library_answers import CASES

    for (chapter, key), answers in CASES.items():
        for answer in answers:
            yield pytest.param(chapter, _exercise(chapter, key), answer, id=f"{chapter}-{key}-{answer.__name__}")


@pytest.mark.parametrize("chapter, exercise, answer", list(_library_answers()))
def test_the_library_answer_fixtures_are_refused_before_any_check_runs(chapter, exercise, answer):
    """Called by its full path, through an alias or a helper, on an instance, inherited or through super(): the
    grader and the notebook's visible check refuse it, naming the library's object."""
    refused = exercise.refusal(answer)
    assert refused is not None and "write it yourself" in refused.message, exercise.key
    assert "course_lib." in refused.message.split(", which")[0], refused.message
    visible = getattr(grader.chapter_module(chapter), exercise.check.__name__)(answer)
    assert not visible.ok and visible.message == refused.message, visible


# ----------------------------------------------------------------------------------------------------------------
# The solutions: not refused


def _solution_namespace(notebook: Path) -> dict:
    """The imports, functions and classes every code cell of ``notebook`` defines, as a cell would."""
    namespace: dict = {"__name__": "__main__"}
    for i, cell in enumerate(nbformat.read(notebook, as_version=4).cells):
        if cell.cell_type == "code":
            keep = [node for node in ast.parse(cell.source).body
                    if isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef)]
            exec(compile(ast.Module(keep, type_ignores=[]), f"/tmp/ipykernel_0/{notebook.stem}_{i}.py", "exec"),
                 namespace)
    return namespace


@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_no_solution_reaches_what_its_exercise_does_not_allow(solution):
    """Read, not run. That the checks never refuse a solution on its ranks either (the comm layer, a stage, a
    DataParallel it is handed): test_grading.py::test_solution_scores_full_marks, every check under the guard."""
    namespace = _solution_namespace(solution)
    for ex in grader.chapter_module(solution.name[:2]).EXERCISES:
        assert ex.refusal(namespace[ex.function]) is None, (solution.name, ex.key)


# ----------------------------------------------------------------------------------------------------------------
# The mechanism


def test_a_refusal_on_a_rank_scores_zero_with_the_rank_named():
    """The learner's function runs on launched ranks: each rank installs the guard, and the grade reads its
    refusal."""
    route = next(r for r in ROUTES if r.name == "sys_modules_at_run_time")
    result = in_kernel.grade_exercise(_exercise("01", "ring_reduce_scatter"), _cell(route))
    assert result.message.startswith("the visible check: rank ") and route.refused in result.message, result


def test_pytorchs_pipeline_schedules_are_refused_like_the_librarys():
    namespace = define_in_cell("""
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

def gpipe_step(stage, x, y, m):
    schedule = Schedule1F1B(PipelineStage(stage, 0, 2, "cpu"), m)
    return schedule.step(x)
""", "/tmp/ipykernel_0/pipelining.py")
    result = _exercise("05", "gpipe_step").refusal(namespace["gpipe_step"])
    assert "torch.distributed.pipelining.schedules.Schedule1F1B" in result.message, result


def test_a_refusal_names_what_the_exercise_allows_instead():
    route = next(r for r in ROUTES if r.name == "imports_inside_method_bodies")
    result = _exercise("04", "sp_region").refusal(_cell(route)["sp_region"])
    assert "its answer may use course_lib.comm" in result.message, result.message


def test_a_refusal_the_answer_catches_still_scores_zero():
    """Caught, and the answer falls back on code of its own: the refusal stands."""
    namespace = define_in_cell("""
import importlib

def tp_kv_heads(rank, t, n_head, n_kv):
    try:
        return getattr(importlib.import_module("course_lib.serving." + "tp_decode"[:]), "kv_heads_of")(
            rank, t, n_head, n_kv)
    except Exception:
        return list(range(n_kv))
""", "/tmp/ipykernel_0/caught.py")
    ex = _exercise("09", "tp_kv_heads")
    ex_pure = Exercise(ex.key, ex.title, ex.points, ex.function, _calls_once, allowed=ex.allowed)
    result = ex_pure.check(namespace["tp_kv_heads"])
    assert not result.ok and "course_lib.serving.tp_decode.kv_heads_of" in result.message, result


def _calls_once(fn) -> CheckResult:
    fn(0, 2, 4, 2)
    return CheckResult("tp_kv_heads", True, "returned")


def test_an_answer_that_removes_the_guard_is_refused():
    namespace = define_in_cell("""
import sys

def tp_kv_heads(rank, t, n_head, n_kv):
    sys.setprofile(None)
    return [rank]
""", "/tmp/ipykernel_0/tamper.py")
    ex = _exercise("09", "tp_kv_heads")
    result = Exercise(ex.key, ex.title, ex.points, ex.function, _calls_once).check(namespace["tp_kv_heads"])
    assert not result.ok and "sys.setprofile" in result.message, result


def test_an_answer_that_switches_the_guard_off_is_refused():
    namespace = define_in_cell("""
import sys

def tp_kv_heads(rank, t, n_head, n_kv):
    sys.modules["course_lib.grading.runtime_guard"]._ACTIVE = None
    return [rank]
""", "/tmp/ipykernel_0/switch_off.py")
    ex = _exercise("09", "tp_kv_heads")
    result = Exercise(ex.key, ex.title, ex.points, ex.function, _calls_once).check(namespace["tp_kv_heads"])
    assert not result.ok and "removed the grader's guard" in result.message, result


def test_the_guard_is_gone_after_a_check_even_one_that_raises():
    before_process, before_threads = sys.getprofile(), threading.getprofile()

    def raises(fn) -> CheckResult:
        raise RuntimeError("the check itself failed")

    with pytest.raises(RuntimeError):
        Exercise("x", "x", 1, "f", raises).check(lambda: None)
    assert sys.getprofile() is before_process and threading.getprofile() is before_threads
    assert runtime_guard._ACTIVE is None


def test_the_checks_own_calls_of_the_library_pass():
    """The library refuses the learner's frames only: this check runs the library's tensor-parallel decode on
    ranks, which calls the learner's function, which calls nothing of the library."""
    namespace = define_in_cell("""
def tp_kv_heads(rank, t, n_head, n_kv):
    per_rank, group = n_head // t, n_head // n_kv
    return sorted({j // group for j in range(rank * per_rank, (rank + 1) * per_rank)})
""", "/tmp/ipykernel_0/mine.py")
    assert ch09.check_tp_kv_heads(namespace["tp_kv_heads"]).ok


def test_an_allowed_path_permits_its_methods_and_nothing_beside():
    allowed = allowlist.Allowed(("course_lib.parallel.cp_attention.BlockAttention.forward",))
    from course_lib.parallel.cp_attention import BlockAttention

    assert allowed.permits_code(BlockAttention.forward.__code__)
    assert not allowed.permits_code(BlockAttention.backward.__code__)
    assert allowed.leads_to("course_lib.parallel.cp_attention.BlockAttention")  # may be named and subclassed
    assert not allowed.permits("course_lib.parallel.cp_attention.BlockAttention.merge")
    comm_only = allowlist.Allowed(("course_lib.comm",))
    from course_lib import comm

    assert comm_only.permits_code(comm.all_gather.__code__) and comm_only.permits_code(comm._TimedWork.wait.__code__)


def test_a_learner_class_inheriting_a_refused_method_is_refused_by_name():
    namespace = define_in_cell("""
from course_lib.parallel import cp_attention as ca

class FixedKernel(ca.BlockAttention):
    pass
""", "/tmp/ipykernel_0/inherits.py")
    result = _exercise("06", "fixed_kernel").refusal(namespace["FixedKernel"])
    assert "inherits course_lib.parallel.cp_attention.BlockAttention.backward" in result.message, result


def test_the_visible_check_in_the_notebook_refuses_what_the_grader_refuses():
    route = next(r for r in ROUTES if r.name == "name_built_at_run_time" and r.chapter == "09")
    result = ch09.check_tp_kv_heads(_cell(route)["tp_kv_heads"])
    assert not result.ok and "course_lib.serving.tp_decode.kv_heads_of" in result.message, result


def test_two_exercises_sharing_a_check_get_their_own_allow_list_in_the_notebook():
    """The notebook's self-check picks the exercise by the answer's name: each answer meets its own allow-list."""
    check = ch01.check_ring_all_reduce_bytes.unguarded
    mine = Exercise("a", "A", 1, "answer_a", check, allowed=("course_lib.comm",))
    other = Exercise("b", "B", 1, "answer_b", check)
    namespace: dict = {}
    guard_visible_checks(namespace, [mine, other])
    source = "from course_lib import comm\n\ndef {}(numel, es, n, rank):\n" \
             "    return comm.ring_bytes('all_reduce', numel, es, n, rank)\n"
    cells = {name: define_in_cell(source.format(name), f"/tmp/ipykernel_0/shared_{name}.py")[name]
             for name in ("answer_a", "answer_b")}
    assert namespace[check.__name__](cells["answer_a"]).ok
    refused = namespace[check.__name__](cells["answer_b"])
    assert not refused.ok and "course_lib.comm.ring_bytes" in refused.message, refused


def test_ch01_gives_messages_but_not_the_bytes_answer():
    byte_exercise = _exercise("01", "ring_all_reduce_bytes")
    assert not allowlist.Allowed(tuple(byte_exercise.allowed)).permits("course_lib.comm.ring_bytes")
    assert set(ch01.POINT_TO_POINT) >= {"course_lib.comm.isend", "course_lib.comm.irecv"}


def test_the_graders_help_says_what_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "Exercise.allowed" in text and "while the checks run" in text and "off_limits" not in text


@pytest.mark.slow
def test_a_whole_notebook_graded_refuses_the_route_and_scores_the_rest(tmp_path):
    """Through papermill and a real kernel: notebook cells, ``__main__``, ranks started from the kernel. Chapter
    09's solution with exercise 4 answered by the library's function reached at run time: 0 for it, with the
    reason; every other exercise full marks."""
    nb = nbformat.read(REPO / "solutions" / "09_serving_exercises.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("def tp_kv_heads"))
    cell.source = next(r for r in ROUTES if r.name == "name_built_at_run_time" and r.chapter == "09").cell
    path = tmp_path / "09_serving_exercises.ipynb"
    nbformat.write(nb, path)
    report = grader.grade_notebook(path)
    scores = {s.key: s for s in report.scores}
    assert scores["tp_kv_heads"].points == 0, report.table()
    assert "course_lib.serving.tp_decode.kv_heads_of" in scores["tp_kv_heads"].reason, report.table()
    assert all(s.points == s.max_points for k, s in scores.items() if k != "tp_kv_heads"), report.table()


def test_an_installed_function_equal_to_a_library_code_is_not_the_librarys():
    """Code objects compare equal across files (a copied ``__code__`` is caught so): torch's own wrappers, equal to
    some library function's code (here once ``runtime.device_audit`` is loaded), are never the library's."""
    importlib.import_module("course_lib.runtime.device_audit")
    namespace = define_in_cell("""
import torch

def train_clipped(rank, world_size, steps=4, seed=0):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.zero_grad(set_to_none=True)
    return [], dict(model.named_parameters())
""", "/tmp/ipykernel_0/installed_equal.py")
    assert _exercise("11", "train_clipped").refusal(namespace["train_clipped"]) is None
