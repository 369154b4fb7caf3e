"""Context parallelism as pictures: who computes which (query, key) pair under a causal mask, how much each rank
does at each ring step, and what a ring step sends for a real model.

* **Arithmetic** (pure): :func:`work_matrix` marks every visible (q, k) pair with the rank that computes it
  (the rank holding the query); :func:`step_work` counts, for each ring step and rank, the pairs of the K,V
  block it holds at that step (the ring moves in lockstep, so a step lasts as long as its busiest rank):
  :func:`lockstep_work` sums the per-step maxima, the *modelled* attention time of one pass in units of pairs.
* **Figure and widget**: :func:`plot_cp_work` draws the matrix, the per-rank totals against their mean and the
  per-step work; :class:`CPWorkWidget` wires cp, sequence length and layout to it, plus a model preset and a
  context length for the bytes each ring step sends (``course_lib.parallel.cp.ring_kv_bytes``).
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from course_lib.estimates.accounting import ring_kv_bytes
from course_lib.estimates.memory_budget import format_bytes
from course_lib.model_config import PRESETS
from course_lib.parallel.cp_attention import LAYOUTS, Layout, all_positions, causal_pairs, imbalance
from course_lib.viz.panel import ControlPanel, figure_png

RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")
CONTEXTS = (4096, 8192, 32768, 131072, 1048576)


def work_matrix(seq_len: int, cp: int, layout: Layout) -> np.ndarray:
    """[s, s] ints: the rank that computes (query q, key k), or -1 where the causal mask hides the pair."""
    owner = np.full(seq_len, -1)
    for r, pos in enumerate(all_positions(seq_len, cp, layout).numpy()):
        owner[pos] = r
    m = np.repeat(owner[:, None], seq_len, axis=1)
    m[np.triu_indices(seq_len, 1)] = -1
    return m


def step_work(seq_len: int, cp: int, layout: Layout) -> np.ndarray:
    """[cp steps, cp ranks]: visible pairs rank r computes at ring step t (with the K,V of rank r - t)."""
    pos = all_positions(seq_len, cp, layout).numpy()
    work = np.zeros((cp, cp), dtype=np.int64)
    for t in range(cp):
        for r in range(cp):
            work[t, r] = int((pos[(r - t) % cp][None, :] <= pos[r][:, None]).sum())
    return work


def lockstep_work(seq_len: int, cp: int, layout: Layout) -> int:
    """Modelled attention time of one pass, in pairs: every step waits for its busiest rank (sum of maxima)."""
    return int(step_work(seq_len, cp, layout).max(axis=1).sum())


def plot_cp_work(seq_len: int, cp: int, layout: Layout) -> Figure:
    """Left: the causal (q, k) matrix coloured by computing rank. Middle: pairs per rank vs the mean. Right:
    pairs per ring step and rank (the step's maximum is what the ring waits for)."""
    fig = Figure(figsize=(11.5, 3.6), layout="constrained")
    ax_m, ax_r, ax_s = fig.subplots(1, 3, width_ratios=[1.1, 1, 1.2])
    m = work_matrix(seq_len, cp, layout)
    cmap = ListedColormap(["#F2F2F2", *RANK_COLORS[:cp]])
    ax_m.imshow(m + 1, cmap=cmap, vmin=0, vmax=cp, interpolation="nearest")
    ax_m.set(title=f"who computes (q, k): {layout}", xlabel="key position", ylabel="query position")
    pairs = causal_pairs(seq_len, cp, layout)
    ranks = np.arange(cp)
    ax_r.bar(ranks, pairs, color=RANK_COLORS[:cp])
    ax_r.axhline(np.mean(pairs), color="k", ls="--", lw=1, label="mean")
    ax_r.set(title=f"pairs per rank: max/mean = {imbalance(pairs):.2f}", xlabel="rank", ylabel="visible pairs",
             xticks=ranks)
    ax_r.legend(loc="upper left", fontsize=8)
    work = step_work(seq_len, cp, layout)
    width = 0.8 / cp
    for r in range(cp):
        ax_s.bar(np.arange(cp) + (r - (cp - 1) / 2) * width, work[:, r], width, color=RANK_COLORS[r],
                 label=f"rank {r}")
    ax_s.set(title=f"per ring step (lockstep total {lockstep_work(seq_len, cp, layout)})", xlabel="ring step",
             ylabel="pairs", xticks=np.arange(cp))
    ax_s.legend(fontsize=7, ncol=2, loc="upper right")
    fig.suptitle("causal attention work under context parallelism (counted pairs; modelled time)", fontsize=10)
    return fig


class CPWorkWidget(ControlPanel):
    """cp, sequence length and layout -> work matrix, imbalance and lockstep work; model and context -> bytes
    of K,V per ring step per layer (bf16, one sequence). ``w.set(cp=4, layout="contiguous")`` returns ``text``;
    ``w.summary`` holds the numbers."""

    def __init__(self, draw: bool = True, **values: Any) -> None:
        super().__init__()
        self._draw = draw
        self.summary: dict[str, Any] = {}
        style = {"description_width": "initial"}
        self.controls = {
            "cp": W.ToggleButtons(options=[2, 4, 8], value=4, description="cp ranks",
                                  style={"description_width": "initial", "button_width": "40px"}),
            "seq_len": W.IntSlider(value=32, min=16, max=96, step=16, description="tokens (picture)", style=style),
            "layout": W.ToggleButtons(options=list(LAYOUTS), value="zigzag", description="layout", style=style),
            "model": W.Dropdown(options=[k for k in PRESETS if k != "tiny"], value="llama3-8b",
                                description="model (bytes)", style=style, layout=W.Layout(width="260px")),
            "context": W.Dropdown(options=list(CONTEXTS), value=131072, description="context", style=style,
                                  layout=W.Layout(width="200px")),
        }
        c = self.controls
        self.verdict = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(max_width="960px"))
        self.children = [W.HBox([c["cp"], c["layout"]], layout=W.Layout(flex_flow="row wrap")),
                         W.HBox([c["seq_len"], c["model"], c["context"]], layout=W.Layout(flex_flow="row wrap")),
                         self.verdict, self.image]
        self.add_class("course-cp-work")
        self._watch()
        self.set(**values)

    def _prepare(self, values: dict[str, Any]) -> dict[str, Any]:
        """The sequence length snaps to a multiple of 2 x 8 (every cp and layout splits it)."""
        if "seq_len" in values:
            values["seq_len"] = max(16, int(values["seq_len"]) // 16 * 16)
        return values

    @property
    def text(self) -> str:
        s = self.summary
        return (f"cp={s['cp']}, {s['seq_len']} tokens, {s['layout']}: pairs per rank {s['pairs']}, "
                f"max/mean {s['imbalance']:.2f} (contiguous formula (2cp-1)/cp = {s['formula']:.2f}, zig-zag 1); "
                f"lockstep work {s['lockstep']} vs {s['lockstep_other']} for the other layout\n"
                f"{s['model']} at {s['context']} tokens: each ring step sends K,V of "
                f"{format_bytes(s['kv_bytes'])} per layer (bf16, b=1, {s['n_kv']} K/V heads), "
                f"{s['cp'] - 1} steps forward per layer")

    def update(self) -> None:
        v = self.values()
        cp, s, layout = v["cp"], v["seq_len"], v["layout"]
        cfg = PRESETS[v["model"]]
        pairs = causal_pairs(s, cp, layout)
        other = "contiguous" if layout == "zigzag" else "zigzag"
        self.summary = {"cp": cp, "seq_len": s, "layout": layout, "pairs": pairs, "imbalance": imbalance(pairs),
                        "formula": (2 * cp - 1) / cp, "lockstep": lockstep_work(s, cp, layout),
                        "lockstep_other": lockstep_work(s, cp, other), "model": cfg.name, "context": v["context"],
                        "n_kv": cfg.kv_heads,
                        "kv_bytes": ring_kv_bytes(v["context"], 1, cfg.kv_heads, cfg.head_dim, cp, 2)}
        self.verdict.value = "<pre>" + self.text + "</pre>"
        if self._draw:
            self.image.value = figure_png(plot_cp_work(s, cp, layout))


def cp_work_widget(**values: Any) -> CPWorkWidget:
    """The widget, with initial values (``cp_work_widget(cp=8, layout="contiguous")``)."""
    return CPWorkWidget(**values)
