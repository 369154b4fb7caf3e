"""Tests for course_lib.viz.schedule: the Gantt chart draws exactly the schedule's compute actions where the
timeline puts them (and the idle gaps between), and the bubble widget prints the closed formula next to the
simulator for every schedule, follows its controls, and explains invalid combinations instead of crashing."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
from matplotlib.figure import Figure

from course_lib.estimates import cost
from course_lib.parallel import schedules as S
from course_lib.parallel.schedule_run import peak_in_flight, simulate
from course_lib.viz.schedule import (
    CONTROL_DESCRIPTIONS,
    SCHEDULE_OPTIONS,
    BubbleWidget,
    bubble_widget,
    build_schedule,
    idle_intervals,
    plot_gantt,
    plot_gantts,
    uniform_stage_costs,
)

COMPUTE_LABELS = {"F", "B", "I", "W"}
CASES = [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2),
         ("zb_h1", 4, 8, 1), ("zb_h1", 2, 6, 1)]
COST_NAMES = {"gpipe": "gpipe", "1f1b": "one_f_one_b", "interleaved": "interleaved_one_f_one_b", "zb_h1": "zb_h1"}


def _boxes(fig: Figure, labels: set[str] = COMPUTE_LABELS) -> list:
    ax = fig.axes[0]
    return [bar for c in ax.containers if c.get_label() in labels for bar in c.patches]


def _widget(**values: object) -> BubbleWidget:
    w = bubble_widget(draw=False)
    if values:
        w.set(**values)
    return w


# ----------------------------------------------------------------------------------------------------------------
# The Gantt chart


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_one_box_per_compute_action_where_the_simulation_put_it(name, p, m, v):
    sim = simulate(build_schedule(name, p, m, v))
    fig = plot_gantt(sim, mode="simulated, unit costs")
    boxes = _boxes(fig)
    n_actions = sum(len(rank) for rank in build_schedule(name, p, m, v))
    assert len(boxes) == n_actions == sum(len(rank) for rank in sim.timeline) > 0
    drawn = sorted((round(b.get_y() + b.get_height() / 2), round(b.get_x(), 9), round(b.get_width(), 9))
                   for b in boxes)
    want = sorted((r, round(start, 9), round(end - start, 9)) for r, rank in enumerate(sim.timeline)
                  for start, end, _ in rank)
    assert drawn == want
    # the kinds drawn are the schedule's (ZB-H1 splits B into I and W)
    labels = {c.get_label() for c in fig.axes[0].containers} - {"idle"}
    assert labels == {a.kind.value for rank in sim.timeline for _, _, a in rank}


def test_idle_boxes_fill_every_rank_up_to_the_makespan():
    sim = simulate(S.one_f_one_b(4, 8))
    fig = plot_gantt(sim, mode="simulated, unit costs")
    idle = _boxes(fig, {"idle"})
    total_idle = sum(b.get_width() for b in idle)
    assert total_idle == pytest.approx(4 * sim.makespan - sum(sim.busy))
    assert total_idle / (4 * sim.makespan) == pytest.approx(sim.bubble_fraction)
    gaps = idle_intervals(sim.timeline)
    assert gaps[3][0] == (0.0, 3.0)  # the last rank waits for 3 forwards, then idles while the others drain
    assert gaps[3][-1][1] == sim.makespan and gaps[0][-1][1] != sim.makespan
    assert len(idle) == sum(map(len, gaps))


def test_the_mode_is_required_and_shown_and_seconds_can_be_drawn_in_ms():
    timeline = [[(0.0, 0.030, S.Action(S.Kind.F, 0, 0)), (0.095, 0.155, S.Action(S.Kind.B, 0, 0))],
                [(0.031, 0.062, S.Action(S.Kind.F, 0, 1)), (0.062, 0.094, S.Action(S.Kind.B, 0, 1))]]
    with pytest.raises(ValueError, match="how the times were produced"):
        plot_gantt(timeline, mode="")
    fig = plot_gantt(timeline, mode="measured, emulated device", title="1F1B p=2", scale=1e3, unit="ms")
    ax = fig.axes[0]
    assert "measured, emulated device" in ax.get_title(loc="left") and "1F1B p=2" in ax.get_title(loc="left")
    assert [round(b.get_width(), 6) for b in _boxes(fig, {"B"})] == [60.0, 32.0]
    assert ax.get_xlabel() == "ms" and [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("0") == 4  # each box is labelled with its micro-batch
    with pytest.raises(ValueError, match="no action"):
        plot_gantt([[], []], mode="x")


def test_stacked_panels_share_the_time_axis_and_keep_their_modes():
    sim = simulate(S.gpipe(2, 4), 0.03, 0.06)
    short = simulate(S.zb_h1(2, 4), 0.03, 0.06)
    fig = plot_gantts({"simulated, emulated costs": sim, "measured, emulated device": short}, scale=1e3, unit="ms")
    top, bottom = fig.axes[:2]
    assert top.get_xlim() == bottom.get_xlim() and top.get_xlim()[1] >= sim.makespan * 1e3
    assert top.get_title(loc="left") == "simulated, emulated costs"
    assert bottom.get_title(loc="left") == "measured, emulated device"
    assert sum(len(c) for c in bottom.containers if c.get_label() in COMPUTE_LABELS) == 2 * 4 * 3
    with pytest.raises(ValueError, match="no panels"):
        plot_gantts({})


# ----------------------------------------------------------------------------------------------------------------
# The widget: formula next to simulation


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_the_printed_bubble_is_the_formula_and_the_simulation_agrees_for_uniform_costs(name, p, m, v):
    w = _widget(schedule=name, p=p, m=m, v=v)
    want = cost.bubble_fraction(COST_NAMES[name], p, m, v)
    assert w.formula_fraction == want and w.formula_ratio == cost.bubble_ratio(COST_NAMES[name], p, m, v)
    assert w.simulated_fraction == pytest.approx(want, abs=1e-12)
    line = next(ln for ln in w.text.splitlines() if ln.startswith("bubble fraction"))
    assert line.count(f"{want:.4f}") == 2, line  # formula and simulated, printed side by side
    assert w.peaks == peak_in_flight(build_schedule(name, p, m, v))


def test_the_text_follows_p_m_v_and_the_schedule():
    w = _widget(schedule="1f1b", p=4, m=8, v=1)
    first = w.text
    assert first.splitlines()[0] == "1F1B: p = 4 ranks, m = 8 micro-batches, v = 1 (4 stages)"
    assert "formula (p-1)/(m+p-1) = 0.2727; simulated 0.2727" in first
    assert "peak micro-batches in flight per rank: 4 3 2 1 " in first
    assert "m = 8 < 4p = 16" in first

    text = w.set(m=16)  # the m >= 4p rule reached: the formula's bubble at m = 4p
    assert text != first and "m = 16 >= 4p = 16" in text and "simulated 0.1579" in text
    assert f"{cost.bubble_fraction('one_f_one_b', 4, 16):.4f}" == "0.1579"

    text = w.set(schedule="gpipe")  # same bubble, every rank holds all m micro-batches
    assert text.startswith("GPipe (AFAB): p = 4") and "simulated 0.1579" in text
    assert "in flight per rank: 16 16 16 16 " in text

    text = w.set(p=2)
    assert "p = 2 ranks" in text and "(2 stages)" in text and "= 0.0588; simulated 0.0588" in text

    assert w.controls["v"].disabled
    text = w.set(schedule="interleaved", v=2, m=8)  # (p-1)/(v*m+p-1) = 1/17
    assert not w.controls["v"].disabled
    assert "v = 2 (4 stages)" in text and "formula (p-1)/(v*m+p-1) = 0.0588; simulated 0.0588" in text
    assert "pairs in flight per rank: 5 3 = 2.5 1.5 micro-batches of a whole stage" in text
    text = w.set(v=4)
    assert "v = 4 (8 stages)" in text and f"= {1 / 33:.4f}; simulated {1 / 33:.4f}" in text

    text = w.set(schedule="zb_h1", v=1)  # (p-1)/(3m+p-1) = 1/25
    assert "formula (p-1)/(3m+p-1) = 0.0400; simulated 0.0400" in text and "(I = W = 1)" in text


def test_v_is_ignored_and_said_so_outside_interleaved():
    w = _widget(schedule="1f1b", p=4, m=8, v=3)
    assert w.controls["v"].disabled
    assert "v = 1 (4 stages) (the v slider applies to interleaved 1F1B only)" in w.text
    assert w.formula_fraction == cost.bubble_fraction("one_f_one_b", 4, 8)


def test_a_slow_last_stage_makes_the_simulated_bubble_larger_than_the_formula():
    w = _widget(schedule="1f1b", p=4, m=8, v=1, imbalance=2.0)
    assert w.simulated_fraction > w.formula_fraction + 0.05
    assert "the last stage (LM head + loss) x2: the formulas assume equal stages" in w.text
    assert w.simulation.busy[3] == pytest.approx(2 * w.simulation.busy[0])
    assert uniform_stage_costs(3, last=2.0) == [(1.0, 2.0, 1.0), (1.0, 2.0, 1.0), (2.0, 4.0, 2.0)]
    assert uniform_stage_costs(4, v=2) == [(0.5, 1.0, 0.5)] * 4


# ----------------------------------------------------------------------------------------------------------------
# The widget: invalid settings, controls, drawing


def test_invalid_combinations_show_a_message_instead_of_crashing():
    w = _widget(schedule="interleaved", p=4, m=8, v=2)
    assert w.error is None
    text = w.set(m=9)  # torch's 2 rounds of equal size do not divide 9
    assert w.error is not None and w.simulation is None and w.formula_fraction is None
    assert "invalid combination" in text and "2 rounds of equal size" in text and "Try m = 8 or 10." in text
    assert w.set(p=8, m=17).endswith("Try m = 16 or 18.")
    assert w.set(p=4, m=12).count("invalid") == 0 and w.simulation is not None  # and it recovers
    # ZB-H1 with m < p runs (the simulator times it) but its closed formula does not hold: said, not raised
    text = w.set(schedule="zb_h1", p=4, m=2)
    assert w.simulation is not None and w.formula_fraction is None
    assert "formula n/a (the ZB-H1 bubble formula holds for m >= p" in text
    with pytest.raises(KeyError, match="unknown control"):
        w.set(stages=3)
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="v must be 1"):
        build_schedule("gpipe", 2, 4, 2)


def test_interleaved_with_m_not_a_multiple_of_p_runs_in_torchs_rounds():
    """p = 4: m = 6 is one group of 6 and m = 10 two of 5 (the formula holds, more micro-batches in flight than
    groups of p); m = 3 < p runs but the formula does not hold: said, with the simulated bubble above it."""
    w = _widget(schedule="interleaved", p=4, m=6, v=2)
    assert w.error is None and w.formula_fraction == cost.bubble_fraction("interleaved_one_f_one_b", 4, 6, 2)
    assert w.simulated_fraction == pytest.approx(w.formula_fraction, abs=1e-12)
    assert "micro-batch groups through each chunk: 6 (torch's" in w.text
    assert w.peaks == [12, 11, 9, 7] and w.set(m=8) and w.peaks == [11, 9, 7, 5]
    assert "groups through each chunk: 5 + 5 " in w.set(m=10)
    text = w.set(m=3)
    assert w.simulation is not None and w.formula_fraction is None and "formula n/a" in text
    assert w.simulated_fraction > (4 - 1) / (2 * 3 + 4 - 1)


def test_controls_have_stable_descriptions_and_the_widget_its_css_class():
    w = _widget()
    assert set(w.controls) == set(CONTROL_DESCRIPTIONS)
    for name, control in w.controls.items():
        assert control.description == CONTROL_DESCRIPTIONS[name]
    assert "course-bubble" in w._dom_classes
    assert [value for _, value in w.controls["schedule"].options] == list(SCHEDULE_OPTIONS.values())
    assert (w.controls["p"].min, w.controls["m"].min, w.controls["v"].min) == (1, 1, 1)


def test_the_drawn_widget_shows_the_chart_and_clears_it_when_invalid():
    w = bubble_widget(schedule="zb_h1", p=2, m=4, v=1)
    assert w.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(_boxes(w.figure)) == 2 * 4 * 3  # F, I, W per micro-batch and rank
    assert "simulated, unit costs" in w.figure.axes[0].get_title(loc="left")
    assert "<pre" in w.html.value and "0.0769" in w.html.value
    w.set(schedule="interleaved", m=5)  # p = 2: two rounds do not divide 5
    assert w.image.value == b"" and w.figure is None and "invalid combination" in w.html.value
