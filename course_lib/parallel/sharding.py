"""The schedule ZeRO and FSDP share: hooks that gather, free and reduce each unit's parameters.

A *unit* is the parameters of one module (one transformer block, then the root for the rest:
``fully_shard`` applied bottom-up). Per unit and step: all-gather it before its forward (a
pre-hook), free it after (``reshard_after_forward``), gather it again before its backward (a tensor
hook on its outputs, FSDP2's pre-backward), reduce its gradients once the last has accumulated
(``register_post_accumulate_grad_hook``), free them; a final backward callback reduces what the
hooks did not. ``prefetch`` starts the next unit's all-gather one unit ahead (FSDP's
``forward_prefetch`` / ``BACKWARD_PRE``). Stages 0 and 1 keep a full gradient buffer and reduce
every unit at the end of backward; stages 2 and 3 reduce each unit once its gradients are complete.
Inside ``no_sync()`` nothing is reduced.

The units are ``zero_unit.FlatParamUnit`` (one flat buffer per unit: FSDP1, DeepSpeed) or
``fsdp2.PerParameterUnit`` (every parameter sharded on dim 0: FSDP2). Chapter 03 derives the
schedule and its memory; ``model_state_bytes`` measures what the units hold at each event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from enum import Enum
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd import Variable


class UnitState(Enum):
    SHARDED = "sharded"  # only the shard exists; the full weights have 0 bytes of storage
    GATHERING = "gathering"  # an async all-gather into the full weights is in flight (prefetch)
    UNSHARDED = "unsharded"  # the full weights are there: the module can run


class Unit(Protocol):
    """What the schedule needs of a unit (``FlatParamUnit``, ``PerParameterUnit``)."""

    module: nn.Module
    params: list[nn.Parameter]
    reshard_after_forward: bool
    grads_ready: int
    backward_started: bool
    reduced: bool

    def unshard(self, async_op: bool = False) -> None: ...
    def reshard(self) -> None: ...
    def install_grad_views(self) -> None: ...
    def reduce_gradients(self) -> torch.Tensor: ...
    def accept_shard_grad(self, g: torch.Tensor) -> None: ...
    def free_grads(self) -> None: ...
    def optimizer_params(self) -> list[nn.Parameter]: ...
    def weight_tensors(self) -> list[torch.Tensor]: ...


def model_state_bytes(units: Sequence[Unit], param_dtype: torch.dtype,
                      optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Live bytes of model states on this rank by ZeRO's categories, each storage counted once: the
    compute-dtype weights (and the shards when they are the weights, fp32); the gradients of the
    full weights and of the shards; the optimizer's state (and the fp32 master shards if mixed)."""
    seen: set[int] = set()

    def total(tensors: Iterable[torch.Tensor | None]) -> int:
        n = 0
        for t in tensors:
            if t is not None and t.untyped_storage()._cdata not in seen:
                seen.add(t.untyped_storage()._cdata)
                n += t.untyped_storage().nbytes()
        return n

    fp32 = param_dtype == torch.float32
    shards = [s for u in units for s in u.optimizer_params()]
    params = total([t for u in units for t in u.weight_tensors()] + (shards if fp32 else []))
    grads = total([p.grad for u in units for p in u.params] + [s.grad for s in shards])
    state = [] if fp32 else list(shards)
    if optimizer is not None:
        state += [v for st in optimizer.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor)]
    return {"parameters": params, "gradients": grads, "optimizer_state": total(state)}


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


class UnitSchedule:
    """Runs ``units`` (bottom-up, the ``root`` last) from hooks: see the module docstring.
    ``sync()`` says, at the root's forward, whether this step reduces (False inside the wrapper's
    ``no_sync``); ``sample`` is called at every event (the wrapper's memory peaks)."""

    def __init__(self, units: Sequence[Unit], root: Unit | None, stage: int, prefetch: bool,
                 sync: Callable[[], bool], sample: Callable[[], None]) -> None:
        self.units, self.root, self.stage, self.prefetch = list(units), root, stage, prefetch
        self.sync, self.sample = sync, sample
        self.hooks: list[Any] = []
        for unit in self.units:
            module = unit.module
            self.hooks.append(module.register_forward_pre_hook(partial(self._pre_forward, unit)))
            self.hooks.append(module.register_forward_hook(partial(self._post_forward, unit)))
            ready = partial(self._grad_ready, unit)
            self.hooks += [p.register_post_accumulate_grad_hook(ready) for p in unit.params]
        self._order: list[Unit] = []  # pre-forward order of this iteration
        self._prev_order: list[Unit] = []  # ... of the previous one (forward prefetch)
        self._post_order: list[Unit] = []  # its reverse is the backward order
        self._queued = False
        self._sync_this_backward = True
        self.reduced_since_step = False  # stages 0/1: one backward per optimizer step

    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any) -> None:
        if unit is self.root or unit in self._order or not self._order:  # a new forward
            self._sync_this_backward = self.sync()
            self._prev_order, self._order, self._post_order = self._order, [], []
        self._order.append(unit)
        unit.unshard()
        order = self._prev_order
        if self.prefetch and unit in order and order.index(unit) + 1 < len(order):
            order[order.index(unit) + 1].unshard(async_op=True)
        self.sample()

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        self._post_order.append(unit)
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

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        if not self._queued:
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
        if unit.backward_started:  # a unit with several outputs: act on the first gradient only
            return
        unit.backward_started = True
        unit.unshard()  # gather again (or wait for the prefetch)
        unit.install_grad_views()
        order = self._post_order[::-1]  # the order backward visits the units
        i = order.index(unit) if unit in order else len(order)
        if self.prefetch and i + 1 < len(order):
            order[i + 1].unshard(async_op=True)
        self.sample()

    def _grad_ready(self, unit: Unit, param: torch.Tensor) -> None:
        unit.grads_ready += 1
        if (self.stage >= 2 and self._sync_this_backward and unit.grads_ready == len(unit.params)
                and not unit.reduced):
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        unit.accept_shard_grad(unit.reduce_gradients())
        self.sample()  # the gradient peak: the full gradients and their reduced shard both alive
        unit.free_grads()
        unit.reshard()

    def _end_of_backward(self) -> None:
        """Reduce the units the hooks did not (every unit in stages 0/1), free, reset."""
        self._queued = False
        if self._sync_this_backward and self.stage < 2 and self.reduced_since_step:
            raise RuntimeError(f"ZeRO stage {self.stage} reduces its full gradient buffer in "
                               "place: one backward per optimizer step (call after_step() before "
                               "the next backward; gradient accumulation is supported by stages 2 "
                               "and 3)")
        self.reduced_since_step |= self._sync_this_backward
        for unit in self.units:
            if self._sync_this_backward and not unit.reduced:
                self._reduce(unit)
            unit.backward_started, unit.grads_ready, unit.reduced = False, 0, False
            unit.reshard()  # e.g. a unit prefetched but never used
        self.sample()

    def remove(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
