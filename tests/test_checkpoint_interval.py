"""How often to checkpoint: Young's and Daly's intervals against the goodput model's optimum, the model against a
simulation, the published Llama 3 numbers, the widget, and bad input refused."""

import math

import pytest

from course_lib.failures.checkpoint_interval import (
    LLAMA3_405B,
    best_interval,
    cluster_mtbf,
    daly_interval,
    goodput,
    simulate_goodput,
    young_interval,
)
from course_lib.viz.failures import GoodputWidget


def test_llama3_snapshot_gives_a_three_hour_job_mtbf():
    assert LLAMA3_405B.mtbf_hours == pytest.approx(54 * 24 / 419)
    assert cluster_mtbf(16_384, LLAMA3_405B.rate_per_gpu_hour) == pytest.approx(LLAMA3_405B.mtbf_hours * 3600)
    assert cluster_mtbf(2 * 16_384, LLAMA3_405B.rate_per_gpu_hour) == pytest.approx(LLAMA3_405B.mtbf_hours * 1800)


@pytest.mark.parametrize(("cost", "mtbf"), [(10.0, 3600.0), (60.0, 11_000.0), (300.0, 7200.0), (5.0, 1e6)])
def test_daly_is_the_models_optimum_and_young_its_first_order(cost, mtbf):
    best = best_interval(cost, mtbf)
    # the grid's step is 10^(log10(1000 M / C) / 4000) - 1, under 0.5 %: Daly's form is within a few steps of it
    assert daly_interval(cost, mtbf) == pytest.approx(best, rel=0.02)
    # Young drops terms of order sqrt(C / 2M) relative: within 2 sqrt(C / 2M) + the grid
    assert young_interval(cost, mtbf) == pytest.approx(best, rel=2 * math.sqrt(cost / (2 * mtbf)) + 0.01)
    assert goodput(daly_interval(cost, mtbf), cost, mtbf) >= goodput(young_interval(cost, mtbf), cost, mtbf) - 1e-9


def test_daly_caps_at_the_mtbf_when_a_checkpoint_costs_more_than_two_mtbfs():
    assert daly_interval(3000.0, 1000.0) == 1000.0


@pytest.mark.parametrize("tau", [300.0, 1156.0, 4000.0])
def test_the_goodput_formula_is_the_simulations_expectation(tau):
    cost, mtbf, restart = 60.0, 11_000.0, 600.0
    runs = [simulate_goodput(tau, cost, mtbf, restart, work_s=300 * mtbf, seed=s) for s in range(4)]
    mean = sum(runs) / len(runs)
    spread = max(runs) - min(runs)
    # the simulated mean of 4 x ~300 failures each; its standard error is below the runs' spread
    assert abs(mean - goodput(tau, cost, mtbf, restart)) <= spread + 1e-3


def test_simulation_without_failures_pays_only_the_checkpoints():
    assert simulate_goodput(100.0, 10.0, 1e15, work_s=1000.0) == pytest.approx(100 / 110)


def test_a_restart_cost_lowers_goodput_and_wrong_intervals_lose():
    cost, mtbf = 60.0, 11_000.0
    best = daly_interval(cost, mtbf)
    assert goodput(best, cost, mtbf, 600.0) < goodput(best, cost, mtbf)
    assert goodput(best, cost, mtbf) > goodput(best / 4, cost, mtbf)
    assert goodput(best, cost, mtbf) > goodput(best * 4, cost, mtbf)


def test_widget_reports_the_intervals_and_redraws():
    w = GoodputWidget(draw=False)
    text = w.set(gpus=1024, cost_s=30.0, restart_s=0.0)
    mtbf = cluster_mtbf(1024, LLAMA3_405B.rate_per_gpu_hour)
    assert w.best == (daly_interval(30.0, mtbf), goodput(daly_interval(30.0, mtbf), 30.0, mtbf))
    assert f"job MTBF {mtbf / 3600:.2f} h (1,024 GPUs)" in text
    assert "Young sqrt(2CM)" in text
    drawn = GoodputWidget(gpus=64)
    assert drawn.image.value[:4] == b"\x89PNG"
    with pytest.raises(KeyError, match="unknown control"):
        w.set(mtbf=3)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="gpus must be > 0"):
        cluster_mtbf(0, 1e-5)
    with pytest.raises(ValueError, match="cost_s must be > 0"):
        young_interval(0.0, 100.0)
    with pytest.raises(ValueError, match="cost_s and restart_s must be >= 0"):
        goodput(10.0, -1.0, 100.0)
