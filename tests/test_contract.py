"""The wrapper contract (``course_lib.parallel``'s docstring), checked the same way for every wrapper.

Each form -- ``DataParallel`` in its three self-running modes, ``ZeroDataParallel`` at stages 0-3 (and
per-parameter, ``FSDP2DataParallel``, in the lifecycle; its parity is in tests/test_zero_fsdp2.py),
``PipelineParallel`` on a GPT and on a plain ``nn.Sequential``, tensor (with sequence), context and expert
parallelism (in-place transforms of the model: their form is the composed run, ``compose.Parallelized``, over
that axis), and the composed run with its data-parallel part at ZeRO 0, 2 and 3 -- goes through the same
lifecycle at 2 and 4 ranks: wrap (initial weights made identical over the group), train with and without
``no_sync`` (gradient accumulation) through the one training loop, parity with ``train_baseline`` (SGD, which
exposes a wrong scale; default tolerance |a - b| <= 1e-6 + 1e-5 |ref|), the per-step communication under
``step_comm``, ``no_sync`` holding the gradient reduction back to the last micro-batch,
``finish_gradient_sync`` + a step + ``after_step`` keeping the replicas identical, ``remove_hooks`` leaving no
hook behind (and, for the forms whose communication is all in hooks, a module that communicates nothing), a
forward the model refuses leaving the wrapper usable, and clear errors for a rank outside the group (of a
wrapper or of an axis's transform) and for ``mesh=`` together with ``group=`` (the forms that take both). At 4
ranks the wrappers also run on sub-groups of a ``Mesh`` (dp groups {0, 2} and {1, 3} of a dp x tp grid; pp
groups of a pp x dp grid; tp groups of a dp x tp grid; cp groups of a dp x cp grid).

The model-parallel forms (TP, CP, EP) communicate inside forward and backward as part of the layers' math (f and
g, the ring, the all-to-alls): ``no_sync`` cannot silence that, only the gradient reduction; so their no_sync
check is the generic one, per micro-batch: the micro-batch under ``no_sync`` issues fewer collectives than the
synchronising one, which issues exactly as many as a step without accumulation.

One launch per world size (rank start-up costs seconds on 2 cores); the tests read its cached results.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.data import global_batch, shard
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel import compose, cp, dp, ep, pp, tp, zero
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.fsdp2 import FSDP2DataParallel
from course_lib.parallel.runs import merge_results, train_cp, train_dp, train_ep, train_pp, train_tp, train_zero
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import Mesh, MeshShape
from course_lib.train import TrainConfig, TrainResult, compare, train_baseline

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=16, bias=False)
MOE = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, bias=False, n_expert=4, top_k=2)
SGD = TrainConfig(steps=3, global_batch=8, optimizer="sgd", lr=1e-2)
LAUNCH_TIMEOUT = 300

DATA_FORMS = {  # name: (training helper, its variant keywords)
    # DataParallel's modes that reduce by themselves ("scheduled" is launched by a pipeline's REDUCE_GRAD)
    **{f"dp-{mode}": (train_dp, {"mode": mode, "bucket_mb": 0.01}) for mode in ("naive", "bucketed", "overlapped")},
    **{f"zero-{stage}": (train_zero, {"stage": stage}) for stage in range(4)},
}


MODEL_FORMS = {  # name: (training helper, its keywords at 2 ranks, at 4 ranks (on the ranks: a Mesh), config)
    "tp-sp": (train_tp, lambda: {"sequence_parallel": True},
              lambda: {"sequence_parallel": True, "mesh": Mesh(dp=2, tp=2)}, CFG),  # n_head=2: t <= 2
    "cp": (train_cp, dict, dict, CFG),
    "cp-zero3": (train_cp, lambda: {"zero_stage": 3}, lambda: {"zero_stage": 3, "mesh": Mesh(dp=2, cp=2)}, CFG),
    "ep": (train_ep, dict, lambda: {"ep": 2}, MOE),
}


def seq_model(cfg: GPTConfig, seed: int) -> nn.Sequential:
    """A model that is not a GPT: embedding, four tanh MLP blocks, a linear head, as an ``nn.Sequential``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks = [nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), nn.Tanh()) for _ in range(cfg.n_layer)]
        return nn.Sequential(nn.Embedding(cfg.vocab_size, cfg.d_model), *blocks,
                             nn.Linear(cfg.d_model, cfg.vocab_size))


def _composed(model: nn.Module, group, zero_stage: int = 0, **shape) -> compose.Parallelized:
    """``parallelize`` on a mesh of ``shape``'s degrees (each None: the group's size) over every rank."""
    n = dist.get_world_size(group)
    config = ParallelConfig(MeshShape(**{axis: n if d is None else d for axis, d in shape.items()}),
                            zero_stage=zero_stage, sequence_parallel="tp" in shape)
    return compose.parallelize(model, config.mesh(), config)


WRAPPERS = {  # name: wrap(model, group) -> wrapper (for the in-process lifecycle checks)
    "dp-overlapped": lambda m, g: dp.DataParallel(m, group=g, mode="overlapped", bucket_mb=0.01),
    "dp-bucketed": lambda m, g: dp.DataParallel(m, group=g, mode="bucketed"),
    **{f"zero-{s}": (lambda m, g, s=s: zero.ZeroDataParallel(m, s, group=g)) for s in range(4)},
    "fsdp2": lambda m, g: FSDP2DataParallel(m, group=g),
    # TP, CP and EP are in-place transforms of the model: their form is the composed run over that axis
    # (compose.parallelize: the transform, then the data-parallel step, the only one that reduces)
    "tp-sp": lambda m, g: _composed(m, g, tp=None),
    "cp": lambda m, g: _composed(m, g, cp=None),
    "ep": lambda m, g: _composed(m, g, dp=None, ep=None),
    "composed-dp": lambda m, g: _composed(m, g, dp=None),
    "composed-zero2": lambda m, g: _composed(m, g, 2, dp=None),
    "composed-fsdp2": lambda m, g: _composed(m, g, 3, dp=None),
}
MATH_COMM = {"tp-sp", "cp", "ep"}
"""Wrappers whose layers communicate in forward and backward (not through hooks)."""
LIFECYCLE_CFG = {"tp-sp": CFG.with_(n_head=4), "ep": MOE}  # 4 heads: TP over all 4 ranks


def _full(w: nn.Module) -> dict[str, torch.Tensor]:
    """The whole parameters of a wrapper's model: the contract's one method on every form (a
    collective for the sharding forms)."""
    return w.full_parameters()


def _hooks_left(module: nn.Module) -> int:
    """Forward (pre-)hooks on any submodule and gradient hooks on any parameter."""
    mods = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())
    return mods + sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in module.parameters())


def _equal_over_group(params: dict[str, torch.Tensor]) -> bool:
    """Whether every rank holds the same parameters (all-gathered checksums)."""
    mine = torch.stack([p.detach().double().sum() for p in params.values()]).float()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], other) for other in every)


def _lifecycle(rank: int, name: str) -> dict:
    """Wrap a model initialised differently on every rank; check the broadcast, no_sync, a step, remove_hooks."""
    out = {}
    cfg = LIFECYCLE_CFG.get(name, CFG)
    model = GPT(cfg, seed=rank)  # different initial weights on every rank
    w = WRAPPERS[name](model, dist.group.WORLD)
    out["identical"] = _equal_over_group(_full(w))
    x, y = global_batch(0, 4, cfg.seq_len, 0)
    mesh = getattr(w, "mesh", None)  # a composed run: its data-parallel coordinate (it cuts its cp tokens itself)
    dp_rank, dp_size = (mesh.coord("dp"), mesh.size("dp")) if mesh is not None else (rank, dist.get_world_size())
    x, y = shard(x, dp_rank, dp_size), shard(y, dp_rank, dp_size)
    with comm.recording() as log, w.no_sync():
        w.forward_backward(x, y)
    out["no_sync_calls"] = log.count("all_reduce") + log.count("reduce_scatter")  # stage 3 still gathers
    with comm.recording() as log:
        w.forward_backward(x, y)
        w.finish_gradient_sync()
    out["sync_calls"] = log.count()
    with torch.no_grad():
        for p in w.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    w.after_step()
    out["identical_after_step"] = _equal_over_group(_full(w))
    w.remove_hooks()
    out["hooks_left"] = _hooks_left(w)
    if name not in MATH_COMM:
        with comm.recording() as log:
            lm_loss(model(x), y).backward()  # the bare module, hooks gone: no communication
        out["after_remove_calls"] = log.count()
    return out


def _refused_forward(rank: int) -> dict:
    """A forward the model refuses (more tokens than ``seq_len``), then a valid step: the wrapper must be usable
    (the step's state is set only after the module returned)."""
    out = {}
    forms = {"dp-overlapped": WRAPPERS["dp-overlapped"], "dp-bucketed": WRAPPERS["dp-bucketed"],
             "zero-3": WRAPPERS["zero-3"], "cp": WRAPPERS["cp"]}
    too_long = CFG.seq_len + 14
    for name, wrap in forms.items():
        w = wrap(GPT(CFG, seed=0), None)
        try:
            w(torch.zeros(1, too_long, dtype=torch.long))
            refused = None
        except ValueError as e:
            refused = str(e)
        x, y = global_batch(0, 2, CFG.seq_len, 0)  # full sequences: the composed run cuts its cp tokens
        try:
            w.forward_backward(x, y)
            w.finish_gradient_sync()
            replicas = {str(i): p.grad.detach().sum().reshape(1) for i, p in enumerate(w.parameters())}
            # a replica's gradients are the group's average; ZeRO's shards differ by construction
            out[name] = (refused, isinstance(w, zero.ZeroDataParallel) or _equal_over_group(replicas))
        except RuntimeError as e:
            out[name] = (refused, str(e))
    return out


BOTH = {"dp": dp.DataParallel, "zero": zero.ZeroDataParallel, "fsdp2": FSDP2DataParallel, "pp": pp.PipelineParallel}
"""The forms that take ``mesh=`` or ``group=``."""


def _errors(rank: int) -> dict:
    """Clear errors: a rank outside the group of a wrapper or of an axis's transform; mesh= with group= (the
    forms that take both: the transforms of TP, CP and EP take their group only)."""
    out = {}
    lonely = dist.new_group([0])  # collective: every rank creates it; only rank 0 is in it
    makers = {"dp": lambda g: dp.DataParallel(GPT(CFG), group=g),
              "zero": lambda g: zero.ZeroDataParallel(GPT(CFG), 3, group=g),
              "pp": lambda g: pp.PipelineParallel(GPT(CFG), group=g),
              "tp": lambda g: tp.apply_tp(GPT(CFG), g),
              "cp": lambda g: cp.apply_cp(GPT(CFG), g),
              "ep": lambda g: ep.apply_ep(GPT(MOE), g, g)}
    if rank != 0:
        for name, make in makers.items():
            try:
                make(lonely)
                out[name] = None
            except ValueError as e:
                out[name] = str(e)
    mesh = Mesh(dp=dist.get_world_size())
    for name, cls in BOTH.items():
        try:
            cls(GPT(CFG), mesh=mesh, group=dist.group.WORLD)
            out["both", name] = None
        except ValueError as e:
            out["both", name] = str(e)
    return out


def _suite(rank: int, world_size: int) -> dict:
    out: dict = {}
    for name, (fn, kw) in DATA_FORMS.items():
        for accumulation in (1, 2):
            out[name, accumulation] = fn(rank, world_size, CFG, SGD, accumulation=accumulation, **kw)
    for name, (fn, kw2, kw4, cfg) in MODEL_FORMS.items():
        for accumulation in (1, 2):
            kw = kw2() if world_size == 2 else kw4()
            out[name, accumulation] = fn(rank, world_size, cfg, SGD, accumulation=accumulation, **kw)
    out["refused"] = _refused_forward(rank)
    out["pp-gpt"] = train_pp(rank, world_size, CFG, SGD, "1f1b", 4)
    out["pp-seq"] = train_pp(rank, world_size, CFG, SGD, "gpipe", 2, model_fn=seq_model)
    for name in WRAPPERS:
        out["lifecycle", name] = _lifecycle(rank, name)
    out["errors"] = _errors(rank)
    if world_size == 4:
        grid = Mesh(dp=2, tp=2)  # dp groups {0, 2} and {1, 3}: not contiguous
        out["mesh", "dp"] = train_dp(rank, world_size, CFG, SGD, mesh=grid)
        out["mesh", "zero"] = train_zero(rank, world_size, CFG, SGD, 3, mesh=grid)
        out["mesh", "dp-ranks"] = grid.ranks("dp")
        line = Mesh(pp=2, dp=2)
        out["mesh", "pp"] = train_pp(rank, world_size, CFG, SGD, "1f1b", 2, mesh=line)
        out["mesh", "pp-ranks"] = line.ranks("pp")
        out["mesh", "tp-ranks"] = grid.ranks("tp")
    return out


@functools.cache
def suite(world_size: int) -> list[dict]:
    return launch(_suite, world_size, timeout=LAUNCH_TIMEOUT)


@functools.cache
def baseline(model: str = "gpt", cfg: GPTConfig = CFG, accumulation: int = 1) -> TrainResult:
    return train_baseline(cfg, SGD, model_fn=seq_model if model == "seq" else GPT, accumulation=accumulation)


def assert_parity(got: TrainResult, what: str, model: str = "gpt") -> None:
    report = compare(baseline(model), got)
    assert report.ok, f"{what}: {report}"


WORLD_SIZES = [2, 4]


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", DATA_FORMS)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_data_parallel_forms_match_the_baseline_with_and_without_no_sync(world_size, name, accumulation):
    for rank, runs in enumerate(suite(world_size)):
        res = runs[name, accumulation]
        assert_parity(res, f"{name}, accumulation {accumulation}, rank {rank}")
        assert len(res.step_comm) == SGD.steps and all(res.step_comm)  # every step communicated, recorded


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", MODEL_FORMS)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_model_parallel_forms_match_the_baseline_through_the_one_loop(world_size, name, accumulation):
    """TP, CP (and CP with ZeRO-3 as its gradient reduction) and EP through ``loop.train_loop``; EP against the
    baseline with the same micro-batches (its router losses depend on the batch of one forward)."""
    cfg = MODEL_FORMS[name][3]
    ref = baseline("gpt", cfg, accumulation if cfg.n_expert else 1)
    for rank, runs in enumerate(suite(world_size)):
        res = runs[name, accumulation]
        report = compare(ref, res)
        assert report.ok, f"{name}, accumulation {accumulation}, rank {rank}: {report}"
        assert len(res.step_comm) == SGD.steps and all(res.step_comm)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", [*DATA_FORMS, *MODEL_FORMS])
def test_no_sync_holds_back_the_gradient_reduction(world_size, name):
    """Per micro-batch (``StepTime.micro_comm_calls``; the last includes ``finish_gradient_sync``): the one under
    ``no_sync`` issues fewer collectives than the synchronising one, which issues exactly as many as a step
    without accumulation -- whatever the layers communicate themselves (TP's f and g, CP's ring, EP's
    all-to-alls, ZeRO-3's gathers)."""
    for rank, runs in enumerate(suite(world_size)):
        one, two = runs[name, 1].timeline[0].micro_comm_calls, runs[name, 2].timeline[0].micro_comm_calls
        assert len(one) == 1 and len(two) == 2, (name, rank, one, two)
        assert two[0] < two[1] == one[0], f"{name}, rank {rank}: collectives per micro-batch {two} vs {one}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_refused_forward_leaves_the_wrapper_usable(world_size):
    """A batch longer than ``seq_len`` is refused with the model's ValueError; the next valid step runs and
    averages its gradients (before the fix: "the previous step's gradients were never averaged")."""
    for rank, runs in enumerate(suite(world_size)):
        for name, (refused, then) in runs["refused"].items():
            assert refused and "seq_len" in refused, (name, rank, refused)
            assert then is True, f"{name}, rank {rank}: after a refused forward: {then}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_no_sync_reduces_gradients_once_per_step(world_size):
    """Two micro-batches, the first under no_sync: as many gradient reductions as one micro-batch (stage 3
    still gathers its parameters for every forward and backward)."""
    runs = suite(world_size)[0]
    reductions = ("all_reduce", "reduce_scatter")
    for name in DATA_FORMS:
        one, two = runs[name, 1].step_comm[0], runs[name, 2].step_comm[0]
        assert [r.op for r in two if r.op in reductions] == [r.op for r in one if r.op in reductions], name


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("model", ["gpt", "seq"])
def test_the_pipeline_wraps_a_gpt_or_any_sequential(world_size, model):
    ranks = [runs[f"pp-{model}"] for runs in suite(world_size)]
    assert_parity(merge_results(ranks), f"pipeline of a {model}", model)
    assert all(len(r.step_comm) == SGD.steps and r.step_comm[0] for r in ranks)
    assert all(r.step_comm[0] == r.steps[0].comm for r in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", WRAPPERS)
def test_lifecycle(world_size, name):
    for runs in suite(world_size):
        got = runs["lifecycle", name]
        assert got["identical"], f"{name}: ranks start from different weights"
        assert got["sync_calls"] > 0, f"{name}: a synchronising step did not communicate"
        assert got["identical_after_step"], f"{name}: replicas differ after finish_gradient_sync, step, after_step"
        assert got["hooks_left"] == 0, f"{name}: {got['hooks_left']} hooks left after remove_hooks()"
        if name not in MATH_COMM:  # their layers communicate by design: no_sync is checked per micro-batch
            assert got["no_sync_calls"] == 0, f"{name}: no_sync() reduced gradients"
            assert got["after_remove_calls"] == 0, f"{name}: the bare module still communicates"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_clear_errors(world_size):
    for rank, runs in enumerate(suite(world_size)):
        got = runs["errors"]
        for name in BOTH:
            assert got["both", name] and "mesh= or group=" in got["both", name], (name, got["both", name])
        for name in ("dp", "zero", "pp", "tp", "cp", "ep"):
            if rank:
                assert got[name] and f"global rank {rank} is not a member" in got[name], (name, got[name])


@pytest.mark.parity
@pytest.mark.slow
def test_wrappers_on_mesh_sub_groups():
    ranks = suite(4)
    assert [r["mesh", "dp-ranks"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for rank, runs in enumerate(ranks):
        assert_parity(runs["mesh", "dp"], f"DP on a dp sub-group, rank {rank}")
        assert_parity(runs["mesh", "zero"], f"ZeRO-3 on a dp sub-group, rank {rank}")
        assert {r.group for r in runs["mesh", "dp"].step_comm[0]} == {"dp"}
    groups = {tuple(r["mesh", "pp-ranks"]) for r in ranks}
    assert len(groups) == 2
    for members in groups:
        assert_parity(merge_results([ranks[i]["mesh", "pp"] for i in members]), f"pipeline on ranks {members}")
    assert [r["mesh", "tp-ranks"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for rank, runs in enumerate(ranks):  # tp-sp and cp-zero3 ran on the tp / cp groups of a dp x tp / dp x cp grid
        assert {r.group for r in runs["tp-sp", 1].step_comm[0]} == {"tp"}, rank
        assert {r.group for r in runs["cp-zero3", 1].step_comm[0]} >= {"cp", "dp+cp"}, rank
