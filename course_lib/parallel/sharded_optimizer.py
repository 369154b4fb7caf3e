"""ZeRO-1 at the optimizer level: ``ShardedOptimizer(params, optimizer_cls, **kw)``, shaped like
PyTorch's ``ZeroRedundancyOptimizer``.

The parameters are partitioned over the N ranks of the group, whole tensors each (largest first, to
the least loaded rank: about Psi/N per rank), and each rank builds ``optimizer_cls`` over its
partition only, so Adam's m and v exist once over the group: K Psi / N bytes per rank instead of K
Psi (ZeRO stage 1, Rajbhandari et al. 2020, section 5.1). ``step()``: every rank steps its own
partition, then every parameter is broadcast from its owner, (N-1)/N V bytes per rank in all
(ZeRO-1's all-gather).

The gradients must already be averaged, as behind DDP: data parallelism reduces them
(``dp.DataParallel``), this optimizer only shards the state. Parameters without a gradient are
skipped by their owner, as on one process. Chapter 03 derives the bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.parallel.contract import HasGroups, require_member, resolve_group


def partition(sizes: list[int], n: int) -> list[int]:
    """Owner rank of each parameter: largest first, each to the rank holding the fewest elements so
    far (ties: the lowest rank). Deterministic, so every rank computes the same partition."""
    load = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda q: (load[q], q))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_cls(<this rank's partition>, **kw)`` (``optimizer``) over ``group`` or
    ``mesh.group("dp", "cp")``; ``owner[i]``: the group rank owning parameter i."""

    def __init__(self, params: Iterable[nn.Parameter],
                 optimizer_cls: type[torch.optim.Optimizer], *, mesh: HasGroups | None = None,
                 group: comm.Group = None, **kwargs: Any) -> None:
        self.group = resolve_group(mesh, group, ("dp", "cp"), "ShardedOptimizer")
        require_member(self.group, "ShardedOptimizer")
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad]
        if not self.params:
            raise ValueError("ShardedOptimizer got no parameters that require grad")
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.owner = partition([p.numel() for p in self.params], self.world_size)
        local = [p for p, r in zip(self.params, self.owner, strict=True) if r == self.rank]
        self.optimizer = optimizer_cls(local or [torch.zeros(0, device=self.params[0].device,
                                                             requires_grad=True)], **kwargs)
        super().__init__(self.params, kwargs)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("ShardedOptimizer.step takes no closure")
        self.optimizer.step()
        for p, r in zip(self.params, self.owner, strict=True):
            comm.broadcast(p, comm.global_rank(self.group, r), group=self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
