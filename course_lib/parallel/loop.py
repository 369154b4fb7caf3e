"""The one training loop every ``train_xx`` helper runs, through the wrapper contract.

Per optimizer step: this rank's slice of ``global_batch(step, tc.global_batch, ...)`` (``data_rank``
of ``data_size`` equal slices), cut into ``accumulation`` micro-batches (a wrapper with
``batch_wide_loss`` gets the global batch cut into micro-batches first, then each micro-batch's
slice); all but the last run under ``no_sync()``, each back-propagates ``loss / accumulation`` (so
the accumulated gradient is that of the mean); then ``finish_gradient_sync()``,
``optimizer.step()``, ``after_step()``. Everything the wrapper communicates in the step is recorded
(``comm.recording``) into ``step_comm``; the losses are reduced once, after training
(``wrapper.reduce_losses``), into the global-batch mean per step -- comparable with
``train_baseline``.

What a chapter adds to a step (clipping, a memory sample, a checkpoint, markers) goes through the
hooks of ``train_loop``, never through a loop of its own: this is the library's only training loop
besides the single-process baseline (``course_lib.train.train_baseline``). Instruments that watch
every run (chapter 11's checksums, non-finite watch) attach with ``observing(observer)``;
``sampler`` replaces what a rank trains on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from course_lib import comm
from course_lib.data import global_batch, micro_batches, shard
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.parallel.contract import LossFn, ParallelWrapper
from course_lib.train import TrainConfig

ModelFn = Callable[[GPTConfig, int], nn.Module]
Batch = list[tuple[torch.Tensor, torch.Tensor]]
Sampler = Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]]
"""``sampler(step, data_rank, data_size)``: this rank's (x, y) of the step (not micro-batched)."""


class LoopObserver:
    """What an instrument sees of every ``train_loop`` in this process (``observing``); each method
    a no-op here. ``batch``: this rank's micro-batches of the step; ``before_optimizer``: the
    gradients are reduced."""

    def start(self, wrapper: ParallelWrapper, optimizer: torch.optim.Optimizer) -> None:
        pass

    def batch(self, step: int, micro: Batch) -> None:
        pass

    def before_optimizer(self, step: int) -> None:
        pass

    def step_end(self, step: int) -> None:
        pass


_OBSERVERS: list[LoopObserver] = []


@contextlib.contextmanager
def observing(observer: LoopObserver) -> Iterator[LoopObserver]:
    """``observer`` sees every training loop run inside the block (on this rank)."""
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.remove(observer)


def build_model(cfg: GPTConfig, seed: int, model_fn: ModelFn | None = None,
                freeze: Sequence[str] = (), device: torch.device | None = None) -> nn.Module:
    """``model_fn(cfg, seed)`` (default ``GPT``) on ``device`` (default: ``launch.device()``, the
    rank's GPU under NCCL, else the CPU), the parameters named in ``freeze`` requires_grad=False."""
    from course_lib.runtime.launch import device as rank_device

    model = (model_fn or GPT)(cfg, seed).to(device or rank_device())
    names = dict(model.named_parameters())
    unknown = sorted(set(freeze) - set(names))
    if unknown:
        raise ValueError(f"cannot freeze unknown parameters {unknown}")
    for name in freeze:
        names[name].requires_grad_(False)
    return model


@dataclass
class StepTime:
    """One optimizer step on one rank. ``compute_s``: forward + backward of all micro-batches (for
    overlapped data parallelism this includes launching the bucket all-reduces from the hooks);
    ``exposed_comm_s``: time in ``finish_gradient_sync`` -- communication the compute did not hide;
    ``optimizer_s``: ``optimizer.step()`` and ``after_step()``; ``comm_s``: the collectives' own
    durations (issue -> completion), which may overlap compute; ``micro_comm_calls``: collectives
    issued during each micro-batch (the last one includes ``finish_gradient_sync``)."""

    step: int
    compute_s: float
    exposed_comm_s: float
    optimizer_s: float
    comm_s: float
    comm_calls: int
    sent_bytes: int
    micro_comm_calls: list[int]


@dataclass
class LoopOutput:
    """What ``train_loop`` measured on this rank: per-step losses (already the global-batch means),
    the communication records of each step, and each step's timing."""

    losses: list[float]
    step_comm: list[list[comm.CommRecord]] = field(default_factory=list, repr=False)
    timeline: list[StepTime] = field(default_factory=list, repr=False)


def step_micro_batches(x: torch.Tensor, y: torch.Tensor, data_rank: int, data_size: int,
                       accumulation: int, micro_first: bool = False
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of one step's global batch (x, y): its slice cut into
    ``accumulation`` pieces, or (``micro_first``) the global batch cut into pieces and this rank's
    slice of each taken. Either way the ranks together see every row of the step once;
    ``micro_first`` makes micro-batch j of all ranks the j-th piece of the global batch, as on one
    process."""
    if micro_first:
        return [(shard(xm, data_rank, data_size), shard(ym, data_rank, data_size))
                for xm, ym in micro_batches(x, y, accumulation)]
    xs, ys = shard(x, data_rank, data_size), shard(y, data_rank, data_size)
    return list(micro_batches(xs, ys, accumulation))


def train_loop(wrapper: ParallelWrapper, optimizer: torch.optim.Optimizer, cfg: GPTConfig,
               tc: TrainConfig, *, data_rank: int, data_size: int, accumulation: int = 1,
               loss_fn: LossFn | None = None, start_step: int = 0,
               before_optimizer: Callable[[int], None] | None = None,
               after_optimizer: Callable[[int], None] | None = None,
               on_step_end: Callable[[int], None] | None = None,
               sampler: Sampler | None = None) -> LoopOutput:
    """Train ``tc.steps - start_step`` steps (see the module docstring). ``loss_fn`` None: the
    wrapper's own ``loss``. Hooks, each called with the step: ``before_optimizer`` after
    ``finish_gradient_sync()``, before ``optimizer.step()`` (gradient clipping); ``after_optimizer``
    right after ``optimizer.step()``, before ``after_step()`` (where a form's memory is sampled);
    ``on_step_end`` after the step is complete (outside its communication record). ``sampler``: this
    rank's rows of each step (default: its slice of ``global_batch``; not with a wrapper whose
    ``batch_wide_loss`` cuts the global batch first)."""
    if accumulation < 1:
        raise ValueError(f"accumulation must be >= 1, got {accumulation}")
    device = module_device(wrapper.module)
    local: list[float] = []
    out = LoopOutput([])
    observers = list(_OBSERVERS)
    for o in observers:
        o.start(wrapper, optimizer)
    for step in range(start_step, tc.steps):
        if sampler is None:
            x, y = global_batch(step, tc.global_batch, cfg.seq_len, tc.seed)
            micro = step_micro_batches(x.to(device), y.to(device), data_rank, data_size,
                                       accumulation, wrapper.batch_wide_loss)
        else:
            x, y = sampler(step, data_rank, data_size)
            micro = micro_batches(x.to(device), y.to(device), accumulation)
        for o in observers:
            o.batch(step, micro)
        optimizer.zero_grad(set_to_none=True)
        loss_sum, marks = 0.0, []
        with comm.recording() as log:
            t0 = time.perf_counter()
            for i, (xm, ym) in enumerate(micro):
                with wrapper.no_sync() if i < accumulation - 1 else contextlib.nullcontext():
                    loss_sum += wrapper.forward_backward(xm, ym, loss_fn, 1 / accumulation)
                marks.append(len(log.records))
            t1 = time.perf_counter()
            wrapper.finish_gradient_sync()
            t2 = time.perf_counter()
            marks[-1] = len(log.records)
            for o in observers:
                o.before_optimizer(step)
            if before_optimizer is not None:
                before_optimizer(step)
            optimizer.step()
            if after_optimizer is not None:
                after_optimizer(step)
            wrapper.after_step()
            t3 = time.perf_counter()
        if on_step_end is not None:
            on_step_end(step)
        for o in observers:
            o.step_end(step)
        local.append(loss_sum)
        out.step_comm.append(list(log.records))
        calls = [b - a for a, b in zip([0, *marks[:-1]], marks, strict=True)]
        out.timeline.append(StepTime(step, t1 - t0, t2 - t1, t3 - t2, log.seconds(), log.count(),
                                     log.sent_bytes(), calls))
    losses = torch.tensor(local, dtype=torch.float32, device=device)
    out.losses = wrapper.reduce_losses(losses).tolist()
    return out


def module_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter or buffer (CPU for an empty module)."""
    for t in [*module.parameters(), *module.buffers()]:
        return t.device
    return torch.device("cpu")
