"""Is the code device-true? Watch a run for the two things that break it on GPUs.

"The same code on GPUs" holds only if every tensor the library creates follows the device of the model (or
of the rank, ``launch.device()``) and every collective carries a dtype NCCL accepts. On a CPU-only machine a
device-less ``torch.zeros(n)`` works -- it lands on the CPU where everything else is -- so the bug stays
invisible until the first GPU run. ``DeviceAudit`` makes it visible on the CPU:

* the tensor factories of the ``torch`` namespace (``torch.zeros``, ``empty``, ``ones``, ``full``, ``arange``,
  ``tensor``, ``rand``, ``randn``, ...) are wrapped for the duration of the audit, which flags the calls made
  *directly* by code outside PyTorch without a ``device=``. (Wrapped rather than watched by a
  ``TorchFunctionMode``: gradient hooks run by the autograd engine do not see such a mode, and the ZeRO
  engine allocates in its hooks.) (the caller's frame is the one that must say where the tensor goes; factories PyTorch
  calls internally, e.g. an optimizer's step counter, are PyTorch's business). ``*_like`` and
  ``Tensor.new_*`` follow their argument's device and are fine. ``course_lib.data`` is exempt: the batches are
  made on the CPU by design and the training loop moves them to the model's device.
* a ``TorchDispatchMode`` sees every collective (the ``c10d`` operators that gloo and NCCL both run) and flags
  payloads of float64 (NCCL's reductions of doubles are slow or missing on many GPUs; the course keeps every
  payload fp32/bf16/int) or on a device other than the expected one.

``with audit.paused():`` excludes a region (building the model on the CPU before moving it is fine).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FACTORIES = ("zeros", "ones", "empty", "full", "arange", "tensor", "rand", "randn", "randint", "eye", "linspace",
             "as_tensor", "empty_strided")
_TORCH_DIR = str(Path(torch.__file__).parent)
_EXEMPT = (str(Path(__file__).parents[1] / "data.py"), __file__)  # course_lib/data.py


@dataclass(frozen=True)
class Finding:
    """One problem: ``kind`` ("factory without device", "float64 collective", "collective on <device>"),
    where it happened (``file:line``) and what was called."""

    kind: str
    where: str
    call: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.call} at {self.where}"


def _caller() -> str | None:
    """``file:line`` of the frame that called the factory, None when it is PyTorch's own code or exempt."""
    frame = sys._getframe(2)  # 0: this function, 1: the wrapper, 2: the caller
    file = frame.f_code.co_filename
    if file.startswith(_TORCH_DIR) or file.startswith(_EXEMPT):
        return None
    return f"{file}:{frame.f_lineno}"


def _watched(audit: DeviceAudit, name: str, factory: Any) -> Any:
    def factory_call(*args: Any, **kwargs: Any) -> Any:
        if not audit.is_paused and kwargs.get("device") is None:
            where = _caller()
            if where is not None:
                audit.findings.append(Finding("factory without device", where, f"torch.{name}"))
        return factory(*args, **kwargs)

    return factory_call


class _Collectives(TorchDispatchMode):
    def __init__(self, audit: DeviceAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "c10d" and not self.audit.is_paused:
            for t in _tensors(args):
                if t.dtype == torch.float64:
                    self.audit.findings.append(Finding("float64 collective", "c10d", str(func)))
                elif self.audit.device is not None and t.device != self.audit.device:
                    self.audit.findings.append(Finding(f"collective on {t.device}", "c10d", str(func)))
        return func(*args, **kwargs)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


class DeviceAudit:
    """``with DeviceAudit(device) as audit: ...`` records a ``Finding`` for every device-less factory call and
    every float64 (or off-device) collective inside the block; ``audit.findings`` lists them."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.findings: list[Finding] = []
        self.is_paused = False
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> DeviceAudit:
        for name in FACTORIES:
            original = getattr(torch, name)
            setattr(torch, name, _watched(self, name, original))
            self._stack.callback(setattr, torch, name, original)
        self._stack.enter_context(_Collectives(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        saved, self.is_paused = self.is_paused, True
        try:
            yield
        finally:
            self.is_paused = saved

    def report(self) -> str:
        unique = sorted({str(f) for f in self.findings})
        return "\n".join(unique) if unique else "no findings"
