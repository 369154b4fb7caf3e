"""The wrapper contract (``course_lib.parallel``'s docstring), checked the same way for every wrapper.

Each form -- ``DataParallel`` in its three modes, ``ZeroDataParallel`` at stages 0-3 (and per-parameter,
``FSDP2DataParallel``, in the lifecycle; its parity is in tests/test_zero_fsdp2.py), ``PipelineParallel`` on a
GPT and on a plain ``nn.Sequential`` -- goes through the same lifecycle at 2 and 4 ranks: wrap (initial weights
made identical over the group), train with and without ``no_sync`` (gradient accumulation) through the one
training loop, parity with ``train_baseline`` (SGD, which exposes a wrong scale; default tolerance
|a - b| <= 1e-6 + 1e-5 |ref|), the per-step communication under ``step_comm``, ``no_sync`` communicating
nothing, ``remove_hooks`` leaving a module that communicates nothing, and clear errors for a rank outside the
group and for ``mesh=`` together with ``group=``. At 4 ranks the wrappers also run on sub-groups of a
``Mesh`` (dp groups {0, 2} and {1, 3} of a dp x tp grid; pp groups of a pp x dp grid).

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
from course_lib.launch import launch
from course_lib.mesh import Mesh
from course_lib.model import GPT, GPTConfig, lm_loss
from course_lib.parallel import dp, pp, zero
from course_lib.parallel.fsdp2 import FSDP2DataParallel
from course_lib.train import TrainConfig, TrainResult, compare, train_baseline

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=16, bias=False)
SGD = TrainConfig(steps=3, global_batch=8, optimizer="sgd", lr=1e-2)
LAUNCH_TIMEOUT = 300

DATA_FORMS = {  # name: (training helper, its variant keywords)
    **{f"dp-{mode}": (dp.train_dp, {"mode": mode, "bucket_mb": 0.01}) for mode in dp.MODES},
    **{f"zero-{stage}": (zero.train_zero, {"stage": stage}) for stage in range(4)},
}


def seq_model(cfg: GPTConfig, seed: int) -> nn.Sequential:
    """A model that is not a GPT: embedding, four tanh MLP blocks, a linear head, as an ``nn.Sequential``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks = [nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), nn.Tanh()) for _ in range(cfg.n_layer)]
        return nn.Sequential(nn.Embedding(cfg.vocab_size, cfg.d_model), *blocks,
                             nn.Linear(cfg.d_model, cfg.vocab_size))


WRAPPERS = {  # name: wrap(model, group) -> wrapper (for the in-process lifecycle checks)
    "dp-overlapped": lambda m, g: dp.DataParallel(m, group=g, mode="overlapped", bucket_mb=0.01),
    "dp-bucketed": lambda m, g: dp.DataParallel(m, group=g, mode="bucketed"),
    **{f"zero-{s}": (lambda m, g, s=s: zero.ZeroDataParallel(m, s, group=g)) for s in range(4)},
    "fsdp2": lambda m, g: FSDP2DataParallel(m, group=g),
}


def _equal_over_group(params: dict[str, torch.Tensor]) -> bool:
    """Whether every rank holds the same parameters (all-gathered checksums)."""
    mine = torch.stack([p.detach().double().sum() for p in params.values()]).float()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], other) for other in every)


def _lifecycle(rank: int, name: str) -> dict:
    """Wrap a model initialised differently on every rank; check the broadcast, no_sync, remove_hooks."""
    out = {}
    model = GPT(CFG, seed=rank)  # different initial weights on every rank
    w = WRAPPERS[name](model, None)
    full = w.full_state_dict() if isinstance(w, zero.ZeroDataParallel) else dict(model.named_parameters())
    out["identical"] = _equal_over_group(full)
    x, y = global_batch(0, 4, CFG.seq_len, 0)
    x, y = shard(x, rank, dist.get_world_size()), shard(y, rank, dist.get_world_size())
    with comm.recording() as log, w.no_sync():
        lm_loss(w(x), y).backward()
    out["no_sync_calls"] = log.count("all_reduce") + log.count("reduce_scatter")  # stage 3 still gathers
    with comm.recording() as log:
        lm_loss(w(x), y).backward()
        w.finish_gradient_sync()
    out["sync_calls"] = log.count()
    w.remove_hooks()
    with comm.recording() as log:
        lm_loss(model(x), y).backward()  # the bare module, hooks gone: no communication
    out["after_remove_calls"] = log.count()
    out["weights_kept"] = torch.allclose(model(x), GPT(CFG, seed=0)(x), atol=1e-6)
    return out


def _errors(rank: int) -> dict:
    """Clear errors: a rank outside the wrapper's group; mesh= with group=."""
    out = {}
    lonely = dist.new_group([0])  # collective: every rank creates it; only rank 0 is in it
    makers = {"dp": lambda: dp.DataParallel(GPT(CFG), group=lonely),
              "zero": lambda: zero.ZeroDataParallel(GPT(CFG), 3, group=lonely),
              "pp": lambda: pp.PipelineParallel(GPT(CFG), group=lonely)}
    if rank != 0:
        for name, make in makers.items():
            try:
                make()
                out[name] = None
            except ValueError as e:
                out[name] = str(e)
    try:
        dp.DataParallel(GPT(CFG), mesh=Mesh(dp=dist.get_world_size()), group=dist.group.WORLD)
        out["both"] = None
    except ValueError as e:
        out["both"] = str(e)
    return out


def _suite(rank: int, world_size: int) -> dict:
    runs: dict = {}
    for name, (fn, kw) in DATA_FORMS.items():
        for accumulation in (1, 2):
            runs[name, accumulation] = fn(rank, world_size, CFG, SGD, accumulation=accumulation, **kw)
    runs["pp-gpt"] = pp.train_pp(rank, world_size, CFG, SGD, "1f1b", 4)
    runs["pp-seq"] = pp.train_pp(rank, world_size, CFG, SGD, "gpipe", 2, model_fn=seq_model)
    for name in WRAPPERS:
        runs["lifecycle", name] = _lifecycle(rank, name)
    runs["errors"] = _errors(rank)
    if world_size == 4:
        grid = Mesh(dp=2, tp=2)  # dp groups {0, 2} and {1, 3}: not contiguous
        runs["mesh", "dp"] = dp.train_dp(rank, world_size, CFG, SGD, mesh=grid)
        runs["mesh", "zero"] = zero.train_zero(rank, world_size, CFG, SGD, 3, mesh=grid)
        runs["mesh", "dp-ranks"] = grid.ranks("dp")
        line = Mesh(pp=2, dp=2)
        runs["mesh", "pp"] = pp.train_pp(rank, world_size, CFG, SGD, "1f1b", 2, mesh=line)
        runs["mesh", "pp-ranks"] = line.ranks("pp")
    return runs


@functools.cache
def suite(world_size: int) -> list[dict]:
    return launch(_suite, world_size, timeout=LAUNCH_TIMEOUT)


@functools.cache
def baseline(model: str = "gpt") -> TrainResult:
    return train_baseline(CFG, SGD, model_fn=seq_model if model == "seq" else GPT)


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
    assert_parity(pp.merge_results(ranks), f"pipeline of a {model}", model)
    assert all(len(r.step_comm) == SGD.steps and r.step_comm[0] for r in ranks)
    assert all(r.step_comm[0] == r.steps[0].comm for r in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", WRAPPERS)
def test_lifecycle(world_size, name):
    for runs in suite(world_size):
        got = runs["lifecycle", name]
        assert got["identical"], f"{name}: ranks start from different weights"
        assert got["no_sync_calls"] == 0, f"{name}: no_sync() reduced gradients"
        assert got["sync_calls"] > 0, f"{name}: a synchronising step did not communicate"
        assert got["after_remove_calls"] == 0, f"{name}: hooks left after remove_hooks()"
        assert got["weights_kept"], f"{name}: the bare module lost the broadcast weights"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_clear_errors(world_size):
    for rank, runs in enumerate(suite(world_size)):
        got = runs["errors"]
        assert "mesh= or group=" in got["both"]
        if rank:
            for name in ("dp", "zero", "pp"):
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
        assert_parity(pp.merge_results([ranks[i]["mesh", "pp"] for i in members]), f"pipeline on ranks {members}")
