"""Chapter 11's pictures: the collective timelines (the desync's calls marked, a stuck call hatched, the group
filter and window of the widget, driven as a learner would) and the drift figure."""

from __future__ import annotations

import pytest

from course_lib.debug.desync import first_desync
from course_lib.debug.drift import Drift
from course_lib.grading.ch11 import SCENARIOS, as_traces
from course_lib.train import TrainResult
from course_lib.viz.debug import plot_drift, plot_timelines, timeline_widget


@pytest.fixture
def hung():
    traces = as_traces(*SCENARIOS["extra_gather"]())
    return traces, first_desync(traces)


def _edges(fig):
    return [(round(p.get_x()), round(-p.get_y() - 0.35), p.get_edgecolor()[:3], p.get_linestyle(), p.get_hatch())
            for p in fig.axes[0].patches]


def test_timelines_mark_the_wrong_call_its_peers_and_the_stuck_calls(hung):
    traces, desync = hung
    fig = plot_timelines(traces, desync, window=4)
    boxes = _edges(fig)
    assert len(boxes) == sum(len(t.entries) for t in traces) == 10
    red = [(x, row, style) for x, row, color, style, _ in boxes if color == (1.0, 0.0, 0.0)]
    assert red == [(3, 0, "-"), (3, 1, "--")]  # rank 0's all_gather, rank 1's all_reduce at that position
    assert sum(h == "///" for *_, h in boxes) == 4  # every rank's last call never returned
    assert "wrong: rank(s) [0]" in fig.axes[0].get_title()


def test_timeline_widget_filters_by_group_and_window(hung):
    traces, desync = hung
    panel = timeline_widget(traces, desync, window=8)
    assert panel.text.splitlines()[0] == "4 ranks, 8 calls each (every group)"
    assert bytes(panel.image.value).startswith(b"\x89PNG")
    text = panel.set(group="dp", window=4)
    assert text.splitlines()[0] == "4 ranks, 4 calls each (dp)"
    assert [ln.split(":")[0] for ln in text.splitlines()[1:-1]] == ["rank 2", "rank 3"]  # only they called dp
    assert "first desync: collective #2 of group tp" in text
    with pytest.raises(KeyError):
        panel.set(ranks=2)


def test_drift_figure_draws_both_panels():
    drift = Drift([0.0, 1e-3], [1e-7, 2e-7], [1e-6, 2e-6], 1e-3, 1e-7, 10.0, "w", "bug", 1)
    fig = plot_drift(TrainResult([5.5, 5.4], {}), TrainResult([5.5, 5.3], {}), drift, "a run")
    left, right = fig.axes
    assert len(left.lines) == 2 and len(right.lines) == 3 and right.get_yscale() == "log"
    assert right.get_title() == "drift test: bug"
