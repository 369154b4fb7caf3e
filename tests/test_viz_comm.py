"""Tests for course_lib.viz.comm: the ring figure is the ring the code runs, the cost figure's curves are
cost.collective_time, and the calculator widget's prediction moves as the model says with size, world size and
link (driven from the kernel side, no browser)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import ipywidgets as W
import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.text import Annotation

from course_lib.estimates.cost import collective_bytes_per_rank, collective_steps, collective_time
from course_lib.estimates.hardware import LINKS
from course_lib.estimates.memory_budget import format_bytes
from course_lib.runtime.collectives import ring_all_gather_chunks, ring_reduce_scatter_chunks
from course_lib.viz.comm import (
    CONTROL_DESCRIPTIONS,
    FITTED,
    CollectiveCostWidget,
    Measurement,
    bus_bandwidth_factor,
    collective_cost_widget,
    format_seconds,
    plot_bytes_per_rank,
    plot_collective_cost,
    plot_ring_steps,
    ring_schedule,
)

# ----------------------------------------------------------------------------------------------------------------
# The ring


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_schedule_follows_the_collectives_chunk_functions_and_ends_reduced(n: int) -> None:
    sched = ring_schedule(n, "all_reduce")
    assert len(sched.transfers) == 2 * (n - 1) and len(sched.states) == 2 * (n - 1) + 1
    everyone = frozenset(range(n))
    for k, moves in enumerate(sched.transfers):
        phase, step = ("reduce-scatter", k) if k < n - 1 else ("all-gather", k - (n - 1))
        chunks = ring_reduce_scatter_chunks if phase == "reduce-scatter" else ring_all_gather_chunks
        assert [(t.src, t.dst, t.chunk, t.phase) for t in moves] == [
            (r, (r + 1) % n, chunks(r, step, n)[0], phase) for r in range(n)]
    after_rs = sched.states[n - 1]
    for r in range(n):  # rank r owns chunk r, reduced over every rank; nothing else is complete yet
        assert after_rs[r][r] == everyone
        assert all(after_rs[r][c] != everyone for c in range(n) if c != r)
    assert all(s == everyone for row in sched.states[-1] for s in row)  # all-reduce: everyone has everything


def test_ring_schedule_alone_phases() -> None:
    rs = ring_schedule(4, "reduce_scatter")
    assert len(rs.transfers) == 3
    assert [rs.states[-1][r][r] for r in range(4)] == [frozenset(range(4))] * 4
    ag = ring_schedule(4, "all_gather")
    assert ag.states[0][2] == [frozenset(), frozenset(), frozenset({2}), frozenset()]
    assert all(ag.states[-1][r][c] == {c} for r in range(4) for c in range(4))
    with pytest.raises(ValueError):
        ring_schedule(1)
    with pytest.raises(ValueError):
        ring_schedule(4, "broadcast")


def test_ring_figure_draws_every_chunk_and_every_message() -> None:
    n = 4
    fig = plot_ring_steps(n, "all_reduce")
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    squares = {p.get_gid(): p for p in ax.patches if isinstance(p, Rectangle) and p.get_gid()}
    assert len(squares) == (2 * (n - 1) + 1) * n * n  # n chunks of n ranks, at the start and after each step
    arrows = sorted(t.get_gid() for t in ax.texts if isinstance(t, Annotation) and t.get_gid())
    sched = ring_schedule(n)
    assert arrows == sorted(f"t{k}:{t.src}->{t.dst}:c{t.chunk}" for k, m in enumerate(sched.transfers) for t in m)
    assert len(arrows) == 2 * (n - 1) * n
    # the final row is complete (dark), the start row is not; the digits are the ranks in each chunk
    last, first = 2 * (n - 1), 0
    assert squares[f"s{last}r1c2"].get_facecolor() == squares[f"s{last}r3c0"].get_facecolor()
    assert squares[f"s{first}r1c2"].get_facecolor() != squares[f"s{last}r1c2"].get_facecolor()
    everyone = frozenset(range(n))
    complete = sum(1 for state in sched.states for row in state for s in row if s == everyone)
    assert [t.get_text() for t in ax.texts].count("0123") == complete == n * n * (n + 1) // 2
    assert "reduce-scatter" in ax.get_title() and "6 steps" in ax.get_title()


def test_ring_figure_of_an_all_gather_only() -> None:
    ax = plot_ring_steps(3, "all_gather").axes[0]
    arrows = [t for t in ax.texts if isinstance(t, Annotation) and t.get_gid()]
    assert len(arrows) == 2 * 3
    assert {a.get_gid().split(":")[-1] for a in arrows[:3]} == {"c0", "c1", "c2"}  # step 1: each its own chunk


# ----------------------------------------------------------------------------------------------------------------
# Bytes and cost figures


def test_bytes_per_rank_bars_and_formula_lines() -> None:
    fig = plot_bytes_per_rank({"naive": [3e6, 1e6, 1e6, 1e6], "ring": [1.5e6] * 4}, {"2(N-1)/N V": 1.5e6})
    ax = fig.axes[0]
    assert [[p.get_height() for p in c.patches] for c in ax.containers] == [[3, 1, 1, 1], [1.5] * 4]
    assert [line.get_ydata()[0] for line in ax.lines] == [1.5]
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"rank {r}" for r in range(4)]


def test_cost_figure_curves_are_the_cost_model_and_points_are_the_measurements() -> None:
    m = Measurement("gloo", "all_reduce", 8, (1e4, 1e6), (2e-4, 3e-3))
    fig = plot_collective_cost("all_reduce", 8, measured=[m], highlight=("PCIe 4.0 x16", 1e8), note="gloo on CPU")
    ax = fig.axes[0]
    curves = [line for line in ax.lines if line.get_gid().startswith("link:")]
    assert [c.get_gid() for c in curves] == [f"link:{name}" for name in LINKS]
    for c in curves:
        link = LINKS[c.get_gid().removeprefix("link:")]
        xs, ys = c.get_xdata(), c.get_ydata()
        assert xs[0] == pytest.approx(1e3) and xs[-1] == pytest.approx(1e10)
        want = [collective_time("all_reduce", x, 8, link.alpha, link.beta) for x in xs]
        assert np.allclose(ys, want, rtol=1e-12)
    (star,) = [line for line in ax.lines if line.get_gid() == "highlight"]
    pcie = LINKS["PCIe 4.0 x16"]
    assert star.get_ydata()[0] == pytest.approx(collective_time("all_reduce", 1e8, 8, pcie.alpha, pcie.beta))
    (points,) = ax.collections
    assert points.get_gid() == "measured:gloo"
    assert np.allclose(points.get_offsets(), [[1e4, 2e-4], [1e6, 3e-3]])
    assert "gloo on CPU" in ax.get_title() and "14 steps" in ax.get_title()
    assert ax.get_xscale() == "log"


def test_cost_figure_with_custom_links_and_linear_axes() -> None:
    ax = plot_collective_cost("reduce_scatter", 2, {"fit": (1e-4, 1e9)}, size_range=(0, 1e6), loglog=False,
                              points=11).axes[0]
    (line,) = ax.lines
    assert line.get_ydata()[0] == pytest.approx(1e-4)  # V = 0: one step of pure latency
    assert line.get_ydata()[-1] == pytest.approx(1e-4 + 0.5e6 / 1e9)
    assert ax.get_xscale() == "linear"


def test_bus_bandwidth_factors_and_formatting() -> None:
    assert bus_bandwidth_factor("all_reduce", 8) == 1.75
    assert bus_bandwidth_factor("all_gather", 4) == bus_bandwidth_factor("all_to_all", 4) == 0.75
    assert bus_bandwidth_factor("broadcast", 16) == 1.0
    with pytest.raises(ValueError):
        bus_bandwidth_factor("gather", 4)
    assert format_bytes(4e6, digits=3) == "4 MB" and format_bytes(1500, digits=3) == "1.5 kB"
    assert format_bytes(12, digits=3) == "12 B"
    assert format_seconds(4.37e-4) == "437 µs" and format_seconds(0.0123) == "12.3 ms"


# ----------------------------------------------------------------------------------------------------------------
# The widget


def _widget(**kw: object) -> CollectiveCostWidget:
    return collective_cost_widget(draw=False, **kw)


def _model(w: CollectiveCostWidget) -> float:
    v = w.values()
    link = w.links[v["link"]]
    return collective_time(v["op"], v["size_mb"] * 1e6, v["world_size"], link.alpha, link.beta)


def test_widget_is_a_container_with_stable_descriptions() -> None:
    w = _widget()
    assert isinstance(w, W.VBox)
    for name, desc in CONTROL_DESCRIPTIONS.items():
        assert w.controls[name].description == desc, name
    assert len(set(CONTROL_DESCRIPTIONS.values())) == len(CONTROL_DESCRIPTIONS)
    assert FITTED not in w.controls["link"].options
    with pytest.raises(KeyError):
        w.set(bytes=3)
    with pytest.raises(ValueError, match="size_mb"):
        w.set(size_mb=1e9)  # the slider would clamp it


def test_prediction_is_the_model_and_scales_with_size() -> None:
    w = _widget(op="all_reduce", size_mb=100, world_size=8, link="NVLink 4 (H100)")
    t100 = w.seconds
    assert t100 == pytest.approx(14 * (3.4e-6 + 100e6 / 8 / 450e9))
    assert w.text.splitlines()[0] == f"all_reduce of 100 MB on 8 ranks over NVLink 4 (H100): {format_seconds(t100)}"
    w.set(size_mb=1000)
    t1000 = w.seconds
    assert t1000 == pytest.approx(_model(w))
    latency = 14 * 3.4e-6  # only the bandwidth term grows, linearly
    assert (t1000 - latency) == pytest.approx(10 * (t100 - latency))
    b = w.breakdown
    assert b["latency"] + b["bandwidth"] == pytest.approx(w.seconds)
    assert b["bytes_per_rank"] == collective_bytes_per_rank("all_reduce", 1e9, 8) == 1.75e9
    assert b["busbw"] == pytest.approx(b["algbw"] * 1.75)
    assert "each rank sends 1.75 GB" in w.text


def test_prediction_with_world_size_latency_grows_bandwidth_saturates() -> None:
    w = _widget(op="all_reduce", size_mb=1000, link="InfiniBand NDR 400G")
    times, bandwidth = {}, {}
    for n in (2, 8, 64, 1024):
        w.set(world_size=n)
        times[n], bandwidth[n] = w.seconds, w.breakdown["bandwidth"]
        assert w.seconds == pytest.approx(_model(w))
        assert w.breakdown["steps"] == collective_steps("all_reduce", 1e9, n)[0] == 2 * (n - 1)
        assert w.breakdown["latency"] == pytest.approx(2 * (n - 1) * 14e-6)
        assert w.breakdown["bandwidth"] == pytest.approx(2 * (n - 1) / n * 1e9 / 50e9)
    assert times[2] < times[8] < times[64] < times[1024]
    assert bandwidth[1024] / bandwidth[8] < 1.15  # the ring's bandwidth term stays below 2V/beta...
    assert times[1024] / times[8] > 1.8  # ...its 2(N-1) latencies do not


def test_prediction_with_link_and_op() -> None:
    w = _widget(op="all_gather", size_mb=1000, world_size=8)
    by_link = {}
    for name in LINKS:
        w.set(link=name)
        by_link[name] = w.seconds
        assert w.seconds == pytest.approx(_model(w))
    assert by_link["NVLink 4 (H100)"] < by_link["NVLink 3 (A100)"] < by_link["PCIe 5.0 x16"] < by_link["PCIe 4.0 x16"]
    assert by_link["InfiniBand NDR 400G"] < by_link["InfiniBand HDR 200G"]
    ag = w.seconds
    w.set(op="all_reduce")  # twice the steps and bytes of an all-gather
    assert w.seconds == pytest.approx(2 * ag)
    w.set(op="broadcast", world_size=16)
    assert w.breakdown["steps"] == 4  # binomial tree: ceil(log2 16)


def test_fitted_link_and_measured_points_in_the_figure() -> None:
    m = Measurement("ring (ours)", "all_reduce", 2, (4e3, 4e6), (5e-4, 5e-3))
    w = collective_cost_widget(world_size=2, size_mb=4, link=FITTED, fitted=(1e-4, 1e9), measured=[m],
                               note="gloo on CPU, 2 ranks", draw=True)
    assert w.controls["link"].options[-1] == FITTED
    assert w.seconds == pytest.approx(2 * (1e-4 + 2e6 / 1e9))
    assert w.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    ax = w.figure().axes[0]
    assert [c.get_gid() for c in ax.collections] == ["measured:ring (ours)"]
    assert "gloo on CPU, 2 ranks" in ax.get_title()
    assert sum(1 for line in ax.lines if line.get_gid().startswith("link:")) == len(LINKS) + 1
    png = w.image.value
    w.set(world_size=8)  # the measurements were on 2 ranks: not drawn, but said
    ax = w.figure().axes[0]
    assert not ax.collections and "all_reduce on 2 ranks" in ax.get_title()
    assert w.image.value != png


def test_user_edits_update_the_widget() -> None:
    """What a browser does: change a control's value directly (no ``set``)."""
    w = _widget(size_mb=10)
    before = w.seconds
    w.controls["size_mb"].value = 100
    assert w.seconds > before and w.seconds == pytest.approx(_model(w))
    w.controls["link"].value = "PCIe 4.0 x16"
    assert w.seconds == pytest.approx(_model(w))
    assert "PCIe 4.0 x16" in w.result.value
