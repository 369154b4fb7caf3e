"""PyTorch's own implementations behind the same contract: the second oracle of every form.

The course's forms are checked against one process (``train_baseline``) and, where PyTorch has a
native API that runs on gloo CPU, against it, running the same training loop on the same batches:
``DistributedDataParallel`` (``TorchDDP``), FSDP2's ``fully_shard`` (``TorchFullyShard``), DTensor's
``parallelize_module`` with ``loss_parallel`` (``DTensorTensorParallel``, its plan ``dtensor_plan``
and a log of its collectives in ``comm``'s records, ``DTensorCommLog``),
``torch.distributed.pipelining`` (``TorchPipeline``) and the differentiable
``all_to_all_single_autograd`` (``TorchAllToAllMoE``). Their traffic goes straight to
``torch.distributed``: only DTensor's is logged. Each chapter shows its oracle by the course's form.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel.contract import HasGroups, LossFn, ParallelWrapper
from course_lib.parallel.dp import DEFAULT_BUCKET_MB
from course_lib.parallel.ep import ExpertParallelMoE
from course_lib.parallel.fsdp2 import default_units
from course_lib.parallel.loop import ModelFn, build_model, train_loop
from course_lib.parallel.pp_stages import build_stages, named_subset, plan_pipeline
from course_lib.parallel.runs import PPResult, TPResult
from course_lib.runtime.launch import device
from course_lib.train import TrainConfig, TrainResult, copy_parameters, make_optimizer


class TorchDDP(ParallelWrapper):
    """PyTorch's ``DistributedDataParallel`` behind the wrapper contract (the same loop runs it)."""

    def __init__(self, module: nn.Module, *, mesh: HasGroups | None = None,
                 group: comm.Group = None, bucket_mb: float = DEFAULT_BUCKET_MB,
                 find_unused_parameters: bool = False) -> None:
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(module, mesh=mesh, group=group)
        self.ddp = DistributedDataParallel(module, process_group=self.group,
                                           bucket_cap_mb=bucket_mb,
                                           find_unused_parameters=find_unused_parameters)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.ddp.no_sync()


def train_torch_ddp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
                    bucket_mb: float = DEFAULT_BUCKET_MB, accumulation: int = 1,
                    find_unused_parameters: bool = False, *, mesh: HasGroups | None = None,
                    group: comm.Group = None, model_fn: ModelFn | None = None,
                    freeze: Sequence[str] = ()) -> TrainResult:
    """The same loop with PyTorch's ``DistributedDataParallel`` (the production API; second oracle).
    Its traffic goes straight to ``torch.distributed`` and is not in the comm log."""
    tc = tc or TrainConfig()
    model = build_model(cfg, tc.seed, model_fn, freeze)
    ddp = TorchDDP(model, mesh=mesh, group=group, bucket_mb=bucket_mb,
                   find_unused_parameters=find_unused_parameters)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], tc)
    out = train_loop(ddp, opt, cfg, tc, data_rank=ddp.rank, data_size=ddp.world_size,
                     accumulation=accumulation)
    return TrainResult(out.losses, copy_parameters(model))


class TorchFullyShard(ParallelWrapper):
    """PyTorch's FSDP2 behind the wrapper contract: ``fully_shard`` on every block, then on the
    root, over a 1-D device mesh of the group's ranks on the rank's device type. Parameters become
    DTensors sharded on dim 0 (per parameter, not flat); gradients are reduce-scattered and divided
    by N, like ours. ``param_dtype`` / ``reduce_dtype``: its ``MixedPrecisionPolicy`` (fp32 = no
    policy; ``reduce_dtype`` None = ``param_dtype``)."""

    axes = ("dp", "cp")

    def __init__(self, module: nn.Module, *, mesh: HasGroups | None = None,
                 group: comm.Group = None, reshard_after_forward: bool | None = None,
                 param_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype | None = None) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        super().__init__(module, mesh=mesh, group=group)
        device_type = next(module.parameters()).device.type
        dmesh = DeviceMesh.from_group(self.group or dist.group.WORLD, device_type)
        compute = None if param_dtype == torch.float32 else param_dtype
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce_dtype)
        for unit in default_units(module):  # every block, then the root
            fully_shard(unit, mesh=dmesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=policy)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)


def train_fsdp2(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
                reshard_after_forward: bool | None = None, *, accumulation: int = 1,
                mesh: HasGroups | None = None, group: comm.Group = None,
                model_fn: ModelFn | None = None, freeze: Sequence[str] = ()) -> TrainResult:
    """The same training with PyTorch's FSDP2 (``TorchFullyShard``), the production oracle."""
    tc = tc or TrainConfig()
    model = build_model(cfg, tc.seed, model_fn, freeze)
    fsdp = TorchFullyShard(model, mesh=mesh, group=group,
                           reshard_after_forward=reshard_after_forward)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], tc)
    out = train_loop(fsdp, opt, cfg, tc, data_rank=fsdp.rank, data_size=fsdp.world_size,
                     accumulation=accumulation)
    params = {name: p.full_tensor().detach().float().cpu().clone()
              for name, p in model.named_parameters()}
    return TrainResult(out.losses, params)


def dtensor_plan(cfg: GPTConfig, sequence_parallel: bool = False) -> dict[str, Any]:
    """The same plan in DTensor's styles (torchtitan's Llama plan, adapted to the course's GPT).

    ``PrepareModuleInput`` on the attention and MLP modules turns their input into one replicated
    DTensor that the q/k/v (gate/up) projections share: one f (SP: one all-gather) per region, as
    ours. Without it each ``ColwiseParallel`` linear converts its own plain input and backward
    all-reduces once per linear (3 + 1 per GELU block instead of 2). Learned positions cannot be
    added to a sequence-sharded embedding output here (a plain [T, h] table and a [B, T/t, h]
    shard), so SP needs ``pos="rope"``, as in torchtitan's models.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if sequence_parallel and cfg.pos == "learned":
        raise ValueError("the DTensor plan with sequence parallelism needs pos='rope' "
                         "(see dtensor_plan)")
    seq = Shard(1) if sequence_parallel else Replicate()
    gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "blocks.*.attn": gather,
        "blocks.*.attn.q_proj": ColwiseParallel(),
        "blocks.*.attn.k_proj": ColwiseParallel(),
        "blocks.*.attn.v_proj": ColwiseParallel(),
        "blocks.*.attn.o_proj": RowwiseParallel(output_layouts=seq),
        "blocks.*.mlp": gather,
        "blocks.*.mlp.fc1": ColwiseParallel(),
        "blocks.*.mlp.fc2": RowwiseParallel(output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    if cfg.mlp == "swiglu":
        plan["blocks.*.mlp.gate"] = ColwiseParallel()
    if sequence_parallel:
        plan |= {"blocks.*.norm1": SequenceParallel(), "blocks.*.norm2": SequenceParallel(),
                 "norm_f": SequenceParallel()}
    return plan


def dtensor_fsdp_tp_placements(cfg: GPTConfig, dp: int, tp: int, block: int = 0
                               ) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """PyTorch's own FSDP + TP ("2D", torchtitan's default) of one block, as placements:
    ``parallelize_module`` with ``dtensor_plan`` over the tp axis of a (dp, tp)
    ``init_device_mesh``, then ``fully_shard`` of block ``block`` over dp. Parameter name (inside
    the block) -> (its DTensor placements, its local shape). Every rank of the dp x tp ranks calls
    it (gloo on CPU runs it); nothing is trained."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from course_lib.model import GPT

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = GPT(cfg, seed=0)
    parallelize_module(model, mesh["tp"], dtensor_plan(cfg))
    fully_shard(model.blocks[block], mesh=mesh["dp"])
    return {name: (tuple(str(x) for x in p.placements), tuple(p.to_local().shape))
            for name, p in model.blocks[block].named_parameters()}


_DTENSOR_OPS = {"all_reduce": "all_reduce", "allreduce_": "all_reduce",
                "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather",
                "reduce_scatter_tensor": "reduce_scatter",
                "_reduce_scatter_base_": "reduce_scatter"}


class DTensorCommLog:
    """Log the collectives DTensor issues, as ``comm.CommRecord``s (tensor_bytes by ``comm``'s
    convention: the gathered output of an all-gather, the input of a reduce-scatter; ring bytes per
    rank; no timings).

    A ``TorchDispatchMode`` sees each ``_c10d_functional`` / ``c10d`` op. Like DTensor's own
    ``CommDebugMode`` it returns ``NotImplemented`` for ops on DTensors, so that DTensor first
    lowers them to local ops and collectives, which the mode then sees (the vocab-parallel loss's
    all-reduces happen there).
    """

    def __init__(self, group_size: int, rank: int, into_comm: bool = False) -> None:
        self.group_size, self.rank, self.into_comm = group_size, rank, into_comm
        self.records: list[comm.CommRecord] = []

    def __enter__(self) -> DTensorCommLog:
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode

        log = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(  # type: ignore[no-untyped-def]
                    self, func, types, args=(), kwargs=None):
                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented
                out = func(*args, **(kwargs or {}))
                name = func.__name__.split(".")[0]
                if "c10d" in func.namespace and name in _DTENSOR_OPS:
                    first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
                    log._add(_DTENSOR_OPS[name], first)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)

    def _add(self, op: str, t: torch.Tensor) -> None:
        n = self.group_size
        numel = t.numel() * (n if op == "all_gather" else 1)
        sent, recv = comm.ring_bytes(op, numel, t.element_size(), n, self.rank)
        record = comm.CommRecord(op, "dtensor", n, numel * t.element_size(), sent, recv, None)
        self.records.append(record)
        if self.into_comm:  # also into comm's log and open recordings (the loop's per-step record)
            comm.add_record(record)


class DTensorTensorParallel(ParallelWrapper):
    """DTensor's ``parallelize_module`` with ``dtensor_plan`` behind the wrapper contract (PyTorch's
    production API; runs on gloo CPU), so the oracle runs the same loop as ours. The loss is
    computed under ``loss_parallel()`` on the vocab-sharded logits; DTensor reduces the replicated
    parameters' partial gradients itself (in the optimizer step, parameter by parameter). Its
    collectives are logged by a ``DTensorCommLog`` into ``comm``'s recordings while ``recording()``
    is open."""

    axes = ("tp",)

    def __init__(self, module: GPT, *, mesh: HasGroups | None = None, group: comm.Group = None,
                 sequence_parallel: bool = False) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import parallelize_module

        super().__init__(module, mesh=mesh, group=group)
        cfg = module.config
        if cfg.kv_heads % self.world_size:
            raise ValueError(f"DTensor's ColwiseParallel splits k_proj's {cfg.kv_heads} K/V heads "
                             f"evenly: t={self.world_size} must divide n_kv_head")
        dev = device().type
        self.device_mesh = DeviceMesh.from_group(self.group or torch.distributed.group.WORLD, dev)
        parallelize_module(module, self.device_mesh, dtensor_plan(cfg, sequence_parallel))

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None = None,
                         scale: float = 1.0) -> float:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = (loss_fn or lm_loss)(self(x), y) * scale
            loss.backward()
        return loss.item()

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """The same loss on every rank: nothing to reduce."""
        return local.to(torch.float32)

    @contextlib.contextmanager
    def recording(self) -> Iterator[DTensorCommLog]:
        """Log DTensor's collectives into the active ``comm.recording()`` blocks while open."""
        with DTensorCommLog(self.world_size, self.rank, into_comm=True) as log:
            yield log

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (``DTensor.full_tensor``: an all-gather per sharded parameter)."""
        from torch.distributed.tensor import DTensor

        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
                for n, p in self.module.named_parameters()}


def train_dtensor_tp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None, *,
                     sequence_parallel: bool = False, group: comm.Group = None) -> TPResult:
    """The same training with DTensor (``DTensorTensorParallel``) through ``loop.train_loop``.
    ``step_comm`` holds the collectives DTensor issued each step (``DTensorCommLog``), the optimizer
    step included (DTensor all-reduces the norms' partial gradients there, parameter by
    parameter)."""
    tc = tc or TrainConfig()
    dt = DTensorTensorParallel(build_model(cfg, tc.seed), group=group,
                               sequence_parallel=sequence_parallel)
    opt = make_optimizer(list(dt.parameters()), tc)
    with dt.recording():
        out = train_loop(dt, opt, cfg, tc, data_rank=0, data_size=1)
    return TPResult(out.losses, dt.full_parameters(), out.step_comm, timeline=out.timeline)


class TorchPipeline(ParallelWrapper):
    """``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` /
    ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``) on the same stages as
    ``PipelineParallel``, behind the wrapper contract, so that the production API, the second
    oracle, runs the same training loop. Its loss_fn returns each micro-batch's mean loss and the
    schedule divides the accumulated gradients by m (``scale_grads=True``, the default): the same
    1/m. Its transfers are not logged."""

    axes = ("pp",)

    def __init__(self, module: nn.Module, *, mesh: HasGroups | None = None,
                 group: comm.Group = None, schedule: str = "1f1b", microbatches: int = 4,
                 v: int = 1, split: Sequence[int] | None = None,
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
        self.plan = plan_pipeline(cfg, self.world_size, schedule, microbatches, v, split,
                                  global_batch)
        self.stages = build_stages(cfg, self.plan, self.rank, model=module)
        device = next(module.parameters()).device
        pipe_stages = [PipelineStage(st, s, self.plan.n_stages, device, group=self.group)
                       for s, st in self.stages.items()]
        single = {"gpipe": ScheduleGPipe, "one_f_one_b": Schedule1F1B}
        multi = {"interleaved_one_f_one_b": ScheduleInterleaved1F1B,
                 "zb_h1": ScheduleInterleavedZeroBubble}
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
        raise NotImplementedError("a pipeline runs forward_backward(x, y), one pass of its "
                                  "schedule")

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None = None,
                         scale: float = 1.0) -> float:
        """One ``schedule.step``: the mean micro-batch loss on the last stage's rank (else 0)."""
        if scale != 1.0:
            raise ValueError("the pipeline splits the batch into its own micro-batches: run it "
                             "with accumulation=1")
        has_first, has_last = 0 in self.stages, self.plan.n_stages - 1 in self.stages
        losses: list[torch.Tensor] = []
        self.runner.step(*((x,) if has_first else ()), target=y if has_last else None,
                         losses=losses if has_last else None)
        return float(torch.stack(losses).detach().mean()) if has_last else 0.0

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """Only the last stage computes the losses: broadcast them from its rank."""
        losses = local.to(torch.float32)
        last = comm.global_rank(self.group, self.plan.rank_of(self.plan.n_stages - 1))
        comm.broadcast(losses, src=last, group=self.group)
        return losses


def train_torch_pp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
                   schedule: str = "1f1b", microbatches: int = 4, v: int = 1,
                   split: Sequence[int] | None = None, group: comm.Group = None) -> PPResult:
    """The same training with ``torch.distributed.pipelining`` (``TorchPipeline``) through
    ``loop.train_loop``: the production API, as a second oracle."""
    tc = tc or TrainConfig()
    pipe = TorchPipeline(build_model(cfg, tc.seed), group=group, schedule=schedule,
                         microbatches=microbatches, v=v, split=split, global_batch=tc.global_batch)
    opt = make_optimizer(list(pipe.parameters()), tc)
    out = train_loop(pipe, opt, cfg, tc, data_rank=0, data_size=1)
    return PPResult(out.losses, named_subset(pipe.module, list(pipe.stages.values())),
                    rank=pipe.rank, stages=sorted(pipe.stages), plan=pipe.plan,
                    step_comm=out.step_comm)


class TorchAllToAllMoE(ExpertParallelMoE):
    """The same layer with PyTorch's differentiable all-to-all,
    ``torch.distributed._functional_collectives.all_to_all_single_autograd`` (what torchtitan's MoE
    uses; a private module, pinned to the course's torch): the second oracle. Its traffic is not in
    the comm log."""

    def all_to_all(self, rows: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> torch.Tensor:
        from torch.distributed import _functional_collectives as fc

        group = self.ep_group if self.ep_group is not None else dist.group.WORLD
        moved = fc.all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, group)
        return fc.wait_tensor(moved)
