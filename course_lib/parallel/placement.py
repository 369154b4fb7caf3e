"""Where each parameter lives: one placement per parameter and mesh axis (DTensor's names).

* ``Replicate()``: every rank of the axis holds the same values (DP replicas, a norm under TP);
* ``Shard(dim)``: the ranks hold consecutive slices of ``dim``, ``ceil(size / n)`` long (the last
  padded, as ``fully_shard`` pads dim 0): a column-parallel weight is ``Shard(0)`` on "tp";
* ``Partial()``: a *gradient* state: the weight is replicated but each rank's gradient is only its
  share of the sum (a norm under sequence parallelism sees s/t tokens): sum it over the axis.

Each axis rewrites the model in place and records here what it did; all that needs to know where a
parameter lives (data parallelism's reduction, gathering, clipping, checkpoints) reads only these
records. No record means ``Replicate()``. Records nest in the order made: ZeRO-3 of a TP weight is
``{"tp": Shard(0), "dp+cp": Shard(0)}``. An axis key names one group: ``"tp"``, or axes joined by
``+``. Expert parallelism records ``Shard(0, size=E)`` on "ep" on each layer's ``nn.ModuleList`` of
experts (a rank holds E/ep of them), and ``Replicate()`` on "edp" on each expert parameter: its
copies live on the expert-data-parallel ranks, where its gradient is reduced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from course_lib import comm
from course_lib.parallel.groups import HasGroups

_ATTR = "_course_placements"


@dataclass(frozen=True)
class Replicate:
    """Every rank of the axis holds the whole (logical or already-sharded-by-other-axes) tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """The ranks of the axis hold consecutive slices of ``dim``, padded to ``ceil(size / n)``;
    ``size``, the logical length, strips the padding when gathering (None: n divides it)."""

    dim: int
    size: int | None = None

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"Shard(dim={self.dim}): give the dimension as a non-negative index")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Partial:
    """The weight is replicated on the axis, but each rank's gradient is a partial sum: reduce it
    (sum) over the axis before the optimizer step."""

    def __str__(self) -> str:
        return "P"


Placement = Replicate | Shard | Partial

Placed = torch.Tensor | nn.Module
"""What carries placements: a parameter, or a module list split over an axis (module docstring)."""


Groups = HasGroups | Mapping[str, comm.Group]
"""Where the axes' groups come from: a mesh, or a map axis key -> group (for ``group=``)."""


def placements_of(p: Placed) -> dict[str, Placement]:
    """``p``'s placements, axis -> placement in the order recorded (a copy; unlisted: Replicate)."""
    return dict(getattr(p, _ATTR, {}))


def placement(p: Placed, axis: str) -> Placement:
    """``p``'s placement on ``axis`` (``Replicate()`` when nothing was recorded)."""
    return getattr(p, _ATTR, {}).get(axis, Replicate())


def set_placement(p: Placed, axis: str, where: Placement) -> None:
    """Record that ``p`` is placed ``where`` on ``axis`` (each axis does, for every parameter it
    changes). A tensor sharded twice on one axis is refused: it would be one slice of a slice."""
    table = getattr(p, _ATTR, None)
    if table is None:
        table = {}
        setattr(p, _ATTR, table)
    old = table.get(axis)
    if isinstance(old, Shard) and isinstance(where, Shard) and old != where:
        raise ValueError(f"axis {axis!r} already shards this parameter as {old}; "
                         f"it cannot also be {where}")
    table[axis] = where


def clear_placement(p: Placed, axis: str) -> None:
    """Forget ``p``'s record on ``axis`` (it is ``Replicate()`` there again): for a wrapper that
    places its own tensors anew (FSDP2's shards moved from "dp" to HSDP's "dp_shard")."""
    getattr(p, _ATTR, {}).pop(axis, None)


def copy_placements(src: Placed, dst: Placed) -> None:
    """Give ``dst`` (a replacement parameter, e.g. a shard of ``src``) ``src``'s placements."""
    for axis, where in placements_of(src).items():
        set_placement(dst, axis, where)


def axis_group(mesh: Groups, axis: str) -> comm.Group:
    """The process group of axis key ``axis`` (``"tp"``, ``"dp+cp"``) in ``mesh``."""
    if isinstance(mesh, Mapping):
        if axis not in mesh:
            raise KeyError(f"no group for axis {axis!r}: the groups given are for {sorted(mesh)}")
        return mesh[axis]
    return mesh.group(*axis.split("+"))
