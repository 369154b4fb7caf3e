"""Serving figures and widgets: the scheduler's timeline, the roofline, the serving budget, and a trace replay.

* :func:`plot_schedule` -- which request ran in which step (prefill / decode / recompute), on the clock that
  made it ("simulated" or "wall-clock", in the title);
* :func:`plot_roofline` -- attainable FLOP/s vs arithmetic intensity, with measured points;
* :class:`ServingBudgetPanel` -- model, GPU, batch, context, quantisation, TP, token budget, all-reduce
  algorithm -> memory per GPU, max concurrent sequences, predicted tokens/s and latency, and the bound that
  dominates (:func:`course_lib.serving.budget.predict`); a batch, context or TP it cannot use is refused with a
  message, and a configuration that does not fit gets no step time or throughput;
* :class:`TracePanel` -- arrival rate and batching policy -> p50/p99 TTFT and ITL of a trace served by the tiny
  GPT on this machine (wall-clock) or on the simulated clock (``TracePanel.TRACE``: chapter 09's trace shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import ipywidgets as W
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from course_lib.estimates.hardware import GPUS
from course_lib.estimates.memory_budget import GB
from course_lib.model import GPT
from course_lib.model_config import PRESETS, GPTConfig
from course_lib.serving.budget import QUANTISATION, TOKEN_BUDGET, predict
from course_lib.serving.engine import Engine
from course_lib.serving.loadgen import poisson_trace
from course_lib.serving.paged import PagedKVCache
from course_lib.serving.roofline import StepCost
from course_lib.serving.scheduler import Scheduler, ServeResult, SimClock, WallClock
from course_lib.viz.memory import CATEGORY_COLORS
from course_lib.viz.panel import ControlPanel, figure_png

KIND_COLORS = {"prefill": "#4C72B0", "decode": "#55A868", "recompute": "#C44E52"}


def plot_schedule(result: ServeResult, *, max_requests: int = 24, title: str = "") -> Figure:
    """One row per request, one bar per step it took part in, coloured by what it fed; x is the clock's time."""
    fig = Figure(figsize=(9, min(4.8, 0.15 * min(max_requests, len(result.records)) + 1.4)))
    ax = fig.add_subplot()
    ids = [r.id for r in result.records][:max_requests]
    row = {rid: i for i, rid in enumerate(ids)}
    scale = 1e3
    for s in result.steps:
        for rid, kind, _ in s.work:
            if rid in row:
                ax.barh(row[rid], (s.end_s - s.start_s) * scale, left=s.start_s * scale, height=0.7,
                        color=KIND_COLORS[kind], linewidth=0)
    for r in result.records[:max_requests]:
        ax.plot(r.arrival_s * scale, row[r.id], marker="|", color="black", markersize=8)
    ax.set_yticks(range(len(ids)), [f"req {i}" for i in ids], fontsize=6 if len(ids) > 16 else 7)
    ax.invert_yaxis()
    ax.set_xlabel(f"time (ms, {result.clock_mode})")
    handles = [Patch(color=c, label=k) for k, c in KIND_COLORS.items()]
    ax.legend(handles=[*handles, Patch(color="black", label="| arrival")], fontsize=7, loc="lower right", ncol=4)
    ax.set_title(title or f"{result.policy} batching: which request ran in each step ({result.clock_mode})",
                 fontsize=9)
    fig.tight_layout()
    return fig


def _finish(fig: Figure, xlabel: str, ylabel: str, title: str, *, legend: bool = True) -> Figure:
    """The ending the line plots below share: axis labels, a small title and legend, a tight layout."""
    ax = fig.axes[0]
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if legend:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_roofline(peak_flops: float, mem_bandwidth: float, points: Mapping[str, tuple[float, float]], *,
                  title: str) -> Figure:
    """log-log roofline: min(peak, I x bandwidth), and ``points`` {label: (intensity FLOP/byte, FLOP/s)}."""
    import numpy as np

    fig = Figure(figsize=(6.5, 4))
    ax = fig.add_subplot()
    lo = min([0.1, *[i for i, _ in points.values()]]) / 2
    hi = max([peak_flops / mem_bandwidth * 20, *[i for i, _ in points.values()]]) * 2
    xs = np.geomspace(lo, hi, 200)
    ax.loglog(xs, np.minimum(peak_flops, xs * mem_bandwidth), color="black", label="roofline")
    ax.axvline(peak_flops / mem_bandwidth, color="grey", linestyle=":", label=f"ridge {peak_flops / mem_bandwidth:.0f}"
               " FLOP/B")
    for k, (label, (i, f)) in enumerate(points.items()):
        ax.loglog(i, f, "o", label=label, color=f"C{k}")
    return _finish(fig, "arithmetic intensity (FLOP / byte)", "FLOP/s", title)


def plot_decode_throughput(batches: list[int], series: Mapping[str, list[float]], *, title: str) -> Figure:
    """log-log decode tokens/s vs batch, one line per ``series`` {label: tokens/s at each batch}; the label says
    whether a line is modelled or measured (and on which device)."""
    fig = Figure(figsize=(6.5, 3.6))
    ax = fig.add_subplot()
    for k, (label, ys) in enumerate(series.items()):
        ax.loglog(batches, ys, "o-" if "measured" in label else "--", label=label, color=f"C{k}")
    return _finish(fig, "batch (sequences decoding together)", "output tokens / s", title)


def plot_budget_sweep(points: Mapping[str, tuple[float, float]], *, title: str) -> Figure:
    """Chunked prefill's trade-off: one point per token budget {label: (TTFT p99 s, ITL p99 s)}, in ms."""
    fig = Figure(figsize=(6, 3.4))
    ax = fig.add_subplot()
    xs, ys = zip(*[(t * 1e3, i * 1e3) for t, i in points.values()], strict=True)
    ax.plot(xs, ys, "o-", color="C0")
    for label, x, y in zip(points, xs, ys, strict=True):
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    return _finish(fig, "TTFT p99 (ms)", "ITL p99 (ms)", title, legend=False)


class ServingBudgetPanel(ControlPanel):
    """Model preset, GPU, batch, context, quantisation, TP, token budget -> memory per GPU by category, max
    concurrent sequences, predicted decode tokens/s and inter-token latency. ``set(tp=4)`` -> ``text``; a value
    the widget cannot use (batch 0, a TP degree not offered or not dividing the model) shows ``invalid: ...``."""

    def __init__(self, model: str = "llama3-70b", gpu: str = "H100 80GB", draw: bool = True,
                 **values: Any) -> None:
        super().__init__()
        self._draw = draw
        style = {"description_width": "initial"}
        self.controls = {
            "model": W.Dropdown(options=[k for k in PRESETS if k != "tiny"], value=model, description="model",
                                style=style),
            "gpu": W.Dropdown(options=list(GPUS), value=gpu, description="GPU", style=style),
            "batch": W.IntText(value=32, description="batch (sequences)", style=style,
                               layout=W.Layout(width="200px")),  # unbounded: 0 is refused with a message
            "context": W.IntText(value=4096, description="context (tokens)", style=style,
                                 layout=W.Layout(width="220px")),
            "quant": W.ToggleButtons(options=list(QUANTISATION), value="bf16", description="weights",
                                     style={"description_width": "initial", "button_width": "60px"}),
            "tp": W.Dropdown(options=[1, 2, 4, 8], value=1, description="TP", style=style,
                             layout=W.Layout(width="120px")),
            "token_budget": W.IntText(value=TOKEN_BUDGET, description="tokens per step", style=style,
                                      layout=W.Layout(width="200px")),
            "allreduce": W.ToggleButtons(options=["best", "ring"], value="best", description="all-reduce",
                                         style={"description_width": "initial", "button_width": "60px"}),
        }
        self.image = W.Image(format="png")
        self.out = W.HTML()
        self.children = [W.HBox([self.controls["model"], self.controls["gpu"], self.controls["tp"]]),
                         W.HBox([self.controls["batch"], self.controls["context"], self.controls["quant"]]),
                         W.HBox([self.controls["token_budget"], self.controls["allreduce"]]), self.out, self.image]
        self._watch()
        self.prediction = None
        self.error = self._refused = ""
        self.set(**values) if values else self.update()

    def _prepare(self, values: dict[str, Any]) -> dict[str, Any]:
        """A TP degree the dropdown does not offer is refused with a message (the control keeps its value)."""
        offered = self.controls["tp"].options
        self._refused = ""
        if "tp" in values and values["tp"] not in offered:
            self._refused = (f"tp={values['tp']!r}: this widget splits a model over {', '.join(map(str, offered))} "
                             "GPUs of one server")
            values = {k: x for k, x in values.items() if k != "tp"}
        return values

    def update(self) -> None:
        v = self.values()
        try:
            if self._refused:
                raise ValueError(self._refused)
            self.prediction = predict(v["model"], v["gpu"], batch=v["batch"], context=v["context"],
                                      quant=v["quant"], tp=v["tp"], allreduce=v["allreduce"],
                                      token_budget=v["token_budget"])
            self.error = ""
        except ValueError as e:
            self.prediction, self.error = None, str(e)
        self.out.value = "<pre>" + self.text + "</pre>"
        if self._draw:  # an invalid split shows its error and no figure (not the last valid one's)
            self.image.value = figure_png(self.figure()) if self.prediction is not None else b""
            self.image.layout.display = None if self.prediction is not None else "none"

    def figure(self) -> Figure:
        p = self.prediction
        fig = Figure(figsize=(6.5, 2.2))
        ax = fig.add_subplot()
        left = 0.0
        for cat, b in p.budget.items():
            ax.barh(0, b / GB, left=left, color=CATEGORY_COLORS.get(cat), label=cat)
            left += b / GB
        ax.axvline(p.capacity_bytes / GB, color="black", linestyle="--", label=f"{self.values()['gpu']}")
        ax.set_yticks([])
        ax.set_xlabel("GB per GPU (modelled)")
        ax.legend(fontsize=7, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.02), frameon=False)
        fig.tight_layout()
        return fig

    @property
    def text(self) -> str:
        if self.prediction is None:
            return f"invalid: {self.error}"
        p, v = self.prediction, self.values()
        fit = "fits" if p.fits else "does NOT fit"
        head = (f"{v['model']} on {v['tp']} x {v['gpu']} ({v['quant']} weights, bf16 KV cache; workspace: one "
                f"{v['token_budget']}-token step)\n"
                f"memory per GPU {p.budget.total / GB:.1f} GB of {p.capacity_bytes / GB:.1f} GB: {fit}\n"
                f"max concurrent sequences of {v['context']} tokens: {p.max_sequences}\n")
        if not p.fits:
            return head + ("no decode step or throughput: this configuration does not fit (lower the batch or the "
                           "context, raise TP, or quantise the weights)")
        return (head + f"decode step {p.step_s * 1e3:.2f} ms ({p.bound}; compute {p.compute_s * 1e3:.2f} ms, memory "
                f"{p.memory_s * 1e3:.2f} ms, TP all-reduces ({v['allreduce']}) {p.comm_s * 1e3:.2f} ms)\n"
                f"-> inter-token latency {p.step_s * 1e3:.2f} ms, {p.tokens_per_s:.0f} tokens/s for the batch; "
                f"prefill of the context ~{p.ttft_s * 1e3:.0f} ms (predicted, roofline)")


class TracePanel(ControlPanel):
    """Arrival rate and batching policy -> p50/p99 TTFT and ITL of a Poisson trace served by the tiny GPT.

    ``clock="wall-clock"`` measures this machine; ``"simulated"`` uses the roofline cost of Llama-3-8B on an
    H100 for each step (tokens still come from the tiny GPT). The trace is ``poisson_trace(n_requests, rate,
    **TRACE, seed=seed)``: chapter 09 builds its section 5 trace from the same ``TRACE``, so at its rate and seed
    the widget replays that trace.
    """

    TRACE: ClassVar[dict[str, tuple[int, int]]] = {"short_prompt": (4, 16), "long_prompt": (32, 64),
                                                   "output": (2, 60)}
    POLICIES: ClassVar[dict[str, tuple[str, int | None]]] = {
        "static": ("static", None), "continuous": ("continuous", None), "chunked prefill": ("continuous", 32)}

    def __init__(self, n_requests: int = 24, seed: int = 0, draw: bool = True, **values: Any) -> None:
        super().__init__()
        self._draw, self.n_requests, self.seed = draw, n_requests, seed
        self.config = GPTConfig(seq_len=128)
        self.model = GPT(self.config, seed=0).eval()
        style = {"description_width": "initial"}
        self.controls = {
            "rate": W.Dropdown(options=[10, 30, 100, 300, 1000], value=100, description="arrivals / s",
                               style=style),
            "policy": W.ToggleButtons(options=list(self.POLICIES), value="continuous", description="batching",
                                      style={"description_width": "initial", "button_width": "135px"}),
            "clock": W.ToggleButtons(options=["simulated", "wall-clock"], value="simulated", description="clock",
                                     style={"description_width": "initial", "button_width": "90px"}),
        }
        self.image = W.Image(format="png")
        self.out = W.HTML()
        self.children = [W.HBox([self.controls["rate"], self.controls["clock"]]), self.controls["policy"],
                         self.out, self.image]
        self._watch()
        self.result: ServeResult | None = None
        self.set(**values) if values else self.update()

    def update(self) -> None:
        v = self.values()
        policy, budget = self.POLICIES[v["policy"]]
        requests = poisson_trace(self.n_requests, float(v["rate"]), **self.TRACE, seed=self.seed)
        clock = SimClock(StepCost.for_model("llama3-8b", "H100 80GB", overhead_s=1e-3)) \
            if v["clock"] == "simulated" else WallClock()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            cache = PagedKVCache(self.config, n_blocks=256, block_size=16)
            self.result = Scheduler(Engine(self.model, cache), policy=policy, max_batch=8, token_budget=budget,
                                    clock=clock).run(requests)
        finally:
            torch.set_num_threads(threads)
        self.out.value = "<pre>" + self.text + "</pre>"
        if self._draw:
            self.image.value = figure_png(plot_schedule(self.result, max_requests=self.n_requests))

    @property
    def text(self) -> str:
        s, v = self.result.summary(), self.values()
        where = "measured on this machine" if v["clock"] == "wall-clock" else \
            "simulated: Llama-3-8B-on-H100 roofline cost per step"
        return (f"{v['policy']} batching, {v['rate']} arrivals/s, {self.n_requests} requests ({where})\n"
                f"TTFT p50 {s['ttft_p50'] * 1e3:.1f} ms  p99 {s['ttft_p99'] * 1e3:.1f} ms | "
                f"ITL p50 {s['itl_p50'] * 1e3:.2f} ms  p99 {s['itl_p99'] * 1e3:.2f} ms | "
                f"{s['throughput_tok_s']:.0f} tokens/s")
