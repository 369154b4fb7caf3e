"""The straggler detector names the rank slowed on the emulated device in 20 of 20 runs, finds none when no rank
is slowed, and refuses bad input."""

import pytest

from course_lib.failures.stragglers import StepTimes, find_straggler, measure_step_times
from course_lib.runtime.launch import RankError, launch
from course_lib.viz.failures import plot_step_times


def _twenty_runs(rank: int, world_size: int) -> list[int | None]:
    found = []
    for run in range(20):
        times = measure_step_times(rank, world_size, steps=5, slow_rank=run % world_size, slow=2.0, compute_s=0.06)
        s = find_straggler(times)
        found.append(None if s is None else s.rank)
    return found


def test_names_the_slowed_rank_in_20_of_20_runs():
    found = launch(_twenty_runs, 2, timeout=300)[0]
    assert found == [run % 2 for run in range(20)]


def test_no_straggler_when_a_rank_is_last_only_by_chance():
    compute = [[0.050, 0.051], [0.052, 0.050], [0.050, 0.0505], [0.051, 0.050]]
    wait = [[0.002, 0.001], [0.001, 0.003], [0.0015, 0.001], [0.001, 0.002]]
    assert find_straggler(StepTimes(compute, wait)) is None


def test_detector_reads_the_wait_not_the_rank_order():
    compute = [[0.05, 0.05, 0.08, 0.05]] * 5
    wait = [[0.031, 0.030, 0.001, 0.032]] * 5
    s = find_straggler(StepTimes(compute, wait))
    assert (s.rank, s.share) == (2, 1.0) and s.slowdown == pytest.approx(1.6)
    assert "rank 2 is the straggler" in str(s)
    # a rank whose wait is smallest in only half the steps (its median wait is the others') is not named
    half = [[0.031, 0.030, 0.001, 0.032], [0.001, 0.030, 0.031, 0.032]] * 3
    assert find_straggler(StepTimes(compute[:1] * 6, half)) is None
    assert plot_step_times(StepTimes(compute, wait), "test").axes


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="equal, non-empty"):
        StepTimes([[0.1, 0.1]], [[0.1]])
    with pytest.raises(ValueError, match="at least 2 ranks"):
        find_straggler(StepTimes([[0.1]], [[0.1]]))
    with pytest.raises(RankError, match="slow_rank=3 is not a rank of 2"):
        launch(measure_step_times, 2, slow_rank=3)
