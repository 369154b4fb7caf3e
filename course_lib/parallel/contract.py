"""The contract the training loop (``loop.train_loop``) drives every form through: per micro-batch
``forward_backward`` (all but the last under ``no_sync()``), ``finish_gradient_sync()``, the step on
``parameters()``, ``after_step()``; ``full_parameters()`` for parity. ``ParallelWrapper`` resolves
``mesh=`` / ``group=`` to one group, refuses ranks outside it, keeps hooks for ``remove_hooks``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.model import lm_loss
from course_lib.parallel.groups import HasGroups

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_group(mesh: HasGroups | None, group: comm.Group, axes: tuple[str, ...],
                  who: str) -> comm.Group:
    """``mesh.group(*axes)`` when a mesh is given, else ``group`` (None = every rank); not both."""
    if mesh is not None and group is not None:
        raise ValueError(f"{who}: pass either mesh= or group=, not both")
    return mesh.group(*axes) if mesh is not None else group


def require_member(group: comm.Group, who: str) -> None:
    """A clear error when this rank is not in ``group`` (torch fails later, in a collective)."""
    if not dist.is_initialized():
        raise RuntimeError(f"{who} needs a process group: run it on ranks started by "
                           "course_lib.runtime.launch")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{who}: global rank {dist.get_rank()} is not a member of the group "
                         f"{dist.get_process_group_ranks(group)}; build it on the ranks of its "
                         "group only (or pass the group this rank belongs to, e.g. "
                         "mesh.group(axis))")


def broadcast_from_first(module: nn.Module, group: comm.Group) -> None:
    """Every rank's parameters and buffers := the group's first rank's (one logged broadcast each,
    tied parameters once): replicas start identical, as DDP does."""
    src = comm.global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            comm.broadcast(tensor.detach(), src, group=group)


class ParallelWrapper(nn.Module):
    """A form: ``module``, its ``group`` (``mesh.group(*axes)`` or ``group=``) and ``rank``."""

    axes: tuple[str, ...] = ("dp", "cp")

    batch_wide_loss: bool = False
    """True when the loss is no mean over rows (an MoE's router losses): the loop cuts micro-batches
    before the ranks' slices, so each holds the rows it holds on one process."""

    def __init__(self, module: nn.Module, *, mesh: HasGroups | None = None,
                 group: comm.Group = None) -> None:
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
        return lm_loss(logits, targets)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None = None,
                         scale: float = 1.0) -> float:
        """Back-propagate ``loss_fn(self(x), y) * scale`` for one micro-batch; return that loss."""
        loss = (loss_fn or self.loss)(self(x).float(), y) * scale
        loss.backward()
        return loss.item()

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's per-step losses -> global-batch means (the group's mean of equal slices)."""
        losses = local.to(torch.float32)
        if self.world_size > 1:
            comm.all_reduce(losses, group=self.group)
        return losses / self.world_size

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward/backward in this block accumulate gradients locally, without communicating."""
        saved, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = saved

    def finish_gradient_sync(self) -> None:
        """After the last backward, before ``optimizer.step()``."""

    def after_step(self) -> None:
        pass

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """CPU copies of the whole parameters by name (a replica holds them whole)."""
        return {n: p.detach().cpu().clone() for n, p in self.module.named_parameters()}

    def remove_hooks(self) -> None:
        """Remove every hook this wrapper installed."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
