"""Failures at scale as pictures: goodput against the checkpoint interval, and per-rank step times.

* :func:`plot_goodput` draws Daly's expected goodput (``checkpoint_interval.goodput``) against the interval for one
  cluster, with Young's and Daly's intervals marked, and, beside it, the best goodput against the cluster size at
  a fixed failure rate per GPU-hour, with a published run (Llama 3's 16,384 GPUs) placed on it.
* :class:`GoodputWidget` wires cluster size, failure rate, checkpoint cost and restart time to it.
* :func:`plot_step_times` draws compute and all-reduce wait per rank and step (the emulated device's timings).
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
import torch
from matplotlib.figure import Figure

from course_lib.failures.checkpoint_interval import (
    LLAMA3_405B,
    PublishedRun,
    best_interval,
    cluster_mtbf,
    daly_interval,
    goodput,
    young_interval,
)
from course_lib.failures.stragglers import StepTimes
from course_lib.viz.panel import ControlPanel, figure_png

__all__ = ["GoodputWidget", "plot_goodput", "plot_step_times"]


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def plot_goodput(gpus: int, rate_per_gpu_hour: float, cost_s: float, restart_s: float,
                 published: PublishedRun = LLAMA3_405B) -> Figure:
    """Left: goodput vs interval at ``gpus`` GPUs. Right: best goodput vs cluster size, ``published`` marked."""
    mtbf = cluster_mtbf(gpus, rate_per_gpu_hour)
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    taus = torch.logspace(1, 6, 300, dtype=torch.float64).tolist()
    left.plot(taus, [goodput(t, cost_s, mtbf, restart_s) for t in taus], color="tab:blue")
    for name, tau, style in (("Young", young_interval(cost_s, mtbf), "--"),
                             ("Daly", daly_interval(cost_s, mtbf), ":")):
        left.axvline(tau, color="black", linestyle=style, label=f"{name}: {_hours(tau)}")
    left.set(xscale="log", xlabel="checkpoint interval (s of work)", ylabel="expected goodput", ylim=(0, 1),
             title=f"{gpus:,} GPUs: job MTBF {_hours(mtbf)}")
    left.legend(loc="lower center")
    sizes = torch.logspace(1, 6, 60).round().tolist()
    best = []
    for n in sizes:
        m = cluster_mtbf(int(n), rate_per_gpu_hour)
        best.append(goodput(daly_interval(cost_s, m), cost_s, m, restart_s))
    right.plot(sizes, best, color="tab:blue", label=f"{rate_per_gpu_hour:.2g} failures / GPU-hour")
    right.axvline(gpus, color="tab:gray", linestyle="--", label=f"this cluster ({gpus:,})")
    m = cluster_mtbf(published.gpus, published.rate_per_gpu_hour)
    right.scatter([published.gpus], [goodput(daly_interval(cost_s, m), cost_s, m, restart_s)], color="tab:red",
                  zorder=3, label=f"Llama 3: {published.unexpected} failures / {published.days:g} days")
    right.set(xscale="log", xlabel="GPUs in the job", ylabel="goodput at Daly's interval", ylim=(0, 1),
              title="modelled: exponential failures (Daly 2006)")
    right.legend(loc="lower left", fontsize=8)
    return fig


class GoodputWidget(ControlPanel):
    """Controls (GPUs, failures per GPU-hour, checkpoint cost, restart time), the intervals and the figure.

    From code: ``w.set(gpus=1024, cost_s=30)`` returns ``w.text``; ``w.best`` is (Daly's interval, its goodput).
    """

    def __init__(self, gpus: int = 16_384, rate_per_gpu_hour: float = LLAMA3_405B.rate_per_gpu_hour,
                 cost_s: float = 60.0, restart_s: float = 600.0, draw: bool = True) -> None:
        super().__init__()
        self._draw = draw
        style = {"description_width": "initial"}
        self.controls: dict[str, Any] = {
            "gpus": W.Dropdown(options=[2 ** k for k in range(3, 18)], value=gpus, description="GPUs",
                               style=style),
            "rate_per_gpu_hour": W.FloatLogSlider(value=rate_per_gpu_hour, base=10, min=-6, max=-3, step=0.1,
                                                  description="failures per GPU-hour", style=style,
                                                  readout_format=".2g"),
            "cost_s": W.FloatLogSlider(value=cost_s, base=10, min=0, max=3, step=0.1,
                                       description="checkpoint cost (s)", style=style, readout_format=".3g"),
            "restart_s": W.FloatSlider(value=restart_s, min=0, max=3600, step=60, description="restart (s)",
                                       style=style),
        }
        c = self.controls
        self.result = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(max_width="900px"))
        self.children = [W.HBox([c["gpus"], c["rate_per_gpu_hour"]], layout=W.Layout(flex_flow="row wrap")),
                         W.HBox([c["cost_s"], c["restart_s"]], layout=W.Layout(flex_flow="row wrap")),
                         self.result, self.image]
        self.add_class("course-goodput")
        self.best = (0.0, 0.0)
        self._watch()
        self.update()

    def _numbers(self) -> tuple[float, float, float, float, float]:
        v = self.values()
        mtbf = cluster_mtbf(int(v["gpus"]), float(v["rate_per_gpu_hour"]))
        cost, restart = float(v["cost_s"]), float(v["restart_s"])
        return mtbf, cost, restart, young_interval(cost, mtbf), daly_interval(cost, mtbf)

    def update(self) -> None:
        mtbf, cost, restart, _, daly = self._numbers()
        self.best = (daly, goodput(daly, cost, mtbf, restart))
        self.result.value = "<br>".join(self.text.split("\n"))
        if self._draw:
            v = self.values()
            self.image.value = figure_png(plot_goodput(int(v["gpus"]), float(v["rate_per_gpu_hour"]), cost, restart))

    @property
    def text(self) -> str:
        mtbf, cost, restart, young, daly = self._numbers()
        best = best_interval(cost, mtbf, restart)
        return (f"job MTBF {_hours(mtbf)} ({self.values()['gpus']:,} GPUs)\n"
                f"Young sqrt(2CM) = {_hours(young)}, Daly = {_hours(daly)}, best by search = {_hours(best)}\n"
                f"expected goodput at Daly's interval: {goodput(daly, cost, mtbf, restart):.1%} "
                f"(checkpointing every hour instead: {goodput(3600, cost, mtbf, restart):.1%})")


def plot_step_times(times: StepTimes, title: str) -> Figure:
    """Per rank and step: compute (solid) and time waiting in the all-reduce (hatched), side by side."""
    compute, wait = times.compute, times.wait
    steps, world = len(compute), len(compute[0])
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / world
    for r in range(world):
        xs = [s + (r - (world - 1) / 2) * width for s in range(steps)]
        ax.bar(xs, [compute[s][r] * 1e3 for s in range(steps)], width, color=f"C{r}", label=f"rank {r} compute")
        ax.bar(xs, [wait[s][r] * 1e3 for s in range(steps)], width, bottom=[compute[s][r] * 1e3 for s in range(steps)],
               color=f"C{r}", alpha=0.35, hatch="//", label=f"rank {r} waits in all-reduce")
    ax.set(xlabel="step", ylabel="ms", xticks=range(steps), title=title)
    ax.legend(fontsize=8, ncols=2, loc="upper right")
    return fig
