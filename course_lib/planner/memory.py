"""The planner's memory of one candidate: ``memory.training_memory`` of its layout for the stages that can be worst
(the first two and the last two: under ``pp_layers.ends_split`` the middle stages hold the same blocks and fewer
micro-batches in flight), their activations scaled to the schedule's own peak in flight (``peak_in_flight``, as
``schedule_run.peak_in_flight`` counts them: interleaved 1F1B holds 1 + (p-1)/(p v) times 1F1B's on rank 0, as
Korthikanti et al. 2022 state; ZB-H1 holds p on every rank until its W).

The search prices thousands of candidates that share most of their memory, so a stage's budget is computed in
two cached parts (``_stage_memory``): the model states, the same for the three recomputations, and the
activations, the same for every data-parallel split. Before any of that, ``states_exceed`` drops a candidate whose
model states alone (``memory.zero_memory_per_device``) cannot fit. ``tests/test_planner_speed.py`` checks that the
ranking is the one ``training_memory`` called directly for every stage gives.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Literal

from course_lib.estimates.activation_memory import Recompute
from course_lib.estimates.layout import ParallelLayout, params_per_rank
from course_lib.estimates.memory import training_memory
from course_lib.estimates.memory_budget import MemoryBudget
from course_lib.estimates.model_states import bytes_per_param, zero_memory_per_device
from course_lib.model_config import GPTConfig
from course_lib.planner.candidate import Candidate, zero3_with_pipeline

Formula = Literal["flash", "paper"]
Precision = Literal["mixed", "bf16"]


def peak_in_flight(schedule: str, p: int, m: int, v: int = 1) -> list[int]:
    """Per rank r, the most (chunk, micro-batch) activations held at once, in closed form: 1F1B min(p - r, m);
    interleaved min(2(p-1-r) + (v-1)p + 1, m v) (its warm-up forwards and the one in steady state); ZB-H1
    min(p, m) on every rank (a micro-batch is held until its W). ``schedule_run.peak_in_flight`` of the library's
    schedules gives the same numbers (tests/test_planner.py checks it)."""
    if schedule == "interleaved":
        return [min(2 * (p - 1 - r) + (v - 1) * p + 1, m * v) for r in range(p)]
    if schedule == "zb_h1":
        return [min(p, m)] * p
    return [min(p - r, m) for r in range(p)]


@lru_cache(maxsize=10_000)
def _in_flight_factor(schedule: str, p: int, m: int, v: int) -> list[float]:
    """Per rank: the schedule's peak activations in flight over 1F1B's min(p - r, m) (whole-stage units)."""
    return [peak / v / min(p - r, m) for r, peak in enumerate(peak_in_flight(schedule, p, m, v))]


STATE_PARTS = ("parameters", "gradients", "optimizer_state", "communication")
"""The parts of a stage's budget that recomputation does not change (the others: activations, temporary)."""


@lru_cache(maxsize=100_000)
def _budgets(cfg: GPTConfig, lay: ParallelLayout, micro_batch: int, seq_len: int, recompute: Recompute,
             formula: Formula, precision: Precision = "mixed") -> tuple[dict[str, float], ...]:
    """``training_memory`` without headroom of each of the ``worst_stages`` of ``lay``, by part."""
    return tuple(dict(training_memory(cfg, precision=precision, stage=stage, micro_batch=micro_batch,
                                      seq_len=seq_len, recompute=recompute, layout=lay, headroom=0.0,
                                      activation_formula="adapted" if formula == "flash" else "paper",
                                      dropout=formula == "paper"))
                 for stage in worst_stages(lay.pp))


@lru_cache(maxsize=10_000)
def _budget_layouts(lay: ParallelLayout) -> tuple[ParallelLayout, ParallelLayout, ParallelLayout]:
    """The keys of ``_stage_memory``'s calls: ``lay`` with m capped at pp; that with dp = ep = 1, ZeRO-0 (the
    activations); the layout whose gradients the stage holds (ZeRO-1's, unsharded, under
    ``zero3_with_pipeline``; else the first)."""
    states = replace(lay, microbatches=min(lay.m, lay.pp) if lay.pp > 1 else 1)
    grads = replace(states, zero_stage=1) if zero3_with_pipeline(lay.zero_stage, lay.pp) else states
    return states, replace(states, dp=1, ep=1, zero_stage=0), grads


def worst_stages(pp: int) -> list[int]:
    """The stages that can be worst: the first two and the last two (under ``pp_layers.ends_split`` the middle
    stages hold the same blocks as the second and fewer micro-batches in flight)."""
    return sorted({0, min(1, pp - 1), max(pp - 2, 0), pp - 1})


@lru_cache(maxsize=100_000)
def _stage_memory(cfg: GPTConfig, lay: ParallelLayout, micro_batch: int, seq_len: int, recompute: Recompute,
                  formula: Formula, precision: Precision = "mixed") -> tuple[tuple[int, dict[str, float]], ...]:
    """``training_memory`` of each of the ``worst_stages`` without headroom, by part, from two cached calls (three
    under ``zero3_with_pipeline``): the model states and buffers (``STATE_PARTS``: they do not depend on
    recomputation, so one call serves the three) and the activations and temporaries (they depend on neither dp,
    ep nor ZeRO, so one call with dp = ep = 1, ZeRO-0 serves every data-parallel split; without recomputation the
    model states' call has them already). A stage's budget sees m only through its micro-batches in flight,
    min(pp - stage, m) (1 when pp = 1), so m is capped at pp in both keys."""
    states_key, acts_key, grads_key = _budget_layouts(lay)
    states_all = _budgets(cfg, states_key, micro_batch, seq_len, "none", formula, precision)
    acts_all = states_all if recompute == "none" else _budgets(cfg, acts_key, micro_batch, seq_len, recompute,
                                                               formula, precision)
    grads_all = states_all if grads_key is states_key else _budgets(cfg, grads_key, micro_batch, seq_len, "none",
                                                                    formula, precision)
    return tuple([(stage, {k: (grads if k == "gradients" else states if k in STATE_PARTS else acts)[k]
                           for k in states})
                  for stage, states, acts, grads in zip(worst_stages(lay.pp), states_all, acts_all, grads_all,
                                                        strict=True)])


def _memory(cfg: GPTConfig, cand: Candidate, global_batch: int, seq_len: int, formula: Formula,
            headroom: float, precision: Precision = "mixed", dense_layers: int = 0) -> MemoryBudget:
    """The budget of ``cand``'s worst stage: each stage's activations x its schedule's ``_in_flight_factor``, plus
    ``headroom`` x the rest."""
    lay = cand.layout(global_batch, cfg.n_layer, dense_layers)
    factors = _in_flight_factor(cand.schedule, cand.pp, lay.m, cand.v) if cand.pp > 1 else (1.0,)
    worst, worst_total = None, 0.0
    for stage, budget in _stage_memory(cfg, lay, cand.micro_batch, seq_len, cand.recompute, formula,
                                       precision):
        parts = dict(budget)
        parts["activations"] *= factors[stage]
        parts["headroom"] = headroom * sum(parts.values())
        total = sum(parts.values())
        if worst is None or total > worst_total:
            worst, worst_total = (stage, parts), total
    stage, parts = worst
    return MemoryBudget(parts, label=f"{cfg.name} | {cand} | per GPU",
                        notes=[f"activations: {formula}", f"precision: {precision}",
                               f"worst pipeline stage: {stage} of {cand.pp}"])


PARAM_BYTES = {p: bytes_per_param(p, "adamw") for p in ("mixed", "bf16")}
"""Bytes per parameter of what ``_budgets`` prices (AdamW, by ``Precision``)."""


@lru_cache(maxsize=10_000)
def stage_params(cfg: GPTConfig, tp: int, pp: int, ep: int, split: tuple[int, ...] | None,
                 dense: tuple[int, ...] | None, stage: int) -> dict[str, float]:
    """``layout.params_per_rank`` of pipeline stage ``stage``: it reads only tp, pp, ep and the (dense) blocks per
    stage of a layout (not dp, cp, ZeRO or m), so one call serves every layout that shares them."""
    return params_per_rank(cfg, ParallelLayout(dp=ep, tp=tp, pp=pp, ep=ep, split=split, dense=dense), stage)


@lru_cache(maxsize=100_000)
def _states_floor(cfg: GPTConfig, tp: int, pp: int, ep: int, split: tuple[int, ...] | None,
                  dense_blocks: tuple[int, ...] | None, n_dense: int, zero: int,
                  precision: Precision = "mixed") -> float:
    """The largest model states of the ``worst_stages`` of a layout: ZeRO's (2 + 2 + K) bytes per parameter, the
    parts of stage z sharded over N_d ranks (``memory.zero_memory_per_device``, Rajbhandari et al. 2020, Sec. 5),
    N_d = dp x cp = ``n_dense`` for the dense parameters and dp x cp / ep for the experts (``stage_params``)."""
    pb = PARAM_BYTES[precision]
    floor = 0.0
    for stage in worst_stages(pp):
        counts = stage_params(cfg, tp, pp, ep, split, dense_blocks, stage)
        dense = counts["embedding"] + counts["blocks"] + counts["head"]
        states = (zero_memory_per_device(dense, pb.optimizer, n_dense, zero, pb.params, pb.grads)
                  + zero_memory_per_device(counts["experts"], pb.optimizer, n_dense // ep, zero, pb.params, pb.grads))
        floor = max(floor, states)
    return floor


FLOOR_MARGIN = 1e-9
"""Relative slack of ``states_exceed``: the floor sums the same parts as ``training_memory`` in another order, so
it can exceed their sum by a few ulps (~1e-16 relative); 1e-9 absorbs that and is far below any real margin."""


def states_exceed(cfg: GPTConfig, lay: ParallelLayout, headroom: float, usable: float,
                  precision: Precision = "mixed") -> bool:
    """True when the model states of one stage of ``lay`` alone, with the budget's headroom, exceed ``usable``
    bytes: a lower bound of ``_memory``'s total (its worst stage adds activations, temporaries and buffers, and
    under ``zero3_with_pipeline`` holds its gradients whole), so such a candidate cannot fit and is not priced."""
    floor = _states_floor(cfg, lay.tp, lay.pp, lay.ep, lay.split, lay.dense, lay.dp * lay.cp, lay.zero_stage, precision)
    return (floor + headroom * floor) * (1 - FLOOR_MARGIN) > usable


def clear_caches() -> None:
    """Empty the memory caches of this module (a benchmark's fresh start; the tests' check of the shortcuts)."""
    for cached in (_budgets, _stage_memory, stage_params, _states_floor):
        cached.cache_clear()
