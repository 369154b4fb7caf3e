"""Data parallelism from scratch: naive, bucketed and overlapped gradient all-reduce, and gradient accumulation.

Every rank holds a full replica of the model and processes its own slice of the global batch; after the
backward pass the ranks average their gradients, so every replica takes the same optimizer step and the
replicas never drift apart. With equal slices, the average of the local mean-loss gradients *is* the gradient
of the mean loss over the global batch, which is why the result matches one process trained on the whole batch
(``course_lib.train.train_baseline``), up to floating-point reassociation.

Batch arithmetic (b = micro-batch per rank, m = gradient-accumulation steps, N = DP degree)::

    global batch B = b x m x N          (rows per optimizer step)

Communication per optimizer step, per rank, for Psi gradient elements of ``s`` bytes each (V = Psi * s), with
the bandwidth-optimal ring all-reduce (reduce-scatter then all-gather, Patarasuk & Yuan 2009)::

    bytes sent = 2 (N-1)/N x V          (exact when every all-reduced buffer divides by N, else
                                         ``comm.ring_bytes`` gives the exact per-rank count)

It does not depend on how the gradients are grouped (one call per parameter or a few buckets): grouping changes
the number of calls, i.e. the latency term alpha x calls of the alpha-beta model, not the bandwidth term. It does
not depend on m either: accumulation skips the all-reduce on all but the last micro-batch (``no_sync``).

Three ways to do the same all-reduce, from the textbook to what ``torch.nn.parallel.DistributedDataParallel``
does (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 13(12),
arXiv:2006.15704, sections 3.2.2-3.2.3):

* ``"naive"``: after backward, one all-reduce per parameter gradient, then divide by N. Many small calls: each
  pays the per-call latency, and nothing overlaps with compute.
* ``"bucketed"``: gradients are packed into flat buckets of about ``bucket_mb`` MiB, formed in *reverse*
  parameter order (roughly the order backward produces them), one all-reduce per bucket, then unpacked back
  into ``.grad``. Fewer, larger messages use the bandwidth better (Li et al., Fig. 2).
* ``"overlapped"``: each parameter's ``register_post_accumulate_grad_hook`` marks its gradient ready; when a
  bucket's last gradient arrives the bucket is all-reduced **asynchronously** (``async_op=True``) while
  backward goes on computing earlier layers. ``finish_gradient_sync()`` waits for every bucket before the
  optimizer step. Buckets are launched strictly in bucket order (bucket i+1 never before bucket i), so every
  rank issues the same collectives in the same order even when gradients arrive in a different order -- the
  rule DDP follows too (Li et al., section 3.2.3).

Gradient accumulation (DDP semantics): inside ``with dp.no_sync():`` the forward/backward only accumulates into
``.grad`` locally, no communication; the last micro-batch runs outside it and its backward (or
``finish_gradient_sync``) averages the accumulated gradients. Each micro-batch loss is scaled by 1/m so that the
accumulated gradient is the gradient of the mean over the m micro-batches.

Special parameters:

* frozen (``requires_grad=False``): never bucketed, never communicated.
* tied (the same ``Parameter`` in two modules, e.g. ``GPTConfig(tie_embeddings=True)``): ``Module.parameters()``
  yields it once, its ``.grad`` already holds the sum of both uses, and its hook fires once per backward: it is
  reduced exactly once. (Reducing it twice would give the same average but twice the bytes.)
* no gradient in this step (``.grad is None`` after backward, e.g. an expert no token chose): **treated as
  zeros** in the all-reduce, as DDP does. A parameter that got a gradient on some ranks but not on others thus
  receives the average with zero contributions -- exactly the baseline's gradient of the global mean loss. A
  parameter unused on *every* rank is different: the baseline leaves its ``.grad`` None and the optimizer skips
  it (no weight decay, no momentum step). With ``find_unused_parameters=True`` (DDP's flag) one extra small
  all-reduce of a per-parameter "used" map detects that case and leaves ``.grad`` None, matching the baseline
  exactly; with the default ``False`` it gets a zero gradient (which AdamW's weight decay and SGD's momentum
  still act on). Unlike DDP, which raises when a parameter is unused and the flag is off, this version carries on.

What is left out compared with DDP: the smaller first bucket, rebuilding buckets in the order gradients really
arrived after the first iteration, ``gradient_as_bucket_view`` (``.grad`` as a view into the bucket, saving the
copies), communication hooks (fp16/bf16 compression, PowerSGD), buffer broadcasting every forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from course_lib import comm
from course_lib.model_config import GPTConfig
from course_lib.parallel.contract import HasGroups, ParallelWrapper, broadcast_from_first
from course_lib.parallel.loop import ModelFn, StepTime, build_model, train_loop
from course_lib.train import TrainConfig, TrainResult, full_params, make_optimizer

Mode = Literal["naive", "bucketed", "overlapped"]
MODES: tuple[Mode, ...] = ("naive", "bucketed", "overlapped")
MiB = 1024 * 1024
DEFAULT_BUCKET_MB = 25.0
"""DDP's default ``bucket_cap_mb``."""


# ----------------------------------------------------------------------------------------------------------------
# Small helpers


def global_batch_size(micro_batch: int, accumulation_steps: int, dp_degree: int) -> int:
    """Rows per optimizer step: B = micro-batch x accumulation steps x DP degree."""
    return micro_batch * accumulation_steps * dp_degree


def allreduce_bytes_per_rank(grad_bytes: float, n: int) -> float:
    """Bytes one rank sends per optimizer step in a ring all-reduce of all gradients: 2 (N-1)/N x V."""
    return 2 * (n - 1) / n * grad_bytes


def broadcast_parameters(model: nn.Module, src: int = 0, group: comm.Group = None) -> None:
    """Make every rank's parameters and buffers equal to those of global rank ``src`` (one logged broadcast per
    tensor; tied parameters once). DDP does this in its constructor, so replicas start identical even when each
    rank initialised its model with a different seed (the wrappers use ``broadcast_from_first``)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            comm.broadcast(tensor.detach(), src, group=group)


def assign_buckets(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Group ``params`` (given in the order their gradients are expected, i.e. already reversed) into buckets.

    Greedy, as DDP's ``compute_bucket_assignment_by_size``: add tensors to the current bucket and close it as soon
    as it holds at least ``bucket_bytes`` (so a bucket may exceed the cap by its last tensor; ``bucket_bytes=0``
    puts every tensor in its own bucket); a change of dtype also closes it (a flat buffer has one dtype).
    Returns lists of indices into ``params``.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, p in enumerate(params):
        if current and p.dtype != params[current[0]].dtype:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(eq=False)
class Bucket:
    """A flat buffer holding the gradients of ``params`` back to back (``offsets[i]`` = where param i starts)."""

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    pending: int = 0  # gradients not ready yet in this backward (overlapped mode)
    work: Any = None  # the async all-reduce handle once launched

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def view(self, i: int) -> torch.Tensor:
        """Parameter i's slice of the buffer, shaped like the parameter."""
        p = self.params[i]
        return self.buffer[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


# ----------------------------------------------------------------------------------------------------------------
# The wrapper


class DataParallel(ParallelWrapper):
    """Wrap ``module`` so that its gradients are averaged over the ranks of ``group`` (or ``mesh.group("dp")``;
    default: all ranks).

    Usage, one optimizer step with m micro-batches::

        dp = DataParallel(model, mode="overlapped", bucket_mb=25)
        for i, (x, y) in enumerate(micro):
            with dp.no_sync() if i < m - 1 else contextlib.nullcontext():
                (lm_loss(dp(x), y) / m).backward()
        dp.finish_gradient_sync()     # must come before optimizer.step(): waits for / runs the all-reduces
        optimizer.step()

    ``mode``: ``"naive"`` (one all-reduce per parameter after backward), ``"bucketed"`` (one per bucket after
    backward) or ``"overlapped"`` (bucket all-reduces launched asynchronously from gradient hooks during
    backward). ``bucket_mb``: bucket capacity in MiB (bucketed / overlapped). ``find_unused_parameters``: exchange
    a "used" map so that parameters without a gradient on any rank keep ``.grad = None`` (see the module
    docstring). ``broadcast``: copy the group's first rank's initial parameters to every rank (DDP does);
    ``broadcast_from``: copy those of that global rank instead.

    Seams a variant overrides (public, so tests and the grader inject bugs through them): ``average`` (sum ->
    mean), ``build_buckets`` (which parameters share an all-reduce), ``all_reduce`` (one collective).
    """

    def __init__(self, module: nn.Module, *, mesh: HasGroups | None = None, group: comm.Group = None,
                 mode: Mode = "overlapped", bucket_mb: float = DEFAULT_BUCKET_MB,
                 find_unused_parameters: bool = False, broadcast: bool = True,
                 broadcast_from: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: use one of {MODES}")
        if bucket_mb < 0:
            raise ValueError(f"bucket_mb must be >= 0, got {bucket_mb}")
        super().__init__(module, mesh=mesh, group=group)
        self.mode: Mode = mode
        self.bucket_bytes = int(bucket_mb * MiB)
        self.find_unused_parameters = find_unused_parameters
        if broadcast_from is not None:
            broadcast_parameters(module, broadcast_from, self.group)
        elif broadcast:
            broadcast_from_first(module, self.group)
        # Trainable parameters, each once (tied weights are one Parameter), in the order backward produces
        # their gradients: the reverse of the order they are defined (and, in a GPT, used) in forward.
        self.params: list[nn.Parameter] = [p for p in module.parameters() if p.requires_grad][::-1]
        self.buckets: list[Bucket] = self.build_buckets() if mode != "naive" else []
        self._bucket_of: dict[int, Bucket] = {id(p): b for b in self.buckets for p in b.params}
        self._sync_this_backward = False  # decided at forward time, as DDP does
        self._unsynced = False  # a synchronising forward ran and finish_gradient_sync() has not yet
        self._next_bucket = 0  # overlapped: buckets launched so far, in order
        if mode == "overlapped":
            for p in self.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    # -- building -------------------------------------------------------------------------------------------------

    def build_buckets(self) -> list[Bucket]:
        """The buckets of ``self.params`` (``assign_buckets`` at ``bucket_bytes``), each with a flat buffer on
        the parameters' device."""
        buckets = []
        for index, members in enumerate(assign_buckets(self.params, self.bucket_bytes)):
            params = [self.params[i] for i in members]
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += p.numel()
            buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
            buckets.append(Bucket(index, params, offsets, buffer))
        return buckets

    # -- the training-loop interface ------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module. Outside ``no_sync()`` (and with autograd on) this also arms the coming
        backward: the buckets are reset and, in overlapped mode, the hooks will launch their all-reduces.

        The step's state changes only once the module has returned: a forward that raises (a batch the model
        refuses) leaves the wrapper as it was, so the next valid forward runs normally."""
        sync = self._require_sync and torch.is_grad_enabled()
        if sync and self._unsynced:
            raise RuntimeError("forward() of a synchronising step while the previous step's gradients were never "
                               "averaged: call finish_gradient_sync() after the last backward, before "
                               "optimizer.step()")
        out = self.module(*args, **kwargs)
        self._sync_this_backward = sync
        if sync:
            self._unsynced = True
            for b in self.buckets:
                b.pending, b.work = len(b.params), None
            self._next_bucket = 0
        return out

    def finish_gradient_sync(self) -> None:
        """Average the gradients over the group; call after the last backward and before ``optimizer.step()``.

        naive / bucketed: runs every all-reduce now. overlapped: launches the buckets whose hooks never completed
        (gradients that were None), then waits for all of them and copies the averages back into ``.grad``.
        """
        if not self._unsynced:
            raise RuntimeError("finish_gradient_sync() without a synchronising forward/backward: the last "
                               "micro-batch must run outside no_sync()")
        with torch.no_grad():
            used = [p.grad is not None for p in self.params]
            if self.mode == "naive":
                self._sync_naive()
            else:
                if self.mode == "bucketed":
                    for b in self.buckets:
                        self.launch_bucket(b, async_op=False)
                else:
                    self._next_bucket = self._launch_in_order(self._next_bucket, force=True)
                for b in self.buckets:
                    if b.work is not None:
                        b.work.wait()
                    self.average(b.buffer)
                    self._unpack(b)
            if self.find_unused_parameters:
                self._restore_globally_unused(used)
        self._unsynced = False

    # -- naive ----------------------------------------------------------------------------------------------------

    def _sync_naive(self) -> None:
        """One blocking all-reduce per parameter gradient (in the same order on every rank), then / N."""
        for i, p in enumerate(self.params):
            if p.grad is None:  # no gradient on this rank: contributes zeros
                p.grad = torch.zeros_like(p)
            self.all_reduce(p.grad, f"param {i}", async_op=False)
            self.average(p.grad)

    # -- the seams ------------------------------------------------------------------------------------------------

    def average(self, summed: torch.Tensor) -> None:
        """Sum over the ranks -> mean over the ranks (in place): g / N."""
        summed.div_(self.world_size)

    def all_reduce(self, tensor: torch.Tensor, label: str, async_op: bool) -> Any:
        """One sum all-reduce over the group (``label``: "bucket 3", "param 7", for recordings). Returns the
        work handle when ``async_op``."""
        return comm.all_reduce(tensor, group=self.group, async_op=async_op)

    # -- buckets --------------------------------------------------------------------------------------------------

    def _pack(self, b: Bucket) -> None:
        for i, p in enumerate(b.params):
            if p.grad is None:
                b.view(i).zero_()
            else:
                b.view(i).copy_(p.grad)

    def launch_bucket(self, b: Bucket, async_op: bool) -> None:
        """Pack bucket ``b``'s gradients and all-reduce its buffer (asynchronously in overlapped mode)."""
        self._pack(b)
        b.work = self.all_reduce(b.buffer, f"bucket {b.index}", async_op)

    def _unpack(self, b: Bucket) -> None:
        for i, p in enumerate(b.params):
            if p.grad is None:
                p.grad = b.view(i).clone()
            else:
                p.grad.copy_(b.view(i))

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Overlapped mode: ``p.grad`` is final for this backward. Launch every bucket that is now complete."""
        if not self._sync_this_backward:
            return
        b = self._bucket_of[id(p)]
        b.pending -= 1
        if b.pending < 0:
            raise RuntimeError("a gradient became ready twice for one synchronising forward: a parameter hooked "
                               "twice, or a second backward without a new forward through the DataParallel wrapper")
        if b.pending == 0:
            self._next_bucket = self._launch_in_order(self._next_bucket, force=False)

    def _launch_in_order(self, start: int, force: bool) -> int:
        """Launch buckets start, start+1, ... asynchronously while they are complete (all of them if ``force``).
        Never out of order: every rank must issue the same collectives in the same sequence."""
        i = start
        while i < len(self.buckets) and (force or self.buckets[i].pending == 0):
            self.launch_bucket(self.buckets[i], async_op=True)
            i += 1
        return i

    # -- unused parameters ----------------------------------------------------------------------------------------

    def _restore_globally_unused(self, used: list[bool]) -> None:
        """One small all-reduce of the "used" map (DDP's ``local_used_map``); parameters no rank used get their
        ``.grad`` back to None so the optimizer skips them, as it does in the single-process baseline."""
        counts = torch.tensor(used, dtype=torch.int32, device=self.params[0].device if self.params else None)
        comm.all_reduce(counts, group=self.group)
        for p, c in zip(self.params, counts.tolist(), strict=True):
            if c == 0:
                p.grad = None


# ----------------------------------------------------------------------------------------------------------------
# The training loop


@dataclass
class DPResult(TrainResult):
    """``TrainResult`` (losses, params) plus each step's timeline and communication records on this rank."""

    timeline: list[StepTime] = field(default_factory=list, repr=False)
    step_comm: list[list[comm.CommRecord]] = field(default_factory=list, repr=False)


def train_dp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None, mode: Mode = "overlapped",
             bucket_mb: float = DEFAULT_BUCKET_MB, accumulation: int = 1, find_unused_parameters: bool = False, *,
             mesh: HasGroups | None = None, group: comm.Group = None, model_fn: ModelFn | None = None,
             freeze: Sequence[str] = (), wrapper_class: type[DataParallel] = DataParallel,
             dp_class: type[DataParallel] | None = None) -> DPResult:
    """Train with data parallelism over ``group`` / ``mesh``'s dp axis (a ``launch`` target:
    ``launch(train_dp, 4, cfg, tc)``).

    Each step every DP rank takes its shard of ``global_batch(step, tc.global_batch, ...)``, splits it into
    ``accumulation`` micro-batches (all but the last under ``no_sync``), averages gradients, steps
    (``course_lib.parallel.loop.train_loop``). Returns the per-step loss averaged over the ranks (= the mean over
    the global batch, comparable with ``train_baseline``), the final full parameters, and the per-step timeline
    and communication records of this rank. ``wrapper_class`` (older name ``dp_class``) swaps in a variant.
    """
    tc = tc or TrainConfig()
    model = build_model(cfg, tc.seed, model_fn, freeze)
    dp = (dp_class or wrapper_class)(model, mesh=mesh, group=group, mode=mode, bucket_mb=bucket_mb,
                                     find_unused_parameters=find_unused_parameters)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], tc)
    out = train_loop(dp, opt, cfg, tc, data_rank=dp.rank, data_size=dp.world_size, accumulation=accumulation)
    return DPResult(out.losses, full_params(model), out.timeline, out.step_comm)


class TorchDDP(ParallelWrapper):
    """PyTorch's ``DistributedDataParallel`` behind the wrapper contract, so the oracle runs the same loop."""

    def __init__(self, module: nn.Module, *, mesh: HasGroups | None = None, group: comm.Group = None,
                 bucket_mb: float = DEFAULT_BUCKET_MB, find_unused_parameters: bool = False) -> None:
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(module, mesh=mesh, group=group)
        self.ddp = DistributedDataParallel(module, process_group=self.group, bucket_cap_mb=bucket_mb,
                                           find_unused_parameters=find_unused_parameters)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.ddp.no_sync()


def train_torch_ddp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
                    bucket_mb: float = DEFAULT_BUCKET_MB, accumulation: int = 1, find_unused_parameters: bool = False,
                    *, mesh: HasGroups | None = None, group: comm.Group = None, model_fn: ModelFn | None = None,
                    freeze: Sequence[str] = ()) -> TrainResult:
    """The same loop with PyTorch's ``DistributedDataParallel`` (the production API; second oracle). Its traffic
    goes straight to ``torch.distributed`` and is not in the comm log."""
    tc = tc or TrainConfig()
    model = build_model(cfg, tc.seed, model_fn, freeze)
    ddp = TorchDDP(model, mesh=mesh, group=group, bucket_mb=bucket_mb, find_unused_parameters=find_unused_parameters)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], tc)
    out = train_loop(ddp, opt, cfg, tc, data_rank=ddp.rank, data_size=ddp.world_size, accumulation=accumulation)
    return TrainResult(out.losses, full_params(model))
