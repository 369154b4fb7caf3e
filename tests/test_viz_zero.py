"""Tests for course_lib.viz.zero: ZeRO's per-rank arithmetic and where the summaries' multipliers hold, the figure's
bars and curves, the widget driven from the kernel side, and the unit timeline (a hand-laid trace, and the
markers a real one-rank run records). Pure and fast: Agg, one in-process rank."""

from __future__ import annotations

import itertools

import matplotlib

matplotlib.use("Agg")

import ipywidgets as W
import pytest
from matplotlib.figure import Figure

from course_lib.estimates.memory_budget import GB
from course_lib.estimates.model_states import bytes_per_param, zero_memory_per_device
from course_lib.model_config import PRESETS, GPTConfig, param_count
from course_lib.runtime.launch import launch
from course_lib.viz import zero as vz

CFG = GPTConfig(bias=False, d_model=33, n_head=3, d_ff=65, n_layer=3, seq_len=15)


# ----------------------------------------------------------------------------------------------------------------
# Arithmetic


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_breakdown_sums_to_the_formula_and_the_papers_example(stage):
    parts = vz.zero_breakdown(7.5e9, 64, stage)
    assert list(parts) == list(vz.CATEGORIES)
    assert sum(parts.values()) == pytest.approx(zero_memory_per_device(7.5e9, 12, 64, stage))
    paper = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # ZeRO, Figure 1 (GB)
    assert sum(parts.values()) / GB == pytest.approx(paper[stage], abs=0.06)
    fp32 = vz.zero_breakdown(1000, 4, stage, K=8, param_bytes=4, grad_bytes=4)
    assert fp32 == {"parameters": 4000 / (4 if stage >= 3 else 1), "gradients": 4000 / (4 if stage >= 2 else 1),
                    "optimizer_state": 8000 / (4 if stage >= 1 else 1)}


def test_reduction_factors_and_their_limits():
    assert vz.reduction_factor(64, 1) == pytest.approx(16 / (4 + 12 / 64))
    assert vz.reduction_factor(64, 2) == pytest.approx(16 / (2 + 14 / 64))
    assert [vz.reduction_factor(n, 3) for n in (1, 4, 8, 1024)] == pytest.approx([1, 4, 8, 1024])
    assert vz.reduction_factor(8, 0) == 1
    assert (vz.limit_factor(1), vz.limit_factor(2), vz.limit_factor(3)) == (4, 8, float("inf"))
    assert (vz.limit_factor(1, 8, 4, 4), vz.limit_factor(2, 8, 4, 4)) == (2, 4)  # fp32 + Adam
    for s in (1, 2):  # the factor approaches the limit from below
        assert vz.reduction_factor(4096, s) < vz.limit_factor(s)
    with pytest.raises(ValueError, match="stage"):
        vz.reduction_factor(8, 4)
    with pytest.raises(ValueError, match="N_d"):
        vz.zero_breakdown(1.0, 0, 1)


def test_where_the_seeds_multipliers_hold():
    """'Stage 1 ~4x, stage 2 ~8x' within 10%: from N_d = 27 and 63 (boundaries exact), never for fp32 Adam;
    ZeRO-3's factor reaches x at N_d = x."""
    for factor, stage, n in ((0.9 * 4, 1, 27), (0.9 * 8, 2, 63), (8, 3, 8), (4, 3, 4), (1, 2, 1)):
        got = vz.min_ranks_for(factor, stage)
        assert got == n, (factor, stage, got)
        assert vz.reduction_factor(n, stage) >= factor - 1e-12
        if n > 1:
            assert vz.reduction_factor(n - 1, stage) < factor
    assert vz.min_ranks_for(4, 1) is None and vz.min_ranks_for(8, 2) is None  # the limits are never reached
    assert vz.min_ranks_for(3.6, 1, K=8, param_bytes=4, grad_bytes=4) is None
    assert vz.min_ranks_for(2, 0) is None


# ----------------------------------------------------------------------------------------------------------------
# The figure


def test_plot_bars_are_the_breakdown_and_curves_the_factors():
    fig = vz.plot_zero_memory(7.5e9, 64, stage=3, gpu="H100 80GB")
    assert isinstance(fig, Figure)
    ax, ax2 = fig.axes
    assert [c.get_label() for c in ax.containers] == list(vz.CATEGORIES)
    for cat, cont in zip(vz.CATEGORIES, ax.containers, strict=True):
        heights = [p.get_height() * GB for p in cont.patches]
        assert heights == pytest.approx([vz.zero_breakdown(7.5e9, 64, s)[cat] for s in range(4)])
    assert ax.get_xticklabels()[3].get_fontweight() == "bold"
    lines = {line.get_label(): line for line in ax2.lines if not line.get_label().startswith("_")}
    assert set(lines) == {vz.STAGE_NAMES[s] for s in (1, 2, 3)}
    for s in (1, 2, 3):
        xs, ys = lines[vz.STAGE_NAMES[s]].get_data()
        assert list(ys) == pytest.approx([vz.reduction_factor(int(n), s) for n in xs])
    texts = " ".join(t.get_text() for t in ax2.texts)
    assert "from N_d = 27" in texts and "from N_d = 63" in texts
    fp32 = vz.plot_zero_memory(1e6, 8, K=8, param_bytes=4, grad_bytes=4, gpu=None)
    assert "never" in " ".join(t.get_text() for t in fp32.axes[1].texts)
    assert "(MB)" in fp32.axes[0].get_ylabel()  # a small model in MB, without a GPU line


@pytest.mark.parametrize("model, n_d, stage", [("llama2-70b", 64, 1), ("llama2-7b", 8, 3), ("llama2-70b", 8, 3),
                                             ("llama2-7b", 1, 0), ("llama3-70b", 4096, 3), ("mixtral-8x7b", 16, 2)])
def test_the_gpu_line_label_never_overprints_the_zero3_bar_value(model, n_d, stage):
    """The GPU capacity's label printed over ZeRO-3's bar value (chapter 03's widget at llama2-70b, N_d = 64, in the
    lab and on the site). Their boxes, as drawn, must not meet; nor the label the right panel or the figure's edge."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    psi = param_count(PRESETS[model])
    fig = vz.plot_zero_memory(psi, n_d, stage=stage, gpu="H100 80GB")
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    ax, ax2 = fig.axes
    (gpu,) = [t for t in ax.texts if t.get_text().startswith("H100 80GB")]
    (zero3,) = [t for t in ax.texts if getattr(t, "xy", (None,))[0] == 3]
    label = gpu.get_window_extent(renderer)
    assert not label.overlaps(zero3.get_window_extent(renderer)), (label, zero3.get_text())
    assert not label.overlaps(ax2.get_tightbbox(renderer)) and fig.bbox.contains(label.x1, label.y1)


# ----------------------------------------------------------------------------------------------------------------
# The widget


def test_widget_text_follows_the_controls():
    w = vz.zero_memory_widget(model="llama2-7b", draw=False, n_d=8, stage=3)
    assert isinstance(w, W.VBox)
    assert {k: c.description for k, c in w.controls.items()} == vz.CONTROL_DESCRIPTIONS
    psi = param_count(PRESETS["llama2-7b"])
    assert [r["factor"] for r in w.rows] == pytest.approx([1, 16 / 5.5, 16 / 3.75, 8])
    assert w.rows[3]["total"] == pytest.approx(16 * psi / 8)
    assert "8.00x less than plain DP" in w.text and "fits on H100 80GB" in w.text
    text = w.set(model="llama2-70b", n_d=64, stage=1)
    assert text.startswith("ZeRO-1 on N_d = 64") and "does not fit" in text
    assert "not sharded by ZeRO: activations" in text
    assert w.rows[1]["factor"] == pytest.approx(16 / (4 + 12 / 64))
    w.set(precision="fp32")
    pb = bytes_per_param("fp32", "adamw")
    assert (pb.params, pb.grads, pb.K) == (4, 4, 8)
    assert "4 + 4 + K=8" in w.text and "stage 1 2x, stage 2 4x" in w.text
    with pytest.raises(KeyError):
        w.set(tp=2)


def test_widget_draws_a_png():
    w = vz.zero_memory_widget(model="gpt2-124m", n_d=4, stage=2)
    assert w.image.value[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------------------------------------------
# The unit timeline

UNITS = [{"name": "blocks.0", "padded_numel": 8, "parent": ""}, {"name": "", "padded_numel": 8, "parent": None}]
PLAIN = [("all_gather", ""), ("forward", ""), ("all_gather", "blocks.0"), ("forward", "blocks.0"),
         ("forward_end", "blocks.0"), ("forward_end", ""), ("backward", ""), ("all_gather", "blocks.0"),
         ("backward", "blocks.0"), ("reduce_scatter", "blocks.0"), ("reduce_scatter", ""), ("optimizer", ""),
         ("optimizer_end", "")]


def _lane(tl, lane):
    return sorted((b for b in tl.bars if b.lane == lane), key=lambda b: b.start)


def test_a_hand_laid_trace_gives_the_hand_computed_times():
    """Root (0.2 before, 0.6 after its block) + one block (1 forward, 2 backward); every collective 0.5."""
    tl = vz.simulate_timeline(PLAIN, UNITS)
    compute = [(b.kind, b.unit, round(b.start, 6), round(b.end, 6)) for b in _lane(tl, "compute")]
    assert compute == [("wait", "", 0.0, 0.5), ("F", "", 0.5, 0.7), ("wait", "blocks.0", 0.7, 1.2),
                       ("F", "blocks.0", 1.2, 2.2), ("F", "", 2.2, 2.8), ("B", "", 2.8, 4.0),
                       ("wait", "blocks.0", 4.0, 4.5), ("B", "blocks.0", 4.5, 6.5), ("wait", "blocks.0", 6.5, 7.0),
                       ("B", "", 7.0, 7.4), ("wait", "", 7.4, 7.9), ("opt", "", 7.9, 8.4)]
    assert [(b.kind, b.unit) for b in _lane(tl, "comm")] == [("AG", ""), ("AG", "blocks.0"), ("AG", "blocks.0"),
                                                             ("RS", "blocks.0"), ("RS", "")]
    assert (tl.makespan, tl.exposed, tl.comm) == pytest.approx((8.4, 2.5, 2.5))


def test_prefetch_overlaps_and_async_reduce_scatter_hides_more():
    prefetch = [("all_gather", ""), ("all_gather", "blocks.0"), ("forward", ""), ("forward", "blocks.0"),
                ("forward_end", "blocks.0"), ("forward_end", ""), ("all_gather", "blocks.0"), ("backward", ""),
                ("backward", "blocks.0"), ("reduce_scatter", "blocks.0"), ("reduce_scatter", ""), ("optimizer", ""),
                ("optimizer_end", "")]
    plain, pre = vz.simulate_timeline(PLAIN, UNITS), vz.simulate_timeline(prefetch, UNITS)
    assert pre.comm == plain.comm and pre.makespan < plain.makespan and pre.exposed < plain.exposed
    # block 0's prefetched gather runs while the root computes: block 0 waits only for the rest of it
    (ag0,) = [b for b in _lane(pre, "comm") if b.kind == "AG" and b.unit == "blocks.0" and b.start < 2]
    (f0,) = [b for b in _lane(pre, "compute") if b.kind == "F" and b.unit == "blocks.0"]
    assert ag0.start == pytest.approx(0.5) and f0.start == pytest.approx(ag0.end)
    free = vz.simulate_timeline(prefetch, UNITS, blocking_reduce_scatter=False)
    assert free.makespan < pre.makespan
    for tl in (plain, pre, free):  # one collective at a time; one computation at a time
        for lane in ("comm", "compute"):
            bars = _lane(tl, lane)
            assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(bars))
    with pytest.raises(ValueError, match="unknown event"):
        vz.simulate_timeline([("broadcast", "")], UNITS)


def test_recorded_markers_on_one_rank_and_the_figure():
    (rec,) = launch(vz.record_zero_step, 1, CFG, prefetch=True)
    names = [u["name"] for u in rec["units"]]
    assert names == ["blocks.0", "blocks.1", "blocks.2", ""]
    assert [u["parent"] for u in rec["units"]] == ["", "", "", None]
    ev = rec["events"]
    assert ev[:5] == [("all_gather", ""), ("all_gather", "blocks.0"), ("forward", ""), ("all_gather", "blocks.1"),
                      ("forward", "blocks.0")]
    assert ev[-2:] == [("optimizer", ""), ("optimizer_end", "")]
    for name in names:  # every unit runs forward, backward and one reduce-scatter
        for kind in ("forward", "forward_end", "backward", "reduce_scatter"):
            assert ev.count((kind, name)) == 1, (kind, name)
    assert vz.simulate_timeline(ev, rec["units"]).makespan > 0
    fig = vz.plot_unit_timeline({"prefetch": [rec]}, note="modelled")
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["rank 0 compute", "rank 0 comm"]
    with pytest.raises(ValueError, match="note"):
        vz.plot_unit_timeline({"prefetch": [rec]}, note="")
    with pytest.raises(ValueError, match="stage 2 or 3"):
        launch(vz.record_zero_step, 1, CFG, stage=1)
