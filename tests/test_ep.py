"""course_lib.parallel.ep and the MoE layer of course_lib.moe: routing, capacity and the router losses by hand;
expert parallelism against the single-process MoE at ep = 2 and 4 (and EP x DP); the comm log against the
formula; mutations that must fail; bad configurations.

Parity: ``train_baseline`` (one process, same global batches, same initial weights) vs ``train_ep``, fp32,
AdamW lr 1e-3, 3 steps, global batch 8 x 16 tokens, within ``train.compare``'s rule (a multiple of the baseline's
own fp32 noise, measured against float64), on losses (LM + aux + z-loss) and every parameter, experts included
(gathered over the ep group). The router sees bit-identical rows on every layout here, so the router decisions are
the same and drops happen to the same assignments. Launches are batched (a rank start costs seconds on 2 cores):
one launch at W = 2 and one at W = 4 run every configuration, the tests read their cached results.

The aux loss under accumulation: the course uses the *per global micro-batch* form (f_i and P_i over every token
of one forward, over all ranks; a step's loss is the mean over its m micro-batches). EP with m = 2 matches
``train_baseline(accumulation=2)``; one batch of B gives a different aux loss (f * P is not linear in the batch).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from course_lib.data import global_batch
from course_lib.estimates import accounting
from course_lib.model import GPT, lm_loss
from course_lib.model_config import PRESETS, GPTConfig
from course_lib.moe import MoE, Routing, expert_capacity, expert_positions, moe_aux_loss
from course_lib.parallel import ep as E
from course_lib.parallel import oracles, runs
from course_lib.parallel.dp import DataParallel
from course_lib.runtime.launch import RankError, launch
from course_lib.train import (
    TrainConfig,
    TrainResult,
    compare,
    copy_parameters,
    make_optimizer,
    train_baseline,
    with_fp32_noise,
)

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

BASE = GPTConfig(bias=False, n_layer=2, d_model=32, n_head=2, seq_len=16, n_expert=4, top_k=2)
TC = TrainConfig(steps=3, global_batch=8)
TOKENS = TC.global_batch * BASE.seq_len
LAUNCH_TIMEOUT = 240


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------------------------
# Variants injected through public seams


class FirstTwoExperts:
    """A router that only ever picks experts 0 and 1 (mixin for MoE and ExpertParallelMoE): at ep = 2 rank 1,
    at ep = 4 ranks 2 and 3 receive no token, and experts 2 and 3 get none."""

    def router_logits(self, flat):
        logits = super().router_logits(flat)
        return logits - 1e4 * (torch.arange(logits.shape[1]) >= 2)


class FirstTwoMoE(FirstTwoExperts, MoE):
    pass


class FirstTwoEP(FirstTwoExperts, E.ExpertParallelMoE):
    pass


def first_two_model(cfg, seed):
    model = GPT(cfg, seed)
    for block in model.blocks:
        block.mlp.__class__ = FirstTwoMoE  # same weights, the router restricted
    return model


class NoCombineWeights(E.ExpertParallelMoE):
    """Bug: the expert outputs come back unweighted."""

    def combine(self, back, weights):
        return back


class FractionNotDividedByK(E.ExpertParallelMoE):
    """Bug: f_i = counts / T instead of counts / (T k): the aux loss is k times too large."""

    def expert_fractions(self, counts, n_tokens):
        return counts.float() / n_tokens


class LocalCapacity(E.ExpertParallelMoE):
    """Bug: each rank keeps assignments by its own tokens only (local capacity, its queue starting at 0)."""

    def keep_mask(self, chosen, counts, capacity):
        local = expert_capacity(self.capacity_factor, chosen.shape[0], self.top_k, self.n_expert)
        return expert_positions(chosen, self.n_expert) < local


class SharedTwice(E.ExpertParallelMoE):
    """Bug: the shared expert's output added twice (once by the layer, once more as if it were routed)."""

    def add_shared(self, routed, flat):
        return super().add_shared(super().add_shared(routed, flat), flat)


class BiasFromKeptCounts(E.ExpertParallelMoE):
    """Bug: the bias update counts the assignments kept after capacity, not those routed: an expert at capacity
    looks no busier than the mean, so the overload that the bias should correct stays invisible."""

    def balance_bias_(self, loads, rate):
        super().balance_bias_(self.step_kept, rate)


class NodeLimitIgnored(E.ExpertParallelMoE):
    """Bug: the top-k taken over every expert, the node limit (topk_group) forgotten."""

    def select_experts(self, scores):
        return scores.topk(self.top_k, dim=-1)


class WrongRank(E.ExpertParallelMoE):
    """Bug: expert e's tokens go to the next rank's experts."""

    def expert_owner(self, expert):
        return (expert // self.n_local + 1) % self.ep_size


# ----------------------------------------------------------------------------------------------------------------
# The batched launches

DROPS = BASE.with_(capacity_factor=1.0, aux_loss_coef=0.01, z_loss_coef=1e-3)
DEEPSEEK = DROPS.with_(n_expert=8, top_k=4, expert_d_ff=64, n_shared_expert=1)
"""DeepSeekMoE's layer at toy size: each expert of f/2 (fine-grained, 2 x the experts and top_k), one shared."""
BIASED = BASE.with_(router="sigmoid", capacity_factor=1.0)
NODE_LIMITED = DROPS.with_(n_expert=8, top_k=4, expert_d_ff=64, n_group=2, topk_group=1)
"""Node-limited routing: 8 experts in 2 groups ("nodes": 1 rank each at ep = 2, 2 at ep = 4), top-4 within 1."""
BIAS_RATE = 0.01
"""Auxiliary-loss-free balancing: a bias step of 0.01 is of the size of the sigmoid scores' differences here, so
it changes which experts are selected from the second step on (``test_bias_update_changes_the_routing``)."""
CASES = {
    "top2": (BASE, {}),
    "top2_drops_aux_z": (DROPS, {}),
    "top1_drops_aux": (BASE.with_(top_k=1, capacity_factor=0.5, aux_loss_coef=0.01), {}),
    "sigmoid_drops_aux": (BASE.with_(router="sigmoid", capacity_factor=0.75, aux_loss_coef=0.01), {}),
    "empty_ranks": (BASE, {"model_fn": first_two_model, "layer": FirstTwoEP}),
    "accumulation": (DROPS, {"accumulation": 2}),
    "deepseek_fine_shared_drops": (DEEPSEEK, {}),
    "sigmoid_bias_update_drops": (BIASED, {"bias_update_rate": BIAS_RATE}),
    "node_limited_drops": (NODE_LIMITED, {}),
    "grouped_free": (NODE_LIMITED.with_(topk_group=None), {}),
    "torch_all_to_all": (DROPS, {"layer": oracles.TorchAllToAllMoE}),
    "no_combine_weights": (BASE, {"layer": NoCombineWeights}),
    "f_not_divided_by_k": (BASE.with_(aux_loss_coef=0.1), {"layer": FractionNotDividedByK}),
    "shared_twice": (DEEPSEEK, {"layer": SharedTwice}),
    "bias_from_kept_counts": (BIASED, {"bias_update_rate": BIAS_RATE, "layer": BiasFromKeptCounts}),
    "node_limit_ignored": (NODE_LIMITED, {"layer": NodeLimitIgnored}),
}
EPXDP = {"epxdp_top2_drops": (DROPS, {"ep": 2}), "epxdp_top1_drops": (CASES["top1_drops_aux"][0], {"ep": 2})}
"""(Plain top-1 under EP x DP differs by 2e-6 in one expert weight under AdamW, 4e-9 under SGD: Mixtral's top-1
weight is 1, the router gets no LM gradient, and Adam turns the reassociation noise of a near-zero gradient into
lr-sized steps -- the conditioning note of ``course_lib.train``. With the aux loss the router learns and it holds.)"""


def _run_cases(rank, world_size, cases, tc):
    torch.set_num_threads(1)
    return {name: runs.train_ep(rank, world_size, cfg, tc, **kw) for name, (cfg, kw) in cases.items()}


@functools.cache
def results(world: int) -> list[dict[str, runs.ComposedResult]]:
    cases = CASES | (EPXDP if world == 4 else {})
    return launch(_run_cases, world, cases, TC, timeout=LAUNCH_TIMEOUT)


def _biased_baseline(cfg: GPTConfig, tc: TrainConfig, rate: float, dtype: torch.dtype) -> TrainResult:
    """One process with DeepSeek-V3's bias step after each optimizer step, loads = the step's routed counts."""
    model = GPT(cfg, tc.seed).to(dtype)
    opt = make_optimizer(list(model.parameters()), tc)
    losses = []
    for step in range(tc.steps):
        x, y = global_batch(step, tc.global_batch, cfg.seq_len, tc.seed)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y) + moe_aux_loss(model)
        loss.backward()
        opt.step()
        for block in model.blocks:
            block.mlp.balance_bias_(torch.tensor(block.mlp.stats.tokens_per_expert), rate)
        losses.append(loss.item())
    return TrainResult(losses, copy_parameters(model))


@functools.cache
def reference(name: str):
    cfg, kw = (CASES | EPXDP)[name]
    if "bias_update_rate" in kw:
        return with_fp32_noise(lambda dtype: _biased_baseline(cfg, TC, kw["bias_update_rate"], dtype))
    return train_baseline(cfg, TC, model_fn=kw.get("model_fn", GPT), accumulation=kw.get("accumulation", 1))


# ----------------------------------------------------------------------------------------------------------------
# Single process: routing, capacity, losses


def _layer(cfg: GPTConfig, seed: int = 3) -> MoE:
    return GPT(cfg.with_(n_layer=1), seed=seed).blocks[0].mlp


def test_capacity_formula():
    assert expert_capacity(1.0, 128, 2, 4) == 64
    assert expert_capacity(1.25, 128, 2, 4) == 80
    assert expert_capacity(1.1, 10, 1, 4) == 3  # ceil(2.75)
    assert expert_capacity(0.01, 10, 1, 4) == 1
    assert expert_capacity(None, 128, 2, 4) is None


def test_queue_positions_follow_token_order():
    chosen = torch.tensor([[0, 1], [1, 0], [1, 2], [0, 1]])
    assert expert_positions(chosen, 3).tolist() == [[0, 0], [1, 1], [2, 0], [2, 3]]
    assert expert_positions(chosen, 3, torch.tensor([5, 0, 1])).tolist() == [[5, 0], [1, 6], [2, 1], [7, 3]]


@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_keeps_the_first_c_assignments_and_drops_pass_through(top_k):
    moe = _layer(BASE.with_(top_k=top_k, capacity_factor=0.5))
    x = torch.randn(2, 16, BASE.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = moe(x).reshape(-1, BASE.d_model)
        flat = x.reshape(-1, BASE.d_model)
        r = moe.route(flat)
        cap = math.ceil(0.5 * 32 * top_k / 4)
        expected = torch.zeros_like(flat)
        taken = [0] * 4
        for t in range(32):  # by hand: walk the tokens in order, each expert accepts until full
            for j in range(top_k):
                e = int(r.chosen[t, j])
                if taken[e] < cap:
                    taken[e] += 1
                    expected[t] += r.weights[t, j] * moe.experts[e](flat[t:t + 1])[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert moe.stats.kept_per_expert == taken and max(taken) <= cap
    assert moe.stats.dropped == 32 * top_k - sum(taken) > 0
    assert (out.abs().sum(-1) == 0).any()  # some token lost every expert: the block passes x through unchanged


def _uniform_routing(n_tokens: int, n_expert: int, top_k: int) -> tuple[Routing, torch.Tensor]:
    chosen = torch.stack([(torch.arange(n_tokens) + j) % n_expert for j in range(top_k)], dim=1)
    logits = torch.zeros(n_tokens, n_expert)
    r = Routing(logits, logits.softmax(-1), chosen, torch.full((n_tokens, top_k), 1 / top_k))
    return r, torch.bincount(chosen.reshape(-1), minlength=n_expert)


def aux_loss_of_uniform_routing(moe: MoE, n_tokens: int = 16) -> float:
    r, counts = _uniform_routing(n_tokens, moe.n_expert, moe.top_k)
    return float(moe.router_loss(r, counts, n_tokens))


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_is_exactly_alpha_for_uniform_routing(top_k):
    moe = _layer(BASE.with_(top_k=top_k, aux_loss_coef=0.01))
    assert aux_loss_of_uniform_routing(moe) == pytest.approx(0.01, rel=1e-6)


def test_aux_loss_catches_f_not_divided_by_k():
    class Bad(MoE):
        def expert_fractions(self, counts, n_tokens):
            return counts.float() / n_tokens

    bad = Bad(BASE.with_(top_k=2, aux_loss_coef=0.01))
    assert aux_loss_of_uniform_routing(bad) == pytest.approx(0.02)  # k x alpha: what the test above rejects


def test_aux_and_z_loss_by_hand_and_their_gradient_reaches_the_router():
    moe = _layer(BASE.with_(aux_loss_coef=0.1, z_loss_coef=0.01))
    x = torch.randn(3, 8, BASE.d_model, generator=torch.Generator().manual_seed(1))
    moe(x)
    flat = x.reshape(-1, BASE.d_model)
    logits = flat @ moe.router.weight.T
    p = logits.softmax(-1)
    f = torch.bincount(logits.topk(2).indices.reshape(-1), minlength=4) / (24 * 2)
    by_hand = 0.1 * 4 * (f * p.mean(0)).sum() + 0.01 * logits.logsumexp(-1).pow(2).mean()
    torch.testing.assert_close(moe.aux_loss, by_hand, rtol=1e-5, atol=1e-7)
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0
    assert all(p.grad is None for e in moe.experts for p in e.parameters())


def test_routing_stats_and_entropy():
    moe = _layer(BASE)
    moe(torch.randn(2, 8, BASE.d_model, generator=torch.Generator().manual_seed(2)))
    s = moe.stats
    assert sum(s.tokens_per_expert) == 32 and s.kept_per_expert == s.tokens_per_expert and s.dropped == 0
    assert 0 < s.entropy <= math.log(4) + 1e-6


def test_sigmoid_router_bias_selects_but_does_not_weight():
    moe = _layer(BASE.with_(router="sigmoid"))
    flat = torch.randn(20, BASE.d_model, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = moe.route(flat)
        moe.expert_bias[3] = 10.0  # expert 3 always selected
        after = moe.route(flat)
    assert (after.chosen == 3).any(-1).all() and not (before.chosen == 3).any(-1).all()
    scores = (flat @ moe.router.weight.T).sigmoid()
    picked = scores.gather(1, after.chosen)
    torch.testing.assert_close(after.weights, picked / picked.sum(-1, keepdim=True))
    moe.balance_bias_(torch.tensor([5, 5, 5, 25]), rate=0.5)  # overloaded expert 3 goes down, the others up
    assert moe.expert_bias.tolist() == [0.5, 0.5, 0.5, 9.5]
    with pytest.raises(ValueError, match="sigmoid"):
        _layer(BASE).balance_bias_(torch.ones(4), 0.1)


def test_aux_loss_under_accumulation_is_per_micro_batch():
    """The form the course uses: m micro-batches of B/m give the mean of their own aux losses, not the aux
    loss of the batch of B (f * P is not linear), while m = 1 is the batch itself."""
    cfg = BASE.with_(n_layer=1, aux_loss_coef=1.0)
    model = GPT(cfg, seed=0)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(x)
        whole = float(moe_aux_loss(model))
        parts = []
        for xm in x.chunk(2):
            model(xm)
            parts.append(float(moe_aux_loss(model)))
    micro = TrainConfig(steps=1, global_batch=8)
    two = train_baseline(cfg, micro, accumulation=2).losses[0]
    one = train_baseline(cfg, micro).losses[0]
    assert abs(whole - sum(parts) / 2) > 1e-4  # the two forms really differ
    assert abs(one - two) > 1e-5


def test_mixtral_budget_from_its_preset():
    b = accounting.moe_budget(PRESETS["mixtral-8x7b"])
    assert round(b["total_params"] / 1e9, 1) == 46.7 and round(b["active_params"] / 1e9, 1) == 12.9
    assert b["total_params"] < 8 * 7e9  # not 56B: the experts share attention, embeddings and norms
    assert b["weight_bytes"] == 2 * b["total_params"] and b["forward_flops_per_token"] == 2 * b["active_params"]


def test_slowest_rank_load():
    assert accounting.slowest_rank_load([10, 10, 10, 10], 2) == (20, 20.0)
    assert accounting.slowest_rank_load([40, 0, 0, 0], 2) == (40, 20.0)
    assert accounting.slowest_rank_load([40, 0, 0, 0], 2, capacity=10) == (10, 5.0)
    with pytest.raises(ValueError, match="divide"):
        accounting.slowest_rank_load([1, 2, 3], 2)


def test_config_errors():
    with pytest.raises(ValueError, match="capacity_factor"):
        GPTConfig(n_expert=4, capacity_factor=0.0)
    with pytest.raises(ValueError, match="router"):
        GPTConfig(n_expert=4, router="relu")
    with pytest.raises(ValueError, match="aux_loss_coef"):
        GPTConfig(n_expert=4, aux_loss_coef=-1.0)


# ----------------------------------------------------------------------------------------------------------------
# Expert parallelism vs one process


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(CASES)[:10])
def test_parity_with_the_single_process_moe(world, name):
    got = results(world)
    report = compare(reference(name), got[0][name])
    assert report.ok, str(report)
    for other in got[1:]:  # every rank reports the same losses and full parameters
        assert other[name].losses == got[0][name].losses
    if "drops" in name:
        assert all(s.dropped > 0 for s in got[0][name].routing[0])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_bit_for_bit_with_torch_all_to_all_single_autograd(world):
    """PyTorch's differentiable all-to-all in place of ours: the same losses and parameters, exactly."""
    got = results(world)[0]
    assert got["torch_all_to_all"].losses == got["top2_drops_aux_z"].losses
    for name, p in got["top2_drops_aux_z"].params.items():
        assert torch.equal(got["torch_all_to_all"].params[name], p), name


def _local_expert_params(cfg: GPTConfig, ep: int) -> list[torch.nn.Parameter]:
    """The expert parameters one ep rank holds (E/ep experts per MoE layer)."""
    return [p for block in GPT(cfg).blocks for e in list(block.mlp.experts)[:cfg.n_expert // ep]
            for p in e.parameters()]


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("name", list(EPXDP))
def test_parity_ep_times_dp(name):
    """ep = 2 x dp = 2: experts sharded over ep, replicated over dp; the dense part averaged over all 4."""
    got = results(4)
    report = compare(reference(name), got[0][name])
    assert report.ok, str(report)
    edp = [r for r in got[0][name].step_comm[0] if r.group == "edp"]
    assert {r.op for r in edp} == {"all_reduce"}  # the experts' gradients, over their replicas only ...
    cfg = EPXDP[name][0]
    experts = _local_expert_params(cfg, ep=2)
    # ... each once (fp32), plus the int32 "used" flag of each (find_unused_parameters: an MoE's experts may idle)
    assert sum(r.tensor_bytes for r in edp) == 4 * sum(p.numel() for p in experts) + 4 * len(experts)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_empty_ranks_and_experts_do_not_hang(world):
    res = results(world)
    routing = res[0]["empty_ranks"].routing
    assert all(s.tokens_per_expert[2:] == [0, 0] for step in routing for s in step)
    ref = reference("empty_ranks")
    assert compare(ref, res[0]["empty_ranks"]).ok
    # experts 2 and 3 never got a gradient, so the optimizer never touched them
    init = GPT(BASE, TC.seed).state_dict()
    for name, p in res[0]["empty_ranks"].params.items():
        if ".experts.2." in name or ".experts.3." in name:
            assert torch.equal(p, init[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_comm_log_equals_the_formula(world):
    """Per MoE layer forward: one all_gather of W x E int64 counts, one all_to_all of E counts, dispatch and
    combine each carrying T*k*h*4 bytes over all ranks (dropless); backward the same two again; plus the
    all-reduce of the dense gradients over dp, each once (the experts, one replica each at ep = W, none)."""
    res = results(world)
    L, h, k = BASE.n_layer, BASE.d_model, BASE.top_k
    model = GPT(BASE)
    experts = {id(p) for block in model.blocks for p in block.mlp.experts.parameters()}
    dense = [p for p in model.parameters() if id(p) not in experts]
    for step in range(TC.steps):
        recs = [r["top2"].step_comm[step] for r in res]
        for mine in recs:
            gathers = [r for r in mine if r.op == "all_gather"]
            assert [r.tensor_bytes for r in gathers] == [world * BASE.n_expert * 8] * L
            counts = [r for r in mine if r.op == "all_to_all" and r.tensor_bytes == BASE.n_expert * 8]
            assert len(counts) == L
            assert sum(1 for r in mine if r.op == "all_to_all") == 5 * L
            reduced = [r for r in mine if r.op == "all_reduce"]
            assert {r.group for r in reduced} == {"dp"}
            # fp32 gradients plus the int32 "used" flag of each (find_unused_parameters)
            assert sum(r.tensor_bytes for r in reduced) == 4 * sum(p.numel() for p in dense) + 4 * len(dense)
        tokens = [[r for r in mine if r.op == "all_to_all" and r.tensor_bytes != BASE.n_expert * 8]
                  for mine in recs]
        total = sum(r.tensor_bytes for mine in tokens for r in mine)
        assert total == 4 * L * accounting.dispatch_bytes(TOKENS, k, h)
        sent = sum(r.sent_bytes for mine in tokens for r in mine)
        assert sent == sum(r.recv_bytes for mine in tokens for r in mine)
        assert abs(sent / total - accounting.leaving_fraction(world)) < 0.2  # near-uniform router at initialisation
    # with drops: only the kept assignments travel
    dropped = res[0]["top2_drops_aux_z"]
    kept = sum(sum(s.kept_per_expert) for s in dropped.routing[-1])
    moved = sum(r.tensor_bytes for rr in res for r in rr["top2_drops_aux_z"].step_comm[-1]
                if r.op == "all_to_all" and r.tensor_bytes != BASE.n_expert * 8)
    assert moved == 4 * kept * h * 4


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("name", ["no_combine_weights", "f_not_divided_by_k", "shared_twice",
                                  "bias_from_kept_counts", "node_limit_ignored"])
def test_mutations_break_parity(name):
    cfg, kw = CASES[name]
    ref = reference("sigmoid_bias_update_drops") if "bias_update_rate" in kw else train_baseline(cfg, TC)
    report = compare(ref, results(2)[0][name])
    assert not report.ok


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_node_limited_routing_crosses_fewer_groups(world):
    """Every token's kept experts in one group; fewer (token, other group) pairs than free routing over the same
    groups; our per-assignment rows to other groups are what the dispatch's splits say."""
    res = results(world)
    for step in range(TC.steps):
        limited = [r["node_limited_drops"].routing[step] for r in res]
        free = [r["grouped_free"].routing[step] for r in res]
        assert all(s.groups_per_token == 1.0 for rank in limited for s in rank)
        assert all(s.groups_per_token > 1.2 for rank in free for s in rank)
        pairs = [sum(s.cross_group_pairs for rank in runs for s in rank) for runs in (limited, free)]
        assert pairs[0] < 0.8 * pairs[1], pairs
        for rank in limited:  # one group per token: a remote token's rows all cross, a local one's none
            assert all(s.cross_group_rows >= s.cross_group_pairs for s in rank)


def test_node_limited_selection_by_hand():
    cfg = BASE.with_(n_expert=8, top_k=3, n_group=4, topk_group=2, n_layer=1)
    moe = _layer(cfg)
    scores = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    _, chosen = moe.select_experts(scores)
    for t in range(64):
        group_score = scores[t].view(4, 2).topk(1, dim=-1).values.sum(-1)  # top max(1, 3 // 2) = 1 per group
        allowed = set(group_score.topk(2).indices.tolist())
        masked = torch.tensor([s if e // 2 in allowed else -math.inf for e, s in enumerate(scores[t].tolist())])
        assert chosen[t].tolist() == masked.topk(3).indices.tolist()
    spans = {len({e // 2 for e in row}) for row in chosen.tolist()}
    assert max(spans) <= 2 and len({len({e // 2 for e in r}) for r in scores.topk(3).indices.tolist()}) > 1
    assert torch.equal(_layer(cfg.with_(topk_group=4)).select_experts(scores)[1], scores.topk(3).indices)


def test_bias_update_changes_the_routing():
    """The bias parity above is not vacuous: without the bias step the same run trains other parameters."""
    plain = with_fp32_noise(lambda dtype: _biased_baseline(BIASED, TC, 0.0, dtype))
    assert not compare(reference("sigmoid_bias_update_drops"), plain).ok


def _train_one(rank, world_size, cfg, layer):
    torch.set_num_threads(1)
    return runs.train_ep(rank, world_size, cfg, TC, layer=layer)


@pytest.mark.slow
@pytest.mark.parametrize("layer", [LocalCapacity, WrongRank])
def test_disagreeing_ranks_raise_a_clear_error(layer):
    with pytest.raises(RankError, match="disagree"):
        launch(_train_one, 2, DROPS, layer, timeout=LAUNCH_TIMEOUT)


# ----------------------------------------------------------------------------------------------------------------
# Bad configurations


BAD = [(BASE.with_(n_expert=3, top_k=1), None, "ep=2 does not divide n_expert=3"),
       (BASE.with_(n_expert=0), None, "needs a mixture-of-experts model"), (BASE, 3, "ep=3 must divide dp x cp = 2")]


def _expect_errors(rank, world_size, bad):
    messages = []
    for cfg, ep, _ in bad:
        try:
            runs.train_ep(rank, world_size, cfg, TrainConfig(steps=1, global_batch=4), ep=ep)
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def _apply_errors(rank, world_size):
    """apply_ep's own checks, below the mesh's: experts that do not split, a dense model; and the data-parallel
    step asked to reduce the experts' gradients without their group ("edp", which only a mesh has)."""
    world = torch.distributed.group.WORLD
    messages = []
    for cfg in (BASE.with_(n_expert=3, top_k=1), BASE.with_(n_expert=0)):
        try:
            E.apply_ep(GPT(cfg), world, world)
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    model = GPT(BASE)
    E.apply_ep(model, world, world)
    dp = DataParallel(model, group=world, mode="bucketed")
    x, y = global_batch(0, 2, BASE.seq_len)
    lm_loss(dp(x), y).backward()
    try:
        dp.finish_gradient_sync()
        messages.append("no error")
    except KeyError as exc:
        messages.append(str(exc))
    return messages


def test_bad_configurations_raise():
    for messages in launch(_expect_errors, 2, BAD, timeout=LAUNCH_TIMEOUT):
        for (_, _, expected), got in zip(BAD, messages, strict=True):
            assert expected in got
    for messages in launch(_apply_errors, 2, timeout=LAUNCH_TIMEOUT):
        assert "n_expert=3 is not divisible by ep=2" in messages[0]
        assert "no MoE layer" in messages[1]
        assert "reduced over 'edp' but no group is given" in messages[2] and "mesh=" in messages[2]
