"""Chapter 08, exercise 7 — where a parameter lives on a mesh, and what its gradient needs.

``place_parameter(name, shape, n_layer, parallel)``: for every parameter of the course's GPT, on meshes of TP with
and without SP, CP, PP, DP and ZeRO-3, the returned ``placements``, ``stage``, ``local_shape`` and ``grad`` are
compared with what the library's transforms record on 4 real ranks (``compose.parallelize`` of the same mesh,
``placement.placements_of`` of every parameter, the stage each rank trains, rank 0's local shapes). Block 0's
linears under DP x TP are the chapter's worked cell; the check also asks for SP's norms, the stage boundaries of a
pipeline, the padded rows of a vocabulary shard and ZeRO-3 over dp x cp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from course_lib.grading import core
from course_lib.grading.core import CheckFailed, CheckResult, run_check
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.parallel.compose import parallelize
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.placement import Replicate, placements_of
from course_lib.runtime.mesh import MeshShape

LAUNCH_TIMEOUT_S = 40.0
"""A launched check stops the ranks after this long (below the grader's 60 s per check)."""
KEYS = ("placements", "stage", "local_shape", "grad")
GRAD_OPS = ("all_reduce_sum", "all_reduce_mean", "reduce_scatter_mean")

PLACE_CFG = GPTConfig(vocab_size=250, seq_len=16, n_layer=4, n_head=4, d_model=32, bias=False)
PLACE_MESHES = (ParallelConfig(MeshShape(dp=2, tp=2), sequence_parallel=True),
                ParallelConfig(MeshShape(dp=2, tp=2), zero_stage=3, sequence_parallel=True),
                ParallelConfig(MeshShape(tp=2, pp=2), sequence_parallel=True),
                ParallelConfig(MeshShape(dp=2, cp=2), zero_stage=3),
                ParallelConfig(MeshShape(tp=2, cp=2)))
"""The visible check's meshes (4 ranks each): SP's partial norms, FSDP + TP's padded vocabulary rows (125 over 2),
a pipeline's stage boundary, ZeRO-3 over dp x cp, TP without SP with the gradient mean over dp x cp."""


def _records_on_rank(rank: int, world_size: int, cfg: GPTConfig, meshes: tuple[ParallelConfig, ...]
                     ) -> list[dict[str, tuple[dict[str, str], tuple[int, ...], bool]]]:
    """For each mesh: every parameter's recorded placements (replicated axes left out), its local shape on this
    rank and whether this rank trains it."""
    out = []
    for parallel in meshes:
        model = GPT(cfg, seed=0)
        composed = parallelize(model, parallel.mesh(), parallel, global_batch=8)
        trained = composed.pipe.stages.values() if composed.pipe is not None else [model]
        held = {id(p) for stage in trained for p in stage.parameters()}
        out.append({name: ({a: str(w) for a, w in placements_of(p).items() if not isinstance(w, Replicate)},
                           tuple(p.shape), id(p) in held) for name, p in model.named_parameters()})
    return out


def reference_grad(placements: dict[str, str], parallel: ParallelConfig) -> list[tuple[str, str]]:
    """The gradient's collectives from its placements: a sum over each ``P`` axis, then the data-parallel mean
    (a reduce-scatter when the parameter is sharded over that group, an all-reduce otherwise)."""
    steps = [("all_reduce_sum", a) for a, w in placements.items() if w == "P"]
    if parallel.shape.dp * parallel.shape.cp > 1:
        key = "dp+cp" if parallel.shape.cp > 1 else "dp"
        steps.append(("reduce_scatter_mean" if placements.get(key, "").startswith("S") else "all_reduce_mean", key))
    return steps


def _references(cfg: GPTConfig, meshes: tuple[ParallelConfig, ...], timeout: float) -> list[dict[str, dict]]:
    per_rank = core.launch_check(_records_on_rank, 4, cfg, meshes, timeout=timeout,
                                 hang_hint=" (the library's own parallelize: report it)", course_files=None)
    refs = []
    for i, parallel in enumerate(meshes):
        table = {}
        for name, (placed, local, _) in per_rank[0][i].items():
            stages = {parallel.shape.coords(r)["pp"] for r in range(4) if per_rank[r][i][name][2]}
            table[name] = {"placements": placed, "stage": min(stages), "local_shape": local,
                           "grad": reference_grad(placed, parallel)}
        refs.append(table)
    return refs


def _mesh_words(p: ParallelConfig) -> str:
    axes = " x ".join(f"{a} {getattr(p.shape, a)}" for a in ("dp", "tp", "cp", "pp") if getattr(p.shape, a) > 1)
    return axes + (f", ZeRO-{p.zero_stage}" if p.zero_stage else "") + (" + SP" if p.sequence_parallel else "")


def _hint(key: str, want: Any, got: Any, parallel: ParallelConfig, name: str) -> str:
    """What a learner needs to see when ``key`` is wrong."""
    if key == "placements":
        if want.get("tp") == "P" and got.get("tp") != "P":
            return ("under sequence parallelism each TP rank's norms and position embedding see only s/tp tokens: "
                    "the weight is replicated, its gradient a partial sum over tp (P)")
        if any(k.startswith("dp") for k in want) and not any(str(k).startswith("dp") for k in got):
            return ("ZeRO-3 (FSDP2) shards every parameter on dim 0 over the data-parallel group, on top of what "
                    "TP made of it")
        if "dp+cp" in want and "dp" in got:
            return "with cp > 1 the data-parallel group is dp x cp, one group keyed 'dp+cp'"
        if want.get("tp", "").startswith("S") and got.get("tp") != want["tp"]:
            return ("column-parallel weights (q, k, v, fc1, the embedding and the head, split by vocabulary) are "
                    "S(0) on tp, row-parallel ones (o_proj, fc2) S(1)")
        return "list every axis it is not replicated on, and only those"
    if key == "stage":
        return (f"the {parallel.shape.pp} stages hold equal runs of blocks; the first stage also holds the "
                "embeddings, the last the final norm and the head")
    if key == "local_shape":
        return ("TP's slice first, then ZeRO-3's dim-0 shard of that slice: ceil(n / N) rows on rank 0 (the last "
                "ranks hold the padding)")
    steps = [s for s, _ in want]
    if "all_reduce_sum" in steps and not any(s == "all_reduce_sum" for s, *_ in got):
        return "a partial (P) gradient is summed over its axis first, or each rank keeps only its tokens' share"
    if "reduce_scatter_mean" in steps:
        return "a ZeRO-3 shard's gradient is reduce-scattered (each rank keeps the mean of its own shard)"
    if not steps:
        return "nothing: every rank of this mesh computes the whole gradient of what it holds"
    return "the data-parallel replicas' gradients are averaged over the data-parallel group, after any partial sum"


def _normalise(answer: Any, what: str) -> dict[str, Any]:
    if not isinstance(answer, dict) or set(answer) != set(KEYS):
        raise CheckFailed(f"{what}: place_parameter must return a dict with exactly the keys {list(KEYS)}, got "
                          f"{answer!r:.200}")
    placed, stage, local, grad = (answer[k] for k in KEYS)
    if not isinstance(placed, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in placed.items()):
        raise CheckFailed(f"{what}: placements must map axis keys to 'S(d)' or 'P' strings, got {placed!r}")
    if "R" in placed.values():
        raise CheckFailed(f"{what}: leave replicated axes out of placements (an axis not listed is R), got {placed}")
    if type(stage) is not int:
        raise CheckFailed(f"{what}: stage must be an int, got {stage!r}")
    if not isinstance(local, tuple | list) or not all(type(n) is int for n in local):
        raise CheckFailed(f"{what}: local_shape must be a tuple of ints, got {local!r}")
    if not isinstance(grad, list | tuple) or not all(
            isinstance(s, tuple | list) and len(s) == 2 and s[0] in GRAD_OPS and isinstance(s[1], str) for s in grad):
        raise CheckFailed(f"{what}: grad must be a list of (collective, axis key) pairs, the collective one of "
                          f"{GRAD_OPS}, got {grad!r}")
    return {"placements": placed, "stage": stage, "local_shape": tuple(local),
            "grad": [tuple(s) for s in grad]}


def check_place_parameter(fn: Callable, cfg: GPTConfig = PLACE_CFG, meshes: tuple[ParallelConfig, ...] = PLACE_MESHES,
                          timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """``fn`` for every parameter of ``cfg``'s GPT on every mesh of ``meshes`` against the library's records on 4
    real ranks (``_records_on_rank``)."""
    def body() -> str:
        if any(p.world_size != 4 for p in meshes):
            raise ValueError("check_place_parameter: every mesh must have 4 ranks")
        refs = _references(cfg, meshes, timeout)
        shapes = {n: tuple(p.shape) for n, p in GPT(cfg, seed=0).named_parameters()}
        n = 0
        for parallel, table in zip(meshes, refs, strict=True):
            for name, want in table.items():
                what = f"{name} {shapes[name]} on {_mesh_words(parallel)} (n_layer={cfg.n_layer})"
                got = _normalise(fn(name, shapes[name], cfg.n_layer, parallel), what)
                for key in KEYS:
                    if got[key] != want[key]:
                        raise CheckFailed(f"{what}: {key} expected {want[key]}, got {got[key]}: "
                                          f"{_hint(key, want[key], got[key], parallel, name)}")
                n += 1
        return f"{n} parameters on {len(meshes)} meshes: placements, stage, local shape and gradient as recorded"
    return run_check("place_parameter", body)


HIDDEN = {"cfg": GPTConfig(vocab_size=254, seq_len=16, n_layer=4, n_head=4, d_model=32, bias=False),
          "meshes": (ParallelConfig(MeshShape(pp=2, dp=2)),
                     ParallelConfig(MeshShape(tp=2, cp=2), sequence_parallel=True),
                     ParallelConfig(MeshShape(dp=4), zero_stage=3),
                     ParallelConfig(MeshShape(dp=2, tp=2), zero_stage=3))}
"""The grader's meshes: a pipeline with data parallelism (4 blocks), TP x CP + SP, ZeRO-3 over 4 (254 rows: 64
on rank 0), FSDP + TP without SP (127 rows: 64)."""
