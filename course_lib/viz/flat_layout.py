"""A ZeRO / FSDP unit's flat buffer as a picture: where each parameter sits, the padding, and who owns what.

:func:`plot_flat_layout` is pure (a ``course_lib.parallel.zero.FlatLayout`` in, a matplotlib ``Figure`` out). Top
row: the padded flat buffer, one cell per element, coloured by the parameter it belongs to (labelled with its name
and shape), the padding hatched grey at the end. Below it, one bracket per rank: rank r owns the contiguous range
[r S, (r+1) S), S = padded / N (ZeRO, Rajbhandari et al. 2020; FSDP1's ``FlatParameter``). Meant for small, toy
layouts (tens of elements), where every cell is visible; ``ax.patches`` holds the element cells first (one per
element, in order), then one bar per rank.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from course_lib.parallel.zero_unit import FlatLayout

__all__ = ["PARAM_COLORS", "plot_flat_layout"]

PARAM_COLORS = ("#6baed6", "#fd8d3c", "#74c476", "#9e9ac8", "#fb6a4a", "#fdd0a2")
PAD_COLOR = "#d9d9d9"


def plot_flat_layout(layout: FlatLayout, *, title: str | None = None) -> Figure:
    """Draw ``layout`` (at most 200 elements: one visible cell each)."""
    if layout.padded_numel > 200:
        raise ValueError(f"{layout.padded_numel} elements: too many to draw one cell each (at most 200)")
    n, size = layout.world_size, layout.shard_numel
    fig = Figure(figsize=(max(7.0, 0.28 * layout.padded_numel + 1.5), 1.2 + 0.35 * n), layout="constrained")
    ax = fig.add_subplot()
    owner = [None] * layout.padded_numel
    for i, (off, k) in enumerate(zip(layout.offsets, layout.numels, strict=True)):
        owner[off:off + k] = [i] * k
    for e, i in enumerate(owner):
        pad = i is None
        ax.add_patch(Rectangle((e, 0), 1, 1, facecolor=PAD_COLOR if pad else PARAM_COLORS[i % len(PARAM_COLORS)],
                               edgecolor="white", lw=0.8, hatch="///" if pad else None))
    for name, shape, off, k in zip(layout.names, layout.shapes, layout.offsets, layout.numels, strict=True):
        ax.text(off + k / 2, 1.12, f"{name} {list(shape)}", ha="center", va="bottom", fontsize=8,
                color="#333333", rotation=0 if k >= 4 else 30)
    if layout.padded_numel > layout.numel:
        ax.text((layout.numel + layout.padded_numel) / 2, -0.12, f"padding ({layout.padded_numel - layout.numel})",
                ha="center", va="top", fontsize=8, color="#555555")
    for r in range(n):
        lo, hi = layout.bounds(r)
        y = -0.7 - 0.35 * r
        ax.add_patch(Rectangle((lo + 0.1, y), hi - lo - 0.2, 0.22, facecolor="#525252"))
        ax.text(lo - 0.3, y + 0.11, f"rank {r}", ha="right", va="center", fontsize=8)
        ax.text(hi + 0.3, y + 0.11, f"[{lo}, {hi})", ha="left", va="center", fontsize=8)
    ax.set_xlim(-2.5, layout.padded_numel + 2.5)
    ax.set_ylim(-0.8 - 0.35 * n, 1.9)
    ax.axis("off")
    ax.set_title(title or f"one unit: {layout.numel} elements padded to {layout.padded_numel} = {n} x {size}; "
                 f"rank r owns [r S, (r+1) S), S = {size}", fontsize=10)
    return fig
