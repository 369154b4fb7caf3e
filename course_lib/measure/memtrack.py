"""Measured memory: a tracker of live tensor bytes by category, inside one process (each rank measures its own).

``MemoryTracker`` reports the same categories as the estimator in ``course_lib.estimates.memory`` (parameters,
gradients, optimizer state, activations, other), their peak and the breakdown at the peak, so the estimate for the
course's tiny GPT can be checked against what PyTorch really allocates. It counts tensor storages, not the allocator: no
caching, fragmentation or kernel workspaces. Checked against ``torch.distributed._tools.mem_tracker.MemTracker``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from course_lib.estimates.memory_budget import MemoryBudget
from course_lib.model import lm_loss

TRACKER_CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")
_PARAM, _GRAD, _OPT = 1, 2, 4


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind a tensor (the inner tensors of a wrapper subclass such as DTensor)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for name in attrs:
            yield from _storages(getattr(t, name))
        return
    if t.is_meta or t.layout != torch.strided:
        return
    try:
        yield t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (e.g. some subclasses)
        return


class _Entry:
    __slots__ = ("category", "flags", "nbytes", "ref", "saved")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.flags = 0
        self.saved = 0
        self.category = "other"
        self.ref: weakref.ref[torch.UntypedStorage] | None = None


class _Saved:
    """What autograd keeps instead of a saved tensor while a :class:`MemoryTracker` is active."""

    __slots__ = ("__weakref__", "generation", "keys", "tensor", "tracker")

    def __init__(self, tracker: MemoryTracker, tensor: torch.Tensor, keys: list[int]) -> None:
        self.tracker, self.tensor, self.keys, self.generation = tracker, tensor, keys, tracker._generation

    def __del__(self) -> None:
        self.tracker._unsave(self.keys, self.generation)


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.tracker._on_outputs(out)
        return out


class MemoryTracker:
    """Measure live tensor bytes, and their peak, by category, inside one process (CPU or GPU).

    Usage::

        model = GPT(cfg); opt = torch.optim.Adam(model.parameters())
        with MemoryTracker(model, opt) as mt:
            loss = lm_loss(model(idx), targets)
            loss.backward()
            opt.step()
        print(mt.peak)            # breakdown at the moment the total peaked (a MemoryBudget)
        mt.phase_peaks            # {"forward": ..., "backward": ..., "optimizer": ...}
        mt.category_peaks         # each category's own maximum (activations peak at the end of forward)

    How it counts:

    * every tensor an ATen op creates is seen by a ``TorchDispatchMode``; its storage is counted once (views
      share it) from creation until it is freed (a weak reference to the storage); parameters, existing
      gradients and optimizer states are registered at entry;
    * **parameters**: storages of ``model.parameters()``; **gradients**: their ``.grad`` (tagged by a
      post-accumulate-grad hook and before/after each optimizer step); **optimizer_state**: tensors in
      ``optimizer.state`` of any optimizer that steps inside the tracker (the ``step`` counters included);
    * **activations**: storages that autograd currently holds for backward (a ``saved_tensors_hooks`` pair
      counts every saved tensor while its graph node is alive, deduplicated by storage); a parameter saved
      for backward stays a parameter;
    * **other**: everything else alive: inputs, outputs, temporaries, activation gradients, tensors
      recomputed in backward under ``torch.utils.checkpoint`` (held by the checkpoint, not by autograd's
      saved slots; the checkpointed blocks' inputs, which autograd does save, count as activations).
      Precedence: parameters > gradients > optimizer_state > activations > other.
    * **resized storages** (FSDP frees a gathered parameter with ``storage.resize_(0)`` and gathers it back into
      the same storage, which no ATen op reports): a storage seen at two sizes is re-read at every later
      allocation, so freed parameters stop counting before the next peak is taken.

    Phases: "backward" while autograd's engine runs, "optimizer" inside ``optimizer.step()``, "forward"
    otherwise (the loss, ``zero_grad`` and data preparation count as forward).

    Limits: it counts tensor storages, not the allocator (no CUDA caching/rounding, no kernel workspaces,
    no memory allocated outside ATen ops). Tensors created before entry are seen only if they are
    parameters, gradients, optimizer states or saved for backward. Saved-tensor hooks pushed inside the
    tracker (``save_on_cpu``, checkpoint's recomputation) take precedence over ours for what they save. One
    tracker at a time, not re-entrant.
    """

    def __init__(self, model: nn.Module | Iterable[nn.Module] | None = None,
                 optimizer: torch.optim.Optimizer | None = None, record_timeline: bool = False) -> None:
        if model is None:
            self.models: list[nn.Module] = []
        elif isinstance(model, nn.Module):
            self.models = [model]
        else:
            self.models = list(model)
        self.optimizers = [optimizer] if optimizer is not None else []
        self.record_timeline = record_timeline
        self._entries: dict[int, _Entry] = {}
        self._resized: set[int] = set()  # keys of storages seen at two sizes: re-read at every allocation
        self._totals = dict.fromkeys(TRACKER_CATEGORIES, 0)
        self._total = 0
        self._active = False
        self._generation = 0
        self._stepping: torch.optim.Optimizer | None = None
        self._handles: list[Any] = []
        self._mode: _Mode | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self.timeline: list[tuple[str, dict[str, int]]] = []
        self.reset_peak()

    # ---- results

    @property
    def current(self) -> MemoryBudget:
        """Live bytes by category now (after exit: at exit)."""
        if not self._active and self._final is not None:
            return self._final
        self._reread_resized()
        return MemoryBudget(dict(self._totals), label="measured: current")

    @property
    def peak(self) -> MemoryBudget:
        """Breakdown at the moment the total was highest."""
        return MemoryBudget(dict(self._peak_parts), label="measured: peak")

    @property
    def category_peaks(self) -> MemoryBudget:
        """Each category's own maximum (not simultaneous; the total of this is not a peak)."""
        return MemoryBudget(dict(self._cat_peaks), label="measured: per-category maxima")

    @property
    def phase_peaks(self) -> dict[str, MemoryBudget]:
        """{phase: breakdown at that phase's peak} for the phases that ran."""
        return {ph: MemoryBudget(dict(parts), label=f"measured: {ph} peak") for ph, parts in self._phase_parts.items()}

    def reset_peak(self) -> None:
        """Start the peaks again from the current state."""
        self._peak_total = self._total
        self._peak_parts = dict(self._totals)
        self._cat_peaks = dict(self._totals)
        self._phase_totals: dict[str, int] = {}
        self._phase_parts: dict[str, dict[str, int]] = {}
        self._final: MemoryBudget | None = None

    @property
    def phase(self) -> str:
        if self._stepping is not None:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward"

    # ---- bookkeeping

    def _register(self, st: torch.UntypedStorage) -> _Entry:
        key = id(st)
        entry = self._entries.get(key)
        nbytes = st.nbytes()
        if entry is None:
            entry = _Entry(nbytes)
            entry.ref = weakref.ref(st, lambda _r, key=key: self._on_free(key))
            self._entries[key] = entry
            self._totals["other"] += nbytes
            self._total += nbytes
        elif entry.nbytes != nbytes:  # resized storage (e.g. FSDP frees a gathered parameter with resize_)
            self._resize(entry, nbytes)
            self._resized.add(key)
        return entry

    def _resize(self, entry: _Entry, nbytes: int) -> None:
        self._totals[entry.category] += nbytes - entry.nbytes
        self._total += nbytes - entry.nbytes
        entry.nbytes = nbytes

    def _reread_resized(self) -> None:
        """Storages once resized may have been resized again outside any op: take their size now."""
        for key in list(self._resized):
            entry = self._entries.get(key)
            st = entry.ref() if entry is not None and entry.ref is not None else None
            if st is None:
                self._resized.discard(key)
            elif st.nbytes() != entry.nbytes:
                self._resize(entry, st.nbytes())

    def _recategorize(self, entry: _Entry) -> None:
        if entry.flags & _PARAM:
            cat = "parameters"
        elif entry.flags & _GRAD:
            cat = "gradients"
        elif entry.flags & _OPT:
            cat = "optimizer_state"
        elif entry.saved > 0:
            cat = "activations"
        else:
            cat = "other"
        if cat != entry.category:
            self._totals[entry.category] -= entry.nbytes
            self._totals[cat] += entry.nbytes
            entry.category = cat

    def _tag(self, t: torch.Tensor | None, flag: int) -> None:
        if t is None or not self._active:
            return
        for st in _storages(t):
            entry = self._register(st)
            entry.flags |= flag
            self._recategorize(entry)

    def _on_free(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and self._active:
            self._totals[entry.category] -= entry.nbytes
            self._total -= entry.nbytes

    def _on_outputs(self, out: Any) -> None:
        if not self._active:
            return
        n_entries, total = len(self._entries), self._total
        stack = [out]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                for st in _storages(x):
                    self._register(st)
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
        if self._stepping is not None and len(self._entries) > n_entries:
            self._scan_optimizer(self._stepping)  # new optimizer states count as such from their creation
        if len(self._entries) != n_entries or self._total != total:  # something was allocated or resized
            self._update_peak()

    def _update_peak(self) -> None:
        self._reread_resized()
        total, totals = self._total, self._totals
        if total > self._peak_total:
            self._peak_total = total
            self._peak_parts = dict(totals)
        for k, v in totals.items():
            if v > self._cat_peaks[k]:
                self._cat_peaks[k] = v
        ph = self.phase
        if total > self._phase_totals.get(ph, -1):
            self._phase_totals[ph] = total
            self._phase_parts[ph] = dict(totals)
        if self.record_timeline:
            self.timeline.append((ph, dict(totals)))

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._active:
            return t
        keys = []
        for st in _storages(t):
            entry = self._register(st)
            entry.saved += 1
            self._recategorize(entry)
            keys.append(id(st))
        self._update_peak()
        return _Saved(self, t.detach(), keys)  # detached: no reference cycle through the tensor's grad_fn

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _unsave(self, keys: list[int], generation: int) -> None:
        if not self._active or generation != self._generation:  # a graph from an earlier ``with`` block
            return
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.saved -= 1
                self._recategorize(entry)

    def _scan_grads(self) -> None:
        for m in self.models:
            for p in m.parameters():
                self._tag(p.grad, _GRAD)

    def _scan_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            for val in state.values():
                if isinstance(val, torch.Tensor):
                    self._tag(val, _OPT)

    # ---- context manager

    def __enter__(self) -> MemoryTracker:
        if self._active:
            raise RuntimeError("MemoryTracker is not re-entrant")
        self._active = True
        self._generation += 1
        for m in self.models:
            for p in m.parameters():
                self._tag(p, _PARAM)
                self._handles.append(p.register_post_accumulate_grad_hook(lambda q: self._tag(q.grad, _GRAD)))
            for buf in m.buffers():
                for st in _storages(buf):
                    self._register(st)
        self._scan_grads()
        for opt in self.optimizers:
            self._scan_optimizer(opt)

        def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._scan_grads()
            self._stepping = opt
            self._update_peak()

        def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._scan_optimizer(opt)
            self._scan_grads()
            self._update_peak()
            self._stepping = None

        self._handles += [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        self.reset_peak()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._mode is not None and self._hooks is not None
        self._mode.__exit__(*exc)
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._scan_grads()
        self._reread_resized()
        self._final = MemoryBudget(dict(self._totals), label="measured: at exit")
        self._active = False
        self._entries.clear()
        self._resized.clear()


def track_training_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, idx: torch.Tensor,
                        targets: torch.Tensor, loss_fn: Any = lm_loss,
                        record_timeline: bool = False) -> MemoryTracker:
    """Run forward, backward and (if given) ``optimizer.step()`` under a :class:`MemoryTracker`; return it."""
    with MemoryTracker(model, optimizer, record_timeline=record_timeline) as mt:
        loss = loss_fn(model(idx), targets)
        loss.backward()
        del loss
        if optimizer is not None:
            optimizer.step()
    return mt
