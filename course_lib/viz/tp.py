"""Tensor parallelism as pictures: communication per layer and per step against t, and where TP turns
communication-bound, for a training step and for a decode step.

* **Training** (pure): :func:`tp_layer_cost` models one transformer block's training step on one rank of a TP
  group of t: compute ``6 P_block n / t + 12 h s n / t`` FLOPs at ``peak x mfu`` (Kaplan et al. 2020; PaLM's
  attention term, ``cost.training_flops_per_token``) against the 4 all-reduces of V = n h e bytes (SP: 4
  all-gathers + 4 reduce-scatters, the same bytes, + 2 all-gathers that re-gather the saved s/t inputs in
  backward; no overlap modelled) in the alpha-beta model (``cost.collective_time``), n = tokens per device.
  Thousands of tokens per weight read keep a training step compute-bound, so memory reads are not modelled
  there. The bandwidth terms both grow with n, so their ratio does not depend on it:

      compute / comm  ~=  6 P_block B / (8 (t-1) h e F)         (~ 9 h B / ((t-1) e F) for a GPT block, f = 4h)

  with B the link bandwidth and F the achieved FLOP/s: TP is communication-bound once (t-1) passes ~9hB/(eF),
  whatever the batch. Communication is counted as not overlapped with compute.
* **Decode** (pure): :func:`tp_decode_cost` prices one decode step (one new token per sequence, forward only) as
  chapter 09 does (``serving.budget.predict``): a roofline, max(FLOPs / peak, (weights + KV cache) / memory
  bandwidth), plus 2 all-reduces per block of batch x h x 2 bytes, NCCL's ring or the small-message kernels of
  serving engines; shown per block as the whole model's step / L (embeddings included).
* **Figure and widget**: :func:`plot_tp_cost` draws compute, memory and communication time per layer against t and
  the bytes per rank per step; :class:`TPCostWidget` (:func:`tp_cost_widget`) wires the step, model, link, GPU,
  tokens per device (decode: sequences), context, all-reduce and SP to it and checks the rule of thumb of the
  Ultra-Scale Playbook summaries ("TP 2-8 inside a node; over PCIe at most 2") against the model. The bytes are
  *modelled* (ring formula), not measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ipywidgets as W
from matplotlib.figure import Figure

from course_lib.estimates import hardware
from course_lib.estimates.cost import collective_bytes_per_rank, collective_time, training_flops_per_token
from course_lib.estimates.hardware import Link
from course_lib.estimates.memory_budget import format_bytes
from course_lib.model_config import PRESETS, GPTConfig, block_params
from course_lib.serving.budget import predict
from course_lib.viz.comm import format_seconds
from course_lib.viz.panel import ControlPanel, figure_png

__all__ = ["CONTROL_DESCRIPTIONS", "DEGREES", "TPCostWidget", "TPLayerCost", "largest_compute_bound_t",
           "plot_tp_cost", "rule_of_thumb", "tp_cost_widget", "tp_decode_cost", "tp_layer_cost"]

DEGREES = (1, 2, 4, 8, 16, 32)
MODELS = tuple(name for name, c in PRESETS.items() if name != "tiny" and not c.n_expert)
CONTROL_DESCRIPTIONS = {"step": "step", "model": "model", "link": "TP link", "gpu": "GPU",
                        "tokens": "tokens per device (decode: sequences)", "context": "decode: KV tokens a sequence",
                        "allreduce": "decode all-reduce", "mfu": "MFU", "sequence_parallel": "sequence parallel"}
ALLREDUCE = {"NCCL ring": "ring", "small-message kernels": "best"}
"""The decode step's all-reduce: NCCL's ring at the protocol its tuner picks, or the cheapest of it and the one- and
two-shot kernels of serving engines (``serving.budget.decode_all_reduce_time``)."""
TOKEN_RANGE = (1, 65536)


@dataclass(frozen=True)
class TPLayerCost:
    """One block's step on one rank of a TP group of ``t`` (seconds; bytes this rank sends). ``memory_s``: reading
    the weights and the KV cache (decode; 0 for a training step); ``fits``: the model fits the GPU (decode)."""

    t: int
    valid: bool  # t divides n_head
    compute_s: float
    comm_s: float
    bytes_per_rank: float
    collectives: int
    memory_s: float = 0.0
    fits: bool = True

    @property
    def work_s(self) -> float:
        """The roofline: the slower of computing and reading memory."""
        return max(self.compute_s, self.memory_s)

    @property
    def comm_bound(self) -> bool:
        return self.t > 1 and self.comm_s > self.work_s

    @property
    def bound(self) -> str:
        return "comm-bound" if self.comm_bound else "memory-bound" if self.memory_s > self.compute_s else \
            "compute-bound"


def tp_layer_cost(cfg: GPTConfig, tokens: int, t: int, link: Link, peak_flops: float, mfu: float = 0.5,
                  element_bytes: int = 2, sequence_parallel: bool = False) -> TPLayerCost:
    """The modelled cost of one block at TP degree t (see the module docstring)."""
    if tokens < 1 or t < 1:
        raise ValueError(f"tokens and t must be >= 1, got {tokens}, {t}")
    flops = training_flops_per_token(block_params(cfg), 1, cfg.d_model, cfg.seq_len) * tokens / t
    v = tokens * cfg.d_model * element_bytes
    if t == 1:
        comm, sent, calls = 0.0, 0.0, 0
    elif sequence_parallel:  # + the backward re-gathers of the two regions' saved s/t inputs
        comm = 6 * collective_time("all_gather", v, t, link.alpha, link.beta) \
            + 4 * collective_time("reduce_scatter", v, t, link.alpha, link.beta)
        sent = 6 * collective_bytes_per_rank("all_gather", v, t) + 4 * collective_bytes_per_rank("reduce_scatter", v, t)
        calls = 10
    else:
        comm = 4 * collective_time("all_reduce", v, t, link.alpha, link.beta)
        sent, calls = 4 * collective_bytes_per_rank("all_reduce", v, t), 4
    return TPLayerCost(t, cfg.n_head % t == 0, flops / (peak_flops * mfu), comm, sent, calls)


def tp_decode_cost(model: str, t: int, link: str, gpu: str, batch: int = 1, context: int = 4096,
                   allreduce: str = "best") -> TPLayerCost:
    """One decode step of ``batch`` sequences of ``context`` tokens on one rank of t, per block: chapter 09's
    ``serving.budget.predict`` (a roofline of FLOPs and weight + KV reads, plus 2 all-reduces a block of
    batch x h x 2 bytes by ``allreduce``: "ring" or "best"), each term divided by the model's L blocks."""
    cfg = PRESETS[model]
    if cfg.n_head % t:
        return TPLayerCost(t, False, 0.0, 0.0, 0.0, 0)
    p = predict(model, gpu, batch=batch, context=context, tp=t, link=link, allreduce=allreduce)
    v, layers = batch * cfg.d_model * 2, cfg.n_layer
    sent = 2 * collective_bytes_per_rank("all_reduce", v, t) if t > 1 else 0.0
    return TPLayerCost(t, True, p.compute_s / layers, p.comm_s / layers, sent, 2 * (t > 1), p.memory_s / layers,
                       p.fits)


def rule_of_thumb(link: Link) -> tuple[int, str]:
    """The largest t the rule of thumb allows on ``link``: 8 over NVLink (TP 2-8 inside a node), 2 over PCIe,
    1 over a network (keep TP inside the node)."""
    if "NVLink" in link.name:
        return 8, "TP 2-8 inside a node"
    if "PCIe" in link.name:
        return 2, "over PCIe at most 2"
    return 1, "keep TP inside the node"


def largest_compute_bound_t(costs: list[TPLayerCost]) -> int:
    """The largest valid t whose communication stays at or below its compute (1 if none)."""
    ok = [c.t for c in costs if c.valid and not c.comm_bound]
    return max(ok) if ok else 1


def plot_tp_cost(costs: list[TPLayerCost], cfg: GPTConfig, link: Link, tokens: int, n_layer: int | None = None,
                 title: str = "") -> Figure:
    """Left: compute and communication time of one block per rank against t (log scale). Right: bytes one rank
    sends per training step (all layers, modelled ring bytes) against t."""
    fig = Figure(figsize=(10.5, 3.8), layout="constrained")
    ax, bx = fig.subplots(1, 2, width_ratios=(3, 2))
    xs = list(range(len(costs)))
    valid = [c for c in costs if c.valid] or costs
    series = [("compute (model FLOPs / achieved FLOP/s)", [c.compute_s for c in costs], "#4C72B0")]
    if any(c.memory_s for c in costs):
        series.append(("memory reads (weights + KV cache / bandwidth)", [c.memory_s for c in costs], "#55A868"))
    series.append((f"TP communication over {link.name} (modelled)", [c.comm_s for c in costs], "#DD8452"))
    w = 0.8 / len(series)
    for k, (label, values, color) in enumerate(series):
        ax.bar([x + (k - (len(series) - 1) / 2) * w for x in xs], [max(v, 1e-9) for v in values], w, label=label,
               color=color)
    shown = [v for c in valid for v in (c.compute_s, c.memory_s, c.comm_s) if v > 0] or [1e-6]
    for x, c in zip(xs, costs, strict=True):
        if not c.valid:
            ax.text(x, min(shown) * 0.9, "t does not\ndivide n_head", ha="center", va="top", fontsize=7, color="gray")
        elif c.comm_bound:
            ax.text(x, max(c.comm_s, c.work_s) * 1.15, "comm-bound", ha="center", va="bottom", fontsize=7,
                    color="#C44E52")
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"t={c.t}" for c in costs])
    ax.set_ylabel("seconds per block and step, one rank")
    ax.set_ylim(min(shown) / 3, max(shown) * 4)
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(f"{cfg.name}: {tokens} tokens per device", fontsize=9)
    layers = n_layer if n_layer is not None else cfg.n_layer
    per_step = [layers * c.bytes_per_rank / 1e9 for c in costs]
    bx.bar(xs, per_step, 0.6, color="#DD8452")
    for x, b in zip(xs, per_step, strict=True):
        bx.text(x, b, f"{b:.3g}", ha="center", va="bottom", fontsize=7)
    bx.set_xticks(xs, [str(c.t) for c in costs])
    bx.set_xlabel("TP degree t")
    bx.set_ylabel("GB sent per rank per step (modelled)")
    bx.set_title(f"{layers} blocks x 4 collectives of b*s*h", fontsize=9)
    bx.set_ylim(0, max([*per_step, 1e-9]) * 1.2)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


class TPCostWidget(ControlPanel):
    """Controls (step, model, link, GPU, tokens per device, context, all-reduce, MFU, SP), a verdict per t and the
    figure. The step: "training" (``tp_layer_cost``) or "decode" (``tp_decode_cost``: ``tokens`` sequences of
    ``context`` tokens, one new token each).

    From code: ``w.set(link="PCIe 4.0 x16", tokens=4096)`` returns ``w.text``; ``w.costs`` the modelled costs,
    ``w.largest_t`` the largest t that is not communication-bound.
    """

    def __init__(self, model: str = "llama3-70b", link: str = "NVLink 4 (H100)", gpu: str = "H100 80GB",
                 tokens: int = 4096, mfu: float = 0.5, sequence_parallel: bool = False, step: str = "training",
                 context: int = 4096, allreduce: str = "small-message kernels", draw: bool = True) -> None:
        super().__init__()
        self._draw = draw
        d, style = CONTROL_DESCRIPTIONS, {"description_width": "initial"}
        self.controls: dict[str, Any] = {
            "step": W.Dropdown(options=["training", "decode"], value=step, description=d["step"], style=style),
            "model": W.Dropdown(options=list(MODELS), value=model, description=d["model"], style=style),
            "link": W.Dropdown(options=list(hardware.LINKS), value=link, description=d["link"], style=style),
            "gpu": W.Dropdown(options=list(hardware.GPUS), value=gpu, description=d["gpu"], style=style),
            "tokens": W.Dropdown(options=[2 ** k for k in range(17)], value=tokens, description=d["tokens"],
                                 style=style),
            "context": W.Dropdown(options=[2 ** k for k in range(9, 18)], value=context, description=d["context"],
                                  style=style),
            "allreduce": W.Dropdown(options=list(ALLREDUCE), value=allreduce, description=d["allreduce"],
                                    style=style),
            "mfu": W.FloatSlider(value=mfu, min=0.1, max=0.8, step=0.05, description=d["mfu"], style=style,
                                 continuous_update=False),
            "sequence_parallel": W.Checkbox(value=sequence_parallel, description=d["sequence_parallel"]),
        }
        c = self.controls
        self.result = W.HTML()
        self.table = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(max_width="820px"))
        self.children = [W.HBox([c["step"], c["model"], c["link"], c["gpu"]], layout=W.Layout(flex_flow="row wrap")),
                         W.HBox([c["tokens"], c["context"], c["allreduce"]], layout=W.Layout(flex_flow="row wrap")),
                         W.HBox([c["mfu"], c["sequence_parallel"]], layout=W.Layout(flex_flow="row wrap")),
                         self.result, self.table, self.image]
        self.add_class("course-tp-cost")
        self.costs: list[TPLayerCost] = []
        self.largest_t = 1
        self._watch()
        self.update()

    def _costs(self) -> list[TPLayerCost]:
        v = self.values()
        if v["step"] == "decode":
            return [tp_decode_cost(v["model"], t, v["link"], v["gpu"], int(v["tokens"]), int(v["context"]),
                                   ALLREDUCE[v["allreduce"]]) for t in DEGREES]
        cfg, link = PRESETS[v["model"]], hardware.link(v["link"])
        peak = hardware.gpu(v["gpu"]).peak_flops
        return [tp_layer_cost(cfg, int(v["tokens"]), t, link, peak, float(v["mfu"]),
                              sequence_parallel=bool(v["sequence_parallel"])) for t in DEGREES]

    def update(self) -> None:
        v = self.values()
        self.costs = self._costs()
        self.largest_t = largest_compute_bound_t(self.costs)
        lines = self.text.split("\n")
        self.result.value = "<br>".join(lines[:2])
        self.table.value = "<pre>" + "\n".join(lines[2:]) + "</pre>"
        if self._draw:
            decode = v["step"] == "decode"
            what = (f"decode: {v['tokens']} sequence(s) of {v['context']} tokens, {v['allreduce']}" if decode else
                    "training step")
            fig = plot_tp_cost(self.costs, PRESETS[v["model"]], hardware.link(v["link"]), int(v["tokens"]),
                               title=f"modelled ({what}): alpha-beta times, no compute/comm overlap")
            self.image.value = figure_png(fig)

    def _head(self) -> list[str]:
        v = self.values()
        cfg, link = PRESETS[v["model"]], hardware.link(v["link"])
        rule, why = rule_of_thumb(link)
        if v["step"] == "decode":
            per_token = {c.t: c.work_s + c.comm_s for c in self.costs if c.valid}
            steps = " -> ".join(f"t={t} {cfg.n_layer * s * 1e3:.1f}" for t, s in per_token.items() if t <= 8)
            return [f"{cfg.name} decode over {link.name}, {v['allreduce']}: {steps} ms per token "
                    f"({v['tokens']} sequence(s) of {v['context']} tokens)",
                    f"not communication-bound up to t={self.largest_t}; from t=2 to 8 TP cuts the step "
                    f"{per_token[2] / per_token[8]:.1f}x (4x would be ideal)" if 2 in per_token and 8 in per_token
                    else f"not communication-bound up to t={self.largest_t}"]
        peak = hardware.gpu(v["gpu"]).peak_flops
        hb = 6 * block_params(cfg) * link.beta / (8 * cfg.d_model * 2 * peak * float(v["mfu"]))
        return [f"{cfg.name} over {link.name}: modelled compute-bound up to t={self.largest_t} "
                f"(bandwidth terms alone: comm = compute at t-1 = {hb:.3g})",
                f"rule of thumb: t <= {rule} ({why}); at {v['tokens']} tokens per device the model "
                + ("allows at least that" if self.largest_t >= rule else f"is stricter: t <= {self.largest_t}")]

    @property
    def text(self) -> str:
        rows = ["   t  sent/layer   comm/layer  compute/layer  memory/layer  verdict"]
        for c in self.costs:
            verdict = "t does not divide n_head" if not c.valid else c.bound + ("" if c.fits else ", does not fit")
            memory = format_seconds(c.memory_s) if c.memory_s else "-"
            rows.append(f"{c.t:>4}  {format_bytes(c.bytes_per_rank, digits=3):>10}  {format_seconds(c.comm_s):>11}  "
                        f"{format_seconds(c.compute_s):>13}  {memory:>12}  {verdict}")
        return "\n".join(self._head() + rows)


def tp_cost_widget(**kwargs: Any) -> TPCostWidget:
    """The TP cost widget (see :class:`TPCostWidget`)."""
    return TPCostWidget(**kwargs)

