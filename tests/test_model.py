"""course_lib.model (with model_config, layers and moe): parameter counts (formula vs module, presets vs published
sizes), initialisation, causality, GQA, MoE routing by hand, configuration errors and a bf16 forward.

Published sizes (exact counts as the Hugging Face checkpoints report them):
GPT-2 small 124,439,808; Llama 2 7B 6,738,415,616; Llama 2 70B 68,976,648,192; Llama 3 8B 8,030,261,248;
Llama 3 70B 70,553,706,496; Mixtral 8x7B 46,702,792,704 total, ~12.9B active per token (2 of 8 experts) --
not the "56B / 13B" that the Ultra-Scale Playbook summaries say; GPT-3 175B (Brown et al. 2020, Table 2.1) ~175B.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from course_lib.layers import RMSNorm, apply_rope, rope_cos_sin
from course_lib.model import GPT, lm_loss, num_params
from course_lib.model_config import PRESETS, GPTConfig, block_params, param_count

SMALL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's spin-waiting makes
    them tens of times slower (measured: 6 baseline steps 0.1 s with one thread, 8 s with two under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _logits(cfg: GPTConfig, idx: torch.Tensor, seed: int = 0) -> torch.Tensor:
    with torch.no_grad():
        return GPT(cfg, seed=seed)(idx)


# ------------------------------------------------------------------------------------------ parameter counts

GRID = list(itertools.product(
    [None, 2],  # n_kv_head: MHA, GQA
    ["gelu", "swiglu"],
    ["layernorm", "rmsnorm"],
    ["learned", "rope"],
    [True, False],  # bias
    [False, True],  # tied embeddings
    [(0, 2), (4, 1), (4, 2)],  # dense, MoE top-1, MoE top-2
))


def test_param_count_equals_the_module_for_every_option():
    wrong = []
    for kv, mlp, norm, pos, bias, tied, (n_expert, top_k) in GRID:
        cfg = SMALL.with_(n_kv_head=kv, mlp=mlp, norm=norm, pos=pos, bias=bias, tie_embeddings=tied,
                          n_expert=n_expert, top_k=top_k, d_ff=48 if mlp == "swiglu" else None)
        model = GPT(cfg)
        real = num_params(model)
        if param_count(cfg) != real:
            wrong.append((cfg, param_count(cfg), real))
        # active: every parameter except the (n_expert - top_k) experts a token does not use, per layer
        unused = sum(p.numel() for b in model.blocks for e in (b.mlp.experts[top_k:] if n_expert else [])
                     for p in e.parameters())
        if param_count(cfg, active_only=True) != real - unused:
            wrong.append((cfg, "active", param_count(cfg, active_only=True), real - unused))
    assert len(GRID) == 192
    assert not wrong, wrong[:3]


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("n_expert", "top_k", "expert_d_ff", "n_shared"), [
    (4, 2, None, 1),  # shared experts next to routed ones of the dense size
    (8, 4, 32, 0),  # fine-grained: 2 x the experts of half the size (d_ff 64), 2 x the top_k
    (8, 4, 32, 2),  # DeepSeekMoE: fine-grained routed experts plus 2 shared ones of the same size
])
def test_param_count_with_shared_and_fine_grained_experts_equals_the_module(mlp, bias, n_expert, top_k,
                                                                           expert_d_ff, n_shared):
    cfg = SMALL.with_(mlp=mlp, bias=bias, d_ff=64, n_expert=n_expert, top_k=top_k, expert_d_ff=expert_d_ff,
                      n_shared_expert=n_shared)
    model = GPT(cfg)
    assert param_count(cfg) == num_params(model) == sum(p.numel() for p in model.parameters())
    moe = model.blocks[0].mlp
    shared = sum(p.numel() for p in moe.shared.parameters()) if n_shared else 0
    unused = sum(p.numel() for b in model.blocks for e in b.mlp.experts[top_k:] for p in e.parameters())
    assert param_count(cfg, active_only=True) == num_params(model) - unused  # shared experts are always active
    assert moe.experts[0].fc1.out_features == (expert_d_ff or 64)
    if n_shared:
        assert moe.shared.fc1.out_features == n_shared * (expert_d_ff or 64) and shared > 0


def test_fine_grained_experts_keep_parameters_and_active_flops_of_the_coarse_layer():
    """DeepSeekMoE's segmentation: E experts of f, top-k  ->  mE experts of f/m, top-mk: the same routed
    parameters (bias-free) and the same active ones, many more combinations (C(8,4) = 70 vs C(4,2) = 6)."""
    coarse = SMALL.with_(bias=False, d_ff=64, n_expert=4, top_k=2)
    fine = coarse.with_(n_expert=8, top_k=4, expert_d_ff=32)
    router_extra = SMALL.n_layer * SMALL.d_model * 4  # the router grows from E to mE outputs
    assert param_count(fine) - param_count(coarse) == router_extra
    assert param_count(fine, active_only=True) - param_count(coarse, active_only=True) == router_extra
    assert math.comb(8, 4) == 70 and math.comb(4, 2) == 6


def test_shared_expert_is_added_once_unweighted():
    cfg = SMALL.with_(n_expert=4, top_k=2, n_shared_expert=1, n_layer=1)
    moe = GPT(cfg, seed=2).blocks[0].mlp
    x = torch.randn(2, 3, cfg.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_shared = moe(x)
        shared, moe.shared = moe.shared, None
        routed = moe(x)
        torch.testing.assert_close(with_shared, routed + shared(x), rtol=1e-6, atol=1e-7)


def test_gpt2_block_is_12h2_plus_13h_and_tied_weights_count_once():
    for h in (64, 768):
        assert block_params(GPTConfig(d_model=h, n_head=4)) == 12 * h * h + 13 * h
    tied = GPT(SMALL.with_(tie_embeddings=True))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert num_params(GPT(SMALL)) - num_params(tied) == SMALL.vocab_size * SMALL.d_model


@pytest.mark.parametrize(("name", "published"), [
    ("gpt2-124m", 124_439_808),
    ("llama2-7b", 6_738_415_616),
    ("llama2-70b", 68_976_648_192),
    ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496),
    ("mixtral-8x7b", 46_702_792_704),
    ("mixtral-8x22b", 140_630_071_296),
])
def test_presets_have_the_published_sizes(name, published):
    cfg = PRESETS[name]
    assert cfg.name == name
    assert param_count(cfg) == published


def test_moe_options_add_no_parameters():
    """The sigmoid router's selection bias is a buffer, capacity and the router losses are arithmetic."""
    cfg = SMALL.with_(n_expert=4, top_k=2)
    for opts in ({"router": "sigmoid"}, {"capacity_factor": 1.0, "aux_loss_coef": 0.01, "z_loss_coef": 1e-3}):
        model = GPT(cfg.with_(**opts))
        assert num_params(model) == param_count(cfg.with_(**opts)) == param_count(cfg)


def test_mixtral_is_46_7b_total_12_9b_active_not_56b_13b():
    cfg = PRESETS["mixtral-8x7b"]
    total, active = param_count(cfg), param_count(cfg, active_only=True)
    assert round(total / 1e9, 1) == 46.7
    assert round(active / 1e9, 1) == 12.9
    assert abs(total - 56e9) > 9e9  # "8 x 7B = 56B" double-counts the shared attention and embeddings
    # the dense parts are shared: total - active is exactly 6 unused experts per layer
    one_expert = 3 * cfg.d_model * cfg.ffn_dim
    assert total - active == cfg.n_layer * (cfg.n_expert - cfg.top_k) * one_expert


def test_gpt3_is_about_175b_and_dense_presets_are_all_active():
    assert param_count(PRESETS["gpt3-175b"]) == pytest.approx(175e9, rel=0.005)
    for name, cfg in PRESETS.items():
        if not cfg.n_expert:
            assert param_count(cfg, active_only=True) == param_count(cfg), name
    assert param_count(PRESETS["tiny"]) == num_params(GPT(PRESETS["tiny"]))


# ------------------------------------------------------------------------------------------ initialisation


def test_init_is_deterministic_from_the_seed_and_ignores_the_global_rng():
    torch.manual_seed(1)
    a = dict(GPT(SMALL, seed=3).named_parameters())
    torch.manual_seed(2)
    b = dict(GPT(SMALL, seed=3).named_parameters())
    c = dict(GPT(SMALL, seed=4).named_parameters())
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_init_leaves_the_global_rng_untouched():
    """The docstring promises it: building a model must not shift the random numbers a notebook draws next."""
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    GPT(SMALL)
    assert torch.equal(torch.rand(3), expected)


def test_init_distribution():
    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=4, d_model=128)
    params = dict(GPT(cfg, seed=0).named_parameters())
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    checked = {"bias": 0, "norm": 0, "resid": 0, "other": 0}
    for name, p in params.items():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
            checked["bias"] += 1
        elif p.dim() == 1:
            assert torch.all(p == 1), name
            checked["norm"] += 1
        else:
            std = resid if name.endswith(("o_proj.weight", "fc2.weight")) else 0.02
            assert p.std().item() == pytest.approx(std, rel=0.1), name
            assert abs(p.mean().item()) < 4 * std / math.sqrt(p.numel()) + 1e-6, name
            checked["resid" if std == resid else "other"] += 1
    assert checked == {"bias": 4 * 8 + 1, "norm": 2 * 4 + 1, "resid": 8, "other": 4 * 4 + 3}
    loss = lm_loss(_logits(cfg, torch.randint(0, 256, (4, 32))), torch.randint(0, 256, (4, 32)))
    assert loss.item() == pytest.approx(math.log(256), abs=0.05)  # small init: nearly uniform predictions


# ------------------------------------------------------------------------------------------ forward


CAUSAL_CFGS = {
    "gpt2-like": SMALL,
    "llama-like": SMALL.with_(n_kv_head=2, mlp="swiglu", norm="rmsnorm", pos="rope", bias=False),
    "moe": SMALL.with_(n_expert=4, top_k=2, pos="rope"),
}


@pytest.mark.parametrize("name", CAUSAL_CFGS)
def test_a_future_token_never_changes_earlier_logits(name):
    cfg = CAUSAL_CFGS[name]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    t = 9
    changed = idx.clone()
    changed[:, t] = (idx[:, t] + 1) % cfg.vocab_size
    a, b = _logits(cfg, idx), _logits(cfg, changed)
    assert a.shape == (2, cfg.seq_len, cfg.vocab_size)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=-1).min() > 1e-5  # position t and every later one do change


def test_shorter_sequences_and_the_pipeline_pieces():
    model = GPT(SMALL.with_(pos="rope"))
    idx = torch.randint(0, SMALL.vocab_size, (3, 5))
    with torch.no_grad():
        logits = model(idx)
        pieces = model.embed(idx)
        for block in model.blocks:
            pieces = block(pieces)
        pieces = model.head(pieces)
    assert logits.shape == (3, 5, SMALL.vocab_size)
    assert torch.equal(logits, pieces)
    full = _logits(SMALL.with_(pos="rope"), torch.cat([idx, idx], dim=1))
    torch.testing.assert_close(full[:, :5], logits, rtol=0, atol=1e-6)


def test_gqa_with_as_many_kv_heads_as_heads_is_mha():
    idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.seq_len))
    mha, gqa = GPT(SMALL), GPT(SMALL.with_(n_kv_head=SMALL.n_head))
    assert {k: v.shape for k, v in mha.state_dict().items()} == {k: v.shape for k, v in gqa.state_dict().items()}
    with torch.no_grad():
        assert torch.equal(mha(idx), gqa(idx))


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_gqa_equals_mha_whose_kv_heads_are_repeated(pos):
    """Query head i uses K/V head i // (n_head / n_kv_head): copy each K/V head into the heads of its group."""
    gqa_cfg = SMALL.with_(n_kv_head=2, pos=pos)
    gqa, mha = GPT(gqa_cfg, seed=1), GPT(gqa_cfg.with_(n_kv_head=None), seed=2)
    rep, d = SMALL.n_head // 2, SMALL.head_dim
    state = gqa.state_dict()
    for k, v in state.items():
        if ".k_proj." in k or ".v_proj." in k:
            state[k] = v.view(2, d, *v.shape[1:]).repeat_interleave(rep, dim=0).reshape(SMALL.d_model, *v.shape[1:])
    mha.load_state_dict(state)
    idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(gqa(idx), mha(idx), rtol=1e-5, atol=1e-6)
        # and the grouping matters: the other repetition order gives another model
        for k, v in gqa.state_dict().items():
            if ".k_proj." in k:
                state[k] = v.view(2, d, *v.shape[1:]).repeat(rep, *[1] * v.dim()).reshape(SMALL.d_model,
                                                                                        *v.shape[1:])
        mha.load_state_dict(state)
        assert (gqa(idx) - mha(idx)).abs().max() > 1e-4


def _moe_layer(top_k: int, n_expert: int = 4):
    return GPT(SMALL.with_(n_expert=n_expert, top_k=top_k, n_layer=1), seed=5).blocks[0].mlp


def test_moe_with_every_expert_is_the_softmax_weighted_sum():
    moe = _moe_layer(top_k=4)
    x = torch.randn(2, 5, SMALL.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        p = (x @ moe.router.weight.T).softmax(-1)  # [2, 5, E]
        by_hand = sum(p[..., e:e + 1] * expert(x) for e, expert in enumerate(moe.experts))
        torch.testing.assert_close(moe(x), by_hand, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_top_k_routing_by_hand(top_k):
    moe = _moe_layer(top_k=top_k)
    x = torch.randn(3, 4, SMALL.d_model, generator=torch.Generator().manual_seed(1)) * 5
    with torch.no_grad():
        got = moe(x).reshape(-1, SMALL.d_model)
        flat = x.reshape(-1, SMALL.d_model)
        logits = flat @ moe.router.weight.T
        used = set()
        for i, (tok, lg) in enumerate(zip(flat, logits, strict=True)):
            best = sorted(range(len(lg)), key=lambda e: -lg[e].item())[:top_k]
            w = torch.stack([lg[e] for e in best]).softmax(0)  # softmax over the chosen logits only
            expected = sum(w[j] * moe.experts[e](tok[None])[0] for j, e in enumerate(best))
            torch.testing.assert_close(got[i], expected, rtol=1e-5, atol=1e-6)
            used.update(best)
        assert len(used) > 1  # several experts were really exercised


def test_swiglu_mlp_and_rmsnorm_by_hand():
    cfg = SMALL.with_(mlp="swiglu", norm="rmsnorm", bias=False, d_ff=40)
    block = GPT(cfg).blocks[0]
    x = torch.randn(2, 3, cfg.d_model)
    mlp = block.mlp
    with torch.no_grad():
        mlp.gate.weight.normal_()  # make gate and up clearly different
        expected = F.silu(x @ mlp.gate.weight.T) * (x @ mlp.fc1.weight.T) @ mlp.fc2.weight.T
        torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)
        norm = RMSNorm(cfg.d_model)
        norm.weight.uniform_(0.5, 1.5)
        expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * norm.weight
        torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    d = 8
    q, k = torch.randn(d), torch.randn(d)
    cos, sin = rope_cos_sin(20, d)

    def rot(v: torch.Tensor, pos: int) -> torch.Tensor:
        return apply_rope(v.view(1, 1, 1, d), cos[pos:pos + 1], sin[pos:pos + 1]).view(d)

    for m, n in [(3, 1), (10, 8), (19, 17)]:  # same offset 2
        assert torch.dot(rot(q, m), rot(k, n)).item() == pytest.approx(torch.dot(rot(q, 2), rot(k, 0)).item(),
                                                                       abs=1e-5)
    assert torch.dot(rot(q, 5), rot(k, 0)).item() != pytest.approx(torch.dot(rot(q, 2), rot(k, 0)).item(), abs=1e-3)
    assert rot(q, 7).norm().item() == pytest.approx(q.norm().item(), rel=1e-5)  # a rotation
    assert torch.equal(rot(q, 0), q)


@pytest.mark.parametrize("moe", [False, True])
def test_bf16_forward(moe):
    cfg = SMALL.with_(n_kv_head=2, mlp="swiglu", norm="rmsnorm", pos="rope", bias=False,
                      n_expert=4 if moe else 0, top_k=2)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    ref = _logits(cfg, idx)
    model = GPT(cfg).to(torch.bfloat16)
    with torch.no_grad():
        out = model(idx)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() < 0.05 * ref.abs().max().item() + 1e-2
    loss = lm_loss(model(idx), idx)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(("changes", "message"), [
    ({"d_model": 30, "n_head": 4}, "d_model=30 is not divisible by n_head=4"),
    ({"n_head": 4, "n_kv_head": 3}, "n_head=4 is not divisible by n_kv_head=3"),
    ({"n_head": 4, "n_kv_head": 8}, "n_head=4 is not divisible by n_kv_head=8"),
    ({"d_model": 36, "n_head": 4, "pos": "rope"}, "rotary positions need an even head_dim, got 9"),
    ({"n_expert": 4, "top_k": 5}, r"top_k=5 must be in \[1, n_expert=4\]"),
    ({"n_expert": 4, "top_k": 0}, r"top_k=0 must be in \[1, n_expert=4\]"),
    ({"n_shared_expert": 1}, r"n_shared_expert and expert_d_ff describe MoE experts: set n_expert > 0"),
    ({"n_expert": 4, "n_shared_expert": -1}, r"n_shared_expert must be an int >= 0"),
    ({"n_expert": 4, "expert_d_ff": 0}, r"expert_d_ff must be a positive int"),
])
def test_invalid_configs_are_refused_with_the_reason(changes, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**changes)
    with pytest.raises(ValueError, match=message):
        GPTConfig().with_(**changes)  # with_ validates too


def test_valid_edge_configs_are_accepted():
    assert GPTConfig(d_model=36, n_head=4).head_dim == 9  # odd head_dim is fine without rope
    assert GPTConfig(n_expert=4, top_k=4).top_k == 4
    assert GPTConfig(n_head=4, n_kv_head=1).kv_heads == 1  # multi-query attention


def test_a_sequence_longer_than_seq_len_is_refused():
    model = GPT(SMALL)
    with pytest.raises(ValueError, match=f"sequence of {SMALL.seq_len + 1} tokens exceeds seq_len={SMALL.seq_len}"):
        model(torch.zeros(1, SMALL.seq_len + 1, dtype=torch.long))
    rope = GPT(SMALL.with_(pos="rope"))  # rope has no table that would overflow: the check must still hold
    with pytest.raises(ValueError, match="exceeds seq_len"):
        rope(torch.zeros(1, SMALL.seq_len + 1, dtype=torch.long))
