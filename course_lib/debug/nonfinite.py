"""The first non-finite value: the step, rank, module and tensor where a NaN or an Inf first appears.

One NaN spreads: the all-reduce of gradients carries it from the rank that made it to every replica, and the next
step's forward turns every activation into NaN, so the loss curve says only *that* it happened. ``NonFiniteWatch``
(a ``LoopObserver``) checks, on its rank, every module's output in forward, the gradient of every module's output
in backward (a hook on the output tensor), every parameter's gradient once reduced, and every parameter after the
optimizer's step; it keeps the first hit. Across ranks the earliest by (step, phase) wins (``first_nonfinite``):
the rank whose own forward or backward made the NaN comes before the ranks that only received it reduced.

PyTorch's own tool, ``torch.autograd.set_detect_anomaly(True)``, names the backward op that produced a NaN (on one
process, at a large cost); the checks here are module forward hooks and tensor hooks (``Tensor.register_hook``),
one ``isfinite`` pass over each tensor: cheap next to the matmul that made it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.loop import Batch, LoopObserver

PHASES = ("forward", "backward", "reduced gradient", "updated weight")
"""The order the checks happen in within one step."""


@dataclass(frozen=True)
class NonFinite:
    """A first hit: at ``step``, ``phase`` (one of ``PHASES``), in ``module`` (``tensor``: which of its tensors),
    ``count`` of its ``numel`` elements not finite."""

    rank: int
    step: int
    phase: str
    module: str
    tensor: str
    count: int
    numel: int

    @property
    def order(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase)

    def describe(self) -> str:
        return (f"rank {self.rank}, step {self.step}, {self.phase}: {self.tensor} of {self.module} "
                f"({self.count} of {self.numel} elements not finite)")


class NonFiniteWatch(LoopObserver):
    """Keeps this rank's first non-finite tensor in ``first`` (None while everything is finite)."""

    def __init__(self) -> None:
        self.first: NonFinite | None = None
        self.step = -1
        self._handles: list[Any] = []
        self._model: nn.Module | None = None

    def start(self, wrapper: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._model = wrapper.module
        for name, m in self._model.named_modules():
            self._handles.append(m.register_forward_hook(self._forward_hook(name or "the model")))

    def batch(self, step: int, micro: Batch) -> None:
        self.step = step

    def before_optimizer(self, step: int) -> None:
        for name, p in self._model.named_parameters():
            if p.grad is not None:
                self._check(p.grad, PHASES[2], name, "gradient")

    def step_end(self, step: int) -> None:
        for name, p in self._model.named_parameters():
            self._check(p, PHASES[3], name, "value")

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _forward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            outputs = output if isinstance(output, tuple | list) else (output,)
            for i, t in enumerate(outputs):
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    continue
                what = "output" if len(outputs) == 1 else f"output {i}"
                self._check(t, PHASES[0], name, what)
                if t.requires_grad:
                    t.register_hook(lambda g, w=what: self._check(g, PHASES[1], name, f"gradient of its {w}"))
        return hook

    def _check(self, t: torch.Tensor, phase: str, module: str, tensor: str) -> None:
        if self.first is not None:
            return
        bad = int((~torch.isfinite(t.detach())).sum())
        if bad:
            self.first = NonFinite(dist.get_rank() if dist.is_initialized() else 0, self.step, phase, module, tensor,
                                   bad, t.numel())


def first_nonfinite(found: Sequence[NonFinite | None]) -> list[NonFinite]:
    """The earliest hits over the ranks (several when ranks tie on step and phase), or [] when none."""
    hits = [f for f in found if f is not None]
    if not hits:
        return []
    first = min(f.order for f in hits)
    return sorted((f for f in hits if f.order == first), key=lambda f: f.rank)
