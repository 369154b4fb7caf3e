"""ZeRO and FSDP as pictures: model states per rank by stage and N_d, and the per-unit schedule of ZeRO-3.

Three layers, as every module of ``course_lib.viz``:

* **Arithmetic** (pure): :func:`zero_breakdown` splits ZeRO's per-rank model states (Rajbhandari et al. 2020,
  Sec. 5; ``course_lib.estimates.model_states.zero_memory_per_device``) into parameters, gradients and optimizer state;
  :func:`reduction_factor` is stage 0's bytes over stage s's at N_d ranks, :func:`limit_factor` its value for
  N_d -> infinity and :func:`min_ranks_for` the smallest N_d that reaches a given factor. They check the articles'
  loose claims: "stage 1 ~4x, stage 2 ~8x" are the *limits* for K = 12 with 16-bit weights and gradients
  ((2+2+12)/4 and (2+2+12)/2), reached only for large N_d; ZeRO-3's factor is N_d itself, so "4-8x" is
  just N_d = 4..8, not a property of FSDP.
* **Figures and the widget** (pure: data in, ``Figure`` out): :func:`plot_zero_memory` draws stacked bars by
  category for stages 0-3 at one N_d next to the reduction factor against N_d; :class:`ZeroMemoryWidget`
  (:func:`zero_memory_widget`) wires a model preset, precision, optimizer, N_d, stage and GPU to it. Its
  :meth:`ZeroMemoryWidget.set` changes controls from code and returns the text it shows.
* **The unit schedule**: :func:`record_zero_step` (a ``launch`` target in ``course_lib.measure.instrument``, re-exported
  here) runs ``ZeroDataParallel`` with extra hooks that write compute markers ("forward", "forward_end", "backward",
  "optimizer") into the engine's own per-unit event list, between its collectives; :func:`simulate_timeline` (pure)
  lays one rank's events out on two lanes, compute and communication, with *modelled* durations (a block's forward
  1, its backward 2, a collective proportional to the unit's bytes) and the dependencies of the real schedule: a
  unit computes only once its all-gather is done; the collectives of one process group run one after the other; a
  blocking collective stops the host; a prefetched all-gather does not. :func:`plot_unit_timeline` draws the lanes
  of every rank, one panel per run, with a mandatory note saying how the times were produced.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import ipywidgets as W
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from course_lib.estimates import hardware
from course_lib.estimates.memory import training_memory
from course_lib.estimates.memory_budget import GB
from course_lib.estimates.model_states import bytes_per_param, zero_memory_per_device
from course_lib.measure.instrument import record_zero_step
from course_lib.model_config import PRESETS, GPTConfig, param_count
from course_lib.parallel.zero import check_stage
from course_lib.viz.memory import CATEGORY_COLORS, PRECISION_OPTIONS
from course_lib.viz.panel import ControlPanel, figure_png

__all__ = [
    "CATEGORIES",
    "CONTROL_DESCRIPTIONS",
    "STAGE_NAMES",
    "Bar",
    "Timeline",
    "ZeroMemoryWidget",
    "limit_factor",
    "min_ranks_for",
    "plot_unit_timeline",
    "plot_zero_memory",
    "record_zero_step",
    "reduction_factor",
    "simulate_timeline",
    "zero_breakdown",
    "zero_memory_widget",
]

CATEGORIES = ("parameters", "gradients", "optimizer_state")
STAGE_NAMES = {0: "DP (stage 0)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP"}


# ----------------------------------------------------------------------------------------------------------------
# Arithmetic


def _check(stage: int, n_d: int) -> None:
    check_stage(stage)
    if isinstance(n_d, bool) or not isinstance(n_d, int) or n_d < 1:
        raise ValueError(f"N_d must be a positive int, got {n_d!r}")


def zero_breakdown(psi: float, n_d: int, stage: int, K: float = 12, param_bytes: float = 2,
                   grad_bytes: float = 2) -> dict[str, float]:
    """Model-state bytes per rank by category: parameters ``param_bytes``·Ψ (/N_d from stage 3), gradients
    ``grad_bytes``·Ψ (/N_d from stage 2), optimizer state K·Ψ (/N_d from stage 1). Sums to
    ``zero_memory_per_device(psi, K, n_d, stage, param_bytes, grad_bytes)``."""
    _check(stage, n_d)
    return {"parameters": param_bytes * psi / (n_d if stage >= 3 else 1),
            "gradients": grad_bytes * psi / (n_d if stage >= 2 else 1),
            "optimizer_state": K * psi / (n_d if stage >= 1 else 1)}


def reduction_factor(n_d: int, stage: int, K: float = 12, param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """How many times less model-state memory a rank holds at ``stage`` than plain DP: (p + g + K) / per-rank.

    Independent of Ψ. K = 12, 16-bit weights and gradients: stage 1 16/(4 + 12/N_d), stage 2 16/(2 + 14/N_d),
    stage 3 N_d."""
    _check(stage, n_d)
    full = zero_memory_per_device(1.0, K, 1, 0, param_bytes, grad_bytes)
    return full / zero_memory_per_device(1.0, K, n_d, stage, param_bytes, grad_bytes)


def limit_factor(stage: int, K: float = 12, param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """``reduction_factor`` for N_d -> infinity: what is never sharded stays. Stage 0: 1; stage 1:
    (p + g + K)/(p + g) (4 for K = 12, 16-bit); stage 2: (p + g + K)/p (8); stage 3: infinite."""
    _check(stage, 1)
    full = param_bytes + grad_bytes + K
    kept = {0: full, 1: param_bytes + grad_bytes, 2: param_bytes, 3: 0.0}[stage]
    return math.inf if kept == 0 else full / kept


def min_ranks_for(factor: float, stage: int, K: float = 12, param_bytes: float = 2,
                  grad_bytes: float = 2) -> int | None:
    """The smallest N_d at which ``reduction_factor(N_d, stage, ...) >= factor``; None if no N_d reaches it
    (the factor is at or above the stage's limit). Exact (rational arithmetic), so a boundary is not lost to
    rounding: stage 1 reaches 3.6x (90% of "~4x") at N_d = 27, stage 2 7.2x (90% of "~8x") at N_d = 63."""
    _check(stage, 1)
    t = Fraction(factor).limit_denominator(10**6)  # 0.9 * 4 is 3.6000000000000001 in floating point
    if t <= 1:
        return 1
    p, g, k = Fraction(param_bytes), Fraction(grad_bytes), Fraction(K)
    full = p + g + k
    kept, sharded = {0: (full, Fraction(0)), 1: (p + g, k), 2: (p, g + k), 3: (Fraction(0), full)}[stage]
    room = full / t - kept  # per-rank bytes the sharded part may still take: sharded / N_d <= room
    if room <= 0:
        return None
    return max(1, math.ceil(sharded / room))


# ----------------------------------------------------------------------------------------------------------------
# The figure


_STAGE_COLORS = {1: "#C44E52", 2: "#DD8452", 3: "#4C72B0"}
_N_RANGE = [2**i for i in range(13)]  # 1 .. 4096


def plot_zero_memory(psi: float, n_d: int, *, K: float = 12, param_bytes: float = 2, grad_bytes: float = 2,
                     stage: int | None = None, gpu: str | None = "H100 80GB", n_range: Sequence[int] = _N_RANGE,
                     claims: bool = True, title: str | None = None,
                     figsize: tuple[float, float] = (11.0, 4.2)) -> Figure:
    """Left: model states per rank by category (stacked) for stages 0-3 at ``n_d`` ranks, against ``gpu``'s
    capacity. Right: the reduction factor vs N_d (log-log) for stages 1-3 with their limits (dotted) and, if
    ``claims``, the articles' numbers: the band "4-8x" and the marks "~4x" (stage 1) and "~8x" (stage 2).
    ``stage`` highlights one stage in both panels. ``fig.axes[0].containers[i]`` holds category ``i``'s four
    bars (``CATEGORIES`` order); the right panel has one line per stage labelled ``STAGE_NAMES[s]``."""
    fig = Figure(figsize=figsize, layout="constrained")
    ax, ax2 = fig.subplots(1, 2, width_ratios=[1.0, 1.25])
    parts = [zero_breakdown(psi, n_d, s, K, param_bytes, grad_bytes) for s in range(4)]
    totals = [sum(p.values()) for p in parts]
    cap = hardware.gpu(gpu).bytes if gpu else 0.0
    scale, unit = (GB, "GB") if max([*totals, cap]) >= 1e8 else (1e6, "MB")
    x = list(range(4))
    bottom = [0.0] * 4
    for cat in CATEGORIES:
        heights = [p[cat] / scale for p in parts]
        ax.bar(x, heights, bottom=bottom, width=0.6, label=cat, color=CATEGORY_COLORS[cat], edgecolor="white",
               linewidth=0.5)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for s, tot in enumerate(totals):
        ax.annotate(f"{tot / scale:,.1f} {unit}\n{totals[0] / tot:.2f}x less" if s else f"{tot / scale:,.1f} {unit}",
                    xy=(s, tot / scale), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize=7.5, fontweight="bold" if s == stage else "normal")
    ax.set_xticks(x, [STAGE_NAMES[s].replace(" / ", "/\n").replace(" (", "\n(") for s in range(4)], fontsize=8)
    if stage is not None:
        ax.get_xticklabels()[stage].set_fontweight("bold")
    if gpu:
        g = hardware.gpu(gpu)
        ax.axhline(g.bytes / scale, color="black", lw=1.2)
        # beside the axes at the line's right end: inside, it printed over the last (ZeRO-3) bar's value label
        ax.annotate(f"{g.name}\n{g.gb:.1f} GB", xy=(1.0, g.bytes / scale), xycoords=("axes fraction", "data"),
                    xytext=(3, 0), textcoords="offset points", ha="left", va="center", fontsize=7,
                    annotation_clip=False)
    ax.set_ylim(0, max([*totals, cap]) / scale * 1.22)
    ax.set_ylabel(f"model states per rank ({unit})")
    ax.set_title(f"N_d = {n_d}: Ψ = {psi / 1e9:.3g}B, bytes/param {param_bytes:g} + {grad_bytes:g} + K={K:g}",
                 fontsize=8)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], fontsize=7, loc="upper right", frameon=False)

    ns = sorted(set(n_range) | {n_d})
    for s in (1, 2, 3):
        ys = [reduction_factor(n, s, K, param_bytes, grad_bytes) for n in ns]
        ax2.plot(ns, ys, marker="o", ms=3, lw=2.4 if s == stage else 1.4, color=_STAGE_COLORS[s], label=STAGE_NAMES[s])
        lim = limit_factor(s, K, param_bytes, grad_bytes)
        if math.isfinite(lim):
            ax2.axhline(lim, color=_STAGE_COLORS[s], ls=":", lw=1)
            ax2.annotate(f"limit {lim:g}x", xy=(ns[-1], lim), xytext=(-2, 2), textcoords="offset points",
                         ha="right", va="bottom", fontsize=7, color=_STAGE_COLORS[s])
    if claims:
        ax2.axhspan(4, 8, color="gold", alpha=0.25, lw=0, label='claimed: "4-8x"')
        for s, claim in ((1, 4), (2, 8)):
            n_ok = min_ranks_for(0.9 * claim, s, K, param_bytes, grad_bytes)
            text = (f'"~{claim}x" (stage {s}) within 10%\nfrom N_d = {n_ok}' if n_ok else
                    f'"~{claim}x" (stage {s}): never\n(limit {limit_factor(s, K, param_bytes, grad_bytes):g}x)')
            if n_ok:
                ax2.plot([n_ok], [reduction_factor(n_ok, s, K, param_bytes, grad_bytes)], marker="*", ms=11,
                         color=_STAGE_COLORS[s], zorder=5)
            ax2.annotate(text, xy=(0.02, 0.97 - 0.11 * (s - 1)), xycoords="axes fraction", ha="left", va="top",
                         fontsize=7, color=_STAGE_COLORS[s])
    ax2.axvline(n_d, color="gray", lw=0.8, ls="--")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log", base=2)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax2.xaxis.set_major_formatter(plain)
    ax2.yaxis.set_major_formatter(plain)
    ax2.tick_params(labelsize=7)
    ax2.set_xlabel("N_d (data-parallel ranks)")
    ax2.set_ylabel("model states: DP / stage (x less per rank)")
    ax2.legend(fontsize=7, loc="lower right", frameon=False)
    ax2.grid(True, which="major", lw=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


# ----------------------------------------------------------------------------------------------------------------
# The widget

CONTROL_DESCRIPTIONS: dict[str, str] = {"model": "model", "precision": "precision", "optimizer": "optimizer",
                                        "n_d": "N_d", "stage": "ZeRO stage", "gpu": "GPU"}
"""Control name (for :meth:`ZeroMemoryWidget.set`) -> the ``description`` shown next to it (stable)."""


class ZeroMemoryWidget(ControlPanel):
    """Model states per rank for a preset model: controls, the verdict and table (text), the figure.

    ``w.set(n_d=64, stage=1)`` sets controls (one redraw) and returns ``w.text``; ``w.rows`` holds one dict per
    stage (bytes by category, total, factor vs DP); ``w.controls`` {name: control} with the names of
    ``CONTROL_DESCRIPTIONS``. Activations are not model states and ZeRO does not shard them: the text adds what
    one sequence of the model's length costs per rank (``training_memory``, selective recomputation)."""

    def __init__(self, model: str = "llama2-7b", draw: bool = True, **values: Any) -> None:
        super().__init__()
        self._draw = draw
        self.rows: list[dict[str, Any]] = []
        self.text_lines: list[str] = []
        style = {"description_width": "initial"}
        d = CONTROL_DESCRIPTIONS
        self.controls: dict[str, Any] = {
            "model": W.Dropdown(options=[k for k in PRESETS if k != "tiny"], value=model, description=d["model"],
                                style=style, layout=W.Layout(width="220px")),
            "precision": W.Dropdown(options=list(PRECISION_OPTIONS.items()), value=("mixed", False),
                                    description=d["precision"], style=style, layout=W.Layout(width="330px")),
            "optimizer": W.Dropdown(options=["adamw", "sgd_momentum", "sgd"], value="adamw",
                                    description=d["optimizer"], style=style, layout=W.Layout(width="170px")),
            "n_d": W.SelectionSlider(options=_N_RANGE, value=8, description=d["n_d"], style=style,
                                     layout=W.Layout(width="330px")),
            "stage": W.ToggleButtons(options=[0, 1, 2, 3], value=3, description=d["stage"],
                                     style={"description_width": "initial", "button_width": "40px"}),
            "gpu": W.Dropdown(options=list(hardware.GPUS), value="H100 80GB", description=d["gpu"], style=style,
                              layout=W.Layout(width="220px")),
        }
        ctl = self.controls
        self.verdict_html = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(max_width="900px"))
        self.table = W.HTML()
        self.children = [
            W.HBox([ctl["model"], ctl["precision"], ctl["optimizer"], ctl["gpu"]],
                   layout=W.Layout(flex_flow="row wrap")),
            W.HBox([ctl["n_d"], ctl["stage"]], layout=W.Layout(flex_flow="row wrap")),
            self.verdict_html, self.image, self.table,
        ]
        self.add_class("course-zero-memory")
        self._watch()
        self.set(**values)

    def _prepare(self, values: dict[str, Any]) -> dict[str, Any]:
        """``precision`` also accepts "mixed", "bf16", "fp32"."""
        if isinstance(values.get("precision"), str):
            values["precision"] = (values["precision"], False)
        return values

    @property
    def text(self) -> str:
        return "\n".join(self.text_lines)

    def update(self) -> None:
        v = {k: w.value for k, w in self.controls.items()}
        cfg: GPTConfig = PRESETS[v["model"]]
        precision, acc = v["precision"]
        try:
            pb = bytes_per_param(precision, v["optimizer"], fp32_grad_accum=acc)
        except ValueError as err:
            self.rows, self.text_lines = [], [f"invalid settings: {err}"]
            self.verdict_html.value = f"<b style='color:darkorange'>{self.text_lines[0]}</b>"
            self.table.value = ""
            return
        psi, n, stage = param_count(cfg), v["n_d"], v["stage"]
        g = hardware.gpu(v["gpu"])
        self.rows = []
        for s in range(4):
            parts = zero_breakdown(psi, n, s, pb.K, pb.params, pb.grads)
            total = sum(parts.values())
            self.rows.append({"stage": s, **parts, "total": total,
                              "factor": reduction_factor(n, s, pb.K, pb.params, pb.grads)})
        chosen = self.rows[stage]
        fits = chosen["total"] <= g.bytes
        acts = training_memory(cfg, precision=precision, optimizer=v["optimizer"], fp32_grad_accum=acc,
                               micro_batch=1, recompute="selective")["activations"]
        verdict = (f"{STAGE_NAMES[stage]} on N_d = {n}: model states {chosen['total'] / GB:.2f} GB per rank, "
                   f"{chosen['factor']:.2f}x less than plain DP; "
                   + (f"fits on {g.name} ({g.gb:.1f} GB) before activations" if fits else
                      f"does not fit on {g.name} ({chosen['total'] / g.bytes:.1f}x its {g.gb:.1f} GB)"))
        header = f"{'stage':>14} | {'parameters':>10} | {'gradients':>10} | {'optimizer':>10} | {'total':>10} | vs DP"
        lines = [verdict,
                 f"{cfg.name}: Ψ = {psi / 1e9:.2f}B, {pb.params} + {pb.grads} + K={pb.K} bytes per parameter "
                 f"({precision}{'+fp32acc' if acc else ''}, {v['optimizer']}), GB per rank:", header]
        for r in self.rows:
            mark = "*" if r["stage"] == stage else " "
            lines.append(f"{mark}{STAGE_NAMES[r['stage']]:>13} | " + " | ".join(
                f"{r[c] / GB:10.2f}" for c in (*CATEGORIES, "total")) + f" | {r['factor']:5.2f}x")
        limits = ", ".join(f"stage {s} {limit_factor(s, pb.K, pb.params, pb.grads):g}x" for s in (1, 2))
        lines.append(f"limits for N_d -> inf: {limits}, stage 3 = N_d; not sharded by ZeRO: activations, "
                     f"{acts / GB:.2f} GB per rank for one sequence of {cfg.seq_len} tokens (selective recompute)")
        self.text_lines = lines
        color = "darkgreen" if fits else "darkred"
        self.verdict_html.value = f"<b style='color:{color}'>{verdict}</b>"
        self.table.value = "<pre style='font-size:11px'>" + "\n".join(lines[1:]) + "</pre>"
        if self._draw:
            fig = plot_zero_memory(psi, n, K=pb.K, param_bytes=pb.params, grad_bytes=pb.grads, stage=stage,
                                   gpu=v["gpu"], title=f"{cfg.name}: model states per rank")
            self.image.value = figure_png(fig)

    def __repr__(self) -> str:
        return f"ZeroMemoryWidget({self.text_lines[0] if self.text_lines else ''!r})"


def zero_memory_widget(model: str = "llama2-7b", draw: bool = True, **values: Any) -> ZeroMemoryWidget:
    """The ZeRO memory explorer (a :class:`ZeroMemoryWidget`) to display; ``values`` set controls at start
    (precision, optimizer, n_d, stage, gpu). ``draw=False`` skips the figure (tests that read the text)."""
    return ZeroMemoryWidget(model=model, draw=draw, **values)


# ----------------------------------------------------------------------------------------------------------------
# Recording the unit schedule: on the ranks, ``course_lib.measure.instrument.record_zero_step`` (re-exported here)


# ----------------------------------------------------------------------------------------------------------------
# The timeline (pure)


@dataclass(frozen=True)
class Bar:
    """One interval of a lane: ``lane`` "compute" or "comm"; ``kind`` "F", "B", "opt", "wait" (compute) or
    "AG", "RS" (comm); ``unit`` the unit name ("" the root)."""

    lane: str
    start: float
    end: float
    kind: str
    unit: str

    @property
    def length(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """One rank's lanes: ``bars``; ``makespan`` (end of the last bar); ``exposed`` (time the host waited for a
    collective: the "wait" bars); ``comm`` (time the comm lane was busy)."""

    bars: list[Bar]

    @property
    def makespan(self) -> float:
        return max((b.end for b in self.bars), default=0.0)

    @property
    def exposed(self) -> float:
        return sum(b.length for b in self.bars if b.kind == "wait")

    @property
    def comm(self) -> float:
        return sum(b.length for b in self.bars if b.lane == "comm")


def simulate_timeline(events: Sequence[tuple[str, str]], units: Sequence[Mapping[str, Any]], *,
                      comm_ratio: float = 0.5, root_costs: tuple[float, float, float] = (0.2, 0.0, 0.6),
                      leaf_cost: float = 1.0, backward_factor: float = 2.0, optimizer_cost: float = 0.5,
                      blocking_reduce_scatter: bool = True) -> Timeline:
    """Lay one rank's events (``record_zero_step``) out in modelled time.

    Costs: a leaf unit's forward ``leaf_cost``, its backward ``backward_factor`` x that; a unit with units inside
    it (the root) computes in segments: before its first child, between children, after its last child, with
    ``root_costs`` (forward; x ``backward_factor`` in backward). A collective of a unit takes ``comm_ratio`` x
    (its padded size / the largest leaf unit's): ``comm_ratio`` is a block's all-gather time over its forward
    time. The optimizer step ``optimizer_cost``.

    Rules (those of ``ZeroDataParallel``): the all-gathers issued in a unit's pre-hook are the unit's own
    (blocking: the host waits) and prefetches (async: the host goes on); a unit starts computing when its
    parameters are gathered; collectives run one at a time in issue order (one process group); a
    reduce-scatter blocks the host (this implementation's on gloo). ``blocking_reduce_scatter=False`` models
    FSDP2 on GPUs instead, whose reduce-scatter runs on its own stream while the next unit computes; the
    optimizer step then waits for the last collective."""
    sizes = {u["name"]: u["padded_numel"] for u in units}
    parents = {u["name"]: u.get("parent") for u in units}
    has_children = {n for n in parents.values() if n is not None}
    leaves = [sizes[n] for n in sizes if n not in has_children] or list(sizes.values())
    ref = max(leaves)
    bars: list[Bar] = []
    t = c = 0.0  # host time, time the comm lane is free
    ready: dict[str, float] = {}
    pending: list[str] = []
    stack: list[list[Any]] = []  # [unit, phase, children seen]

    def comm_bar(kind: str, unit: str, blocking: bool) -> None:
        nonlocal t, c
        start = max(t, c)
        end = start + comm_ratio * sizes[unit] / ref
        bars.append(Bar("comm", start, end, kind, unit))
        c = end
        if kind == "AG":
            ready[unit] = end
        if blocking and end > t:
            bars.append(Bar("compute", t, end, "wait", unit))
            t = end

    def flush(own: str | None) -> None:
        for v in pending:
            comm_bar("AG", v, blocking=(own is None or v == own))
        pending.clear()

    def compute(unit: str, phase: str, position: str) -> None:
        nonlocal t
        if unit in has_children:
            # backward runs the unit's segments in reverse: its first segment is the forward's last one
            order = ("first", "middle", "last") if phase == "F" else ("last", "middle", "first")
            cost = dict(zip(order, root_costs, strict=True))
            d = sum(root_costs) if position == "only" else cost[position]
        else:
            d = leaf_cost
        d *= backward_factor if phase == "B" else 1.0
        if d > 0:
            bars.append(Bar("compute", t, t + d, phase, unit))
            t += d

    def wait_for(unit: str) -> None:
        nonlocal t
        if ready.get(unit, 0.0) > t:
            bars.append(Bar("compute", t, ready[unit], "wait", unit))
            t = ready[unit]

    def close_top() -> None:
        unit, phase, seen = stack.pop()
        compute(unit, phase, "last" if seen else "only")

    for kind, unit in events:
        if kind == "all_gather":
            pending.append(unit)
        elif kind in ("forward", "backward"):
            phase = "F" if kind == "forward" else "B"
            if stack and stack[-1][0] != parents.get(unit) and stack[-1][1] == phase:
                close_top()  # a sibling's backward ended without a marker of its own (stage 2's hooks)
            if stack:
                top = stack[-1]
                compute(top[0], top[1], "middle" if top[2] else "first")
                top[2] = True
            flush(unit)
            wait_for(unit)
            stack.append([unit, phase, False])
        elif kind == "forward_end" or kind in ("reduce_scatter", "all_reduce"):
            flush(None)
            if stack and stack[-1][0] == unit:
                close_top()
            if kind != "forward_end":
                comm_bar("RS" if kind == "reduce_scatter" else "AR", unit, blocking=blocking_reduce_scatter)
        elif kind == "optimizer":
            flush(None)
            while stack:
                close_top()
            if c > t:  # the step needs every reduced gradient
                bars.append(Bar("compute", t, c, "wait", ""))
                t = c
        elif kind == "optimizer_end":
            if optimizer_cost > 0:
                bars.append(Bar("compute", t, t + optimizer_cost, "opt", ""))
                t += optimizer_cost
        else:
            raise ValueError(f"unknown event {kind!r} (unit {unit!r})")
    flush(None)  # e.g. stages 1/2: the all-gathers after the optimizer step
    return Timeline(bars)


_UNIT_COLORS = ["#4C72B0", "#55A868", "#8172B3", "#937860", "#DA8BC3", "#64B5CD", "#CCB974"]


def _short(unit: str) -> str:
    return "root" if unit == "" else unit.replace("blocks.", "b")


def plot_unit_timeline(panels: Mapping[str, Sequence[Mapping[str, Any]]], *, note: str,
                       figsize: tuple[float, float] | None = None, **costs: Any) -> Figure:
    """One panel per run ({title: [record_zero_step result of each rank]}), two lanes per rank: compute
    (F forward, B backward, opt, and red "wait" where the host waits for a collective) and communication (AG
    all-gather, RS reduce-scatter). Colours: one per unit. ``note`` (required) says how the times were made;
    ``costs`` go to :func:`simulate_timeline`. Each panel's title ends with its modelled step time and
    exposed communication."""
    if not note:
        raise ValueError("a timeline needs its note: say how the times were produced")
    if not panels:
        raise ValueError("nothing to plot")
    n_rows = sum(2 * len(ranks) for ranks in panels.values())
    fig = Figure(figsize=figsize or (11.0, 0.9 + 0.38 * n_rows + 0.5 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (title, ranks) in zip(axes, panels.items(), strict=True):
        colors = {u["name"]: _UNIT_COLORS[i % len(_UNIT_COLORS)] for i, u in enumerate(ranks[0]["units"])}
        ticks, labels = [], []
        span = exposed = 0.0
        for i, rec in enumerate(ranks):
            tl = simulate_timeline(rec["events"], rec["units"], **costs)
            span, exposed = max(span, tl.makespan), max(exposed, tl.exposed)
            for lane_i, lane in enumerate(("compute", "comm")):
                y = -(2 * i + lane_i)
                ticks.append(y)
                labels.append(f"rank {rec['rank']} {lane}")
                for b in (b for b in tl.bars if b.lane == lane):
                    if b.kind == "wait":
                        ax.barh(y, b.length, left=b.start, height=0.7, color="#F4CCCC", edgecolor="#C44E52",
                                hatch="///", lw=0.6)
                        continue
                    color = "#BBBBBB" if b.kind == "opt" else colors.get(b.unit, "gray")
                    ax.barh(y, b.length, left=b.start, height=0.7, color=color, edgecolor="black", lw=0.5,
                            alpha=0.55 if b.kind in ("B", "RS") else 0.95)
                    text = "opt" if b.kind == "opt" else f"{b.kind} {_short(b.unit)}"
                    if b.length >= 0.3:
                        ax.text(b.start + b.length / 2, y, text, ha="center", va="center", fontsize=6.5)
        ax.set_yticks(ticks, labels, fontsize=7)
        ax.set_xlim(0, span * 1.01)
        ax.set_title(f"{title}: step {span:.2f}, exposed communication {exposed:.2f} (modelled units)", fontsize=8.5)
        ax.tick_params(axis="x", labelsize=7)
    wrapped = "\n".join(textwrap.wrap(note, 180))
    axes[-1].set_xlabel(f"modelled time (a block's forward = 1)\n{wrapped}", fontsize=8)
    legend = [Patch(color=c, label=_short(u)) for u, c in colors.items()]
    legend += [Patch(facecolor="#F4CCCC", edgecolor="#C44E52", hatch="///", label="host waits")]
    axes[0].legend(handles=legend, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return fig
