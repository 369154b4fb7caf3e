"""Checkpoints across meshes for every form (``checkpoint``'s whole format): save under ZeRO-1, ZeRO-3 / FSDP2 and
expert parallelism, resume under another mesh, and the resumed run equals the uninterrupted one.

Each saving run trains 4 steps and writes its checkpoint after step 2, so it *is* the uninterrupted run; the
resumed run trains steps 3-4 on another mesh. AdamW throughout, so the optimizer state (m, v, the step count) must
come back cut for the new mesh. Equality: ``compare`` with the noise of ``train_baseline``, and the resumed run
against the single-process baseline at the default tolerance; the arithmetic is not identical across meshes
(other reduction orders, FSDP's reduce-scatter), so not bitwise. Mutations: the optimizer state dropped on
resume makes the resumed run another run, and so do the nested cuts applied in reverse order (FSDP before TP)
and ZeRO-2's flat state taken at offset 0 on every rank; experts saved by their local index collide and the
resume names what is missing. ZeRO-2's flat shards are gathered into their parameters and laid out again.

One launch at 2 ranks (the ZeRO-1 dp 2 save) and one at 4 ranks (every other run); the tests read the cache.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from course_lib.model_config import GPTConfig
from course_lib.parallel import checkpoint as MC
from course_lib.parallel import runs
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.placement import placements_of, set_placement
from course_lib.parallel.placement_ops import shard_like
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import MeshShape
from course_lib.train import TrainConfig, TrainResult, compare, train_baseline

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, bias=False)
MOE = GPTConfig(bias=False, n_layer=2, d_model=32, n_head=2, seq_len=16, n_expert=4, top_k=2)
TC4 = TrainConfig(steps=4, global_batch=8)  # AdamW
SAVE_AFTER = 2
LAUNCH_TIMEOUT = 300

ROUND_TRIPS = {  # name: (model, mesh that saves, its world size, mesh that resumes (4 ranks))
    "zero3_dp4_to_fsdp_dp2_tp2": (CFG, ParallelConfig(MeshShape(dp=4), zero_stage=3), 4,
                                  ParallelConfig(MeshShape(dp=2, tp=2), zero_stage=3)),
    "fsdp_dp2_tp2_to_zero2_dp4": (CFG, ParallelConfig(MeshShape(dp=2, tp=2), zero_stage=3), 4,
                                  ParallelConfig(MeshShape(dp=4), zero_stage=2)),
    "zero2_dp2_tp2_to_fsdp_dp4": (CFG, ParallelConfig(MeshShape(dp=2, tp=2), zero_stage=2), 4,
                                  ParallelConfig(MeshShape(dp=4), zero_stage=3)),
    "ep2_dp2_to_ep4": (MOE, ParallelConfig(MeshShape(dp=4, ep=2)), 4, ParallelConfig(MeshShape(dp=4, ep=4))),
    "zero1_dp2_to_dp4": (CFG, ParallelConfig(MeshShape(dp=2), zero_stage=1), 2,
                         ParallelConfig(MeshShape(dp=4), zero_stage=1)),
}


def _local_names(composed: MC.Composed) -> dict[int, str]:
    """Mutation of ``checkpoint._names``: experts by their local index (rank r's expert 0 is
    ``experts.0`` on every ep rank), so the ranks' experts overwrite each other in the checkpoint."""
    return {id(p): n for n, p in composed.module.named_parameters()}


def _cut_in_reverse_order(composed: MC.Composed, p: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """Mutation of ``checkpoint._cut``: the nested cuts applied last first (FSDP's dim-0 shard of the whole
    tensor, then TP's rows of that): the same shape, other rows of m and v for a TP weight under FSDP."""
    like = torch.empty_like(p)
    for axis, where in reversed(list(placements_of(p).items())):
        set_placement(like, axis, where)
    return shard_like(full, like, composed.mesh)


class _FirstShard:
    """A ZeRO-2 unit that says every rank owns the first shard [0, S) of the flat buffer."""

    def __init__(self, unit: Any) -> None:
        self._unit = unit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._unit, name)

    def bounds(self) -> tuple[int, int]:
        return 0, self._unit.layout.shard_numel


_RESTORE_FLAT = MC._restore_flat


def _restore_first_shard(composed: MC.Composed, inner: torch.optim.Optimizer, unit: Any,
                         states: list[dict[str, torch.Tensor]]) -> None:
    """Mutation of ``checkpoint._restore_flat``: every rank's m and v taken from rank 0's range of the flat
    buffer (the shard's offset forgotten)."""
    _RESTORE_FLAT(composed, inner, _FirstShard(unit), states)


def _save(rank: int, world_size: int, folder: str, names: list[str]) -> dict[str, runs.ComposedResult]:
    out = {}
    for name in names:
        cfg, first, _, _ = ROUND_TRIPS[name]
        out[name] = runs.train_parallel(rank, world_size, cfg, TC4, first, checkpoint=runs.Checkpointing(
            save_to=f"{folder}/{name}", save_after=SAVE_AFTER))
    return out


def _suite4(rank: int, world_size: int, folder: str) -> dict[str, runs.ComposedResult]:
    out = {f"uninterrupted_{k}": v for k, v in
           _save(rank, world_size, folder, [n for n, t in ROUND_TRIPS.items() if t[2] == 4]).items()}
    _, first, _, _ = ROUND_TRIPS["ep2_dp2_to_ep4"]
    with mock.patch.object(MC, "_names", _local_names):
        runs.train_parallel(rank, world_size, MOE, TrainConfig(steps=SAVE_AFTER, global_batch=8), first,
                         checkpoint=runs.Checkpointing(save_to=f"{folder}/experts_by_local_index",
                                                    save_after=SAVE_AFTER))
    for name, (cfg, _, _, second) in ROUND_TRIPS.items():
        out[f"resumed_{name}"] = runs.train_parallel(rank, world_size, cfg, TC4, second, checkpoint=runs.Checkpointing(
            resume_from=f"{folder}/{name}"))
    try:  # every rank reads the same files and raises before any collective
        runs.train_parallel(rank, world_size, MOE, TC4, ROUND_TRIPS["ep2_dp2_to_ep4"][3],
                         checkpoint=runs.Checkpointing(resume_from=f"{folder}/experts_by_local_index"))
        out["experts_by_local_index"] = "resumed"
    except ValueError as e:
        out["experts_by_local_index"] = str(e)
    fsdp_tp = ROUND_TRIPS["zero3_dp4_to_fsdp_dp2_tp2"][3]
    with mock.patch.object(MC, "_cut", _cut_in_reverse_order):
        out["resumed_cut_in_reverse_order"] = runs.train_parallel(rank, world_size, CFG, TC4, fsdp_tp, checkpoint=(
            runs.Checkpointing(resume_from=f"{folder}/zero3_dp4_to_fsdp_dp2_tp2")))
    with mock.patch.object(MC, "_restore_flat", _restore_first_shard):
        out["resumed_flat_state_at_offset_0"] = runs.train_parallel(
            rank, world_size, CFG, TC4, ROUND_TRIPS["fsdp_dp2_tp2_to_zero2_dp4"][3],
            checkpoint=runs.Checkpointing(resume_from=f"{folder}/fsdp_dp2_tp2_to_zero2_dp4"))
    _drop_optimizer_state(Path(folder) / "zero3_dp4_to_fsdp_dp2_tp2", Path(folder) / "no_optimizer_state", rank)
    out["resumed_no_optimizer_state"] = runs.train_parallel(
        rank, world_size, CFG, TC4, ROUND_TRIPS["zero3_dp4_to_fsdp_dp2_tp2"][3],
        checkpoint=runs.Checkpointing(resume_from=f"{folder}/no_optimizer_state"))
    return out


def _drop_optimizer_state(src: Path, dst: Path, rank: int) -> None:
    """Mutation: the same checkpoint with every parameter's optimizer state emptied (AdamW starts afresh)."""
    import torch.distributed as dist

    if rank == 0:
        dst.mkdir(exist_ok=True)
        (dst / "meta.json").write_text((src / "meta.json").read_text())
        for f in src.glob("stage*.pt"):
            part = torch.load(f, weights_only=True)
            part["optimizer"] = {n: {} for n in part["optimizer"]}
            torch.save(part, dst / f.name)
    dist.barrier()


@functools.cache
def _folder() -> str:
    return tempfile.mkdtemp(prefix="ckpt-meshes-")


@functools.cache
def _results() -> dict[str, TrainResult]:
    two = launch(_save, 2, _folder(), [n for n, t in ROUND_TRIPS.items() if t[2] == 2], timeout=LAUNCH_TIMEOUT)
    four = launch(_suite4, 4, _folder(), timeout=LAUNCH_TIMEOUT)
    out = {f"uninterrupted_{k}": runs.merge_composed([r[k] for r in two]) for k in two[0]}
    return out | {k: (runs.merge_composed([r[k] for r in four]) if k.startswith(("resumed", "uninterrupted"))
                      else four[0][k]) for k in four[0]}


@functools.cache
def _reference(cfg: GPTConfig) -> TrainResult:
    return train_baseline(cfg, TC4)


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_resumed_on_another_mesh_equals_the_uninterrupted_run(name: str) -> None:
    cfg = ROUND_TRIPS[name][0]
    ref = _reference(cfg)
    resumed, uninterrupted = _results()[f"resumed_{name}"], _results()[f"uninterrupted_{name}"]
    report = compare(uninterrupted.from_step(SAVE_AFTER), resumed, noise=ref.noise)
    assert report.ok, f"{name}: resumed vs uninterrupted: {report}"
    assert compare(ref.from_step(SAVE_AFTER), resumed).ok, f"{name}: resumed vs one process"


@pytest.mark.parity
@pytest.mark.parametrize("mutation, name", [("no_optimizer_state", "zero3_dp4_to_fsdp_dp2_tp2"),
                                            ("cut_in_reverse_order", "zero3_dp4_to_fsdp_dp2_tp2"),
                                            ("flat_state_at_offset_0", "fsdp_dp2_tp2_to_zero2_dp4")])
def test_a_broken_checkpoint_does_not_resume_the_run(mutation: str, name: str) -> None:
    ref = _reference(ROUND_TRIPS[name][0])
    report = compare(_results()[f"uninterrupted_{name}"].from_step(SAVE_AFTER), _results()[f"resumed_{mutation}"],
                     noise=ref.noise)
    assert not report.ok, f"{mutation}: the broken checkpoint still resumes the run"


@pytest.mark.slow  # reads the module's 4-rank launch: make test, not make test-fast
def test_experts_saved_by_local_index_are_missing_on_resume() -> None:
    """Mutation: experts named by their local index collide (ep rank 1's expert 0 overwrites rank 0's), so the
    checkpoint lacks experts 2 and 3 and the resume says which."""
    message = _results()["experts_by_local_index"]
    assert "the checkpoint has no" in message and "experts.2" in message, message
