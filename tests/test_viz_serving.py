"""Serving figures and widgets, driven from the kernel side: the budget panel's numbers are the estimator's,
TP and quantisation move them the right way, the trace panel's numbers are the scheduler's summary."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
from matplotlib.figure import Figure

from course_lib.estimates.memory_budget import GB
from course_lib.model import GPT
from course_lib.serving.budget import predict, serving_budget
from course_lib.serving.engine import Engine
from course_lib.serving.loadgen import poisson_trace
from course_lib.serving.paged import PagedKVCache
from course_lib.serving.roofline import StepCost, critical_batch
from course_lib.serving.scheduler import Scheduler, SimClock
from course_lib.viz.serving import ServingBudgetPanel, TracePanel, plot_roofline, plot_schedule


def test_budget_panel_shows_the_estimators_budget_and_reacts_to_tp_and_quantisation():
    w = ServingBudgetPanel(model="llama3-70b", draw=False)
    text = w.set(tp=1, batch=8, context=4096, quant="bf16")
    ref = serving_budget("llama3-70b", batch=8, context=4096, tp=1)
    assert w.prediction.budget.total == pytest.approx(ref.total)
    assert f"{ref.total / GB:.1f} GB" in text and "does NOT fit" in text
    assert "fits" in w.set(tp=4) and w.prediction.max_sequences > 0
    bf16_step = w.prediction.step_s
    w.set(quant="int4")
    assert w.prediction.step_s < bf16_step  # fewer weight bytes to stream per step
    assert w.prediction.bound == "memory-bound"
    assert "compute-bound" in str(predict("llama3-8b", batch=2048, context=128).bound)


def test_budget_panel_reports_an_invalid_split_instead_of_raising():
    w = ServingBudgetPanel(model="llama3-8b", draw=False)
    assert w.set(model="gpt3-175b", tp=8).startswith("gpt3-175b")
    w2 = ServingBudgetPanel(model="gpt2-124m", draw=False)
    assert w2.set(tp=8).startswith("invalid")  # 12 heads are not divisible by 8
    w2.set(tp=1)
    assert isinstance(w2.figure(), Figure)


def test_trace_panel_replays_the_trace_and_static_is_slower_than_continuous():
    w = TracePanel(n_requests=12, draw=False)
    w.set(policy="continuous", rate=300, clock="simulated")
    cont = w.result.summary()
    assert f"{cont['ttft_p50'] * 1e3:.1f} ms" in w.text and "simulated" in w.text
    w.set(policy="static")
    assert w.result.summary()["ttft_p99"] > cont["ttft_p99"]
    fig = plot_schedule(w.result)
    assert "simulated" in fig.axes[0].get_xlabel()


def test_roofline_figure_marks_the_ridge():
    fig = plot_roofline(989e12, 3.35e12, {"decode b=1": (1.0, 3.35e12)}, title="H100")
    ax = fig.axes[0]
    assert any("ridge 295" in t.get_text() for t in ax.get_legend().get_texts())
    assert critical_batch(989e12, 3.35e12) == pytest.approx(295.2, abs=0.1)


def test_drawn_budget_panel_redraws_on_each_control_and_hides_its_figure_for_an_invalid_split():
    w = ServingBudgetPanel(model="llama3-8b")
    shown = [w.image.value]
    assert shown[0][:4] == b"\x89PNG"
    for change in ({"tp": 2}, {"batch": 128}, {"context": 32768}, {"quant": "int8"}, {"gpu": "A100 80GB"}):
        w.set(**change)
        assert w.image.value[:4] == b"\x89PNG" and w.image.value not in shown, f"{change}: the bar was not redrawn"
        assert w.image.layout.display is None
        shown.append(w.image.value)
    assert w.set(model="gpt2-124m", tp=8).startswith("invalid")  # 12 heads on 8 ranks: no budget to draw
    assert w.image.value == b"" and w.image.layout.display == "none"  # no stale bar beside the error
    w.set(tp=4)
    assert w.image.value[:4] == b"\x89PNG" and w.image.layout.display is None


def test_drawn_trace_panel_redraws_the_schedule_for_each_policy():
    w = TracePanel(n_requests=8)
    shown = [w.image.value]
    for policy in ("static", "chunked prefill"):
        w.set(policy=policy)
        assert w.image.value[:4] == b"\x89PNG" and w.image.value not in shown, policy
        shown.append(w.image.value)


def test_budget_panel_refuses_what_it_cannot_use_with_a_message():
    w = ServingBudgetPanel(model="llama3-70b", draw=False)
    assert w.set(batch=0) == "invalid: batch must be an int >= 1, got 0" and w.prediction is None
    assert w.set(batch=32, tp=3).startswith("invalid: tp=3: this widget splits a model over 1, 2, 4, 8 GPUs")
    assert w.values()["tp"] != 3 and w.set(tp=4).startswith("llama3-70b on 4 x")
    assert w.set(token_budget=16).startswith("invalid: batch=32 sequences")


def test_budget_panel_prints_no_throughput_for_a_configuration_that_does_not_fit():
    w = ServingBudgetPanel(model="llama3-70b", draw=False)
    fits = w.set(tp=4, batch=32, context=4096)
    assert "tokens/s" in fits and "decode step" in fits
    cap = w.prediction.max_sequences
    for change in ({"batch": cap + 1}, {"batch": 32, "tp": 1}):
        text = w.set(**change)
        assert "does NOT fit" in text and "tokens/s" not in text and "no decode step or throughput" in text
    assert w.set(tp=4, batch=1).count(f"max concurrent sequences of 4096 tokens: {cap}") == 1  # whatever the batch


def test_trace_panel_replays_the_chapters_trace():
    """At the same rate, size and seed the widget serves exactly the trace the chapter builds from TracePanel.TRACE."""
    w = TracePanel(n_requests=12, draw=False)
    w.set(rate=300, policy="static", clock="simulated")
    trace = poisson_trace(12, 300.0, **TracePanel.TRACE, seed=0)
    ref = Scheduler(Engine(GPT(w.config, seed=0).eval(), PagedKVCache(w.config, n_blocks=400, block_size=16)),
                    policy="static", max_batch=8, clock=SimClock(StepCost.for_model("llama3-8b", "H100 80GB",
                                                                                    overhead_s=1e-3))).run(trace)
    assert w.result.outputs() == ref.outputs() and w.result.summary() == ref.summary()


def test_budget_panel_names_the_all_reduce_bound_and_keeps_its_legend_off_the_axis_label():
    w = ServingBudgetPanel(model="llama3-70b", draw=False)
    ring = w.set(tp=8, batch=1, context=4096, allreduce="ring")
    assert "memory-bound" in ring and "(ring)" in ring  # NCCL's ring at the protocol it picks (LL)
    assert "memory-bound" in w.set(allreduce="best") and "(best)" in w.text
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = w.figure()
    renderer = FigureCanvasAgg(fig).get_renderer()
    ax = fig.axes[0]
    legend, label = ax.get_legend().get_window_extent(renderer), ax.xaxis.label.get_window_extent(renderer)
    assert not legend.overlaps(label)


def test_decode_and_budget_sweep_figures_label_their_series():
    from course_lib.viz.serving import plot_budget_sweep, plot_decode_throughput

    fig = plot_decode_throughput([1, 4], {"measured (emulated device)": [1.0, 3.0], "modelled": [1.0, 3.5]},
                                 title="t")
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["measured (emulated device)", "modelled"]
    fig = plot_budget_sweep({"64": (0.1, 0.01), "512": (0.05, 0.02)}, title="t")
    assert fig.axes[0].get_xlabel() == "TTFT p99 (ms)"
