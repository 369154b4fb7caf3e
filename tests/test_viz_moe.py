"""course_lib.viz.moe: the dispatch arithmetic (capacity, drops, rows per rank, bytes), the figures, and the
widget driven from the kernel side. Pure and fast (Agg, no ranks)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from matplotlib.figure import Figure

from course_lib.viz import moe as vm


def test_routed_counts_even_and_skewed():
    even = vm.routed_counts(4096, 8, 2, skew=0.0)
    skewed = vm.routed_counts(4096, 8, 2, skew=2.0)
    assert sum(even) == sum(skewed) == 8192
    assert max(even) < 1.15 * 8192 / 8  # an even router: every expert near T*k/E
    assert skewed[0] > 3 * 8192 / 8 and skewed[-1] < 8192 / 8 / 10
    assert vm.routed_counts(100, 4, 1, 1.0, seed=3) == vm.routed_counts(100, 4, 1, 1.0, seed=3)
    with pytest.raises(ValueError, match="top_k"):
        vm.routed_counts(10, 4, 5, 0.0)


def test_dispatch_plan_by_hand():
    plan = vm.dispatch_plan([30, 10, 5, 3], n_tokens=24, top_k=2, ep=2, capacity_factor=1.0, d_model=8,
                            element_size=2)
    assert plan.capacity == 12  # ceil(1.0 * 24 * 2 / 4)
    assert plan.kept == [12, 10, 5, 3] and plan.dropped == 18
    assert plan.rank_rows == [22, 8] and plan.slowest == 22 and plan.mean == 15
    assert plan.bytes_per_step == 4 * 30 * 8 * 2 and plan.leaving_bytes_per_step == plan.bytes_per_step / 2
    dropless = vm.dispatch_plan([30, 10, 5, 3], 24, 2, 4, None)
    assert dropless.capacity is None and dropless.dropped == 0 and dropless.rank_rows == [30, 10, 5, 3]
    with pytest.raises(ValueError, match="divide"):
        vm.dispatch_plan([1, 2, 3], 3, 2, 2, 1.0)


def test_figures():
    fig = vm.plot_dispatch(vm.dispatch_plan(vm.routed_counts(512, 16, 2, 1.0), 512, 2, 4, 1.0))
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    assert any("capacity" in t.get_text() for t in fig.axes[0].get_legend().get_texts())
    runs = {"without": [[5, 1, 1, 1], [6, 1, 1, 0]], "with": [[2, 2, 2, 2]] * 2}
    load = vm.plot_expert_load(runs)
    assert len(load.axes) == 4  # two heat maps, their colour bar, the max/mean panel
    assert [vm.load_ratio(c) for c in runs["without"]] == [2.5, 3.0] and vm.load_ratio([2, 2, 2, 2]) == 1.0
    assert [line.get_ydata()[1] for line in load.axes[-1].get_lines()[:2]] == [3.0, 1.0]
    with_entropy = vm.plot_expert_load(runs, {"without": [0.9, 0.8], "with": [1.38, 1.38]})
    assert len(with_entropy.axes) == 5
    chosen = torch.tensor([[0, 1], [0, 2], [0, 1]])
    keep = torch.tensor([[True, True], [True, True], [False, True]])
    grid = vm.plot_routing_grid(chosen, keep, 3, 2)
    assert [t.get_text() for t in grid.axes[0].texts] == ["0", "0", "1", "0", "2", "1"]


def test_widget_text_follows_the_controls():
    w = vm.moe_dispatch_widget(draw=False)
    assert set(w.controls) == set(vm.CONTROL_DESCRIPTIONS)
    text = w.set(n_expert=8, top_k=2, capacity_factor=1.0, ep=4, skew=0.0)
    assert "C = ceil(1.0 x 4096 x 2 / 8) = 1024" in text
    even = w.plan
    w.set(skew=2.0)
    assert w.plan.dropped > even.dropped and w.plan.slowest / w.plan.mean > even.slowest / even.mean
    assert "dropless" in w.set(capacity_factor=None) and w.plan.dropped == 0
    assert w.set(ep=1).count("1.00x") == 1  # one rank: it is the mean
    with pytest.raises(KeyError):
        w.set(experts=4)


def test_widget_draws_a_png():
    w = vm.moe_dispatch_widget(n_expert=16, skew=1.0)
    assert w.image.value[:4] == b"\x89PNG"
    before = w.image.value
    w.controls["ep"].value = 2  # a learner's change redraws
    assert w.image.value != before
