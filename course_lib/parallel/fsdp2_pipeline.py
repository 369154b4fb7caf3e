"""FSDP2 under a pipeline: schedule actions, not autograd hooks, gather, free and reduce the shards.

The hook schedule (``sharding``) follows one forward and one backward at a time; a pipeline
interleaves the m micro-batches of a step (1F1B: F0 F1 B0 F2 B1 ...), and a stage's gradients are
complete only after its last backward. As ``torch.distributed.pipelining`` runs ``fully_shard``
stages (``set_requires_gradient_sync(False)`` for every micro-batch, the reduction at the stage's
``REDUCE_GRAD`` action; torchtitan's FSDP x TP x PP):

* before a stage computes (F, B, I, W) its units are all-gathered when they are not (``before``);
  ``reshard_after_forward=False`` (torchtitan's choice) keeps them until ``REDUCE_GRAD``, True frees
  them after every F (``after``);
* the full gradients **accumulate on the stage** over the m micro-batches; ``REDUCE_GRAD``
  (``reduce``) reduce-scatters them once per step into the shards' gradients (the data ranks' mean),
  then frees.

So under a pipeline ZeRO-3 saves the weights' and the optimizer's memory, not the gradients'; ZeRO-2
would save nothing over ZeRO-1 (refused, ``config.ZERO_WITH_PIPELINE``). HSDP: the shards replicated
over ``dp_replicate``, all-reduced there after the reduce-scatter, as in ``fsdp2``. Chapters 05, 08.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from course_lib import comm
from course_lib.parallel import dp_reduce as R
from course_lib.parallel.contract import broadcast_from_first, require_member
from course_lib.parallel.fsdp2 import PerParameterUnit
from course_lib.parallel.schedules import Action, Kind


class StageSharding:
    """FSDP2 per-parameter shards of one pipeline rank's ``stages`` over ``group`` (its data ranks),
    driven by the schedule's actions (module docstring): the data-parallel form of a pipeline rank
    under ZeRO-3 (the loop's ``no_sync``, ``finish_gradient_sync``, ``after_step``). ``groups``:
    where the partial gradients are summed (a mesh); ``axis``: the key the shards are recorded on;
    ``replicate_group``: HSDP's replicas. Seam: ``accumulate(unit)``, what a backward leaves of the
    full gradients."""

    def __init__(self, stages: Mapping[int, nn.Module], group: comm.Group, *, groups: R.Groups,
                 axis: str = "dp", replicate_group: comm.Group = None,
                 reshard_after_forward: bool = False,
                 param_dtype: torch.dtype = torch.float32) -> None:
        require_member(group, type(self).__name__)
        self.group, self.groups, self.reshard_after_forward = group, groups, reshard_after_forward
        self.sync = True  # False inside no_sync(): REDUCE_GRAD then only frees the weights
        self.events: list[tuple[str, str]] = []
        broadcast_from_first(nn.ModuleList(stages.values()), group)
        self.units: dict[int, list[PerParameterUnit]] = {}
        replicate_axis = "dp_replicate" if replicate_group is not None else None
        for s, stage in stages.items():
            units = []
            for i, block in stage.blocks.items():
                own = [(f"blocks.{i}.{n}", p) for n, p in block.named_parameters()
                       if p.requires_grad]
                if own:
                    units.append(PerParameterUnit(f"blocks.{i}", block, own, 3, group,
                                                  param_dtype, self.events))
            rest = [(n, p) for n, p in stage.named_parameters()
                    if not n.startswith("blocks.") and p.requires_grad]
            if rest:
                units.append(PerParameterUnit(f"stage{s}", stage, rest, 3, group, param_dtype,
                                              self.events))
            for unit in units:
                if replicate_group is not None:
                    unit.set_replicate(replicate_group)
                    for pad in unit.padded:
                        comm.broadcast(pad, comm.global_rank(replicate_group, 0),
                                       group=replicate_group)
                unit.record_placements(axis, replicate_axis)
            self.units[s] = units

    def parameters(self) -> Iterator[nn.Parameter]:
        """The shards (the stages' own parameters now): what this rank's optimizer steps."""
        return iter([q for units in self.units.values() for u in units
                     for q in u.optimizer_params()])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        saved, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = saved

    # ---- what the executor calls

    def before(self, action: Action) -> None:
        """Before a compute action of a stage: all-gather its units that are not gathered."""
        for unit in self.units[action.stage]:
            unit.unshard()

    def after(self, action: Action) -> None:
        """After a compute action: free the weights after an F when ``reshard_after_forward``; after
        a backward, what ``accumulate`` says of the gradients."""
        if action.kind is Kind.F and self.reshard_after_forward:
            for unit in self.units[action.stage]:
                unit.reshard()
        elif action.kind in (Kind.B, Kind.W):
            for unit in self.units[action.stage]:
                self.accumulate(unit)

    def accumulate(self, unit: PerParameterUnit) -> None:
        """After a micro-batch's backward the full gradients stay on the full weights and the next
        backward adds into them (``set_requires_gradient_sync(False)``): nothing to do. A seam for
        mutations."""

    def reduce(self, stage: int) -> None:
        """``REDUCE_GRAD`` of ``stage``: each unit's accumulated gradients reduce-scattered into its
        shards' ``.grad`` (the mean over the data ranks), the full gradients and weights freed.
        Inside ``no_sync``: only the weights freed (the gradients keep accumulating)."""
        for unit in self.units[stage]:
            if self.sync:
                unit.accept_shard_grad(unit.reduce_gradients())
                unit.free_grads()
            unit.reshard()

    # ---- the loop's steps

    def finish_gradient_sync(self) -> None:
        """After the step's schedule: the partial gradient shards summed over their axes (TP's)."""
        if self.sync:
            R.sum_partials(self.parameters(), self.groups)

    def after_step(self) -> None:
        """Nothing: the next step's actions gather the updated shards."""

    def remove_hooks(self) -> None:
        """Full fp32 parameters back in the stages (a collective): the engine is spent."""
        for units in self.units.values():
            for unit in units:
                unit.restore_full()
