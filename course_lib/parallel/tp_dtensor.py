"""PyTorch's own tensor parallelism, the second oracle of ``course_lib.parallel.tp``: the course's plan in DTensor's
styles for ``parallelize_module`` (``dtensor_plan``) and a log of the collectives DTensor issues, in ``comm``'s
records (``DTensorCommLog``), so that ``tp.train_dtensor_tp`` and ``tp.train_tp`` compare loss by loss,
parameter by parameter and collective by collective; ``DTensorTensorParallel`` puts DTensor's version behind the
wrapper contract, so both run the one training loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from course_lib import comm
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel.contract import HasGroups, LossFn, ParallelWrapper
from course_lib.runtime.launch import device

__all__ = ["DTensorCommLog", "DTensorTensorParallel", "dtensor_fsdp_tp_placements", "dtensor_plan"]


def dtensor_plan(cfg: GPTConfig, sequence_parallel: bool = False) -> dict[str, Any]:
    """The same plan in DTensor's styles (torchtitan's Llama plan, adapted to the course's GPT).

    ``PrepareModuleInput`` on the attention and MLP modules turns their input into one replicated DTensor that the
    q/k/v (gate/up) projections share: one f (SP: one all-gather) per region, as ours. Without it each
    ``ColwiseParallel`` linear converts its own plain input and backward all-reduces once per linear (3 + 1 per
    GELU block instead of 2). Learned positions cannot be added to a sequence-sharded embedding output here (a
    plain [T, h] table and a [B, T/t, h] shard), so SP needs ``pos="rope"``, as in torchtitan's models.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if sequence_parallel and cfg.pos == "learned":
        raise ValueError("the DTensor plan with sequence parallelism needs pos='rope' (see dtensor_plan)")
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "blocks.*.attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "blocks.*.attn.q_proj": ColwiseParallel(),
        "blocks.*.attn.k_proj": ColwiseParallel(),
        "blocks.*.attn.v_proj": ColwiseParallel(),
        "blocks.*.attn.o_proj": RowwiseParallel(output_layouts=seq),
        "blocks.*.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "blocks.*.mlp.fc1": ColwiseParallel(),
        "blocks.*.mlp.fc2": RowwiseParallel(output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if cfg.mlp == "swiglu":
        plan["blocks.*.mlp.gate"] = ColwiseParallel()
    if sequence_parallel:
        plan |= {"blocks.*.norm1": SequenceParallel(), "blocks.*.norm2": SequenceParallel(),
                 "norm_f": SequenceParallel()}
    return plan


def dtensor_fsdp_tp_placements(cfg: GPTConfig, dp: int, tp: int, block: int = 0
                               ) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """PyTorch's own FSDP + TP ("2D", torchtitan's default) of one block, as placements: ``parallelize_module``
    with ``dtensor_plan`` over the tp axis of a (dp, tp) ``init_device_mesh``, then ``fully_shard`` of block
    ``block`` over dp. Parameter name (inside the block) -> (its DTensor placements, its local shape). Every
    rank of the dp x tp ranks calls it (gloo on CPU runs it); nothing is trained."""
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


_DTENSOR_OPS = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
                "_allgather_base_": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                "_reduce_scatter_base_": "reduce_scatter"}


class DTensorCommLog:
    """Log the collectives DTensor issues, as ``comm.CommRecord``s (tensor_bytes by ``comm``'s convention: the
    gathered output of an all-gather, the input of a reduce-scatter; ring bytes per rank; no timings).

    A ``TorchDispatchMode`` sees each ``_c10d_functional`` / ``c10d`` op. Like DTensor's own ``CommDebugMode`` it
    returns ``NotImplemented`` for ops on DTensors, so that DTensor first lowers them to local ops and
    collectives, which the mode then sees (the vocab-parallel loss's all-reduces happen there).
    """

    def __init__(self, group_size: int, rank: int, into_comm: bool = False) -> None:
        self.group_size, self.rank, self.into_comm = group_size, rank, into_comm
        self.records: list[comm.CommRecord] = []

    def __enter__(self) -> DTensorCommLog:
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode

        log = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented
                out = func(*args, **(kwargs or {}))
                name = func.__name__.split(".")[0]
                if "c10d" in func.namespace and name in _DTENSOR_OPS:
                    log._add(_DTENSOR_OPS[name], args[0][0] if isinstance(args[0], (list, tuple)) else args[0])
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
        if self.into_comm:  # also into comm's log and open recordings (the training loop's per-step record)
            comm.add_record(record)


class DTensorTensorParallel(ParallelWrapper):
    """DTensor's ``parallelize_module`` with ``dtensor_plan`` behind the wrapper contract (PyTorch's production
    API; runs on gloo CPU), so the oracle runs the same loop as ours. The loss is computed under
    ``loss_parallel()`` on the vocab-sharded logits; DTensor reduces the replicated parameters' partial
    gradients itself (in the optimizer step, parameter by parameter). Its collectives are logged by a
    ``DTensorCommLog`` into ``comm``'s recordings while ``recording()`` is open."""

    axes = ("tp",)

    def __init__(self, module: GPT, *, mesh: HasGroups | None = None, group: comm.Group = None,
                 sequence_parallel: bool = False) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import parallelize_module

        super().__init__(module, mesh=mesh, group=group)
        cfg = module.config
        if cfg.kv_heads % self.world_size:
            raise ValueError(f"DTensor's ColwiseParallel splits k_proj's {cfg.kv_heads} K/V heads evenly: "
                             f"t={self.world_size} must divide n_kv_head")
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
