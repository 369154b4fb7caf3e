"""PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) behind the course's wrapper contract: the production
API as a second oracle for ``course_lib.parallel.zero`` and ``course_lib.parallel.fsdp2``, run on the same units
(every transformer block, then the root) and the same training loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.model_config import GPTConfig
from course_lib.parallel.contract import HasGroups, ParallelWrapper
from course_lib.parallel.loop import ModelFn, build_model, train_loop
from course_lib.parallel.zero_unit import default_units
from course_lib.train import TrainConfig, TrainResult, make_optimizer

__all__ = ["TorchFullyShard", "train_fsdp2"]


class TorchFullyShard(ParallelWrapper):
    """PyTorch's FSDP2 behind the wrapper contract: ``fully_shard`` on every block, then on the root, over a
    1-D device mesh of the group's ranks on the rank's device type. Parameters become DTensors sharded on dim 0
    (per parameter, not flat); gradients are reduce-scattered and divided by N, like ours. ``param_dtype`` /
    ``reduce_dtype``: its ``MixedPrecisionPolicy`` (fp32 = no policy; ``reduce_dtype`` None = ``param_dtype``)."""

    axes = ("dp", "cp")

    def __init__(self, module: nn.Module, *, mesh: HasGroups | None = None, group: comm.Group = None,
                 reshard_after_forward: bool | None = None, param_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype | None = None) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        super().__init__(module, mesh=mesh, group=group)
        device_type = next(module.parameters()).device.type
        dmesh = DeviceMesh.from_group(self.group or dist.group.WORLD, device_type)
        policy = MixedPrecisionPolicy(param_dtype=None if param_dtype == torch.float32 else param_dtype,
                                      reduce_dtype=reduce_dtype)
        for block in default_units(module)[:-1]:
            fully_shard(block, mesh=dmesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(module, mesh=dmesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)


def train_fsdp2(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
                reshard_after_forward: bool | None = None, *, accumulation: int = 1, mesh: HasGroups | None = None,
                group: comm.Group = None, model_fn: ModelFn | None = None,
                freeze: Sequence[str] = ()) -> TrainResult:
    """The same training with PyTorch's FSDP2 (``TorchFullyShard``), the production API as a second oracle."""
    tc = tc or TrainConfig()
    model = build_model(cfg, tc.seed, model_fn, freeze)
    fsdp = TorchFullyShard(model, mesh=mesh, group=group, reshard_after_forward=reshard_after_forward)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], tc)
    out = train_loop(fsdp, opt, cfg, tc, data_rank=fsdp.rank, data_size=fsdp.world_size, accumulation=accumulation)
    params = {name: p.full_tensor().detach().float().cpu().clone() for name, p in model.named_parameters()}
    return TrainResult(out.losses, params)
