"""How often to checkpoint: the interval that loses the least time to failures, and the goodput it leaves.

A job of N GPUs, each failing independently at ``rate`` failures per GPU-hour, fails as a whole at N x rate: its
mean time between failures is M = 1 / (N x rate) (``cluster_mtbf``). Checkpointing every tau seconds of work costs
C seconds a checkpoint; a failure loses the work since the last checkpoint and costs a restart R. Two estimates of
the best tau:

* Young, "A first order approximation to the optimum checkpoint interval" (1974): tau = sqrt(2 C M). (Per unit of
  time the run pays C / tau for checkpoints and, per failure, about tau / 2 of lost work, i.e. tau / (2 M); the sum
  is smallest at tau = sqrt(2 C M).)
* Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps" (2006):
  tau = sqrt(2 C M) [1 + (1/3) sqrt(C / (2M)) + (1/9) C / (2M)] - C for C < 2M, else tau = M.

Daly's model of the expected wall time for exponentially distributed failures (which may strike during work, a
checkpoint or a restart) gives the goodput, useful work over wall time::

    goodput(tau) = tau / (M e^(R/M) (e^((tau + C)/M) - 1))

``simulate_goodput`` draws the failures and runs that process; the formula is its expectation. A published scale
point: "The Llama 3 Herd of Models" (Meta, 2024) reports 466 job interruptions in a 54-day snapshot of pre-training
on 16,384 H100 GPUs, 419 of them unexpected (``LLAMA3_405B``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PublishedRun:
    """A published run's interruption count: ``unexpected`` failures over ``days`` on ``gpus`` GPUs."""

    name: str
    gpus: int
    days: float
    interruptions: int
    unexpected: int

    @property
    def rate_per_gpu_hour(self) -> float:
        """Unexpected failures per GPU-hour."""
        return self.unexpected / (self.gpus * self.days * 24)

    @property
    def mtbf_hours(self) -> float:
        """The job's mean time between unexpected failures, in hours."""
        return self.days * 24 / self.unexpected


LLAMA3_405B = PublishedRun("Llama 3 405B pre-training (54-day snapshot)", 16_384, 54, 466, 419)


def _positive(**values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")


def cluster_mtbf(gpus: int, rate_per_gpu_hour: float) -> float:
    """The job's mean time between failures in seconds, M = 3600 / (gpus x rate)."""
    _positive(gpus=gpus, rate_per_gpu_hour=rate_per_gpu_hour)
    return 3600.0 / (gpus * rate_per_gpu_hour)


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): tau = sqrt(2 C M), seconds of work between checkpoints."""
    _positive(cost_s=cost_s, mtbf_s=mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006): sqrt(2CM) [1 + sqrt(C/2M)/3 + (C/2M)/9] - C for C < 2M, else M."""
    _positive(cost_s=cost_s, mtbf_s=mtbf_s)
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - cost_s


def goodput(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Daly's expected useful fraction of wall time: tau / (M e^(R/M) (e^((tau+C)/M) - 1))."""
    _positive(interval_s=interval_s, mtbf_s=mtbf_s)
    if cost_s < 0 or restart_s < 0:
        raise ValueError(f"cost_s and restart_s must be >= 0, got {cost_s}, {restart_s}")
    exponent = (interval_s + cost_s + restart_s) / mtbf_s
    if exponent > 700:  # e^700 ~ 1e304: the goodput is below 1e-300, zero in any figure (and exp would overflow)
        return 0.0
    return interval_s / (mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + cost_s) / mtbf_s))


def best_interval(cost_s: float, mtbf_s: float, restart_s: float = 0.0, points: int = 4001) -> float:
    """The interval that maximises ``goodput``, by search on a log grid from C/100 to 10 M (the check on Young's
    and Daly's closed forms)."""
    _positive(cost_s=cost_s, mtbf_s=mtbf_s)
    grid = torch.logspace(math.log10(cost_s / 100), math.log10(10 * mtbf_s), points, dtype=torch.float64)
    values = [goodput(t, cost_s, mtbf_s, restart_s) for t in grid.tolist()]
    return grid[max(range(points), key=values.__getitem__)].item()


def simulate_goodput(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0,
                     work_s: float | None = None, seed: int = 0) -> float:
    """Useful work over wall time of one simulated run of ``work_s`` seconds of work (default 2000 x M): segments
    of ``interval_s`` work then a checkpoint of ``cost_s``; exponential failures (mean ``mtbf_s``) anywhere,
    restarts included, each losing the segment in progress and costing ``restart_s``."""
    _positive(interval_s=interval_s, mtbf_s=mtbf_s)
    g = torch.Generator().manual_seed(seed)
    work_s = 2000 * mtbf_s if work_s is None else work_s
    done = wall = 0.0

    def next_failure() -> float:
        return float(torch.empty(1, dtype=torch.float64).exponential_(1 / mtbf_s, generator=g))

    to_failure = next_failure()
    while done < work_s:
        segment = min(interval_s, work_s - done) + cost_s
        if to_failure >= segment:
            wall, done, to_failure = wall + segment, done + segment - cost_s, to_failure - segment
            continue
        wall += to_failure  # the segment is lost; restart (a failure during the restart starts it again)
        to_failure = next_failure()
        while to_failure < restart_s:
            wall += to_failure
            to_failure = next_failure()
        wall, to_failure = wall + restart_s, to_failure - restart_s
    return done / wall
