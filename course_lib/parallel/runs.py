"""Launch targets: train with one form or a composed mesh on real ranks, and what each rank returns.

Each ``train_xx(rank, world_size, cfg, tc, ...)`` builds the single-process model from ``tc.seed``,
applies the form (``launch(train_dp, 4, cfg, tc)``), runs the one training loop
(``loop.train_loop``) and returns a ``TrainResult`` (the global-batch mean loss per step, the whole
parameters by name) with what the chapter measures: comm records per step, timelines, memory peaks,
routing statistics. ``train_parallel`` takes a ``ParallelConfig`` and runs ``compose.parallelize``;
the single-axis runs are the same composition on a mesh of one axis, or a form the chapter builds
(``DataParallel``, ``ZeroDataParallel``, ``PipelineParallel``). Compare with
``course_lib.train.train_baseline`` (``assert_parity``); ``merge_composed`` / ``merge_results`` join
the ranks' results where each holds part of the parameters.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from course_lib import comm
from course_lib.model import lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel import compose as C
from course_lib.parallel.checkpoint import (
    load_parameters,
    load_sharded,
    load_whole,
    restore_optimizer,
    save_sharded,
    save_whole,
)
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.contract import HasGroups, LossFn, ParallelWrapper
from course_lib.parallel.cp_attention import BlockAttention, Layout
from course_lib.parallel.dp import DEFAULT_BUCKET_MB, DataParallel, Mode
from course_lib.parallel.dp_reduce import sum_partials
from course_lib.parallel.ep import EPRoutingStats, ExpertParallelMoE
from course_lib.parallel.loop import ModelFn, Sampler, StepTime, build_model, train_loop
from course_lib.parallel.placement_ops import clip_grad_norm_, full_parameters, merge_parameters
from course_lib.parallel.pp import PipelineParallel
from course_lib.parallel.pp_executor import StepRecord
from course_lib.parallel.pp_stages import PipelinePlan
from course_lib.parallel.schedules import Schedule, Timeline
from course_lib.parallel.sharding import model_state_bytes
from course_lib.parallel.tp import Builder, apply_tp
from course_lib.parallel.tp_layers import vocab_parallel_cross_entropy
from course_lib.parallel.zero import ZeroDataParallel
from course_lib.runtime.mesh import Mesh, MeshShape
from course_lib.train import (
    TrainConfig,
    TrainResult,
    copy_parameters,
    make_optimizer,
    optimizer_spec,
)


@dataclass
class RunResult(TrainResult):
    """``TrainResult`` plus this rank's communication records and timing of each step."""

    step_comm: list[list[comm.CommRecord]] = field(default_factory=list, repr=False)
    timeline: list[StepTime] = field(default_factory=list, repr=False)


# ------------------------------------------------------------------------------ one form at a time


def train_dp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
             mode: Mode = "overlapped", bucket_mb: float = DEFAULT_BUCKET_MB,
             accumulation: int = 1, find_unused_parameters: bool = False, *,
             mesh: HasGroups | None = None, group: comm.Group = None,
             model_fn: ModelFn | None = None, freeze: Sequence[str] = (),
             data_parallel: Callable[..., ParallelWrapper] = DataParallel,
             sampler: Sampler | None = None) -> RunResult:
    """Data parallelism over ``group`` / ``mesh`` (chapter 02). ``data_parallel``: the form (a
    variant of ``DataParallel``, or one of your own with its constructor's keywords); ``sampler``:
    ``train_loop``'s."""
    tc = tc or TrainConfig()
    model = build_model(cfg, tc.seed, model_fn, freeze)
    dp = data_parallel(model, mesh=mesh, group=group, mode=mode, bucket_mb=bucket_mb,
                       find_unused_parameters=find_unused_parameters)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], tc)
    out = train_loop(dp, opt, cfg, tc, data_rank=dp.rank, data_size=dp.world_size,
                     accumulation=accumulation, sampler=sampler)
    return RunResult(out.losses, copy_parameters(model), out.step_comm, out.timeline)


@dataclass
class ZeroTrainResult(RunResult):
    """Plus ``events`` (per step, (collective, unit) in issue order), ``memory`` (model-state bytes
    right after the first ``optimizer.step()``), ``peak`` (the largest weight / gradient bytes at
    any hook), ``units``."""

    events: list[list[tuple[str, str]]] = field(default_factory=list, repr=False)
    memory: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    units: list[dict[str, Any]] = field(default_factory=list, repr=False)
    start_step: int = 0

    @property
    def comm(self) -> list[comm.CommLog]:
        """``step_comm`` as one ``CommLog`` per step."""
        return [comm.CommLog(list(records)) for records in self.step_comm]


def train_zero(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
               stage: int = 3, *, prefetch: bool = False, reshard_after_forward: bool | None = None,
               param_dtype: torch.dtype = torch.float32, save_to: str | Path | None = None,
               resume_from: str | Path | None = None, accumulation: int = 1,
               mesh: HasGroups | None = None, group: comm.Group = None,
               model_fn: ModelFn | None = None, freeze: Sequence[str] = (),
               sharding: Callable[..., Any] = ZeroDataParallel) -> ZeroTrainResult:
    """ZeRO ``stage`` over ``group`` / ``mesh``'s dp x cp (chapter 03). ``resume_from``: continue
    from a sharded checkpoint (any N, any stage); ``save_to``: save one after the last step.
    ``sharding``: the form (``ZeroDataParallel``, ``fsdp2.FSDP2DataParallel``, a variant)."""
    tc = tc or TrainConfig()
    model = build_model(cfg, tc.seed, model_fn, freeze)
    zdp = sharding(model, stage, mesh=mesh, group=group, prefetch=prefetch,
                   reshard_after_forward=reshard_after_forward, param_dtype=param_dtype)
    opt = make_optimizer(list(zdp.parameters()), tc)
    start = load_sharded(zdp, opt, resume_from) if resume_from is not None else 0
    result = ZeroTrainResult([], {}, start_step=start, units=[_unit_sizes(u) for u in zdp.units])
    marks = [len(zdp.events)]

    def measure(step: int) -> None:
        if not result.memory:
            result.memory = model_state_bytes(zdp.units, zdp.param_dtype, opt)

    out = train_loop(zdp, opt, cfg, tc, data_rank=zdp.rank, data_size=zdp.world_size,
                     accumulation=accumulation, start_step=start, after_optimizer=measure,
                     on_step_end=lambda s: marks.append(len(zdp.events)))
    result.events = [zdp.events[a:b] for a, b in itertools.pairwise(marks)]
    if save_to is not None:
        save_sharded(zdp, opt, save_to, step=tc.steps)
    result.losses, result.step_comm, result.timeline = out.losses, out.step_comm, out.timeline
    fp32_replica = stage < 3 and param_dtype == torch.float32 and isinstance(zdp, ZeroDataParallel)
    result.params = copy_parameters(model) if fp32_replica else zdp.full_parameters()
    result.peak = dict(zdp.peak_bytes)
    return result


def _unit_sizes(u: Any) -> dict[str, Any]:
    layout = getattr(u, "layout", None)
    if layout is None:  # a per-parameter unit
        return {"name": u.name, "numel": sum(p.numel() for p in u.params)}
    return {"name": u.name, "numel": layout.numel, "padded_numel": layout.padded_numel,
            "shard_numel": layout.shard_numel}


@dataclass
class TPResult(RunResult):
    """Plus the gradient norms before clipping (when clipping)."""

    grad_norms: list[float] = field(default_factory=list)


class TensorParallelStep(ParallelWrapper):
    """The data-parallel step of TP alone: every rank of a tp group sees the whole batch, so there
    is no data group to average over (also when ``mesh`` has dp ranks), only the ``Partial()``
    gradients to sum over tp."""

    axes = ("tp",)

    def __init__(self, module: nn.Module, mesh: HasGroups) -> None:
        super().__init__(module, mesh=mesh)
        self.mesh = mesh

    def finish_gradient_sync(self) -> None:
        sum_partials(self.module.parameters(), self.mesh)


def train_tp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None, *,
             mesh: Mesh | None = None, sequence_parallel: bool = False,
             model_fn: ModelFn | None = None, plan: Mapping[str, str | Builder] | None = None,
             clip_grad_norm: float | None = None, accumulation: int = 1,
             freeze: Sequence[str] = (), sp_matmul: Callable | None = None,
             loss_fn: LossFn | None = None,
             clip: Callable[..., torch.Tensor] = clip_grad_norm_) -> TPResult:
    """Tensor (and sequence) parallelism over ``mesh``'s tp axis (default: every rank), chapter 04.
    Every rank sees the whole batch; the loss is the vocab-parallel cross-entropy (``loss_fn``
    replaces it); the partial gradients are summed over tp by the data-parallel step
    (``TensorParallelStep``). ``clip_grad_norm``: clip to that global norm (``clip``, counting each
    shard once) before the step."""
    tc = tc or TrainConfig()
    mesh = mesh or Mesh(tp=world_size)
    model = build_model(cfg, tc.seed, model_fn, freeze)
    group = mesh.group("tp")
    apply_tp(model, group, plan, sequence_parallel=sequence_parallel, sp_matmul=sp_matmul)
    dp = TensorParallelStep(model, mesh)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], tc)
    norms: list[float] = []

    def clipped(step: int) -> None:
        if clip_grad_norm is not None:
            norms.append(float(clip(model, clip_grad_norm, mesh)))

    loss = loss_fn or functools.partial(vocab_parallel_cross_entropy, group=group)
    out = train_loop(dp, opt, cfg, tc, data_rank=0, data_size=1, accumulation=accumulation,
                     loss_fn=loss, before_optimizer=clipped)
    return TPResult(out.losses, _whole(model, mesh), out.step_comm, out.timeline, norms)


def _whole(model: nn.Module, mesh: HasGroups) -> dict[str, torch.Tensor]:
    return {n: t.cpu() for n, t in full_parameters(model, mesh).items()}


@dataclass
class PPResult(RunResult):
    """One rank's run: its parameters only (``merge_results`` joins the ranks'), its stages, each
    step's record (actions as they ran, comm, micro-batch losses) and the plan."""

    rank: int = 0
    stages: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list, repr=False)
    plan: PipelinePlan | None = field(default=None, repr=False)


def train_pp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
             schedule: str | Schedule = "1f1b", microbatches: int = 4, v: int = 1,
             split: Sequence[int] | None = None, *, mesh: HasGroups | None = None,
             group: comm.Group = None, model_fn: ModelFn | None = None,
             freeze: Sequence[str] = (), loss_fn: LossFn = lm_loss,
             emulate: tuple[float, float, float] | None = None, **options: Any) -> PPResult:
    """Pipeline parallelism over ``group`` / ``mesh``'s pp axis (chapter 05): p * v stages,
    ``schedule`` over ``microbatches`` micro-batches per step; every rank steps its own stages'
    parameters. ``options``: ``PipelineParallel``'s others (``executor``: a variant's class)."""
    tc = tc or TrainConfig()
    model = build_model(cfg, tc.seed, model_fn, freeze)
    pipe = PipelineParallel(model, mesh=mesh, group=group, schedule=schedule,
                            microbatches=microbatches, v=v, split=split,
                            global_batch=tc.global_batch, loss_fn=loss_fn, emulate=emulate,
                            **options)
    opt = make_optimizer(list(pipe.parameters()), tc)
    spans: list[tuple[float, float]] = []

    def span(step: int) -> None:
        first = pipe.timelines[-1][0].start if pipe.timelines[-1] else time.perf_counter()
        spans.append((first, time.perf_counter()))

    out = train_loop(pipe, opt, cfg, tc, data_rank=0, data_size=1, loss_fn=loss_fn,
                     on_step_end=span)
    ran = zip(pipe.timelines, out.step_comm, pipe.micro_losses, spans, strict=True)
    records = [StepRecord(step, timeline, comm_, losses, start, end)
               for step, (timeline, comm_, losses, (start, end)) in enumerate(ran)]
    return PPResult(out.losses, pipe.full_parameters(), out.step_comm, out.timeline, rank=pipe.rank,
                    stages=sorted(int(k) for k in pipe.stages), steps=records, plan=pipe.plan)


def merge_results(results: Sequence[TrainResult]) -> TrainResult:
    """Join the pipeline ranks' results into one ``TrainResult`` (each parameter on one stage)."""
    if not results:
        raise ValueError("no results to merge")
    for r in results:
        if r.losses != results[0].losses:
            raise ValueError(f"ranks report different losses: {r.losses} vs {results[0].losses}")
    params = merge_parameters([r.params for r in results], exclusive=True)
    return TrainResult(list(results[0].losses), params)


def measured_timeline(results: Sequence[PPResult], step: int = -1) -> Timeline:
    """The compute actions of one step on every rank, as (start, end, action) in seconds from the
    step's first start: ``schedule_run.simulate``'s format, for the same Gantt chart."""
    per_rank = [[t for t in r.steps[step].actions if t.action.is_compute] for r in results]
    t0 = min(t.start for rank in per_rank for t in rank)
    return [[(t.start - t0, t.end - t0, t.action) for t in rank] for rank in per_rank]


def measured_bubble_fraction(results: Sequence[PPResult], step: int = -1) -> float:
    """1 - busy / (p x makespan) for one step: rank-time's idle share (``bubble_fraction``)."""
    timeline = measured_timeline(results, step)
    makespan = max(end for rank in timeline for _, end, _ in rank)
    busy = sum(end - start for rank in timeline for start, end, _ in rank)
    return 1 - busy / (len(timeline) * makespan)


# --------------------------------------------------------------------------------------- composed


@dataclass
class ComposedResult(RunResult):
    """One rank's composed run: its parameters (whole, by name: ``merge_composed`` joins the
    ranks'), its mesh coordinates; ``pairs``: attention pairs per step (cp); ``routing``: each
    step's routing statistics per expert-parallel layer (ep)."""

    rank: int = 0
    coords: dict[str, int] = field(default_factory=dict)
    pairs: list[int] = field(default_factory=list)
    routing: list[list[EPRoutingStats]] = field(default_factory=list, repr=False)


@dataclass(frozen=True)
class Checkpointing:
    """Checkpoints of a composed run (the whole format): ``save_to`` a folder after ``save_after``
    steps; ``resume_from`` a folder written at any mesh."""

    save_to: str | None = None
    save_after: int | None = None
    resume_from: str | None = None


def train_parallel(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
                   parallel: ParallelConfig | None = None, *,
                   checkpoint: Checkpointing | None = None, model_fn: ModelFn | None = None,
                   freeze: Sequence[str] = (), steps: Sequence[C.Step] = C.STEPS,
                   mesh_fn: Callable[[ParallelConfig], Mesh] | None = None,
                   sampler: Sampler | None = None) -> ComposedResult:
    """Train on the mesh of ``parallel`` (default one rank) through ``parallelize`` and the one loop
    (chapter 08): ``launch(train_parallel, 8, cfg, tc, parallel)``. ``steps``: the composition
    (``compose.with_step`` swaps one); ``mesh_fn``: how the mesh is built (a test's wrong mesh);
    ``sampler``: ``train_loop``'s. Compare ``merge_composed`` of the ranks' results with
    ``train_baseline(cfg, tc, accumulation=parallel.accumulation)``."""
    tc, parallel = tc or TrainConfig(), parallel or ParallelConfig()
    checkpoint = checkpoint or Checkpointing()
    mesh = (mesh_fn or ParallelConfig.mesh)(parallel)
    model = build_model(cfg, tc.seed, model_fn, freeze)
    start, states = 0, None
    if checkpoint.resume_from is not None:  # whole tensors in the model: parallelize cuts them
        start, whole, states = load_whole(checkpoint.resume_from)
        load_parameters(model, whole)
    run = C.parallelize(model, mesh, parallel, global_batch=tc.global_batch, steps=steps)
    opt_cls, kwargs = optimizer_spec(tc)
    optimizer = run.make_optimizer(opt_cls, **kwargs)
    if states is not None:
        restore_optimizer(run, optimizer, states)
    pairs = [run.cp.stats.pairs] if run.cp is not None else []
    routing: list[list[EPRoutingStats]] = []

    def step_end(step: int) -> None:
        if checkpoint.save_to is not None and step + 1 == checkpoint.save_after:
            save_whole(run, optimizer, step + 1, checkpoint.save_to)
        if run.cp is not None:
            pairs.append(run.cp.stats.pairs)
        if run.ep:
            routing.append([layer.stats for layer in run.ep])

    out = train_loop(run, optimizer, cfg, tc, data_rank=mesh.coord("dp"), data_size=mesh.size("dp"),
                     accumulation=parallel.accumulation, start_step=start, on_step_end=step_end,
                     sampler=sampler)
    return ComposedResult(out.losses, run.full_parameters(), out.step_comm, out.timeline, rank=rank,
                          coords=mesh.shape.coords(rank),
                          pairs=[b - a for a, b in itertools.pairwise(pairs)], routing=routing)


def merge_composed(results: Sequence[ComposedResult]) -> TrainResult:
    """Join the ranks' results into one ``TrainResult`` with every parameter once; every copy of a
    parameter (replicas, TP ranks after the gather) must be bit-for-bit equal and every rank report
    the same losses."""
    if not results:
        raise ValueError("no results to merge")
    for r in results:
        if r.losses != results[0].losses:
            raise ValueError(f"rank {r.rank} reports losses {r.losses}, rank {results[0].rank} "
                             f"{results[0].losses}")
    params = merge_parameters([r.params for r in results], [r.rank for r in results])
    return TrainResult(list(results[0].losses), params)


def train_cp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None, *,
             mesh: Mesh | None = None, layout: Layout = "zigzag", algorithm: str = "ring",
             model_fn: ModelFn | None = None, kernel: BlockAttention | None = None,
             attention: Callable[..., nn.Module] | None = None, zero_stage: int = 0,
             accumulation: int = 1, freeze: Sequence[str] = ()) -> ComposedResult:
    """Context parallelism over ``mesh``'s cp axis (default: every rank), with data parallelism when
    it has a dp axis (chapter 06): the composition of ``cp x dp``, ``kernel`` (the per-block
    operations) and ``attention`` (what each block's attention becomes) passed to ``apply_cp``."""
    shape = mesh.shape if mesh is not None else MeshShape(cp=world_size)
    options = {k: v for k, v in (("kernel", kernel), ("attention", attention)) if v is not None}
    step = functools.partial(C.context_parallel, **options)
    steps = C.with_step(C.STEPS, C.context_parallel, step)
    parallel = ParallelConfig(shape, zero_stage=zero_stage, cp_layout=layout,
                              cp_algorithm=algorithm, accumulation=accumulation)
    return train_parallel(rank, world_size, cfg, tc, parallel, model_fn=model_fn, freeze=freeze,
                          steps=steps, mesh_fn=(lambda _: mesh) if mesh is not None else None)


def train_ep(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None, *,
             ep: int | None = None, mesh: Mesh | None = None, accumulation: int = 1,
             model_fn: ModelFn | None = None,
             freeze: Sequence[str] = (), layer: Callable[..., ExpertParallelMoE] | None = None,
             bias_update_rate: float = 0.0) -> ComposedResult:
    """Expert parallelism of degree ``ep`` (default: every rank) over the data-parallel ranks
    (chapter 07): the composition of ``Mesh(dp=world_size, ep=ep)``; ``layer``: the expert-parallel
    layer (a variant)."""
    shape = mesh.shape if mesh is not None else MeshShape(dp=world_size, ep=ep or world_size)
    if shape.size("tp", "pp", "cp") != 1:
        raise ValueError("train_ep runs EP x DP only (tp = pp = cp = 1); composing more axes is "
                         "train_parallel's")
    steps = C.STEPS
    if layer is not None:
        step = functools.partial(C.expert_parallel, layer=layer)
        steps = C.with_step(C.STEPS, C.expert_parallel, step)
    parallel = ParallelConfig(shape, accumulation=accumulation, bias_update_rate=bias_update_rate)
    return train_parallel(rank, world_size, cfg, tc, parallel, model_fn=model_fn, freeze=freeze,
                          steps=steps, mesh_fn=(lambda _: mesh) if mesh is not None else None)

