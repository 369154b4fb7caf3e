"""Checkpoints of expert-parallel runs under ZeRO-1 (``checkpoint``'s whole format with ``Parallelized.make_optimizer``:
the dense AdamW state partitioned over dp x cp, the experts' over edp), saved at one mesh and resumed at another.

The checkpoint holds every expert's parameters and AdamW state whole, by its global index, so a run saved at
EP 2 x edp 2 resumes at EP 4, under TP, CP or a pipeline, on 2 ranks or on one process. Each saving run trains 4
steps and writes after step 2 (so it *is* the uninterrupted run); the resumed run trains steps 3-4 on its mesh.
Equality: on the mesh that saved, every parameter bit-for-bit (the same reductions in the same order, so nothing
may differ; the reported losses only within the tolerance below: their mean over the ranks is one all-reduce of
every step's losses at once, and gloo at 4 ranks sums a 2-step tensor in another order than a 4-step one (the
same values differ in their last bits, checked by hand) -- seen: one ulp,
5.4538646 vs 5.4538651 at dp 4 x ep 2, with equal parameters, with or without ZeRO-1); on another mesh,
``compare`` with the fp32 noise of ``train_baseline`` (other reduction orders: the all-reduce over another group,
the pipeline's two micro-batches), and the resumed run against one process too. The model
routes dropless with the z-loss only, so a pipeline's micro-batches train the objective of the whole batch.

Mutations: an expert's state written under the next expert's index resumes another run; the experts' states
written only by the first edp replica (their partition over edp not gathered, as for replicated experts) leaves
the other owners' states out, and the resume names them. An optimizer whose state keys are not known (Adam in
``make_optimizer``'s per-data-group optimizers) is refused before anything is written.

Launches: 2 ranks (a save, the refusal), 4 ranks (the saves and resumes), 2 ranks again and one process (resumes
of the 4-rank save); the tests read the cached results.
"""

from __future__ import annotations

import functools
import re
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from course_lib.model import GPTConfig
from course_lib.parallel import checkpoint, runs
from course_lib.parallel import checkpoint as MC
from course_lib.parallel import compose as C
from course_lib.parallel import dp_reduce as R
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.loop import build_model
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import MeshShape
from course_lib.train import TrainConfig, TrainResult, compare, train_baseline

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

MOE = GPTConfig(bias=False, n_layer=2, d_model=32, n_head=2, seq_len=16, n_expert=4, top_k=2, z_loss_coef=0.01)
TC4 = TrainConfig(steps=4, global_batch=8, optimizer="adamw")
SAVE_AFTER = 2
LAUNCH_TIMEOUT = 600

SAVES = {  # name: (world size, mesh that trains 4 steps and saves after 2)
    "ep2_edp2_zero1": (4, ParallelConfig(MeshShape(dp=4, ep=2), zero_stage=1)),  # both partitions real
    "pp2_ep2_zero1": (4, ParallelConfig(MeshShape(dp=2, pp=2, ep=2), zero_stage=1)),  # edp 1: experts' plain AdamW
    "tp2_ep2_zero1": (4, ParallelConfig(MeshShape(dp=2, tp=2, ep=2), zero_stage=1)),
    "cp2_ep2_zero1": (4, ParallelConfig(MeshShape(dp=2, cp=2, ep=2), zero_stage=1)),  # the ep pairs are cp pairs
    "ep2_zero1_2ranks": (2, ParallelConfig(MeshShape(dp=2, ep=2), zero_stage=1)),
}

RESUMES = {  # name: (the save it reads, world size, mesh that resumes for the last 2 steps)
    "ep2_edp2_zero1_same_mesh": ("ep2_edp2_zero1", 4, ParallelConfig(MeshShape(dp=4, ep=2), zero_stage=1)),
    "ep2_edp2_zero1_to_ep4_zero1": ("ep2_edp2_zero1", 4, ParallelConfig(MeshShape(dp=4, ep=4), zero_stage=1)),
    "ep2_edp2_zero1_to_tp2_ep2_zero1": ("ep2_edp2_zero1", 4,
                                        ParallelConfig(MeshShape(dp=2, tp=2, ep=2), zero_stage=1)),
    "pp2_ep2_zero1_to_ep2_edp2_zero1": ("pp2_ep2_zero1", 4, ParallelConfig(MeshShape(dp=4, ep=2), zero_stage=1)),
    "tp2_ep2_zero1_to_pp2_ep2": ("tp2_ep2_zero1", 4, ParallelConfig(MeshShape(dp=2, pp=2, ep=2))),
    "cp2_ep2_zero1_to_ep4_zero1": ("cp2_ep2_zero1", 4, ParallelConfig(MeshShape(dp=4, ep=4), zero_stage=1)),
    "2ranks_to_ep2_edp2_zero1": ("ep2_zero1_2ranks", 4, ParallelConfig(MeshShape(dp=4, ep=2), zero_stage=1)),
    "ep2_edp2_zero1_to_2ranks": ("ep2_edp2_zero1", 2, ParallelConfig(MeshShape(dp=2, ep=2), zero_stage=1)),
    "ep2_edp2_zero1_to_one_process": ("ep2_edp2_zero1", 1, ParallelConfig()),
}

EXPERT = re.compile(r"(\.experts\.)(\d+)\.")


def _next_expert(name: str) -> str:
    """``...experts.<e>.w`` -> ``...experts.<(e + 1) mod E>.w``; other names unchanged."""
    return EXPERT.sub(lambda m: f"{m[1]}{(int(m[2]) + 1) % MOE.n_expert}.", name)


def _shift_expert_states(src: Path, dst: Path, rank: int) -> None:
    """Mutation: the checkpoint ``src`` with each expert's optimizer state under the next expert's index (its
    parameters where they were)."""
    if rank == 0:
        dst.mkdir(exist_ok=True)
        (dst / "meta.json").write_text((src / "meta.json").read_text())
        for f in src.glob("stage*.pt"):
            part = torch.load(f, weights_only=True)
            part["optimizer"] = {_next_expert(n): s for n, s in part["optimizer"].items()}
            torch.save(part, dst / f.name)
    dist.barrier()


_STEPPERS = MC._steppers


def _experts_not_partitioned(optimizer: torch.optim.Optimizer) -> dict[int, tuple[Any, bool, bool]]:
    """Mutation of ``checkpoint._steppers``: the experts' state read as if replicated over edp, so only the
    first edp replica (a writer) writes it and the other owners' states are dropped."""
    experts = {id(p) for part in getattr(optimizer, "parts", ()) for p in getattr(part, "params", ())
               if R.data_axis(p) == R.EXPERT_DATA}
    return {k: (o, owns, part and k not in experts) for k, (o, owns, part) in _STEPPERS(optimizer).items()}


def _run(rank: int, world_size: int, folder: str, name: str, *, save: bool) -> runs.ComposedResult:
    if save:
        return runs.train_parallel(rank, world_size, MOE, TC4, SAVES[name][1], checkpoint=runs.Checkpointing(
            save_to=f"{folder}/{name}", save_after=SAVE_AFTER))
    source, _, parallel = RESUMES[name]
    return runs.train_parallel(rank, world_size, MOE, TC4, parallel, checkpoint=runs.Checkpointing(
        resume_from=f"{folder}/{source}"))


def _refused(rank: int, world_size: int, folder: str) -> str:
    """Adam (not AdamW) in ZeRO-1's optimizers (one per data group): ``save_whole`` refuses it and says why."""
    parallel = ParallelConfig(MeshShape(dp=2, ep=2), zero_stage=1)
    mesh = parallel.mesh()
    composed = C.parallelize(build_model(MOE, TC4.seed), mesh, parallel, global_batch=TC4.global_batch)
    optimizer = composed.make_optimizer(torch.optim.Adam, lr=1e-3)
    try:
        checkpoint.save_whole(composed, optimizer, 0, f"{folder}/adam")
    except ValueError as e:
        return str(e)
    return "saved"


def _first2(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    return {"ep2_zero1_2ranks": _run(rank, world_size, folder, "ep2_zero1_2ranks", save=True),
            "refused": _refused(rank, world_size, folder)}


def _four(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {n: _run(rank, world_size, folder, n, save=True) for n, (w, _) in SAVES.items() if w == 4}
    out |= {n: _run(rank, world_size, folder, n, save=False) for n, (_, w, _) in RESUMES.items() if w == 4}
    _shift_expert_states(Path(folder) / "ep2_edp2_zero1", Path(folder) / "shifted", rank)
    out["expert_state_under_next_index"] = runs.train_parallel(
        rank, world_size, MOE, TC4, SAVES["ep2_edp2_zero1"][1], checkpoint=runs.Checkpointing(
            resume_from=f"{folder}/shifted"))
    with mock.patch.object(MC, "_steppers", _experts_not_partitioned):
        runs.train_parallel(rank, world_size, MOE, TrainConfig(steps=SAVE_AFTER, global_batch=8, optimizer="adamw"),
                         SAVES["ep2_edp2_zero1"][1], checkpoint=runs.Checkpointing(
                             save_to=f"{folder}/not_partitioned", save_after=SAVE_AFTER))
    return out


def _resume_small(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {n: _run(rank, world_size, folder, n, save=False) for n, (_, w, _) in RESUMES.items()
                           if w == world_size}
    if world_size == 1:  # one process steps every parameter: the missing states are named here
        try:
            runs.train_parallel(rank, world_size, MOE, TC4, ParallelConfig(), checkpoint=runs.Checkpointing(
                resume_from=f"{folder}/not_partitioned"))
            out["not_partitioned"] = "resumed"
        except ValueError as e:
            out["not_partitioned"] = str(e)
    return out


@functools.cache
def _results() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ckpt-ep-") as folder:
        first = launch(_first2, 2, folder, timeout=LAUNCH_TIMEOUT)
        four = launch(_four, 4, folder, timeout=LAUNCH_TIMEOUT)
        two = launch(_resume_small, 2, folder, timeout=LAUNCH_TIMEOUT)
        one = launch(_resume_small, 1, folder, timeout=LAUNCH_TIMEOUT)
    out: dict[str, Any] = {"refused": [r["refused"] for r in first], "not_partitioned": one[0]["not_partitioned"]}
    for per_rank in (first, four, two, one):
        out |= {k: runs.merge_composed([r[k] for r in per_rank]) for k, v in per_rank[0].items()
                if isinstance(v, runs.ComposedResult)}
    return out


@functools.cache
def _reference() -> TrainResult:
    return train_baseline(MOE, TC4)


def _unequal(a: TrainResult, b: TrainResult) -> list[str]:
    """The parameters of ``a`` and ``b`` that are not bit-for-bit equal (or not in both)."""
    return sorted(set(a.params) ^ set(b.params)) + [n for n in a.params if n in b.params
                                                     and not torch.equal(a.params[n], b.params[n])]


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(SAVES))
def test_the_saving_run_matches_one_process(name: str) -> None:
    report = compare(_reference(), _results()[name])
    assert report.ok, f"{name}: {report}"


@pytest.mark.parity
def test_resumed_on_the_mesh_that_saved_has_the_uninterrupted_parameters_bit_for_bit() -> None:
    source, _, _ = RESUMES["ep2_edp2_zero1_same_mesh"]
    uninterrupted, resumed = _results()[source].from_step(SAVE_AFTER), _results()["ep2_edp2_zero1_same_mesh"]
    assert not _unequal(uninterrupted, resumed), _unequal(uninterrupted, resumed)
    assert compare(uninterrupted, resumed, noise=_reference().noise).ok


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(RESUMES))
def test_resumed_on_another_mesh_equals_the_uninterrupted_run(name: str) -> None:
    ref, resumed = _reference(), _results()[name]
    uninterrupted = _results()[RESUMES[name][0]].from_step(SAVE_AFTER)
    report = compare(uninterrupted, resumed, noise=ref.noise)
    assert report.ok, f"{name}: resumed vs uninterrupted: {report}"
    assert compare(ref.from_step(SAVE_AFTER), resumed).ok, f"{name}: resumed vs one process"


@pytest.mark.parity
def test_an_expert_state_under_the_wrong_index_does_not_resume_the_run() -> None:
    uninterrupted = _results()["ep2_edp2_zero1"].from_step(SAVE_AFTER)
    report = compare(uninterrupted, _results()["expert_state_under_next_index"], noise=_reference().noise)
    assert not report.ok, "the experts' states under shifted indices still resume the run"


@pytest.mark.slow  # reads the module's 4-rank launch: make test, not make test-fast
def test_expert_states_not_gathered_over_edp_are_named_on_resume() -> None:
    message = _results()["not_partitioned"]
    assert "the checkpoint has no optimizer state for" in message and ".experts." in message, message


@pytest.mark.slow  # reads the module's 4-rank launch: make test, not make test-fast
def test_an_optimizer_with_unknown_state_keys_is_refused() -> None:
    for message in _results()["refused"]:
        assert "save_whole takes AdamW or SGD" in message and "Adam in Optimizers" in message, message
