"""Local capacity (``GPTConfig(capacity_scope="local")``, as Megatron-LM computes it) and the drop policies.

* By hand (tiny tensors, no ranks): the three drop policies on four tokens; each rank's share with its own
  capacity; the balance loss per data rank in Megatron-LM's closed form; one process: local = global, bit for bit.
* What drops depends on the layout: the same step drops other assignments on other meshes (``dropped``).
* Parity: ``runs.train_parallel`` with local capacity against ``moe_reference.train_local_reference`` of the
  same ``ParallelConfig`` (one process, the ranks' micro-batches and shares replayed), at 2 ranks (dp, dp with
  accumulation, cp, dp x ep), 4 (dp x pp with two schedules, dp x pp x ep, dp x cp, dp x cp x ep) and 8 (the
  DeepSeek-V3 shape: PP x EP x DP with ZeRO-1, sigmoid router, node-limited routing, a shared expert). SGD (lr 0.05,
  momentum 0.9), 2 steps, global batch 8 x 16 tokens, capacity factor 1 (assignments drop), alpha = 0.01,
  beta = 0.01, within ``train.compare``'s rule (8 x the reference's own fp32 noise + 8 ulp).
* Mutations that must go red: capacity from the global token count (plain and expert-parallel), f_i of a cp rank
  from its own tokens; a rank whose capacity disagrees with its ep peers' raises.
* The refusals: the global scope keeps its pipeline refusal (message unchanged), the local scope composes, and
  the planner agrees; a drop policy other than "position" needs the local scope on dp x cp > 1.
Launches are batched (one per world size); the tests read their cached results.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from course_lib.data import global_batch
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.moe import MoE, Routing, queue_positions
from course_lib.parallel import compose as C
from course_lib.parallel import runs
from course_lib.parallel.config import ParallelConfig, check_composable, routing_refusal
from course_lib.parallel.ep import ExpertParallelMoE
from course_lib.parallel.moe_mesh import moe_layers
from course_lib.parallel.moe_reference import MeshShares, dropped, rank_micro_batches, train_local_reference
from course_lib.planner import search as planner
from course_lib.runtime.launch import RankError, launch
from course_lib.runtime.mesh import MeshShape
from course_lib.train import TrainConfig, compare, train_baseline

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

LOCAL = GPTConfig(bias=False, n_layer=2, d_model=32, n_head=2, seq_len=16, n_expert=4, top_k=2, capacity_factor=1.0,
                  aux_loss_coef=0.01, z_loss_coef=0.01, capacity_scope="local")
PROBS, CHOICE = LOCAL.with_(drop_policy="probs"), LOCAL.with_(drop_policy="choice")
DEEPSEEK = LOCAL.with_(n_expert=8, expert_d_ff=32, router="sigmoid", n_shared_expert=1, n_group=2, topk_group=1,
                       drop_policy="probs")
"""DeepSeek-V3's layer in miniature: 8 fine-grained experts, top-2 from 1 of 2 groups, a shared expert."""
SGD = TrainConfig(steps=2, global_batch=8, optimizer="sgd", lr=0.05)
LAUNCH_TIMEOUT = 400


# ----------------------------------------------------------------------------------------------------------------
# By hand

CHOSEN = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1]])
WEIGHTS = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.7, 0.3], [0.5, 0.5]])


@pytest.mark.parametrize("policy, expected", [
    # token order: expert 0 queues t0, t1, t2 (its second choice), t3
    ("position", [[0, 0], [1, 0], [1, 2], [3, 2]]),
    # by weight: expert 0 queues t1 (0.9), t0 (0.6), t3 (0.5), t2 (0.3); expert 1: t2 (0.7), t3 (0.5), t0 (0.4)
    ("probs", [[1, 2], [0, 0], [0, 3], [2, 1]]),
    # first choices first: expert 0 queues t0, t1, t3, then t2's second; expert 1: t2, then t0's and t3's seconds
    ("choice", [[0, 1], [1, 0], [0, 3], [2, 2]]),
])
def test_drop_policies_queue_as_computed_by_hand(policy, expected):
    assert queue_positions(CHOSEN, WEIGHTS, 3, policy).tolist() == expected


def test_at_capacity_2_each_policy_drops_other_assignments():
    dropped_at = {p: (queue_positions(CHOSEN, WEIGHTS, 3, p) >= 2).nonzero().tolist()
                  for p in ("position", "probs", "choice")}
    assert dropped_at == {"position": [[2, 1], [3, 0], [3, 1]],  # t2's 2nd, t3's 1st and 2nd (latest tokens)
                          "probs": [[0, 1], [2, 1], [3, 0]],  # t0 -> 1 (0.4), t2 -> 0 (0.3), t3 -> 0 (0.5)
                          "choice": [[2, 1], [3, 0], [3, 1]]}  # t3's first choice is third at expert 0


def test_choice_keeps_a_first_choice_that_position_drops():
    chosen = torch.tensor([[1, 0], [0, 1], [0, 1]])  # t0's second choice is expert 0, t1 and t2 pick it first
    weights = torch.full((3, 2), 0.5)
    keep = {p: (queue_positions(chosen, weights, 2, p) < 2)[:, 0].tolist() for p in ("position", "choice")}
    assert keep == {"position": [True, True, False], "choice": [True, True, True]}


def _layer(cfg: GPTConfig) -> MoE:
    return GPT(cfg, 0).blocks[0].mlp


def _routing(chosen: torch.Tensor, weights: torch.Tensor, probs: torch.Tensor) -> Routing:
    return Routing(torch.zeros_like(probs), probs, chosen, weights)


def test_each_rank_share_has_its_own_capacity():
    """Top-1 of E = 2, cf = 1, two data ranks of 4 tokens: C = ceil(1 x 4 x 1 / 2) = 2 per rank (global: 4)."""
    cfg = LOCAL.with_(n_expert=2, top_k=1, aux_loss_coef=0.0, z_loss_coef=0.0)
    chosen = torch.tensor([[0], [0], [0], [1], [0], [1], [1], [1]])
    r = _routing(chosen, torch.ones(8, 1), torch.full((8, 2), 0.5))
    layer = _layer(cfg)
    layer.local = MeshShares(dp=2)
    counts, kept, keep, _ = layer.local_routing(r, (2, 4))
    assert keep[:, 0].tolist() == [True, True, False, True, True, True, True, False]  # t2 and t7 drop
    assert counts.tolist() == [4, 4] and kept.tolist() == [3, 3]
    layer.local = None  # one process: one share of 8 tokens, C = 4, nothing drops
    assert layer.local_routing(r, (2, 4))[2].all()


def test_a_cp_share_is_the_rank_positions_in_layout_order():
    shares = MeshShares(dp=2, cp=2, layout="zigzag").split((2, 8), torch.device("cpu"))
    # row d = data rank d; zigzag over 4 chunks of 2: cp rank 0 holds chunks 0 and 3, cp rank 1 chunks 1 and 2
    assert [[s.tolist() for s in group] for group in shares] == [[[0, 1, 6, 7], [2, 3, 4, 5]],
                                                                 [[8, 9, 14, 15], [10, 11, 12, 13]]]


def test_the_balance_loss_is_megatrons_per_data_rank_micro_batch():
    """Megatron-LM's ``switch_load_balancing_loss_func``: alpha E / (k T^2) sum_i (sum_t p_ti) (count_i), T and
    the counts of one data rank's micro-batch; the step averages it over the data ranks."""
    cfg = LOCAL.with_(n_expert=2, top_k=1, capacity_factor=None, z_loss_coef=0.0)
    chosen = torch.tensor([[0], [0], [0], [1], [0], [1], [1], [1]])
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.7, 0.3], [0.4, 0.6], [0.2, 0.8],
                          [0.1, 0.9]])
    layer = _layer(cfg)
    layer.local = MeshShares(dp=2)
    loss = layer.local_routing(_routing(chosen, torch.ones(8, 1), probs), (2, 4))[3]

    def megatron(p, counts, k=1, T=4, E=2, alpha=0.01):
        return alpha * E / (k * T * T) * float((p.sum(0) * counts).sum())

    rank0 = megatron(probs[:4], torch.tensor([3.0, 1.0]))  # 0.01 * 2/16 * (2.6 * 3 + 1.4 * 1) = 0.0115
    rank1 = megatron(probs[4:], torch.tensor([1.0, 3.0]))  # 0.01 * 2/16 * (1.4 * 1 + 2.6 * 3) = 0.0115
    assert math.isclose(float(loss), (rank0 + rank1) / 2, rel_tol=1e-6)
    assert math.isclose((rank0 + rank1) / 2, 0.0115, rel_tol=1e-6)
    layer.local = None  # one process: f and P over all 8 tokens, 0.01 * 2/64 * (4.0 * 4 + 4.0 * 4) = 0.01:
    # each rank is imbalanced, the batch is not
    assert math.isclose(float(layer.local_routing(_routing(chosen, torch.ones(8, 1), probs), (2, 4))[3]), 0.01,
                        rel_tol=1e-6)


def test_on_one_process_local_is_global_bit_for_bit():
    report = compare(train_baseline(LOCAL.with_(capacity_scope="global"), SGD),
                     train_local_reference(LOCAL, SGD, ParallelConfig()), rtol=0, atol=0)
    assert report.ok, report


def test_the_pipeline_micro_batches_are_each_data_ranks_own():
    x = torch.arange(8)[:, None].expand(8, 4)
    rows = [xm[:, 0].tolist() for xm, _ in rank_micro_batches(x, x, ParallelConfig(MeshShape(dp=2, pp=2)))]
    assert rows == [[0, 1, 4, 5], [2, 3, 6, 7]]  # data rank 0 holds rows 0-3, rank 1 rows 4-7, each cut in 2
    rows = [xm[:, 0].tolist() for xm, _ in rank_micro_batches(x, x, ParallelConfig(MeshShape(dp=2), accumulation=2))]
    assert rows == [[0, 1, 2, 3], [4, 5, 6, 7]]  # without a pipeline: each piece of the global batch, sliced


LAYOUTS = {"one process": ParallelConfig(), "dp 2": ParallelConfig(MeshShape(dp=2)),
           "dp 4": ParallelConfig(MeshShape(dp=4)), "dp 2 x pp 2": ParallelConfig(MeshShape(dp=2, pp=2)),
           "cp 2": ParallelConfig(MeshShape(cp=2)), "dp 2 x cp 2": ParallelConfig(MeshShape(dp=2, cp=2))}


def test_what_drops_depends_on_the_layout():
    """One step, the same 128 tokens and weights: one process pools every token into each expert's queue; the
    smaller shares of a mesh fill theirs unevenly and drop more."""
    counts = {name: dropped(LOCAL, parallel) for name, parallel in LAYOUTS.items()}
    model = GPT(LOCAL.with_(capacity_scope="global"), 0)
    model(global_batch(0, SGD.global_batch, LOCAL.seq_len, SGD.seed)[0])
    assert counts["one process"] == sum(layer.stats.dropped for layer in moe_layers(model))  # scopes agree
    assert all(counts[name] > counts["one process"] for name in LAYOUTS if name != "one process"), counts


# ----------------------------------------------------------------------------------------------------------------
# Mutations injected through public seams


class GlobalCountCapacity(MoE):
    """Bug: each rank's capacity from the token count of the whole batch over its 2 data ranks."""

    def capacity(self, n_tokens):
        return super().capacity(2 * n_tokens)


class GlobalCountCapacityEP(ExpertParallelMoE):
    """The same bug in the expert-parallel layer: the capacity of every rank of the batch together."""

    def capacity(self, n_tokens):
        return super().capacity(self.batch_size * n_tokens)


class OneRankDisagrees(ExpertParallelMoE):
    """Rank 0 gives every expert one more slot than its peers do: they must raise, not hang."""

    def capacity(self, n_tokens):
        return super().capacity(n_tokens) + (dist.get_rank() == 0)


def capacity_from_global_count(run: C.Parallelized) -> None:
    """The routing step, then every MoE layer's capacity seam replaced (same weights)."""
    C.moe_routing(run)
    for layer in moe_layers(run.module):
        layer.__class__ = GlobalCountCapacity


def f_from_own_tokens(run: C.Parallelized) -> None:
    """Bug: the routing step forgets the cp peers, so a cp rank's f_i counts its own tokens only."""
    C.moe_routing(run)
    for layer in moe_layers(run.module):
        layer.local = None


CASES_2 = {  # name: (config, ParallelConfig, train_parallel keywords)
    "dp2": (LOCAL, ParallelConfig(MeshShape(dp=2)), {}),
    "dp2_probs_accumulation2": (PROBS, ParallelConfig(MeshShape(dp=2), accumulation=2), {}),
    "cp2_choice": (CHOICE, ParallelConfig(MeshShape(cp=2)), {}),
    "dp2_ep2_probs": (PROBS, ParallelConfig(MeshShape(dp=2, ep=2)), {}),
}
MUTATIONS_2 = {
    "dp2_capacity_from_global_count": (LOCAL, ParallelConfig(MeshShape(dp=2)),
                                       {"steps": C.with_step(C.STEPS, C.moe_routing, capacity_from_global_count)}),
    "cp2_f_from_own_tokens": (LOCAL, ParallelConfig(MeshShape(cp=2)),
                              {"steps": C.with_step(C.STEPS, C.moe_routing, f_from_own_tokens)}),
}
CASES_4 = {
    "dp2_pp2": (LOCAL, ParallelConfig(MeshShape(dp=2, pp=2)), {}),
    "dp2_pp2_probs_zb_h1": (PROBS, ParallelConfig(MeshShape(dp=2, pp=2), schedule="zb_h1"), {}),
    "dp2_pp2_ep2_choice": (CHOICE, ParallelConfig(MeshShape(dp=2, pp=2, ep=2)), {}),
    "dp2_cp2": (LOCAL, ParallelConfig(MeshShape(dp=2, cp=2)), {}),
    "dp2_cp2_ep2_probs": (PROBS, ParallelConfig(MeshShape(dp=2, cp=2, ep=2), cp_layout="contiguous"), {}),
}
MUTATIONS_4 = {
    "dp2_pp2_ep2_capacity_from_global_count": (
        LOCAL, ParallelConfig(MeshShape(dp=2, pp=2, ep=2)),
        {"steps": C.with_step(C.STEPS, C.expert_parallel,
                              functools.partial(C.expert_parallel, layer=GlobalCountCapacityEP))}),
}
CASES_8 = {  # DeepSeek-V3 trained with PP 16 x EP 64 x ZeRO-1 DP: here PP 2 x EP 4 (over all 4 data ranks)
    "deepseek_dp4_pp2_ep4_zero1": (DEEPSEEK, ParallelConfig(MeshShape(dp=4, pp=2, ep=4), zero_stage=1), {}),
}
ALL = CASES_2 | MUTATIONS_2 | CASES_4 | MUTATIONS_4 | CASES_8
BY_WORLD = {2: CASES_2 | MUTATIONS_2, 4: CASES_4 | MUTATIONS_4, 8: CASES_8}


def _run(rank: int, world_size: int, names: list[str]) -> dict[str, object]:
    torch.set_num_threads(1)
    out: dict[str, object] = {}
    for name in names:
        cfg, parallel, kw = ALL[name]
        out[name] = runs.train_parallel(rank, world_size, cfg, SGD, parallel, **kw)
    return out


@functools.cache
def _results(world: int) -> dict[str, list]:
    per_rank = launch(_run, world, sorted(BY_WORLD[world]), timeout=LAUNCH_TIMEOUT)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


@functools.cache
def _reference(cfg: GPTConfig, parallel: ParallelConfig):
    return train_local_reference(cfg, SGD, parallel)


MUTATIONS = MUTATIONS_2 | MUTATIONS_4
NAMES = [*sorted(CASES_2 | CASES_4 | MUTATIONS), pytest.param("deepseek_dp4_pp2_ep4_zero1", marks=pytest.mark.slow)]


@pytest.mark.parity
@pytest.mark.parametrize("name", NAMES)
def test_local_capacity_matches_its_reference_and_its_mutations_do_not(name: str) -> None:
    cfg, parallel, _ = ALL[name]
    report = compare(_reference(cfg, parallel), runs.merge_composed(_results(parallel.world_size)[name]))
    assert report.ok == (name not in MUTATIONS), f"{name}: {report}"


@pytest.mark.parity
def test_the_parity_is_not_vacuous() -> None:
    """The runs drop assignments, the layout changes the training (the local reference of dp 2 x pp 2 is not the
    one-process model) and the balance loss moves the loss."""
    mesh = ParallelConfig(MeshShape(dp=2, pp=2))
    assert dropped(LOCAL, mesh) > 0 and dropped(DEEPSEEK, ALL["deepseek_dp4_pp2_ep4_zero1"][1]) > 0
    assert not compare(_reference(LOCAL, ParallelConfig(MeshShape(pp=2))), _reference(LOCAL, mesh)).ok
    without = train_local_reference(LOCAL.with_(aux_loss_coef=0.0), SGD, mesh)
    assert abs(without.losses[0] - _reference(LOCAL, mesh).losses[0]) > 1e-3


def _disagree(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    steps = C.with_step(C.STEPS, C.expert_parallel, functools.partial(C.expert_parallel, layer=OneRankDisagrees))
    runs.train_parallel(rank, world_size, LOCAL, SGD, ParallelConfig(MeshShape(dp=2, ep=2)), steps=steps)


@pytest.mark.slow
def test_a_rank_whose_local_capacity_disagrees_raises():
    with pytest.raises(RankError, match="each rank's own token count"):
        launch(_disagree, 2, timeout=LAUNCH_TIMEOUT)


# ----------------------------------------------------------------------------------------------------------------
# Options and refusals

def test_the_pipeline_refusal_is_lifted_for_the_local_scope_only():
    shape = MeshShape(dp=2, pp=2)
    check_composable(shape, LOCAL, global_batch=8, microbatches=2)
    with pytest.raises(ValueError) as refused:
        check_composable(shape, LOCAL.with_(capacity_scope="global"), global_batch=8, microbatches=2)
    assert routing_refusal(2, 2, True, True) in str(refused.value)
    assert ("cannot run with dp x cp = 2 and pp = 2: the pipeline cuts each data-parallel rank's rows into its own "
            "micro-batches" in str(refused.value))
    assert routing_refusal(2, 2, True, True, "local") == ""
    assert planner.moe_pipeline_refusal(LOCAL, shape) == ""
    assert planner.moe_pipeline_refusal(LOCAL.with_(capacity_scope="global"), shape)


def test_a_drop_policy_over_ranks_needs_the_local_scope():
    check_composable(MeshShape(dp=2), PROBS, global_batch=8)
    check_composable(MeshShape(), PROBS.with_(capacity_scope="global"), global_batch=8)  # one process: fine
    with pytest.raises(ValueError, match="use capacity_scope='local'"):
        check_composable(MeshShape(dp=2), PROBS.with_(capacity_scope="global"), global_batch=8)


@pytest.mark.parametrize("changes, message", [
    ({"capacity_scope": "rank"}, "capacity_scope must be one of 'global', 'local'"),
    ({"drop_policy": "random"}, "drop_policy must be one of 'position', 'probs', 'choice'"),
    ({"drop_policy": "probs", "capacity_factor": None}, "needs a capacity_factor"),
    ({"capacity_scope": "local", "n_expert": 0, "capacity_factor": None, "aux_loss_coef": 0.0,
      "z_loss_coef": 0.0}, "describes MoE routing"),
])
def test_bad_options_are_refused_with_their_reason(changes, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig().with_(**changes)
