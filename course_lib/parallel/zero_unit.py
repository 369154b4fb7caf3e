"""One flat ZeRO / FSDP1 unit: the parameters of one module in one flat buffer, sharded over ranks.

``FlatLayout`` places each parameter in the buffer (padded to a multiple of N, rank r owning
elements [r S, (r+1) S)); ``FlatParamUnit`` gathers, frees and reduces it; ``default_units`` picks
the modules (every block, then the root). ``zero`` runs the units from ``sharding``'s hooks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.parallel import placement as P
from course_lib.parallel.sharding import UnitState

# ---------------------------------------------------------------------------------- the flat layout


def shard_bounds(rank: int, shard_numel: int) -> tuple[int, int]:
    """Rank r owns elements [r S, (r+1) S) of a unit's padded flat buffer (S = padded / N)."""
    return rank * shard_numel, (rank + 1) * shard_numel


@dataclass(frozen=True)
class FlatLayout:
    """How a unit's parameters sit in its flat buffer: parameter i from ``offsets[i]`` on, for
    ``numel(shapes[i])`` elements; ``numel`` = Ψ_u, their total; ``padded_numel``: Ψ_u rounded up
    to a multiple of ``world_size`` (zero padding, which gets zero gradients and stays zero under
    SGD/AdamW); each rank owns ``shard_numel`` = padded / N elements."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int
    padded_numel: int
    world_size: int

    @classmethod
    def build(cls, names: Sequence[str], shapes: Sequence[Sequence[int]],
              world_size: int) -> FlatLayout:
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        offsets, total = [], 0
        for s in shapes:
            offsets.append(total)
            total += math.prod(s)
        padded = -(-total // world_size) * world_size  # ceil to a multiple of N
        return cls(tuple(names), shapes, tuple(offsets), total, padded, world_size)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    def bounds(self, rank: int) -> tuple[int, int]:
        return shard_bounds(rank, self.shard_numel)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of ``flat``, shaped like the parameter (views: no copy)."""
        return [flat[o:o + n].view(s)
                for o, n, s in zip(self.offsets, self.numels, self.shapes, strict=True)]


# ----------------------------------------------------------------------------------------- one unit


def default_units(model: nn.Module) -> list[nn.Module]:
    """Units bottom-up: one per transformer block (``model.blocks``), then the root for the rest."""
    blocks = getattr(model, "blocks", None)
    return [*blocks, model] if isinstance(blocks, nn.ModuleList) else [model]


class FlatParamUnit:
    """The parameters of one module (minus those of units below it), flattened and sharded.

    * ``full``: the padded flat buffer in the compute dtype, viewed by the module's parameters.
      Stages 0-2 keep it; stage 3 frees it after use (``reshard``), re-fills it (``unshard``).
    * ``shard``: the ``nn.Parameter`` the optimizer sees, fp32, ``shard_numel`` elements (the whole
      buffer in stage 0). In fp32 stages 0-2 a *view* of the rank's chunk of ``full`` (no second
      copy: the optimizer updates the full buffer in place, the all-gather reads its input from the
      buffer it fills); else a separate tensor (stage 3's only resident weights; the fp32 master
      copy under mixed precision).
    * ``flat_grad``: the flat gradient buffer the ``.grad`` view: persistent in stages 0/1; in 2/3
      allocated at the unit's pre-backward, freed after its reduce-scatter.

    ``name``: the module's path ("blocks.0"; the root's is "")."""

    def __init__(self, name: str, module: nn.Module,
                 named_params: Sequence[tuple[str, nn.Parameter]], stage: int,
                 group: comm.Group = None, param_dtype: torch.dtype = torch.float32,
                 events: list[tuple[str, str]] | None = None) -> None:
        if not named_params:
            raise ValueError(f"unit {name!r} has no parameters of its own (all belong to units "
                             "below it)")
        self.name, self.module, self.stage, self.group = name, module, stage, group
        self.params, self.param_dtype = [p for _, p in named_params], param_dtype
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.events = events if events is not None else []
        shard_world = 1 if stage == 0 else self.world_size  # stage 0: plain DP, every rank owns all
        self.shard_rank = 0 if stage == 0 else self.rank
        names = [n for n, _ in named_params]
        self.layout = FlatLayout.build(names, [p.shape for p in self.params], shard_world)
        self.device = self.params[0].device
        lo, hi = self.bounds()
        with torch.no_grad():
            flat32 = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self.device)
            for view, p in zip(self.layout.views(flat32), self.params, strict=True):
                view.copy_(p.detach())
        self.aliased = stage < 3 and param_dtype == torch.float32
        if self.aliased:
            self.full = flat32
            self.shard = nn.Parameter(flat32[lo:hi])
        else:
            self.shard = nn.Parameter(flat32[lo:hi].clone())
            self.full = flat32.to(param_dtype) if stage < 3 else torch.empty(
                self.layout.padded_numel, dtype=param_dtype, device=self.device)
        for p, view in zip(self.params, self.layout.views(self.full), strict=True):
            p.data = view  # the module now computes with views into the full flat buffer
        self.flat_grad: torch.Tensor | None = None
        if stage < 2:
            self.install_grad_views()  # allocates the persistent buffer
        self.reshard_after_forward = True  # stage 3; ZeroDataParallel sets it per unit
        self.state = UnitState.UNSHARDED
        self._pending: tuple[Any, torch.Tensor] | None = None
        if stage == 3:
            self.full.untyped_storage().resize_(0)
            self.state = UnitState.SHARDED
        # per-backward bookkeeping
        self.grads_ready, self.backward_started, self.reduced = 0, False, False

    @property
    def label(self) -> str:
        return self.name or "(root)"

    # ---- what the engine and the memory accounting see

    flat = True
    """The parameters live in one flat buffer (what the sharded checkpoints read and write)."""

    axis = "dp"
    """The axis key of the unit's group (``record_placements``)."""

    def record_placements(self, axis: str) -> None:
        """Record where the flat shard lives: ``Shard(0, size=Ψ_u)`` on ``axis`` (Ψ_u elements
        padded to a multiple of N, rank r holding the r-th slice), or ``Replicate()`` in stage 0
        (every rank holds it all). The module's own parameters stay full (views of ``full``)."""
        self.axis = axis
        where = P.Shard(0, size=self.layout.numel) if self.layout.world_size > 1 else P.Replicate()
        P.set_placement(self.shard, axis, where)

    def optimizer_params(self) -> list[nn.Parameter]:
        """What the optimizer steps for this unit: its flat shard."""
        return [self.shard]

    def weight_tensors(self) -> list[torch.Tensor]:
        """The compute-dtype weights: the full flat buffer (0 bytes when resharded), its views."""
        return [self.full, *self.params]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the unit, full, fp32, on the CPU, by name (a collective over the
        group): the flat shards all-gathered, cut into the parameters."""
        flat = self.shard.detach().float()
        if self.layout.world_size > 1:
            flat = self.shard.new_empty(self.layout.padded_numel)
            comm.all_gather(flat, self.shard.detach(), group=self.group)
        return {name: view.cpu().clone()
                for name, view in zip(self.layout.names, self.layout.views(flat), strict=True)}

    # ---- the seams a variant overrides

    def bounds(self) -> tuple[int, int]:
        """The elements of the padded flat buffer this rank owns: ``shard_bounds(rank, S)``."""
        return self.layout.bounds(self.shard_rank)

    def average(self, g: torch.Tensor) -> None:
        """Sum -> mean (in place): a rank's loss averages its B/N rows, the baseline's all B."""
        g.div_(self.world_size)

    # ---- parameters

    def unshard(self, async_op: bool = False) -> None:
        """Stage 3: all-gather the shards into the full buffer (re-allocated first); else no-op."""
        if self.state is UnitState.UNSHARDED:
            return
        if self.state is UnitState.GATHERING:
            if not async_op:
                self.wait()
            return
        elem = self.full.element_size()
        self.full.untyped_storage().resize_(self.layout.padded_numel * elem)
        src = self.shard.detach().to(self.param_dtype)  # no copy in fp32; the bf16 cast otherwise
        work = comm.all_gather(self.full, src, group=self.group, async_op=async_op)
        self.events.append(("all_gather", self.name))
        if async_op:
            self._pending = (work, src)  # keep the input alive until the collective has read it
            self.state = UnitState.GATHERING
        else:
            self.state = UnitState.UNSHARDED

    def wait(self) -> None:
        if self.state is UnitState.GATHERING:
            assert self._pending is not None
            self._pending[0].wait()
            self._pending = None
            self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Stage 3: free the full weights (storage resized to 0 bytes; views keep their shape)."""
        if self.stage < 3 or self.state is UnitState.SHARDED:
            return
        self.wait()
        self.full.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

    def refresh_full(self) -> None:
        """After the optimizer step (stages 0-2): every rank's full parameters := the updated ones
        (stages 1/2 all-gather the shards, in place when a shard views ``full``)."""
        if self.stage == 3:
            return
        if self.stage == 0:
            if not self.aliased:
                with torch.no_grad():
                    self.full.copy_(self.shard)
            return
        lo, hi = self.bounds()
        src = self.full[lo:hi] if self.aliased else self.shard.detach().to(self.param_dtype)
        comm.all_gather(self.full, src, group=self.group)
        self.events.append(("all_gather", self.name))

    # ---- gradients

    def install_grad_views(self) -> None:
        """Point each ``.grad`` at its slice of the flat gradient buffer (zeros if new)."""
        if self.flat_grad is None:
            self.flat_grad = torch.zeros(self.layout.padded_numel, dtype=self.param_dtype,
                                         device=self.device)
        for p, view in zip(self.params, self.layout.views(self.flat_grad), strict=True):
            if p.grad is None:
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():  # replaced (e.g. by module.zero_grad())
                view.copy_(p.grad)
                p.grad = view

    def reduce_gradients(self) -> torch.Tensor:
        """Reduce this unit's gradients, return its shard's (for ``shard.grad``): stage 0
        all-reduces the whole flat gradient; stage 1 reduce-scatters *in place* (my chunk of the
        full buffer receives the sum; the buffer stays until the next step); stages 2/3
        reduce-scatter into a fresh shard-sized tensor and free the full buffer."""
        self.install_grad_views()  # a no-op unless the pre-backward hook did not run for this unit
        flat = self.flat_grad
        assert flat is not None
        if self.stage == 0:
            comm.all_reduce(flat, group=self.group)
            self.events.append(("all_reduce", self.name))
            g = flat
        elif self.stage == 1:
            lo, hi = self.bounds()
            g = flat[lo:hi]
            comm.reduce_scatter(g, flat, group=self.group)
            self.events.append(("reduce_scatter", self.name))
        else:
            g = torch.empty(self.layout.shard_numel, dtype=flat.dtype, device=flat.device)
            comm.reduce_scatter(g, flat, group=self.group)
            self.events.append(("reduce_scatter", self.name))
        self.average(g)
        self.reduced = True
        return g

    def accept_shard_grad(self, g: torch.Tensor) -> None:
        g32 = g if g.dtype == torch.float32 else g.float()
        if self.shard.grad is None or self.shard.grad.data_ptr() == g32.data_ptr():
            self.shard.grad = g32
        else:  # gradient accumulation over several backward passes (stages 2/3)
            self.shard.grad += g32

    def free_grads(self) -> None:
        """Stages 2/3: drop the full gradients once reduce-scattered."""
        if self.stage >= 2:
            for p in self.params:
                p.grad = None
            self.flat_grad = None

    def zero_flat_grad(self) -> None:
        if self.stage < 2 and self.flat_grad is not None:
            self.flat_grad.zero_()
