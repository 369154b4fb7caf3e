"""Debugging a distributed run as pictures: the ranks' collective timelines side by side, and a run's drift.

* :func:`plot_timelines` draws each rank's last calls (flight-recorder entries) as a row of boxes, in call order,
  the newest at the right, so that the ranks' sequences line up; a call that never returned is hatched, the
  first desync's wrong call outlined in red and its peers' calls at that position in dashed red.
* :class:`TimelineWidget` (``timeline_widget``) filters them by group and widens or narrows the window.
* :func:`plot_drift` draws a run's losses beside one process's, and each step's difference against the tolerance
  measured from another reduction order (``course_lib.debug.drift``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ipywidgets as W
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from course_lib.debug.desync import Desync
from course_lib.debug.drift import Drift
from course_lib.debug.recorder import Entry, Trace
from course_lib.train import TrainResult
from course_lib.viz.panel import ControlPanel, show_figures

__all__ = ["CONTROL_DESCRIPTIONS", "TimelineWidget", "plot_drift", "plot_timelines", "timeline_widget"]

COLORS = {"all_reduce": "tab:blue", "all_gather": "tab:orange", "reduce_scatter": "tab:green",
          "broadcast": "tab:purple", "all_to_all": "tab:brown", "send": "tab:gray", "recv": "silver",
          "barrier": "black"}
SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC", "all_to_all": "A2A",
         "send": "send", "recv": "recv", "barrier": "bar"}
EVERY_GROUP = "every group"
CONTROL_DESCRIPTIONS = {"group": "group", "window": "last calls"}


def _rows(traces: Sequence[Trace], group: str | None, window: int) -> dict[int, list[Entry]]:
    return {t.rank: [e for e in t.entries if group in (None, e.group)][-window:] for t in traces}


def plot_timelines(traces: Sequence[Trace] | Mapping[int, Trace], desync: Desync | None = None, window: int = 16,
                   group: str | None = None) -> Figure:
    """Each rank's last ``window`` calls (of ``group`` only, when given), in call order, newest at the right."""
    traces = list(traces.values()) if isinstance(traces, Mapping) else list(traces)
    rows = _rows(traces, group, window)
    marked = {(r, e.seq): r in desync.culprits for r, e in (desync.calls.items() if desync else []) if e is not None}
    fig = Figure(figsize=(10, 0.9 + 0.75 * len(rows)), layout="constrained")
    ax = fig.subplots()
    for y, (rank, entries) in enumerate(sorted(rows.items())):
        for i, e in enumerate(entries):
            x = window - len(entries) + i
            culprit = marked.get((rank, e.seq))  # True: the wrong call, False: its peers' at that position
            ax.add_patch(Rectangle((x + 0.05, -y - 0.35), 0.9, 0.7, facecolor=COLORS.get(e.op, "white"),
                                   alpha=0.85, hatch="///" if e.end is None else None,
                                   edgecolor="black" if culprit is None else "red",
                                   linestyle="-" if culprit in (None, True) else "--",
                                   linewidth=0.5 if culprit is None else 2.5))
            ax.text(x + 0.5, -y, f"{SHORT.get(e.op, e.op)}\n{e.group}#{e.group_seq}", ha="center", va="center",
                    fontsize=6.5, color="white" if e.op in ("broadcast", "barrier", "all_to_all") else "black")
    ax.set(xlim=(0, window), ylim=(-len(rows) + 0.4, 0.6), yticks=[-y for y in range(len(rows))],
           yticklabels=[f"rank {r}" for r in sorted(rows)], xticks=[],
           xlabel=f"each rank's last {window} calls{'' if group is None else f' on {group}'}, oldest left "
                  "(hatched: never returned)")
    title = "collective timelines, in call order"
    if desync is not None:
        title += (f": first desync at {desync.group} #{desync.position} ({desync.kind}), "
                  f"wrong: rank(s) {list(desync.culprits)} (red; its peers' calls dashed)")
    ax.set_title(title, fontsize=10)
    ops = sorted({e.op for es in rows.values() for e in es})
    ax.legend(handles=[Patch(facecolor=COLORS.get(op, "white"), label=op) for op in ops], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return fig


class TimelineWidget(ControlPanel):
    """The timelines of a run's traces, filtered by group, over a chosen window of calls."""

    def __init__(self, traces: Sequence[Trace] | Mapping[int, Trace], desync: Desync | None = None,
                 window: int = 16) -> None:
        super().__init__()
        self.traces = list(traces.values()) if isinstance(traces, Mapping) else list(traces)
        self.desync = desync
        groups = sorted({e.group for t in self.traces for e in t.entries})
        self.controls = {
            "group": W.Dropdown(options=[EVERY_GROUP, *groups], value=EVERY_GROUP,
                                description=CONTROL_DESCRIPTIONS["group"]),
            "window": W.IntSlider(value=window, min=4, max=40, step=2, description=CONTROL_DESCRIPTIONS["window"]),
        }
        self.html = W.HTML()
        self.image = W.Image(format="png")
        self.children = [W.HBox(list(self.controls.values())), self.html, self.image]
        self.add_class("course-timelines")
        self._watch()
        self.update()

    def update(self) -> None:
        v = self.values()
        group = None if v["group"] == EVERY_GROUP else v["group"]
        self.html.value = f"<pre>{self.text}</pre>"
        show_figures((self.image, plot_timelines(self.traces, self.desync, v["window"], group)))

    @property
    def text(self) -> str:
        v = self.values()
        group = None if v["group"] == EVERY_GROUP else v["group"]
        rows = _rows(self.traces, group, v["window"])
        stuck = [f"rank {r}: {es[-1].describe()}" for r, es in sorted(rows.items()) if es and es[-1].end is None]
        lines = [f"{len(rows)} ranks, {v['window']} calls each ({v['group']})", *stuck]
        if self.desync is not None:
            lines.append(self.desync.describe().splitlines()[0])
        return "\n".join(lines)


def timeline_widget(traces: Sequence[Trace] | Mapping[int, Trace], desync: Desync | None = None,
                    window: int = 16) -> TimelineWidget:
    return TimelineWidget(traces, desync, window)


def plot_drift(reference: TrainResult, candidate: TrainResult, drift: Drift, title: str, start: int = 0) -> Figure:
    """Left: the losses of one process and of the run. Right: their difference at each step against the
    tolerance from another reduction order (log scale; a difference of 0 is drawn at the axis' bottom)."""
    steps = list(range(start, start + len(drift.diffs)))
    fig = Figure(figsize=(10, 3.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(steps, reference.losses, "o-", color="black", alpha=0.5, lw=3, label="one process")
    left.plot(steps, candidate.losses, "x--", color="tab:red", label="the run")
    left.set(xlabel="step", ylabel="loss", xticks=steps, title=title)
    left.legend()
    floor = min(a for a in drift.allowed) / 100
    right.semilogy(steps, [max(d, floor) for d in drift.diffs], "x-", color="tab:red", label="|run - one process|")
    right.semilogy(steps, drift.allowed, "-", color="tab:green", label="tolerance (8 x the measured noise)")
    right.semilogy(steps, [max(n, floor) for n in drift.noise], ":", color="tab:green",
                   label="noise: other orders, float64")
    right.set(xlabel="step", ylabel="loss difference", xticks=steps, title=f"drift test: {drift.verdict}")
    right.legend(fontsize=8)
    return fig
