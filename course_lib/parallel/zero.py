"""ZeRO stages 0-3 and FSDP, from scratch: flat-parameter sharding, unit-by-unit gathering, sharded checkpoints.

Data parallelism (chapter 02) keeps a full copy of every *model state* on every rank. ZeRO (Rajbhandari et al.
2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC'20, arXiv:1910.02054) removes
that redundancy by partitioning the states over the N_d data-parallel ranks; PyTorch FSDP (Zhao et al. 2023,
"PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 16(12), arXiv:2304.11277) is the
production form of the last stage. With Ψ parameters, K optimizer bytes per parameter and 16-bit weights and
gradients, the model states per rank are (ZeRO, Sec. 5 and Figure 1;
``course_lib.estimates.model_states.zero_memory_per_device``)::

    stage 0  plain DP                         (2 + 2 + K) Ψ
    stage 1  P_os      optimizer states       (2 + 2) Ψ + K Ψ / N_d
    stage 2  P_os+g    + gradients            2 Ψ + (2 + K) Ψ / N_d
    stage 3  P_os+g+p  + parameters           (2 + 2 + K) Ψ / N_d

The parity tests run in fp32: 4 (weights) + 4 (grads) + K = 8 (Adam m and v) = 16 bytes per parameter, so the
same table reads 4Ψ + 4Ψ + 8Ψ with the divisions by N_d above. (Mixed precision: K = 12 = 4 master + 4 + 4.)

Communication per rank and training step, ring collectives (``course_lib.comm``), V = Ψ x bytes per element::

    stage 0     all-reduce of the gradients                     2 (N-1)/N V
    stage 1, 2  reduce-scatter gradients + all-gather params    (N-1)/N V + (N-1)/N V = 2 (N-1)/N V
    stage 3     all-gather forward + all-gather backward + RS   3 (N-1)/N V   (ZeRO Sec. 7.2.2: 1.5x DP)

Stage 1 here reduce-scatters (not all-reduces) the gradients: every rank needs the reduced gradient only for
the shard it updates, so the all-reduce's second half would be wasted; DeepSpeed does the same. What separates
stage 1 from stage 2 is *when* and *what is kept*: stage 1 lets the backward pass fill a full gradient buffer
(Ψ per rank, kept until the step) and reduce-scatters it afterwards; stage 2 reduce-scatters each unit's
gradients as soon as backward has produced them and frees the full ones, keeping only Ψ/N_d.

Exact byte counts of *this* implementation (``comm_bytes_per_step``): every unit is padded to a multiple of N, so
each ring chunk is equal and a rank sends exactly (N-1)/N x 4 x Ψ_pad per phase (Ψ_pad = Σ padded unit sizes,
at most N-1 elements per unit above Ψ). Stage 3 with the default ``reshard_after_forward=None`` keeps the root
unit (embeddings, final norm, head) gathered from forward to backward, as FSDP2 does for its root: the
backward all-gathers skip it, 2Ψ_pad - Ψ_root,pad all-gathered instead of 2Ψ_pad. ``reshard_after_forward=True``
re-gathers every unit (the paper's 3Ψ exactly); ``False`` keeps every unit gathered until its backward is done
(2Ψ like stage 2, but the full parameters of the whole model are alive between forward and backward).

Building blocks, in the literature's names:

* **flat parameter** (FSDP1's ``FlatParameter``; DeepSpeed's flattened partitions): the parameters of one
  *unit* are copied into one contiguous fp32 buffer, padded to a multiple of N; rank r owns the contiguous
  shard [r S, (r+1) S), S = padded / N (``FlatLayout``, ``shard_bounds``). The module's own parameters become
  views into the unit's full flat buffer, so the model code is untouched.
* **unit** (``FlatParamUnit``): the parameters of one module not already owned by a unit below it. Units are
  applied bottom-up -- one per transformer block, then the root for what is left (embeddings, final norm,
  head) -- exactly like ``fully_shard(block)`` for every block and then ``fully_shard(model)``.
* **stage 3 schedule** (``ZeroDataParallel``): all-gather a unit just before its forward (forward pre-hook),
  free it after (forward post-hook: the storage is resized to 0 bytes -- every view keeps its shape, only the
  memory goes), all-gather it again just before its backward, reduce-scatter its gradients just after, free.
  ``prefetch=True`` issues the next unit's all-gather asynchronously one unit ahead, in forward (order recorded
  during the previous forward) and in backward (reverse of this forward's post-forward order), as FSDP's
  ``forward_prefetch`` / ``BACKWARD_PRE`` prefetch do.

Hooks, and why these. *Pre-forward* / *post-forward*: ``register_forward_pre_hook`` / ``register_forward_hook``
on the unit's module. *Pre-backward*: in the post-forward hook, a tensor hook (``Tensor.register_hook``) on each
output that requires grad; it fires when the output's gradient is ready, i.e. just before the unit's own
backward -- what FSDP2 does (``FSDPState._register_pre_backward_hook``). It needs no wrapping of inputs or
outputs (unlike ``register_full_backward_pre_hook``, which inserts an identity autograd Function and breaks on
in-place ops on outputs). *Post-backward*: ``register_post_accumulate_grad_hook`` on each of the unit's
parameters; when the last of them has its gradient accumulated, no backward node that reads the unit's
parameters is left (every such node also feeds a parameter's AccumulateGrad), so the unit can reduce-scatter
and free. *End of backward*: the first pre-backward hook queues a final callback
(``Variable._execution_engine.queue_callback``) that reduces whatever units did not complete (parameters that got
no gradient count as zeros) and, in stages 0/1, reduces all units. Gradients: at pre-backward each parameter's
``.grad`` is set to a zeroed view into the unit's flat gradient buffer; autograd then accumulates in place
(``AccumulateGrad`` adds into an existing ``.grad``), so the reduce-scatter reads the buffer without a copy --
DDP's ``gradient_as_bucket_view``.

Caveat of the counting: a unit whose parameters get no gradient on *some* ranks only (a routed expert)
would be reduced in the hook on some ranks and in the final callback on others -- collectives out of order.
The course's dense GPT uses every parameter on every rank; FSDP2 triggers the reduce from the unit's inputs'
gradients instead, at the price of subtler ordering arguments.

Gradient accumulation: ``no_sync()`` keeps the full gradients and skips the reduce-scatter until the last
micro-batch (FSDP's ``no_sync``: less communication, full-size gradient memory); without it stages 2/3
reduce-scatter every backward and add into the shard's gradient. FSDP2's per-parameter (dim-0) sharding is
``course_lib.parallel.fsdp2``, built on the same engine; the units and the flat layout are in ``zero_unit``,
the sharded checkpoints in ``zero_checkpoint``, the byte accounting (``model_state_bytes``,
``comm_bytes_per_step``) in ``zero_accounting``, PyTorch's ``fully_shard`` as the oracle in ``fsdp_torch``; all
are importable from here.

Under a pipeline the hooks cannot tell the m micro-batches' backwards apart: ``pp_fsdp`` runs the same units
from the schedule's actions instead (gathered per stage, gradients accumulated, one reduce-scatter per step).

Left out compared with FSDP2/DeepSpeed: meta-device initialisation (here every rank builds the full model once,
then shards it), CUDA streams and rate limiting (CPU gloo runs collectives on its own threads), CPU offload,
hybrid sharding (HSDP).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable

from course_lib import comm
from course_lib.model_config import GPTConfig
from course_lib.parallel.contract import HasGroups, ParallelWrapper, broadcast_from_first
from course_lib.parallel.fsdp_torch import TorchFullyShard, train_fsdp2
from course_lib.parallel.loop import ModelFn, StepTime, build_model, train_loop
from course_lib.parallel.zero_accounting import comm_bytes_per_step, model_state_bytes
from course_lib.parallel.zero_checkpoint import (
    CHECKPOINT_FORMAT,
    load_checkpoint,
    load_full_state_dict,
    load_into_model,
    save_checkpoint,
)
from course_lib.parallel.zero_unit import FlatLayout, FlatParamUnit, default_units, shard_bounds
from course_lib.train import TrainConfig, TrainResult, full_params, make_optimizer

__all__ = [
    "CHECKPOINT_FORMAT",
    "FlatLayout",
    "FlatParamUnit",
    "TorchFullyShard",
    "ZeroDataParallel",
    "ZeroTrainResult",
    "comm_bytes_per_step",
    "default_units",
    "load_checkpoint",
    "load_full_state_dict",
    "load_into_model",
    "model_state_bytes",
    "save_checkpoint",
    "shard_bounds",
    "train_fsdp2",
    "train_zero",
]

DEFAULT_TRAIN = TrainConfig()

# ----------------------------------------------------------------------------------------------------------------
# The engine: hooks, the step


class ZeroDataParallel(ParallelWrapper):
    """Data parallelism with ZeRO stage 0 (plain DP), 1, 2 or 3 (FSDP) over ``group`` (or ``mesh.group("dp",
    "cp")``: ZeRO shards over the data and context axes, as Megatron's distributed optimizer does).

    Usage (one optimizer step; every rank runs it on its own slice of the global batch)::

        zdp = ZeroDataParallel(GPT(cfg), stage=3, prefetch=True)
        opt = make_optimizer(zdp.parameters(), tc)   # the shards: each rank's optimizer sees Ψ/N elements
        loss = lm_loss(zdp(x), y)                     # stage 3: gathers unit by unit, frees after each
        loss.backward()                               # stages 2/3: reduce-scatter unit by unit; 0/1: at the end
        opt.step()                                    # each rank updates its own shard only
        zdp.after_step()                              # stages 1/2: all-gather the updated parameters
        opt.zero_grad(set_to_none=True)

    ``units``: modules in bottom-up order, the last being ``module`` itself (default ``default_units``).
    ``reshard_after_forward`` (stage 3): ``None`` frees every unit but the root after forward (FSDP2's
    default), ``True`` every unit, ``False`` none (ZeRO-2-like: more memory, no backward all-gather).
    ``param_dtype``: compute dtype (``torch.bfloat16`` for mixed precision with fp32 master shards).
    Parameters that do not require grad stay replicated, untouched. After construction ``peak_bytes`` holds the
    largest parameter / gradient bytes seen at the hooks (``model_state_bytes`` sampled at each event).
    ``broadcast``: first copy the group's first rank's initial weights to every rank.

    ``no_sync()``: the backward passes inside it keep accumulating the *unsharded* gradients locally (no
    reduce-scatter; stages 2/3 then hold full gradients until the synchronising backward, as FSDP's
    ``no_sync`` does). Seams: ``unit_class`` (a ``FlatParamUnit`` subclass overriding ``average`` or
    ``bounds``).
    """

    axes = ("dp", "cp")
    unit_class: type[FlatParamUnit] = FlatParamUnit

    def __init__(self, module: nn.Module, stage: int = 3, *, mesh: HasGroups | None = None, group: comm.Group = None,
                 units: Iterable[nn.Module] | None = None, prefetch: bool = False,
                 reshard_after_forward: bool | None = None, param_dtype: torch.dtype = torch.float32,
                 broadcast: bool = True) -> None:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        super().__init__(module, mesh=mesh, group=group)
        self.stage, self.prefetch = stage, prefetch
        self.param_dtype = param_dtype
        group = self.group
        if broadcast:
            broadcast_from_first(module, group)
        self.events: list[tuple[str, str]] = []  # (collective, unit name) in issue order
        unit_modules = list(default_units(module) if units is None else units)
        if not unit_modules or unit_modules[-1] is not module:
            raise ValueError("units are applied bottom-up: the last unit must be the root module itself")
        paths = {m: name for name, m in module.named_modules()}
        owned: set[int] = set()
        self.units: list[FlatParamUnit] = []
        for m in unit_modules:
            if m not in paths:
                raise ValueError(f"unit {type(m).__name__} is not a submodule of the model")
            prefix = paths[m] + "." if paths[m] else ""
            named = [(prefix + n, p) for n, p in m.named_parameters() if p.requires_grad and id(p) not in owned]
            owned.update(id(p) for _, p in named)
            self.units.append(self.unit_class(paths[m], m, named, stage, group, param_dtype, self.events))
            owned.update(id(s) for s in self.units[-1].optimizer_params())  # shards the unit registered in m
        self.root = self.units[-1]
        self.axis = "dp+cp" if mesh is not None and getattr(mesh, "size", lambda _: 1)("cp") > 1 else "dp"
        """The axis key of the group the shards live on (their ``placement`` records)."""
        for unit in self.units:
            unit.record_placements(self.axis)
        for unit in self.units:
            unit.reshard_after_forward = (unit is not self.root) if reshard_after_forward is None \
                else bool(reshard_after_forward)
            self._hooks.append(unit.module.register_forward_pre_hook(partial(self._pre_forward, unit)))
            self._hooks.append(unit.module.register_forward_hook(partial(self._post_forward, unit)))
            for p in unit.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(partial(self._post_accumulate_grad, unit)))
        self._forward_order: list[FlatParamUnit] = []  # pre-forward order of this iteration
        self._prev_forward_order: list[FlatParamUnit] = []  # ... of the previous one (forward prefetch)
        self._post_forward_order: list[FlatParamUnit] = []  # its reverse is the backward order
        self._callback_queued = False
        self._sync_this_backward = True  # decided at the root's forward: False under no_sync()
        self._reduced_since_step = False  # stages 0/1: one backward per optimizer step
        self.peak_bytes = {"parameters": 0, "gradients": 0}
        self._sample()

    # ---- what the optimizer and the loop see

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The shards (one flat fp32 parameter per unit; one per parameter with ``PerParameterUnit``, the very
        tensors the module registers then): what each rank's optimizer updates."""
        return iter([s for u in self.units for s in u.optimizer_params()])

    def after_step(self) -> None:
        """After ``optimizer.step()``: stages 1/2 all-gather the updated shards into every rank's full
        parameters; stages 0/1 clear their persistent full-gradient buffers for the next backward."""
        for unit in self.units:
            unit.refresh_full()
            unit.zero_flat_grad()
        self._reduced_since_step = False
        self._sample()

    def remove_hooks(self) -> None:
        """Remove every hook; stage 3 first gathers every unit back (a collective), so that the module runs on
        its own afterwards with the current weights."""
        for unit in self.units:
            unit.unshard()
        super().remove_hooks()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, full and fp32, by the model's names (a collective: every rank must call it)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            out.update(unit.gather_full())
        for name, p in self.module.named_parameters():  # frozen parameters were never sharded
            if name not in out:
                out[name] = p.detach().float().cpu().clone()
        return {name: out[name] for name, _ in self.module.named_parameters()}

    # ---- hooks

    def _pre_forward(self, unit: FlatParamUnit, module: nn.Module, args: Any) -> None:
        if unit is self.root:  # a new forward: reset the per-iteration state
            self._sync_this_backward = self._require_sync
            self._prev_forward_order = self._forward_order
            self._forward_order, self._post_forward_order = [], []
        self._forward_order.append(unit)
        unit.unshard()
        if self.prefetch:
            order = self._prev_forward_order
            if unit in order and order.index(unit) + 1 < len(order):
                order[order.index(unit) + 1].unshard(async_op=True)
        self._sample()

    def _post_forward(self, unit: FlatParamUnit, module: nn.Module, args: Any, output: Any) -> None:
        self._post_forward_order.append(unit)
        if not torch.is_grad_enabled():  # no backward will come: free everything now
            unit.reshard()
            return
        if unit.reshard_after_forward:
            unit.reshard()
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(partial(self._pre_backward, unit))
        unit.backward_started = unit.reduced = False
        unit.grads_ready = 0

    def _pre_backward(self, unit: FlatParamUnit, grad: torch.Tensor) -> None:
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        if unit.backward_started:  # a unit with several outputs: act on the first gradient only
            return
        unit.backward_started = True
        unit.unshard()  # stage 3: gather again (or wait for the prefetch)
        unit.install_grad_views()
        if self.prefetch:
            order = self._post_forward_order[::-1]  # the order backward visits the units
            i = order.index(unit) if unit in order else len(order)
            if i + 1 < len(order):
                order[i + 1].unshard(async_op=True)
        self._sample()

    def _post_accumulate_grad(self, unit: FlatParamUnit, param: torch.Tensor) -> None:
        unit.grads_ready += 1
        if self.stage >= 2 and self._sync_this_backward and unit.grads_ready == len(unit.params) and not unit.reduced:
            self._post_backward(unit)

    def _post_backward(self, unit: FlatParamUnit) -> None:
        unit.accept_shard_grad(unit.reduce_gradients())
        self._sample()  # the gradient peak: the full gradient buffer and its reduced shard are both alive
        unit.free_grads()
        unit.reshard()

    def _end_of_backward(self) -> None:
        """Final callback: reduce the units the hooks did not (all of them in stages 0/1), free, reset."""
        self._callback_queued = False
        if not self._sync_this_backward:  # no_sync(): keep the full gradients, reduce in a later backward
            for unit in self.units:
                unit.backward_started = False
                unit.grads_ready = 0
                unit.reshard()
            self._sample()
            return
        if self.stage < 2 and self._reduced_since_step:
            raise RuntimeError(f"ZeRO stage {self.stage} reduces its full gradient buffer in place: one backward per "
                               "optimizer step (call after_step() before the next backward; gradient accumulation "
                               "is supported by stages 2 and 3)")
        self._reduced_since_step = True
        for unit in self.units:
            if not unit.reduced:
                self._post_backward(unit)
            unit.backward_started = False
            unit.grads_ready = 0
            unit.reduced = False
            unit.reshard()  # e.g. a unit prefetched but never used
        self._sample()

    # ---- memory

    def _sample(self) -> None:
        now = model_state_bytes(self)
        for k in self.peak_bytes:
            self.peak_bytes[k] = max(self.peak_bytes[k], now[k])


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


# ----------------------------------------------------------------------------------------------------------------
# The training loop (PyTorch's FSDP2 as the second oracle: ``fsdp_torch.train_fsdp2``)


@dataclass
class ZeroTrainResult(TrainResult):
    """``TrainResult`` (losses, final full parameters) plus what this rank measured.

    * ``step_comm``: per step run, the collectives this rank issued in that step (``comm``: the same as logs);
    * ``events``: per step, (collective, unit name) in issue order -- the counts per unit;
    * ``memory``: model-state bytes (``model_state_bytes``) right after the first ``optimizer.step()``;
    * ``peak``: the largest parameter / gradient bytes seen at any hook during the run;
    * ``units``: per unit {name, numel, padded_numel, shard_numel}."""

    step_comm: list[list[comm.CommRecord]] = field(default_factory=list, repr=False)
    events: list[list[tuple[str, str]]] = field(default_factory=list, repr=False)
    memory: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    units: list[dict[str, Any]] = field(default_factory=list, repr=False)
    start_step: int = 0
    timeline: list[StepTime] = field(default_factory=list, repr=False)

    @property
    def comm(self) -> list[comm.CommLog]:
        """``step_comm`` as one ``CommLog`` per step (for its counting helpers)."""
        return [comm.CommLog(list(records)) for records in self.step_comm]


def train_zero(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig = DEFAULT_TRAIN, stage: int = 3, *,
               prefetch: bool = False, reshard_after_forward: bool | None = None,
               param_dtype: torch.dtype = torch.float32, save_to: str | Path | None = None,
               resume_from: str | Path | None = None, accumulation: int = 1, mesh: HasGroups | None = None,
               group: comm.Group = None, model_fn: ModelFn | None = None, freeze: Sequence[str] = (),
               wrapper_class: type[ZeroDataParallel] = ZeroDataParallel) -> ZeroTrainResult:
    """Train ``model_fn(cfg, tc.seed)`` (the GPT by default) with ZeRO ``stage`` over ``group`` / ``mesh``'s
    dp x cp axes (a ``launch`` target), through ``course_lib.parallel.loop.train_loop``.

    Every rank takes its contiguous slice of the same global batches as ``train_baseline``. ``losses``: the mean
    over the global batch per step; ``params``: the final full parameters by the model's names (stages 0-2 in
    fp32: this rank's replica; else gathered from the shards). ``resume_from``: continue from a
    ``save_checkpoint`` directory (any N, any stage) at its step; ``save_to``: save one after the last step.
    Stop a run at step k with ``replace(tc, steps=k)`` and ``save_to``; resume it with the full ``tc`` and
    ``resume_from``. ``wrapper_class`` swaps in a variant."""
    model = build_model(cfg, tc.seed, model_fn, freeze)
    zdp = wrapper_class(model, stage, mesh=mesh, group=group, prefetch=prefetch,
                        reshard_after_forward=reshard_after_forward, param_dtype=param_dtype)
    opt = make_optimizer(list(zdp.parameters()), tc)
    start = load_checkpoint(zdp, opt, resume_from) if resume_from is not None else 0
    result = ZeroTrainResult([], {}, start_step=start,
                             units=[{"name": u.name, "numel": u.layout.numel, "padded_numel": u.layout.padded_numel,
                                     "shard_numel": u.layout.shard_numel} for u in zdp.units])
    marks = [len(zdp.events)]

    def measure(step: int) -> None:
        if not result.memory:
            result.memory = model_state_bytes(zdp, opt)

    out = train_loop(zdp, opt, cfg, tc, data_rank=zdp.rank, data_size=zdp.world_size, accumulation=accumulation,
                     start_step=start, after_optimizer=measure, on_step_end=lambda step: marks.append(len(zdp.events)))
    result.events = [zdp.events[a:b] for a, b in itertools.pairwise(marks)]
    if save_to is not None:
        save_checkpoint(zdp, opt, save_to, step=tc.steps)
    result.losses, result.step_comm, result.timeline = out.losses, out.step_comm, out.timeline
    # stages 0-2 in fp32: this rank's own replica, what it computes with; otherwise gathered from the shards
    result.params = full_params(model) if stage < 3 and param_dtype == torch.float32 else zdp.full_state_dict()
    result.peak = dict(zdp.peak_bytes)
    return result
