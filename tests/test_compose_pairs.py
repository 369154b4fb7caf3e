"""The composition matrix: the pairs of axes that the in-place transforms (``course_lib.parallel.compose``)
made composable, each at 4 ranks against one process, the mutations that must break them, and every refusal
with its reason.

One launch at 4 ranks runs every configuration in turn (AdamW, 2 steps, a 4-layer d=32 model with learned
positions, so that a token at the wrong position changes the loss); the tests read its cached results. Parity:
``train_baseline`` within the noise-derived tolerance (``course_lib.train.compare``: a multiple of the fp32 noise
the baseline measures against its own float64 run), and every copy of a parameter -- its data-parallel replicas,
its TP ranks, its FSDP shards after the gather -- bit-for-bit equal (``merge_composed`` raises otherwise).
"""

from __future__ import annotations

import functools

import pytest
import torch

from course_lib.model_config import GPTConfig
from course_lib.parallel import compose as C
from course_lib.parallel import dp_reduce as R
from course_lib.parallel import placement as P
from course_lib.parallel import runs
from course_lib.parallel.config import ParallelConfig, check_composable
from course_lib.parallel.cp import CPContext
from course_lib.parallel.fsdp2 import FSDP2DataParallel, PerParameterUnit
from course_lib.parallel.zero import ZeroDataParallel
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import MeshShape
from course_lib.train import TrainConfig, TrainResult, compare, train_baseline

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(n_layer=4, d_model=32, n_head=4, seq_len=16, bias=False)
TC = TrainConfig(steps=2, global_batch=8, optimizer="adamw")
LAUNCH_TIMEOUT = 600

PAIRS_4 = {  # name: the ParallelConfig of a 4-rank run that the old structure refused
    "zero2_x_tp": ParallelConfig(MeshShape(dp=2, tp=2), zero_stage=2),
    "zero2_x_tp_sp": ParallelConfig(MeshShape(dp=2, tp=2), zero_stage=2, sequence_parallel=True),
    "fsdp2_x_tp": ParallelConfig(MeshShape(dp=2, tp=2), zero_stage=3),
    "fsdp2_x_tp_sp": ParallelConfig(MeshShape(dp=2, tp=2), zero_stage=3, sequence_parallel=True),
    "fsdp2_x_cp": ParallelConfig(MeshShape(dp=2, cp=2), zero_stage=3),
    "pp_x_cp": ParallelConfig(MeshShape(pp=2, cp=2)),
    "pp_x_cp_contiguous_allgather": ParallelConfig(MeshShape(pp=2, cp=2), cp_layout="contiguous",
                                                   cp_algorithm="allgather"),
    "pp_x_tp_sp": ParallelConfig(MeshShape(pp=2, tp=2), sequence_parallel=True),
    "pp_zb_h1_x_tp_sp": ParallelConfig(MeshShape(pp=2, tp=2), sequence_parallel=True, schedule="zb_h1"),
}


PRODUCTION_8 = {  # scaled-down copies of the meshes of large runs, on 8 ranks
    # a long-context dense run; Megatron's 3D; torchtitan's FSDP2 x TP x CP
    "tp2_cp2_pp2_sp": ParallelConfig(MeshShape(tp=2, cp=2, pp=2), sequence_parallel=True),
    "dp2_tp2_pp2_zero1_sp": ParallelConfig(MeshShape(dp=2, tp=2, pp=2), zero_stage=1, sequence_parallel=True),
    "fsdp2_tp2_cp2_sp": ParallelConfig(MeshShape(dp=2, tp=2, cp=2), zero_stage=3, sequence_parallel=True),
}


class ChunkLocalPositions(CPContext):
    """The first stage embeds positions 0..s/cp-1 on every cp rank, not the tokens' global ones."""

    def embedding_positions(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.local_positions().device)


def chunk_local_context_parallel(run: C.Parallelized) -> None:
    """The composition's context-parallel step with a ``ChunkLocalPositions`` context."""
    if run.mesh.size("cp") > 1:
        ctx = ChunkLocalPositions(run.mesh.group("cp"), run.config.cp_layout, C.ATTEND[run.config.cp_algorithm],
                                  max_len=run.module.config.seq_len)
        C.context_parallel(run, context=ctx)


class RecordedOnTheTPDim(PerParameterUnit):
    """ZeRO-3 of a TP weight recorded on the TP shard's own dim (a row-parallel weight's dim 1) instead of the
    local tensor's dim 0 it actually cuts: gathering and checkpoints then cut the wrong way."""

    def record_placements(self, axis: str, replicate_axis: str | None = None) -> None:
        super().record_placements(axis, replicate_axis)
        for shard, shape in zip(self.shards, self.shapes, strict=True):
            tp = P.placement(shard, "tp")
            if isinstance(tp, P.Shard) and tp.dim == 1:
                P.clear_placement(shard, axis)
                P.set_placement(shard, axis, P.Shard(1, shape[1]))


class PartialsSummedTwice(FSDP2DataParallel):
    """The known bug: the partial (sequence-parallel) gradients summed over tp once more after FSDP2 summed
    them (TP's own sync run after the data-parallel one)."""

    def finish_gradient_sync(self) -> None:
        super().finish_gradient_sync()
        R.sum_partials([s for u in self.units for s in u.shards], self.groups)


class FlatPartialSkipped(ZeroDataParallel):
    """ZeRO-2 x TP + SP without the sum over tp of the flat shards' partial segments."""

    def finish_gradient_sync(self) -> None:
        pass


def _sharded(run: C.Parallelized, make) -> None:
    run.dp = make(run.module, mesh=run.mesh)


def data_parallel_as(make) -> dict[str, object]:
    """``train_parallel``'s ``steps`` with a data-parallel step that builds ``make(module, mesh=mesh)``."""
    return {"steps": C.with_step(C.STEPS, C.data_parallel, functools.partial(_sharded, make=make))}


MUTATIONS_4 = {  # name: (the run's ParallelConfig, train_parallel keywords that break it)
    "pp_x_cp_first_stage_at_chunk_local_positions": (
        PAIRS_4["pp_x_cp"], {"steps": C.with_step(C.STEPS, C.context_parallel, chunk_local_context_parallel)}),
    "fsdp2_x_tp_recorded_on_the_wrong_dim": (
        PAIRS_4["fsdp2_x_tp"], data_parallel_as(functools.partial(FSDP2DataParallel, unit=RecordedOnTheTPDim))),
    "fsdp2_x_tp_sp_partial_summed_twice": (PAIRS_4["fsdp2_x_tp_sp"], data_parallel_as(PartialsSummedTwice)),
    "zero2_x_tp_sp_partial_not_summed": (
        PAIRS_4["zero2_x_tp_sp"], data_parallel_as(functools.partial(FlatPartialSkipped, stage=2))),
}


def _placements(rank: int) -> dict[str, dict[str, dict[str, P.Placement]]]:
    """The placements FSDP2 + TP records on block 0 (dp 2 x tp 2), and FSDP2 on dp 2 x cp 2."""
    from course_lib.model import GPT
    from course_lib.runtime.mesh import Mesh

    out = {}
    for name, kw in {"fsdp_tp": dict(dp=2, tp=2), "fsdp_cp": dict(dp=2, cp=2)}.items():
        mesh = Mesh(**kw)
        composed = C.parallelize(GPT(CFG, seed=0), mesh, ParallelConfig(mesh.shape, zero_stage=3))
        out[name] = {n: P.placements_of(p) for n, p in composed.module.named_parameters()
                     if n.startswith("blocks.0.")}
    return out


def _mismatch(rank: int) -> str:
    """The error of ``parallelize`` given a config for another mesh than the one it runs on."""
    from course_lib.model import GPT
    from course_lib.runtime.mesh import Mesh

    try:
        C.parallelize(GPT(CFG), Mesh(dp=4), ParallelConfig(MeshShape(dp=2, tp=2)))
    except ValueError as e:
        return str(e)
    return "accepted"


def _suite4(rank: int, world_size: int) -> dict[str, object]:
    out: dict[str, object] = {"placements": _placements(rank), "mismatch": _mismatch(rank)}
    for name, parallel in PAIRS_4.items():
        out[name] = runs.train_parallel(rank, world_size, CFG, TC, parallel)
    for name, (parallel, seam) in MUTATIONS_4.items():
        out[name] = runs.train_parallel(rank, world_size, CFG, TC, parallel, **seam)
    return out


def _suite8(rank: int, world_size: int) -> dict[str, object]:
    return {name: runs.train_parallel(rank, world_size, CFG, TC, parallel) for name, parallel in PRODUCTION_8.items()}


@functools.cache
def _results(n: int = 4) -> dict[str, list]:
    per_rank = launch(_suite4 if n == 4 else _suite8, n, timeout=LAUNCH_TIMEOUT)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


@functools.cache
def _reference() -> TrainResult:
    return train_baseline(CFG, TC)


def _outcome(results: list) -> str:
    try:
        merged = runs.merge_composed(results)
    except ValueError as e:
        return f"merge failed: {e}"
    report = compare(_reference(), merged)
    return "PASS" if report.ok else str(report)


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(PAIRS_4))
def test_pair_matches_one_process_at_4_ranks(name: str) -> None:
    assert _outcome(_results()[name]) == "PASS"


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRODUCTION_8))
def test_production_shaped_mesh_matches_one_process_at_8_ranks(name: str) -> None:
    results = _results(8)[name]
    assert _outcome(results) == "PASS"
    groups = {rec.group for r in results for step in r.step_comm for rec in step}
    axes = [a for a in ("dp", "cp", "tp", "pp") if PRODUCTION_8[name].shape.size(a) > 1]
    assert all(any(a in g for g in groups) for a in axes), groups  # every axis communicated over its group


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(MUTATIONS_4))
def test_mutation_fails(name: str) -> None:
    assert _outcome(_results()[name]) != "PASS", f"the broken variant {name} still matches one process"


@pytest.mark.slow  # reads the module's 4-rank launch: make test, not make test-fast
def test_fsdp2_shards_the_tp_shard_again_on_dim_0() -> None:
    """FSDP2 + TP: a column-parallel weight is S(0) on tp then S(0) on dp (this rank's rows of its TP rows), a
    row-parallel one S(1) on tp then S(0) on dp -- the local shard cut again on its dim 0, as ``fully_shard``
    over a 2-D mesh after ``parallelize_module`` has it; with cp > 1 the shards live on "dp+cp"."""
    for rank in _results()["placements"]:
        tp = rank["fsdp_tp"]  # d_model 32: q_proj [32, 32] -> [16, 32] on tp; o_proj -> [32, 16]
        assert tp["blocks.0.attn.q_proj.weight"] == {"tp": P.Shard(0), "dp": P.Shard(0, 16)}, tp
        assert tp["blocks.0.attn.o_proj.weight"] == {"tp": P.Shard(1), "dp": P.Shard(0, 32)}, tp
        assert list(tp["blocks.0.attn.o_proj.weight"]) == ["tp", "dp"]  # the dp cut nests inside the tp one
        cp = rank["fsdp_cp"]
        assert all(v.get("dp+cp") == P.Shard(0, v["dp+cp"].size) and "dp" not in v for v in cp.values()), cp


# -- what still does not compose, with the reason and its source ----------------------------------------------


def test_zero_2_with_a_pipeline_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"ZeRO-2 with pipeline parallelism is refused: .* accumulate unsharded on "
                                         r"the stage .*nothing to save over ZeRO-1.*zero_stage=3"):
        ParallelConfig(MeshShape(dp=2, pp=2), zero_stage=2).validate(CFG, global_batch=8)


@pytest.mark.slow  # reads the module's 4-rank launch: make test, not make test-fast
def test_a_config_for_another_mesh_is_refused_with_the_fix() -> None:
    for rank, message in enumerate(_results()["mismatch"]):
        assert message.startswith(f"rank {rank}: parallelize got a ParallelConfig for "), message
        assert "build the mesh from the config (config.mesh())" in message


def test_the_pairs_the_old_structure_refused_now_validate() -> None:
    for parallel in PAIRS_4.values():
        parallel.validate(CFG, global_batch=8)
    check_composable(MeshShape(dp=2, cp=2, tp=2, pp=2), CFG, sequence_parallel=True, global_batch=8,
                     microbatches=2)
