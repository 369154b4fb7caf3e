"""ZeRO-1 at the optimizer level: ``ShardedOptimizer(params, optimizer_cls, **kw)``, for any model, no wrapper.

The shape of PyTorch's ``ZeroRedundancyOptimizer``: the parameters are partitioned over the N ranks of the
group, whole parameters each (greedy, largest first, to the least loaded rank -- so a rank holds about Ψ/N
of them), and each rank builds ``optimizer_cls`` over its partition only: Adam's m and v exist once over the
group, K Ψ / N bytes per rank instead of K Ψ (ZeRO stage 1, Rajbhandari et al. 2020, Sec. 5.1). ``step()``:

1. average the gradients over the group (one all-reduce per gradient, 2 (N-1)/N V bytes per rank; pass
   ``average_gradients=False`` when a data-parallel wrapper already did, as with ``ZeroRedundancyOptimizer``
   behind DDP);
2. every rank steps its own partition;
3. every parameter is broadcast from the rank that owns it, so every replica holds the updated weights
   ((N-1)/N V bytes per rank in total, the all-gather of ZeRO-1).

Parameters without a gradient on every rank are skipped by their owner's optimizer, as in one process.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.parallel.contract import HasGroups, broadcast_from_first, require_member, resolve_group


def partition(sizes: list[int], n: int) -> list[int]:
    """Owner rank of each parameter: largest first, each to the rank holding the fewest elements so far (ties:
    the lowest rank). Deterministic, so every rank computes the same partition."""
    load = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda q: (load[q], q))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_cls(<this rank's partition>, **kw)`` over ``group`` (or ``mesh.group("dp", "cp")``), see the
    module docstring. ``optimizer``: the local optimizer; ``owner[i]``: the group rank owning parameter i."""

    def __init__(self, params: Iterable[nn.Parameter], optimizer_cls: type[torch.optim.Optimizer], *,
                 mesh: HasGroups | None = None, group: comm.Group = None, average_gradients: bool = True,
                 broadcast: bool = True, **kwargs: Any) -> None:
        self.group = resolve_group(mesh, group, ("dp", "cp"), "ShardedOptimizer")
        require_member(self.group, "ShardedOptimizer")
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad]
        if not self.params:
            raise ValueError("ShardedOptimizer got no parameters that require grad")
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.average_gradients = average_gradients
        if broadcast:
            broadcast_from_first(_Holder(self.params), self.group)
        self.owner = partition([p.numel() for p in self.params], self.world_size)
        local = [p for p, r in zip(self.params, self.owner, strict=True) if r == self.rank]
        self.optimizer = optimizer_cls(local or [torch.zeros(0, device=self.params[0].device,
                                                             requires_grad=True)], **kwargs)
        super().__init__(self.params, kwargs)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("ShardedOptimizer.step takes no closure")
        if self.average_gradients and self.world_size > 1:
            used = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32,
                                device=self.params[0].device)
            comm.all_reduce(used, group=self.group)  # skip only what no rank has a gradient for
            for p, u in zip(self.params, used.tolist(), strict=True):
                if u:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    comm.all_reduce(p.grad, group=self.group)
                    p.grad.div_(self.world_size)
        self.optimizer.step()
        for p, r in zip(self.params, self.owner, strict=True):
            comm.broadcast(p, comm.global_rank(self.group, r), group=self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


class _Holder(nn.Module):
    """A module around loose parameters, to reuse ``broadcast_from_first``."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.held = nn.ParameterList(params)
