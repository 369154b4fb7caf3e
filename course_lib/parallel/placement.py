"""Where each parameter lives on the mesh: one placement per parameter and per mesh axis.

A parameter of a parallel model is one *logical* tensor (the single-process model's) spread over the ranks. For
each mesh axis it is, on that axis, in exactly one of three states (the names are PyTorch DTensor's, whose
``torch.distributed.tensor.placement_types`` this mirrors):

* ``Replicate()``: every rank of the axis holds the same values (DP replicas, a norm under TP);
* ``Shard(dim)``: the ranks of the axis hold consecutive slices of ``dim`` (rank r of n the r-th of n slices;
  when ``dim`` does not divide, the slices are ``ceil(size / n)`` long and the last ones padded, as
  ``fully_shard`` pads dim 0) -- a column-parallel weight is ``Shard(0)`` on ``tp``, a row-parallel one
  ``Shard(1)``, a ZeRO-3 / FSDP2 parameter ``Shard(0)`` on the data-parallel axes;
* ``Partial()``: a *gradient* state, not a weight one: the weight is replicated on the axis but each rank's
  gradient is only its share of the sum (a LayerNorm under sequence parallelism sees s/t tokens), so the true
  gradient is the sum over the axis.

Each transform of ``course_lib.parallel`` (TP, CP, PP, EP, data parallel / ZeRO) rewrites the model in place and
records here what it did to every parameter; the generic functions that need to know where a parameter lives
(gather the whole tensor, clip by the global norm counting each element once, reduce partial gradients, cut and
merge checkpoints) read only these records. An axis a parameter has no record for is ``Replicate()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ATTR = "_course_placements"


@dataclass(frozen=True)
class Replicate:
    """Every rank of the axis holds the whole (logical or already-sharded-by-other-axes) tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """The ranks of the axis hold consecutive slices of ``dim`` (padded to ``ceil(size / n)`` when n does not
    divide ``size``; ``size`` is the logical length, kept to strip the padding when gathering)."""

    dim: int
    size: int | None = None

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"Shard(dim={self.dim}): give the dimension as a non-negative index")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Partial:
    """The weight is replicated on the axis, but each rank's gradient is a partial sum: reduce it (sum) over the
    axis before the optimizer step."""

    def __str__(self) -> str:
        return "P"


Placement = Replicate | Shard | Partial


def placements_of(p: torch.Tensor) -> dict[str, Placement]:
    """The placements recorded on ``p``, axis -> placement (a copy; an axis not listed is ``Replicate()``)."""
    return dict(getattr(p, _ATTR, {}))


def placement(p: torch.Tensor, axis: str) -> Placement:
    """``p``'s placement on ``axis`` (``Replicate()`` when nothing was recorded)."""
    return getattr(p, _ATTR, {}).get(axis, Replicate())


def set_placement(p: torch.Tensor, axis: str, where: Placement) -> None:
    """Record that ``p`` is placed ``where`` on ``axis`` (the transforms call this for every parameter they
    change). A tensor sharded twice on one axis is refused: it would be one slice of a slice."""
    table = getattr(p, _ATTR, None)
    if table is None:
        table = {}
        setattr(p, _ATTR, table)
    old = table.get(axis)
    if isinstance(old, Shard) and isinstance(where, Shard) and old != where:
        raise ValueError(f"axis {axis!r} already shards this parameter as {old}; it cannot also be {where}")
    table[axis] = where


def copy_placements(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Give ``dst`` (a replacement parameter, e.g. a shard built from ``src``) ``src``'s placements."""
    for axis, where in placements_of(src).items():
        set_placement(dst, axis, where)


def describe(p: torch.Tensor, axes: tuple[str, ...]) -> str:
    """``p``'s placements on ``axes`` as DTensor prints them, e.g. ``"(S(0), R)"`` for ``("tp", "dp")``."""
    return "(" + ", ".join(str(placement(p, a)) for a in axes) + ")"
