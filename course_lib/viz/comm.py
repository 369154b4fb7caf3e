"""Collectives as pictures: the ring step by step, bytes per rank, and the alpha-beta cost on real links.

Two layers, as every module of ``course_lib.viz``:

* Pure figures (data in, ``matplotlib.figure.Figure`` out, no pyplot state):

  - :func:`plot_ring_steps`: which chunk every rank holds and sends at each step of a ring reduce-scatter,
    all-gather or all-reduce, drawn from :func:`ring_schedule` (itself built on
    ``collectives.ring_reduce_scatter_chunks`` / ``ring_all_gather_chunks``, the functions the ring code runs);
  - :func:`plot_bytes_per_rank`: bytes each rank sent (from the comm log) beside the formulas;
  - :func:`plot_collective_cost`: the alpha-beta time of a collective against the tensor size, one curve per
    link, with measured points on top.

* :func:`collective_cost_widget`: an ipywidgets container that predicts a collective's time for a chosen op,
  size, world size and link. :meth:`CollectiveCostWidget.set` changes controls from code and returns the text
  the widget shows; every control has a stable ``description`` (``CONTROL_DESCRIPTIONS``) for browser tests.

The model (``course_lib.estimates.cost``): a collective runs ``steps`` messages one after the other, each costing
``alpha + bytes_per_step / beta``. The links, their ``alpha`` (NCCL's per-step latency of a ring step) and
``beta`` (vendors' bandwidth, one direction), come from the hardware catalogue ``course_lib.estimates.hardware.LINKS``,
each with its source; NCCL adds a fixed ~8 us per call (``baseLat``) that this model leaves out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ipywidgets as W
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from course_lib.estimates.cost import collective_bytes_per_rank, collective_steps, collective_time
from course_lib.estimates.hardware import LINKS, Link
from course_lib.estimates.memory_budget import format_bytes
from course_lib.runtime.collectives import ring_all_gather_chunks, ring_reduce_scatter_chunks
from course_lib.viz.panel import ControlPanel, figure_png

__all__ = [
    "CONTROL_DESCRIPTIONS",
    "FITTED",
    "OPS",
    "CollectiveCostWidget",
    "Measurement",
    "RingSchedule",
    "Transfer",
    "bus_bandwidth_factor",
    "collective_cost_widget",
    "format_seconds",
    "plot_bytes_per_rank",
    "plot_collective_cost",
    "plot_ring_steps",
    "ring_schedule",
]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


# ----------------------------------------------------------------------------------------------------------------
# Units


def format_seconds(t: float) -> str:
    """'437 µs', '12.3 ms', '1.52 s' (three significant digits)."""
    for unit, f in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(t) >= f:
            return f"{t / f:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns"


# ----------------------------------------------------------------------------------------------------------------
# Links


FITTED = "this machine (fitted)"
"""Name of the link whose alpha and beta were fitted to this machine's measurements (gloo on CPU)."""


def bus_bandwidth_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth = algorithm bandwidth (V / t) x this factor (nccl-tests doc/PERFORMANCE.md):
    2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for broadcast. It is the
    rate each rank's link really carries, so it can be compared with the link's bandwidth whatever n is."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; choose one of {OPS}")


# ----------------------------------------------------------------------------------------------------------------
# The ring, step by step


@dataclass(frozen=True)
class Transfer:
    """One message of a ring step: group rank ``src`` sends chunk ``chunk`` to ``dst`` (= src + 1 mod n)."""

    step: int
    phase: str  # "reduce-scatter" or "all-gather"
    src: int
    dst: int
    chunk: int


@dataclass(frozen=True)
class RingSchedule:
    """The messages of each step and what every rank holds after it.

    ``states[k][r][c]``: after ``k`` steps (``states[0]`` is the start), the set of ranks whose data rank r's
    copy of chunk c contains -- a partial sum for the reduce phases (complete when it holds all n ranks), for a
    lone all-gather ``{c}`` once rank r has received chunk c (empty before). ``transfers[k]``: the n messages of
    step k+1.
    """

    op: str
    n: int
    transfers: list[list[Transfer]]
    states: list[list[list[frozenset[int]]]]

    def complete(self, s: frozenset[int], chunk: int) -> bool:
        """Does a copy of ``chunk`` holding ``s`` have its final value?"""
        return s == {chunk} if self.op == "all_gather" else len(s) == self.n


def ring_schedule(n: int, op: str = "all_reduce") -> RingSchedule:
    """Simulate a ring reduce-scatter, all-gather or all-reduce (reduce-scatter then all-gather) on ``n`` ranks.

    The chunk each rank sends at each step comes from ``collectives.ring_reduce_scatter_chunks`` and
    ``collectives.ring_all_gather_chunks``, the functions the ring code itself runs: a reduce-scatter step adds
    the received partial sum to the receiver's copy, an all-gather step overwrites it.
    """
    if op not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"the ring is drawn for all_reduce, reduce_scatter or all_gather, not {op!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"a ring needs n >= 2 ranks, got {n!r}")
    if op == "all_gather":
        state = [[frozenset({c}) if c == r else frozenset() for c in range(n)] for r in range(n)]
    else:
        state = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    phases = {"all_reduce": ["reduce-scatter", "all-gather"], "reduce_scatter": ["reduce-scatter"],
              "all_gather": ["all-gather"]}[op]
    states, transfers = [state], []
    for phase in phases:
        for k in range(n - 1):
            step = len(transfers)
            chunks = ring_reduce_scatter_chunks if phase == "reduce-scatter" else ring_all_gather_chunks
            moves = [Transfer(step, phase, r, (r + 1) % n, chunks(r, k, n)[0]) for r in range(n)]
            new = [row[:] for row in state]
            for t in moves:
                assert chunks(t.dst, k, n)[1] == t.chunk  # the receiver expects exactly this chunk
                got = state[t.src][t.chunk]
                new[t.dst][t.chunk] = state[t.dst][t.chunk] | got if phase == "reduce-scatter" else got
            state = new
            states.append(state)
            transfers.append(moves)
    return RingSchedule(op, n, transfers, states)


_PHASE_COLORS = {"reduce-scatter": "#C44E52", "all-gather": "#4C72B0"}


def plot_ring_steps(n: int = 4, op: str = "all_reduce", *, figsize: tuple[float, float] | None = None) -> Figure:
    """The ring, one row per step: each rank's n chunks, shaded by how many ranks' data they hold (the digits
    are those ranks), with an arrow for every message of the step (red: reduce-scatter, blue: all-gather).

    Artists carry stable ids for tests: the squares ``gid = "s{k}r{r}c{c}"`` (after k steps, rank r, chunk c),
    the arrows ``gid = "t{k}:{src}->{dst}:c{chunk}"`` (message of step k+1).
    """
    sched = ring_schedule(n, op)
    rows = len(sched.states)
    width, row_h = n + 1.2, 1.9
    fig = Figure(figsize=figsize or (1.1 + 0.62 * n * width / 1.6, 0.55 + 0.72 * rows), layout="constrained")
    ax = fig.add_subplot()
    cmap_full = "#2E7D32"

    def x0(r: int, c: int) -> float:
        return r * width + c

    def y0(k: int) -> float:
        return -k * row_h

    for k, state in enumerate(sched.states):
        for r in range(n):
            for c in range(n):
                s = state[r][c]
                full = sched.complete(s, c)
                if not s:
                    face = "white"
                elif full:
                    face = cmap_full
                else:
                    face = (0.55, 0.78, 0.55, 0.25 + 0.6 * len(s) / n)
                rect = Rectangle((x0(r, c), y0(k)), 0.9, 0.9, facecolor=face, edgecolor="0.35", lw=0.6)
                rect.set_gid(f"s{k}r{r}c{c}")
                ax.add_patch(rect)
                label = "".join(map(str, sorted(s))) if n <= 5 else (str(len(s)) if s else "")
                ax.text(x0(r, c) + 0.45, y0(k) + 0.45, label, ha="center", va="center",
                        fontsize=6 if n <= 4 else 5, color="white" if full else "black")
        phase = sched.transfers[k - 1][0].phase if k else None
        name = "start" if k == 0 else f"{phase} {(k - 1) % (n - 1) + 1}"
        ax.text(-0.4, y0(k) + 0.45, name, ha="right", va="center", fontsize=7,
                color=_PHASE_COLORS.get(phase or "", "black"))
    for r in range(n):
        ax.text(x0(r, 0) + n / 2 - 0.05, 1.25, f"rank {r}", ha="center", va="bottom", fontsize=8, fontweight="bold")
        for c in range(n):
            ax.text(x0(r, c) + 0.45, 0.95, f"c{c}", ha="center", va="bottom", fontsize=5, color="0.4")
    for k, moves in enumerate(sched.transfers):
        for t in moves:
            wrap = t.dst < t.src
            ann = ax.annotate("", xy=(x0(t.dst, t.chunk) + 0.45, y0(k + 1) + 0.92),
                              xytext=(x0(t.src, t.chunk) + 0.45, y0(k) - 0.02),
                              arrowprops=dict(arrowstyle="-|>", color=_PHASE_COLORS[t.phase], lw=0.8,
                                              alpha=0.55 if wrap else 0.9, shrinkA=0, shrinkB=0,
                                              linestyle="--" if wrap else "-",
                                              connectionstyle="arc3,rad=0.06" if wrap else "arc3,rad=0"))
            ann.set_gid(f"t{k}:{t.src}->{t.dst}:c{t.chunk}")
    ax.set_xlim(-3.2, n * width)
    ax.set_ylim(y0(rows - 1) - 0.3, 1.9)
    ax.set_aspect("equal")
    ax.axis("off")
    steps = len(sched.transfers)
    what = {"all_reduce": f"reduce-scatter then all-gather, 2(n-1) = {steps} steps",
            "reduce_scatter": f"n-1 = {steps} steps", "all_gather": f"n-1 = {steps} steps"}[op]
    ax.set_title(f"ring {op.replace('_', '-')} on {n} ranks: {what}; rank r sends to rank r+1 (mod {n})",
                 fontsize=9)
    handles = [Patch(facecolor=cmap_full, label="final value"),
               Patch(facecolor=(0.55, 0.78, 0.55, 0.6), label="partial sum (digits: ranks in it)"),
               Patch(facecolor=_PHASE_COLORS["reduce-scatter"], label="sent, then added"),
               Patch(facecolor=_PHASE_COLORS["all-gather"], label="sent, then copied")]
    if op == "all_gather":
        handles = [handles[0], handles[3]]
    elif op == "reduce_scatter":
        handles = handles[:3]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles), fontsize=7,
              frameon=False)
    return fig


# ----------------------------------------------------------------------------------------------------------------
# Bytes per rank


def plot_bytes_per_rank(bars: Mapping[str, Sequence[float]], formulas: Mapping[str, float] | None = None, *,
                        unit: str = "MB", title: str | None = None,
                        figsize: tuple[float, float] = (7.0, 3.4)) -> Figure:
    """Grouped bars: bytes sent by each rank (``bars``: {label: [bytes of rank 0, 1, ...]}), with a dashed
    horizontal line per formula ({label: bytes}). ``ax.containers[i]`` holds the bars of the i-th label."""
    scale = {"B": 1.0, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    n = max(len(v) for v in bars.values())
    w = 0.8 / len(bars)
    for i, (label, values) in enumerate(bars.items()):
        xs = [r - 0.4 + w * (i + 0.5) for r in range(len(values))]
        ax.bar(xs, [v / scale for v in values], width=w * 0.95, label=label)
    for j, (label, value) in enumerate((formulas or {}).items()):
        ax.axhline(value / scale, ls="--", lw=1, color=f"C{len(bars) + j}", label=label)
    ax.set_xticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylabel(f"bytes sent ({unit})")
    ax.legend(fontsize=7, loc="upper right", frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    return fig


# ----------------------------------------------------------------------------------------------------------------
# The alpha-beta figure


@dataclass(frozen=True)
class Measurement:
    """Measured times of ``op`` on ``n`` ranks: ``sizes`` (V, bytes) and ``times`` (seconds, one per size)."""

    label: str
    op: str
    n: int
    sizes: tuple[float, ...]
    times: tuple[float, ...]


def _as_link(name: str, link: Link | tuple[float, float]) -> Link:
    return link if isinstance(link, Link) else Link(name, float(link[0]), float(link[1]), "given as (alpha, beta)")


def plot_collective_cost(op: str = "all_reduce", n: int = 8, links: Mapping[str, Link | tuple[float, float]] | None
                         = None, *, measured: Sequence[Measurement] = (), size_range: tuple[float, float] = (1e3, 1e10),
                         highlight: tuple[str, float] | None = None, note: str | None = None, loglog: bool = True,
                         points: int = 121, figsize: tuple[float, float] = (7.5, 4.2)) -> Figure:
    """Predicted time of ``op`` on ``n`` ranks against the tensor size V, one line per link, measured points on top.

    ``links``: {name: Link or (alpha s, beta bytes/s)} (default: every link of ``hardware.LINKS``); each becomes one
    ``Line2D`` of ``ax.lines`` (``gid = "link:<name>"``) whose y values are ``cost.collective_time``.
    ``measured``: one scatter of ``ax.collections`` (``gid = "measured:<label>"``) per :class:`Measurement` --
    pass only those of this op and n. ``highlight``: (link name, V) marks the prediction of one point (a
    one-point line, ``gid = "highlight"``). ``note`` goes under the title (say where
    the measurements come from). ``loglog=False`` draws linear axes (a fitted line then looks straight).
    """
    links = dict(LINKS) if links is None else dict(links)
    lo, hi = size_range
    xs = np.logspace(math.log10(lo), math.log10(hi), points) if loglog else np.linspace(lo, hi, points)
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    for i, (name, spec) in enumerate(links.items()):
        link = _as_link(name, spec)
        ys = [collective_time(op, float(x), n, link.alpha, link.beta) for x in xs]
        label = f"{name}: α = {format_seconds(link.alpha)}, β = {link.beta / 1e9:.3g} GB/s"
        ax.plot(xs, ys, color=f"C{i}", lw=1.4, label=label, gid=f"link:{name}")
    markers = "os^Dv"
    for j, m in enumerate(measured):
        ax.scatter(m.sizes, m.times, s=22, marker=markers[j % len(markers)], color="black" if j == 0 else "0.45",
                   zorder=3, label=f"measured: {m.label} ({m.op}, {m.n} ranks)", gid=f"measured:{m.label}")
    if highlight is not None:
        name, v = highlight
        link = _as_link(name, links[name])
        t = collective_time(op, v, n, link.alpha, link.beta)
        ax.plot([v], [t], marker="*", ms=14, color="gold", mec="black", ls="none", zorder=4,
                label=f"{format_bytes(v, digits=3)} on {name}: {format_seconds(t)}", gid="highlight")
    if loglog:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("tensor size V (bytes)")
    ax.set_ylabel("time (s)")
    steps, _ = collective_steps(op, 1.0, n)
    title = f"{op} on {n} ranks: {steps} steps x (α + bytes per step / β)"
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=9)
    ax.grid(True, which="major", lw=0.4, alpha=0.5)
    ax.legend(fontsize=7, loc="upper left", frameon=False)
    return fig


# ----------------------------------------------------------------------------------------------------------------
# The widget

CONTROL_DESCRIPTIONS: dict[str, str] = {"op": "collective", "size_mb": "size (MB)", "world_size": "ranks",
                                        "link": "link"}
"""Control name (for :meth:`CollectiveCostWidget.set`) -> the ``description`` shown next to it (stable)."""

WORLD_SIZES = (2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SIZE_RANGE_MB = (1e-3, 1e5)  # 1 kB to 100 GB, decimal


class CollectiveCostWidget(ControlPanel):
    """An ipywidgets container: controls (collective, size, ranks, link), the prediction, and the figure.

    From code: ``w.set(size_mb=1000, world_size=64)`` sets controls (one update) and returns ``w.text``;
    ``w.seconds`` is the predicted time, ``w.breakdown`` its parts, ``w.controls`` {name: control widget} with
    the names of ``CONTROL_DESCRIPTIONS``, ``w.links`` the links offered.
    """

    def __init__(self, op: str = "all_reduce", size_mb: float = 100.0, world_size: int = 8,
                 link: str = "NVLink 4 (H100)", fitted: tuple[float, float] | None = None,
                 measured: Sequence[Measurement] = (), note: str | None = None, draw: bool = True) -> None:
        super().__init__()
        self._draw = draw
        self.links: dict[str, Link] = dict(LINKS)
        if fitted is not None:
            self.links[FITTED] = Link(FITTED, float(fitted[0]), float(fitted[1]), note or "fitted to measurements")
        self.measured = list(measured)
        self.note = note
        self.seconds = 0.0
        self.breakdown: dict[str, float] = {}
        style = {"description_width": "initial"}
        d = CONTROL_DESCRIPTIONS
        self.controls: dict[str, Any] = {
            "op": W.Dropdown(options=list(OPS), value=op, description=d["op"], style=style,
                             layout=W.Layout(width="220px")),
            "size_mb": W.FloatLogSlider(value=size_mb, base=10, min=math.log10(SIZE_RANGE_MB[0]),
                                        max=math.log10(SIZE_RANGE_MB[1]), step=0.05, description=d["size_mb"],
                                        readout_format=".3g", style=style, continuous_update=False,
                                        layout=W.Layout(width="360px")),
            "world_size": W.Dropdown(options=list(WORLD_SIZES), value=world_size, description=d["world_size"],
                                     style=style, layout=W.Layout(width="130px")),
            "link": W.Dropdown(options=list(self.links), value=link, description=d["link"], style=style,
                               layout=W.Layout(width="300px")),
        }
        self.result = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(max_width="760px"))
        c = self.controls
        self.children = [W.HBox([c["op"], c["world_size"], c["link"]], layout=W.Layout(flex_flow="row wrap")),
                         c["size_mb"], self.result, self.image]
        self.add_class("course-collective-cost")
        self._watch()
        self.update()

    # ---- reading and writing from code

    def _prepare(self, values: dict[str, Any]) -> dict[str, Any]:
        lo, hi = SIZE_RANGE_MB
        if "size_mb" in values and not lo <= values["size_mb"] <= hi:  # the slider would clamp it silently
            raise ValueError(f"size_mb must be within [{lo:g}, {hi:g}] MB, got {values['size_mb']}")
        return values

    @property
    def text(self) -> str:
        """The prediction and its parts, as plain text (what the widget shows)."""
        b, v = self.breakdown, self.values()
        link = self.links[v["link"]]
        op, n = v["op"], v["world_size"]
        nbytes, step_bytes, sent = (format_bytes(b[k], digits=3) for k in ("nbytes", "step_bytes", "bytes_per_rank"))
        return "\n".join([
            f"{op} of {nbytes} on {n} ranks over {link.name}: {format_seconds(self.seconds)}",
            f"  = {b['steps']:.0f} steps x (alpha {format_seconds(link.alpha)} + {step_bytes}"
            f" / beta {link.beta / 1e9:.3g} GB/s) = latency {format_seconds(b['latency'])}"
            f" + bandwidth {format_seconds(b['bandwidth'])}",
            f"  each rank sends {sent}; algbw = V/t = {b['algbw'] / 1e9:.3g} GB/s, "
            f"busbw = algbw x {b['busbw_factor']:.3g} = {b['busbw'] / 1e9:.3g} GB/s (nccl-tests convention)",
        ])

    # ---- computing

    def update(self) -> None:
        """Recompute the prediction from the controls and redraw."""
        v = self.values()
        op, n, link = v["op"], int(v["world_size"]), self.links[v["link"]]
        nbytes = float(v["size_mb"]) * 1e6
        steps, step_bytes = collective_steps(op, nbytes, n)
        self.seconds = collective_time(op, nbytes, n, link.alpha, link.beta)
        algbw = nbytes / self.seconds if self.seconds else 0.0
        factor = bus_bandwidth_factor(op, n)
        self.breakdown = {"nbytes": nbytes, "steps": float(steps), "step_bytes": step_bytes,
                          "latency": steps * link.alpha, "bandwidth": steps * step_bytes / link.beta,
                          "bytes_per_rank": collective_bytes_per_rank(op, nbytes, n), "algbw": algbw,
                          "busbw_factor": factor, "busbw": algbw * factor}
        lines = self.text.split("\n")
        self.result.value = (f"<b>{lines[0]}</b><br><span style='font-size:12px'>{lines[1]}<br>{lines[2]}"
                             f"<br><i>{link.source}</i></span>")
        if self._draw:
            self.image.value = figure_png(self.figure())

    def figure(self) -> Figure:
        """The alpha-beta figure for the current op and world size, every link, the measurements that match."""
        v = self.values()
        op, n = v["op"], int(v["world_size"])
        matching = [m for m in self.measured if m.op == op and m.n == n]
        note = self.note if matching else None
        if self.measured and not matching:
            shown = sorted({(m.op, m.n) for m in self.measured})
            note = "measured points exist for " + ", ".join(f"{o} on {k} ranks" for o, k in shown)
        return plot_collective_cost(op, n, self.links, measured=matching,
                                    highlight=(v["link"], float(v["size_mb"]) * 1e6), note=note, points=61)

    def __repr__(self) -> str:
        return f"CollectiveCostWidget({self.text.splitlines()[0]!r})"


def collective_cost_widget(op: str = "all_reduce", size_mb: float = 100.0, world_size: int = 8,
                           link: str = "NVLink 4 (H100)", *, fitted: tuple[float, float] | None = None,
                           measured: Sequence[Measurement] = (), note: str | None = None,
                           draw: bool = True) -> CollectiveCostWidget:
    """A collective-cost calculator: an ipywidgets container (a :class:`CollectiveCostWidget`) to display.

    ``fitted``: (alpha, beta) measured on this machine, offered as the link ``FITTED``; ``measured``: points
    drawn when the chosen op and world size match theirs; ``note``: where they come from (shown on the figure).
    ``draw=False`` skips the figure (for tests that read only the text).
    """
    return CollectiveCostWidget(op=op, size_mb=size_mb, world_size=world_size, link=link, fitted=fitted,
                                measured=measured, note=note, draw=draw)
