"""ZeRO-3 / FSDP2 under a pipeline: the schedule's actions, not autograd hooks, gather, free and reduce the shards.

The hook engine of ``zero`` follows *one* forward and *one* backward at a time: it gathers a unit at its forward,
frees it after, gathers it again at its backward and reduce-scatters its gradients as soon as they are complete.
A pipeline interleaves the m micro-batches of a step (1F1B: F0 F1 B0 F2 B1 ...), so "the backward" happens m
times per stage and the gradients are complete only after the stage's *last* one. Reducing after each would
reduce-scatter m times per step (DeepSpeed's ``PipelineEngine`` refuses ZeRO >= 2 for that reason).

``torch.distributed.pipelining`` (``stage.py``: ``backward_maybe_with_nosync`` and the ``REDUCE_GRAD`` action's
``perform_reduce_grad``; torchtitan's ``parallelize_llama`` applies ``fully_shard`` to each stage's blocks)
composes the two another way, which this module follows:

* every micro-batch's backward runs with ``set_requires_gradient_sync(False)`` /
  ``set_is_last_backward(False)`` / ``set_reshard_after_backward(False)``: the full (unsharded) gradients
  **accumulate on the stage** over the m micro-batches, nothing is reduced;
* the schedule's ``REDUCE_GRAD`` action of the stage (``schedule_run.add_grad_reduce``: after its last ``B``, or its
  last ``W`` under a split backward) turns the sync back on and runs FSDP's post-backward: **one reduce-scatter**
  of the accumulated gradients per step, the gradient shards averaged over the data-parallel group, the full
  gradients and weights freed;
* the weights are all-gathered before a stage computes (its ``F`` / ``B`` / ``I`` / ``W``) when they are not
  gathered already; ``reshard_after_forward=False`` (torchtitan's choice under a pipeline) keeps them gathered
  from the stage's first action of the step to its ``REDUCE_GRAD``; ``True`` frees them after every ``F`` (and
  keeps them after a ``B``, as ``set_reshard_after_backward(False)`` does), so the next ``B`` gathers again.

Here the executor calls ``before(action)`` / ``after(action)`` around each compute action and ``reduce(stage)``
at ``REDUCE_GRAD``: the schedule (data: each rank's action list) drives the engine, whatever the schedule.

Trade-off, per pipeline rank holding Ψ_s parameters of its stages, N data-parallel ranks, V = Ψ_s x 4 bytes
(fp32), m micro-batches, ring collectives (``zero``'s table), AdamW (8 bytes of state per parameter)::

    form                         dp traffic per step                model states per rank
    ZeRO-1 x PP (this library)   all-reduce 2 (N-1)/N V + the       4 Ψ_s weights + 4 Ψ_s grads + 8 Ψ_s / N
                                 owners' broadcast (N-1)/N V
    ZeRO-3 x PP, kept gathered   all-gather (N-1)/N V +             during the step ZeRO-1's + the 4 Ψ_s / N shards
                                 reduce-scatter (N-1)/N V           (weights gathered, gradients whole); between
                                                                    steps 4 Ψ_s / N + 8 Ψ_s / N (+ 4 Ψ_s / N grads)
    ZeRO-3 x PP, reshard after F about (m + 1) all-gathers + one    the weights gathered except from each F to the
                                 reduce-scatter                     next B; 4 Ψ_s grads from the first B on

Measured (``course_lib.measure.memtrack.MemoryTracker``, dp 2 x pp 2, a 4-layer d=256 GPT, m = 4, fp32 AdamW): the peak
of one rank is 25.8 MiB under ZeRO-1 and 30.0 MiB under ZeRO-3 (the gathered stage next to its shards), but
what stays resident between steps drops from 19.1 MiB to 12.6 MiB (weights and their gradients sharded).

The accumulation is what makes the unsharded gradients unavoidable during the step: sharding them after each
micro-batch would cost m reduce-scatters (ZeRO-2's saving, bought with m x the gradient traffic). So under a
pipeline ZeRO-3 saves the weights' and the optimizer's memory, not the gradients'; ZeRO-2 would save nothing
over ZeRO-1 and is refused (``config.ZERO_WITH_PIPELINE``).

Units: one per block of each stage (``fully_shard(block)``) and one for the rest of a stage (embeddings on the
first, final norm and head on the last), each a ``fsdp2.PerParameterUnit``: the module's parameters *are* the
dim-0 shards (FSDP2's contract), recorded ``Shard(0)`` on "dp" (or "dp+cp") on top of TP's records. Gradients
recorded ``Partial()`` on an axis (TP's replicated K/V, norms under SP) are summed over it in
``finish_gradient_sync`` (``fsdp2.sum_partial_shards``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from course_lib import comm
from course_lib.parallel.contract import broadcast_from_first, require_member
from course_lib.parallel.fsdp2 import PerParameterUnit, partial_shards, sum_partial_shards
from course_lib.parallel.pp_stages import Stage
from course_lib.parallel.schedules import Action, Kind

__all__ = ["StageSharding"]


class StageSharding:
    """FSDP2 per-parameter shards of one pipeline rank's stages over ``group`` (its data-parallel group), driven
    by the schedule's actions (module docstring). ``mesh``: what ``finish_gradient_sync`` sums partial
    gradients over (``mesh.group(axis)``); ``axis``: the key the shards are recorded on ("dp", "dp+cp").

    Seams: ``accumulate(unit)`` (what a ``B`` leaves of the full gradients: kept, to sum over the micro-batches)
    and ``reduce(stage)``."""

    unit_class: type[PerParameterUnit] = PerParameterUnit

    def __init__(self, stages: Mapping[int, Stage], group: comm.Group, *, mesh: object = None, axis: str = "dp",
                 reshard_after_forward: bool = False, param_dtype: torch.dtype = torch.float32) -> None:
        require_member(group, type(self).__name__)
        self.group, self.mesh, self.reshard_after_forward = group, mesh, reshard_after_forward
        self.sync = True  # False inside the pipeline's no_sync(): REDUCE_GRAD then only frees the weights
        self.events: list[tuple[str, str]] = []
        broadcast_from_first(nn.ModuleList(stages.values()), group)
        self.units: dict[int, list[PerParameterUnit]] = {}
        for s, stage in stages.items():
            named = dict(stage.named_parameters())
            units = []
            for i, block in stage.blocks.items():
                own = [(f"blocks.{i}.{n}", p) for n, p in block.named_parameters() if p.requires_grad]
                if own:
                    units.append(self.unit_class(f"blocks.{i}", block, own, 3, group, param_dtype, self.events))
            rest = [(n, p) for n, p in named.items() if not n.startswith("blocks.") and p.requires_grad]
            if rest:
                units.append(self.unit_class(f"stage{s}", stage, rest, 3, group, param_dtype, self.events))
            for unit in units:
                unit.record_placements(axis)
            self.units[s] = units
        every = [u for units in self.units.values() for u in units]
        self.partial = partial_shards(every, mesh is not None, type(self).__name__)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The shards (the stages' own parameters now): what this rank's optimizer steps."""
        return iter([q for units in self.units.values() for u in units for q in u.optimizer_params()])

    # ---- what the executor calls

    def before(self, action: Action) -> None:
        """Before a compute action of a stage: all-gather its units that are not gathered (no-op otherwise)."""
        for unit in self.units[action.stage]:
            unit.unshard()

    def after(self, action: Action) -> None:
        """After a compute action: free the weights after an ``F`` when ``reshard_after_forward``; after a
        backward, what ``accumulate`` says of the gradients."""
        if action.kind is Kind.F and self.reshard_after_forward:
            for unit in self.units[action.stage]:
                unit.reshard()
        elif action.kind in (Kind.B, Kind.W):
            for unit in self.units[action.stage]:
                self.accumulate(unit)

    def accumulate(self, unit: PerParameterUnit) -> None:
        """After a micro-batch's backward: the full gradients stay on the full weights, and the next backward
        adds into them (``set_requires_gradient_sync(False)``): nothing to do. A seam for the mutation tests."""

    def reduce(self, stage: int) -> None:
        """``REDUCE_GRAD`` of ``stage``: reduce-scatter each unit's accumulated full gradients into its shards'
        ``.grad`` (the mean over the group), free the full gradients and weights. Inside ``no_sync``: only free
        the weights (the gradients keep accumulating until a synchronising step)."""
        for unit in self.units[stage]:
            if self.sync:
                unit.accept_shard_grad(unit.reduce_gradients())
                unit.free_grads()
            unit.reshard()

    def finish_gradient_sync(self) -> None:
        """After the step's schedule: the partial gradient shards summed over their axis (TP's)."""
        if self.sync:
            sum_partial_shards(self.partial, self.mesh)

    def restore_full(self) -> None:
        """Give the stages full fp32 parameters again (a collective: the master shards are all-gathered), so that
        they run on their own with the current weights; the engine is spent."""
        for units in self.units.values():
            for unit in units:
                unit.restore_full()
