"""Composing the axes: ``parallelize(model, mesh, config)`` is an ordered list of plain functions.

Each step changes the *same* model in place on its group of the mesh and records where each
parameter now lives (``placement``), in torchtitan's (``parallelize_llama``) and Megatron's order:

1. ``tensor_parallel``: the plan applied (sliced weights, f and g, the vocab-parallel loss);
   every later step sees the sharded layers;
2. ``context_parallel``: attention over the cp ring at global positions; no weight changes;
3. ``expert_parallel``: E/ep experts per MoE layer, their parameters recorded on "edp";
4. ``moe_routing``: an MoE's capacity and router losses, as on one process or per rank;
5. ``pipeline_parallel``: whatever 1-4 made of the model cut into this rank's stages;
6. ``data_parallel``: **last, the only step that reduces gradients**: it must see exactly the
   parameters this rank trains, and reads in their placements where each is reduced (``dp_reduce``):
   averaged over dp x cp (experts: edp), summed over tp where ``Partial()``. A bucketed
   ``DataParallel`` (ZeRO 0/1; under a pipeline launched by each stage's ``REDUCE_GRAD``), the flat
   ``ZeroDataParallel`` (ZeRO-2) or FSDP2 (ZeRO-3; per stage: ``fsdp2_pipeline``; HSDP).

The steps are data (``STEPS``): a variant or a test passes its own (``with_step``). Chapter 08
composes them on 8 ranks; the refusals and their reasons are ``config.check_composable``'s.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.model import lm_loss
from course_lib.moe import moe_aux_loss
from course_lib.parallel import dp_reduce as R
from course_lib.parallel.config import ParallelConfig, check_composable
from course_lib.parallel.contract import LossFn, ParallelWrapper
from course_lib.parallel.cp import CPContext, apply_cp
from course_lib.parallel.cp_attention import allgather_attention, ring_attention, shard_sequence
from course_lib.parallel.cp_ulysses import ulysses_attention
from course_lib.parallel.dp import DataParallel
from course_lib.parallel.ep import ExpertParallelMoE, apply_ep, end_step
from course_lib.parallel.fsdp2 import FSDP2DataParallel
from course_lib.parallel.fsdp2_pipeline import StageSharding
from course_lib.parallel.moe_mesh import MeshRouting, share_routing
from course_lib.parallel.placement_ops import full_parameters
from course_lib.parallel.pp import PipelineParallel, apply_pp
from course_lib.parallel.sharded_optimizer import ShardedOptimizer
from course_lib.parallel.tp import apply_tp, gpt_plan
from course_lib.parallel.tp_layers import vocab_parallel_cross_entropy
from course_lib.parallel.zero import ZeroDataParallel
from course_lib.runtime.mesh import Mesh

ATTEND = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}
"""``ParallelConfig.cp_algorithm`` -> the attention function context parallelism runs."""


class Parallelized(ParallelWrapper):
    """A model with every axis of ``mesh`` applied by ``steps``, behind the loop's contract
    (``train_loop`` drives it like any other form). The parts the steps set: ``loss_fn`` (the LM
    loss, or TP's vocab-parallel one), ``cp`` (the ``CPContext``), ``ep`` (the expert-parallel
    layers), ``routing``, ``pipe`` (the ``PipelineParallel`` of this rank's stages) and ``dp`` (the
    data-parallel form: the one that reduces).

    ``forward_backward(x, y)`` takes this data-parallel rank's rows of full sequences: it cuts its
    cp share of the tokens and runs forward and backward (the pipeline's schedule when pp > 1)."""

    def __init__(self, model: nn.Module, mesh: Mesh, config: ParallelConfig,
                 global_batch: int | None = None) -> None:
        super().__init__(model, mesh=mesh)
        self.mesh, self.config, self.global_batch = mesh, config, global_batch
        self.batch_wide_loss = bool(model.config.n_expert)  # MoE: micro-batches cut globally first
        self.loss_fn: LossFn = lm_loss
        self.cp: CPContext | None = None
        self.ep: list[ExpertParallelMoE] = []
        self.routing: MeshRouting | None = None
        self.pipe: PipelineParallel | None = None
        self.dp: Any = None

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of this rank's tokens (+ the router losses of an MoE)."""
        loss = self.loss_fn(logits.float(), targets)
        return loss + moe_aux_loss(self.module) if self.batch_wide_loss else loss

    def local_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's context-parallel share of ``t``'s tokens [rows, seq] (all when cp = 1)."""
        if self.cp is None:
            return t
        return shard_sequence(t, self.cp.rank, self.cp.size, self.cp.layout, dim=1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's tokens: vocab-sharded under TP."""
        return (self.dp if self.dp is not None else self.module)(idx)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None = None,
                         scale: float = 1.0) -> float:
        """One micro-batch of this rank's rows (full sequences); the loss is ``loss``."""
        if self.cp is not None:  # every pipeline rank: later stages never run the model's forward
            self.cp.begin(x.shape[1], x.device)
        x, y = self.local_tokens(x), self.local_tokens(y)
        if self.pipe is not None:
            return self.pipe.forward_backward(x, y, self.loss, scale)
        loss = self.loss(self(x), y) * scale
        loss.backward()
        return loss.item()

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """What this rank's optimizer steps: its shards (ZeRO-2/3), stages' or trainable ones."""
        if isinstance(self.dp, (ZeroDataParallel, FSDP2DataParallel, StageSharding)):
            return self.dp.parameters()
        held = self.pipe.parameters() if self.pipe is not None else self.module.parameters()
        return iter([p for p in held if p.requires_grad])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.dp.no_sync() if self.dp is not None else contextlib.nullcontext():
            yield

    def finish_gradient_sync(self) -> None:
        """The data-parallel step: every gradient reduced as its placements say."""
        if self.dp is not None:
            self.dp.finish_gradient_sync()

    def after_step(self) -> None:
        if self.dp is not None:
            self.dp.after_step()
        if self.ep:
            end_step(self.ep, self.config.bias_update_rate)

    def remove_hooks(self) -> None:
        if self.dp is not None:
            self.dp.remove_hooks()
        super().remove_hooks()

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """The global-batch mean per step: the last stage's (pipeline), averaged over the data
        ranks, plus every stage's router losses."""
        if self.pipe is not None:
            local = self.pipe.reduce_losses(local)
        losses = super().reduce_losses(local)
        return self.routing.add_stage_losses(losses) if self.routing is not None else losses

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters this rank holds (its stages' under a pipeline), whole, by the
        single-process names, fp32 on the CPU (a collective over the axes that shard them)."""
        held = (None if self.pipe is None
                else [q for st in self.pipe.stages.values() for q in st.parameters()])
        return {n: t.cpu() for n, t in full_parameters(self.module, self.mesh, held).items()}

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer],
                       **kwargs: Any) -> torch.optim.Optimizer:
        """``optimizer_cls`` on ``parameters()``; under ZeRO-1 its state partitioned over each data
        group (``ShardedOptimizer``: the dense parameters' over dp x cp, the experts' over edp)."""
        params = list(self.parameters())
        if self.config.zero_stage != 1 or self.mesh.size("dp", "cp") == 1:
            return optimizer_cls(params, **kwargs)
        parts: list[torch.optim.Optimizer] = []
        for key, mine in R.by_data_axis(params).items():
            group = R.group_of(self.mesh, key)
            parts.append(ShardedOptimizer(mine, optimizer_cls, group=group, **kwargs)
                         if dist.get_world_size(group) > 1 else optimizer_cls(mine, **kwargs))
        return parts[0] if len(parts) == 1 else Optimizers(parts)


class Optimizers(torch.optim.Optimizer):
    """Several optimizers stepped as one (ZeRO-1 with experts: one partition per data group)."""

    def __init__(self, parts: Sequence[torch.optim.Optimizer]) -> None:
        self.parts = list(parts)
        super().__init__([p for o in self.parts for g in o.param_groups for p in g["params"]], {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for o in self.parts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none)


# --------------------------------------------------------------------------------------- the steps

Step = Callable[[Parallelized], None]


def tensor_parallel(run: Parallelized) -> None:
    """TP (and SP) over "tp": ``gpt_plan`` applied in place, the loss vocab-parallel."""
    if run.mesh.size("tp") > 1:
        group = run.mesh.group("tp")
        apply_tp(run.module, group, gpt_plan(run.module.config),
                 sequence_parallel=run.config.sequence_parallel)
        run.loss_fn = functools.partial(vocab_parallel_cross_entropy, group=group)


def context_parallel(run: Parallelized, **options: Any) -> None:
    """CP over "cp": ring (or all-gather, Ulysses) attention at the tokens' global positions.
    ``options``: ``apply_cp``'s (a kernel, a context)."""
    if run.mesh.size("cp") > 1:
        run.cp = apply_cp(run.module, run.mesh.group("cp"), layout=run.config.cp_layout,
                          attend=ATTEND[run.config.cp_algorithm], **options)
        run._hooks.extend(run.cp.hooks)


def expert_parallel(run: Parallelized, **options: Any) -> None:
    """EP over "ep": E/ep experts per MoE layer, the batch over dp x cp; ``options``: apply_ep's."""
    if run.mesh.size("ep") > 1:
        run.ep = apply_ep(run.module, run.mesh.group("ep"), run.mesh.group("dp", "cp"), **options)


def moe_routing(run: Parallelized) -> None:
    """An MoE's capacity, queues and router losses over dp x cp (``moe_mesh``): as on one process
    (the global scope) or each rank's own (``GPTConfig.capacity_scope="local"``)."""
    pipelined = run.mesh.size("pp") > 1
    run.routing = share_routing(run.module, run.mesh, cp_layout=run.config.cp_layout,
                                microbatches=run.config.microbatches if pipelined else None)


def pipeline_parallel(run: Parallelized, **options: Any) -> None:
    """PP over "pp": the model cut into this rank's stages; under SP the messages are s/tp tokens.
    ``options``: ``PipelineParallel``'s (an executor class, a split)."""
    if run.mesh.size("pp") == 1:
        return
    c, gb = run.config, run.global_batch
    run.pipe = apply_pp(run.module, run.mesh.group("pp"), schedule=c.schedule,
                        microbatches=c.microbatches, v=c.v,
                        global_batch=gb // run.mesh.size("dp") if gb else None, loss_fn=run.loss,
                        sequence_shards=run.mesh.size("tp") if c.sequence_parallel else 1,
                        **options)


def data_parallel(run: Parallelized) -> None:
    """Data parallelism over dp x cp, last: the only step reducing gradients (module docstring)."""
    mesh, zero, moe = run.mesh, run.config.zero_stage, bool(run.module.config.n_expert)
    if run.pipe is not None:
        pipe = run.pipe
        if zero == 3:
            hybrid = mesh.size("dp_replicate") > 1
            shard = "dp_shard" if hybrid else "dp"
            run.dp = StageSharding({int(k): st for k, st in pipe.stages.items()},
                                   mesh.group(shard, "cp"), groups=mesh,
                                   axis=shard + ("+cp" if mesh.size("cp") > 1 else ""),
                                   replicate_group=mesh.group("dp_replicate") if hybrid else None)
            pipe.connect(run.dp.reduce, engine=run.dp)
        else:
            run.dp = DataParallel(pipe.stages, mesh=mesh, mode="scheduled",
                                  find_unused_parameters=moe)
            pipe.connect(lambda stage: run.dp.launch(pipe.stage_parameters(stage)))
    elif zero == 3:
        run.dp = FSDP2DataParallel(run.module, mesh=mesh)
    elif zero == 2:
        run.dp = ZeroDataParallel(run.module, 2, mesh=mesh)
    else:
        run.dp = DataParallel(run.module, mesh=mesh, mode="bucketed", find_unused_parameters=moe)


STEPS: tuple[Step, ...] = (tensor_parallel, context_parallel, expert_parallel, moe_routing,
                           pipeline_parallel, data_parallel)


def with_step(steps: Sequence[Step], old: Step, new: Step) -> tuple[Step, ...]:
    """``steps`` with ``old`` replaced by ``new`` (a variant, or a test's mutation)."""
    if old not in steps:
        raise ValueError(f"{old.__name__} is not one of the steps {[s.__name__ for s in steps]}")
    return tuple(new if s is old else s for s in steps)


def parallelize(model: nn.Module, mesh: Mesh, config: ParallelConfig | None = None, *,
                global_batch: int | None = None, steps: Sequence[Step] = STEPS) -> Parallelized:
    """Apply every step to ``model`` in place on ``mesh`` with ``config``'s options (its shape must
    be the mesh's) and return the run. Every rank calls it with the same model (same seed)."""
    config = config or ParallelConfig(mesh.shape)
    if config.shape != mesh.shape:
        raise ValueError(f"rank {mesh.rank}: parallelize got a ParallelConfig for {config.shape} "
                         f"but the mesh {mesh.shape}: build the mesh from the config "
                         "(config.mesh())")
    check_composable(mesh.shape, model.config, sequence_parallel=config.sequence_parallel,
                     global_batch=global_batch, microbatches=config.microbatches, v=config.v,
                     zero_stage=config.zero_stage)
    run = Parallelized(model, mesh, config, global_batch)
    for step in steps:
        step(run)
    return run
