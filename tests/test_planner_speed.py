"""The planner's search is fast because its memory model is cached in two parts (``planner_memory._stage_memory``:
the model states, shared by the three recomputations, and the activations, shared by every data-parallel split),
and because a candidate whose model states alone cannot fit is not priced (``planner_memory.states_exceed``).
These tests check that the shortcuts change nothing: the full ranked list of published runs, planned once with
the cached path and once with ``memory.training_memory`` called directly for every stage (or with nothing left
out before pricing), is the same, candidate by candidate, to the last bit of every time and memory figure."""

from dataclasses import replace

import pytest

from course_lib.estimates.memory import training_memory
from course_lib.planner import memory as PM
from course_lib.planner import published as PP
from course_lib.planner import search as P
from course_lib.planner.candidate import padded_config
from course_lib.planner.search import cluster, plan

RUNS = {r.name: r for r in PP.published_runs()}


def _direct_stage_memory(cfg, lay, micro_batch, seq_len, recompute, formula, precision="mixed"):
    """The uncached reference: ``training_memory`` of each stage that can be worst, with the candidate's own
    layout (its real m, dp, ep and ZeRO stage); under ZeRO-3 with a pipeline, the gradients of the same layout
    at ZeRO-1 (unsharded, ``zero3_with_pipeline``)."""
    def budget(stage, layout):
        return dict(training_memory(cfg, precision=precision, stage=stage, micro_batch=micro_batch, seq_len=seq_len,
                                    recompute=recompute, layout=layout, headroom=0.0,
                                    activation_formula="adapted" if formula == "flash" else "paper",
                                    dropout=formula == "paper"))

    out = []
    for stage in PM.worst_stages(lay.pp):
        parts = budget(stage, lay)
        if PM.zero3_with_pipeline(lay.zero_stage, lay.pp):
            parts["gradients"] = budget(stage, replace(lay, zero_stage=1))["gradients"]
        out.append((stage, parts))
    return tuple(out)


def _ranking(run: PP.PublishedRun) -> tuple[list[tuple], int, int]:
    res = plan(run.cfg, cluster(run.cluster, run.nodes), run.global_batch, run.seq_len, assume=run.assume,
               fixed=run.study_fixed, **run.space)
    return ([(p.candidate, p.step_s, dict(p.memory), p.mfu, p.seconds, p.reasons, p.memory.label, p.memory.notes)
             for p in res.ranked], res.considered, res.rejected_memory)


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


@pytest.mark.parametrize("name", ["BLOOM 176B", "OPT-175B", "Llama 3 405B, 128K", "Megatron-LM 462B",
                                  "Qwen3 30B-A3B"])
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
        return states, replace(states, dp=1, ep=1, zero_stage=0, cp=1), states

    _clear()
    monkeypatch.setattr(PM, "_budget_layouts", wrong)
    with pytest.raises(AssertionError):
        _same_with_direct_memory("Llama 3 405B, 128K", monkeypatch)
    _clear()


@pytest.mark.parametrize("name", sorted(RUNS))
def test_leaving_out_what_cannot_fit_ranks_exactly_as_pricing_everything_does(name, monkeypatch):
    """Every published run: the ranked list, the counts, with and without ``states_exceed`` before pricing."""
    _clear()
    fast = _ranking(RUNS[name])
    _clear()
    with monkeypatch.context() as m:
        m.setattr(P, "states_exceed", lambda *args: False)
        every = _ranking(RUNS[name])
    _clear()
    assert fast == every, name


@pytest.mark.parametrize("name", ["BLOOM 176B", "Llama 3 405B, 128K", "Qwen3 30B-A3B"])
def test_the_model_states_floor_is_below_every_candidates_memory(name):
    """The floor of ``states_exceed`` (model states of each worst stage, with headroom) never exceeds a candidate's
    budget: every ZeRO stage (with and without a pipeline), CP and EP meshes, every recomputation."""
    run = RUNS[name]
    space = {**run.space, "zero_stages": (0, 1, 2, 3)}
    cl = cluster(run.cluster, run.nodes)
    for cand in P.candidates(run.cfg, cl.world_size, run.global_batch, run.seq_len, gpus_per_node=cl.gpus_per_node,
                             **space):
        pcfg = padded_config(run.cfg, cand.tp)
        total = PM._memory(pcfg, cand, run.global_batch, run.seq_len, run.assume.attention_memory,
                           run.assume.headroom).total
        assert not PM.states_exceed(pcfg, cand.layout(run.global_batch, run.cfg.n_layer), run.assume.headroom,
                                    total), (name, cand)


def test_an_empty_plan_names_the_same_closest_candidate_with_and_without_the_floor(monkeypatch):
    """Nothing fits: the message names the candidate that comes closest, as when every candidate is priced."""
    args = ("gpt3-175b", cluster("dgx-h100", 1), 8, 4096)
    _clear()
    fast = plan(*args)
    with monkeypatch.context() as m:
        m.setattr(P, "states_exceed", lambda *a: False)
        every = plan(*args)
    assert not fast.ranked and fast.message == every.message and fast.message.startswith("no mesh fits")
    assert (fast.considered, fast.rejected_memory) == (every.considered, every.rejected_memory)
