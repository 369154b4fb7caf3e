"""The planner's search is fast because its memory model is cached in two parts (``planner_memory._stage_memory``:
the model states, shared by the three recomputations, and the activations, shared by every data-parallel split).
These tests check that the shortcut changes nothing: the full ranked list of published runs, planned once with
the cached path and once with ``memory.training_memory`` called directly for every stage, is the same, candidate
by candidate, to the last bit of every time and memory figure."""

from dataclasses import replace

import pytest

from course_lib import planner_memory as PM
from course_lib import planner_published as PP
from course_lib.memory import training_memory
from course_lib.planner import cluster, plan

RUNS = {r.name: r for r in PP.published_runs()}


def _direct_stage_memory(cfg, lay, micro_batch, seq_len, recompute, formula):
    """The uncached reference: ``training_memory`` of each stage that can be worst, with the candidate's own
    layout (its real m, dp, ep and ZeRO stage); under ZeRO-3 with a pipeline, the gradients of the same layout
    at ZeRO-1 (unsharded, ``zero3_with_pipeline``)."""
    def budget(stage, layout):
        return dict(training_memory(cfg, stage=stage, micro_batch=micro_batch, seq_len=seq_len, recompute=recompute,
                                    layout=layout, headroom=0.0,
                                    activation_formula="adapted" if formula == "flash" else "paper",
                                    dropout=formula == "paper"))

    out = []
    for stage in PM.worst_stages(lay.pp):
        parts = budget(stage, lay)
        if PM.zero3_with_pipeline(lay.zero, lay.pp):
            parts["gradients"] = budget(stage, replace(lay, zero=1))["gradients"]
        out.append((stage, parts))
    return tuple(out)


def _ranking(run: PP.PublishedRun) -> tuple[list[tuple], int, int]:
    res = plan(run.cfg, cluster(run.cluster, run.nodes), run.global_batch, run.seq_len, assume=run.assume,
               fixed=run.study_fixed, **run.space)
    return ([(p.candidate, p.step_s, dict(p.memory), p.mfu, p.seconds) for p in res.ranked], res.considered,
            res.rejected_memory)


def _clear() -> None:
    PM.clear_caches()


def _same_with_direct_memory(name: str, monkeypatch) -> None:
    _clear()
    fast = _ranking(RUNS[name])
    _clear()
    with monkeypatch.context() as m:
        m.setattr(PM, "_stage_memory", _direct_stage_memory)
        direct = _ranking(RUNS[name])
    _clear()
    assert fast[1:] == direct[1:], (name, fast[1:], direct[1:])  # as many considered and rejected
    assert len(fast[0]) == len(direct[0]) and fast[0] == direct[0], name


@pytest.mark.parametrize("name", ["BLOOM 176B", "OPT-175B", "Llama 3 405B, 128K", "Megatron-LM 462B"])
def test_the_cached_memory_ranks_exactly_as_training_memory_does(name, monkeypatch):
    _same_with_direct_memory(name, monkeypatch)


@pytest.mark.slow
def test_the_cached_memory_ranks_deepseek_v3_exactly_as_training_memory_does(monkeypatch):
    _same_with_direct_memory("DeepSeek-V3", monkeypatch)


def test_a_shortcut_that_drops_what_activations_depend_on_goes_red(monkeypatch):
    """Mutation: an activations key that also forgets the context-parallel split (activations do depend on it)
    must change the ranking of the 128K run, which uses CP."""
    def wrong(lay):
        states = replace(lay, microbatches=min(lay.m, lay.pp) if lay.pp > 1 else 1)
        return states, replace(states, dp=1, ep=1, zero=0, cp=1), states

    _clear()
    monkeypatch.setattr(PM, "_budget_layouts", wrong)
    with pytest.raises(AssertionError):
        _same_with_direct_memory("Llama 3 405B, 128K", monkeypatch)
    _clear()
