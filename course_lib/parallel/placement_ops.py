"""What reads placements across a whole model: the whole tensors (gathered or cut), every parameter
by its single-process name, the ranks' results merged, the global gradient norm and its clipping, a
table. (``placement`` holds the records; every function here is a collective over the axes a
parameter's records name.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.parallel.placement import (
    Groups,
    Placed,
    Shard,
    axis_group,
    placement,
    placements_of,
)


def _size_rank(mesh: Groups, axis: str) -> tuple[comm.Group, int, int]:
    g = axis_group(mesh, axis)
    return g, dist.get_world_size(g), dist.get_rank(g)


# --------------------------------------------------------------------------------------------------
# One tensor: gather it whole, cut a whole one


def full_tensor(p: torch.Tensor, mesh: Groups, value: torch.Tensor | None = None) -> torch.Tensor:
    """The whole logical tensor of ``p`` (or of ``value``, a tensor shaped and placed like ``p``:
    its gradient or optimizer state), every ``Shard`` undone by an all-gather along its dim over its
    axis, the last recorded first, padding stripped (a collective over those axes: every rank calls
    it). fp32 on ``p``'s device."""
    t = (p if value is None else value).detach().float()
    gathered = False
    for axis, where in reversed(list(placements_of(p).items())):
        if not isinstance(where, Shard):
            continue
        g, n, _ = _size_rank(mesh, axis)
        if n == 1:
            continue
        front = t.movedim(where.dim, 0).contiguous()
        # torch.chunk's short last pieces (FSDP2): padded
        if where.size is not None and front.shape[0] < math.ceil(where.size / n):
            pad = math.ceil(where.size / n) - front.shape[0]
            front = torch.cat([front, front.new_zeros((pad, *front.shape[1:]))])
        out = front.new_empty((n * front.shape[0], *front.shape[1:]))
        comm.all_gather(out, front, group=g)
        if where.size is not None:
            out = out[:where.size]
        t, gathered = out.movedim(0, where.dim), True
    return t.contiguous() if gathered else t.clone()


def shard_like(full: torch.Tensor, p: torch.Tensor, mesh: Groups) -> torch.Tensor:
    """This rank's piece of the whole tensor ``full`` as ``p`` is placed: every ``Shard`` applied in
    the order recorded (slices of ``ceil(size / n)``, the last zero-padded). No communication; the
    inverse of ``full_tensor``. Raises when the result does not fit ``p``'s shape."""
    t = full
    shards = [(axis, where) for axis, where in placements_of(p).items() if isinstance(where, Shard)]
    for i, (axis, where) in enumerate(shards):
        _, n, r = _size_rank(mesh, axis)
        size = t.shape[where.dim]
        c = math.ceil(size / n)
        if c * n != size:
            pad = list(t.shape)
            pad[where.dim] = c * n - size
            t = torch.cat([t, t.new_zeros(pad)], dim=where.dim)
        t = t.narrow(where.dim, r * c, c)
        # the last cut kept unpadded (FSDP2's pieces are torch.chunk's: the last ones shorter)
        if i == len(shards) - 1 and p.dim() == t.dim() and p.shape[where.dim] < c:
            t = t.narrow(where.dim, 0, p.shape[where.dim])
    if t.shape != p.shape:
        raise ValueError(f"a whole tensor of shape {tuple(full.shape)} cut as {placements_of(p)} "
                         f"gives {tuple(t.shape)}, not the parameter's {tuple(p.shape)}")
    return t.to(device=p.device, dtype=p.dtype).clone()


# --------------------------------------------------------------------------------------------------
# A model: every parameter whole; the ranks' results joined


def sharded_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList, str, Shard]]:
    """Each module list of ``model`` split over an axis (experts): (name, list, axis, Shard)."""
    return [(name, m, axis, where) for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList)
            for axis, where in placements_of(m).items() if isinstance(where, Shard)]


def full_parameters(model: nn.Module, mesh: Groups, held: Iterable[torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` whole, fp32, by the single-process model's names (a collective
    over the axes its placements name: every rank calls it). Module lists split over an axis are
    gathered entry by entry and named by their global index. ``held``: only these parameters (a
    pipeline stage's); the others are left out, for ``merge_parameters`` to join with the other
    stages'."""
    keep = None if held is None else {id(p) for p in held}
    in_list = {id(p) for _, m, _, _ in sharded_lists(model) for p in m.parameters()}
    out = {name: full_tensor(p, mesh) for name, p in model.named_parameters()
           if id(p) not in in_list and (keep is None or id(p) in keep)}
    for name, experts, axis, where in sharded_lists(model):
        if keep is not None and not any(id(p) in keep for p in experts.parameters()):
            continue
        g, n, _ = _size_rank(mesh, axis)
        for pname, _ in experts[0].named_parameters():
            local = torch.stack([full_tensor(e.get_parameter(pname), mesh) for e in experts])
            stacked = local.new_empty((n * local.shape[0], *local.shape[1:]))
            comm.all_gather(stacked, local, group=g)
            for e in range(where.size if where.size is not None else stacked.shape[0]):
                out[f"{name}.{e}.{pname}"] = stacked[e].clone()
    return out


def merge_parameters(per_rank: Sequence[Mapping[str, torch.Tensor]],
                     ranks: Sequence[int] | None = None, *,
                     exclusive: bool = False) -> dict[str, torch.Tensor]:
    """Join the ranks' whole parameters (each rank's ``full_parameters``) into one map, every name
    once. Every copy of a parameter (data-parallel replicas, TP ranks after the gather) must be
    bit-for-bit equal: a replica that drifted is a bug, named with its ranks. ``exclusive``: no name
    may come from two ranks (pure pipeline parallelism: every parameter on exactly one stage)."""
    ranks = list(range(len(per_rank))) if ranks is None else list(ranks)
    params: dict[str, torch.Tensor] = {}
    holder: dict[str, int] = {}
    for rank, part in zip(ranks, per_rank, strict=True):
        twice = sorted(set(params) & set(part))
        if exclusive and twice:
            raise ValueError(f"parameters held by two ranks: {twice}")
        for name, t in part.items():
            if name not in params:
                params[name], holder[name] = t, rank
            elif not torch.equal(params[name], t):
                diff = (params[name] - t).abs().max().item()
                raise ValueError(f"{name} differs between rank {holder[name]} and rank {rank} "
                                 f"(max |diff| {diff:.3g}): replicas drifted apart")
    return params


# --------------------------------------------------------------------------------------------------
# Gradients: the global norm, every element counted once


def _sum_axes(model_or_params: nn.Module | Iterable[torch.Tensor], disjoint: Sequence[str]
              ) -> list[tuple[torch.Tensor, tuple[str, ...]]]:
    """Each trainable parameter and the axes its squares are summed over: those that shard it, those
    of a module list it belongs to, and ``disjoint`` (axes whose ranks hold different parameters). A
    parameter whose gradient is None (an expert no token reached) stays in: it counts as zeros, so
    that every rank issues the same all-reduces whatever gradients it happens to hold."""
    if isinstance(model_or_params, nn.Module):
        lists = {id(p): axis for _, m, axis, _ in sharded_lists(model_or_params)
                 for p in m.parameters()}
        params = list(model_or_params.parameters())
    else:
        lists, params = {}, list(model_or_params)
    out = []
    for p in params:
        if not p.requires_grad:
            continue
        axes = [a for a, w in placements_of(p).items() if isinstance(w, Shard)]
        if id(p) in lists:
            axes.append(lists[id(p)])
        out.append((p, tuple(dict.fromkeys([*axes, *disjoint]))))
    return out


def grad_norm(model_or_params: nn.Module | Iterable[torch.Tensor], mesh: Groups,
              disjoint: Sequence[str] = ()) -> torch.Tensor:
    """The global L2 norm of the gradients, every element of the logical model counted once: the
    squares of each parameter summed locally (fp32), then over every axis that holds different
    pieces of it (its shards, its module list's ranks, ``disjoint``); replicated and
    ``Partial``-then-reduced gradients are equal on every rank of their axis and count once. Every
    rank of those axes calls it, with parameters placed alike."""
    pairs = _sum_axes(model_or_params, disjoint)
    if not pairs:
        return torch.zeros(())
    acc: dict[tuple[str, ...], torch.Tensor] = {}
    device = pairs[0][0].device
    for p, axes in pairs:
        sq = (p.grad.detach().float().pow(2).sum() if p.grad is not None
              else torch.zeros((), device=device))
        acc[axes] = (acc[axes] + sq if axes in acc
                     else torch.zeros((), dtype=torch.float32, device=device) + sq)
    total = acc.pop((), torch.zeros((), dtype=torch.float32, device=device))
    for axes, sq in acc.items():
        for axis in axes:
            comm.all_reduce(sq, group=axis_group(mesh, axis))
        total = sq + total
    return total.sqrt()


def clip_grad_norm_(model_or_params: nn.Module | Iterable[torch.Tensor], max_norm: float,
                    mesh: Groups, eps: float = 1e-6, disjoint: Sequence[str] = ()) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model placed on a mesh: scale every gradient by
    min(1, max_norm / (norm + eps)), norm = ``grad_norm``. Returns the norm before clipping."""
    if not isinstance(model_or_params, nn.Module):
        model_or_params = list(model_or_params)
    norm = grad_norm(model_or_params, mesh, disjoint)
    pairs = _sum_axes(model_or_params, disjoint)
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    for p, _ in pairs:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return norm


def placement_table(model: nn.Module, axes: Sequence[str],
                    prefix: str = "") -> list[dict[str, Any]]:
    """One row per parameter whose name starts with ``prefix``: its name, local shape and placement
    per axis (``describe``'s letters), for printing what the transforms recorded."""
    return [{"parameter": name, "local shape": tuple(p.shape),
             **{a: str(placement(p, a)) for a in axes}}
            for name, p in model.named_parameters() if name.startswith(prefix)]


def describe(p: Placed, axes: Sequence[str]) -> str:
    """``p``'s placements on ``axes`` as DTensor prints them: ``"(S(0), R)"`` for
    ``("tp", "dp")``."""
    return "(" + ", ".join(str(placement(p, a)) for a in axes) + ")"
