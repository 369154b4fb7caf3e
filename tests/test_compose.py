"""course_lib.parallel.compose: every composed mesh against one process, checkpoints across meshes, the
pipeline's data-parallel reduction as a schedule action, and mutations that must fail.

Launches are few and batched (each costs seconds of rank start-up on 2 cores): one launch at 4 ranks runs every
4-rank configuration in turn, one at 8 ranks the 2 x 2 x 2 mesh under two axis orders; the tests read their
cached results. Parity: ``train_baseline`` at the default tolerance (|a-b| <= 1e-6 + 1e-5 |ref|), AdamW at the
default lr, fp32; the MoE run with SGD (AdamW turns 1e-9 round-off in the tiny first gradient of a rarely used
expert into a 1e-6 step, for ``train_ep`` alike). Every copy of a parameter over its replicas and TP ranks must be
bit-for-bit equal (``merge_composed``).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from course_lib import comm
from course_lib.data import global_batch, shard
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.parallel import compose as C
from course_lib.parallel import runs
from course_lib.parallel import schedules as S
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.pp import PipelineParallel
from course_lib.parallel.pp_executor import PipelineExecutor
from course_lib.parallel.runs import train_ep
from course_lib.parallel.schedules import Action, Kind, add_grad_reduce, add_send_recv
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import Mesh, MeshError, MeshShape
from course_lib.train import TrainConfig, TrainResult, compare, train_baseline

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(n_layer=4, d_model=32, n_head=4, seq_len=16, bias=False)
MOE = GPTConfig(bias=False, n_layer=2, d_model=32, n_head=2, seq_len=16, n_expert=4, top_k=2)
TC = TrainConfig(steps=2, global_batch=8)
TC4 = TrainConfig(steps=4, global_batch=8)
SGD = TrainConfig(steps=3, global_batch=8, optimizer="sgd", lr=0.05)
LAUNCH_TIMEOUT = 300
OTHER_ORDER = "dp-cp-ep-tp-pp"  # TP slowest but PP: TP groups span what the default order keeps together

PARITY_4 = {  # name: the ParallelConfig of a 4-rank run
    "dp2_tp2": ParallelConfig(MeshShape(dp=2, tp=2)),
    "tp2_cp2": ParallelConfig(MeshShape(tp=2, cp=2)),
    "dp2_cp2": ParallelConfig(MeshShape(dp=2, cp=2)),
    "dp2_pp2_1f1b": ParallelConfig(MeshShape(dp=2, pp=2)),
    "dp2_pp2_zb_h1": ParallelConfig(MeshShape(dp=2, pp=2), schedule="zb_h1"),
    "dp2_pp2_interleaved_zero1": ParallelConfig(MeshShape(dp=2, pp=2), schedule="interleaved", v=2, zero_stage=1),
    "tp2_pp2": ParallelConfig(MeshShape(tp=2, pp=2)),
    "dp2_tp2_zero1_sp": ParallelConfig(MeshShape(dp=2, tp=2), zero_stage=1, sequence_parallel=True),
    "dp4_accumulation2": ParallelConfig(MeshShape(dp=4), accumulation=2),
    "dp2_tp2_other_order": ParallelConfig(MeshShape(dp=2, tp=2, order=OTHER_ORDER)),
}


class CoordsInAnotherOrder(Mesh):
    """Groups built in the default order, but coordinates (which rows a rank trains on) read in another: the
    data-parallel rank of a TP pair differs, so the two TP halves of one layer see different rows."""

    def coord(self, axis: str) -> int:
        s = self.shape
        return MeshShape(dp=s.dp, cp=s.cp, tp=s.tp, pp=s.pp, ep=s.ep, order=OTHER_ORDER).coords(self.rank)[axis]


class DPWithoutCP(Mesh):
    """The data-parallel average over "dp" only, not "dp" x "cp": CP ranks' gradients of the same rows are never
    added up."""

    def group(self, *axes: str):  # type: ignore[no-untyped-def]
        return super().group("dp") if set(axes) == {"dp", "cp"} else super().group(*axes)


def mesh_of(cls: type[Mesh]):
    """A ``mesh_fn`` for ``train_parallel``: the config's mesh built as ``cls``."""
    return functools.partial(_build_mesh, cls)


def _build_mesh(cls: type[Mesh], config: ParallelConfig) -> Mesh:
    return cls(**dataclasses.asdict(config.shape))


class SkipGradReduce(PipelineExecutor):
    """The pipeline's data-parallel gradient reduction never runs."""

    def reduce_grad(self, stage: int) -> None:
        pass


def reduce_before_last_w(actions: S.Schedule) -> S.Schedule:
    """Each stage's REDUCE_GRAD right after its last I, before the W passes still pending: the reduced gradient
    misses them (the zero-bubble bug)."""
    out = []
    for rank in add_grad_reduce(actions):
        plain = [a for a in rank if a.kind is not Kind.REDUCE_GRAD]
        for stage in sorted({a.stage for a in plain}):
            last_i = max(i for i, a in enumerate(plain) if a.kind is Kind.I and a.stage == stage)
            plain.insert(last_i + 1, Action(Kind.REDUCE_GRAD, plain[last_i].microbatch, stage))
        out.append(plain)
    return out


def with_pipeline(**options: object) -> dict[str, object]:
    """``train_parallel``'s ``steps`` with ``pipeline_parallel`` given ``options`` (an executor, a placement)."""
    return {"steps": C.with_step(C.STEPS, C.pipeline_parallel, functools.partial(C.pipeline_parallel, **options))}


MUTATIONS_4 = {  # name: (the run's ParallelConfig, what breaks it: a wrong mesh, a pipeline step's part)
    "coords_in_another_order": (ParallelConfig(MeshShape(dp=2, tp=2)), dict(mesh_fn=mesh_of(CoordsInAnotherOrder))),
    "dp_average_without_cp": (ParallelConfig(MeshShape(dp=2, cp=2)), dict(mesh_fn=mesh_of(DPWithoutCP))),
    "pipeline_grad_reduce_skipped": (ParallelConfig(MeshShape(dp=2, pp=2)), with_pipeline(executor=SkipGradReduce)),
    "pipeline_grad_reduce_before_last_w": (ParallelConfig(MeshShape(dp=2, pp=2), schedule="zb_h1"),
                                           with_pipeline(place_grad_reduce=reduce_before_last_w)),
}

CHECKPOINTS = {  # name: (mesh that saves after 2 steps, world size, mesh that resumes for 2 more, world size)
    "dp4_to_dp2_tp2": (ParallelConfig(MeshShape(dp=4)), 4, ParallelConfig(MeshShape(dp=2, tp=2)), 4),
    "pp2_to_pp1": (ParallelConfig(MeshShape(pp=2)), 2, ParallelConfig(), 1),
    "dp2_tp2_to_tp2_pp2": (ParallelConfig(MeshShape(dp=2, tp=2)), 4, ParallelConfig(MeshShape(tp=2, pp=2)), 4),
}


LIFECYCLE = {"dp2_tp2": dict(dp=2, tp=2), "dp2_pp2": dict(dp=2, pp=2), "dp2_cp2": dict(dp=2, cp=2)}
REDUCTIONS = ("all_reduce", "reduce_scatter")


def _lifecycle(rank: int) -> dict[str, dict]:
    """The wrapper contract on a composed model initialised differently on every rank: the weights made identical,
    no data-parallel reduction under ``no_sync``, one outside it, nothing left after ``remove_hooks``."""
    out = {}
    for name, kw in LIFECYCLE.items():
        mesh = Mesh(**kw)
        model = GPT(CFG, seed=rank)
        w = C.parallelize(model, mesh, global_batch=4)
        x, y = global_batch(0, 4, CFG.seq_len, 0)
        x, y = shard(x, mesh.coord("dp"), mesh.size("dp")), shard(y, mesh.coord("dp"), mesh.size("dp"))
        got: dict = {"params": runs.ComposedResult([], w.full_parameters(), rank=rank)}
        dp_label = mesh.label("dp", "cp")
        with comm.recording() as log, w.no_sync():
            w.forward_backward(x, y)
        got["no_sync"] = sum(r.op in REDUCTIONS and r.group == dp_label for r in log.records)
        with comm.recording() as log:
            w.forward_backward(x, y)
            w.finish_gradient_sync()
        got["sync"] = sum(r.op in REDUCTIONS and r.group == dp_label for r in log.records)
        w.remove_hooks()
        out[name] = got
    return out


def _suite4(rank: int, world_size: int, folder: str) -> dict[str, object]:
    out: dict[str, object] = {"lifecycle": _lifecycle(rank)}
    for name, parallel in PARITY_4.items():
        out[name] = runs.train_parallel(rank, world_size, CFG, TC, parallel)
    for name, (parallel, seam) in MUTATIONS_4.items():
        try:
            out[name] = runs.train_parallel(rank, world_size, CFG, TC, parallel, **seam)
        except RuntimeError as e:  # the data-parallel step refuses parameters a pipeline never reduced
            out[name] = f"raised: {e}"
    out["uninterrupted_dp4"] = runs.train_parallel(rank, world_size, CFG, TC4, ParallelConfig(MeshShape(dp=4)))
    out["moe_dp4_ep2"] = runs.train_parallel(rank, world_size, MOE, SGD, ParallelConfig(MeshShape(dp=4, ep=2)))
    out["moe_train_ep"] = train_ep(rank, world_size, MOE, SGD, ep=2)
    for name, (first, n_first, _, _) in CHECKPOINTS.items():
        if n_first == world_size:
            runs.train_parallel(rank, world_size, CFG, TrainConfig(steps=2, global_batch=8), first,
                             checkpoint=runs.Checkpointing(save_to=f"{folder}/{name}", save_after=2))
    for name, (_, _, second, n_second) in CHECKPOINTS.items():
        if n_second == world_size:
            out[f"resumed_{name}"] = runs.train_parallel(rank, world_size, CFG, TC4, second,
                                                      checkpoint=runs.Checkpointing(resume_from=f"{folder}/{name}"))
    return out


def _suite2(rank: int, world_size: int, folder: str) -> dict[str, object]:
    out: dict[str, object] = {"tp2": runs.train_parallel(rank, world_size, CFG, TC, ParallelConfig(MeshShape(tp=2))),
                              "cp2": runs.train_parallel(rank, world_size, CFG, TC, ParallelConfig(MeshShape(cp=2)))}
    runs.train_parallel(rank, world_size, CFG, TrainConfig(steps=2, global_batch=8), ParallelConfig(MeshShape(pp=2)),
                     checkpoint=runs.Checkpointing(save_to=f"{folder}/pp2_to_pp1", save_after=2))
    return out


def _suite8(rank: int, world_size: int) -> dict[str, object]:
    return {order: runs.train_parallel(rank, world_size, CFG, TC,
                                       ParallelConfig(MeshShape(dp=2, tp=2, pp=2, order=order)))
            for order in ("tp-cp-ep-dp-pp", OTHER_ORDER)}


@functools.cache
def _folder() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="compose-ckpt-")


@functools.cache
def _results(n: int) -> dict[str, list]:
    if n == 8:
        per_rank = launch(_suite8, 8, timeout=LAUNCH_TIMEOUT)
    elif n == 2:
        per_rank = launch(_suite2, 2, _folder(), timeout=LAUNCH_TIMEOUT)
    else:
        _results(2)  # writes the PP 2 checkpoint the 1-rank resume reads
        per_rank = launch(_suite4, 4, _folder(), timeout=LAUNCH_TIMEOUT)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


@functools.cache
def _reference(tc: TrainConfig, cfg: GPTConfig = CFG, accumulation: int = 1) -> TrainResult:
    return train_baseline(cfg, tc, accumulation=accumulation)


def _outcome(results: list) -> str:
    """'PASS' when the ranks' results merge and match the baseline; else why not."""
    if isinstance(results[0], str):  # the run raised
        return results[0]
    try:
        merged = runs.merge_composed(results)
    except ValueError as e:
        return f"merge failed: {e}"
    report = compare(_reference(TC), merged)
    return "PASS" if report.ok else str(report)


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(PARITY_4))
def test_composed_mesh_matches_one_process_at_4_ranks(name: str) -> None:
    acc = PARITY_4[name].accumulation
    report = compare(_reference(TC, accumulation=acc), runs.merge_composed(_results(4)[name]))
    assert report.ok, f"{name}: {report}"


@pytest.mark.parity
@pytest.mark.parametrize("name", ["tp2", "cp2"])
def test_composed_mesh_matches_one_process_at_2_ranks(name: str) -> None:
    assert _outcome(_results(2)[name]) == "PASS"


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", OTHER_ORDER])
def test_dp_tp_pp_2x2x2_on_8_ranks(order: str) -> None:
    results = _results(8)[order]
    assert _outcome(results) == "PASS"
    shape = MeshShape(dp=2, tp=2, pp=2, order=order)
    assert [r.coords for r in results] == [shape.coords(r) for r in range(8)]
    for r in results:  # each rank trains exactly its pipeline stage's blocks (TP shards gathered whole)
        blocks = {int(n.split(".")[1]) for n in r.params if n.startswith("blocks.")}
        assert blocks == ({0, 1} if r.coords["pp"] == 0 else {2, 3}), (r.rank, r.coords, blocks)
    groups = {rec.group for r in results for step in r.step_comm for rec in step}
    assert {"tp", "pp", "dp"} <= groups, groups  # every axis communicated, each over its own named group


@pytest.mark.parity
def test_expert_parallel_composes_with_data_parallel() -> None:
    ours = runs.merge_composed(_results(4)["moe_dp4_ep2"])
    report = compare(_reference(SGD, MOE), ours)
    assert report.ok, str(report)
    library = _results(4)["moe_train_ep"][0]  # the chapter-07 helper: the same computation, bit for bit
    assert ours.losses == library.losses
    assert all(torch.equal(ours.params[n], library.params[n]) for n in library.params)


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(MUTATIONS_4))
def test_mutation_fails(name: str) -> None:
    outcome = _outcome(_results(4)[name])
    assert outcome != "PASS", f"the broken variant {name} still matches one process"
    if outcome.startswith("raised"):  # only the skipped reduction may be refused instead of training wrong
        assert name == "pipeline_grad_reduce_skipped" and "REDUCE_GRAD" in outcome, outcome


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_checkpoint_resumed_on_another_mesh_equals_the_uninterrupted_run(name: str) -> None:
    n_second = CHECKPOINTS[name][3]
    if n_second == 1:
        _results(2)
        resumed = runs.merge_composed(launch(runs.train_parallel, 1, CFG, TC4,
                                          checkpoint=runs.Checkpointing(resume_from=f"{_folder()}/{name}")))
    else:
        resumed = runs.merge_composed(_results(4)[f"resumed_{name}"])
    ref = _reference(TC4)
    report = compare(ref.from_step(2), resumed)
    assert report.ok, f"{name}: {report}"
    uninterrupted = runs.merge_composed(_results(4)["uninterrupted_dp4"])
    assert compare(uninterrupted.from_step(2), resumed, noise=ref.noise).ok


@pytest.mark.parity
def test_checkpoint_without_optimizer_state_does_not_resume_the_run() -> None:
    """Mutation: the same checkpoint without the optimizer state (AdamW starts afresh at step 2): the resumed run
    is another run, and the parity check says so."""
    _results(2)
    src = Path(_folder()) / "pp2_to_pp1"
    broken = Path(_folder()) / "no_optimizer_state"
    broken.mkdir(exist_ok=True)
    (broken / "meta.json").write_text((src / "meta.json").read_text())
    for f in src.glob("stage*.pt"):
        part = torch.load(f, weights_only=True)
        part["optimizer"] = {n: {} for n in part["optimizer"]}
        torch.save(part, broken / f.name)
    resumed = runs.merge_composed(launch(runs.train_parallel, 1, CFG, TC4,
                                      checkpoint=runs.Checkpointing(resume_from=str(broken))))
    ref = _reference(TC4)
    assert not compare(ref.from_step(2), resumed).ok


@pytest.mark.slow  # reads the module's 4-rank launch: make test, not make test-fast
@pytest.mark.parametrize("name", sorted(LIFECYCLE))
def test_the_composed_wrapper_follows_the_contract(name: str) -> None:
    ranks = [r[name] for r in _results(4)["lifecycle"]]
    merged = runs.merge_composed([r["params"] for r in ranks])  # raises if two copies of a parameter differ
    if "pp" not in LIFECYCLE[name]:  # every rank now holds the first rank's initial weights (seed 0)
        assert all(torch.equal(t, GPT(CFG, seed=0).get_parameter(n).detach()) for n, t in merged.params.items())
    assert all(r["no_sync"] == 0 for r in ranks), f"{name}: no_sync() reduced gradients over dp"
    assert all(r["sync"] > 0 for r in ranks), f"{name}: the synchronising pass did not reduce over dp"


# -- the schedule action --------------------------------------------------------------------------------------


def _reduce_positions(schedule: S.Schedule) -> list[dict[int, int]]:
    return [{a.stage: i for i, a in enumerate(rank) if a.kind is Kind.REDUCE_GRAD} for rank in schedule]


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 2, 4, 1), ("gpipe", 4, 4, 1), ("interleaved", 2, 4, 2),
                                        ("zb_h1", 4, 8, 1)])
def test_grad_reduce_follows_each_stage_last_weight_gradient(name: str, p: int, m: int, v: int) -> None:
    builder = getattr(S, S.canonical_schedule(name))
    compute = builder(p, m, v) if v > 1 else builder(p, m)
    with_reduce = add_grad_reduce(add_send_recv(compute))
    for r, (rank, positions) in enumerate(zip(with_reduce, _reduce_positions(with_reduce), strict=True)):
        assert sorted(positions) == list(range(r, p * v, p)), (r, positions)  # one per stage of this rank
        for stage, i in positions.items():
            weight_kind = Kind.W if any(a.kind is Kind.W for a in rank) else Kind.B
            writes = [j for j, a in enumerate(rank) if a.stage == stage and a.kind is weight_kind]
            assert len(writes) == m and i == writes[-1] + 1, (name, r, stage, i, writes[-1])
        assert [a for a in rank if a.kind is not Kind.REDUCE_GRAD] == add_send_recv(compute)[r]


# -- what does not compose gets a clear error -----------------------------------------------------------------


def _check(shape: MeshShape, **kw: object) -> None:
    C.check_composable(shape, CFG, **kw)


@pytest.mark.parametrize("shape,kw,words", [
    (MeshShape(pp=2, dp=2), {"zero_stage": 2}, "ZeRO-2 with pipeline parallelism is refused: a stage's gradients"),
])
def test_unsupported_combination_is_named(shape: MeshShape, kw: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        _check(shape, **kw)


def test_zero_3_with_a_pipeline_composes() -> None:
    _check(MeshShape(pp=2, dp=2), zero_stage=3, global_batch=8, microbatches=2)  # fsdp2_pipeline: no refusal


def test_expert_parallel_with_sequence_parallel_is_refused() -> None:
    C.check_composable(MeshShape(dp=2, tp=2, ep=2), MOE)  # EP x TP composes (tests/test_compose_ep.py)
    with pytest.raises(ValueError, match="ep > 1 with sequence_parallel"):
        C.check_composable(MeshShape(dp=2, tp=2, ep=2), MOE, sequence_parallel=True)


def test_mesh_that_does_not_divide_the_model_names_the_constraint() -> None:
    with pytest.raises(MeshError, match="n_head"):
        _check(MeshShape(tp=8))
    with pytest.raises(MeshError, match="n_layer"):
        _check(MeshShape(pp=8))


def test_an_unknown_zero_stage_is_refused_with_the_stages() -> None:
    with pytest.raises(ValueError, match="ZeRO stage 4: the stages are 0"):
        ParallelConfig(zero_stage=4)


def test_parallel_config_keeps_the_mesh_messages() -> None:
    """A bad degree is refused at construction with ``MeshShape``'s message; ``validate`` names every constraint
    the mesh breaks for the model and batch, each with its fix, as ``MeshShape.validate`` does."""
    with pytest.raises(MeshError, match=r"dp=0: every degree must be an int >= 1"):
        ParallelConfig(MeshShape(dp=0))
    with pytest.raises(MeshError) as caught:
        ParallelConfig(MeshShape(tp=8, pp=8)).validate(CFG, global_batch=8)
    with pytest.raises(MeshError) as direct:
        MeshShape(tp=8, pp=8).validate(CFG, global_batch=8, seq_len=CFG.seq_len)
    assert caught.value.problems == direct.value.problems and len(direct.value.problems) >= 2
    assert ParallelConfig(MeshShape(dp=2, tp=2, pp=2)).shape == MeshShape(dp=2, tp=2, pp=2)
    assert ParallelConfig(MeshShape(dp=2, tp=2, pp=2)).world_size == 8


def test_a_degree_passed_the_old_way_names_parallel_config() -> None:
    """The degrees are the mesh's (``MeshShape``), which ``ParallelConfig`` holds; ``train_parallel`` takes no
    degree and no part class (a variant is a step: ``compose.with_step``)."""
    with pytest.raises(TypeError, match=r"first field is the mesh: ParallelConfig\(MeshShape\(dp=2"):
        ParallelConfig(2)
    with pytest.raises(TypeError, match="'dp'"):
        runs.train_parallel(0, 1, CFG, TC, dp=2)
    with pytest.raises(TypeError, match="'pipeline'"):
        runs.train_parallel(0, 1, CFG, TC, pipeline=PipelineParallel)


@pytest.mark.parity
def test_parallelize_on_one_rank_is_the_model() -> None:
    """With every axis trivial, parallelize changes nothing: one process, the baseline's numbers."""
    report = compare(_reference(TC), runs.merge_composed(launch(runs.train_parallel, 1, CFG, TC)))
    assert report.ok and report.max_param_diff == 0.0, str(report)
