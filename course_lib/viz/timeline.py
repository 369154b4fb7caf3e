"""Step timelines: where one data-parallel step spends its time on each rank, and which communication the
backward pass hides.

Three layers:

* **Recording** (on the ranks): :class:`RecordingDataParallel` is ``course_lib.parallel.dp.DataParallel`` plus a
  clock. It records a :class:`Span` for every forward, every backward (forward end -> the last gradient of that
  backward is accumulated, seen by ``register_post_accumulate_grad_hook``), every gradient all-reduce (issue ->
  completion: the completion time comes from the collective's future, set by gloo's thread when it is done, not
  from the later ``wait()``), and every exposed wait (``finish_gradient_sync``: communication the compute did
  not hide). Times are ``time.perf_counter()``, which on Linux is ``CLOCK_MONOTONIC``: one clock for all the
  processes of a machine, so the ranks' rows line up. Two knobs create the pitfalls of the chapter:
  ``input_delay_s`` (a rank waits that long for its batch before a step: an input stall, or a straggler) and
  ``link_gbps`` (an **emulated link**: every collective completes no earlier than its ring bytes over that
  bandwidth after the previous one; the extra time is a sleep, which costs no CPU -- nor would a slower wire;
  the real all-reduce still runs, so the gradients are unchanged). :func:`record_train_dp` runs ``dp.train_dp``
  with it (a ``launch`` target) and returns the spans with the run. :class:`EmulatedDeviceGPT` gives each rank
  an **emulated device** (compute costs a sleep proportional to its FLOPs), for timelines on a machine with fewer
  free cores than ranks.
* **Arithmetic** (pure): :func:`breakdown` splits one rank's step into compute, communication in flight,
  communication **hidden** under compute (in flight while the rank computes), **exposed** communication (the
  rank waits), input stall, optimizer. :func:`spans_from_step_times` turns ``DPResult.timeline``
  (``StepTime``, recorded by every ``train_dp`` run) into coarse spans, when no recording was made.
* **Figure** (pure, data in, ``Figure`` out): :func:`plot_timeline` draws one panel per run, two lanes per rank
  (compute; communication in flight, green where it is hidden under compute and red where the rank waits for
  it), and a mandatory ``note`` saying how the times were produced ("gloo on CPU, 2 ranks on 2 cores,
  time-sliced", "emulated device", ...): a timeline without its mode is not evidence.
"""

from __future__ import annotations

import functools
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from torch import nn

from course_lib import comm
from course_lib.model import GPT, GPTConfig
from course_lib.parallel import dp
from course_lib.train import TrainConfig

__all__ = [
    "COLORS",
    "COMPUTE_KINDS",
    "KINDS",
    "Breakdown",
    "EmulatedDeviceGPT",
    "RecordedRun",
    "RecordingDataParallel",
    "Span",
    "breakdown",
    "intersection_length",
    "plot_timeline",
    "record_train_dp",
    "spans_from_step_times",
    "typical_step",
    "union",
    "union_length",
]

KINDS = ("input", "forward", "backward", "wait", "optimizer", "comm")
"""``input``: waiting for the batch; ``forward`` / ``backward``: compute; ``wait``: exposed communication
(``finish_gradient_sync``); ``optimizer``: the step; ``comm``: one collective in flight (issue -> completion)."""
COMPUTE_KINDS = ("forward", "backward")
COLORS = {"input": "#f0a030", "forward": "#9ecae1", "backward": "#3182bd", "wait": "#d62728",
          "optimizer": "#969696", "hidden": "#2ca02c", "exposed": "#d62728", "comm": "#7f7f7f"}


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
# Interval arithmetic


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge intervals into disjoint ones, sorted: [(0, 2), (1, 3), (5, 6)] -> [(0, 3), (5, 6)]."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total time covered by at least one interval."""
    return sum(b - a for a, b in union(intervals))


def intersection_length(xs: Iterable[tuple[float, float]], ys: Iterable[tuple[float, float]]) -> float:
    """Time covered by both an interval of ``xs`` and one of ``ys``."""
    ux, uy = union(xs), union(ys)
    total, i, j = 0.0, 0, 0
    while i < len(ux) and j < len(uy):
        lo, hi = max(ux[i][0], uy[j][0]), min(ux[i][1], uy[j][1])
        total += max(0.0, hi - lo)
        if ux[i][1] < uy[j][1]:
            i += 1
        else:
            j += 1
    return total


def _clip(intervals: Iterable[tuple[float, float]], keep: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``intervals`` that lie inside ``keep`` (both merged first)."""
    out = []
    for a, b in union(intervals):
        for c, d in union(keep):
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                out.append((lo, hi))
    return out


def _minus(intervals: Iterable[tuple[float, float]], cut: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``intervals`` outside every interval of ``cut``."""
    out = []
    cuts = union(cut)
    for a, b in union(intervals):
        pos = a
        for c, d in cuts:
            if d <= pos or c >= b:
                continue
            if c > pos:
                out.append((pos, c))
            pos = max(pos, d)
        if pos < b:
            out.append((pos, b))
    return out


# ----------------------------------------------------------------------------------------------------------------
# One rank's step, in numbers


@dataclass(frozen=True)
class Breakdown:
    """Where one rank's step went (seconds).

    ``compute``: forward + backward (union); ``comm``: time at least one collective was in flight; ``hidden``:
    the part of ``comm`` that ran while the rank computed; ``exposed``: time the rank waited for communication
    (``finish_gradient_sync``); ``input``: waiting for the batch; ``optimizer``; ``step``: first start to last
    end of the step on this rank.
    """

    rank: int
    step: int
    compute: float
    comm: float
    hidden: float
    exposed: float
    input: float
    optimizer: float
    total: float

    @property
    def hidden_fraction(self) -> float:
        """Share of the communication time hidden under compute (0 when there was none)."""
        return self.hidden / self.comm if self.comm > 0 else 0.0

    def __str__(self) -> str:
        ms = 1e3
        text = (f"rank {self.rank}: compute {self.compute * ms:.0f} ms, comm in flight {self.comm * ms:.0f} ms "
                f"({self.hidden * ms:.0f} hidden, {self.exposed * ms:.0f} exposed)")
        if self.input:
            text += f", input wait {self.input * ms:.0f} ms"
        return text + f", step {self.total * ms:.0f} ms"


def _of(spans: Iterable[Span], rank: int, step: int, kinds: Sequence[str]) -> list[tuple[float, float]]:
    return [(s.start, s.end) for s in spans if s.rank == rank and s.step == step and s.kind in kinds]


def breakdown(spans: Sequence[Span], rank: int, step: int) -> Breakdown:
    """Compute / communication / hidden / exposed time of ``rank`` in ``step`` (see :class:`Breakdown`)."""
    mine = [s for s in spans if s.rank == rank and s.step == step]
    if not mine:
        raise ValueError(f"no spans for rank {rank}, step {step}")
    compute = _of(mine, rank, step, COMPUTE_KINDS)
    comms = _of(mine, rank, step, ("comm",))
    return Breakdown(
        rank=rank, step=step, compute=union_length(compute), comm=union_length(comms),
        hidden=intersection_length(comms, compute), exposed=union_length(_of(mine, rank, step, ("wait",))),
        input=union_length(_of(mine, rank, step, ("input",))),
        optimizer=union_length(_of(mine, rank, step, ("optimizer",))),
        total=max(s.end for s in mine) - min(s.start for s in mine))


def typical_step(spans: Sequence[Span], skip_first: bool = True) -> int:
    """The step whose duration (first start to last end over all ranks) is the median one; step 0 (warm-up:
    allocations, first calls) is skipped when there are others."""
    steps = sorted({s.step for s in spans})
    if not steps:
        raise ValueError("no spans")
    if skip_first and len(steps) > 1:
        steps = steps[1:]
    length = {k: max(s.end for s in spans if s.step == k) - min(s.start for s in spans if s.step == k)
              for k in steps}
    med = statistics.median_low(length.values())
    return next(k for k in steps if length[k] == med)


def spans_from_step_times(step_times: Sequence[Any], rank: int = 0) -> list[Span]:
    """Coarse spans from ``DPResult.timeline`` (``StepTime``: compute, exposed wait, optimizer, one after the
    other, steps laid end to end). There is no per-bucket information: the communication lane stays empty."""
    spans, t = [], 0.0
    for st in step_times:
        for kind, seconds in (("backward", st.compute_s), ("wait", st.exposed_comm_s), ("optimizer", st.optimizer_s)):
            spans.append(Span(rank, kind, t, t + seconds, st.step))
            t += seconds
    return spans


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
        self.rank = dist.get_rank()
        self.input_delay_s = float((input_delay_s or {}).get(self.rank, 0.0))
        self._step = 0
        self._step_started = False
        self._fwd_end: float | None = None
        self._last_grad: float | None = None
        self._open = 0  # async buckets whose completion has not been recorded yet
        self._rec_hooks = [p.register_post_accumulate_grad_hook(self._grad_done) for p in self.params]
        RecordingDataParallel.last = self

    def _add(self, kind: str, start: float, end: float, label: str = "", step: int | None = None) -> None:
        self.spans.append(Span(self.rank, kind, start, end, self._step if step is None else step, label))

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

    # -- communication ------------------------------------------------------------------------------------------

    def _sent(self, t: torch.Tensor) -> int:
        n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        return comm.ring_bytes("all_reduce", t.numel(), t.element_size(), n, r)[0]

    def _blocking(self, t: torch.Tensor, label: str) -> None:
        start = time.perf_counter()
        comm.all_reduce(t, group=self.group)
        end = self.link.block(start, self._sent(t)) if self.link else time.perf_counter()
        self._add("comm", start, end, label)

    def _launch(self, b: dp.Bucket, async_op: bool) -> None:
        self._pack(b)
        label = f"bucket {b.index}"
        if not async_op:  # bucketed mode: a blocking call, complete when it returns
            self._blocking(b.buffer, label)
            b.work = None
            return
        start, step = time.perf_counter(), self._step
        work = comm.all_reduce(b.buffer, group=self.group, async_op=True)
        self._open += 1

        def finished(end: float) -> None:  # on gloo's (or the emulated link's) thread
            self.spans.append(Span(self.rank, "comm", start, end, step, label))
            self._open -= 1

        if self.link:
            b.work = self.link.submit(work, start, self._sent(b.buffer), finished)
            return
        b.work = work
        future = getattr(getattr(work, "_work", None), "get_future", None)
        if future is None:  # no future from this backend: completion is known only at wait()
            work.wait()
            finished(time.perf_counter())
        else:
            future().add_done_callback(lambda _: finished(time.perf_counter()))

    def _sync_naive(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._blocking(p.grad, f"param {i}")
            self._average(p.grad)

    def remove_hooks(self) -> None:
        super().remove_hooks()
        for handle in self._rec_hooks:
            handle.remove()
        self._rec_hooks.clear()


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

    result: dp.DPResult
    spans: list[Span] = field(repr=False)


def record_train_dp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
                    mode: dp.Mode = "overlapped",
                    bucket_mb: float = dp.DEFAULT_BUCKET_MB, accumulation: int = 1,
                    input_delay_s: Mapping[int, float] | None = None, link_gbps: float | None = None,
                    model_fn: dp.ModelFn | None = None) -> RecordedRun:
    """``dp.train_dp`` with :class:`RecordingDataParallel` (a ``launch`` target, like ``train_dp``)."""
    wrapper = functools.partial(RecordingDataParallel, input_delay_s=input_delay_s, link_gbps=link_gbps)
    res = dp.train_dp(rank, world_size, cfg, tc, mode=mode, bucket_mb=bucket_mb, accumulation=accumulation,
                      model_fn=model_fn, dp_class=wrapper)  # type: ignore[arg-type]
    rec = RecordingDataParallel.last
    assert rec is not None
    spans = list(rec.spans)
    for st in res.timeline:  # the optimizer step follows the exposed wait of its step
        waits = [s for s in spans if s.step == st.step and s.kind == "wait"]
        if waits:
            end = waits[-1].end
            spans.append(Span(rec.rank, "optimizer", end, end + st.optimizer_s, st.step))
    rec.remove_hooks()
    return RecordedRun(res, sorted(spans, key=lambda s: (s.step, s.start)))


# ----------------------------------------------------------------------------------------------------------------
# The figure


def plot_timeline(panels: Mapping[str, Sequence[Span]], *, note: str, step: int | None = None,
                  title: str | None = None, width: float = 9.0, xmax_ms: float | None = None) -> Figure:
    """One panel per run (``panels``: {label: spans of all ranks}), one step each (``step``, default
    :func:`typical_step` of that run), two lanes per rank: compute (input wait, forward, backward, exposed wait,
    optimizer) and communication in flight, green where the rank computes at the same time (hidden) and red
    where it does not (exposed). Times in ms from the step's first start over all ranks. ``note``: how the times
    were produced (required, shown under the title). ``xmax_ms``: a common time axis (default: each panel's own
    maximum, shared by all panels)."""
    if not panels:
        raise ValueError("nothing to plot: no panels")
    if not note:
        raise ValueError("say how the times were produced (note=...): a timeline without its mode is no evidence")
    chosen: dict[str, tuple[int, list[Span]]] = {}
    for label, spans in panels.items():
        if not spans:
            raise ValueError(f"panel {label!r} has no spans")
        k = typical_step(spans) if step is None else step
        sel = [s for s in spans if s.step == k]
        if not sel:
            raise ValueError(f"panel {label!r} has no spans in step {k}")
        chosen[label] = (k, sel)
    origin = {label: min(s.start for s in sel) for label, (_, sel) in chosen.items()}
    longest = max(max(s.end for s in sel) - origin[label] for label, (_, sel) in chosen.items()) * 1e3
    xmax = xmax_ms or longest * 1.02
    n_ranks = [len({s.rank for s in sel}) for _, sel in chosen.values()]
    fig = Figure(figsize=(width, sum(0.75 * n + 0.75 for n in n_ranks) + 0.9), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=[n + 1 for n in n_ranks])[:, 0]
    for ax, (label, (k, sel)) in zip(axes, chosen.items(), strict=True):
        t0 = origin[label]
        ranks = sorted({s.rank for s in sel})
        yticks, ylabels, texts = [], [], []
        for i, r in enumerate(ranks):
            base = (len(ranks) - 1 - i) * 2.2
            compute_iv = _of(sel, r, k, COMPUTE_KINDS)
            for s in (s for s in sel if s.rank == r and s.kind != "comm"):
                ax.broken_barh([((s.start - t0) * 1e3, s.seconds * 1e3)], (base + 1.1, 0.9),
                               facecolors=COLORS[s.kind], edgecolor="white", linewidth=0.3,
                               hatch="//" if s.kind == "wait" else None)
            comm_iv = _of(sel, r, k, ("comm",))
            for part, color in ((_clip(comm_iv, compute_iv), COLORS["hidden"]),
                                (_minus(comm_iv, compute_iv), COLORS["exposed"])):
                ax.broken_barh([((a - t0) * 1e3, (b - a) * 1e3) for a, b in part], (base + 0.1, 0.8),
                               facecolors=color, alpha=0.75)
            for s in (s for s in sel if s.rank == r and s.kind == "comm"):  # one tick per collective issued
                ax.plot([(s.start - t0) * 1e3], [base + 0.95], marker="v", ms=3, color="black", lw=0)
            yticks += [base + 1.55, base + 0.5]
            ylabels += [f"rank {r} compute", f"rank {r} comm"]
            texts.append(str(breakdown(sel, r, k)))
        ax.set_yticks(yticks, ylabels, fontsize=7)
        ax.set_xlim(0, xmax)
        ax.set_ylim(-0.2, len(ranks) * 2.2)
        ax.set_title(f"{label} (step {k})\n" + "\n".join(texts), fontsize=7.5, loc="left")
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(True, axis="x", lw=0.3, alpha=0.5)
    axes[-1].set_xlabel("ms since the step began (first rank to start)", fontsize=8)
    legend = [Patch(color=COLORS[k], label=t) for k, t in (
        ("input", "waiting for the batch"), ("forward", "forward"), ("backward", "backward"),
        ("optimizer", "optimizer step"), ("hidden", "comm in flight, hidden under compute"),
        ("exposed", "comm in flight / exposed wait"))]
    fig.legend(handles=legend, loc="outside lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle((title + "\n" if title else "") + note, fontsize=8.5)
    return fig
