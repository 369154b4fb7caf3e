"""The wrapper contract every parallelism follows (the rules are listed in ``course_lib.parallel``'s docstring).

``ParallelWrapper`` is the base class: it resolves ``mesh=`` / ``group=`` to one process group, refuses a rank
that is not in that group, keeps the hooks it installs so that ``remove_hooks()`` can take them all off, and
gives the default (no-op) steps of the training-loop interface that a form overrides where it has work to do:

    wrapper = Form(model, mesh=mesh)                 # or group=...; initial weights identical over the group
    opt = torch.optim.AdamW(wrapper.parameters())    # what the optimizer steps (shards, for ZeRO)
    for i, (x, y) in enumerate(micro):
        with wrapper.no_sync() if i < m - 1 else contextlib.nullcontext():
            wrapper.forward_backward(x, y, lm_loss, 1 / m)
    wrapper.finish_gradient_sync()                   # after the last backward, before the step
    opt.step()
    wrapper.after_step()                             # after the step
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.model import lm_loss

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class HasGroups(Protocol):
    """What a wrapper needs of ``course_lib.runtime.mesh.Mesh``: one process group for one or more named axes."""

    def group(self, *axes: str) -> dist.ProcessGroup: ...


def resolve_group(mesh: HasGroups | None, group: comm.Group, axes: tuple[str, ...], who: str) -> comm.Group:
    """``mesh.group(*axes)`` when a mesh is given, else ``group`` (None = every rank); not both."""
    if mesh is not None and group is not None:
        raise ValueError(f"{who}: pass either mesh= or group=, not both")
    return mesh.group(*axes) if mesh is not None else group


def require_member(group: comm.Group, who: str) -> None:
    """A clear error when this rank is not in ``group`` (torch reports rank -1, and the wrapper would fail much
    later, deep in a collective)."""
    if not dist.is_initialized():
        raise RuntimeError(f"{who} needs a process group: run it on ranks started by course_lib.runtime.launch.launch")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{who}: global rank {dist.get_rank()} is not a member of the group "
                         f"{dist.get_process_group_ranks(group)}; build the wrapper on the ranks of its group only "
                         f"(or pass the group this rank belongs to, e.g. mesh.group(axis))")


def module_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter or buffer (CPU for an empty module)."""
    for t in [*module.parameters(), *module.buffers()]:
        return t.device
    return torch.device("cpu")


def broadcast_from_first(module: nn.Module, group: comm.Group) -> None:
    """Make every rank's parameters and buffers equal to those of the group's first rank (one logged broadcast
    per tensor; tied parameters once). DDP and FSDP do this at construction, so replicas start identical even
    when each rank initialised its model differently."""
    src = comm.global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            comm.broadcast(tensor.detach(), src, group=group)


class ParallelWrapper(nn.Module):
    """Base of every wrapper: ``module`` (the wrapped model), ``group`` (the process group it works over),
    ``rank`` / ``world_size`` in that group, and the training-loop interface with no-op defaults."""

    axes: tuple[str, ...] = ("dp",)
    """The mesh axes whose group the form works over (``mesh.group(*axes)``)."""

    batch_wide_loss: bool = False
    """True when the loss is not a mean over rows (an MoE's router losses depend on the whole batch of one
    forward): the loop then cuts each step's batch into micro-batches *before* the ranks' slices, so that every
    micro-batch holds the same rows as on one process (``train_baseline(..., accumulation=m)``)."""

    def __init__(self, module: nn.Module, *, mesh: HasGroups | None = None, group: comm.Group = None) -> None:
        super().__init__()
        who = type(self).__name__
        self.group = resolve_group(mesh, group, self.axes, who)
        require_member(self.group, who)
        self.module = module
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self._hooks: list[Any] = []
        self._require_sync = True  # False inside no_sync()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of this rank's outputs: the LM loss (a form whose outputs differ overrides it: TP's
        vocab-parallel cross-entropy, EP's added router losses)."""
        return lm_loss(logits, targets)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None = None,
                         scale: float = 1.0) -> float:
        """One micro-batch: ``loss_fn(self(x), y) * scale`` back-propagated (``loss_fn`` None: ``self.loss``);
        returns the scaled loss. (The pipeline overrides it: there forward and backward interleave over
        micro-batches.)"""
        loss = (loss_fn or self.loss)(self(x).float(), y) * scale
        loss.backward()
        return loss.item()

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """The per-step losses of this rank -> the global-batch means (one call after training): the mean of
        the ranks' means, as each rank's slice is equally large. Float32: a payload every backend accepts."""
        losses = local.to(torch.float32)
        if self.world_size > 1:
            comm.all_reduce(losses, group=self.group)
        return losses / self.world_size

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward/backward inside this block accumulate gradients locally, without communication."""
        saved, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = saved

    def finish_gradient_sync(self) -> None:
        """Call after the last backward, before ``optimizer.step()`` (no-op where backward already reduced)."""

    def after_step(self) -> None:
        """Call after ``optimizer.step()`` (no-op where nothing has to follow the step)."""

    def remove_hooks(self) -> None:
        """Remove every hook this wrapper installed."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
