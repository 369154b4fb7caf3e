"""The planner: its properties (every ranked candidate fits, GPU counts match, each schedule's bubble is
``cost.bubble_ratio``, its memory follows the library's schedules, refusals), the rule for uneven stages and the
library's pipeline cutting it, vocabulary padding, topology that changes the answer, and one clear error for
every empty or impossible question. The published runs are in tests/test_planner_published.py."""

import dataclasses

import pytest

from course_lib.estimates import cost
from course_lib.estimates.memory_budget import GiB
from course_lib.model_config import PRESETS, GPTConfig
from course_lib.parallel import schedule_run as R
from course_lib.parallel import schedules as S
from course_lib.parallel.pp_layers import ends_split, layer_split
from course_lib.planner import search as P
from course_lib.planner.model import padded_vocab, peak_in_flight
from course_lib.runtime.mesh import MeshShape

SMALL = dict(zero_stages=(1,), recomputes=("selective",), micro_batches=(1, 2))


@pytest.fixture(scope="module")
def llama70b_64_nodes():
    return P.plan("llama3-70b", P.cluster("dgx-h100", 64), 64, 32768, zero_stages=(1,),
                  recomputes=("selective", "full"), micro_batches=(1,))


# ------------------------------------------------------------------------------------------------ properties


def test_every_ranked_candidate_fits_and_uses_the_whole_cluster(llama70b_64_nodes):
    res = llama70b_64_nodes
    assert res.ranked and res.rejected_memory > 0 and res.considered == len(res.ranked) + res.rejected_memory
    for p in res.ranked:
        c = p.candidate
        assert p.fits and p.memory.total <= P.H100.bytes
        assert c.dp * c.tp * c.pp * c.cp == 512 and c.tp <= 8  # TP inside the node (step 2)
    assert [p.step_s for p in res.ranked] == sorted(p.step_s for p in res.ranked)


def test_the_512_gpu_70b_32k_example_is_a_top_candidate(llama70b_64_nodes):
    assert llama70b_64_nodes.place(tp=8, pp=4, cp=4, dp=4) is not None
    best = llama70b_64_nodes.ranked[0].candidate
    assert best.cp > 1  # 32K tokens need context parallelism


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb_h1", 1)])
def test_the_bubble_of_every_schedule_is_cost_bubble_ratio(schedule, v):
    cfg = PRESETS["llama2-70b"]
    cl = P.cluster("dgx-h100", 16)
    cand = P.Candidate(dp=4, tp=8, pp=4, micro_batch=1, schedule=schedule, v=v)
    p = P.predict(cfg, cl, 64, 4096, cand)
    s, m = p.seconds, 64 // 4
    name = {"1f1b": "one_f_one_b", "interleaved": "interleaved_one_f_one_b", "zb_h1": "zb_h1"}[schedule]
    ratio = cost.bubble_ratio(name, 4, m, v)
    assert s["pp_bubble"] == pytest.approx(ratio * (s["compute"] + s["tp"] + s["cp"] + s["ep"]))
    assert p.step_s == pytest.approx(sum(s.values()))
    assert p.tokens_per_s == pytest.approx(64 * 4096 / p.step_s)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_activations_in_flight_are_the_library_schedules(p):
    for m in (p, 2 * p, 4 * p):
        assert peak_in_flight("1f1b", p, m) == R.peak_in_flight(S.one_f_one_b(p, m))
        assert peak_in_flight("zb_h1", p, m) == R.peak_in_flight(S.zb_h1(p, m))
        for v in (2, 3):
            assert peak_in_flight("interleaved", p, m, v) == R.peak_in_flight(S.interleaved_one_f_one_b(p, m, v))


def test_interleaving_costs_memory_and_saves_bubble():
    cfg, cl = PRESETS["llama2-70b"], P.cluster("dgx-h100", 16)
    one, inter = (P.predict(cfg, cl, 64, 4096, P.Candidate(dp=4, tp=8, pp=4, schedule=s, v=v))
                  for s, v in (("1f1b", 1), ("interleaved", 2)))
    assert inter.memory["activations"] > one.memory["activations"]
    # rank 0 holds 1 + (p-1)/(p v) times 1F1B's activations (Korthikanti et al. 2022): 1 + 3/8
    assert inter.memory["activations"] / one.memory["activations"] == pytest.approx(1 + 3 / 8, rel=0.02)
    assert inter.seconds["pp_bubble"] < one.seconds["pp_bubble"]


def test_zero_2_with_a_pipeline_is_refused_and_priced_per_micro_batch():
    cfg = PRESETS["llama2-7b"]
    cands = list(P.candidates(cfg, 16, 64, 4096, zero_stages=(2,), recomputes=("selective",)))
    assert cands and all(c.pp == 1 for c in cands)
    assert P.refusal(cfg, P.Candidate(dp=8, tp=1, pp=2, zero_stage=2), 8).startswith("ZeRO-2 with pipeline parallelism")
    # ZeRO-2's reduce-scatter runs once per micro-batch: more micro-batches, more exposed DP time than ZeRO-1
    cl = P.cluster("pcie-h100-ethernet", 2)
    one, two = (P.predict(cfg, cl, 64, 4096, P.Candidate(dp=16, tp=1, pp=1, zero_stage=z, micro_batch=1))
                for z in (1, 2))
    assert two.seconds["dp"] > 2 * one.seconds["dp"]


def test_zero_3_with_a_pipeline_is_planned_in_torchtitans_form_with_or_without_the_library_rules():
    cfg = PRESETS["llama2-7b"]
    space = dict(zero_stages=(3,), recomputes=("selective",))
    free = list(P.candidates(cfg, 16, 64, 4096, **space))
    assert any(c.pp > 1 for c in free) and P.refusal(cfg, P.Candidate(dp=8, tp=1, pp=2, zero_stage=3), 8) == ""
    ruled = list(P.candidates(cfg, 16, 64, 4096, library_rules=True, **space))
    assert any(c.pp > 1 for c in ruled)  # the library composes it in the same form (parallel.fsdp2_pipeline)
    assert P.library_refusal(cfg, P.Candidate(dp=8, tp=1, pp=2, zero_stage=3), 64, 4096) == ""
    # memory: the stage's gradients whole (ZeRO-1's), its parameters and optimizer state sharded (ZeRO-3's)
    cl = P.cluster("pcie-h100-ethernet", 2)
    mem = {z: P.predict(cfg, cl, 64, 4096, P.Candidate(dp=8, tp=1, pp=2, zero_stage=z)).memory for z in (1, 3)}
    assert mem[3]["gradients"] == mem[1]["gradients"]
    assert mem[3]["parameters"] == pytest.approx(mem[1]["parameters"] / 8)
    assert mem[3]["optimizer_state"] == mem[1]["optimizer_state"]
    # traffic (no overlap): ZeRO-1 sends RS + AG once; ZeRO-3 x PP gathers twice per micro-batch and
    # reduce-scatters once: dp(m) = 2 m AG + RS
    no_overlap = P.Assumptions(grad_overlap=0.0, zero3_overlap=0.0)

    def dp_s(zero: int, batch: int) -> tuple[float, int]:
        c = P.Candidate(dp=8, tp=1, pp=2, zero_stage=zero)
        return P.predict(cfg, cl, batch, 4096, c, no_overlap).seconds["dp"], c.microbatches(batch)

    (z3a, m_a), (z3b, m_b), (z1, _) = dp_s(3, 32), dp_s(3, 64), dp_s(1, 32)
    ag = (z3b - z3a) / (2 * (m_b - m_a))
    assert ag > 0 and z1 - ag == pytest.approx(z3a - 2 * m_a * ag, rel=1e-9)  # the same RS, once per step


def test_tp_overlap_is_an_explicit_assumption_off_by_default():
    cfg, cl = PRESETS["llama2-70b"], P.cluster("dgx-h100", 2)
    cand = P.Candidate(dp=2, tp=8, pp=1, recompute="full")
    off, half = (P.predict(cfg, cl, 16, 4096, cand, P.Assumptions(tp_overlap=x)) for x in (0.0, 0.5))
    assert P.Assumptions().tp_overlap == 0.0
    assert half.seconds["tp"] == pytest.approx(off.seconds["tp"] / 2)


def test_causal_attention_is_halved_and_full_attention_mfu_counts_it_whole():
    cfg, cl = PRESETS["llama3-8b"], P.cluster("dgx-h100", 1)
    p = P.predict(cfg, cl, 8, 8192, P.Candidate(dp=8, tp=1, pp=1))
    attn = 2 * cfg.d_model * 8192 * cfg.n_layer * 3  # causal: half of 12 L h s per token
    extra = attn * 8 * 8192 / (p.step_s * 8 * P.H100.peak_flops)
    assert p.mfu_full_attention - p.mfu == pytest.approx(extra)


def test_flash_memory_has_no_score_matrix_and_the_paper_formula_is_an_option():
    cfg, cl = PRESETS["llama2-7b"], P.cluster("dgx-h100", 1)
    cand = P.Candidate(dp=8, tp=1, pp=1, recompute="none")
    flash = P.predict(cfg, cl, 8, 4096, cand)
    paper = P.predict(cfg, cl, 8, 4096, cand, P.Assumptions(attention_memory="paper"))
    # the paper's 5 a s / h term: 5 * 32 * 4096 bytes per token and layer, 2.5 GiB a layer at 4096 tokens
    assert paper.memory["activations"] - flash.memory["activations"] > 32 * 5 * 32 * 4096 * 4096 * 0.9


def test_expert_parallelism_crosses_the_links_it_really_uses():
    cfg = PRESETS["mixtral-8x7b"]
    cl = P.cluster("dgx-h100", 2)
    inside = P.predict(cfg, cl, 64, 4096, P.Candidate(dp=16, tp=1, pp=1, ep=8))   # 8 EP ranks on one node
    across = P.predict(cfg, cl.with_nodes(2), 64, 4096, P.Candidate(dp=16, tp=1, pp=1, ep=8),
                       P.Assumptions(node_limit=1))
    assert inside.seconds["ep"] > 0 and across.seconds["ep"] == pytest.approx(inside.seconds["ep"])
    hidden = P.predict(cfg, cl, 64, 4096, P.Candidate(dp=16, tp=1, pp=1, ep=8), P.Assumptions(ep_overlap=1.0))
    assert hidden.seconds["ep"] == 0.0
    # each rank holds n_expert / ep experts: less memory with more EP
    ep1 = P.predict(cfg, cl, 64, 4096, P.Candidate(dp=16, tp=1, pp=1, ep=1))
    assert inside.memory["parameters"] < ep1.memory["parameters"] / 4


# ------------------------------------------------------------------------------------------------ uneven stages, vocab


def test_ends_split_takes_the_shortfall_from_the_ends():
    assert ends_split(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B on 16 stages
    assert ends_split(61, 16) == [3] + [4] * 13 + [3, 3]
    assert ends_split(96, 12) == [8] * 12
    for n_layer, n in [(70, 12), (105, 35), (5, 4), (7, 7)]:
        split = ends_split(n_layer, n)
        assert sum(split) == n_layer and max(split) - min(split) <= 1 and layer_split(n_layer, n, split) == split
    with pytest.raises(ValueError, match="at least one block each"):
        ends_split(3, 4)


def test_uneven_pipelines_are_planned_and_memory_counts_every_stage():
    cfg = dataclasses.replace(PRESETS["llama3-70b"], n_layer=78, name="llama3-78-layers")
    res = P.plan(cfg, P.cluster("dgx-h100", 8), 64, 8192, fixed={"pp": 8}, **SMALL)
    assert res.ranked and all(p.candidate.pp == 8 for p in res.ranked)
    assert res.ranked[0].candidate.split(78) == ends_split(78, 8)


def test_the_library_pipeline_cuts_the_planners_split_and_trains_like_one_process():
    from course_lib.parallel.runs import merge_results, train_pp
    from course_lib.runtime.launch import launch
    from course_lib.train import TrainConfig, assert_parity, train_baseline

    cfg = GPTConfig(vocab_size=256, seq_len=8, n_layer=3, n_head=2, d_model=16, bias=False)
    tc = TrainConfig(steps=2, global_batch=4, optimizer="adamw", lr=1e-3, seed=0)
    split = P.Candidate(dp=1, tp=1, pp=2).split(cfg.n_layer)
    assert split == [2, 1]
    results = launch(train_pp, 2, cfg, tc, microbatches=2, split=split, timeout=120)
    assert [len(r.params) for r in results] and results[0].stages != results[1].stages
    assert_parity(train_baseline(cfg, tc), merge_results(results))


def test_the_vocabulary_is_padded_as_megatron_pads_it():
    assert padded_vocab(50257, 8) == 51200 and padded_vocab(131072, 8) == 131072 and padded_vocab(32000, 1) == 32000
    cands = list(P.candidates(PRESETS["gpt3-175b"], 64, 64, 2048, zero_stages=(1,), recomputes=("full",),
                              micro_batches=(1,), fixed={"tp": 8}))
    assert cands  # 50257 does not divide by 8: padded to 51200, the mesh is valid
    for c in cands:
        MeshShape(dp=c.dp, tp=c.tp, pp=c.pp, cp=c.cp).validate(
            dataclasses.replace(PRESETS["gpt3-175b"], vocab_size=51200), global_batch=64,
            micro_batch=c.micro_batch, uneven_layers=True)


def test_two_clusters_with_the_same_gpus_but_different_links_prefer_different_meshes():
    fast = P.plan("llama2-7b", P.cluster("dgx-h100", 2), 64, 4096).best()
    slow = P.plan("llama2-7b", P.cluster("pcie-h100-ethernet", 2), 64, 4096).best()
    assert (fast.candidate.dp, fast.candidate.pp, fast.candidate.cp) != (slow.candidate.dp, slow.candidate.pp,
                                                                         slow.candidate.cp)
    assert slow.mfu < fast.mfu


def test_presets_come_from_the_hardware_catalogue():
    from course_lib.estimates.hardware import GPUS, LINKS

    assert P.CLUSTERS["hgx-h800"].gpu is GPUS["H800 80GB"] and P.CLUSTERS["hgx-h800"].intra is LINKS["NVLink 4 (H800)"]
    assert P.CLUSTERS["dgx-a100-40gb"].gpu is GPUS["A100 40GB"]
    assert P.CLUSTERS["dgx-a100-80gb"].inter is LINKS["InfiniBand HDR 200G"]
    assert all(c.source for c in P.CLUSTERS.values())


# ------------------------------------------------------------------------------------------------ clear errors


def test_a_model_that_fits_nowhere_says_how_far_the_closest_is():
    res = P.plan("llama2-70b", P.cluster("dgx-h100", 1), 8, 4096, fixed={"tp": 1, "pp": 1, "cp": 1})
    assert res.ranked == [] and res.rejected_memory == res.considered > 0
    assert "no mesh fits: the closest" in res.message and "x the memory per GPU" in res.message
    assert "raise the number of nodes" in res.message
    need = float(res.message.split("needs ")[1].split("x")[0])
    assert need > 1
    with pytest.raises(ValueError, match="no mesh fits"):
        res.best()


def test_no_valid_mesh_names_the_constraint():
    with pytest.raises(ValueError, match=r"no valid mesh with fixed=\{'pp': 16\}.*n_layer=6"):
        P.plan(GPTConfig(n_layer=6, n_head=4, d_model=64), P.cluster("dgx-h100", 2), 16, 32, fixed={"pp": 16})
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 16"):
        P.plan("llama2-7b", P.cluster("dgx-h100", 1), 8, 4100, fixed={"cp": 8})


@pytest.mark.parametrize("key", ["tpp", "zero", "nodes"])
def test_unknown_fixed_keys_are_named(key):
    with pytest.raises(ValueError, match=rf"fixed has unknown key\(s\) \['{key}'\]"):
        P.plan("llama2-7b", P.cluster("dgx-h100", 1), 8, 4096, fixed={key: 2})


def test_fixed_ep_and_zero_are_honoured():
    res = P.plan("mixtral-8x7b", P.cluster("dgx-h100", 2), 64, 4096, fixed={"ep": 8, "zero_stage": 1}, **SMALL)
    assert res.ranked and all(p.candidate.ep == 8 and p.candidate.zero_stage == 1 for p in res.ranked)


@pytest.mark.parametrize("nodes", [0, -1, 1.5, True])
def test_bad_node_counts_are_named(nodes):
    with pytest.raises(ValueError, match="nodes must be an int >= 1"):
        P.cluster("dgx-h100", nodes)
    with pytest.raises(ValueError, match="nodes must be an int >= 1"):
        P.Cluster("mine", nodes, 8, P.H100, P.CLUSTERS["dgx-h100"].intra, P.CLUSTERS["dgx-h100"].inter)


@pytest.mark.parametrize("space, needle", [
    (dict(micro_batches=(0,)), r"micro_batches must hold ints >= 1, got 0"),
    (dict(micro_batches=()), "micro_batches is empty"),
    (dict(zero_stages=(4,)), r"zero_stages must hold values of \(0, 1, 2, 3\), got 4"),
    (dict(recomputes=("some",)), "recomputes must be"),
    (dict(schedules=("1f1b", "dualpipe")), "schedules must be"),
    (dict(max_cp=0), "max_cp must be"),
])
def test_bad_search_spaces_are_named(space, needle):
    with pytest.raises(ValueError, match=needle):
        P.plan("llama2-7b", P.cluster("dgx-h100", 1), 8, 4096, **space)


@pytest.mark.parametrize("field, value", [("efficiency", 0), ("efficiency", 1.5), ("grad_overlap", -0.1),
                                          ("tp_overlap", 2), ("usable_memory", 0), ("headroom", -1),
                                          ("attention_efficiency", 0), ("node_limit", 0),
                                          ("attention_memory", "exact"), ("precision", "fp8"),
                                          ("ep_dedup", 1), ("attention_by_length", "yes")])
def test_every_assumption_is_checked(field, value):
    with pytest.raises(ValueError, match=f"Assumptions.{field}"):
        P.Assumptions(**{field: value})


def test_predict_refuses_a_mesh_larger_than_the_cluster():
    cfg = PRESETS["llama2-70b"]
    with pytest.raises(ValueError, match=r"uses tp x cp x dp x pp = 16384 GPUs, but cluster 'dgx-h100' has 8192"):
        P.predict(cfg, P.cluster("dgx-h100", 1024), 2048, 4096, P.Candidate(dp=256, tp=8, pp=8))


@pytest.mark.parametrize("kwargs, needle", [(dict(global_batch=0), "global_batch"), (dict(seq_len=-1), "seq_len")])
def test_bad_input_is_named(kwargs, needle):
    args = dict(global_batch=8, seq_len=2048) | kwargs
    with pytest.raises(ValueError, match=needle):
        P.plan("llama2-7b", P.cluster("dgx-h100", 1), args["global_batch"], args["seq_len"])


def test_unknown_cluster_and_model_are_named():
    with pytest.raises(ValueError, match="unknown cluster"):
        P.cluster("tpu", 1)
    with pytest.raises(ValueError, match="unknown model preset"):
        P.plan("llama9", P.cluster("dgx-h100", 1), 8, 2048)


def test_memory_reasons_state_the_budget():
    p = P.plan("llama2-7b", P.cluster("dgx-h100", 1), 8, 4096, **SMALL).best()
    assert p.reasons[0].startswith(f"{p.memory.total / GiB:.1f} GiB of 80 GiB")


def test_a_checked_split_is_checked_again_for_what_differs_only_in_type():
    """``layer_split`` caches the check of a tuple split by value and type: (1.0, 3) is refused after (1, 3)."""
    assert layer_split(4, 2, (1, 3)) == [1, 3]
    for bad in ((1.0, 3), (True, 3), [1.0, 3]):
        with pytest.raises(ValueError, match="whole number"):
            layer_split(4, 2, bad)
    with pytest.raises(ValueError, match="whole number"):
        layer_split(4, 2, ([1], 3))  # unhashable: checked without the cache


def test_the_groups_the_time_model_prices_are_the_meshs_own():
    import itertools

    from course_lib.planner.comm import _group_of_rank0, group_span

    for tp, cp, dp, pp in itertools.product((1, 2, 4), (1, 2), (1, 2, 4, 8), (1, 3)):
        for ep in (e for e in (1, 2, 4, 8) if (dp * cp) % e == 0):
            shape = MeshShape(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
            for axes in [("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp"), ("ep",), ("edp",)]:
                ranks = shape.group_ranks(0, *axes)
                assert _group_of_rank0(shape, axes) == ranks, (shape, axes)
                for gpn in (1, 2, 8):  # the span, cached by strides, is the group's own
                    assert group_span(shape, axes, gpn) == (len(ranks), len({r // gpn for r in ranks}))


def test_candidates_are_distinct_and_unpipelined_meshes_have_one_schedule():
    cands = list(P.candidates(PRESETS["llama2-7b"], 16, 64, 4096, schedules=("interleaved", "zb_h1"),
                              virtual_stages=(2, 4)))
    assert cands and len(set(cands)) == len(cands)
    assert all((c.schedule, c.v) == ("1f1b", 1) for c in cands if c.pp == 1)
    assert {c.schedule for c in cands if c.pp > 1} == {"interleaved", "zb_h1"}


def test_predict_names_a_batch_the_candidate_cannot_split():
    with pytest.raises(ValueError, match=r"global batch 10 does not split into dp x micro_batch = 4 x 2"):
        P.predict(PRESETS["llama2-7b"], P.cluster("dgx-h100", 1), 10, 4096, P.Candidate(dp=4, tp=2, pp=1,
                                                                                         micro_batch=2))


# ------------------------------------------------------------------------------------------------ MoE model


def test_fine_grained_experts_keep_the_active_parameters_and_shared_experts_add_theirs():
    from course_lib.model_config import mlp_params
    from course_lib.planner.model import active_params
    coarse = GPTConfig(n_layer=4, d_model=64, n_expert=8, top_k=2, d_ff=256, mlp="swiglu", bias=False)
    fine = coarse.with_(n_expert=32, top_k=8, expert_d_ff=64)  # DeepSeekMoE: m = 4 times more experts of f / 4
    router = 4 * 64 * (32 - 8)  # the only difference: the router has h x E weights
    assert active_params(fine) - active_params(coarse) == router
    shared = fine.with_(n_shared_expert=1)
    assert active_params(shared) - active_params(fine) == 4 * mlp_params(fine, 64)
    # a prediction's MFU counts them: same step, more model FLOPs with the shared expert
    cl, cand = P.cluster("dgx-h100", 1), P.Candidate(dp=8, tp=1, pp=1)
    assert P.predict(shared, cl, 16, 32, cand).seconds["compute"] > P.predict(fine, cl, 16, 32, cand).seconds["compute"]


def test_deepseek_v3_is_described_as_its_report_gives_it():
    from course_lib.planner.model import active_params
    from course_lib.planner.published import DEEPSEEK_V3_DENSE_LAYERS, DEEPSEEK_V3_LIKE
    ds = DEEPSEEK_V3_LIKE
    assert (ds.n_expert, ds.expert_ffn_dim, ds.n_shared_expert, ds.top_k, ds.n_group, ds.topk_group) == \
        (256, 2048, 1, 8, 8, 4)
    # the report (Sec. 4.2): 37B activated parameters per token; here MHA instead of MLA, within 5 %
    assert active_params(ds, DEEPSEEK_V3_DENSE_LAYERS) == pytest.approx(37e9, rel=0.05)


def test_leading_dense_blocks_are_priced_on_the_stage_that_holds_them():
    from course_lib.planner.model import rank_dense_layers
    cfg = GPTConfig(n_layer=8, d_model=64, n_expert=8, top_k=2, d_ff=1024, expert_d_ff=64, mlp="swiglu")
    cand = P.Candidate(dp=4, tp=1, pp=2)
    assert rank_dense_layers(cand, 8, 3) == [3, 0]
    assert rank_dense_layers(P.Candidate(dp=2, tp=1, pp=2, schedule="interleaved", v=2), 8, 3) == [2, 1]
    cl = P.cluster("dgx-h100", 1)
    moe = P.predict(cfg, cl, 16, 64, cand)
    dense = P.predict(cfg, cl, 16, 64, cand, P.Assumptions(dense_layers=3))
    # a dense MLP of 1024 costs more than 2 experts of 64: stage 0 becomes the slow one, more model FLOPs
    assert dense.seconds["compute"] > moe.seconds["compute"]
    assert dense.mfu * dense.step_s > moe.mfu * moe.step_s
    # and held in memory as dense blocks: stage 0 holds 3 dense MLPs of 1024 and 1 MoE block of 8 experts of 64
    from course_lib.estimates.layout import block_params_per_rank
    from course_lib.model_config import dense_twin
    (attn_moe, experts), (plain, _) = block_params_per_rank(cfg, 1), block_params_per_rank(dense_twin(cfg), 1)
    extra = 3 * (plain - attn_moe - experts)  # no EP, no ZeRO: unsharded, 2 bytes each (bf16 weights)
    assert dense.memory["parameters"] - moe.memory["parameters"] == pytest.approx(2 * extra)
    assert cand.layout(16, 8, 3).dense == (3, 0) and cand.layout(16, 8).dense is None
    with pytest.raises(ValueError, match="dense_layers"):
        P.Assumptions(dense_layers=-1)


def test_node_limited_routing_comes_from_the_model():
    from course_lib.planner.model import route_node_limit
    cfg = PRESETS["mixtral-8x7b"].with_(n_expert=64, top_k=8, n_group=8, topk_group=2)
    assert route_node_limit(cfg, 8) == 2 and route_node_limit(cfg, 4) == 2 and route_node_limit(cfg, 16) == 4
    assert route_node_limit(cfg.with_(topk_group=None, n_group=1), 8) is None
    cl, cand = P.cluster("dgx-h100", 8), P.Candidate(dp=64, tp=1, pp=1, ep=64)
    limited = P.predict(cfg, cl, 64, 4096, cand)
    free = P.predict(cfg.with_(topk_group=None, n_group=1), cl, 64, 4096, cand)
    override = P.predict(cfg.with_(topk_group=None, n_group=1), cl, 64, 4096, cand, P.Assumptions(node_limit=2))
    assert limited.seconds["ep"] < free.seconds["ep"]
    assert limited.seconds["ep"] == pytest.approx(override.seconds["ep"])


def test_a_deduplicating_dispatcher_sends_a_token_once_per_node():
    """Kimi K2's shape, EP 32 over 4 nodes, top-8 of 384 experts: without de-duplication 8 x 3/4 = 6 copies of
    a token cross the network; with it, once per distinct other node hit, 4 (1 - (3/4)^8) x 3/4 = 2.7 copies."""
    from course_lib.planner.comm import _all_to_all
    cl = P.cluster("dgx-h100", 4)
    every = _all_to_all(cl, (32, 4), 2 * 7168, 4096, 8, None)
    once = _all_to_all(cl, (32, 4), 2 * 7168, 4096, 8, None, dedup=True)
    distinct = 4 * (1 - (3 / 4) ** 8) * 3 / 4
    beta = cl.inter.beta
    assert every == pytest.approx(3 * cl.inter.alpha + 4096 * 6 * 2 * 7168 / beta)
    assert once == pytest.approx(3 * cl.inter.alpha + 4096 * distinct * 2 * 7168 / beta)
    assert once == pytest.approx(_all_to_all(cl, (32, 4), 2 * 7168, 4096, 8, 4))  # a node limit of all 4 nodes
    assert _all_to_all(cl, (8, 1), 2 * 7168, 4096, 8, None, dedup=True) == _all_to_all(cl, (8, 1), 2 * 7168, 4096,
                                                                                         8, None)  # one node
    cfg, cand = PRESETS["mixtral-8x7b"].with_(n_expert=64), P.Candidate(dp=32, tp=1, pp=1, ep=32)
    plain, dedup = (P.predict(cfg, cl, 64, 4096, cand, P.Assumptions(ep_dedup=x)) for x in (False, True))
    assert 0 < dedup.seconds["ep"] < plain.seconds["ep"]


def test_attention_is_slower_on_short_blocks_as_flashattention_measures_it():
    """``attention_length_factor``: the published speeds over the speed at 16K, the ring's blocks weighted by
    their work (one causal diagonal block, cp - 1 unmasked ones of s/cp)."""
    from course_lib.estimates.hardware import FLASH_ATTENTION_BY_LENGTH as T
    from course_lib.estimates.hardware import attention_length_factor as f
    causal, full = dict(T["causal"]), dict(T["full"])
    assert [f(n) for n in causal] == pytest.approx([v / causal[16384] for v in causal.values()])
    assert f(131072) == f(16384) == 1.0 and f(256) == f(512)  # clamped at both ends
    assert f(4096, 2) == pytest.approx(1 / (0.5 * causal[16384] / causal[2048] + 0.5 * full[16384] / full[2048]))
    assert f(4096) > f(4096, 2) > f(4096, 4) > f(4096, 8) and f(131072, 16) == pytest.approx(1.0, abs=1e-3)
    cfg, cl = PRESETS["llama2-7b"], P.cluster("dgx-h100", 1)
    cand = P.Candidate(dp=2, tp=1, pp=1, cp=4, recompute="none")
    flat, short = (P.predict(cfg, cl, 8, 4096, cand, P.Assumptions(attention_by_length=x)) for x in (False, True))
    attn = 8 * 4096 / 8 * 2 * cfg.d_model * 4096 / (cl.gpu.peak_flops * 0.5) * 3 * cfg.n_layer  # fwd + 2x bwd
    assert short.seconds["compute"] - flat.seconds["compute"] == pytest.approx(attn * (1 / f(4096, 4) - 1))


def test_bf16_model_states_take_half_the_bytes_of_mixed_precision():
    cfg, cl, cand = PRESETS["llama2-7b"], P.cluster("dgx-h100", 1), P.Candidate(dp=8, tp=1, pp=1, zero_stage=1)
    mixed, bf16 = (P.predict(cfg, cl, 8, 4096, cand, P.Assumptions(precision=x)).memory for x in ("mixed", "bf16"))
    assert (mixed["parameters"], mixed["gradients"]) == (bf16["parameters"], bf16["gradients"])
    assert mixed["optimizer_state"] == pytest.approx(3 * bf16["optimizer_state"])  # (4 + 4 + 4) / (2 + 2)


# ------------------------------------------------------------------------------------------------ the library's rules


TOY_MOE = GPTConfig(n_layer=4, d_model=64, n_head=4, n_expert=4, top_k=2, aux_loss_coef=0.01)


def test_the_zero_pipeline_refusal_is_the_librarys_own():
    from course_lib.parallel.config import check_composable
    with pytest.raises(ValueError) as e:
        check_composable(MeshShape(dp=4, pp=2), GPTConfig(), global_batch=16, microbatches=2, zero_stage=2)
    assert P.refusal(GPTConfig(), P.Candidate(dp=4, tp=1, pp=2, zero_stage=2), 2).split(";")[0] in str(e.value)


@pytest.mark.parametrize("cfg", [TOY_MOE, TOY_MOE.with_(aux_loss_coef=0.0, capacity_factor=1.0),
                                 TOY_MOE.with_(aux_loss_coef=0.0, z_loss_coef=0.01)], ids=["aux", "capacity", "z"])
def test_the_moe_pipeline_refusal_is_the_librarys(cfg):
    from course_lib.parallel.config import routing_refusal
    for dp, cp, pp, ep in [(1, 1, 2, 1), (2, 1, 2, 1), (1, 2, 2, 1), (2, 1, 1, 1), (2, 1, 2, 2), (4, 1, 1, 2)]:
        shape = MeshShape(dp=dp, cp=cp, pp=pp, ep=ep)
        library = routing_refusal(dp * cp, pp, cfg.capacity_factor is not None, bool(cfg.aux_loss_coef))
        planner = P.moe_pipeline_refusal(cfg, shape)
        assert bool(planner) == bool(library), (shape, planner, library)


def test_with_library_rules_every_ranked_mesh_is_one_the_library_composes():
    cl = P.cluster("dgx-h100", 1)
    ruled = P.plan(TOY_MOE, cl, 16, 32, library_rules=True)
    free = P.plan(TOY_MOE, cl, 16, 32)
    assert ruled.ranked and len(ruled.ranked) < len(free.ranked)
    for p in ruled.ranked:
        assert P.library_refusal(TOY_MOE, p.candidate, 16, 32) == "", str(p.candidate)
    # the planner's deliberate differences (the module docstring), e.g. the MoE with its aux loss over dp x pp
    refused = [P.library_refusal(TOY_MOE, p.candidate, 16, 32) for p in free.ranked]
    assert any("an MoE with capacity or the load-balancing loss" in r for r in refused)
    assert {str(p.candidate) for p in ruled.ranked} == {str(p.candidate) for p, r in zip(free.ranked, refused,
                                                                                          strict=True) if not r}


def test_moe_activations_follow_the_experts_hidden_size_not_d_ff():
    cfg = GPTConfig(n_layer=4, d_model=64, n_expert=8, top_k=2, d_ff=1024, expert_d_ff=64, n_shared_expert=1)
    cl, cand = P.cluster("dgx-h100", 1), P.Candidate(dp=8, tp=1, pp=1, recompute="none")
    act = P.predict(cfg, cl, 16, 64, cand).memory["activations"]
    assert P.predict(cfg.with_(d_ff=4096), cl, 16, 64, cand).memory["activations"] == act  # d_ff: dense blocks
    assert P.predict(cfg.with_(n_shared_expert=2), cl, 16, 64, cand).memory["activations"] > act
