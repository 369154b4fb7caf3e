"""Tests for course_lib.viz.memory: the stacked-bar figure and the memory-budget widget, driven from the kernel
side (no browser): the bars are the estimator's numbers, the verdict flips where it should, TP divides the
parameters, inference shows the KV cache (with GQA) and MoE experts are split by EP."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import ipywidgets as W
import pytest
from matplotlib.figure import Figure

from course_lib.estimates.hardware import GPUS
from course_lib.estimates.layout import ParallelLayout, params_per_rank
from course_lib.estimates.memory import inference_memory, kv_cache_bytes, training_memory
from course_lib.estimates.memory_budget import GB
from course_lib.estimates.model_states import bytes_per_param
from course_lib.model_config import PRESETS, mlp_params, param_count
from course_lib.viz.memory import (
    CONTROL_DESCRIPTIONS,
    MemoryBudgetWidget,
    memory_budget_widget,
    plot_budget,
    verdict,
)

LLAMA70 = PRESETS["llama2-70b"]


def _widget(**values: object) -> MemoryBudgetWidget:
    return memory_budget_widget(model="llama2-70b", gpu="H100 80GB", draw=False, **values)


# ----------------------------------------------------------------------------------------------------------------
# The figure


def test_plot_has_one_segment_per_category_with_the_estimators_heights() -> None:
    est = training_memory("llama2-70b", layout=ParallelLayout(dp=8, zero_stage=3, tp=8), recompute="selective")
    fig = plot_budget(est, target="H100 80GB")
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert [c.get_label() for c in ax.containers] == list(est)  # one container per category, in order
    bottom = 0.0
    for cat, cont in zip(est, ax.containers, strict=True):
        (patch,) = cont.patches  # one bar: one segment per category
        assert patch.get_height() * GB == pytest.approx(est[cat], rel=1e-12), cat
        assert patch.get_y() == pytest.approx(bottom)  # stacked
        bottom += patch.get_height()
    assert bottom * GB == pytest.approx(est.total)
    # capacity lines of every GPU size, in decimal GB (80 GiB = 85.9 GB), and the verdict above the bar
    lines = sorted({round(line.get_ydata()[0], 3) for line in ax.lines})
    assert lines == sorted({round(g.gb, 3) for g in GPUS.values()})
    texts = " ".join(t.get_text() for t in ax.texts)
    assert ("does not fit" in texts) != verdict(est, "H100 80GB")[0]


def test_plot_several_bars_and_a_small_unit() -> None:
    """Bars side by side share the categories (a missing one is a 0-height segment); without GPU lines the
    unit follows the data (the tiny model is counted in kB)."""
    a = {"parameters": 4000.0, "activations": 2000.0}
    b = {"parameters": 4000.0, "other": 500.0}
    fig = plot_budget({"estimate": a, "measured": b}, gpus=())
    ax = fig.axes[0]
    assert [c.get_label() for c in ax.containers] == ["parameters", "activations", "other"]
    heights = [[p.get_height() for p in c.patches] for c in ax.containers]
    assert heights == [[4.0, 4.0], [2.0, 0.0], [0.0, 0.5]]
    assert "(kB)" in ax.get_ylabel()
    assert not ax.lines and not any("fit" in t.get_text() for t in ax.texts)


def test_verdict_text() -> None:
    h100 = GPUS["H100 80GB"]
    assert h100.bytes == 80 * 2**30
    fits, text = verdict({"weights": 80e9}, "H100 80GB")
    assert fits and text.startswith("fits on H100 80GB") and "5.90 GB to spare" in text
    fits, text = verdict({"weights": 140e9}, "H100 80GB")  # 70B in bf16
    assert not fits and text.startswith("does not fit") and "1.6x" in text
    assert verdict({"weights": 140e9}, "H200 141GB")[0]


# ----------------------------------------------------------------------------------------------------------------
# The widget


def test_widget_is_a_container_with_stable_descriptions() -> None:
    w = _widget()
    assert isinstance(w, W.VBox)
    for name, desc in CONTROL_DESCRIPTIONS.items():
        assert w.controls[name].description == desc, name
    assert len(set(CONTROL_DESCRIPTIONS.values())) == len(CONTROL_DESCRIPTIONS)
    with pytest.raises(KeyError):
        w.set(zero=3)  # the stage is spelled zero_stage everywhere


def test_verdict_flips_when_zero_shards_over_more_dp_ranks() -> None:
    """Llama 2 70B, full recomputation, 80 GB GPUs: DP alone never helps (every rank holds everything); ZeRO
    helps in proportion to the DP degree, and only ZeRO-3 on enough ranks makes it fit."""
    w = _widget(recompute="full")
    assert w.fits is False and w.text.startswith("does not fit on H100 80GB")
    one_gpu = w.budget.total
    w.set(dp=64)
    assert w.fits is False and w.budget.total >= one_gpu  # plain DP: same states + a gradient bucket
    totals = []
    for stage in (1, 2, 3):
        w.set(zero_stage=stage)
        totals.append(w.budget.total)
    assert totals == sorted(totals, reverse=True)
    assert w.fits is True and w.text.startswith("fits on H100 80GB")
    want = training_memory(LLAMA70, layout=ParallelLayout(dp=64, zero_stage=3), recompute="full")
    assert dict(w.budget) == dict(want)  # the widget shows exactly the estimator's numbers
    w.set(dp=8)  # ZeRO-3 over 8 ranks is not enough
    assert w.fits is False
    w.set(gpu="H200 141GB", dp=16)
    assert w.fits is True and "H200 141GB" in w.text


def test_tensor_parallel_divides_the_parameter_bytes() -> None:
    w = _widget()
    p1 = w.budget["parameters"]
    w.set(tp=8)
    p8 = w.budget["parameters"]
    assert p1 == pytest.approx(2 * param_count(LLAMA70))
    assert p8 == pytest.approx(2 * sum(params_per_rank(LLAMA70, ParallelLayout(tp=8)).values()))
    assert p1 / p8 == pytest.approx(8, rel=2e-3)  # only norms (and GQA-free replicas) stay whole
    pb = bytes_per_param("mixed", "adamw")  # 2 + 2 + 12 bytes per parameter, all divided alike
    assert w.budget["gradients"] == pytest.approx(pb.grads * p8 / 2)
    assert w.budget["optimizer_state"] == pytest.approx(pb.optimizer * p8 / 2)


def test_inference_shows_the_kv_cache_with_gqa() -> None:
    w = _widget(mode="inference", batch=8, seq_len=4096)
    assert "kv_cache" in w.text and "optimizer_state" not in w.text
    kv, weights = w.budget["kv_cache"], w.budget["weights"]
    assert kv == kv_cache_bytes(LLAMA70, 4096, 8) == 8 * 4096 * 2 * 80 * 8 * 128 * 2  # 8 KV heads of 128
    assert dict(w.budget) == dict(inference_memory(LLAMA70, batch=8, context_len=4096))
    assert w.controls["zero_stage"].disabled and not w.controls["kv_bytes"].disabled
    w.set(tp=8)
    assert w.budget["kv_cache"] == kv / 8  # 8 KV heads, one per TP rank
    assert w.budget["weights"] == pytest.approx(weights / 8, rel=2e-3)
    w.set(tp=1, n_kv_head=64)  # the same model with multi-head attention: 8x the cache
    assert w.controls["model"].value == "custom"
    assert w.budget["kv_cache"] == 8 * kv
    w.set(model="llama2-70b", kv_bytes=1.0)
    assert w.budget["kv_cache"] == kv / 2


def test_moe_counts_every_expert_and_ep_splits_them() -> None:
    mix = PRESETS["mixtral-8x7b"]
    w = memory_budget_widget(model="mixtral-8x7b", mode="inference", draw=False, seq_len=4096)
    assert w.budget["weights"] == pytest.approx(2 * param_count(mix))  # 46.7B, all experts resident
    assert 46.6e9 < param_count(mix) < 46.8e9
    assert not w.controls["ep"].disabled
    w.set(mode="training", dp=8, ep=8)
    counts = params_per_rank(mix, ParallelLayout(dp=8, ep=8))
    assert w.budget["parameters"] == pytest.approx(2 * sum(counts.values()))
    assert counts["experts"] == mix.n_layer * mix.n_expert * mlp_params(mix) / 8  # one expert per rank
    w.set(model="llama2-70b", ep=1)
    assert w.controls["ep"].disabled


def test_user_edits_update_the_widget() -> None:
    """What a browser does: change a control's value directly (no ``set``)."""
    w = _widget()
    before = w.budget.total
    w.controls["zero_stage"].value = 3
    w.controls["dp"].value = 8
    assert w.budget.total < before
    w.controls["model"].value = "llama3-8b"  # a preset fills the sizes and the sequence
    assert w.controls["n_layer"].value == 32 and w.controls["seq_len"].value == 8192
    assert w.budget["parameters"] == pytest.approx(2 * param_count(PRESETS["llama3-8b"]) / 8)
    w.controls["n_layer"].value = 16  # editing a size makes the model custom
    assert w.controls["model"].value == "custom"
    assert w.config.n_layer == 16 and w.config.vocab_size == PRESETS["llama3-8b"].vocab_size
    w.controls["tp"].value = 64  # 32 heads cannot be split 64 ways
    assert w.budget is None and w.text.startswith("invalid settings: tp=64 must divide n_head=32")


def test_widget_draws_the_figure() -> None:
    w = memory_budget_widget(model="llama3-8b", draw=True)
    png = w.image.value
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    w.set(recompute="full")
    assert w.image.value != png
