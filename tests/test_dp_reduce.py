"""Only data parallelism reduces gradients, by one rule read from the placements (``parallel.dp_reduce``).

* The rule itself, on tensors (no ranks): a parameter's data group is "dp+cp", an expert's (recorded on "edp")
  "edp"; its ``Partial()`` axes are summed too; flatten / split back is exact, missing gradients count as zeros.
* On 4 real ranks, against one process: the composition with the rule right, and three mutations that must go
  red: a norm under sequence parallelism recorded ``Partial()`` on "dp" instead of "tp" (the wrong reduction
  group), the experts' "edp" record dropped (experts reduced over dp x cp: the ep ranks' different experts
  averaged into each other), and a pipeline stage reduced twice (two ``REDUCE_GRAD`` actions: refused).
* FSDP with replicated parameters, as Stanford CS336's FSDP assignment specifies and ``fully_shard`` on
  sub-modules with ``replicate`` on the root does: only the ``Linear`` and ``Embedding`` weights sharded, the
  norms whole on every rank with their gradients all-reduced; against one process both ways (those units, and
  the default blocks + root).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from course_lib.layers import make_norm
from course_lib.model_config import GPTConfig
from course_lib.parallel import compose as C
from course_lib.parallel import dp_reduce as R
from course_lib.parallel import placement as P
from course_lib.parallel import runs
from course_lib.parallel import schedules as S
from course_lib.parallel import tp as T
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.dp import assign_buckets
from course_lib.parallel.fsdp2 import FSDP2DataParallel
from course_lib.parallel.tp_layers import vocab_parallel_cross_entropy
from course_lib.runtime.launch import RankError, launch
from course_lib.runtime.mesh import MeshShape
from course_lib.train import TrainConfig, TrainResult, compare, train_baseline

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, bias=False)
MOE = GPTConfig(bias=False, n_layer=2, d_model=32, n_head=2, seq_len=16, n_expert=4, top_k=2)
SGD = TrainConfig(steps=2, global_batch=8, optimizer="sgd", lr=0.05)
TIMEOUT = 300


# ------------------------------------------------------------------------------------------ the rule, no ranks


def test_the_data_group_and_the_partial_axes_come_from_the_placements():
    dense, expert, norm = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    P.set_placement(expert, "edp", P.Replicate())
    P.set_placement(norm, "tp", P.Partial())
    assert [R.data_axis(p) for p in (dense, expert, norm)] == ["dp+cp", "edp", "dp+cp"]
    assert [R.partial_axes(p) for p in (dense, expert, norm)] == [[], [], ["tp"]]
    assert {k: len(v) for k, v in R.by_data_axis([dense, expert, norm]).items()} == {"dp+cp": 2, "edp": 1}


def test_buckets_keep_one_open_per_data_group():
    """An MoE's gradients alternate dense and expert layer by layer: one open bucket per data group (DDP's
    per-dtype buckets, Megatron-LM's separate expert buffers) gives one all-reduce per group, not one per
    layer; the buckets are in the order of their first gradient."""
    params = [nn.Parameter(torch.ones(4)) for _ in range(6)]
    for p in params[1::2]:
        P.set_placement(p, "edp", P.Replicate())
    assert assign_buckets(params, 1 << 20) == [[0, 2, 4], [1, 3, 5]]
    assert assign_buckets(params, 32) == [[0, 2], [1, 3], [4], [5]]  # a bucket closes at 2 x 16 bytes


def test_flatten_and_split_back_is_exact_and_a_missing_gradient_counts_as_zeros():
    a, b = nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))
    a.grad = torch.arange(6.0).view(2, 3)
    flat = R.flatten_grads([a, b])
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 0, 0]
    R.write_grads([a, b], flat * 2)
    assert torch.equal(a.grad, torch.arange(6.0).view(2, 3) * 2) and torch.equal(b.grad, torch.zeros(4))


def test_a_missing_group_names_the_axis_and_the_fix():
    p = nn.Parameter(torch.ones(2))
    P.set_placement(p, "tp", P.Partial())
    with pytest.raises(KeyError, match=r"'tp'.*mesh="):
        R.group_of({"dp+cp": None}, "tp")


# ------------------------------------------------------------------------------------ mutations, on 4 ranks


def _norm_partial_on_dp(m: nn.Module, group, sp: bool) -> None:
    """The "sequence" style recording a norm's share on the wrong axis: "dp" instead of "tp"."""
    T.sequence(m, group, sp)
    for p in m.parameters():
        P.clear_placement(p, "tp")
        P.set_placement(p, "dp", P.Partial())


def _wrong_group_tp(run: C.Parallelized) -> None:
    plan = {k: (_norm_partial_on_dp if v == "sequence" else v) for k, v in T.gpt_plan(run.module.config).items()}
    T.apply_tp(run.module, run.mesh.group("tp"), plan, sequence_parallel=True)
    run.loss_fn = functools.partial(vocab_parallel_cross_entropy, group=run.mesh.group("tp"))


def _experts_over_dp_cp(run: C.Parallelized) -> None:
    C.expert_parallel(run)
    for layer in run.ep:
        for p in layer.experts.parameters():
            P.clear_placement(p, "edp")


def _reduce_twice(schedule: S.Schedule) -> S.Schedule:
    once = S.add_grad_reduce(schedule)
    return [[a for b in rank for a in ([b, b] if b.kind is S.Kind.REDUCE_GRAD else [b])] for rank in once]


CASES = {  # name: (model, ParallelConfig, steps)
    "tp_sp": (CFG, ParallelConfig(MeshShape(dp=2, tp=2), sequence_parallel=True), C.STEPS),
    "tp_sp_partial_on_the_wrong_axis": (CFG, ParallelConfig(MeshShape(dp=2, tp=2), sequence_parallel=True),
                                        C.with_step(C.STEPS, C.tensor_parallel, _wrong_group_tp)),
    "ep": (MOE, ParallelConfig(MeshShape(dp=4, ep=2)), C.STEPS),
    "ep_experts_over_dp_cp": (MOE, ParallelConfig(MeshShape(dp=4, ep=2)),
                              C.with_step(C.STEPS, C.expert_parallel, _experts_over_dp_cp)),
    "pp": (CFG, ParallelConfig(MeshShape(dp=2, pp=2)), C.STEPS),
    "pp_stage_reduced_twice": (CFG, ParallelConfig(MeshShape(dp=2, pp=2)),
                               C.with_step(C.STEPS, C.pipeline_parallel,
                                           functools.partial(C.pipeline_parallel, place_grad_reduce=_reduce_twice))),
}


def _run(rank: int, world_size: int, name: str) -> object:
    cfg, parallel, steps = CASES[name]
    return runs.train_parallel(rank, world_size, cfg, SGD, parallel, steps=steps)


@functools.cache
def _results(name: str) -> TrainResult | str:
    try:
        out = launch(_run, 4, name, timeout=TIMEOUT)
    except RankError as e:  # a refusal: the launcher stops the other ranks
        return f"refused: {e}"
    try:
        return runs.merge_composed(out)
    except ValueError as e:  # replicas that drifted apart
        return f"drifted: {e}"


@pytest.mark.parity
@pytest.mark.parametrize("name", ["tp_sp", "ep", "pp"])
def test_the_rule_matches_one_process(name: str):
    cfg = CASES[name][0]
    result = _results(name)
    assert isinstance(result, TrainResult), result
    report = compare(train_baseline(cfg, SGD), result)
    assert report.ok, report


@pytest.mark.parametrize("name", ["tp_sp_partial_on_the_wrong_axis", "ep_experts_over_dp_cp"])
def test_a_wrong_reduction_group_goes_red(name: str):
    result = _results(name)
    assert isinstance(result, str) or not compare(train_baseline(CASES[name][0], SGD), result).ok, name


def test_a_stage_reduced_twice_is_refused():
    result = _results("pp_stage_reduced_twice")
    assert isinstance(result, str) and "reduced twice" in result, result


# ------------------------------------------------------------------ FSDP with replicated parameters (CS336)


def _linear_and_embedding(model: nn.Module) -> list[nn.Module]:
    """CS336's FSDP: every Linear and Embedding module its own unit; the norms in none (replicated)."""
    return [m for m in model.modules() if isinstance(m, nn.Linear | nn.Embedding)]


def _fsdp(rank: int, world_size: int, units_of: str) -> dict:
    from course_lib.parallel.loop import build_model, train_loop
    from course_lib.train import make_optimizer

    model = build_model(CFG, SGD.seed)
    norms = {n for n, m in model.named_modules() if isinstance(m, type(make_norm(CFG)))}
    units = _linear_and_embedding(model) if units_of == "linear" else None
    w = FSDP2DataParallel(model, units=units)
    opt = make_optimizer(list(w.parameters()), SGD)
    grads: dict[str, torch.Tensor] = {}

    def keep_grads(step: int) -> None:
        grads.update({n: p.grad.clone() for n, p in model.named_parameters() if n.rsplit(".", 1)[0] in norms})

    out = train_loop(w, opt, CFG, SGD, data_rank=w.rank, data_size=w.world_size, before_optimizer=keep_grads)
    replicated = {n for n, p in model.named_parameters() if not P.placements_of(p)}
    return {"result": TrainResult(out.losses, w.full_parameters()), "replicated": replicated,
            "norms": sorted(n for n, _ in model.named_parameters() if n.rsplit(".", 1)[0] in norms),
            "norm_grads": grads}


@pytest.mark.parity
@pytest.mark.parametrize("units_of", ["linear", "blocks"])
def test_fsdp_with_replicated_parameters_matches_one_process(units_of: str):
    ranks = launch(_fsdp, 2, units_of, timeout=TIMEOUT)
    reference = train_baseline(CFG, SGD)
    for r in ranks:
        report = compare(reference, r["result"])
        assert report.ok, report
    if units_of == "linear":  # the norms stay whole and equal on every rank: their gradients were all-reduced
        assert ranks[0]["replicated"] == set(ranks[0]["norms"]) != set()
        for n in ranks[0]["norms"]:
            assert torch.equal(ranks[0]["norm_grads"][n], ranks[1]["norm_grads"][n]), n
    else:
        assert ranks[0]["replicated"] == set()


def test_units_must_be_submodules():
    with pytest.raises(RankError, match="not a submodule"):
        launch(_foreign_unit, 2, timeout=TIMEOUT)


def _foreign_unit(rank: int, world_size: int) -> None:
    from course_lib.model import GPT

    FSDP2DataParallel(GPT(CFG), units=[nn.Linear(2, 2)])
