"""The model cut into pipeline stages, as a picture: which layers each rank holds and what crosses each cut.

:func:`plot_stage_cut` is pure (numbers in, a matplotlib ``Figure`` out). One box per layer, left to right in the
order of the forward pass: the embeddings, every transformer block, then the final norm + LM head + loss; each
box coloured by the stage that holds it and labelled with the stage and its rank underneath. At every cut between
two stages two arrows say what crosses it per micro-batch: the activation forward (above) and its gradient
backward (below), both of shape [b, s, h] -- nothing else travels between stages (GPipe, Huang et al. 2019).
``ax.patches`` holds the layer boxes first (one per layer, in order), so a test can count them and read their
colours.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

__all__ = ["STAGE_COLORS", "plot_stage_cut"]

STAGE_COLORS = ("#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc", "#fc9272", "#c7e9c0", "#fdd0a2", "#dadaeb")


def plot_stage_cut(split: Sequence[int], *, shape: tuple[int, int, int], ranks: Sequence[int] | None = None,
                   title: str | None = None) -> Figure:
    """Draw ``sum(split)`` blocks cut into ``len(split)`` stages (stage k holds ``split[k]`` blocks; the first
    also the embeddings, the last the final norm, the head and the loss). ``shape`` = (b, s, h) of the tensor
    that crosses each cut; ``ranks[k]`` is the rank of stage k (default: rank k)."""
    if not split or any(not isinstance(n, int) or n < 1 for n in split):
        raise ValueError(f"split must be positive block counts, one per stage, got {list(split)}")
    ranks = list(range(len(split))) if ranks is None else list(ranks)
    if len(ranks) != len(split):
        raise ValueError(f"{len(split)} stages but {len(ranks)} ranks")
    owner = [k for k, n in enumerate(split) for _ in range(n)]  # the stage of each block
    layers = [("embed", 0)] + [(f"block\n{i}", k) for i, k in enumerate(owner)]
    layers.append(("norm\nhead\nloss", len(split) - 1))
    fig = Figure(figsize=(max(7.0, 0.8 * len(layers) + 1), 2.6), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, k) in enumerate(layers):
        ax.add_patch(FancyBboxPatch((i + 0.06, 0.0), 0.88, 1.0, boxstyle="round,pad=0.0,rounding_size=0.08",
                                    facecolor=STAGE_COLORS[k % len(STAGE_COLORS)], edgecolor="#333333", lw=0.8))
        ax.text(i + 0.5, 0.5, name, ha="center", va="center", fontsize=8)
    b, s, h = shape
    for k in range(len(split)):
        held = [i for i, (_, kk) in enumerate(layers) if kk == k]
        start, end = held[0], held[-1]
        ax.text((start + end + 1) / 2, -0.22, f"stage {k} on rank {ranks[k]}", ha="center", va="top", fontsize=9,
                fontweight="bold")
        if k < len(split) - 1:
            x = end + 1
            ax.axvline(x, ymin=0.12, ymax=0.88, color="#b30000", ls="--", lw=1.2)
            ax.annotate("", xy=(x + 0.45, 1.25), xytext=(x - 0.45, 1.25),
                        arrowprops={"arrowstyle": "->", "color": "#08519c", "lw": 1.5})
            ax.annotate("", xy=(x - 0.45, -0.62), xytext=(x + 0.45, -0.62),
                        arrowprops={"arrowstyle": "->", "color": "#a63603", "lw": 1.5})
            ax.text(x, 1.38, f"activation [{b}, {s}, {h}]", ha="center", va="bottom", fontsize=8, color="#08519c")
            ax.text(x, -0.75, f"its gradient [{b}, {s}, {h}]", ha="center", va="top", fontsize=8, color="#a63603")
    ax.set_xlim(-0.2, len(layers) + 0.2)
    ax.set_ylim(-1.15, 1.75)
    ax.axis("off")
    ax.set_title(title or f"{sum(split)} blocks cut into {len(split)} stages: forward left to right, per micro-batch",
                 fontsize=10)
    return fig
