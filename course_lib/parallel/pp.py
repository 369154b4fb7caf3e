"""Pipeline parallelism from scratch: cut the GPT into stages, run any schedule of ``course_lib.parallel.schedules``
on real ranks, and measure it.

Stages. The model is cut into ``n = p * v`` contiguous (virtual) stages: stage 0 has the embeddings, the last stage
the final norm, the LM head and the loss, each stage a run of blocks (``split``: the number of blocks of each stage,
equal counts by default; any counts >= 1 summing to ``n_layer``). Stage ``s`` lives on rank ``s % p``: with
``v = 1`` stage s is rank s; with ``v > 1`` (interleaved 1F1B) rank r holds model chunks r, r + p, r + 2p, ...
(Megatron-LM's placement, the one ``schedules.py`` uses). Parameters keep their global names
(``blocks.3.attn.q_proj.weight``), so a stage's parameters line up with ``GPT.named_parameters()``.

Micro-batches and the loss. The global batch B is split into m micro-batches of b = B / m rows. The last stage
computes each micro-batch's mean loss L_j and back-propagates ``L_j / m``: the m backward passes accumulate
sum_j grad(L_j) / m = grad(mean over the batch) -- the single-process gradient. Without the ``/ m`` the gradients
are m times too large (an easy bug to write; Adam's update is nearly scale-invariant and hides it, SGD
does not). The reported loss is the mean of the unscaled L_j.

Transfers and the executor that runs each rank's actions: ``course_lib.parallel.pp_executor``; per optimizer
step 2 (n - 1) m messages of b * s * h * 4 bytes (n = p v stages).

Split backward (zero-bubble, ``I`` and ``W``): ``course_lib.parallel.pp_split``.

Timeline. Each compute action records its start and end (``time.perf_counter``, one clock for every process of a
machine) and how long it waited for its input first; ``measured_bubble_fraction`` turns the ranks' records into
1 - busy / (p x makespan), the quantity ``schedule_run.simulate`` predicts, and ``measured_timeline`` gives them in the
simulator's format for the Gantt chart. On a 2-core laptop ranks time-slice; for timing lessons pass
``emulate=(t_f, t_b, t_w)``: every action then also sleeps that long (an emulated device: the host waits as it
waits for a GPU kernel), so ranks run side by side and the measured bubble follows the schedule, not the OS.

Balancing (``course_lib.parallel.pp_balance``): equal layer counts are not equal stages; ``balance_stages``
returns the contiguous split minimizing the slowest stage from measured per-layer costs.

Checked (tests/test_pp.py): every schedule at p = 2 and 4, and uneven splits, give bit-for-bit the parameters of
one process accumulating the same m micro-batches, and of ``torch.distributed.pipelining`` on the same stages
(``train_torch_pp``); and match ``train_baseline`` within the default tolerance (AdamW at lr 5e-4 -- at larger lr,
AdamW turns the rounding noise of *any* micro-batching into visible differences; the test module says why).

Left out compared with Megatron-LM / torchtitan: tied embeddings across first and last stage (they would need an
all-reduce of the shared weight's gradient between the two ranks), activation recomputation, overlapping the
point-to-point transfers with compute through batched ``isend``/``irecv`` on separate streams, building only the
local layers (each rank here builds the full tiny model once, for identical initial weights, and keeps its part).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.model import lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel.contract import HasGroups, ParallelWrapper, broadcast_from_first, require_member
from course_lib.parallel.loop import ModelFn, build_model, train_loop
from course_lib.parallel.placement import merge_parameters
from course_lib.parallel.pp_balance import LayerCosts, balance_stages, measure_layer_costs, stage_costs
from course_lib.parallel.pp_executor import LossFn, PipelineExecutor, StepRecord, TimedAction
from course_lib.parallel.pp_fsdp import StageSharding
from course_lib.parallel.pp_layers import layer_split, stage_layers
from course_lib.parallel.pp_split import backward_input, backward_weight
from course_lib.parallel.pp_stages import (
    SCHEDULES,
    PipelineParts,
    PipelinePlan,
    Stage,
    build_stages,
    named_subset,
    pipeline_parts,
    plan_pipeline,
    shares_weights,
)
from course_lib.parallel.schedule_run import Timeline, add_grad_reduce
from course_lib.parallel.schedules import Schedule
from course_lib.train import TrainConfig, TrainResult, make_optimizer

__all__ = [  # with what pp_stages / pp_layers / pp_balance / pp_split / pp_executor define, re-exported here
    "SCHEDULES", "LayerCosts", "PPResult", "PipelineExecutor", "PipelineParallel", "PipelineParts", "PipelinePlan",
    "Stage", "StepRecord", "TimedAction", "TorchPipeline", "backward_input", "backward_weight", "balance_stages",
    "build_stages", "layer_split", "measure_layer_costs", "measured_bubble_fraction", "measured_timeline",
    "merge_results", "pipeline_parts", "plan_pipeline", "stage_costs", "stage_layers", "train_pp", "train_torch_pp",
]


# ------------------------------------------------------------------------------------------------ training


class PipelineParallel(ParallelWrapper):
    """Wrap ``module`` (a GPT, an ``nn.Sequential`` [first, *blocks, last] or ``PipelineParts``) so that this
    rank of ``group`` (or ``mesh.group("pp")``) runs its stages of it under ``schedule``.

    Every rank holds the whole module (built from the same seed: identical weights, nothing to broadcast) and
    keeps its stages: ``parameters()`` are this rank's stages' parameters, what its optimizer steps.
    ``forward_backward(x, y)`` runs one pass of the schedule over the ``microbatches`` micro-batches of the batch
    (forwards and backwards interleave, so a pipeline has no separate forward); it returns the mean micro-batch
    loss on the last stage's rank (0.0 elsewhere; ``reduce_losses`` broadcasts the last stage's). The pipeline
    accumulates its own micro-batches, so on its own ``no_sync`` has nothing to hold back and
    ``finish_gradient_sync`` / ``after_step`` are no-ops; ``remove_hooks`` has none to remove (sharded stages:
    it puts full parameters back). Seam: the executor's ``scale_loss`` (``executor_class``, a
    ``PipelineExecutor`` subclass).

    Pipeline + data parallelism: with ``grad_group`` (the data-parallel group of this pipeline rank, e.g.
    ``mesh.group("dp", "cp")``), each stage's gradients are averaged over that group by the schedule's own
    ``REDUCE_GRAD`` action (``schedule_run.add_grad_reduce``: after the stage's last B, or its last W under a
    split backward): one async all-reduce of the stage's gradients in a flat buffer starts there, while the
    other stages drain, and ``finish_gradient_sync`` waits for them and writes the averages back. The stage's
    weights are broadcast over ``grad_group`` at construction; inside ``no_sync`` nothing is reduced (the next
    pass outside it reduces the accumulated sum). Seams: ``place_grad_reduce`` (where the action goes) and the
    executor's ``reduce_grad``.

    Pipeline + ZeRO-3 / FSDP2 (``enable_sharding``, ``pp_fsdp``): the stages' parameters become their shards
    over ``grad_group``, the executor gathers them around each compute action, the full gradients accumulate
    over the micro-batches and ``REDUCE_GRAD`` reduce-scatters them once per step (torch's pipelining runs
    FSDP the same way). Seam: ``sharding_class``.

    ``sequence_shards``: the messages hold 1 / sequence_shards of each row's tokens (tp, when the stages are
    tensor- and sequence-parallel: Korthikanti et al. 2022 send the sequence-sharded hidden state between
    stages, s/tp tokens per message).
    """

    axes = ("pp",)
    sharding_class: type[StageSharding] = StageSharding

    def __init__(self, module: nn.Module | PipelineParts, *, mesh: HasGroups | None = None,
                 group: comm.Group = None, schedule: str | Schedule = "1f1b", microbatches: int = 4, v: int = 1,
                 split: Sequence[int] | None = None, global_batch: int | None = None, loss_fn: LossFn = lm_loss,
                 emulate: tuple[float, float, float] | None = None,
                 executor_class: type[PipelineExecutor] = PipelineExecutor, grad_group: comm.Group = None,
                 sequence_shards: int = 1) -> None:
        parts = pipeline_parts(module)
        super().__init__(module if isinstance(module, nn.Module) else nn.ModuleList([parts.first, *parts.blocks,
                                                                                        parts.last]),
                         mesh=mesh, group=group)
        if shares_weights(parts.first, parts.last) and self.world_size * v > 1:
            raise ValueError("the first and the last part share a weight (tied embeddings): its gradient would need "
                             "an all-reduce between those stages' ranks (Megatron's embedding group), which this "
                             "executor does not do; use an untied model")
        self.plan = plan_pipeline(len(parts.blocks), self.world_size, schedule, microbatches, v, split, global_batch)
        self.stages = nn.ModuleDict({str(s): Stage(parts, s, self.plan.n_stages, self.plan.layers[s])
                                     for s in self.plan.stages_of(self.rank)})
        by_index = {int(k): st for k, st in self.stages.items()}
        self.parts = parts
        self.grad_group: comm.Group = None
        self.sharding: StageSharding | None = None  # ZeRO-3 of the stages (enable_sharding)
        self._pending: list[tuple[list[nn.Parameter], torch.Tensor, Any]] = []  # (params, flat, work) per stage
        self.executor = executor_class(by_index, self.plan, self.rank, self.group, loss_fn, emulate)
        self.executor.sequence_shards = sequence_shards
        if grad_group is not None:
            self.enable_grad_reduce(grad_group)
        self.timelines: list[list[TimedAction]] = []  # one per forward_backward
        self.micro_losses: list[list[float]] = []

    def _own_grad_reduce(self, grad_group: comm.Group) -> None:
        """Make ``grad_group`` the group this pipeline reduces its gradients over, and add the ``REDUCE_GRAD``
        actions to the schedule (once: a second data-parallel group is refused)."""
        if self.grad_group is not None:
            raise ValueError("the pipeline already reduces its gradients over a data-parallel group")
        require_member(grad_group, type(self).__name__)
        self.grad_group = grad_group
        self.plan = dataclasses.replace(self.plan, actions=self.place_grad_reduce(self.plan.actions))
        self.executor.plan, self.executor.actions = self.plan, self.plan.actions[self.rank]

    def enable_grad_reduce(self, grad_group: comm.Group) -> None:
        """Average each stage's gradients over ``grad_group`` (this pipeline rank's data-parallel group) by the
        schedule's ``REDUCE_GRAD`` actions; the stages' weights are first broadcast over it."""
        self._own_grad_reduce(grad_group)
        broadcast_from_first(self.stages, grad_group)
        self.executor.grad_reduce = self._launch_grad_reduce

    def enable_sharding(self, grad_group: comm.Group, *, mesh: HasGroups | None = None, axis: str = "dp",
                        reshard_after_forward: bool = False) -> StageSharding:
        """ZeRO-3 / FSDP2 of the stages over ``grad_group`` (``pp_fsdp``): the stages' parameters become their
        dim-0 shards (``sharding_class``), gathered and freed around the schedule's compute actions, and each
        stage's accumulated full gradients reduce-scattered once, by its ``REDUCE_GRAD`` action. ``mesh`` /
        ``axis``: the groups of the partial gradients and the key the shards are recorded on."""
        self._own_grad_reduce(grad_group)
        self.sharding = self.sharding_class({int(k): st for k, st in self.stages.items()}, grad_group, mesh=mesh,
                                            axis=axis, reshard_after_forward=reshard_after_forward)
        self.executor.engine = self.sharding
        self.executor.grad_reduce = self._sharded_reduce
        return self.sharding

    def _sharded_reduce(self, stage: int) -> None:
        assert self.sharding is not None
        self.sharding.sync = self._require_sync
        self.sharding.reduce(stage)

    def place_grad_reduce(self, actions: Schedule) -> Schedule:
        """The schedule with its ``REDUCE_GRAD`` actions (a seam: a test puts them in the wrong place)."""
        return add_grad_reduce(actions)

    def _launch_grad_reduce(self, stage: int) -> None:
        if not self._require_sync:
            return
        params = [q for q in self.stages[str(stage)].parameters() if q.requires_grad]
        flat = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1) for q in params])
        self._pending.append((params, flat, comm.all_reduce(flat, group=self.grad_group, async_op=True)))

    def finish_gradient_sync(self) -> None:
        """Wait for the stages' gradient all-reduces (started by ``REDUCE_GRAD``) and write back the averages;
        sharded stages (``enable_sharding``): sum the partial gradient shards over their axis."""
        if self.sharding is not None:
            self.sharding.finish_gradient_sync()
        n = dist.get_world_size(self.grad_group) if self.grad_group is not None else 1
        for params, flat, work in self._pending:
            work.wait()
            flat /= n
            for q, chunk in zip(params, flat.split([q.numel() for q in params]), strict=True):
                q.grad = chunk.view_as(q)
        self._pending.clear()

    def remove_hooks(self) -> None:
        """Sharded stages (``enable_sharding``): full parameters back in the stages (a collective over
        ``grad_group``); the executor no longer gathers."""
        if self.sharding is not None:
            self.sharding.restore_full()
            self.executor.engine = None
        super().remove_hooks()

    def message_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """The shape of one hidden state per token, from the first part on one row of ``x`` (every rank holds
        the whole module, so every rank can ask it)."""
        with torch.no_grad():
            return tuple(self.parts.first(x[:1]).shape[2:])

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's stages' trainable parameters."""
        return iter([q for st in self.stages.values() for q in st.parameters() if q.requires_grad])

    def local_params(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by the wrapped module's names (copies, fp32)."""
        return named_subset(self.module, list(self.stages.values()))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a pipeline interleaves forward and backward over micro-batches: call "
                                  "forward_backward(x, y) (one pass of the schedule), not the wrapper itself")

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None = None,
                         scale: float = 1.0) -> float:
        if scale != 1.0:
            raise ValueError("the pipeline splits the batch into its own micro-batches (microbatches=m) and scales "
                             "each loss by 1/m itself: run it with accumulation=1")
        if loss_fn is not None:
            self.executor.loss_fn = loss_fn
        if self.executor.hidden_shape is None:
            self.executor.hidden_shape = self.message_shape(x)
        losses, timeline = self.executor.run(x, y)
        self.timelines.append(timeline)
        self.micro_losses.append(losses)
        return sum(losses) / len(losses) if losses else 0.0

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """Only the last stage computes the losses: broadcast them from its rank (then the mean over the
        data-parallel group, when there is one)."""
        losses = local.to(torch.float32)
        if self.world_size > 1:
            comm.broadcast(losses, src=comm.global_rank(self.group, self.plan.rank_of(self.plan.n_stages - 1)),
                           group=self.group)
        if self.grad_group is not None:
            comm.all_reduce(losses, group=self.grad_group)
            losses /= dist.get_world_size(self.grad_group)
        return losses


@dataclass
class PPResult(TrainResult):
    """``TrainResult`` of one rank: losses (the global-batch mean, on every rank) and **this rank's** parameters by
    global name (``merge_results`` joins the ranks'), plus its stages and the per-step records (``step_comm``:
    the communication of each step, the same records as ``steps[i].comm``)."""

    rank: int = 0
    stages: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list, repr=False)
    plan: PipelinePlan | None = field(default=None, repr=False)
    step_comm: list[list[comm.CommRecord]] = field(default_factory=list, repr=False)


def train_pp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
             schedule: str | Schedule = "1f1b", microbatches: int = 4, v: int = 1, split: Sequence[int] | None = None,
             *, mesh: HasGroups | None = None, group: comm.Group = None, model_fn: ModelFn | None = None,
             freeze: Sequence[str] = (), loss_fn: LossFn = lm_loss, emulate: tuple[float, float, float] | None = None,
             wrapper_class: type[PipelineParallel] = PipelineParallel,
             executor_class: type[PipelineExecutor] = PipelineExecutor) -> PPResult:
    """Train with pipeline parallelism over ``group`` / ``mesh``'s pp axis (a ``launch`` target:
    ``launch(train_pp, 2, cfg, tc)``), through ``course_lib.parallel.loop.train_loop``.

    p = the group's size; the model is cut into p * v stages (``split`` blocks each, equal by default); each step
    runs ``schedule`` over ``microbatches`` micro-batches of ``global_batch(step, tc.global_batch, ...)`` and every
    rank steps the optimizer on its own stages' parameters. Returns the per-step losses (mean over the global
    batch, computed by the last stage and broadcast), this rank's final parameters (``merge_results`` joins them),
    and each step's timeline and communication records.
    """
    tc = tc or TrainConfig()
    model = build_model(cfg, tc.seed, model_fn, freeze)
    pipe = wrapper_class(model, mesh=mesh, group=group, schedule=schedule, microbatches=microbatches, v=v,
                         split=split, global_batch=tc.global_batch, loss_fn=loss_fn, emulate=emulate,
                         executor_class=executor_class)
    opt = make_optimizer(list(pipe.parameters()), tc)
    spans: list[tuple[float, float]] = []
    out = train_loop(pipe, opt, cfg, tc, data_rank=0, data_size=1, loss_fn=loss_fn,
                     on_step_end=lambda step: spans.append((pipe.timelines[-1][0].start if pipe.timelines[-1]
                                                            else time.perf_counter(), time.perf_counter())))
    records = [StepRecord(step, timeline, comm_, losses, start, end) for step, (timeline, comm_, losses, (start, end))
               in enumerate(zip(pipe.timelines, out.step_comm, pipe.micro_losses, spans, strict=True))]
    return PPResult(out.losses, pipe.local_params(), rank=pipe.rank, stages=sorted(int(k) for k in pipe.stages),
                    steps=records, plan=pipe.plan, step_comm=out.step_comm)


def merge_results(results: Sequence[TrainResult]) -> TrainResult:
    """Join the ranks' ``PPResult`` s (as ``launch`` returns them) into one ``TrainResult`` with every parameter,
    comparable with ``train_baseline`` by ``course_lib.train.compare`` (``placement.merge_parameters``: each
    parameter on exactly one stage)."""
    if not results:
        raise ValueError("no results to merge")
    for r in results:
        if r.losses != results[0].losses:
            raise ValueError(f"ranks report different losses: {r.losses} vs {results[0].losses}")
    return TrainResult(list(results[0].losses), merge_parameters([r.params for r in results], exclusive=True))


def measured_timeline(results: Sequence[PPResult], step: int = -1) -> Timeline:
    """The compute actions of one step on every rank, as (start, end, action) in seconds from the step's first
    start: the format of ``schedule_run.simulate(...).timeline``, for the same Gantt chart. ``results``: the
    pipeline's ranks in (group) rank order, as ``launch`` returns them."""
    per_rank = [[t for t in r.steps[step].actions if t.action.is_compute] for r in results]
    t0 = min(t.start for rank in per_rank for t in rank)
    return [[(t.start - t0, t.end - t0, t.action) for t in rank] for rank in per_rank]


def measured_bubble_fraction(results: Sequence[PPResult], step: int = -1) -> float:
    """1 - busy / (p x makespan) for one step: the idle share of rank-time, as ``Simulation.bubble_fraction``.
    Busy = the compute actions' durations; makespan = first compute start to last compute end over all ranks."""
    timeline = measured_timeline(results, step)
    makespan = max(end for rank in timeline for _, end, _ in rank)
    busy = sum(end - start for rank in timeline for start, end, _ in rank)
    return 1 - busy / (len(timeline) * makespan)


# ---------------------------------------------------------------------------------------- torch's version


class TorchPipeline(ParallelWrapper):
    """``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` /
    ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``) on the same stages as ``PipelineParallel``,
    behind the wrapper contract, so that the production API, the second oracle, runs the same training loop.
    Its loss_fn returns each micro-batch's mean loss and the schedule divides the accumulated gradients by m
    (``scale_grads=True``, the default): the same 1/m. Its transfers are not logged."""

    axes = ("pp",)

    def __init__(self, module: nn.Module, *, mesh: HasGroups | None = None, group: comm.Group = None,
                 schedule: str = "1f1b", microbatches: int = 4, v: int = 1, split: Sequence[int] | None = None,
                 global_batch: int | None = None) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
        )

        super().__init__(module, mesh=mesh, group=group)
        cfg = module.config
        self.plan = plan_pipeline(cfg, self.world_size, schedule, microbatches, v, split, global_batch)
        self.stages = build_stages(cfg, self.plan, self.rank, model=module)
        device = next(module.parameters()).device
        pipe_stages = [PipelineStage(st, s, self.plan.n_stages, device, group=self.group)
                       for s, st in self.stages.items()]
        single = {"gpipe": ScheduleGPipe, "one_f_one_b": Schedule1F1B}
        multi = {"interleaved_one_f_one_b": ScheduleInterleaved1F1B, "zb_h1": ScheduleInterleavedZeroBubble}
        if self.plan.schedule in single:
            self.runner = single[self.plan.schedule](pipe_stages[0], self.plan.m, loss_fn=lm_loss)
        elif self.plan.schedule in multi:
            self.runner = multi[self.plan.schedule](pipe_stages, self.plan.m, loss_fn=lm_loss)
        else:
            raise ValueError(f"no torch schedule for {schedule!r}")

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's stages' trainable parameters."""
        return iter([q for st in self.stages.values() for q in st.parameters() if q.requires_grad])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a pipeline runs forward_backward(x, y), one pass of its schedule")

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None = None,
                         scale: float = 1.0) -> float:
        """One ``schedule.step`` over the batch; the mean micro-batch loss on the last stage's rank, else 0."""
        if scale != 1.0:
            raise ValueError("the pipeline splits the batch into its own micro-batches: run it with accumulation=1")
        has_first, has_last = 0 in self.stages, self.plan.n_stages - 1 in self.stages
        losses: list[torch.Tensor] = []
        self.runner.step(*((x,) if has_first else ()), target=y if has_last else None,
                         losses=losses if has_last else None)
        return float(torch.stack(losses).detach().mean()) if has_last else 0.0

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """Only the last stage computes the losses: broadcast them from its rank."""
        losses = local.to(torch.float32)
        comm.broadcast(losses, src=comm.global_rank(self.group, self.plan.rank_of(self.plan.n_stages - 1)),
                       group=self.group)
        return losses


def train_torch_pp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
                   schedule: str = "1f1b", microbatches: int = 4, v: int = 1, split: Sequence[int] | None = None,
                   group: comm.Group = None) -> PPResult:
    """The same training with ``torch.distributed.pipelining`` (``TorchPipeline``) through ``loop.train_loop``:
    the production API, as a second oracle."""
    tc = tc or TrainConfig()
    pipe = TorchPipeline(build_model(cfg, tc.seed), group=group, schedule=schedule, microbatches=microbatches, v=v,
                         split=split, global_batch=tc.global_batch)
    opt = make_optimizer(list(pipe.parameters()), tc)
    out = train_loop(pipe, opt, cfg, tc, data_rank=0, data_size=1)
    return PPResult(out.losses, named_subset(pipe.module, list(pipe.stages.values())), rank=pipe.rank,
                    stages=sorted(pipe.stages), plan=pipe.plan, step_comm=out.step_comm)
