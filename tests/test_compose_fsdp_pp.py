"""ZeRO-3 / FSDP2 x PP (``course_lib.parallel.fsdp2_pipeline``): each pipeline stage's parameters are their dim-0 shards
over dp, the schedule's actions gather them, the full gradients accumulate over the micro-batches and the stage's
``REDUCE_GRAD`` reduce-scatters them once per step -- torchtitan's FSDP x TP x PP.

One launch at 4 ranks (dp 2 x pp 2) runs every schedule, the variants, the mutations, the inspection and the
checkpoint round trips in turn (AdamW, 2 steps, the 4-layer d=32 model of ``test_compose_pairs``); the tests read
its cached results; the 8-rank dp 2 x tp 2 x pp 2 runs (with and without SP) are ``slow``. Parity:
``train_baseline`` within the noise-derived tolerance (``course_lib.train.compare``: a multiple of the fp32 noise
the baseline measures against its own float64 run), and every copy of a parameter -- its dp shards after the
gather, its TP ranks -- bit-for-bit equal with the same losses on every rank (``merge_composed`` raises
otherwise). Mutations: the gradients reduce-scattered after every micro-batch and overwritten (only the last one
counts), the reduction skipped at the last micro-batch, the first micro-batch's full gradients dropped, and
ZB-H1's ``REDUCE_GRAD`` placed before the pending W passes.
"""

from __future__ import annotations

import functools
import tempfile
from collections import Counter
from typing import Any

import pytest

from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.parallel import compose as C
from course_lib.parallel import placement as P
from course_lib.parallel import runs
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.fsdp2 import PerParameterUnit, dim0_chunk
from course_lib.parallel.fsdp2_pipeline import StageSharding
from course_lib.parallel.loop import train_loop
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import MeshShape
from course_lib.train import TrainConfig, TrainResult, compare, make_optimizer, train_baseline
from tests.test_compose import reduce_before_last_w, with_pipeline  # REDUCE_GRAD before the pending W passes

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(n_layer=4, d_model=32, n_head=4, seq_len=16, bias=False)
TC = TrainConfig(steps=2, global_batch=8, optimizer="adamw")
TC4 = TrainConfig(steps=4, global_batch=8, optimizer="adamw")  # the checkpoint round trips: save after 2
SAVE_AFTER = 2
LAUNCH_TIMEOUT = 600

SCHEDULES_4 = {  # name: a dp 2 x pp 2 ZeRO-3 run
    "1f1b": ParallelConfig(MeshShape(dp=2, pp=2), zero_stage=3, schedule="1f1b", microbatches=2),
    "gpipe": ParallelConfig(MeshShape(dp=2, pp=2), zero_stage=3, schedule="gpipe", microbatches=4),
    "zb_h1": ParallelConfig(MeshShape(dp=2, pp=2), zero_stage=3, schedule="zb_h1", microbatches=2),
    "interleaved": ParallelConfig(MeshShape(dp=2, pp=2), zero_stage=3, schedule="interleaved", microbatches=2, v=2),
}

PRODUCTION_8 = {  # torchtitan's 3D mesh
    "fsdp_tp_pp": ParallelConfig(MeshShape(dp=2, tp=2, pp=2), zero_stage=3),
    "fsdp_tp_sp_pp": ParallelConfig(MeshShape(dp=2, tp=2, pp=2), zero_stage=3, sequence_parallel=True),
}


# -- variants of the engine (``StageSharding``, swapped into the composition's data-parallel step) ---------------


class ReshardAfterForward(StageSharding):
    """FSDP2's ``reshard_after_forward=True`` under the pipeline: the weights freed after every F."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "reshard_after_forward": True})


class ReduceEveryMicrobatch(StageSharding):
    """ZeRO-2's way: reduce-scatter after every micro-batch's backward and *add* into the shards' gradients
    (correct, m reduce-scatters per step instead of one); ``REDUCE_GRAD`` then only frees the weights."""

    def accumulate(self, unit: PerParameterUnit) -> None:
        if self.sync:
            unit.accept_shard_grad(unit.reduce_gradients())
            unit.free_grads()

    def reduce(self, stage: int) -> None:
        for unit in self.units[stage]:
            unit.reshard()


class NotAccumulated(ReduceEveryMicrobatch):
    """Mutation: reduce-scatter at every micro-batch without accumulating -- each one overwrites the shards'
    gradients, so only the last micro-batch's count."""

    def accumulate(self, unit: PerParameterUnit) -> None:
        for s in unit.shards:
            s.grad = None
        super().accumulate(unit)


class SyncSkippedAtLast(StageSharding):
    """Mutation: ``REDUCE_GRAD`` frees the weights but never reduces (the sync of the last micro-batch skipped):
    the shards get no gradient."""

    def reduce(self, stage: int) -> None:
        for unit in self.units[stage]:
            unit.free_grads()
            unit.reshard()


class FirstMicrobatchDropped(StageSharding):
    """Mutation: the full gradients of each step's first micro-batch are dropped (``.grad`` reset after its
    backward), so the reduce-scatter sees the others only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: set[int] = set()

    def accumulate(self, unit: PerParameterUnit) -> None:
        if id(unit) not in self.seen:
            self.seen.add(id(unit))
            unit.free_grads()

    def reduce(self, stage: int) -> None:
        super().reduce(stage)
        self.seen -= {id(u) for u in self.units[stage]}


def _sharded_stages(run: C.Parallelized, sharding: type[StageSharding]) -> None:
    """The composition's data-parallel step of a dp x pp ZeRO-3 run, with ``sharding`` as the engine."""
    pipe = run.pipe
    run.dp = sharding({int(k): st for k, st in pipe.stages.items()}, run.mesh.group("dp", "cp"), groups=run.mesh)
    pipe.connect(run.dp.reduce, engine=run.dp)


def with_sharding(sharding: type[StageSharding]) -> tuple[C.Step, ...]:
    """The composition with ``sharding`` in place of ``StageSharding``."""
    return C.with_step(C.STEPS, C.data_parallel, functools.partial(_sharded_stages, sharding=sharding))


VARIANTS_4 = {"reshard_after_forward": ReshardAfterForward, "reduce_every_microbatch": ReduceEveryMicrobatch}
MUTATIONS_4 = {"reduce_scattered_every_microbatch_not_accumulated": NotAccumulated,
               "sync_skipped_at_the_last_microbatch": SyncSkippedAtLast,
               "first_microbatch_gradients_dropped": FirstMicrobatchDropped}

ROUND_TRIPS = {  # name: (mesh that saves, mesh that resumes), 4 ranks each
    "fsdp_dp2_pp2_to_fsdp_dp2_tp2": (SCHEDULES_4["1f1b"], ParallelConfig(MeshShape(dp=2, tp=2), zero_stage=3)),
    "zero1_dp4_to_fsdp_dp2_pp2": (ParallelConfig(MeshShape(dp=4), zero_stage=1), SCHEDULES_4["1f1b"]),
}


# -- what runs on the ranks --------------------------------------------------------------------------------------


def _inspect(rank: int, sharding: type[StageSharding]) -> dict[str, Any]:
    """Train dp 2 x pp 2 ZeRO-3 (1F1B, m = 2) by hand and look inside: each module parameter after the step (its
    shape, placement, whether it is what the optimizer steps), the gathered weights' storage, the collectives per
    unit, and the error of a second data-parallel reduction."""
    parallel = SCHEDULES_4["1f1b"]
    mesh = parallel.mesh()
    full = {n: tuple(p.shape) for n, p in GPT(CFG, seed=TC.seed).named_parameters()}
    composed = C.parallelize(GPT(CFG, seed=TC.seed), mesh, parallel, global_batch=TC.global_batch,
                             steps=with_sharding(sharding))
    opt = make_optimizer(list(composed.parameters()), TC)
    train_loop(composed, opt, CFG, TC, data_rank=mesh.coord("dp"), data_size=mesh.size("dp"))
    pipe = composed.pipe
    stepped = {id(p) for group in opt.param_groups for p in group["params"]}
    held = {n: p for st in pipe.stages.values() for n, p in st.named_parameters()}
    full = {n: full[n] for n in held}
    dp_rank = mesh.coord("dp")
    shapes = {n: (tuple(p.shape), (dim0_chunk(full[n][0], 2, dp_rank)[1] - dim0_chunk(full[n][0], 2, dp_rank)[0],
                                   *full[n][1:])) for n, p in held.items()}
    try:
        pipe.connect(composed.dp.reduce, engine=composed.dp)
        again = "accepted"
    except ValueError as e:
        again = str(e)
    units = [u for us in composed.dp.units.values() for u in us]
    gathered = sum(w.untyped_storage().nbytes() for u in units for w in u.params)
    placements, events = {n: P.placements_of(p) for n, p in held.items()}, Counter(composed.dp.events)
    composed.remove_hooks()  # full parameters back in the stages: the whole parameters, by the model's names
    restored = {n: tuple(p.shape) for st in pipe.stages.values() for n, p in st.named_parameters()}
    return {"restored": restored == full, "shapes": shapes, "placements": placements,
            "stepped": all(id(p) in stepped for p in held.values()) and len(stepped) == len(held),
            "gathered_bytes": gathered,
            "events": events, "units": [u.name for u in units], "again": again,
            "micro": pipe.plan.m, "full": full}


def _suite4(rank: int, world_size: int, folder: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, parallel in SCHEDULES_4.items():
        out[name] = runs.train_parallel(rank, world_size, CFG, TC, parallel)
    for name, sharding in {**VARIANTS_4, **MUTATIONS_4}.items():
        out[name] = runs.train_parallel(rank, world_size, CFG, TC, SCHEDULES_4["1f1b"],
                                        steps=with_sharding(sharding))
    out["zb_h1_reduce_before_last_w"] = runs.train_parallel(rank, world_size, CFG, TC, SCHEDULES_4["zb_h1"],
                                                            **with_pipeline(place_grad_reduce=reduce_before_last_w))
    out["inspect"] = _inspect(rank, StageSharding)
    out["inspect_reshard"] = _inspect(rank, ReshardAfterForward)
    out["inspect_every_microbatch"] = _inspect(rank, ReduceEveryMicrobatch)
    for name, (first, second) in ROUND_TRIPS.items():
        out[f"uninterrupted_{name}"] = runs.train_parallel(rank, world_size, CFG, TC4, first, checkpoint=(
            runs.Checkpointing(save_to=f"{folder}/{name}", save_after=SAVE_AFTER)))
        out[f"resumed_{name}"] = runs.train_parallel(rank, world_size, CFG, TC4, second, checkpoint=(
            runs.Checkpointing(resume_from=f"{folder}/{name}")))
    return out


def _suite8(rank: int, world_size: int) -> dict[str, object]:
    return {name: runs.train_parallel(rank, world_size, CFG, TC, parallel) for name, parallel in PRODUCTION_8.items()}


@functools.cache
def _results(n: int = 4) -> dict[str, list]:
    per_rank = (launch(_suite4, 4, tempfile.mkdtemp(prefix="fsdp-pp-"), timeout=LAUNCH_TIMEOUT) if n == 4
                else launch(_suite8, 8, timeout=LAUNCH_TIMEOUT))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


@functools.cache
def _reference(tc: TrainConfig = TC) -> TrainResult:
    return train_baseline(CFG, tc)


def _outcome(results: list, reference: TrainResult | None = None) -> str:
    try:
        merged = runs.merge_composed(results)
    except ValueError as e:
        return f"merge failed: {e}"
    report = compare(reference or _reference(), merged)
    return "PASS" if report.ok else str(report)


# -- parity ------------------------------------------------------------------------------------------------------


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(SCHEDULES_4))
def test_fsdp_x_pp_matches_one_process_at_4_ranks(name: str) -> None:
    assert _outcome(_results()[name]) == "PASS"


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(VARIANTS_4))
def test_the_other_policies_match_one_process_too(name: str) -> None:
    """Freeing the weights after every F, or reduce-scattering after every micro-batch (and adding), trade
    memory for traffic: the same training."""
    assert _outcome(_results()[name]) == "PASS"


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRODUCTION_8))
def test_fsdp_x_tp_x_pp_matches_one_process_at_8_ranks(name: str) -> None:
    results = _results(8)[name]
    assert _outcome(results) == "PASS"
    groups = {rec.group for r in results for step in r.step_comm for rec in step}
    assert all(any(a in g for g in groups) for a in ("dp", "tp", "pp")), groups  # every axis communicated


@pytest.mark.parity
@pytest.mark.parametrize("name", [*sorted(MUTATIONS_4), "zb_h1_reduce_before_last_w"])
def test_mutation_fails(name: str) -> None:
    assert _outcome(_results()[name]) != "PASS", f"the broken variant {name} still matches one process"


# -- FSDP2's contract and the traffic ----------------------------------------------------------------------------


@pytest.mark.slow  # reads the module's 4-rank launch: make test, not make test-fast
def test_each_module_parameter_is_its_shard_after_the_step() -> None:
    """After training, every parameter the rank's stages register is its dp rank's dim-0 chunk of the whole
    parameter (``torch.chunk``'s rule), recorded ``Shard(0, d0)`` on "dp", and exactly what the optimizer steps;
    no gathered weight holds storage between steps."""
    for rank in _results()["inspect"]:
        for name, (got, expected) in rank["shapes"].items():
            assert got == expected, (name, got, expected)
        assert all(w == {"dp": P.Shard(0, rank["full"][n][0])} for n, w in rank["placements"].items()), rank
        assert set(rank["shapes"]) == set(rank["full"]) and len(rank["full"]) > 0
        assert rank["stepped"]
        assert rank["gathered_bytes"] == 0
        assert rank["restored"]  # remove_hooks: whole parameters again


@pytest.mark.slow  # reads the module's 4-rank launch: make test, not make test-fast
def test_one_all_gather_and_one_reduce_scatter_per_unit_and_step() -> None:
    """Kept gathered from the stage's first action to its REDUCE_GRAD (torchtitan's choice under a pipeline):
    each unit is all-gathered once and reduce-scattered once per step, whatever m; freeing after every F
    gathers again for the backward; reducing every micro-batch costs m reduce-scatters."""
    for rank in _results()["inspect"]:
        assert rank["units"], rank
        for unit in rank["units"]:
            assert rank["events"][("all_gather", unit)] == TC.steps, rank["events"]
            assert rank["events"][("reduce_scatter", unit)] == TC.steps, rank["events"]
    for rank in _results()["inspect_reshard"]:
        for unit in rank["units"]:
            assert TC.steps < rank["events"][("all_gather", unit)] <= 2 * rank["micro"] * TC.steps
            assert rank["events"][("reduce_scatter", unit)] == TC.steps
    for rank in _results()["inspect_every_microbatch"]:
        for unit in rank["units"]:
            assert rank["events"][("reduce_scatter", unit)] == rank["micro"] * TC.steps


@pytest.mark.slow  # reads the module's 4-rank launch: make test, not make test-fast
def test_a_second_data_parallel_reduction_is_refused() -> None:
    for rank in _results()["inspect"]:
        assert "already connected to a data-parallel step" in rank["again"], rank["again"]


# -- checkpoints across meshes -----------------------------------------------------------------------------------


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_checkpoint_round_trip_to_another_mesh(name: str) -> None:
    """Saved after step 2 under one mesh, resumed under the other (FSDP x PP on either side): steps 3-4 equal
    the uninterrupted run and one process."""
    ref = _reference(TC4)
    uninterrupted = runs.merge_composed(_results()[f"uninterrupted_{name}"])
    resumed = runs.merge_composed(_results()[f"resumed_{name}"])
    report = compare(uninterrupted.from_step(SAVE_AFTER), resumed, noise=ref.noise)
    assert report.ok, f"{name}: resumed vs uninterrupted: {report}"
    assert compare(ref.from_step(SAVE_AFTER), resumed).ok, f"{name}: resumed vs one process"
