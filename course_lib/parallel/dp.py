"""Data parallelism from scratch: naive, bucketed and overlapped gradient all-reduce; accumulation.

Every rank holds a replica and its own slice of the global batch (B = b x m x N: micro-batch x
accumulation steps x ranks); after backward the ranks average their gradients, so every replica
takes the same step: with equal slices the mean of the local mean-loss gradients *is* the global
mean loss's gradient. A ring all-reduce sends 2 (N-1)/N x V bytes per rank and step however they
are grouped (grouping changes the number of calls, the alpha term; Patarasuk & Yuan 2009).

* ``naive``: one all-reduce per gradient after backward;
* ``bucketed``: gradients packed into flat buckets of ~``bucket_mb`` MiB in reverse parameter order;
* ``overlapped``: a bucket is all-reduced asynchronously once backward filled it, in bucket order
  on every rank (DDP, Li et al. 2020, VLDB 13(12), sections 3.2.2-3.2.3);
* ``scheduled``: ``launch(params)`` starts their reduction (a pipeline's ``REDUCE_GRAD``).

Each gradient's group, and the axes that sum it too, are read from its placements (``dp_reduce``).
``no_sync()`` accumulates without communicating; ``find_unused_parameters`` leaves ``.grad`` None
where no rank has one (DDP's flag). Chapter 02 builds it in the notebook first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from course_lib import comm
from course_lib.parallel import dp_reduce as R
from course_lib.parallel.contract import HasGroups, ParallelWrapper, broadcast_from_first

Mode = Literal["naive", "bucketed", "overlapped", "scheduled"]
MODES: tuple[Mode, ...] = ("naive", "bucketed", "overlapped")  # "scheduled" waits for launch()
DEFAULT_BUCKET_MB = 25.0
"""DDP's default ``bucket_cap_mb``."""


def assign_buckets(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``params`` (in gradient order) grouped greedily, as DDP's
    ``compute_bucket_assignment_by_size``: one open bucket per dtype and data group (one buffer, one
    collective), closed once it holds ``bucket_bytes`` (its last tensor may overflow it; 0: one
    each); buckets in the order of their first tensor, so they fill in turn."""
    buckets: list[list[int]] = []
    open_: dict[tuple[torch.dtype, str], tuple[list[int], int]] = {}
    for i, p in enumerate(params):
        key = (p.dtype, R.data_axis(p))
        members, size = open_.get(key, ([], 0))
        members.append(i)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(members)
            open_.pop(key, None)
        else:
            open_[key] = (members, size)
    return sorted(buckets + [m for m, _ in open_.values()], key=lambda m: m[0])


@dataclass(eq=False)
class Bucket:
    """``params``' gradients back to back in ``buffer``, reduced over axis key ``key``'s group."""

    params: list[nn.Parameter]
    key: str
    buffer: torch.Tensor
    pending: int = 0  # gradients not ready yet in this backward (overlapped)
    work: Any = None  # the async all-reduce once launched


class DataParallel(ParallelWrapper):
    """Average ``module``'s gradients over its data ranks: ``mesh.group("dp", "cp")`` (experts over
    ``"edp"``, partial sums over their axes: ``dp_reduce``) or ``group`` (default: every rank).

        dp = DataParallel(model, mode="overlapped")
        for i, (x, y) in enumerate(micro):
            with dp.no_sync() if i < m - 1 else contextlib.nullcontext():
                (lm_loss(dp(x), y) / m).backward()
        dp.finish_gradient_sync()     # before optimizer.step(): waits for / runs the all-reduces
        optimizer.step()

    ``broadcast``: start every replica from its group's first copy. Seams a variant overrides:
    ``average``, ``build_buckets``, ``all_reduce``."""

    def __init__(self, module: nn.Module, *, mesh: HasGroups | None = None,
                 group: comm.Group = None, mode: Mode = "overlapped",
                 bucket_mb: float = DEFAULT_BUCKET_MB, find_unused_parameters: bool = False,
                 broadcast: bool = True) -> None:
        if mode not in (*MODES, "scheduled"):
            raise ValueError(f"unknown mode {mode!r}: use one of {(*MODES, 'scheduled')}")
        if bucket_mb < 0:
            raise ValueError(f"bucket_mb must be >= 0, got {bucket_mb}")
        super().__init__(module, mesh=mesh, group=group)
        self.mode: Mode = mode
        self.groups = mesh if mesh is not None else {R.DATA: self.group}
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.find_unused_parameters = find_unused_parameters
        if broadcast and mesh is not None:
            R.broadcast_replicas([*module.parameters(), *module.buffers()], mesh)
        elif broadcast:
            broadcast_from_first(module, self.group)
        # trainable parameters, each once (tied weights are one), in the order backward makes them
        self.params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.buckets = self.build_buckets() if mode in ("bucketed", "overlapped") else []
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._launched: list[Bucket] = []  # this step's buckets in flight or done, in launch order
        self._next = 0  # overlapped: buckets launched so far, in order
        self._sync_this_backward = False  # decided at forward time, as DDP does
        self._unsynced = False  # a synchronising forward ran and finish_gradient_sync() has not yet
        if mode == "overlapped":
            for p in self.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def build_buckets(self, params: Sequence[nn.Parameter] | None = None) -> list[Bucket]:
        """Buckets of ``params`` (default: all) by ``assign_buckets``, each a flat buffer."""
        params = self.params if params is None else list(params)
        out = []
        for members in assign_buckets(params, self.bucket_bytes):
            ps = [params[i] for i in members]
            buffer = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
            out.append(Bucket(ps, R.data_axis(ps[0]), buffer))
        return out

    # -- the loop's steps --------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; outside ``no_sync()`` this arms the coming backward's reduction (after
        the module returned: a forward that raises leaves the wrapper as it was)."""
        if self._require_sync and torch.is_grad_enabled() and self._unsynced:
            raise RuntimeError("a synchronising forward while the previous step's gradients were "
                               "never averaged: call finish_gradient_sync() after the last "
                               "backward, before the step")
        out = self.module(*args, **kwargs)
        self._arm()
        return out

    def _arm(self) -> None:
        self._sync_this_backward = sync = self._require_sync and torch.is_grad_enabled()
        if sync:
            self._unsynced, self._next, self._launched = True, 0, []
            for b in self.buckets:
                b.pending, b.work = len(b.params), None

    def launch(self, params: Sequence[nn.Parameter]) -> None:
        """Start reducing ``params`` now (scheduled: a pipeline stage's gradients are complete).
        Inside ``no_sync()`` nothing is reduced: the next synchronising step reduces the sum."""
        if not self._require_sync:
            return
        if not self._unsynced:
            self._arm()
        params = [p for p in params if p.requires_grad]
        done = {id(p) for b in self._launched for p in b.params}
        if any(id(p) in done for p in params):
            raise RuntimeError(
                f"rank {self.rank}: launch() of parameters already reduced this step: a stage "
                "reduced twice (two REDUCE_GRAD actions for one stage?)")
        for b in self.build_buckets(params[::-1]):
            self.launch_bucket(b, async_op=True)

    def finish_gradient_sync(self) -> None:
        """Wait for (or run) every all-reduce, average, write ``.grad``, then sum the partials."""
        if self.mode == "scheduled":
            self._check_all_launched()
        if not self._unsynced:
            raise RuntimeError("finish_gradient_sync() without a synchronising forward/backward: "
                               "the last micro-batch must run outside no_sync()")
        with torch.no_grad():
            had = [p.grad is not None for p in self.params]
            if self.mode == "naive":
                for p in self.params:
                    self.launch_bucket(Bucket([p], R.data_axis(p), R.flatten_grads([p])), False)
            elif self.mode == "bucketed":
                for b in self.buckets:
                    self.launch_bucket(b, async_op=False)
            elif self.mode == "overlapped":
                self._launch_in_order(force=True)
            for b in self._launched:
                if b.work is not None:
                    b.work.wait()
                self.average(b.buffer)
                R.write_grads(b.params, b.buffer)
            if self.find_unused_parameters:
                self._restore_unused(had)
            R.sum_partials(self.params, self.groups)
        self._unsynced, self._launched = False, []

    def _restore_unused(self, had: list[bool]) -> None:
        """Parameters no rank of their data group had a gradient for get ``.grad`` None back (one
        small all-reduce of a "used" map per group): the optimizer skips them as on one process."""
        flags = dict(zip(map(id, self.params), had, strict=True))
        for key, params in R.by_data_axis(self.params).items():
            used = torch.tensor([flags[id(p)] for p in params], dtype=torch.int32,
                                device=params[0].device)
            R.all_reduce_flat(used, R.group_of(self.groups, key))
            for p, u in zip(params, used.tolist(), strict=True):
                if u == 0:
                    p.grad = None

    def _check_all_launched(self) -> None:
        done = {id(p) for b in self._launched for p in b.params}
        missed = [p for p in self.params if id(p) not in done]
        if missed:
            raise RuntimeError(f"rank {self.rank}: {len(missed)} of {len(self.params)} parameters "
                               "were never reduced this step: launch(params) must run for every "
                               "stage (the pipeline's REDUCE_GRAD action)")

    # -- the seams ---------------------------------------------------------------------------------

    def average(self, summed: torch.Tensor) -> None:
        """Sum over the data ranks -> their mean (in place): / N."""
        summed.div_(self.world_size)

    def all_reduce(self, tensor: torch.Tensor, group: comm.Group, async_op: bool) -> Any:
        """One sum all-reduce over ``group`` (none on one rank); the work handle if ``async_op``."""
        return R.all_reduce_flat(tensor, group, async_op)

    # -- buckets -----------------------------------------------------------------------------------

    def launch_bucket(self, b: Bucket, async_op: bool) -> None:
        """Pack ``b``'s gradients (None as zeros) and all-reduce its buffer over its group."""
        group = R.group_of(self.groups, b.key)
        b.buffer.copy_(R.flatten_grads(b.params, b.buffer.dtype))
        b.work = self.all_reduce(b.buffer, group, async_op)
        self._launched.append(b)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Overlapped: ``p.grad`` is final for this backward; launch the buckets now complete."""
        if not self._sync_this_backward:
            return
        b = self._bucket_of[id(p)]
        b.pending -= 1
        if b.pending < 0:
            raise RuntimeError("a gradient became ready twice for one synchronising forward: a "
                               "parameter hooked twice, or a second backward without a new forward "
                               "through the wrapper")
        if b.pending == 0:
            self._launch_in_order(force=False)

    def _launch_in_order(self, force: bool) -> None:
        """Launch buckets next, next+1, ... while complete (all if ``force``): never out of order,
        so every rank issues the same collectives in the same sequence."""
        while self._next < len(self.buckets) and (force or self.buckets[self._next].pending == 0):
            self.launch_bucket(self.buckets[self._next], async_op=True)
            self._next += 1
