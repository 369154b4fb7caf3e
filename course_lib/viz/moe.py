"""Mixture of experts as pictures: where the tokens of one step go, what the capacity drops, what the all-to-alls
carry and how long the slowest rank works.

* **Arithmetic** (pure): :func:`routed_counts` draws a router's top-k choices for T tokens with a preference
  ("skew") for low-numbered experts: logits = N(0, 1) noise + skew * (1 - 2e/(E-1)), so skew 0 is an even router
  and skew 2 sends most tokens to the first experts; :func:`dispatch_plan` applies the capacity
  C = ceil(cf * T * k / E) (``course_lib.moe.expert_capacity``) and places the experts on ep ranks
  contiguously: kept and dropped assignments per expert, rows per rank, the busiest rank against the mean
  (``course_lib.parallel.ep.slowest_rank_load``), and the bytes per layer and step: dispatch + combine forward
  and both again in backward, 4 x kept x h x bytes over all ranks, of which the rows routed to another rank's
  experts leave their rank (*modelled*: what our all-to-all would carry, computed here, not measured).
* **Figures and the widget**: :func:`plot_dispatch` draws tokens per expert (kept and dropped, the capacity line,
  experts shaded by the rank that holds them) next to rows per rank; :func:`plot_expert_load` the load of each
  expert over training steps as a heat map with the busiest expert / mean per step; :class:`MoEDispatchWidget`
  (:func:`moe_dispatch_widget`) wires E, k, capacity factor, ep and skew to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ipywidgets as W
import torch
from matplotlib.figure import Figure

from course_lib.estimates.accounting import slowest_rank_load
from course_lib.moe import expert_capacity
from course_lib.viz.panel import ControlPanel, figure_png

__all__ = ["CONTROL_DESCRIPTIONS", "DispatchPlan", "MoEDispatchWidget", "dispatch_plan", "load_ratio",
           "moe_dispatch_widget", "plot_dispatch", "plot_expert_load", "plot_routing_grid", "routed_counts"]

CONTROL_DESCRIPTIONS = {"n_expert": "experts E", "top_k": "top-k", "capacity_factor": "capacity factor",
                        "ep": "ep ranks", "skew": "router skew"}
CAPACITY_OPTIONS = [("dropless", None), ("0.5", 0.5), ("1.0", 1.0), ("1.25", 1.25), ("1.5", 1.5), ("2.0", 2.0)]


def routed_counts(n_tokens: int, n_expert: int, top_k: int, skew: float, seed: int = 0) -> list[int]:
    """Assignments per expert of a simulated router (top-k of noise + a linear preference of strength skew)."""
    if not 1 <= top_k <= n_expert:
        raise ValueError(f"top_k={top_k} must be in [1, n_expert={n_expert}]")
    g = torch.Generator().manual_seed(seed)
    pref = skew * (1 - 2 * torch.arange(n_expert) / max(n_expert - 1, 1))
    logits = torch.randn(n_tokens, n_expert, generator=g) + pref
    chosen = logits.topk(top_k, dim=-1).indices
    return torch.bincount(chosen.reshape(-1), minlength=n_expert).tolist()


@dataclass
class DispatchPlan:
    """One MoE layer in one step: per expert routed / kept / dropped; per rank the rows its experts process and
    the rows its tokens send away (even split of the tokens over ranks assumed for the latter)."""

    n_tokens: int
    top_k: int
    ep: int
    capacity: int | None
    routed: list[int]
    kept: list[int]
    rank_rows: list[int]
    slowest: int
    mean: float
    bytes_per_step: int
    leaving_bytes_per_step: float

    @property
    def dropped(self) -> int:
        return sum(self.routed) - sum(self.kept)


def dispatch_plan(routed: list[int], n_tokens: int, top_k: int, ep: int, capacity_factor: float | None,
                  d_model: int = 4096, element_size: int = 2) -> DispatchPlan:
    """Capacity, drops, rows per rank and the all-to-all bytes per layer and step (forward + backward)."""
    E = len(routed)
    if E % ep:
        raise ValueError(f"ep={ep} must divide the {E} experts")
    cap = expert_capacity(capacity_factor, n_tokens, top_k, E)
    kept = [min(c, cap) if cap is not None else c for c in routed]
    slowest, mean = slowest_rank_load(routed, ep, cap)
    rank_rows = [sum(kept[j * E // ep:(j + 1) * E // ep]) for j in range(ep)]
    total = 4 * sum(kept) * d_model * element_size  # dispatch + combine, forward + backward
    return DispatchPlan(n_tokens, top_k, ep, cap, list(routed), kept, rank_rows, slowest, mean, total,
                        total * (ep - 1) / ep)


def plot_dispatch(plan: DispatchPlan, title: str = "") -> Figure:
    """Left: assignments per expert, kept (solid) and dropped (hatched), the capacity line, a band per rank.
    Right: rows each rank's experts process, the mean dashed: the step waits for the tallest bar."""
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax, bx = fig.subplots(1, 2, width_ratios=[2.2, 1])
    E, ep = len(plan.routed), plan.ep
    xs = range(E)
    for j in range(ep):
        ax.axvspan(j * E / ep - 0.5, (j + 1) * E / ep - 0.5, color=f"C{j % 10}", alpha=0.08, lw=0)
    ax.bar(xs, plan.kept, color="C0", label="kept")
    ax.bar(xs, [r - k for r, k in zip(plan.routed, plan.kept, strict=True)], bottom=plan.kept, color="none",
           edgecolor="C3", hatch="///", label="dropped")
    if plan.capacity is not None:
        ax.axhline(plan.capacity, color="C3", ls="--", lw=1, label=f"capacity C = {plan.capacity}")
    ax.set_xlabel("expert (shaded by the ep rank that holds it)")
    ax.set_ylabel("assignments")
    ax.set_xticks(list(xs) if E <= 16 else list(range(0, E, E // 8)))
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title or f"tokens per expert (T={plan.n_tokens}, k={plan.top_k})", fontsize=10)
    bx.bar(range(ep), plan.rank_rows, color=[f"C{j % 10}" for j in range(ep)])
    bx.axhline(plan.mean, color="k", ls="--", lw=1, label=f"mean {plan.mean:.0f}")
    bx.set_xticks(range(ep))
    bx.set_xlabel("ep rank")
    bx.set_ylabel("rows processed")
    bx.set_title(f"slowest rank {plan.slowest / plan.mean:.2f}x the mean" if plan.mean else "no rows", fontsize=10)
    bx.legend(loc="upper right", fontsize=8)
    return fig


def load_ratio(counts: list[int]) -> float:
    """max / mean of one step's assignments per expert (1 = balanced; E = everything on one expert)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 0.0


def plot_expert_load(runs: dict[str, list[list[int]]], entropy: dict[str, list[float]] | None = None,
                     title: str = "") -> Figure:
    """Tokens per expert over training steps: one heat map per run ({label: [counts per expert, per step]}),
    steps down, experts across, the share of the step's assignments in colour (1/E everywhere = balanced); below,
    the busiest expert / mean per step of every run (``load_ratio``) and, if given, the mean routing entropy per
    step ({label: [nats per step]}, log E = uniform)."""
    n = len(runs)
    bottom = 2 if entropy else 1
    fig = Figure(figsize=(3.3 * max(n, 2), 2.9 + 2.2 * bottom), layout="constrained")
    grid = fig.add_gridspec(2, n * bottom, height_ratios=[1.35, 1])
    share = {label: torch.tensor(steps, dtype=torch.float32) for label, steps in runs.items()}
    share = {label: t / t.sum(1, keepdim=True).clamp_min(1) for label, t in share.items()}
    image = None
    for i, (label, t) in enumerate(share.items()):
        ax = fig.add_subplot(grid[0, i * bottom:(i + 1) * bottom])
        image = ax.imshow(t.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xticks(range(t.shape[1]))
        ax.set_xlabel("expert")
        ax.set_ylabel("step" if i == 0 else "")
        ax.set_title(label, fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=fig.axes, label="share of the step's assignments", shrink=0.9)
    ax = fig.add_subplot(grid[1, :n])  # the left half of the bottom row (all of it without entropy)
    for j, (label, steps) in enumerate(runs.items()):
        ax.plot([load_ratio(c) for c in steps], color=f"C{j}", label=label)
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert / mean")
    ax.legend(fontsize=7)
    if entropy:
        bx = fig.add_subplot(grid[1, n:])
        for j, (label, values) in enumerate(entropy.items()):
            bx.plot(values, color=f"C{j}", label=label)
        n_expert = len(next(iter(runs.values()))[0])
        bx.axhline(float(torch.log(torch.tensor(float(n_expert)))), color="k", lw=0.8, ls=":", label="log E")
        bx.set_xlabel("step")
        bx.set_ylabel("routing entropy (nats)")
        bx.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


class MoEDispatchWidget(ControlPanel):
    """E, k, capacity factor, ep and router skew -> tokens per expert, dropped, bytes per step, slowest rank.

    ``w.set(ep=4, skew=2.0)`` changes controls (one redraw) and returns ``w.text``; ``w.plan`` is the current
    ``DispatchPlan``. T tokens per step and h are fixed (``n_tokens``, ``d_model``; bf16)."""

    def __init__(self, n_tokens: int = 4096, d_model: int = 4096, draw: bool = True, **values: Any) -> None:
        super().__init__()
        self.n_tokens, self.d_model, self._draw = n_tokens, d_model, draw
        self.plan: DispatchPlan | None = None
        self.text_lines: list[str] = []
        d, style = CONTROL_DESCRIPTIONS, {"description_width": "initial"}
        self.controls: dict[str, Any] = {
            "n_expert": W.Dropdown(options=[4, 8, 16, 32, 64], value=8, description=d["n_expert"], style=style,
                                   layout=W.Layout(width="160px")),
            "top_k": W.Dropdown(options=[1, 2, 4], value=2, description=d["top_k"], style=style,
                                layout=W.Layout(width="130px")),
            "capacity_factor": W.Dropdown(options=CAPACITY_OPTIONS, value=1.25, description=d["capacity_factor"],
                                          style=style, layout=W.Layout(width="220px")),
            "ep": W.Dropdown(options=[1, 2, 4], value=4, description=d["ep"], style=style,
                             layout=W.Layout(width="140px")),
            "skew": W.FloatSlider(value=0.0, min=0.0, max=3.0, step=0.25, description=d["skew"], style=style,
                                  continuous_update=False, layout=W.Layout(width="300px")),
        }
        self.html = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(max_width="900px"))
        self.children = [W.HBox(list(self.controls.values()), layout=W.Layout(flex_flow="row wrap")), self.html,
                         self.image]
        self.add_class("course-moe-dispatch")
        self._watch()
        self.set(**values)

    @property
    def text(self) -> str:
        return "\n".join(self.text_lines)

    def update(self) -> None:
        v = self.values()
        T, k, E = self.n_tokens, v["top_k"], v["n_expert"]
        plan = self.plan = dispatch_plan(routed_counts(T, E, k, v["skew"]), T, k, v["ep"], v["capacity_factor"],
                                         self.d_model)
        cap = "dropless" if plan.capacity is None else f"C = ceil({v['capacity_factor']} x {T} x {k} / {E}) = " \
                                                       f"{plan.capacity}"
        self.text_lines = [
            f"E={E} k={k} ep={v['ep']} skew={v['skew']:g}: {cap}",
            f"dropped {plan.dropped} of {T * k} assignments ({100 * plan.dropped / (T * k):.1f}%)",
            f"all-to-all bytes per layer and step (modelled, bf16, h={self.d_model}): {plan.bytes_per_step / 2**20:.1f}"
            f" MiB, {plan.leaving_bytes_per_step / 2**20:.1f} MiB of it between ranks ((ep-1)/ep)",
            f"slowest rank {plan.slowest} rows vs mean {plan.mean:.0f} ({plan.slowest / plan.mean:.2f}x)",
        ]
        self.html.value = "<br>".join(self.text_lines)
        if self._draw:
            self.image.value = figure_png(plot_dispatch(plan))


def moe_dispatch_widget(**values: Any) -> MoEDispatchWidget:
    """The widget, with any controls set: ``moe_dispatch_widget(n_expert=16, skew=1.5)``."""
    return MoEDispatchWidget(**values)


def plot_routing_grid(chosen: torch.Tensor, keep: torch.Tensor, n_expert: int, capacity: int | None,
                      title: str = "") -> Figure:
    """The router's decisions on a small batch: one row per token, one column per expert; each assignment shows
    its place in the expert's queue (0, 1, ...), blue when kept, a red cross when the queue was already full."""
    T, k = chosen.shape
    fig = Figure(figsize=(1.2 + 0.9 * n_expert, 0.8 + 0.32 * T), layout="constrained")
    ax = fig.subplots()
    taken = [0] * n_expert
    for t in range(T):
        for j in range(k):
            e = int(chosen[t, j])
            kept = bool(keep[t, j])
            ax.scatter(e, t, s=260, marker="s" if kept else "X", color="C0" if kept else "C3",
                       alpha=0.85 if kept else 0.9)
            ax.text(e, t, str(taken[e]), ha="center", va="center", fontsize=8, color="white")
            taken[e] += 1
    ax.set_xticks(range(n_expert))
    ax.set_xlim(-0.6, n_expert - 0.4)
    ax.set_yticks(range(T))
    ax.set_ylim(T - 0.5, -0.5)
    ax.set_xlabel("expert (number: place in its queue)")
    ax.set_ylabel("token (batch order)")
    cap = "dropless" if capacity is None else f"capacity C = {capacity}"
    ax.set_title(title or f"top-{k} routing, {cap}: blue kept, red cross dropped", fontsize=10)
    return fig
