"""The drift test: is a run's difference from one process rounding noise, or a bug?

A parallel run adds the same numbers in another order (other shards, micro-batches, all-reduce groupings), so it
never matches one process bit for bit. How far a *correct* run may drift is measured, never guessed: the
single-process run is trained again with other reduction orders (each step's gradient summed from 2, then from 4
micro-batches) in the candidate's own precision, and once in float64 (its own rounding error, the course's rule).
Their largest distance from the reference at each step, n_s, is what rounding alone does to this model, these
batches, this dtype. The candidate passes step s when

    |loss_s - ref_s| <= NOISE_MULTIPLE * max(n_0..n_s) + FLOOR_ULPS * u * |ref_s|      (u = 2^-24)

and its final weights likewise against the largest weight difference (``course_lib.train``'s rule: 8 times the
noise, a floor for a step whose noise is 0 by chance). A bug grows past it within a step or two (hundreds of
tolerances); noise stays under it. The verdict names the first step over. The noise is a sample, so the test is
statistical: its false-alarm rate on correct runs is measured in ``tests/test_debug.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from course_lib.model_config import GPTConfig
from course_lib.parallel.loop import ModelFn
from course_lib.train import FLOOR_ULPS, NOISE_MULTIPLE, UNIT_ROUNDOFF, TrainConfig, TrainResult, train_single

NOISE, BUG = "noise", "bug"


@dataclass(frozen=True)
class Drift:
    """Per step: the candidate's loss difference, the measured noise so far and the tolerance; the same for the
    final weights (their largest difference, on ``worst_param``); the ``verdict`` and the ``first_step`` over
    (None when the difference is noise; ``len(losses)`` when only the weights are over)."""

    diffs: list[float]
    noise: list[float]
    allowed: list[float]
    param_diff: float
    param_noise: float
    param_ratio: float
    worst_param: str
    verdict: str
    first_step: int | None

    @property
    def ratios(self) -> list[float]:
        return [d / a if a else (0.0 if d == 0 else float("inf")) for d, a in zip(self.diffs, self.allowed,
                                                                                   strict=True)]

    def describe(self) -> str:
        worst = max(self.ratios, default=0.0)
        where = "" if self.first_step is None else f", first over at step {self.first_step}"
        return (f"{self.verdict}: largest loss difference {worst:.2g} x its tolerance, weights "
                f"{self.param_ratio:.2g} x ({self.worst_param}){where}")


def noise_runs(cfg: GPTConfig, tc: TrainConfig, *, dtype: torch.dtype = torch.float32,
               model_fn: ModelFn | None = None) -> list[TrainResult]:
    """The single-process run with each step's gradient summed from 2 and from 4 micro-batches (in ``dtype``), and
    in float64: what the noise is measured from."""
    return [*(train_single(cfg, tc, model_fn, accumulation=m, dtype=dtype) for m in (2, 4)),
            train_single(cfg, tc, model_fn, dtype=torch.float64)]


def drift_test(reference: TrainResult, candidate: TrainResult, others: Sequence[TrainResult],
               start: int = 0) -> Drift:
    """``candidate`` against ``reference``, the noise from ``others`` (the reference in other reduction orders or
    precisions, same steps: ``noise_runs``): module docstring. ``start``: the step of the first loss (a resumed
    run's), for ``first_step``."""
    ref, cand = (torch.tensor(r.losses, dtype=torch.float64) for r in (reference, candidate))
    alt = [torch.tensor(r.losses, dtype=torch.float64) for r in others]
    if not others or any(t.shape != ref.shape for t in (cand, *alt)):
        raise ValueError(f"compare the same steps, with at least one noise run: {len(reference.losses)} reference "
                         f"steps, {len(candidate.losses)} candidate, {[len(r.losses) for r in others]} noise "
                         "(TrainResult.from_step for a resumed run)")
    diffs = (cand - ref).abs()
    noise = torch.stack([(a - ref).abs() for a in alt]).max(0).values
    allowed = NOISE_MULTIPLE * torch.cummax(noise, 0).values + FLOOR_ULPS * UNIT_ROUNDOFF * ref.abs()
    over = [s for s in range(len(ref)) if diffs[s] > allowed[s]]
    p_noise = max((float((r.params[k].double() - v.double()).abs().max()) for r in others
                   for k, v in reference.params.items() if v.numel()), default=0.0)
    p_ratio, worst, p_diff = 0.0, "-", 0.0
    for k, v in reference.params.items():
        if not v.numel():
            continue
        d = (candidate.params[k].double() - v.double()).abs()
        a = NOISE_MULTIPLE * p_noise + FLOOR_ULPS * UNIT_ROUNDOFF * v.double().abs()
        r = float(torch.where(d == 0, torch.zeros_like(d), d / a).max())
        if r > p_ratio:
            p_ratio, worst, p_diff = r, k, float(d.max())
    first = start + over[0] if over else (start + len(ref) if p_ratio > 1 else None)
    return Drift(diffs.tolist(), noise.tolist(), allowed.tolist(), p_diff, p_noise, p_ratio, worst,
                 BUG if first is not None else NOISE, first)
