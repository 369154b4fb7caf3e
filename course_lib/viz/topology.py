"""Bytes that leave a node, drawn: per axis order, per group, from a run's log next to the prediction; and a widget
that predicts them for a real model and cluster under every axis order (``course_lib.measure.topology``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import ipywidgets as W
from matplotlib.figure import Figure

from course_lib.measure import topology
from course_lib.model_config import PRESETS
from course_lib.runtime.mesh import MeshError, MeshShape
from course_lib.viz.mesh import _COLOURS, draw_mesh
from course_lib.viz.panel import ControlPanel, show_figures

GROUP_COLOURS = {"tp": _COLOURS[0], "dp": _COLOURS[1], "pp": _COLOURS[2]}


def plot_cross_node(bars: Mapping[str, Mapping[str, int]], predicted: Mapping[str, Mapping[str, int]] | None = None,
                    kinds: Mapping[str, str] | None = None, unit: float = 1e3, unit_name: str = "kB",
                    ax=None) -> Figure | None:
    """One cluster of bars per configuration (an axis order), one bar per group: the bytes per step that cross a
    node boundary (``bars[config][group]``); ``predicted`` (same keys) as a black tick on each bar; ``kinds``
    (group -> "measured"/"modelled") in the legend."""
    fig = None
    if ax is None:
        fig = Figure(figsize=(7.5, 3.2), layout="constrained")
        ax = fig.add_subplot()
    configs = list(bars)
    groups = sorted({g for b in bars.values() for g in b})
    width = 0.8 / max(len(groups), 1)
    for k, g in enumerate(groups):
        xs = [i + (k - (len(groups) - 1) / 2) * width for i in range(len(configs))]
        label = f"{g} ({kinds[g]})" if kinds and g in kinds else g
        ax.bar(xs, [bars[c].get(g, 0) / unit for c in configs], width, label=label,
               color=GROUP_COLOURS.get(g, _COLOURS[(3 + k) % len(_COLOURS)]))
        if predicted is not None:
            ax.scatter(xs, [predicted[c].get(g, 0) / unit for c in configs], marker="_", s=900 * width, color="k",
                       zorder=3, label="predicted" if k == 0 else None)
    ax.set_xticks(range(len(configs)), configs, fontsize=8)
    ax.set_ylabel(f"{unit_name} per step across nodes")
    ax.legend(fontsize=7, frameon=False)
    return fig


class TopologyWidget(ControlPanel):
    """Model preset, gpus per node, tp / pp / dp, batch and sequence -> the bytes per step that leave a node under
    each axis order in ``ORDERS`` (predicted, bf16 messages, one micro-batch of one sequence at a time), in all and
    on the busiest GPU of each group (what the ring's slowest hop carries), and the TP groups of the chosen order
    drawn in their nodes."""

    ORDERS: ClassVar[tuple[str, ...]] = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "dp-tp-cp-ep-pp", "pp-dp-tp-cp-ep")

    def __init__(self, model: str = "llama2-7b", gpus_per_node: int = 8, tp: int = 8, pp: int = 1, dp: int = 2,
                 global_batch: int = 16, seq_len: int = 4096, order: str = "tp-cp-ep-dp-pp") -> None:
        degrees = [1, 2, 4, 8, 16]
        self.controls = {
            "model": W.Dropdown(options=sorted(PRESETS), value=model, description="model"),
            "order": W.Dropdown(options=list(self.ORDERS), value=order, description="order"),
            "gpus_per_node": W.Dropdown(options=[2, 4, 8], value=gpus_per_node, description="GPUs/node"),
            "tp": W.Dropdown(options=degrees, value=tp, description="tp"),
            "pp": W.Dropdown(options=degrees, value=pp, description="pp"),
            "dp": W.Dropdown(options=degrees, value=dp, description="dp"),
            "global_batch": W.BoundedIntText(value=global_batch, min=1, max=4096, description="batch (seqs)"),
            "seq_len": W.Dropdown(options=[1024, 2048, 4096, 8192], value=seq_len, description="sequence"),
        }
        self.crossing: dict[str, dict[str, int]] = {}
        self.message = ""
        self._out = W.HTML()
        self._img = W.Image(format="png")
        self._mesh = W.Image(format="png")
        ctl = list(self.controls.values())
        super().__init__([W.HBox(ctl[:3]), W.HBox(ctl[3:6]), W.HBox(ctl[6:]), self._out, self._img, self._mesh])
        self._watch()
        self.update()

    def update(self) -> None:
        v = self.values()
        cfg = PRESETS[v["model"]].with_(seq_len=v["seq_len"])
        shape = MeshShape(dp=v["dp"], tp=v["tp"], pp=v["pp"], order=v["order"])
        try:
            shape.validate(cfg, global_batch=v["global_batch"])
            topology.nodes(shape.world_size, v["gpus_per_node"])
            m = v["global_batch"] // v["dp"]
            flows = {o: topology.predicted_flows(cfg, MeshShape(dp=v["dp"], tp=v["tp"], pp=v["pp"], order=o),
                                                 v["global_batch"], microbatches=m, element_bytes=2)
                     for o in self.ORDERS}
        except (MeshError, ValueError) as e:
            self.crossing, self.message = {}, f"invalid: {e}"
        else:
            self.crossing = {o: topology.cross_node_bytes(f, v["gpus_per_node"]) for o, f in flows.items()}
            busiest = topology.busiest_rank_bytes(flows[v["order"]], v["gpus_per_node"])
            n = shape.world_size
            self.message = (f"{n} GPUs on {n // v['gpus_per_node']} nodes; {v['order']}: bytes per step across "
                            "nodes (predicted), all GPUs: "
                            + ", ".join(f"{g} {b / 1e9:.1f} GB" for g, b in sorted(self.crossing[v["order"]].items()))
                            + "; the busiest GPU of each group: "
                            + ", ".join(f"{g} {b / 1e9:.1f} GB" for g, b in sorted(busiest.items())))
        self._out.value = f"<pre>{self.message}</pre>"
        plot = plot_cross_node(self.crossing, unit=1e9, unit_name="GB") if self.crossing else None
        mesh = draw_mesh(shape, ("tp",), v["gpus_per_node"]) if plot and shape.world_size <= 32 else None
        show_figures((self._img, plot), (self._mesh, mesh))

    @property
    def text(self) -> str:
        return self.message
