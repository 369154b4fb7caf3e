"""Pipeline parallelism from scratch: a model cut into stages on ranks, run under any schedule.

n = p x v contiguous stages (``split`` blocks each, equal by default), stage s on rank s % p (v > 1:
interleaved 1F1B, Megatron-LM's placement); names stay global (``blocks.3.attn.q_proj.weight``).
The batch is cut into m micro-batches, each back-propagating its mean loss / m so the backwards sum
to the batch mean's gradient (without / m it is m times too large: Adam hides it, SGD does not).
GPipe's bubble is (p-1)/(m+p-1) of the step (Huang et al. 2019); 1F1B keeps at most p micro-batches
in flight; ZB-H1 splits the backward into I and W (``pp_split``) to fill it. A pipeline reduces no
gradient: data parallelism connects at each stage's ``REDUCE_GRAD`` (``connect``). Chapter 05
builds the schedules and the executor first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from course_lib import comm
from course_lib.model import lm_loss
from course_lib.parallel import pp_stages
from course_lib.parallel.contract import HasGroups, ParallelWrapper
from course_lib.parallel.pp_executor import LossFn, PipelineExecutor, StageEngine, TimedAction
from course_lib.parallel.pp_stages import PipelineParts, Stage
from course_lib.parallel.schedules import Schedule, add_grad_reduce


class PipelineParallel(ParallelWrapper):
    """This rank's stages of ``module`` (a GPT, an ``nn.Sequential`` [first, *blocks, last] or
    ``PipelineParts``, built from one seed on every rank) over ``group`` (or ``mesh.group("pp")``),
    run under ``schedule``. ``forward_backward(x, y)`` runs one pass of it over ``microbatches``
    micro-batches (no separate forward) and returns the mean micro-batch loss on the last stage's
    rank (0.0 elsewhere; ``reduce_losses`` broadcasts it). ``sequence_shards``: a message holds
    1/that of the tokens (SP). ``executor``: its class (a variant overrides ``scale_loss``);
    ``place_grad_reduce``: where ``REDUCE_GRAD`` goes once data parallelism connects."""

    axes = ("pp",)

    def __init__(self, module: nn.Module | PipelineParts, *, mesh: HasGroups | None = None,
                 group: comm.Group = None, schedule: str | Schedule = "1f1b", microbatches: int = 4,
                 v: int = 1, split: Sequence[int] | None = None, global_batch: int | None = None,
                 loss_fn: LossFn = lm_loss, emulate: tuple[float, float, float] | None = None,
                 sequence_shards: int = 1, executor: type[PipelineExecutor] = PipelineExecutor,
                 place_grad_reduce: Callable[[Schedule], Schedule] = add_grad_reduce) -> None:
        parts = pp_stages.pipeline_parts(module)
        held = (module if isinstance(module, nn.Module)
                else nn.ModuleList([parts.first, *parts.blocks, parts.last]))
        super().__init__(held, mesh=mesh, group=group)
        if pp_stages.shares_weights(parts.first, parts.last) and self.world_size * v > 1:
            raise ValueError("the first and the last part share a weight (tied embeddings): its "
                             "gradient would need an all-reduce between those stages' ranks "
                             "(Megatron's embedding group), which this executor does not do; use "
                             "an untied model")
        self.plan = plan = pp_stages.plan_pipeline(len(parts.blocks), self.world_size, schedule,
                                                   microbatches, v, split, global_batch)
        self.stages = nn.ModuleDict({str(s): Stage(parts, s, plan.n_stages, plan.layers[s])
                                     for s in plan.stages_of(self.rank)})
        self.parts, self.place_grad_reduce = parts, place_grad_reduce
        self.executor = executor({int(k): st for k, st in self.stages.items()}, plan, self.rank,
                                 self.group, loss_fn, emulate)
        self.executor.sequence_shards = sequence_shards
        self.timelines: list[list[TimedAction]] = []  # one per forward_backward
        self.micro_losses: list[list[float]] = []

    def stage_parameters(self, stage: int) -> list[nn.Parameter]:
        """The trainable parameters of one of this rank's stages."""
        return [q for q in self.stages[str(stage)].parameters() if q.requires_grad]

    def connect(self, grad_reduce: Callable[[int], None] | None = None,
                engine: StageEngine | None = None) -> None:
        """Hand the stages' gradients to data parallelism: ``grad_reduce(stage)`` runs at each
        stage's ``REDUCE_GRAD`` (placed by ``place_grad_reduce``: after its last B, or W);
        ``engine.before / after`` run around every compute action (ZeRO-3's gathers)."""
        if grad_reduce is not None:
            if self.executor.grad_reduce is not None:  # a second one: every gradient reduced twice
                raise ValueError("stages already connected to a data-parallel step: connect once")
            if not any(a.kind.name == "REDUCE_GRAD" for rank in self.plan.actions for a in rank):
                self.plan = self.plan.with_actions(self.place_grad_reduce(self.plan.actions))
                self.executor.plan, self.executor.actions = self.plan, self.plan.actions[self.rank]
            self.executor.grad_reduce = grad_reduce
        self.executor.engine = engine

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's stages' trainable parameters."""
        return iter([q for st in self.stages.values() for q in st.parameters() if q.requires_grad])

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by the wrapped module's names (copies, fp32)."""
        return pp_stages.named_subset(self.module, list(self.stages.values()))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "a pipeline interleaves forward and backward over micro-batches: call "
            "forward_backward(x, y) (one pass of the schedule), not the module")

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None = None,
                         scale: float = 1.0) -> float:
        if scale != 1.0:
            raise ValueError("the pipeline splits the batch into its own micro-batches "
                             "(microbatches=m) and scales each loss by 1/m itself: run it with "
                             "accumulation=1")
        if loss_fn is not None:
            self.executor.loss_fn = loss_fn
        if self.executor.hidden_shape is None:  # one token's hidden state: the first part on a row
            with torch.no_grad():
                self.executor.hidden_shape = tuple(self.parts.first(x[:1]).shape[2:])
        losses, timeline = self.executor.run(x, y)
        self.timelines.append(timeline)
        self.micro_losses.append(losses)
        return sum(losses) / len(losses) if losses else 0.0

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """Only the last stage computes the losses: broadcast them from its rank."""
        losses = local.to(torch.float32)
        if self.world_size > 1:
            last = comm.global_rank(self.group, self.plan.rank_of(self.plan.n_stages - 1))
            comm.broadcast(losses, src=last, group=self.group)
        return losses


def apply_pp(model: nn.Module, group: comm.Group, **options: Any) -> PipelineParallel:
    """Pipeline parallelism of ``model`` (whatever the axes before did to it) over ``group``: this
    rank's stages and its schedule's executor (``PipelineParallel``'s options)."""
    return PipelineParallel(model, group=group, **options)
