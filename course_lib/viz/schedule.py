"""Pipeline schedules as pictures: a Gantt chart of every rank, and a widget that explores the bubble.

Two layers, as every module of ``course_lib.viz``:

* :func:`plot_gantt` is pure: a timeline (``schedule_run.simulate(...)`` or ``parallel.pp.measured_timeline(...)``:
  per rank, ``(start, end, action)`` of each compute action) in, a matplotlib ``Figure`` out. One row per rank,
  rank 0 on top; one box per compute action, coloured by kind (F forward, B backward, I backward for the input,
  W backward for the weights) and labelled with its micro-batch; the idle gaps drawn as hatched grey boxes; each
  row's idle share on the right. ``mode`` is required and goes into the title ("simulated, unit costs",
  "measured, emulated device", ...): a timeline without the mode that produced it is no evidence.
  ``ax.containers`` holds one bar container per kind drawn (label "F", "B", "I", "W") and one labelled "idle", so
  the boxes can be counted. :func:`plot_gantts` stacks several timelines (simulated above measured) on one time
  axis.
* :func:`bubble_widget` wires ipywidgets controls (schedule, p, m, v, the cost of the last stage) to
  ``course_lib.parallel.schedules`` and ``course_lib.estimates.cost``: it draws the Gantt chart of every rank, and
  prints the closed formula's bubble fraction next to the simulated one and the peak number of micro-batches in
  flight per rank.
  Interleaved 1F1B takes m in torch's rounds (``schedules.interleaved_groups``: p = 4, m = 6 is one group of 6);
  the m it refuses (p = 4, m = 9) show a message instead of a chart.
  :meth:`BubbleWidget.set` changes controls from code and returns the text the widget shows; every control has a
  stable ``description`` (``CONTROL_DESCRIPTIONS``) and the widget the CSS class ``course-bubble``, for browser
  tests.

Costs in the widget (the formulas' assumptions): a whole stage costs F = 1, B = 2 (so I = W = 1 for ZB-H1, the
equal-cost case of the zero-bubble paper); with v model chunks per rank each chunk holds 1/v of the rank's layers
and costs 1/v of that, so the makespans of different v compare. "last stage cost" multiplies the costs of the last
(virtual) stage -- the one with the final norm, the LM head and the loss, which is the heavy one in practice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ipywidgets as W
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from course_lib.estimates import cost
from course_lib.parallel import schedules as S
from course_lib.parallel.schedule_run import Simulation, simulate
from course_lib.parallel.schedules import Kind, Schedule, Timeline
from course_lib.viz.panel import ControlPanel, figure_png

__all__ = [
    "CONTROL_DESCRIPTIONS",
    "FORMULAS",
    "IDLE_COLOR",
    "KIND_COLORS",
    "SCHEDULE_OPTIONS",
    "BubbleWidget",
    "bubble_widget",
    "build_schedule",
    "idle_intervals",
    "plot_gantt",
    "plot_gantts",
    "uniform_stage_costs",
]

KIND_COLORS: dict[Kind, str] = {Kind.F: "#6baed6", Kind.B: "#08519c", Kind.I: "#fd8d3c", Kind.W: "#31a354"}
KIND_NAMES: dict[Kind, str] = {Kind.F: "F forward", Kind.B: "B backward", Kind.I: "I backward (input grad)",
                               Kind.W: "W backward (weight grad)"}
IDLE_COLOR = "#e6e6e6"

SCHEDULE_OPTIONS: dict[str, str] = {"GPipe (AFAB)": "gpipe", "1F1B": "1f1b", "interleaved 1F1B": "interleaved",
                                    "ZB-H1 (zero bubble)": "zb_h1"}
"""Dropdown label -> schedule name (the names of ``parallel.pp.SCHEDULES``)."""
_LABEL = {v: k for k, v in SCHEDULE_OPTIONS.items()}

FORMULAS: dict[str, tuple[str, str]] = {  # schedule -> (bubble fraction, bubble / ideal), as cost.py computes them
    "gpipe": ("(p-1)/(m+p-1)", "(p-1)/m"),
    "1f1b": ("(p-1)/(m+p-1)", "(p-1)/m"),
    "interleaved": ("(p-1)/(v*m+p-1)", "(p-1)/(v*m)"),
    "zb_h1": ("(p-1)/(3m+p-1)", "(p-1)/(3m)"),
}


# ----------------------------------------------------------------------------------------------------------------
# Schedules and costs


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The compute-only schedule ``name`` ("gpipe", "1f1b", "interleaved", "zb_h1") for p ranks, m micro-batches
    and (interleaved only) v chunks per rank. Raises ``ValueError`` with the builder's explanation."""
    if name not in _LABEL:
        raise ValueError(f"unknown schedule {name!r}: choose one of {list(_LABEL)}")
    if name == "interleaved":
        return S.interleaved_one_f_one_b(p, m, v)
    if v != 1:
        raise ValueError(f"{_LABEL[name]} has one stage per rank: v must be 1, got {v} (v > 1 is interleaved 1F1B)")
    return getattr(S, S.canonical_schedule(name))(p, m)


def uniform_stage_costs(n_stages: int, v: int = 1, last: float = 1.0, cost_f: float = 1.0,
                        cost_b: float = 2.0) -> list[tuple[float, float, float]]:
    """Per (virtual) stage ``(cost_f, cost_b, cost_w)`` for ``schedule_run.simulate``: a whole stage costs
    ``cost_f`` and ``cost_b`` (W = B / 2), a chunk 1/v of that; the last stage ``last`` times as much."""
    f, b = cost_f / v, cost_b / v
    costs = [(f, b, b / 2)] * n_stages
    costs[-1] = (f * last, b * last, b * last / 2)
    return costs


def idle_intervals(timeline: Timeline, makespan: float | None = None) -> list[list[tuple[float, float]]]:
    """Per rank, the gaps between 0, its compute actions and ``makespan`` (default: the last end of any rank)."""
    if makespan is None:
        makespan = max((end for rank in timeline for _, end, _ in rank), default=0.0)
    gaps = []
    for rank in timeline:
        t, mine = 0.0, []
        for start, end, _ in sorted(rank, key=lambda item: item[0]):
            if start > t:
                mine.append((t, start))
            t = max(t, end)
        if makespan > t:
            mine.append((t, makespan))
        gaps.append(mine)
    return gaps


# ----------------------------------------------------------------------------------------------------------------
# The figure


def _timeline_of(data: Timeline | Simulation) -> Timeline:
    return data.timeline if isinstance(data, Simulation) else [list(rank) for rank in data]


def _shade(color: str, chunk: int, v: int) -> tuple[float, float, float]:
    """Chunk c of v: the kind's colour, lightened towards white for later chunks (interleaved schedules)."""
    if v <= 1:
        return to_rgb(color)
    mix = 0.55 * chunk / (v - 1)
    return tuple(c + (1 - c) * mix for c in to_rgb(color))  # type: ignore[return-value]


def plot_gantt(data: Timeline | Simulation, *, mode: str, title: str | None = None, ax: Axes | None = None,
               scale: float = 1.0, unit: str = "time units", labels: bool | None = None,
               xmax: float | None = None, figsize: tuple[float, float] | None = None, legend: bool | None = None
               ) -> Figure:
    """Gantt chart of one pipeline step: one row per rank, one box per compute action, idle gaps hatched.

    ``data``: a ``Simulation`` or a timeline (per rank, ``(start, end, Action)``; the measured one of
    ``parallel.pp.measured_timeline`` is in seconds). ``mode`` (required): how the times were produced, shown in
    the title. ``scale`` multiplies the times (1e3 for seconds -> ms) and ``unit`` names the result. ``labels``:
    the micro-batch inside each box (default: when the boxes are wide enough). With interleaved stages
    (stage >= p) later chunks are lighter. ``ax``: draw into an existing axes (its figure is returned; no legend
    unless ``legend=True``). ``xmax``: the end of the time axis, in the timeline's own unit.
    """
    if not mode:
        raise ValueError("say how the times were produced (mode=...): a timeline without its mode is no evidence")
    timeline = _timeline_of(data)
    p = len(timeline)
    if p == 0 or not any(timeline):
        raise ValueError("nothing to plot: the timeline has no action")
    n_stages = 1 + max(a.stage for rank in timeline for _, _, a in rank)
    v = -(-n_stages // p)
    makespan = max(end for rank in timeline for _, end, _ in rank)
    if ax is None:
        fig = Figure(figsize=figsize or (9.0, 0.45 * p + 1.6), layout="constrained")
        ax = fig.add_subplot()
        legend = True if legend is None else legend
    else:
        fig = ax.figure  # type: ignore[assignment]
    span = (xmax or makespan) * scale
    n_actions = sum(len(rank) for rank in timeline)
    if labels is None:
        labels = n_actions / p <= 48
    gaps = idle_intervals(timeline, makespan)
    kinds = [k for k in KIND_COLORS if any(a.kind is k for rank in timeline for _, _, a in rank)]
    for kind in kinds:
        ys, widths, lefts, colors, texts = [], [], [], [], []
        for r, rank in enumerate(timeline):
            for start, end, a in rank:
                if a.kind is kind:
                    ys.append(r)
                    lefts.append(start * scale)
                    widths.append((end - start) * scale)
                    colors.append(_shade(KIND_COLORS[kind], a.stage // p, v))
                    texts.append(str(a.microbatch))
        bars = ax.barh(ys, widths, left=lefts, height=0.78, color=colors, edgecolor="white", linewidth=0.6,
                       label=kind.value)
        if labels:
            for bar, text, width in zip(bars, texts, widths, strict=True):
                if width >= span / 90:
                    ax.text(bar.get_x() + width / 2, bar.get_y() + bar.get_height() / 2, text, ha="center",
                            va="center", fontsize=7, color="white" if kind in (Kind.B, Kind.W) else "black")
    idle = [(r, a, b) for r, mine in enumerate(gaps) for a, b in mine]
    ax.barh([r for r, _, _ in idle], [(b - a) * scale for _, a, b in idle], left=[a * scale for _, a, _ in idle],
            height=0.78, color=IDLE_COLOR, edgecolor="#b0b0b0", hatch="///", linewidth=0.0, label="idle")
    for r, rank in enumerate(timeline):
        busy = sum(end - start for start, end, _ in rank)
        share = 1 - busy / makespan if makespan else 0.0
        ax.annotate(f"idle {share:.0%}", xy=(1.0, r), xycoords=("axes fraction", "data"), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=8)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, span * 1.005)
    ax.set_xlabel(unit, fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(True, axis="x", lw=0.3, alpha=0.5)
    ax.set_title(f"{title}\n{mode}" if title else mode, fontsize=8.5, loc="left")
    if legend:
        fig.legend(handles=_legend_handles(kinds, v), loc="outside lower center", ncol=5, fontsize=7, frameon=False)
    return fig


def _legend_handles(kinds: Sequence[Kind], v: int) -> list[Patch]:
    handles = [Patch(color=KIND_COLORS[k], label=KIND_NAMES[k]) for k in kinds]
    handles.append(Patch(facecolor=IDLE_COLOR, edgecolor="#b0b0b0", hatch="///", label="idle (bubble)"))
    if v > 1:
        handles.append(Patch(facecolor=_shade(KIND_COLORS[Kind.F], v - 1, v), label=f"lighter: later chunk (v={v})"))
    return handles


def plot_gantts(panels: Mapping[str, Timeline | Simulation], *, title: str | None = None, scale: float = 1.0,
                unit: str = "time units", width: float = 9.0, sharex: bool = True) -> Figure:
    """Several Gantt charts stacked on one time axis: ``panels`` is {mode: timeline or Simulation}, e.g.
    {"simulated, emulated costs": sim, "measured, emulated device": measured}; each key is its panel's mode."""
    if not panels:
        raise ValueError("nothing to plot: no panels")
    timelines = {k: _timeline_of(d) for k, d in panels.items()}
    rows = [len(t) for t in timelines.values()]
    fig = Figure(figsize=(width, sum(0.45 * n + 1.0 for n in rows) + 0.5 + (0.3 if title else 0)),
                 layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=[n + 1.6 for n in rows])[:, 0]
    xmax = max(end for t in timelines.values() for rank in t for _, end, _ in rank) if sharex else None
    for ax, (mode, tl) in zip(axes, timelines.items(), strict=True):
        plot_gantt(tl, mode=mode, ax=ax, scale=scale, unit=unit, xmax=xmax)
    kinds = [k for k in KIND_COLORS if any(a.kind is k for t in timelines.values() for rank in t for _, _, a in rank)]
    v = max(-(-(1 + max(a.stage for rank in t for _, _, a in rank)) // len(t)) for t in timelines.values())
    fig.legend(handles=_legend_handles(kinds, v), loc="outside lower center", ncol=5, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


# ----------------------------------------------------------------------------------------------------------------
# The widget

CONTROL_DESCRIPTIONS: dict[str, str] = {"schedule": "schedule", "p": "stages p", "m": "micro-batches m",
                                        "v": "chunks per rank v", "imbalance": "last stage cost x"}
"""Control name (for :meth:`BubbleWidget.set`) -> the ``description`` shown next to it (stable)."""

P_MAX, M_MAX, V_MAX = 8, 32, 4


class BubbleWidget(ControlPanel):
    """Schedule, p, m, v and the last stage's cost in; the Gantt chart of every rank and the numbers out.

    From code: ``w.set(p=4, m=16)`` sets controls (one redraw) and returns :attr:`text`. After each update:
    ``w.simulation`` (a ``schedule_run.Simulation``, None when the settings are invalid), ``w.schedule`` (the
    compute actions per rank), ``w.formula_fraction`` / ``w.formula_ratio`` (``cost.bubble_fraction`` /
    ``bubble_ratio``, None when the formula does not apply), ``w.simulated_fraction``, ``w.peaks`` (peak
    micro-batches in flight per rank, ``schedule_run.peak_in_flight``), ``w.error`` (the message, or None).
    ``w.controls`` {name: control} with the names of ``CONTROL_DESCRIPTIONS``. v applies to interleaved 1F1B
    only: its slider is disabled (and v taken as 1) for the other schedules.
    """

    def __init__(self, schedule: str = "1f1b", p: int = 4, m: int = 8, v: int = 2, imbalance: float = 1.0,
                 draw: bool = True) -> None:
        super().__init__()
        self._draw = draw
        self.simulation: Simulation | None = None
        self.schedule: Schedule | None = None
        self.formula_fraction: float | None = None
        self.formula_ratio: float | None = None
        self.simulated_fraction: float | None = None
        self.peaks: list[int] | None = None
        self.error: str | None = None
        self.figure: Figure | None = None
        self.text_lines: list[str] = []
        d, style = CONTROL_DESCRIPTIONS, {"description_width": "initial"}
        self.controls: dict[str, Any] = {
            "schedule": W.Dropdown(options=list(SCHEDULE_OPTIONS.items()), value=schedule,
                                   description=d["schedule"], style=style, layout=W.Layout(width="260px")),
            "p": W.IntSlider(value=p, min=1, max=P_MAX, description=d["p"], style=style,
                             continuous_update=False, layout=W.Layout(width="260px")),
            "m": W.IntSlider(value=m, min=1, max=M_MAX, description=d["m"], style=style,
                             continuous_update=False, layout=W.Layout(width="340px")),
            "v": W.IntSlider(value=v, min=1, max=V_MAX, description=d["v"], style=style,
                             continuous_update=False, layout=W.Layout(width="260px")),
            "imbalance": W.FloatSlider(value=imbalance, min=0.5, max=3.0, step=0.1, readout_format=".1f",
                                       description=d["imbalance"], style=style, continuous_update=False,
                                       layout=W.Layout(width="300px")),
        }
        ctl = self.controls
        self.html = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(max_width="900px"))
        self.children = [
            W.HBox([ctl["schedule"], ctl["p"], ctl["m"]], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([ctl["v"], ctl["imbalance"]], layout=W.Layout(flex_flow="row wrap")),
            self.html, self.image,
        ]
        self.add_class("course-bubble")
        self._watch()
        self.update()

    # ---- reading and writing from code

    @property
    def text(self) -> str:
        """What the widget prints (the chart aside), as plain text."""
        return "\n".join(self.text_lines)

    # ---- the computation

    def update(self) -> None:
        """Rebuild the schedule from the controls, simulate it, redraw the chart and the text."""
        val = self.values()
        name, p, m, last = val["schedule"], int(val["p"]), int(val["m"]), float(val["imbalance"])
        interleaved = name == "interleaved"
        self.controls["v"].disabled = not interleaved
        v = int(val["v"]) if interleaved else 1
        head = f"{_LABEL[name]}: p = {p} ranks, m = {m} micro-batches, v = {v} ({p * v} stages)"
        if not interleaved and val["v"] != 1:
            head += " (the v slider applies to interleaved 1F1B only)"
        self.simulation = self.schedule = self.formula_fraction = self.formula_ratio = None
        self.simulated_fraction = self.peaks = self.error = None
        try:
            schedule = build_schedule(name, p, m, v)
        except ValueError as err:
            hint = ""
            if interleaved:
                near = [n for n in (m - 1, m + 1) if 1 <= n <= M_MAX and _torch_takes(p, n)]
                hint = f" Try m = {' or '.join(map(str, near))}." if near else ""
            self.error = f"invalid combination: {err}.{hint}"
            self.text_lines = [head, self.error]
            self.html.value = (f"<b>{_esc(head)}</b><br><b style='color:darkorange'>{_esc(self.error)}</b>")
            self.image.value = b""
            self.figure = None
            return
        costs = uniform_stage_costs(p * v, v, last)
        sim = simulate(schedule, per_stage_costs=costs)
        self.schedule, self.simulation = schedule, sim
        self.simulated_fraction, self.peaks = sim.bubble_fraction, sim.peak_in_flight
        frac_f, ratio_f = FORMULAS[name]
        try:
            self.formula_fraction = cost.bubble_fraction(S.canonical_schedule(name), p, m, v)  # type: ignore[arg-type]
            self.formula_ratio = cost.bubble_ratio(S.canonical_schedule(name), p, m, v)  # type: ignore[arg-type]
            formula = f"formula {frac_f} = {self.formula_fraction:.4f}"
            formula_r = f"formula {ratio_f} = {self.formula_ratio:.4f}"
        except ValueError as err:
            formula = formula_r = f"formula n/a ({err})"
        uniform = last == 1.0
        costs_line = ("costs: a stage's F = 1, B = 2" + (" (I = W = 1)" if name == "zb_h1" else "")
                      + (f", a chunk 1/{v} of that" if v > 1 else "") + "; "
                      + ("every stage equal" if uniform else
                         f"the last stage (LM head + loss) x{last:g}: the formulas assume equal stages"))
        busy = sum(sim.busy) / p
        lines = [
            head, costs_line,
            f"bubble fraction (idle / rank-time): {formula}; simulated {sim.bubble_fraction:.4f}",
            f"bubble / ideal (Megatron-LM):       {formula_r}; simulated {sim.bubble_ratio:.4f}",
            f"makespan {sim.makespan:.4g} units; mean busy time per rank {busy:.4g}",
        ]
        if interleaved:
            lines.append(f"micro-batch groups through each chunk: {' + '.join(map(str, S.interleaved_groups(p, m)))} "
                         "(torch's ScheduleInterleaved1F1B; Megatron-LM long required groups of p, m a multiple "
                         "of p)")
        if v > 1:
            full = " ".join(f"{k / v:g}" for k in sim.peak_in_flight)
            lines.append(f"peak (micro-batch, chunk) pairs in flight per rank: "
                         f"{' '.join(map(str, sim.peak_in_flight))} = {full} micro-batches of a whole stage")
        else:
            lines.append(f"peak micro-batches in flight per rank: {' '.join(map(str, sim.peak_in_flight))} "
                         f"(activations held at once; AFAB holds m = {m}, 1F1B at most p = {p})")
        rule = 4 * p
        at_rule = cost.bubble_fraction(S.canonical_schedule(name), p, rule, v)  # type: ignore[arg-type]
        lines.append(f"the rule of thumb m >= 4p: m = {m} {'>=' if m >= rule else '<'} 4p = {rule}; at m = 4p the "
                     f"formula gives a bubble fraction of {at_rule:.4f}")
        self.text_lines = lines
        self.html.value = "<pre style='font-size:11px; line-height:1.3'>" + _esc("\n".join(lines)) + "</pre>"
        if self._draw:
            mode = "simulated, unit costs" + ("" if uniform else f", last stage x{last:g}")
            self.figure = plot_gantt(sim, mode=mode, title=f"{_LABEL[name]}, p={p}, m={m}, v={v}",
                                     unit="time (a stage's forward = 1)")
            self.image.value = figure_png(self.figure)

    def __repr__(self) -> str:
        return f"BubbleWidget({self.text_lines[0] if self.text_lines else ''!r})"


def _torch_takes(p: int, m: int) -> bool:
    """Whether interleaved 1F1B runs m micro-batches on p ranks in torch's rounds."""
    try:
        S.interleaved_groups(p, m)
    except ValueError:
        return False
    return True


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def bubble_widget(schedule: str = "1f1b", p: int = 4, m: int = 8, v: int = 2, imbalance: float = 1.0,
                  draw: bool = True) -> BubbleWidget:
    """A pipeline-bubble explorer (a :class:`BubbleWidget`) to display: pick the schedule ("gpipe", "1f1b",
    "interleaved", "zb_h1"), p, m, v and how much the last stage costs; see the Gantt chart of every rank, the
    formula's bubble next to the simulated one, and the micro-batches each rank holds. ``draw=False`` skips the
    chart (for tests that read the text). The chart is drawn off-screen into an ``Image`` widget."""
    return BubbleWidget(schedule=schedule, p=p, m=m, v=v, imbalance=imbalance, draw=draw)

