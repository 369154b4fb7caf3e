"""Recording and emulation on the ranks: the runtime side of the course's timelines (``course_lib.viz`` only
plots what these record).

* :class:`RecordingDataParallel` is ``course_lib.parallel.dp.DataParallel`` plus a clock, through its public
  ``all_reduce`` seam and the wrapper's hooks. It records a :class:`Span` for every forward, every backward
  (forward end -> the last gradient of that backward is accumulated, seen by
  ``register_post_accumulate_grad_hook``), every gradient all-reduce (issue -> completion: the completion time
  comes from the collective's future, set by gloo's thread when it is done, not from the later ``wait()``), and
  every exposed wait (``finish_gradient_sync``: communication the compute did not hide). Times are
  ``time.perf_counter()``, which on Linux is ``CLOCK_MONOTONIC``: one clock for all the processes of a
  machine, so the ranks' rows line up. Two knobs create the pitfalls of the data-parallel chapter:
  ``input_delay_s`` (a rank waits that long for its batch before a step: an input stall, or a straggler) and
  ``link_gbps`` (an **emulated link**: every collective completes no earlier than its ring bytes over that
  bandwidth after the previous one; the extra time is a sleep, which costs no CPU -- nor would a slower wire;
  the real all-reduce still runs, so the gradients are unchanged). :func:`record_train_dp` runs
  ``runs.train_dp`` with it (a ``launch`` target) and returns the spans with the run.
* :class:`EmulatedDeviceGPT` gives each rank an **emulated device** (compute costs a sleep proportional to its
  FLOPs), for timelines on a machine with fewer free cores than ranks.
* :func:`record_zero_step` runs ``runs.train_zero``'s loop with compute markers in ZeRO's per-unit event list
  (``course_lib.viz.zero`` lays them out and draws them).
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.parallel import dp, runs, zero
from course_lib.parallel.loop import build_model, train_loop
from course_lib.train import TrainConfig, make_optimizer

__all__ = ["KINDS", "EmulatedDeviceGPT", "RecordedRun", "RecordingDataParallel", "Span", "record_train_dp",
           "record_zero_step"]

KINDS = ("input", "forward", "backward", "wait", "optimizer", "comm")
"""``input``: waiting for the batch; ``forward`` / ``backward``: compute; ``wait``: exposed communication
(``finish_gradient_sync``); ``optimizer``: the step; ``comm``: one collective in flight (issue -> completion)."""

@dataclass(frozen=True)
class Span:
    """One interval on one rank: ``kind`` (see ``KINDS``) from ``start`` to ``end`` (seconds, one clock for all
    ranks of the machine), during optimizer step ``step``; ``label`` names the bucket of a ``comm`` span."""

    rank: int
    kind: str
    start: float
    end: float
    step: int = 0
    label: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown span kind {self.kind!r}: use one of {KINDS}")
        if self.end < self.start:
            raise ValueError(f"span {self.kind} ends ({self.end}) before it starts ({self.start})")

    @property
    def seconds(self) -> float:
        return self.end - self.start


# ----------------------------------------------------------------------------------------------------------------
# Recording on the ranks


class _EmulatedLink:
    """A link of ``gbps`` GB/s that this rank's collectives share one after the other: a collective issued at
    ``t`` and sending ``b`` bytes completes no earlier than ``max(t, link free) + b / bandwidth`` (nor before the
    real collective). The extra time is a sleep -- no CPU, as with a slower wire -- on one helper
    thread that serves the collectives in the order they were issued (as a real link does)."""

    def __init__(self, gbps: float) -> None:
        self.bytes_per_s = gbps * 1e9
        self.free_at = 0.0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="emulated-link", daemon=True)
        self._thread.start()

    def block(self, start: float, sent_bytes: int) -> float:
        """A blocking collective issued at ``start`` has just returned: sleep until the emulated link is done."""
        target = max(start, self.free_at) + sent_bytes / self.bytes_per_s
        self.free_at = max(target, time.perf_counter())
        time.sleep(max(0.0, target - time.perf_counter()))
        return time.perf_counter()

    def submit(self, work: Any, start: float, sent_bytes: int, on_done: Callable[[float], None]) -> _LinkWork:
        handle = _LinkWork(work)
        self._queue.put((handle, start, sent_bytes, on_done))
        return handle

    def _serve(self) -> None:
        while True:
            handle, start, sent_bytes, on_done = self._queue.get()
            handle.work.wait()
            on_done(self.block(start, sent_bytes))
            handle.done.set()


class _LinkWork:
    """The handle ``finish_gradient_sync`` waits on when the link is emulated."""

    def __init__(self, work: Any) -> None:
        self.work = work
        self.done = threading.Event()

    def wait(self) -> bool:
        self.done.wait()
        return True


class RecordingDataParallel(dp.DataParallel):
    """``DataParallel`` that records :class:`Span` s (see the module docstring). ``spans``: this rank's record;
    ``RecordingDataParallel.last``: the most recent instance of this process (``train_dp`` builds the wrapper
    itself). ``input_delay_s``: {rank: seconds} this rank sleeps before the first forward of every step (an
    input stall). ``link_gbps``: emulate a link of that bandwidth (GB/s, this rank's ring bytes over it, one
    collective at a time; the real collective still runs and the gradients are unchanged)."""

    last: RecordingDataParallel | None = None

    def __init__(self, module: nn.Module, *args: Any, input_delay_s: Mapping[int, float] | None = None,
                 link_gbps: float | None = None, **kwargs: Any) -> None:
        if link_gbps is not None and link_gbps <= 0:
            raise ValueError(f"link_gbps must be > 0 (GB/s), got {link_gbps}")
        super().__init__(module, *args, **kwargs)
        self.spans: list[Span] = []
        self.link = _EmulatedLink(link_gbps) if link_gbps else None
        self.global_rank = dist.get_rank()  # spans are labelled by global rank
        self.input_delay_s = float((input_delay_s or {}).get(self.global_rank, 0.0))
        self._step = 0
        self._step_started = False
        self._fwd_end: float | None = None
        self._last_grad: float | None = None
        self._open = 0  # async buckets whose completion has not been recorded yet
        self._hooks += [p.register_post_accumulate_grad_hook(self._grad_done) for p in self.params]
        RecordingDataParallel.last = self

    def _add(self, kind: str, start: float, end: float, label: str = "", step: int | None = None) -> None:
        self.spans.append(Span(self.global_rank, kind, start, end, self._step if step is None else step, label))

    def _close_backward(self) -> None:
        if self._fwd_end is not None and self._last_grad is not None and self._last_grad >= self._fwd_end:
            self._add("backward", self._fwd_end, self._last_grad)
        self._fwd_end = self._last_grad = None

    def _grad_done(self, p: nn.Parameter) -> None:
        self._last_grad = time.perf_counter()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._close_backward()  # the previous micro-batch's backward, if any
        if not self._step_started:
            self._step_started = True
            if self.input_delay_s:
                t0 = time.perf_counter()
                time.sleep(self.input_delay_s)
                self._add("input", t0, time.perf_counter())
        t0 = time.perf_counter()
        out = super().forward(*args, **kwargs)
        self._fwd_end = time.perf_counter()
        self._add("forward", t0, self._fwd_end)
        return out

    def finish_gradient_sync(self) -> None:
        self._close_backward()
        t0 = time.perf_counter()
        super().finish_gradient_sync()
        self._add("wait", t0, time.perf_counter())
        give_up = time.perf_counter() + 1.0
        while self._open > 0 and time.perf_counter() < give_up:  # completion callbacks may trail wait() a bit
            time.sleep(1e-4)
        self._step += 1
        self._step_started = False

    # -- communication: the wrapper's all_reduce seam, timed ------------------------------------------------

    def _sent(self, t: torch.Tensor) -> int:
        return comm.ring_bytes("all_reduce", t.numel(), t.element_size(), self.world_size, self.rank)[0]

    def all_reduce(self, tensor: torch.Tensor, label: str, async_op: bool) -> Any:
        start, step = time.perf_counter(), self._step
        if not async_op:  # naive / bucketed mode: a blocking call, complete when it returns
            comm.all_reduce(tensor, group=self.group)
            end = self.link.block(start, self._sent(tensor)) if self.link else time.perf_counter()
            self._add("comm", start, end, label)
            return None
        work = comm.all_reduce(tensor, group=self.group, async_op=True)
        self._open += 1

        def finished(end: float) -> None:  # on gloo's (or the emulated link's) thread
            self.spans.append(Span(self.global_rank, "comm", start, end, step, label))
            self._open -= 1

        if self.link:
            return self.link.submit(work, start, self._sent(tensor), finished)
        future = getattr(getattr(work, "_work", None), "get_future", None)
        if future is None:  # no future from this backend: completion is known only at wait()
            work.wait()
            finished(time.perf_counter())
        else:
            future().add_done_callback(lambda _: finished(time.perf_counter()))
        return work


class _DeviceTime(torch.autograd.Function):
    """Identity whose forward and backward each cost a sleep: the host waiting for an (emulated) device."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class EmulatedDeviceGPT(GPT):
    """The course's GPT on an **emulated device** that computes at ``flops_per_s``: after each block (and the
    head) the forward sleeps 2 x its parameters x tokens / ``flops_per_s`` and the backward 4 x as much, before
    the block's gradients are produced. The real math still runs (results are those of ``GPT``), but on a model
    small enough that it costs little; the sleeps dominate and take no CPU -- from the host's side a GPU kernel
    is a wait too -- so ranks run truly side by side on a machine with fewer cores than ranks, and timelines show
    the algorithm, not the scheduler. Build it with ``functools.partial(EmulatedDeviceGPT, flops_per_s=...)`` as
    a ``model_fn``."""

    def __init__(self, config: GPTConfig, seed: int = 0, *, flops_per_s: float) -> None:
        if flops_per_s <= 0:
            raise ValueError(f"flops_per_s must be > 0, got {flops_per_s}")
        super().__init__(config, seed)
        self.flops_per_s = flops_per_s

    def _cost(self, modules: Sequence[nn.Module], tokens: int) -> tuple[float, float]:
        params = sum(p.numel() for m in modules for p in m.parameters())
        forward = 2 * params * tokens / self.flops_per_s
        return forward, 2 * forward

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        tokens = idx.numel()
        x = self.embed(idx)
        for block in self.blocks:
            x = _DeviceTime.apply(block(x), *self._cost([block], tokens))
        return _DeviceTime.apply(self.head(x), *self._cost([self.norm_f, self.lm_head], tokens))


@dataclass
class RecordedRun:
    """What :func:`record_train_dp` returns on each rank: the ``DPResult`` and this rank's spans (with the
    optimizer spans added from ``DPResult.timeline``)."""

    result: runs.RunResult
    spans: list[Span] = field(repr=False)


def record_train_dp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
                    mode: dp.Mode = "overlapped",
                    bucket_mb: float = dp.DEFAULT_BUCKET_MB, accumulation: int = 1,
                    input_delay_s: Mapping[int, float] | None = None, link_gbps: float | None = None,
                    model_fn: dp.ModelFn | None = None) -> RecordedRun:
    """``runs.train_dp`` with :class:`RecordingDataParallel` (a ``launch`` target, like ``train_dp``)."""
    wrapper = functools.partial(RecordingDataParallel, input_delay_s=input_delay_s, link_gbps=link_gbps)
    res = runs.train_dp(rank, world_size, cfg, tc, mode=mode, bucket_mb=bucket_mb, accumulation=accumulation,
                      model_fn=model_fn, data_parallel=wrapper)  # type: ignore[arg-type]
    rec = RecordingDataParallel.last
    assert rec is not None
    spans = list(rec.spans)
    for st in res.timeline:  # the optimizer step follows the exposed wait of its step
        waits = [s for s in spans if s.step == st.step and s.kind == "wait"]
        if waits:
            end = waits[-1].end
            spans.append(Span(rec.global_rank, "optimizer", end, end + st.optimizer_s, st.step))
    rec.remove_hooks()
    return RecordedRun(res, sorted(spans, key=lambda s: (s.step, s.start)))


# ----------------------------------------------------------------------------------------------------------------
# ZeRO's unit schedule with compute markers


def _mark(events: list[tuple[str, str]], kind: str, name: str, *_: Any) -> None:
    events.append((kind, name))


class MarkedZero(zero.ZeroDataParallel):
    """``ZeroDataParallel`` with compute markers in its own event list, between its collectives. Hooks
    registered *after* the engine's: a unit's "forward" marker lands after its all-gather (and any prefetch it
    issues), "forward_end" after its forward (and its reshard), "backward" after its pre-backward all-gather;
    its reduce-scatter marks the end of its backward. ``remove_hooks`` removes them with the engine's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ev = self.events
        for unit in self.units:
            name = unit.name
            self._hooks.append(unit.module.register_forward_pre_hook(functools.partial(_mark, ev, "forward", name)))
            state = {"seen": False}

            def post(module: Any, args: Any, output: Any, name: str = name, state: dict = state) -> None:
                ev.append(("forward_end", name))
                state["seen"] = False
                outs = [output] if hasattr(output, "register_hook") else [
                    t for t in (output if isinstance(output, tuple | list) else []) if hasattr(t, "register_hook")]
                for t in outs:
                    if t.requires_grad:
                        def on_grad(grad: Any, name: str = name, state: dict = state) -> None:
                            if not state["seen"]:
                                state["seen"] = True
                                ev.append(("backward", name))
                        t.register_hook(on_grad)
            self._hooks.append(unit.module.register_forward_hook(post))


def _parent(name: str, names: Sequence[str]) -> str | None:
    """The innermost other unit whose module path encloses ``name`` ("" is the root's path)."""
    if name == "":
        return None
    enclosing = [n for n in names if n != name and (n == "" or name.startswith(n + "."))]
    return max(enclosing, key=len) if enclosing else None


def record_zero_step(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None, stage: int = 3, *,
                     prefetch: bool = False, reshard_after_forward: bool | None = None,
                     steps: int = 2) -> dict[str, Any]:
    """A ``launch`` target: ``steps`` steps of ``MarkedZero`` (stage 2 or 3) through ``loop.train_loop``, the
    optimizer step marked by the loop's hooks; returns the last step's events (collectives and markers, in
    issue order), the units (name, padded size, parent) and the rank. Only the last step is kept: forward
    prefetch follows the previous step's order."""
    if stage < 2:
        raise ValueError("the unit timeline needs stage 2 or 3 (each unit's reduce-scatter ends its backward)")
    tc = dataclasses.replace(tc or TrainConfig(), steps=steps)
    zdp = MarkedZero(build_model(cfg, tc.seed), stage, prefetch=prefetch, reshard_after_forward=reshard_after_forward)
    opt = make_optimizer(list(zdp.parameters()), tc)
    marks = [len(zdp.events)]
    train_loop(zdp, opt, cfg, tc, data_rank=zdp.rank, data_size=zdp.world_size,
               before_optimizer=lambda step: zdp.events.append(("optimizer", "")),
               after_optimizer=lambda step: zdp.events.append(("optimizer_end", "")),
               on_step_end=lambda step: marks.append(len(zdp.events)))
    names = [u.name for u in zdp.units]
    units = [{"name": u.name, "padded_numel": u.layout.padded_numel, "parent": _parent(u.name, names)}
             for u in zdp.units]
    return {"rank": rank, "stage": stage, "prefetch": prefetch, "events": list(zdp.events[marks[-2]:]),
            "units": units}
