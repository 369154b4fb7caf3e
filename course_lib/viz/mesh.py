"""The mesh drawn (ranks in node boxes, coloured by their group along one axis) and the planner widget."""

from __future__ import annotations

from typing import ClassVar

import ipywidgets as W
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from course_lib.model_config import PRESETS
from course_lib.planner import search as P
from course_lib.runtime.mesh import MeshShape
from course_lib.viz.panel import ControlPanel, show_figures

_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
            "#CCB974", "#64B5CD"]


def draw_mesh(shape: MeshShape, axes: tuple[str, ...] = ("tp",), gpus_per_node: int = 8,
              ax=None) -> Figure | None:
    """Every rank as a square inside its node's box (node = rank // gpus_per_node), coloured by which group over
    ``axes`` it belongs to, labelled with its id and coordinates."""
    fig = None
    if ax is None:
        fig = Figure(figsize=(min(12, 1.2 * min(shape.world_size, gpus_per_node) + 1.5),
                              1.3 * -(-shape.world_size // gpus_per_node) + 0.8))
        ax = fig.add_subplot()
    groups = shape.all_groups(*axes)
    colour = {r: _COLOURS[i % len(_COLOURS)] for i, g in enumerate(groups) for r in g}
    n_nodes = -(-shape.world_size // gpus_per_node)
    for node in range(n_nodes):
        y = n_nodes - 1 - node
        ax.add_patch(Rectangle((-0.1, y - 0.45), gpus_per_node + 0.2, 0.9, fill=False, lw=1.2, ec="0.3"))
        ax.text(-0.25, y, f"node {node}", ha="right", va="center", fontsize=8)
        for slot in range(gpus_per_node):
            r = node * gpus_per_node + slot
            if r >= shape.world_size:
                break
            c = shape.coords(r)
            ax.add_patch(Rectangle((slot + 0.05, y - 0.35), 0.9, 0.7, color=colour[r]))
            label = " ".join(f"{a}{c[a]}" for a in ("dp", "cp", "tp", "pp") if shape.size(a) > 1)
            ax.text(slot + 0.5, y + 0.12, f"r{r}", ha="center", va="center", fontsize=8, color="white",
                    weight="bold")
            ax.text(slot + 0.5, y - 0.15, label, ha="center", va="center", fontsize=6, color="white")
    ax.set_xlim(-1.6, gpus_per_node + 0.2)
    ax.set_ylim(-0.6, n_nodes - 0.4)
    ax.axis("off")
    ax.set_title(f"{'+'.join(axes)} groups (one colour each), order {shape.order}", fontsize=9)
    return fig


def draw_plan(result: P.PlanResult, top: int = 8, ax=None) -> Figure | None:
    """Predicted step time of the best candidates, stacked by where the time goes."""
    fig = None
    if ax is None:
        fig = Figure(figsize=(10, 0.45 * top + 1.4), layout="constrained")
        ax = fig.add_subplot()
    preds = result.ranked[:top][::-1]
    parts = ["compute", "tp", "cp", "ep", "pp_bubble", "pp_p2p", "dp"]
    left = [0.0] * len(preds)
    for i, part in enumerate(parts):
        vals = [p.seconds[part] for p in preds]
        ax.barh(range(len(preds)), vals, left=left, color=_COLOURS[i], label=part)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.set_yticks(range(len(preds)), [str(p.candidate) for p in preds], fontsize=7)
    ax.set_xlabel("predicted seconds per step (model, not measured)")
    ax.legend(fontsize=7, ncol=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return fig


class PlannerWidget(ControlPanel):
    """Model preset, cluster, nodes, global batch and sequence -> the ranked meshes, their time bars and the
    best mesh drawn. A smaller search than ``planner.plan``'s default keeps it interactive."""

    SPACE: ClassVar[dict[str, tuple]] = dict(zero_stages=(1, 3), recomputes=("selective", "full"), micro_batches=(1, 2),
                                             schedules=("1f1b", "interleaved"), virtual_stages=(2,))

    def __init__(self, model: str = "llama3-70b", cluster: str = "dgx-h100", nodes: int = 64,
                 global_batch: int = 64, seq_len: int = 32768) -> None:
        self.controls = {
            "model": W.Dropdown(options=sorted(PRESETS), value=model, description="model"),
            "cluster": W.Dropdown(options=sorted(P.CLUSTERS), value=cluster, description="cluster"),
            "nodes": W.BoundedIntText(value=nodes, min=1, max=1024, description="nodes"),
            "global_batch": W.BoundedIntText(value=global_batch, min=1, max=65536, description="batch (seqs)",
                                             style={"description_width": "initial"}),
            "seq_len": W.Dropdown(options=[2048, 4096, 8192, 16384, 32768, 131072], value=seq_len,
                                  description="sequence"),
        }
        self.result: P.PlanResult | None = None
        self.message = ""
        self._out = W.HTML()
        self._img = W.Image(format="png")
        self._mesh = W.Image(format="png")
        super().__init__([W.HBox(list(self.controls.values())[:3]), W.HBox(list(self.controls.values())[3:]),
                          self._out, self._img, self._mesh])
        self.add_class("course-planner")
        self._watch()
        self.update()

    def update(self) -> None:
        v = self.values()
        try:
            cl = P.cluster(v["cluster"], v["nodes"])
            self.result = P.plan(v["model"], cl, v["global_batch"], v["seq_len"], **self.SPACE)
        except ValueError as e:
            self.result, self.message = None, f"invalid: {e}"
        else:
            r = self.result
            self.message = (f"{r.considered} valid meshes, {r.rejected_memory} do not fit in memory, "
                            f"{len(r.ranked)} ranked")
            if r.ranked:
                best = r.ranked[0]
                self.message += f"; best: {best.candidate} (MFU {best.mfu:.0%}; {'; '.join(best.reasons)})"
            else:
                self.message += f"; {r.message}"
        self._out.value = f"<pre>{self.message}</pre>"
        plot = draw_plan(self.result) if self.result and self.result.ranked else None
        best = self.result.ranked[0].candidate if plot else None
        mesh = draw_mesh(best.shape, ("tp",), cl.gpus_per_node) if best and best.shape.world_size <= 64 else None
        show_figures((self._img, plot), (self._mesh, mesh))

    @property
    def text(self) -> str:
        return self.message
