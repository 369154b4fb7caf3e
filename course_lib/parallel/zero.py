"""ZeRO stages 0-3 over flat parameters (FSDP1's and DeepSpeed's form), from scratch.

ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054) partitions the model states over the N
data-parallel ranks. With Psi parameters, 16-bit weights and gradients and K optimizer bytes per
parameter, per rank (section 5)::

    stage 0  plain DP                         (2 + 2 + K) Psi
    stage 1  P_os      optimizer states       (2 + 2) Psi + K Psi / N
    stage 2  P_os+g    + gradients            2 Psi + (2 + K) Psi / N
    stage 3  P_os+g+p  + parameters           (2 + 2 + K) Psi / N

and per step 2 (N-1)/N V bytes for stages 0-2 (reduce-scatter + all-gather), 3 (N-1)/N V for stage 3
(V = Psi x bytes per element). A unit's parameters live in one flat buffer padded to a multiple of
N; rank r owns slice r (``zero_unit``); the ``sharding`` schedule gathers, frees and reduces the
units from hooks. Stage 1 reduce-scatters the full gradient buffer at the end of backward, stage 2
each unit once its gradients are complete. The parity runs are fp32 (4 + 4 + 8 bytes per parameter).
FSDP2's per-parameter form is ``fsdp2``; chapter 03 derives both and measures their memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from course_lib import comm
from course_lib.parallel import dp_reduce as R
from course_lib.parallel.contract import HasGroups, ParallelWrapper, broadcast_from_first
from course_lib.parallel.placement import Partial, placements_of
from course_lib.parallel.sharding import UnitSchedule, model_state_bytes
from course_lib.parallel.zero_unit import FlatParamUnit, default_units


def check_stage(stage: object) -> None:
    """The one check of a ZeRO stage (the library, the layouts and the planner call it)."""
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage!r}: the stages are 0 (replicated optimizer), "
                         "1 (optimizer state sharded over the data ranks), 2 (and gradients), "
                         "3 (and parameters: FSDP)")


class ZeroDataParallel(ParallelWrapper):
    """ZeRO ``stage`` 0-3 of ``module`` over ``mesh.group("dp", "cp")`` (Megatron's distributed
    optimizer shards over the data and context ranks) or ``group``:

        zdp = ZeroDataParallel(GPT(cfg), stage=3, prefetch=True)
        opt = make_optimizer(zdp.parameters(), tc)   # the shards: Psi/N elements per rank
        lm_loss(zdp(x), y).backward()                # stage 3: gathers and frees unit by unit
        zdp.finish_gradient_sync(); opt.step()       # each rank updates its own shard
        zdp.after_step()                             # stages 1/2: all-gather the updated parameters

    ``units``: modules bottom-up, the root last (``default_units``); ``reshard_after_forward``
    (stage 3): None frees every unit but the root (FSDP2's default), True every unit, False none;
    ``param_dtype``: the compute dtype (fp32 master shards). ``unit``: the unit factory
    (``FlatParamUnit``; a variant overrides ``average`` or ``bounds``). ``peak_bytes``: the largest
    weight / gradient bytes seen at any hook. With a mesh, ``Partial()`` parameters' slices of the
    flat gradient are summed over their axis."""

    def __init__(self, module: nn.Module, stage: int = 3, *, mesh: HasGroups | None = None,
                 group: comm.Group = None, units: Iterable[nn.Module] | None = None,
                 prefetch: bool = False, reshard_after_forward: bool | None = None,
                 param_dtype: torch.dtype = torch.float32, broadcast: bool = True,
                 unit: type[FlatParamUnit] = FlatParamUnit) -> None:
        check_stage(stage)
        super().__init__(module, mesh=mesh, group=group)
        self.stage, self.param_dtype, self.mesh = stage, param_dtype, mesh
        if broadcast:
            broadcast_from_first(module, self.group)
        self.events: list[tuple[str, str]] = []  # (collective, unit name) in issue order
        modules = list(default_units(module) if units is None else units)
        if not modules or modules[-1] is not module:
            raise ValueError("units are applied bottom-up: the last unit must be the root module "
                             "itself")
        paths = {m: name for name, m in module.named_modules()}
        owned: set[int] = set()
        self.units: list[FlatParamUnit] = []
        for m in modules:
            if m not in paths:
                raise ValueError(f"unit {type(m).__name__} is not a submodule of the model")
            prefix = paths[m] + "." if paths[m] else ""
            named = [(prefix + n, p) for n, p in m.named_parameters()
                     if p.requires_grad and id(p) not in owned]
            owned.update(id(p) for _, p in named)
            self.units.append(unit(paths[m], m, named, stage, self.group, param_dtype, self.events))
        self.root = self.units[-1]
        self.axis = "dp+cp" if getattr(mesh, "size", lambda _: 1)("cp") > 1 else "dp"
        """The axis key the shards are recorded on (their placements)."""
        for u in self.units:
            u.record_placements(self.axis)
            u.reshard_after_forward = (u is not self.root) if reshard_after_forward is None \
                else bool(reshard_after_forward)
        self.peak_bytes = {"parameters": 0, "gradients": 0}
        self.schedule = UnitSchedule(self.units, self.root, stage, prefetch,
                                     lambda: self._require_sync, self._sample)
        self._sample()

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The flat shards, one per unit: what this rank's optimizer updates."""
        return iter([s for u in self.units for s in u.optimizer_params()])

    def finish_gradient_sync(self) -> None:
        """Sum over their axes the ``Partial()`` parameters' slices of each rank's flat shard."""
        if self.mesh is not None:
            sum_partial_slices(self.units, self.mesh)

    def after_step(self) -> None:
        """Stages 1/2: all-gather the updated shards; 0/1: zero the full gradient buffers."""
        for u in self.units:
            u.refresh_full()
            u.zero_flat_grad()
        self.schedule.reduced_since_step = False
        self._sample()

    def remove_hooks(self) -> None:
        """Remove every hook; stage 3 first gathers every unit back (a collective)."""
        for u in self.units:
            u.unshard()
        self.schedule.remove()
        super().remove_hooks()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, full and fp32, by the model's names (a collective)."""
        out: dict[str, torch.Tensor] = {}
        for u in self.units:
            out.update(u.full_parameters())
        for name, p in self.module.named_parameters():  # frozen parameters were never sharded
            if name not in out:
                out[name] = p.detach().float().cpu().clone()
        return {name: out[name] for name, _ in self.module.named_parameters()}

    def _sample(self) -> None:
        now = model_state_bytes(self.units, self.param_dtype)
        for k in self.peak_bytes:
            self.peak_bytes[k] = max(self.peak_bytes[k], now[k])


def sum_partial_slices(units: Iterable[FlatParamUnit], mesh: HasGroups) -> None:
    """After each unit's reduce-scatter, rank r's shard [lo, hi) of the flat buffer holds the
    data-parallel mean of the parameters overlapping it; equal local shapes give every TP rank the
    same layout, so summing over an axis the elements of parameters recorded ``Partial()`` there
    completes their gradients: one flat all-reduce per axis, on every rank (maybe empty)."""
    units = list(units)
    views: dict[str, list[torch.Tensor]] = {}
    axes: set[str] = set()
    for u in units:
        lo, hi = u.bounds()
        for p, off, n in zip(u.params, u.layout.offsets, u.layout.numels, strict=True):
            a, b = max(lo, off), min(hi, off + n)
            for axis in (k for k, w in placements_of(p).items() if isinstance(w, Partial)):
                axes.add(axis)
                if a < b and u.shard.grad is not None:
                    views.setdefault(axis, []).append(u.shard.grad[a - lo:b - lo])
    for axis in sorted(axes):
        mine = views.get(axis, [])
        flat = torch.cat([v.reshape(-1) for v in mine]) if mine else torch.zeros(0)
        R.all_reduce_flat(flat, R.group_of(mesh, axis))
        offset = 0
        for v in mine:
            v.copy_(flat[offset:offset + v.numel()].view_as(v))
            offset += v.numel()
