"""Every axis of a mesh as one in-place transform of the model, applied in one documented order.

Each ``apply_*`` rewrites the model it is given (a ``GPT``, possibly already transformed by the axes before it)
and records, per parameter and axis, where the parameter now lives (``placement``: ``Shard(dim)``, ``Partial()``
or ``Replicate()``). Nothing wraps the whole model until the last step, so each transform sees the real modules
the previous ones left: the pipeline cuts TP- and CP-transformed blocks, ZeRO-3 shards TP shards again. The order
is torchtitan's ``parallelize_llama`` (TP, then CP, then FSDP) with Megatron's pipeline cut after the layers are
built:

1. ``apply_tp(model, mesh, plan, sequence_parallel=)``: the plan is data (module pattern -> style,
   ``tp.gpt_plan``); layers become their column / row / vocab-parallel forms, in place;
2. ``apply_cp(model, group, layout=, algorithm=)`` (``cp.apply_cp``): attention over the cp ring and the tokens'
   global positions, inside the model (pre-hooks on the model and its position embedding), no wrapper;
3. ``apply_ep(model, mesh)``: a mixture-of-experts model keeps E/ep experts per layer (``ExpertParallel``, whose
   dense data-parallel average it also is; with the other axes: ``ep_mesh``);
4. ``apply_pp(model, mesh, ...)``: the (transformed) model is cut into this rank's stages;
5. ``apply_data_parallel(model, mesh, zero=, pipe=)``: last, because it must see exactly the parameters this rank
   trains. It reads the placements and shards on top of them, over the group ``"dp+cp"`` (CP ranks hold other
   tokens of the same rows: for the gradient they are data-parallel ranks, torchtitan's ``dp_shard_cp``):

   * ``zero=0`` / ``1``: gradients averaged (a bucketed ``DataParallel``, or the pipeline's ``REDUCE_GRAD``
     action); ZeRO-1's sharded optimizer is built on ``parameters()`` by the caller (``ShardedOptimizer``);
   * ``zero=2``: the flat ``ZeroDataParallel`` (gradients reduce-scattered unit by unit, Rajbhandari et al.
     2020); a flat shard of a TP rank's unit holds the same element range on every TP rank (same local shapes),
     so the ``Partial`` segments of it are summed over tp after the reduce-scatter (``reduce_partial_flat``);
   * ``zero=3``: FSDP2's per-parameter form (``fsdp2.FSDP2DataParallel``): each local tensor cut on dim 0
     again, recorded ``Shard(0)`` on ``"dp"`` (or ``"dp+cp"``) after what TP recorded -- torchtitan's
     FSDP + TP "2D". On a mesh with ``dp_replicate`` > 1 this is HSDP: the shards live on ``"dp_shard"``
     (``"dp_shard+cp"``) and are replicated over ``"dp_replicate"`` (reduce-scatter, then all-reduce of the
     shard). The split is the mesh's (``ParallelConfig(dp_replicate=)``, torchtitan's ``dp_replicate`` x
     ``dp_shard``), not a keyword here: the groups and the rank layout must be built with the mesh, on every
     rank, before any transform runs.

   With a pipeline, ``zero=3`` shards each stage's parameters the same way (``pipe.enable_sharding``,
   ``pp_fsdp``): the schedule's actions gather them, the full gradients accumulate over the micro-batches and
   the stage's ``REDUCE_GRAD`` reduce-scatters them once per step (``torch.distributed.pipelining`` with
   ``fully_shard``, torchtitan's FSDP x TP x PP). Refused, with the reason: ZeRO-2 with a pipeline
   (``ZERO_WITH_PIPELINE``): the accumulated gradients are unsharded until the last micro-batch anyway, so it
   would save nothing over ZeRO-1, and sharding them per micro-batch costs m reduce-scatters per step (the
   reason DeepSpeed's ``PipelineEngine`` asserts ZeRO stage < 2).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from course_lib import comm
from course_lib.model import GPT
from course_lib.parallel import placement as P
from course_lib.parallel.config import HSDP_NEEDS_FSDP, HSDP_WITH_PIPELINE, ZERO_WITH_PIPELINE
from course_lib.parallel.cp import apply_cp
from course_lib.parallel.dp import DataParallel
from course_lib.parallel.ep import ExpertParallel
from course_lib.parallel.fsdp2 import FSDP2DataParallel
from course_lib.parallel.pp import LossFn, PipelineExecutor, PipelineParallel
from course_lib.parallel.schedules import Schedule
from course_lib.parallel.tp import Style, TensorParallel
from course_lib.parallel.zero import ZeroDataParallel
from course_lib.parallel.zero_unit import FlatParamUnit
from course_lib.runtime.mesh import Mesh

__all__ = ["ZERO_WITH_PIPELINE", "apply_cp", "apply_data_parallel", "apply_ep", "apply_pp", "apply_tp",
           "reduce_partial_flat"]


def apply_tp(model: GPT, mesh: Mesh, plan: Mapping[str, Style] | None = None, *, sequence_parallel: bool = False,
             tp_class: type[TensorParallel] = TensorParallel) -> TensorParallel | None:
    """Tensor (and sequence) parallelism over ``mesh.group("tp")``, in place: ``plan`` (default
    ``tp.gpt_plan``) applied to ``model``'s modules, each parameter recorded ``Shard(dim)``, ``Partial()`` or
    ``Replicate()`` on "tp". Returns the ``TensorParallel`` handle (its vocab-parallel ``loss``), None when
    tp = 1."""
    if mesh.size("tp") == 1:
        return None
    return tp_class(model, mesh=mesh, plan=plan, sequence_parallel=sequence_parallel)


def apply_ep(model: GPT, mesh: Mesh, *, ep_class: type[ExpertParallel] = ExpertParallel) -> ExpertParallel | None:
    """Expert parallelism over ``mesh.group("ep")`` (``ExpertParallel``: E/ep experts per MoE layer, the module
    list recorded ``Shard(0)`` on "ep", expert gradients summed over "edp", dense ones averaged over dp x cp;
    with the other axes: ``ep_mesh``). None when ep = 1."""
    return ep_class(model, mesh=mesh) if mesh.size("ep") > 1 else None


def apply_pp(model: GPT, mesh: Mesh, *, schedule: str | Schedule = "1f1b", microbatches: int = 2, v: int = 1,
             global_batch: int | None = None, loss_fn: LossFn, sequence_parallel: bool = False,
             pipeline_class: type[PipelineParallel] = PipelineParallel,
             executor_class: type[PipelineExecutor] = PipelineExecutor) -> PipelineParallel | None:
    """Cut ``model`` (whatever the axes before did to it) into this rank's stages over ``mesh.group("pp")``.
    Its data-parallel average is ``apply_data_parallel``'s to add (``grad_group``). Under sequence parallelism
    the messages are the sequence-sharded hidden states (s/tp tokens). None when pp = 1."""
    if mesh.size("pp") == 1:
        return None
    return pipeline_class(model, mesh=mesh, schedule=schedule, microbatches=microbatches, v=v,
                          global_batch=global_batch // mesh.size("dp") if global_batch else None, loss_fn=loss_fn,
                          executor_class=executor_class,
                          sequence_shards=mesh.size("tp") if sequence_parallel else 1)


def apply_data_parallel(model: nn.Module, mesh: Mesh, *, zero: int = 0, pipe: PipelineParallel | None = None,
                        data_parallel_class: type[DataParallel] = DataParallel,
                        fsdp_class: type[FSDP2DataParallel] = FSDP2DataParallel) -> nn.Module | None:
    """Data parallelism (ZeRO stage ``zero``) over ``mesh.group("dp", "cp")`` on top of the placements the other
    axes left (module docstring). With a pipeline, the stage's average is the schedule's ``REDUCE_GRAD`` action
    (``pipe.grad_group`` set here); otherwise the returned module wraps ``model``: a bucketed ``DataParallel``
    (zero 0 / 1), a flat ``ZeroDataParallel`` (2) or ``FSDP2DataParallel`` (3). None when there is nothing to
    average over."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero}: the ZeRO stages are 0, 1, 2 and 3")
    if mesh.size("dp_replicate") > 1 and zero != 3:
        raise ValueError(HSDP_NEEDS_FSDP.format(replicate=mesh.size("dp_replicate"), stage=zero))
    if mesh.size("dp", "cp") == 1:
        return None
    group = mesh.group("dp", "cp")
    if pipe is not None:
        if zero == 2:
            raise ValueError(ZERO_WITH_PIPELINE)
        if mesh.size("dp_replicate") > 1:
            raise ValueError(HSDP_WITH_PIPELINE.format(replicate=mesh.size("dp_replicate")))
        if zero == 3:
            pipe.enable_sharding(group, mesh=mesh, axis="dp+cp" if mesh.size("cp") > 1 else "dp")
        else:
            pipe.enable_grad_reduce(group)
        return None
    if zero == 3:
        return fsdp_class(model, mesh=mesh)
    if zero == 2:
        return ZeroDataParallel(model, 2, mesh=mesh)
    return data_parallel_class(model, group=group, mode="bucketed")


def reduce_partial_flat(units: Iterable[FlatParamUnit], groups: P.Groups) -> None:
    """Sum over each axis the segments of the flat gradient shards that belong to parameters recorded
    ``Partial()`` there (a norm under SP, replicated GQA K/V): after a unit's reduce-scatter over dp, rank r's
    shard ``[lo, hi)`` of the unit's flat buffer holds, for each parameter overlapping it, the dp-mean of that
    parameter's slice; on every TP rank the same slice (equal local shapes give equal layouts), so the sum over
    tp of those elements completes the gradient. One flat all-reduce per axis; every rank of the axis issues it
    (a rank whose shard holds no Partial element sends an empty one; the TP ranks of one dp rank hold the
    same segments)."""
    by_axis: dict[str, list[torch.Tensor]] = {}
    for unit in units:
        if not unit.flat or unit.shard.grad is None:
            continue
        lo, hi = unit.bounds()
        for p, off, n in zip(unit.params, unit.layout.offsets, unit.layout.numels, strict=True):
            a, b = max(lo, off), min(hi, off + n)
            for axis, where in P.placements_of(p).items():
                if isinstance(where, P.Partial) and a < b:
                    by_axis.setdefault(axis, []).append(unit.shard.grad[a - lo:b - lo])
    axes = sorted({a for unit in units for p in unit.params for a, w in P.placements_of(p).items()
                   if isinstance(w, P.Partial)})
    for axis in axes:
        views = by_axis.get(axis, [])
        flat = torch.cat([v.reshape(-1) for v in views]) if views else torch.zeros(0)
        comm.all_reduce(flat, group=P.axis_group(groups, axis))
        offset = 0
        for v in views:
            v.copy_(flat[offset:offset + v.numel()].view_as(v))
            offset += v.numel()
