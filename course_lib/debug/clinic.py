"""The clinic: broken runs on real ranks, each a bug class of production trackers, and each one's fix.

Every case is a library run (``runs.train_dp``, ``train_tp``, ``train_parallel``) with one piece swapped for a
broken one, passed explicitly as the library's seams take it: a ``DataParallel`` subclass, a pipeline executor, a
TP plan entry, a compose step, a model function, a data sampler. ``Case.run()`` launches it with the instruments
that show its symptom (``watch``); ``Case.run(fixed=True)`` the same run with the piece put right; ``answer`` is
what a correct diagnosis says (the bug class, the ranks whose code or state is wrong, the first step it shows,
the collective, parameter or module). The factories take the ranks and steps as arguments, so the grader can hide
variants the chapter never ran. Chapter 11 shows each case by its symptom first and the swapped piece last.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.data import global_batch, shard
from course_lib.debug.checksums import BEFORE_TRAINING
from course_lib.debug.drift import Drift, drift_test, noise_runs
from course_lib.debug.watch import Instruments, Watched, run
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.parallel import compose as C
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.dp import DataParallel
from course_lib.parallel.placement_ops import full_parameters
from course_lib.parallel.pp_executor import PipelineExecutor
from course_lib.parallel.runs import Checkpointing, merge_composed, train_dp, train_parallel, train_tp
from course_lib.parallel.tp import gpt_plan
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import MeshShape
from course_lib.train import TrainConfig, TrainResult, train_baseline, train_single

CFG = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, bias=False)
"""The clinic's model: small enough that a 4-rank run of a few steps takes about a second."""
TC = TrainConfig(steps=3, global_batch=8)
SGD = replace(TC, optimizer="sgd", lr=0.05)
"""For a bug that scales gradients: AdamW divides the scale away, SGD shows it (chapter 05's lesson)."""
DP_TP = MeshShape(dp=2, tp=2)
DP_PP = MeshShape(dp=2, pp=2)
IGNORE = -100
"""The target id the loss skips (``F.cross_entropy``'s ``ignore_index``): padding."""

HANG, WRONG_GROUP, PARTIAL_NOT_SUMMED, ACCUMULATION, DROPOUT_RNG = (
    "collective on one rank only", "reduction over the wrong group", "partial gradient not summed",
    "gradient accumulation scaled wrong", "RNG not synchronised")
SAME_DATA, NO_BROADCAST, NO_BUG, SKIPPED_BATCH, NON_FINITE = (
    "every rank sees the same data", "replicas start from different weights", "no bug", "resume skipped a batch",
    "non-finite loss")
BUGS = (HANG, WRONG_GROUP, PARTIAL_NOT_SUMMED, ACCUMULATION, DROPOUT_RNG, SAME_DATA, NO_BROADCAST, NO_BUG,
        SKIPPED_BATCH, NON_FINITE)
"""The bug classes a diagnosis names (``NO_BUG``: the difference is noise)."""


@dataclass(frozen=True)
class Diagnosis:
    """What went wrong: the ``bug`` (one of ``BUGS``), the ``ranks`` whose code or state is wrong (every rank when
    all run the same wrong code; () for no bug), the first ``step`` the instruments show it (``BEFORE_TRAINING``:
    -1; None when no step applies) and ``where``: the first diverging collective ("all_gather #34 on tp"), the
    first parameter whose copies differ, or the module of the first non-finite value (None when none applies)."""

    bug: str
    ranks: tuple[int, ...] = ()
    step: int | None = None
    where: str | None = None


# -------------------------------------------------------------------------------------------- the broken pieces


class SnapshotDP(DataParallel):
    """Data parallelism that also gathers the whole weights after step ``after`` -- on every rank, or (the bug) on
    ``only_rank``: ``full_parameters`` is a collective over tp, and the other ranks went on to the next step."""

    def __init__(self, module: nn.Module, *, after: int, only_rank: int | None = None, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self.after, self.only_rank, self.done, self.snapshot = after, only_rank, 0, None

    def after_step(self) -> None:
        super().after_step()
        if self.done == self.after and self.only_rank in (None, dist.get_rank()):
            self.snapshot = full_parameters(self.module, self.groups)
        self.done += 1


def snapshot_step(run_: C.Parallelized, *, after: int, only_rank: int | None = None) -> None:
    """The data-parallel compose step with ``SnapshotDP``."""
    run_.dp = SnapshotDP(run_.module, mesh=run_.mesh, mode="bucketed", after=after, only_rank=only_rank)


class EveryRankDP(DataParallel):
    """The bug: each bucket is all-reduced over every rank instead of the data-parallel group it was given."""

    def all_reduce(self, tensor: torch.Tensor, group: Any, async_op: bool) -> Any:
        return super().all_reduce(tensor, None, async_op)


def every_rank_step(run_: C.Parallelized) -> None:
    """The data-parallel compose step with ``EveryRankDP``."""
    run_.dp = EveryRankDP(run_.module, mesh=run_.mesh, mode="bucketed")


def replicated_norm(m: nn.Module, group: Any, sp: bool) -> None:
    """The bug: a TP plan style for norms that keeps them whole but records no ``Partial()`` under sequence
    parallelism, so their gradients (each rank's s/t tokens) are never summed over tp."""
    return None


class TwiceScaled(PipelineExecutor):
    """The bug: each micro-batch's loss divided by m twice (the loop and the executor both averaging)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return super().scale_loss(loss) / self.plan.m


class Unscaled(PipelineExecutor):
    """The bug: each micro-batch's loss not divided by m (the m backwards sum to m times the gradient)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


class DropoutGPT(GPT):
    """The GPT with dropout ``P`` on the embeddings, its mask drawn in fp32 from the global generator whatever the
    dtype (so the fp64 twin of the baseline draws the same masks)."""

    P = 0.1

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        if self.training:
            keep = torch.rand(x.shape, device=x.device) >= self.P
            x = x * keep.to(x.dtype) / (1 - self.P)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dropout_model(cfg: GPTConfig, seed: int, *, by_rank: bool = False) -> nn.Module:
    """``DropoutGPT`` with the global generator seeded by ``seed`` -- plus the rank (the bug) when ``by_rank``:
    tensor-parallel ranks then drop different elements of the same replicated activation."""
    torch.manual_seed(seed + (dist.get_rank() if by_rank and dist.is_initialized() else 0))
    return DropoutGPT(cfg, seed)


def masked_mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the non-padding targets, divided by their count, written out by hand (as many
    training scripts do): with no target at all it is 0 / 0, and so is its gradient."""
    mask = targets != IGNORE
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).clamp(min=0),
                                reduction="none")
    return (per_token * mask.reshape(-1)).sum() / mask.sum()


class MaskedMeanDP(DataParallel):
    """Data parallelism with ``masked_mean_loss`` as the loss."""

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return masked_mean_loss(logits, targets)


def rank_seeded_model(cfg: GPTConfig, seed: int, *, ranks: tuple[int, ...] = ()) -> nn.Module:
    """The GPT initialised from ``seed`` -- or from ``seed`` + rank on ``ranks`` (each process its own seed)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return GPT(cfg, seed + rank if rank in ranks else seed)


def bf16_model(cfg: GPTConfig, seed: int) -> nn.Module:
    """The GPT in bfloat16 (weights, gradients and their all-reduce)."""
    return GPT(cfg, seed).to(torch.bfloat16)


@dataclass(frozen=True)
class Sampler:
    """A rank's rows of each step: its slice of ``global_batch`` (``loop.Sampler``) -- or, with a bug:
    ``same_rows``: every rank draws rows/N rows from the same generator; ``skip_from``: from that step on, the
    next step's batch (a loader restored one batch ahead); ``empty``: (rank, step) whose targets are all padding."""

    rows: int
    seq_len: int
    seed: int = 0
    same_rows: bool = False
    skip_from: int | None = None
    empty: tuple[int, int] | None = None

    def __call__(self, step: int, data_rank: int, data_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        drawn = step + 1 if self.skip_from is not None and step >= self.skip_from else step
        if self.same_rows:
            x, y = global_batch(drawn, self.rows // data_size, self.seq_len, self.seed)
        else:
            x, y = (shard(t, data_rank, data_size) for t in global_batch(drawn, self.rows, self.seq_len, self.seed))
        if self.empty == (data_rank, step):
            y = torch.full_like(y, IGNORE)
        return x, y


# ------------------------------------------------------------------------------------------------------ cases


def composed(shape: MeshShape, *, data_parallel: Any, tc: TrainConfig = TC, microbatches: int = 4,
             executor: Any = None, sampler: Any = None) -> Callable[..., Any]:
    """A composed run on ``shape`` (``runs.train_parallel``) built from its parts: the data-parallel compose step,
    the pipeline's executor class (None: the library's), the data sampler."""
    steps = C.with_step(C.STEPS, C.data_parallel, data_parallel)
    if executor is not None:
        steps = C.with_step(steps, C.pipeline_parallel, functools.partial(C.pipeline_parallel, executor=executor))
    return functools.partial(train_parallel, cfg=CFG, tc=tc, parallel=ParallelConfig(shape, microbatches=microbatches),
                             steps=steps, sampler=sampler)


def data_parallel_run(*, data_parallel: Any, model_fn: Any, sampler: Any) -> Callable[..., Any]:
    """A data-parallel run (``runs.train_dp``) built from its parts: the form, the model function, the sampler."""
    return functools.partial(train_dp, cfg=CFG, tc=TC, data_parallel=data_parallel, model_fn=model_fn,
                             sampler=sampler)


def tensor_parallel_run(*, plan: Any, model_fn: Any, sequence_parallel: bool = False) -> Callable[..., Any]:
    """A tensor-parallel run (``runs.train_tp``) built from its parts: the TP plan and the model function."""
    return functools.partial(train_tp, cfg=CFG, tc=TC, sequence_parallel=sequence_parallel, plan=plan,
                             model_fn=model_fn)


@dataclass(frozen=True)
class Case:
    """One broken run: ``build(**parts)`` is its launch target on the ranks of ``shape``, one of its ``parts`` is
    broken and ``repair`` holds it put right (empty: nothing is wrong); the ``instruments`` that show its symptom;
    the ``answer``; and what the chapter says of it (``symptom``, ``fix``). ``resume_at``: the run is resumed from
    a checkpoint written after that many steps. ``with_parts`` swaps pieces (a fix, or a variant)."""

    key: str
    symptom: str
    fix: str
    shape: MeshShape
    build: Callable[..., Callable[..., Any]]
    parts: dict[str, Any]
    repair: dict[str, Any]
    instruments: Instruments
    answer: Diagnosis | None
    tc: TrainConfig = TC
    dtype: torch.dtype = torch.float32
    model_fn: Callable[[GPTConfig, int], nn.Module] = GPT
    composed: bool = False
    resume_at: int | None = None
    timeout: float = 60.0

    @property
    def target(self) -> Callable[..., Any]:
        return self.build(**self.parts)

    @property
    def fixed(self) -> Callable[..., Any]:
        return self.build(**(self.parts | self.repair))

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    def with_parts(self, **parts: Any) -> Case:
        """The same run with some of its parts replaced (unknown names refused)."""
        unknown = sorted(set(parts) - set(self.parts))
        if unknown:
            raise KeyError(f"{self.key} has no part {unknown}; its parts are {sorted(self.parts)}")
        return replace(self, parts=self.parts | parts)

    def suspect(self) -> Case:
        """The case as a learner gets it: the run and its parts, without its name, answer, repair, symptom and the
        instruments chosen for it (the recorder only: choose the others)."""
        return replace(self, key="suspect", repair={}, answer=None, fix="", symptom="", instruments=Instruments())

    def run(self, fixed: bool = False, instruments: Instruments | None = None) -> Watched:
        """Launch the broken run (or the fixed one) with the instruments; a hang comes back as a report."""
        fn, ins = (self.fixed if fixed else self.target), instruments or self.instruments
        if self.resume_at is None:
            return run(fn, self.world_size, instruments=ins, timeout=self.timeout)
        with tempfile.TemporaryDirectory() as folder:
            first = functools.partial(fn, tc=replace(self.tc, steps=self.resume_at),
                                      checkpoint=Checkpointing(save_to=folder, save_after=self.resume_at))
            launch(first, self.world_size, timeout=self.timeout)
            return run(fn, self.world_size, instruments=ins, timeout=self.timeout,
                       checkpoint=Checkpointing(resume_from=folder))

    def result(self, watched: Watched) -> TrainResult:
        """The run's losses and whole weights as one ``TrainResult`` (compare with ``train_baseline``)."""
        results = watched.results
        merged = merge_composed(results) if self.composed else results[0]
        return TrainResult(list(merged.losses), merged.params)

    def baseline(self) -> TrainResult:
        """One process, in fp32 with its fp32 noise (``train_baseline``), from ``resume_at`` on."""
        return train_baseline(CFG, self.tc, self.model_fn).from_step(self.resume_at or 0)

    def drift(self, watched: Watched) -> tuple[TrainResult, TrainResult, Drift]:
        """(one process, this run, the drift test): the single-process run in the run's dtype, and again in other
        reduction orders and in float64 for the noise (from ``resume_at`` on for a resumed run)."""
        start = self.resume_at or 0
        ref = train_single(CFG, self.tc, self.model_fn, dtype=self.dtype).from_step(start)
        others = [r.from_step(start) for r in noise_runs(CFG, self.tc, dtype=self.dtype, model_fn=self.model_fn)]
        got = self.result(watched)
        return ref, got, drift_test(ref, got, others, start=start)


def hang(only_rank: int = 0, after: int = 1, shape: MeshShape = DP_TP) -> Case:
    """A rank gathers the weights for a snapshot that its tp peers do not take: they hang in the next step."""
    broken = functools.partial(snapshot_step, after=after, only_rank=only_rank)
    return Case("hang", "the run stops making progress: no error, no output, every rank waiting",
                "every rank takes part in the gather (rank 0 alone keeps the snapshot)", shape,
                functools.partial(composed, shape), {"data_parallel": broken},
                {"data_parallel": functools.partial(snapshot_step, after=after)},
                Instruments(stall_s=2.0, torch_recorder=True), Diagnosis(HANG, (only_rank,), after, "all_gather on tp"),
                composed=True, timeout=10.0)


def wrong_group(shape: MeshShape = DP_TP) -> Case:
    """Gradients all-reduced over every rank instead of the data-parallel group."""
    return Case("wrong_group", "replicas agree with each other, but the loss leaves one process's curve",
                "all-reduce each bucket over the group it was given (the data-parallel group)", shape,
                functools.partial(composed, shape), {"data_parallel": every_rank_step},
                {"data_parallel": C.data_parallel}, Instruments(checksums=shape),
                Diagnosis(WRONG_GROUP, tuple(range(shape.world_size)), 1), composed=True)


def partial_not_summed(tp: int = 2) -> Case:
    """Under TP + SP the norms' gradients are partial sums that nobody sums over tp."""
    plan = gpt_plan(CFG) | {"blocks.*.norm1": replicated_norm, "blocks.*.norm2": replicated_norm,
                            "norm_f": replicated_norm}
    return Case("partial_not_summed", "the copies of a replicated weight disagree across tp ranks",
                "record the norms Partial() on tp (the 'sequence' style), so data parallelism sums them",
                MeshShape(tp=tp),
                functools.partial(tensor_parallel_run, sequence_parallel=True), {"plan": plan, "model_fn": None},
                {"plan": None}, Instruments(checksums=MeshShape(tp=tp)),
                Diagnosis(PARTIAL_NOT_SUMMED, tuple(range(tp)), 0, "blocks.0.norm1.weight"))


SCALINGS = {"twice": TwiceScaled, "none": Unscaled}


def accumulation(scaled: str = "twice", shape: MeshShape = DP_PP, microbatches: int = 2) -> Case:
    """Under DP x PP each micro-batch's loss scaled twice or not at all (``SCALINGS``)."""
    return Case("accumulation", "replicas agree, but with SGD the loss leaves one process's curve from step 1",
                "divide each micro-batch's loss by m once (the executor's scale_loss)", shape,
                functools.partial(composed, shape, data_parallel=C.data_parallel, tc=SGD, microbatches=microbatches),
                {"executor": SCALINGS[scaled]}, {"executor": PipelineExecutor},
                Instruments(checksums=shape), Diagnosis(ACCUMULATION, tuple(range(shape.world_size)), 1), tc=SGD,
                composed=True)


def dropout_rng(tp: int = 2) -> Case:
    """Each tensor-parallel rank seeds its dropout with its own rank."""
    return Case("dropout_rng", "the copies of a replicated weight disagree across tp ranks after the first step",
                "seed the generator that draws the replicated region's dropout alike on every tp rank",
                MeshShape(tp=tp),
                tensor_parallel_run, {"plan": None, "model_fn": functools.partial(dropout_model, by_rank=True)},
                {"model_fn": dropout_model}, Instruments(checksums=MeshShape(tp=tp)),
                Diagnosis(DROPOUT_RNG, tuple(range(1, tp)), 0, "pos_emb.weight"), model_fn=dropout_model)


def same_data(world_size: int = 2) -> Case:
    """Every rank draws its rows from the same generator: the data-parallel ranks train on the same rows."""
    return Case("same_data", "the loss falls, replicas agree, the curve leaves one process's",
                "deal each rank its own slice of the global batch (DistributedSampler's rank and num_replicas)",
                MeshShape(dp=world_size), data_parallel_run,
                {"data_parallel": DataParallel, "model_fn": None, "sampler": _sampler(same_rows=True)},
                {"sampler": _sampler()}, Instruments(checksums=MeshShape(dp=world_size), batches=True),
                Diagnosis(SAME_DATA, tuple(range(world_size)), 0))


def no_broadcast(world_size: int = 2, ranks: tuple[int, ...] = (1,)) -> Case:
    """Ranks ``ranks`` initialise from their own seed and the initial broadcast was turned off."""
    return Case("no_broadcast", "the replicas' weights differ from the start",
                "broadcast the first replica's weights to the others before training (DataParallel's broadcast)",
                MeshShape(dp=world_size), data_parallel_run,
                {"data_parallel": functools.partial(DataParallel, broadcast=False),
                 "model_fn": functools.partial(rank_seeded_model, ranks=ranks), "sampler": None},
                {"data_parallel": DataParallel}, Instruments(checksums=MeshShape(dp=world_size)),
                Diagnosis(NO_BROADCAST, ranks, BEFORE_TRAINING, "tok_emb.weight"))


def bf16_noise(world_size: int = 2) -> Case:
    """A bf16 run on ranks: its gradients are summed in another order than on one process. Not a bug."""
    return Case("bf16_noise", "fails parity with one process by the fp32 rule, by far",
                "none: measure the noise in the run's own precision", MeshShape(dp=world_size), data_parallel_run,
                {"data_parallel": DataParallel, "model_fn": bf16_model, "sampler": None}, {},
                Instruments(checksums=MeshShape(dp=world_size)), Diagnosis(NO_BUG), dtype=torch.bfloat16,
                model_fn=bf16_model)


def skipped_batch(at: int = 1, world_size: int = 2) -> Case:
    """Resumed from a checkpoint written after ``at`` steps, the data loader starts one batch ahead."""
    return Case("skipped_batch", "after a restart the loss leaves the uninterrupted run's curve",
                "restore the loader at the first batch the checkpoint has not trained on", MeshShape(dp=world_size),
                functools.partial(composed, MeshShape(dp=world_size), data_parallel=C.data_parallel),
                {"sampler": _sampler(skip_from=at)}, {"sampler": _sampler()},
                Instruments(checksums=MeshShape(dp=world_size), batches=True),
                Diagnosis(SKIPPED_BATCH, tuple(range(world_size)), at), composed=True, resume_at=at)


def non_finite(rank: int = 1, step: int = 2, world_size: int = 2) -> Case:
    """Rank ``rank``'s batch of step ``step`` is all padding: its hand-written mean loss is 0/0."""
    return Case("non_finite", "the loss turns NaN on every rank at once",
                "never hand a rank a batch without targets (or divide by the global token count)",
                MeshShape(dp=world_size),
                data_parallel_run,
                {"data_parallel": MaskedMeanDP, "model_fn": None, "sampler": _sampler(empty=(rank, step))},
                {"sampler": _sampler()}, Instruments(nonfinite=True), Diagnosis(NON_FINITE, (rank,), step, "lm_head"))


def _sampler(**bug: Any) -> Sampler:
    return Sampler(TC.global_batch, CFG.seq_len, TC.seed, **bug)


CASES: dict[str, Callable[[], Case]] = {
    "hang": hang, "wrong_group": wrong_group, "partial_not_summed": partial_not_summed,
    "accumulation": accumulation, "dropout_rng": dropout_rng, "same_data": same_data,
    "no_broadcast": no_broadcast, "bf16_noise": bf16_noise, "skipped_batch": skipped_batch,
    "non_finite": non_finite}
"""Each case of the chapter, by key, with its default arguments."""
