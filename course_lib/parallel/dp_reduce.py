"""Where each gradient is reduced, read from its placements: the one rule of data parallelism.

Only data parallelism reduces gradients (torchtitan's rule); the other axes only record placements:

* a trainable parameter is replicated over its **data group**: ``"dp+cp"`` (data- and
  context-parallel ranks hold other tokens of the same model), or ``"edp"`` for an expert (its
  copies live on the dp x cp / ep ranks holding the same experts). Its gradient is summed over that
  group and divided by W = dp x cp: each rank's loss is the mean over its own tokens, and the
  all-to-alls already summed an expert's gradient over its ep peers;
* a parameter recorded ``Partial()`` on an axis (a norm under sequence parallelism, replicated K/V
  heads under TP) holds only its share of the sum there: summed over that axis too, not divided.

Every data-parallel form applies it to what it owns (``DataParallel`` buckets, ZeRO flat units,
FSDP2 shards) through these helpers. Chapter 02 derives it; chapter 08 composes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.parallel.placement import Groups, Partial, axis_group, placements_of

DATA = "dp+cp"
EXPERT_DATA = "edp"


def data_axis(p: torch.Tensor) -> str:
    """The key of the group ``p``'s gradient is averaged over: "edp" for an expert, else "dp+cp"."""
    return EXPERT_DATA if EXPERT_DATA in placements_of(p) else DATA


def partial_axes(p: torch.Tensor) -> list[str]:
    """The axes where ``p``'s gradient is a partial sum (recorded ``Partial()``)."""
    return [a for a, where in placements_of(p).items() if isinstance(where, Partial)]


def by_data_axis(params: Iterable[nn.Parameter]) -> dict[str, list[nn.Parameter]]:
    """``params`` grouped by ``data_axis``, each group in the given order."""
    out: dict[str, list[nn.Parameter]] = {}
    for p in params:
        out.setdefault(data_axis(p), []).append(p)
    return out


def group_of(groups: Groups, key: str) -> comm.Group:
    """The group of axis key ``key`` in ``groups`` (a mesh or a map); if missing, the fix."""
    try:
        return axis_group(groups, key)
    except KeyError as e:
        raise KeyError(f"a gradient must be reduced over {key!r} but no group is given for it "
                       f"({e.args[0]}): build the data-parallel form with mesh= (a Mesh has every "
                       "axis)") from None


def flatten_grads(params: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """The gradients of ``params`` back to back in one buffer (a missing one counts as zeros)."""
    if not params:
        return torch.zeros(0)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])
    return flat if dtype is None else flat.to(dtype)


def write_grads(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Split ``flat`` back into each parameter's ``.grad`` (in place where one exists)."""
    for p, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
        chunk = chunk.view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)


def all_reduce_flat(flat: torch.Tensor, group: comm.Group, async_op: bool = False) -> Any:
    """Sum ``flat`` over ``group`` (none on one rank); the work handle if ``async_op``."""
    if dist.get_world_size(group) == 1:
        return None
    return comm.all_reduce(flat, group=group, async_op=async_op)


def sum_partials(params: Iterable[torch.Tensor], groups: Groups) -> None:
    """Sum each gradient recorded ``Partial()`` over its axis: one flat all-reduce per axis, in the
    order first met (the same on every rank). Once, after the data-parallel reduction."""
    params = [p for p in params if p.requires_grad]
    axes = list(dict.fromkeys(a for p in params for a in partial_axes(p)))
    for axis in axes:
        mine = [p for p in params if axis in partial_axes(p)]
        flat = flatten_grads(mine)
        all_reduce_flat(flat, group_of(groups, axis))
        write_grads(mine, flat)


def reduce_gradients(params: Iterable[torch.Tensor], groups: Groups, data_size: int) -> None:
    """The whole rule for ``params``, blocking: each data group's gradients summed (one flat
    all-reduce per group) and divided by ``data_size``, then the partial sums."""
    params = [p for p in params if p.requires_grad]
    for key, mine in by_data_axis(params).items():
        flat = flatten_grads(mine)
        all_reduce_flat(flat, group_of(groups, key))
        write_grads(mine, flat.div_(data_size))
    sum_partials(params, groups)


def broadcast_replicas(params: Iterable[torch.Tensor], groups: Groups) -> None:
    """Every parameter := its data group's first copy (one broadcast each): replicas start equal."""
    with torch.no_grad():
        for p in params:
            group = group_of(groups, data_axis(p))
            if dist.get_world_size(group) > 1:
                comm.broadcast(p.detach(), comm.global_rank(group, 0), group=group)
