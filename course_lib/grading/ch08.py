"""Chapter 08 — composing the axes: coordinates, groups, a mesh's constraints, and steps on four ranks.

1. ``coords_of(rank, degrees, order)``: a rank's dense coordinates for an axis order; every rank of several meshes
   and orders.
2. ``group_of(rank, axes, degrees, order)``: the sorted ranks of a group over some axes; every rank and axis set.
3. ``mesh_problems(cfg, degrees, global_batch, micro_batch)``: the names of the constraints a mesh breaks; on
   meshes that break none, one and several, each also at the edge of the sequence and batch rules.
4. ``predict_mesh(...)``: a mesh's model-state bytes per GPU and step time (``ch08_predict``).
5. ``average_dp_gradients(params, mesh)`` (find the bug): on 4 real ranks (dp=2 x tp=2, both axis orders), every
   rank's parameters after one SGD step against one process's.
6. ``add_grad_reduce(schedule)``: the gradient reduction as a schedule action (``ch08_pipeline``).
7. ``place_parameter(name, shape, n_layer, parallel)``: where a parameter lives and what its gradient needs
   (``ch08_placement``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from course_lib.data import global_batch, shard
from course_lib.grading import ch08_placement, core
from course_lib.grading.cases import each, several
from course_lib.grading.ch08_pipeline import _build, check_add_grad_reduce, check_grad_reduce_on_ranks
from course_lib.grading.ch08_placement import LAUNCH_TIMEOUT_S, check_place_parameter
from course_lib.grading.ch08_predict import (
    MEMORY_RTOL,
    PREDICT_CASES,
    TIME_RTOL,
    check_predict_mesh,
    library_prediction,
    predict_mesh_spec,
)
from course_lib.grading.core import (
    CheckFailed,
    CheckResult,
    Exercise,
    expect_close,
    expect_equal,
    guard_visible_checks,
    run_check,
)
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel.schedules import Kind
from course_lib.planner import search as planner
from course_lib.runtime.mesh import DENSE_AXES, Mesh, MeshShape

GRADER_PARAMETERS = {"seed": 1}
REEXPORTED = (check_grad_reduce_on_ranks, MEMORY_RTOL, PREDICT_CASES, TIME_RTOL, library_prediction,
              predict_mesh_spec)
"""Defined with their exercise's module (``ch08_predict``, ``ch08_pipeline``); the notebooks and the tests reach
them as ``ch08.<name>``."""

CONSTRAINTS = ("heads", "kv_heads", "ffn", "vocab", "layers", "sequence", "batch")
"""The names ``mesh_problems`` returns, one per constraint of ``MeshShape.validate`` (world size aside)."""

_MESHES = (({"tp": 2, "cp": 1, "dp": 2, "pp": 2}, "tp-cp-ep-dp-pp"),
           ({"tp": 2, "cp": 2, "dp": 3, "pp": 1}, "tp-cp-ep-dp-pp"),
           ({"tp": 4, "cp": 1, "dp": 2, "pp": 1}, "dp-tp-cp-ep-pp"),
           ({"tp": 2, "cp": 2, "dp": 2, "pp": 2}, "pp-dp-cp-ep-tp"),
           ({"tp": 2, "ep": 2, "dp": 2, "pp": 2}, "tp-ep-dp-cp-pp"))  # ep has a degree but is not a dense axis


def _shape(degrees: dict[str, int], order: str) -> MeshShape:
    return MeshShape(order=order, **{a: degrees.get(a, 1) for a in DENSE_AXES})


def check_coords_of(fn: Callable, meshes: tuple = _MESHES) -> CheckResult:
    def body() -> str:
        n = 0
        for degrees, order in meshes:
            shape = _shape(degrees, order)
            for r in range(shape.world_size):
                want = {a: shape.coords(r)[a] for a in DENSE_AXES}
                got = fn(r, dict(degrees), order)
                if not isinstance(got, dict) or set(got) != set(DENSE_AXES) or \
                        not all(type(v) is int for v in got.values()):
                    raise CheckFailed(f"coords_of({r}, {degrees}, {order!r}) must return a dict of the four axes "
                                      f"{list(DENSE_AXES)} to Python ints, got {got!r}")
                if got != want:
                    ep = " ; ep has a degree here but is not a dense axis: skip it" if degrees.get("ep", 1) > 1 else ""
                    raise CheckFailed(f"coords_of({r}, {degrees}, {order!r}): expected {want}, got {got} (the first "
                                      f"axis of the order varies fastest{ep})")
                n += 1
        return f"{n} ranks of {len(meshes)} meshes right"
    return run_check("coords_of", body)


def check_group_of(fn: Callable, meshes: tuple = _MESHES,
                   axes_list: tuple = (("tp",), ("dp",), ("pp",), ("dp", "cp"), ("tp", "pp"), ("pp", "dp", "tp"))
                   ) -> CheckResult:
    def body() -> str:
        n = 0
        for degrees, order in meshes:
            shape = _shape(degrees, order)
            for axes in axes_list:
                for r in range(shape.world_size):
                    want = shape.group_ranks(r, *axes)
                    got = fn(r, axes, dict(degrees), order)
                    if not isinstance(got, list) or not all(type(v) is int for v in got):
                        raise CheckFailed(f"group_of({r}, {axes}, {degrees}, {order!r}) must return a list of ints, "
                                          f"got {got!r}")
                    expect_equal(got, want, f"group_of({r}, {axes}, {degrees}, {order!r}) (sorted ranks)")
                    n += 1
        return f"{n} groups right"
    return run_check("group_of", body)


def reference_problems(cfg: GPTConfig, degrees: dict[str, int], global_batch: int, micro_batch: int) -> set[str]:
    """The chapter's rules, one name each (the grader's reference for ``mesh_problems``)."""
    tp, cp, dp, pp = (degrees.get(a, 1) for a in ("tp", "cp", "dp", "pp"))
    out = set()
    if cfg.n_head % tp:
        out.add("heads")
    if cfg.kv_heads % tp and tp % cfg.kv_heads:
        out.add("kv_heads")
    if cfg.ffn_dim % tp:
        out.add("ffn")
    if cfg.vocab_size % tp:
        out.add("vocab")
    if cfg.n_layer % pp:
        out.add("layers")
    if cp > 1 and cfg.seq_len % (2 * cp):
        out.add("sequence")
    if global_batch % (dp * micro_batch):
        out.add("batch")
    return out


_CFG = GPTConfig(vocab_size=256, seq_len=24, n_layer=4, n_head=4, n_kv_head=2, d_model=64, d_ff=192)
_CASES = (
    (_CFG, {"tp": 2, "dp": 2, "pp": 2}, 8, 1),          # fits
    (_CFG, {"tp": 4, "dp": 2}, 8, 1),                    # kv heads replicated: fits
    (_CFG, {"tp": 8}, 8, 1),                             # heads (kv 2 divides 8: replicated)
    (_CFG, {"pp": 3, "dp": 2}, 8, 1),                    # layers
    (_CFG.with_(seq_len=12), {"cp": 4, "dp": 2}, 8, 1),  # sequence: 12 % 8 (12 % 4 == 0)
    (_CFG, {"dp": 3}, 8, 1),                             # batch
    (_CFG.with_(vocab_size=250, d_ff=190), {"tp": 4}, 8, 2),  # ffn, vocab
    (GPTConfig(n_head=6, n_kv_head=3, d_model=48), {"tp": 4, "dp": 2}, 6, 2),  # heads, kv, batch
    (_CFG, {"cp": 2, "dp": 2}, 6, 1),                    # fits: cp ranks share the sequences, not the batch
)


def _with_boundaries(cases: tuple) -> list[tuple]:
    """Each case, then beside it the same mesh at the edge of the two rules that count in units: a sequence that cp
    divides but 2 cp does not (cp > 1), and a global batch that dp divides but dp x micro-batch does not (mb > 1)."""
    out = []
    for cfg, degrees, gb, mb in cases:
        cp, dp = degrees.get("cp", 1), degrees.get("dp", 1)
        edges = [(cfg.with_(seq_len=cp * (2 * (cfg.seq_len // (2 * cp)) + 1)), degrees, gb, mb)] if cp > 1 else []
        edges += [(cfg, degrees, dp * (mb * (gb // (dp * mb)) + 1), mb)] if mb > 1 else []
        for case in [(cfg, degrees, gb, mb), *edges]:
            if case not in out:
                out.append(case)
    return out


def check_mesh_problems(fn: Callable, cases: tuple = _CASES) -> CheckResult:
    def body() -> str:
        for cfg, degrees, gb, mb in _with_boundaries(cases):
            want = reference_problems(cfg, degrees, gb, mb)
            got = fn(cfg, dict(degrees), gb, mb)
            if not isinstance(got, set) or not all(isinstance(v, str) for v in got):
                raise CheckFailed(f"mesh_problems must return a set of names from {CONSTRAINTS}, got {got!r}")
            unknown = got - set(CONSTRAINTS)
            if unknown:
                raise CheckFailed(f"unknown constraint names {sorted(unknown)}: use {CONSTRAINTS}")
            if got != want:
                missing, extra = sorted(want - got), sorted(got - want)
                wrong = ([f"{missing} broken but not returned"] if missing else []) + \
                    ([f"{extra} returned but not broken (that rule holds here)"] if extra else [])
                raise CheckFailed(f"degrees {degrees}, global batch {gb}, micro-batch {mb} (n_head={cfg.n_head}, "
                                  f"n_kv_head={cfg.kv_heads}, d_ff={cfg.ffn_dim}, vocab={cfg.vocab_size}, "
                                  f"n_layer={cfg.n_layer}, seq_len={cfg.seq_len}): expected {sorted(want)}, got "
                                  f"{sorted(got)}: {'; '.join(wrong)}")
        return f"{len(cases)} meshes: the broken constraints named exactly"
    return run_check("mesh_problems", body)


# ----------------------------------------------------------------------------------------------------------------
# DP x TP on four ranks

_RANK_CFG = GPTConfig(vocab_size=256, seq_len=8, n_layer=1, n_head=2, d_model=16)


def _dp_tp_step(rank: int, world_size: int, fn: Callable, order: str, batch: int, seed: int) -> dict[str, Any]:
    from course_lib.parallel.dp_reduce import sum_partials
    from course_lib.parallel.placement_ops import full_parameters
    from course_lib.parallel.tp import apply_tp
    from course_lib.parallel.tp_layers import vocab_parallel_cross_entropy

    mesh = Mesh(dp=2, tp=2, order=order)
    model = GPT(_RANK_CFG, seed=seed)
    apply_tp(model, mesh.group("tp"))
    x, y = global_batch(seed, batch, _RANK_CFG.seq_len, seed)
    xd, yd = shard(x, mesh.coord("dp"), 2), shard(y, mesh.coord("dp"), 2)
    vocab_parallel_cross_entropy(model(xd), yd, mesh.group("tp")).backward()
    sum_partials(model.parameters(), mesh)  # TP's partial sums: what the library's data-parallel step adds
    fn(list(model.parameters()), mesh)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    return full_parameters(model, mesh)


def check_average_dp_gradients(fn: Callable, orders: tuple[str, ...] = ("tp-cp-ep-dp-pp", "dp-tp-cp-ep-pp"),
                               batch: int = 4,
                               seed: int = 0, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """4 ranks, dp=2 x tp=2: each DP replica (a TP pair) trains on its half of the batch; after ``fn`` and one SGD
    step (lr 0.5) every rank's full parameters must equal one process's after the same step on the whole batch."""
    launch = functools.partial(core.launch_check, hang_hint=": did every rank call the same collectives on the "
                               "same group?")

    def body() -> str:
        ref = GPT(_RANK_CFG, seed=seed)
        x, y = global_batch(seed, batch, _RANK_CFG.seq_len, seed)
        lm_loss(ref(x), y).backward()
        with torch.no_grad():
            want = {n: p - 0.5 * p.grad for n, p in ref.named_parameters()}
        for order in orders:
            for r, got in enumerate(launch(_dp_tp_step, 4, fn, order, batch, seed, timeout=timeout)):
                for name, value in want.items():
                    expect_close(got[name], value, f"order {order!r}, rank {r}: {name} after one step "
                                 "(the average over the data-parallel replicas)", rtol=1e-4, atol=1e-6)
        return f"orders {list(orders)}: every rank equals one process after the step"
    return run_check("average_dp_gradients", body)


EXERCISES = [
    Exercise("coords_of", "Rank -> coordinates for an axis order", 3, "coords_of", check_coords_of,
             hidden=[{"meshes": (({"tp": 3, "cp": 1, "dp": 2, "pp": 2}, "cp-dp-tp-ep-pp"),
                                 ({"tp": 1, "cp": 4, "dp": 1, "pp": 2}, "tp-cp-ep-dp-pp"),
                                 ({"tp": 2, "cp": 2, "dp": 2, "ep": 4}, "ep-cp-tp-dp-pp"))}]),
    Exercise("group_of", "The ranks of a group over some axes", 3, "group_of", check_group_of,
             hidden=[{"meshes": (({"tp": 3, "cp": 2, "dp": 2, "pp": 1}, "dp-cp-tp-ep-pp"),
                                 ({"tp": 2, "cp": 2, "dp": 2, "ep": 4}, "cp-ep-tp-dp-pp")),
                      "axes_list": (("cp",), ("tp", "cp", "dp"), ("dp", "pp"))}]),
    Exercise("mesh_problems", "Validate a mesh: which constraints break", 3, "mesh_problems", check_mesh_problems,
             hidden=[{"cases": ((GPTConfig(n_head=8, n_kv_head=1, d_model=64, seq_len=30, n_layer=6),
                                 {"tp": 2, "cp": 3, "pp": 4}, 12, 1),
                                (GPTConfig(n_head=8, d_model=64, seq_len=32, n_layer=6), {"pp": 2, "dp": 4}, 16, 2),
                                (GPTConfig(n_head=8, d_model=64, seq_len=32, n_layer=6), {"cp": 4, "dp": 2}, 10, 1))}],
             allowed=("course_lib.model_config.GPTConfig",)),
    Exercise("predict_mesh", "Predict a mesh's memory and step time", 4, "predict_mesh", check_predict_mesh,
             hidden=[{"cases": (("llama3-8b", {"dp": 8, "tp": 2, "pp": 2}, planner.A100, 32, 2048, 1, 1, 0.4),
                                ("llama2-70b", {"dp": 64, "tp": 8}, planner.A100, 512, 2048, 1, 3, 0.6),
                                ("llama2-70b", {"dp": 4, "cp": 2, "tp": 8, "pp": 2}, planner.H100, 32, 2048, 1, 2,
                                 0.45),
                                ("llama2-70b", {"dp": 2, "tp": 8, "pp": 4}, planner.H100, 8, 4096, 1, 1, 0.4))}],
             allowed=("course_lib.model_config.GPTConfig", "course_lib.model_config.param_count",
                      "course_lib.estimates.hardware.GPU")),
    Exercise("average_dp_gradients", "Find the bug: DP x TP on four ranks", 5, "average_dp_gradients",
             check_average_dp_gradients, hidden=[{"orders": ("dp-tp-cp-ep-pp", "tp-dp-cp-ep-pp"), "batch": 8,
                                                  "seed": 2}],
             allowed=("course_lib.comm", "course_lib.runtime.mesh.Mesh")),
    Exercise("add_grad_reduce", "Pipeline x data parallelism: the gradient reduction in the schedule", 5,
             "add_grad_reduce", check_add_grad_reduce,
             hidden=[{"cases": (("gpipe", 4, 4, 1), ("zb_h1", 2, 3, 1), ("interleaved", 4, 8, 2), ("zb_h1", 3, 6, 1)),
                      "ranks": (("zb_h1", 4, 1),)}],
             allowed=("course_lib.parallel.schedules.Action", "course_lib.parallel.schedules.Kind")),
    Exercise("place_parameter", "Where a parameter lives on a mesh, and what its gradient needs", 4,
             "place_parameter", check_place_parameter, hidden=[ch08_placement.HIDDEN],
             allowed=("course_lib.parallel.config.ParallelConfig.world_size", "course_lib.runtime.mesh.MeshShape.size",
                      "course_lib.runtime.mesh.MeshShape.world_size")),
]



# ----------------------------------------------------------------------------------------------------------------
# Case classes


def _mesh_classes(meshes: tuple) -> set[str]:
    out = several((order for _, order in meshes), "axis orders")
    for degrees, order in meshes:
        dense = {a: degrees.get(a, 1) for a in DENSE_AXES}
        out |= {"an order whose first axis is not tp"} if not order.startswith("tp") else set()
        out |= {"an axis of degree more than 2"} if max(dense.values()) > 2 else set()
        out |= {"an axis of degree 1"} if 1 in dense.values() else set()
        out |= {"ep with a degree, before a dense axis of the order"} if degrees.get("ep", 1) > 1 and any(
            dense[a] > 1 for a in order.split("-")[order.split("-").index("ep") + 1:]) else set()
    return out


def _group_classes(calls: list[dict]) -> set[str]:
    out = set()
    for call in calls:
        out |= _mesh_classes(call["meshes"])
        for axes in call["axes_list"]:
            out.add(f"a group over {('one axis', 'two axes', 'three axes', 'four axes')[len(axes) - 1]}")
            for _, order in call["meshes"]:
                out |= {"axes listed in another order than the mesh's"} if list(axes) != sorted(
                    axes, key=order.split("-").index) else set()
    return out


def _problem_classes(calls: list[dict]) -> set[str]:
    out = set()
    for cfg, degrees, gb, mb in each(calls):
        broken = reference_problems(cfg, degrees, gb, mb)
        out |= {f"breaks {name}" for name in broken} | ({"breaks nothing"} if not broken else set())
        out |= {"breaks several"} if len(broken) > 1 else set()
        tp = degrees.get("tp", 1)
        out |= {"kv heads replicated over tp"} if tp > cfg.kv_heads and tp % cfg.kv_heads == 0 else set()
        out |= {"cp > 1"} if degrees.get("cp", 1) > 1 else set()
        out |= {"a micro-batch of several sequences"} if mb > 1 else set()
    return out


def _predict_classes(calls: list[dict]) -> set[str]:
    cases = each(calls)
    out = several((gpu.name for _, _, gpu, *_ in cases), "GPUs") | several((c[7] for c in cases), "efficiencies")
    for _, degrees, _, _, _, mb, zero, _ in cases:
        out |= {"pp > 1" if degrees.get("pp", 1) > 1 else "no pipeline", f"ZeRO-{zero}"}
        out |= ({"cp > 1"} if degrees.get("cp", 1) > 1 else set()) | ({"a micro-batch > 1"} if mb > 1 else set())
    return out


def _reduce_classes(calls: list[dict]) -> set[str]:
    out = several((p for _, p, _, _ in each(calls)), "pipeline depths")
    for name, p, m, v in each(calls):
        actions = [a for rank in _build(name, p, m, v) for a in rank]
        split = any(a.kind is Kind.W for a in actions)
        out |= {"a split backward (the last W)" if split else "a whole backward (the last B)"}
        out |= {"several stages per rank"} if v > 1 else set()
    return out | {"trained on ranks" for call in calls if call["ranks"]}


def _place_classes(calls: list[dict]) -> set[str]:
    out = set()
    for call in calls:
        for p in call["meshes"]:
            s, zero3 = p.shape, p.zero_stage == 3
            out |= {"tp with SP" if p.sequence_parallel else "tp without SP"} if s.tp > 1 else set()
            out |= {"a pipeline"} if s.pp > 1 else set()
            if s.dp * s.cp > 1:
                over = "dp x cp" if s.cp > 1 else "dp"
                out.add(f"ZeRO-3 over {over}" if zero3 else f"gradients averaged over {over}")
            out |= {"ZeRO-3 on top of tp"} if zero3 and s.tp > 1 else set()
            rows = -(-call["cfg"].vocab_size // s.tp)
            out |= {"a ZeRO-3 shard with padded rows"} if zero3 and rows % (s.dp * s.cp) else set()
    return out


CASE_CLASSES = {
    "coords_of": lambda calls: set().union(*(_mesh_classes(c["meshes"]) for c in calls)),
    "group_of": _group_classes,
    "mesh_problems": _problem_classes,
    "predict_mesh": _predict_classes,
    "average_dp_gradients": lambda calls: {
        "dp before tp in the order" if o.index("dp") < o.index("tp") else "tp before dp in the order"
        for c in calls for o in c["orders"]},
    "add_grad_reduce": _reduce_classes,
    "place_parameter": _place_classes,
}

guard_visible_checks(globals(), EXERCISES)
