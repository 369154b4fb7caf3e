"""The memory budget per GPU, as a picture: a stacked bar by category against the memory of common GPUs.

Two layers, as every module of ``course_lib.viz``:

* :func:`plot_budget` is pure: budgets (bytes by category, e.g. :func:`course_lib.estimates.memory.training_memory`) in,
  a matplotlib ``Figure`` out. One stacked bar per budget, one segment per category (drawn even when it is 0,
  so every bar has the same segments), horizontal lines at the capacity of common GPUs, and the verdict
  "fits" / "does not fit" on a chosen GPU above each bar.
* :func:`memory_budget_widget` wires ipywidgets controls (model preset or sizes, precision, optimizer, batch,
  sequence, recomputation, ZeRO stage, DP/TP/PP/CP/EP degrees, training or inference, target GPU) to
  :func:`course_lib.estimates.memory.training_memory` / :func:`course_lib.estimates.memory.inference_memory` and
  redraws. :meth:`MemoryBudgetWidget.set` changes controls from code and returns the text the widget shows, so a test
  (or a notebook cell whose output nbval checks) can drive it without a browser. Every control has a stable
  ``description`` (listed in ``CONTROL_DESCRIPTIONS``) for browser tests.

GPU capacities come from the hardware catalogue (``course_lib.estimates.hardware.GPUS``): vendors' "80GB" of HBM is
80 GiB, so the lines sit at the nominal size x 2^30 bytes, printed in decimal GB like every other number of the
course (80 GiB = 85.9 GB). What a program can really allocate is a little less (the CUDA context, NCCL's own
buffers, and what the driver keeps); the budgets' "headroom" category stands for that and for the allocator's
fragmentation.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import ipywidgets as W
from matplotlib.figure import Figure

from course_lib.estimates import hardware
from course_lib.estimates.hardware import GPU, GPUS
from course_lib.estimates.layout import ParallelLayout
from course_lib.estimates.memory import inference_memory, training_memory
from course_lib.estimates.memory_budget import GB, GiB, MemoryBudget
from course_lib.model_config import PRESETS, GPTConfig
from course_lib.viz.panel import ControlPanel, figure_png

__all__ = [
    "CATEGORY_COLORS",
    "CONTROL_DESCRIPTIONS",
    "MemoryBudgetWidget",
    "budget_for",
    "memory_budget_widget",
    "plot_budget",
    "verdict",
]


# ----------------------------------------------------------------------------------------------------------------
# GPUs and the verdict


def verdict(budget: Mapping[str, float], gpu: str | GPU = "H100 80GB") -> tuple[bool, str]:
    """(fits, text): does ``budget`` (bytes per GPU, headroom included) fit in ``gpu``, and by how much.

    "fits on H100 80GB: 61.68 GB of 85.90 GB, 24.22 GB to spare" or
    "does not fit on H100 80GB: needs 1810.5 GB, 21.1x its 85.90 GB".
    """
    g = hardware.gpu(gpu)
    total = float(sum(budget.values()))
    if total <= g.bytes:
        return True, f"fits on {g.name}: {total / GB:.2f} GB of {g.gb:.2f} GB, {(g.bytes - total) / GB:.2f} GB to spare"
    return False, (f"does not fit on {g.name}: needs {total / GB:.2f} GB, {total / g.bytes:.1f}x its {g.gb:.2f} GB "
                   f"({(total - g.bytes) / GB:.2f} GB over)")


# ----------------------------------------------------------------------------------------------------------------
# The plot

CATEGORY_COLORS: dict[str, str] = {
    # training (course_lib.estimates.memory.TRAINING_CATEGORIES)
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer_state": "#C44E52",
    "activations": "#55A868",
    "temporary": "#8172B3",
    "communication": "#937860",
    "headroom": "#BBBBBB",
    # inference (INFERENCE_CATEGORIES)
    "weights": "#4C72B0",
    "kv_cache": "#55A868",
    "workspace": "#8172B3",
    # the tracker's leftover (course_lib.measure.memtrack.TRACKER_CATEGORIES)
    "other": "#8C8C8C",
}

_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0))


def _unit_for(n: float) -> tuple[str, float]:
    return next(((u, f) for u, f in _UNITS if n >= f), ("B", 1.0))


def plot_budget(budgets: Mapping[str, float] | Mapping[str, Mapping[str, float]], *,
                gpus: Sequence[str | GPU] | None = None, target: str | GPU | None = "H100 80GB",
                unit: str | None = None, title: str | None = None, figsize: tuple[float, float] = (8.0, 4.5)
                ) -> Figure:
    """Stacked bars of bytes by category, one bar per budget, against GPU capacities.

    ``budgets``: one budget (a :class:`~course_lib.estimates.memory_budget.MemoryBudget` or any {category: bytes}) or
    several ({bar label: budget}, e.g. {"estimate": est, "measured": dict(mt.category_peaks)}). Every bar gets one
    segment per category of the union of all budgets, in order; ``ax.containers[i]`` holds category ``i``'s
    segments and its label is the category name. ``gpus``: capacity lines (default: every GPU of ``hardware.GPUS``;
    ``()`` for none, e.g. for the tiny model). ``target``: the GPU of the verdict written above each bar
    (``None`` for none). ``unit``: "GB", "MB", ... (default: GB when GPUs are drawn, else picked from the
    largest bar). Uses ``matplotlib.figure.Figure`` directly: no pyplot state, nothing shown by itself.
    """
    if not budgets:
        raise ValueError("nothing to plot: the budget is empty")
    if all(isinstance(v, Mapping) for v in budgets.values()):
        bars: dict[str, Mapping[str, float]] = dict(budgets)  # type: ignore[arg-type]
    else:
        bars = {"per GPU": budgets}  # type: ignore[dict-item]
    gpu_list = [hardware.gpu(g) for g in (GPUS.values() if gpus is None else gpus)]
    tgt = hardware.gpu(target) if (target is not None and gpu_list) else None
    cats: list[str] = []
    for b in bars.values():
        cats += [k for k in b if k not in cats]
    totals = [float(sum(b.values())) for b in bars.values()]
    top = max(totals + [g.bytes for g in gpu_list])
    if unit is None:
        unit, scale = ("GB", GB) if gpu_list else _unit_for(max(totals))
    else:
        scale = dict(_UNITS).get(unit) or {"GiB": GiB, "MiB": 2**20, "KiB": 2**10}[unit]

    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    x = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    for cat in cats:
        heights = [b.get(cat, 0.0) / scale for b in bars.values()]
        ax.bar(x, heights, bottom=bottom, width=0.55, label=cat, color=CATEGORY_COLORS.get(cat),
               edgecolor="white", linewidth=0.5)
        bottom = [bo + h for bo, h in zip(bottom, heights, strict=True)]
    by_size: dict[float, list[GPU]] = {}
    for g in gpu_list:  # GPUs of the same size share one line (A100 80GB and H100 80GB)
        by_size.setdefault(g.bytes, []).append(g)
    for size, group in by_size.items():
        is_tgt = tgt is not None and tgt.bytes == size
        style = dict(color="black", lw=1.6, ls="-") if is_tgt else dict(color="dimgray", lw=0.8, ls="--")
        ax.axhline(size / scale, **style)  # type: ignore[arg-type]
        ax.annotate(f"{' / '.join(g.name for g in group)}: {size / GB:.1f} GB", xy=(0.995, size / scale),
                    xycoords=("axes fraction", "data"), xytext=(0, 1.5), textcoords="offset points", ha="right",
                    va="bottom", fontsize=7, fontweight="bold" if is_tgt else "normal")
    if tgt is not None:
        for xi, b, tot in zip(x, bars.values(), totals, strict=True):
            fits, _ = verdict(b, tgt)
            text = (f"fits\n{(tgt.bytes - tot) / GB:.1f} GB to spare" if fits
                    else f"does not fit\n{tot / tgt.bytes:.1f}x {tgt.name}")
            ax.annotate(text, xy=(xi, tot / scale), xytext=(0, 3), textcoords="offset points", ha="center",
                        va="bottom", fontsize=8, color="darkgreen" if fits else "darkred", fontweight="bold")
    ax.set_xticks(x, list(bars))
    ax.set_xlim(-0.6, len(bars) - 0.4 + (0.5 if gpu_list else 0.0))  # room for the GPU names on the right
    ax.set_ylim(0, top / scale * 1.18)
    ax.set_ylabel(f"memory per GPU ({unit})")
    handles, labels = ax.get_legend_handles_labels()  # top of the stack first, as drawn
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title.replace(" | ", "\n", 1) if len(title) > 70 else title, fontsize=8)
    return fig


# ----------------------------------------------------------------------------------------------------------------
# One function from control values to a budget (what the widget calls; also handy on its own)

PRECISION_OPTIONS = {  # label -> (precision policy, fp32 gradient accumulation)
    "mixed bf16 (fp32 master + Adam states)": ("mixed", False),
    "mixed bf16 + fp32 grad accumulation": ("mixed", True),
    "pure bf16": ("bf16", False),
    "fp32": ("fp32", False),
}
WEIGHT_OPTIONS = {"bf16 (2 B)": 2.0, "fp8 / int8 (1 B)": 1.0, "int4 (0.5 B)": 0.5}
KV_OPTIONS = {"bf16 (2 B)": 2.0, "fp8 (1 B)": 1.0}

SIZE_FIELDS = ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "vocab_size", "n_expert", "top_k")


def budget_for(config: GPTConfig | str, *, mode: str = "training", precision: str = "mixed",
               fp32_grad_accum: bool = False, optimizer: str = "adamw", batch: int = 1, seq_len: int | None = None,
               recompute: str = "none", zero_stage: int = 0, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1,
               ep: int = 1, sp: bool = False, weight_bytes: float = 2.0, kv_bytes: float = 2.0) -> MemoryBudget:
    """The budget the widget shows, from plain values: training -> :func:`training_memory` with a
    :class:`ParallelLayout` (its default activations: flash attention, no s x s scores); inference ->
    :func:`inference_memory` (DP replicas, CP, ZeRO and the optimizer do not change what one serving GPU holds).
    Raises ``ValueError`` for an invalid model or layout."""
    c = PRESETS[config] if isinstance(config, str) else config
    s = seq_len or c.seq_len
    if c.pos == "learned" and s > c.seq_len:  # a longer sequence needs a longer position table
        c = c.with_(seq_len=s)
    if mode == "training":
        layout = ParallelLayout(dp=dp, zero_stage=zero_stage, tp=tp, sp=sp, pp=pp, cp=cp, ep=ep)
        return training_memory(c, precision=precision, optimizer=optimizer,  # type: ignore[arg-type]
                               fp32_grad_accum=fp32_grad_accum, micro_batch=batch, seq_len=s,
                               recompute=recompute, layout=layout)  # type: ignore[arg-type]
    if mode == "inference":
        return inference_memory(c, batch=batch, context_len=s, weight_bytes_per_param=weight_bytes,
                                kv_bytes=kv_bytes, tp=tp, pp=pp, ep=ep)
    raise ValueError(f"mode must be 'training' or 'inference', got {mode!r}")


# ----------------------------------------------------------------------------------------------------------------
# The widget

CONTROL_DESCRIPTIONS: dict[str, str] = {
    "model": "model", "mode": "mode", "gpu": "GPU",
    "n_layer": "layers", "d_model": "d_model", "n_head": "heads", "n_kv_head": "KV heads", "d_ff": "d_ff",
    "vocab_size": "vocab", "n_expert": "experts", "top_k": "top-k",
    "precision": "precision", "optimizer": "optimizer", "recompute": "recompute",
    "batch": "batch", "seq_len": "sequence",
    "zero_stage": "ZeRO stage", "dp": "DP", "tp": "TP", "pp": "PP", "cp": "CP", "ep": "EP", "sp": "SP",
    "weight_bytes": "weights", "kv_bytes": "KV cache",
}
"""Control name (for :meth:`MemoryBudgetWidget.set`) -> the ``description`` shown next to it (stable)."""

_TRAINING_ONLY = ("precision", "optimizer", "recompute", "zero_stage", "dp", "cp", "sp")
_INFERENCE_ONLY = ("weight_bytes", "kv_bytes")
_POW2 = [2**i for i in range(13)]


class MemoryBudgetWidget(ControlPanel):
    """An ipywidgets container: controls, then the verdict, the stacked bar and the budget table.

    From code: ``w.set(zero_stage=3, dp=64)`` sets controls (one redraw) and returns ``w.text``; ``w.budget`` is the
    current :class:`MemoryBudget` (None when the settings are invalid), ``w.fits`` the verdict as a bool,
    ``w.controls`` {name: control widget} with the names of ``CONTROL_DESCRIPTIONS``.
    """

    def __init__(self, model: str = "llama2-70b", mode: str = "training", gpu: str = "H100 80GB",
                 draw: bool = True, **values: Any) -> None:
        super().__init__()
        self._draw = draw
        self.budget: MemoryBudget | None = None
        self.fits: bool | None = None
        self.verdict_text = ""
        self.config: GPTConfig | None = None
        style = {"description_width": "initial"}
        d = CONTROL_DESCRIPTIONS

        def drop(name: str, options: Any, value: Any, width: str = "auto") -> Any:
            return W.Dropdown(options=options, value=value, description=d[name], style=style,
                              layout=W.Layout(width=width))

        def num(name: str, value: int, width: str = "150px") -> Any:  # unbounded: 0 or -5 shows the error
            return W.IntText(value=value, description=d[name], style=style, layout=W.Layout(width=width))

        names = [*[k for k in PRESETS if k != "tiny"], "tiny", "custom"]
        c0 = PRESETS[model] if model in PRESETS else PRESETS["llama2-70b"]
        self.controls: dict[str, Any] = {
            "model": drop("model", names, model if model in PRESETS else "llama2-70b", "220px"),
            "mode": W.ToggleButtons(options=["training", "inference"], value=mode, description=d["mode"],
                                    style={"description_width": "initial", "button_width": "100px"}),
            "gpu": drop("gpu", list(GPUS), gpu, "220px"),
            "n_layer": num("n_layer", c0.n_layer),
            "d_model": num("d_model", c0.d_model),
            "n_head": num("n_head", c0.n_head),
            "n_kv_head": num("n_kv_head", c0.kv_heads),
            "d_ff": num("d_ff", c0.ffn_dim),
            "vocab_size": num("vocab_size", c0.vocab_size),
            "n_expert": num("n_expert", c0.n_expert),
            "top_k": num("top_k", c0.top_k),
            "precision": drop("precision", list(PRECISION_OPTIONS.items()), ("mixed", False), "330px"),
            "optimizer": drop("optimizer", ["adamw", "adam", "sgd_momentum", "sgd"], "adamw", "170px"),
            "recompute": drop("recompute", ["none", "selective", "full"], "none", "170px"),
            "batch": num("batch", 1),
            "seq_len": num("seq_len", c0.seq_len, "170px"),
            "zero_stage": drop("zero_stage", [0, 1, 2, 3], 0, "130px"),
            "dp": drop("dp", _POW2, 1, "100px"),
            "tp": drop("tp", _POW2[:8], 1, "100px"),
            "pp": drop("pp", _POW2[:9], 1, "100px"),
            "cp": drop("cp", _POW2[:8], 1, "100px"),
            "ep": drop("ep", _POW2[:8], 1, "100px"),
            "sp": W.Checkbox(value=False, description=d["sp"], indent=False, layout=W.Layout(width="60px")),
            "weight_bytes": drop("weight_bytes", list(WEIGHT_OPTIONS.items()), 2.0, "190px"),
            "kv_bytes": drop("kv_bytes", list(KV_OPTIONS.items()), 2.0, "170px"),
        }
        self.verdict_html = W.HTML()
        self.note = ""  # what the last change did besides the obvious (a preset's own sequence length)
        self.image = W.Image(format="png", layout=W.Layout(max_width="820px", display="none"))  # shown once drawn
        self.table = W.HTML()
        ctl = self.controls
        sizes = W.HBox([ctl[k] for k in SIZE_FIELDS], layout=W.Layout(flex_flow="row wrap"))
        self.children = ([
            W.HBox([ctl["model"], ctl["mode"], ctl["gpu"]], layout=W.Layout(flex_flow="row wrap")),
            W.Accordion(children=[sizes], titles=("model sizes (editing one makes the model 'custom')",)),
            W.HBox([ctl["precision"], ctl["optimizer"], ctl["recompute"], ctl["batch"], ctl["seq_len"]],
                   layout=W.Layout(flex_flow="row wrap")),
            W.HBox([ctl[k] for k in ("zero_stage", "dp", "tp", "pp", "cp", "ep", "sp")],
                   layout=W.Layout(flex_flow="row wrap")),
            W.HBox([ctl["weight_bytes"], ctl["kv_bytes"]], layout=W.Layout(flex_flow="row wrap")),
            self.verdict_html, self.image, self.table,
        ])
        self.add_class("course-memory-budget")
        self._settle_controls()
        ctl["model"].observe(self._on_model, names="value")
        for k in SIZE_FIELDS:
            ctl[k].observe(self._on_size, names="value")
        for k in ctl:
            if k != "model" and k not in SIZE_FIELDS:
                ctl[k].observe(self._on_change, names="value")
        self._apply_model(ctl["model"].value)
        self.set(**values)

    # ---- reading and writing from code

    def _prepare(self, values: dict[str, Any]) -> dict[str, Any]:
        """``precision`` also accepts "mixed", "bf16", "fp32"."""
        if isinstance(values.get("precision"), str):
            values["precision"] = (values["precision"], False)
        return values

    def _assign(self, values: dict[str, Any]) -> None:
        """``model`` first (a preset fills the sizes and the sequence length), then the sizes, then the rest."""
        order = ["model", *SIZE_FIELDS]
        self.note = ""  # as for a learner's change: only what this change did is pointed out
        for k in sorted(values, key=lambda k: order.index(k) if k in order else len(order)):
            self.controls[k].value = values[k]
            if k == "model":
                self._apply_model(values[k])
            elif k in SIZE_FIELDS:
                self.controls["model"].value = "custom"
            elif k == "seq_len":
                self.note = ""  # the caller chose the length

    @property
    def text(self) -> str:
        """The verdict, the layout and the budget table, as plain text (what the widget shows)."""
        lines = [self.verdict_text] + ([self.note] if self.note else [])
        if self.budget is not None:
            lines += [self._layout_line(), self.budget.to_string("GB")]
        return "\n".join(lines)

    # ---- callbacks

    def _apply_model(self, name: str) -> None:
        """A preset fills the sizes and sets the sequence to the model's own context length, and says so."""
        if name == "custom":
            return
        c = PRESETS[name]
        was, self._busy = self._busy, True
        before = self.controls["seq_len"].value
        try:
            for k in SIZE_FIELDS:
                self.controls[k].value = c.kv_heads if k == "n_kv_head" else (
                    c.ffn_dim if k == "d_ff" else getattr(c, k))
            self.controls["seq_len"].value = c.seq_len
        finally:
            self._busy = was
        self._base = c
        self.note = (f"sequence length set to {c.seq_len:,} tokens, the context length of {name} (was {before:,})"
                     if before != c.seq_len else "")

    def _on_model(self, change: dict) -> None:
        if self._busy:
            return
        self._apply_model(change["new"])
        self.update()

    def _on_change(self, change: dict) -> None:
        if not self._busy:
            self.note = ""
        super()._on_change(change)

    def _on_size(self, change: dict) -> None:
        if self._busy:
            return
        self.note = ""
        self._busy = True
        try:
            self.controls["model"].value = "custom"
        finally:
            self._busy = False
        self.update()

    def _current_config(self) -> GPTConfig:
        v = self.values()
        if v["model"] != "custom":
            return PRESETS[v["model"]]
        sizes = {k: int(v[k]) for k in SIZE_FIELDS}
        return self._base.with_(name="custom", **sizes)

    def _layout_line(self) -> str:
        v = self.values()
        if v["mode"] == "training":
            world = v["dp"] * v["tp"] * v["pp"] * v["cp"]
            return (f"world size = DP x TP x PP x CP = {v['dp']} x {v['tp']} x {v['pp']} x {v['cp']} = {world} "
                    f"GPUs (EP={v['ep']} carved out of DP x CP)")
        return (f"one replica = TP x PP = {v['tp'] * v['pp']} GPUs (EP={v['ep']}); more replicas (DP) add "
                "throughput, not memory per GPU")

    def update(self) -> None:
        """Recompute the budget from the controls and redraw."""
        v = self.values()
        training = v["mode"] == "training"
        for k in _TRAINING_ONLY:
            self.controls[k].disabled = not training
        for k in _INFERENCE_ONLY:
            self.controls[k].disabled = training
        self.controls["ep"].disabled = not v["n_expert"]  # the size fields always show the model's sizes
        precision, acc = v["precision"]
        try:
            self.config = self._current_config()
            self.budget = budget_for(self.config, mode=v["mode"], precision=precision, fp32_grad_accum=acc,
                                     optimizer=v["optimizer"], batch=v["batch"], seq_len=v["seq_len"],
                                     recompute=v["recompute"], zero_stage=v["zero_stage"], dp=v["dp"],
                                     tp=v["tp"], pp=v["pp"], cp=v["cp"], ep=v["ep"], sp=v["sp"],
                                     weight_bytes=v["weight_bytes"], kv_bytes=v["kv_bytes"])
        except ValueError as err:  # the message names the field and what it accepts; no stale or empty figure
            self.budget, self.fits = None, None
            self.verdict_text = f"invalid settings: {err}"
            self.verdict_html.value = f"<b style='color:darkorange'>{html.escape(self.verdict_text)}</b>"
            self.table.value = ""
            self.image.layout.display = "none"
            return
        self.fits, self.verdict_text = verdict(self.budget, v["gpu"])
        # the figure first, then text, table and figure together: they never show different settings
        png = figure_png(plot_budget(self.budget, target=v["gpu"], title=self.budget.label, figsize=(8.0, 4.2))) \
            if self._draw else None
        color = "darkgreen" if self.fits else "darkred"
        note = f"<br><i>{html.escape(self.note)}</i>" if self.note else ""
        self.verdict_html.value = f"<b style='color:{color}'>{self.verdict_text}</b>{note}<br>{self._layout_line()}"
        self.table.value = f"<pre style='font-size:11px'>{self.budget.to_string('GB')}</pre>"
        if png is not None:
            self.image.value = png
            self.image.layout.display = None

    def __repr__(self) -> str:
        return f"MemoryBudgetWidget({self.verdict_text!r})"


def memory_budget_widget(model: str = "llama2-70b", mode: str = "training", gpu: str = "H100 80GB",
                         draw: bool = True, **values: Any) -> MemoryBudgetWidget:
    """A memory-budget explorer: an ipywidgets container (a :class:`MemoryBudgetWidget`) to display.

    ``values`` set any control at start (names of ``CONTROL_DESCRIPTIONS``: batch, seq_len, zero, dp, tp, ...).
    ``draw=False`` skips the figure (faster, for tests that read only the text). The figure is drawn
    off-screen (``Figure`` + ``savefig`` into an ``Image`` widget), whatever matplotlib's backend.
    """
    return MemoryBudgetWidget(model=model, mode=mode, gpu=gpu, draw=draw, **values)
