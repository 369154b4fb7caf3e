"""FSDP2-style per-parameter sharding (``course_lib.parallel.fsdp2``) and the optimizer-level ZeRO-1
(``ShardedOptimizer``): parity with ``train_baseline`` (default tolerance) and with PyTorch's ``fully_shard`` at
2 and 4 ranks, gradient shards of the parameters' own shape and dtype after backward, gradient accumulation
under ``no_sync``, the optimizer state partitioned over the ranks, and the memory measured by
``MemoryTracker`` against the estimator (the ZeRO-3 formula) with a variant that keeps the full gradients.

The model has odd sizes (as in tests/test_zero.py: d_model 33, d_ff 65, seq_len 15) so that dim 0 of most
parameters does not divide by 2 or 4: the padding rows are exercised.
"""

from __future__ import annotations

import functools

import pytest
import torch

from course_lib.data import global_batch, shard
from course_lib.launch import launch
from course_lib.memory import ParallelLayout, training_memory, zero_memory_per_device
from course_lib.memtrack import MemoryTracker
from course_lib.model import GPT, GPTConfig, lm_loss, num_params
from course_lib.parallel import zero
from course_lib.parallel.contract import ParallelWrapper
from course_lib.parallel.fsdp2 import FSDP2DataParallel, PerParameterUnit
from course_lib.parallel.loop import train_loop
from course_lib.parallel.sharded_optimizer import ShardedOptimizer, partition
from course_lib.train import TrainConfig, TrainResult, compare, full_params, make_optimizer, train_baseline

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(bias=False, d_model=33, n_head=3, d_ff=65, n_layer=3, seq_len=15)
SGD = TrainConfig(optimizer="sgd", lr=1e-2)
ADAMW = TrainConfig(optimizer="adamw", lr=1e-3)
PSI = num_params(GPT(CFG))
MODEL_STATES = ("parameters", "gradients", "optimizer_state")


class KeepFullGradUnit(PerParameterUnit):
    """Never drops the full gradients after the reduce-scatter: Ψ x 4 bytes more gradients than FSDP holds."""

    def free_grads(self) -> None:
        pass


class KeepFullGrad(FSDP2DataParallel):
    unit_class = KeepFullGradUnit


def _sharded_optimizer(rank, world_size, tc):
    model = GPT(CFG, seed=tc.seed)
    opt_cls, kw = (torch.optim.SGD, {"momentum": tc.momentum}) if tc.optimizer == "sgd" else (torch.optim.AdamW, {})
    opt = ShardedOptimizer(model.parameters(), opt_cls, lr=tc.lr, weight_decay=tc.weight_decay, foreach=False, **kw)
    out = train_loop(ParallelWrapper(model), opt, CFG, tc, data_rank=rank, data_size=world_size)
    local = sum(p.numel() for g in opt.optimizer.param_groups for p in g["params"])
    return TrainResult(out.losses, full_params(model)), local


def _grad_shards(rank, world_size):
    """One backward: every shard has a gradient of its own shape and dtype; the full parameters have none."""
    model = GPT(CFG)
    w = FSDP2DataParallel(model)
    x, y = global_batch(0, 8, CFG.seq_len, 0)
    lm_loss(w(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    shards = list(w.parameters())
    return ([(s.grad is not None and s.grad.shape == s.shape and s.grad.dtype == s.dtype) for s in shards],
            [p.grad is None for p in model.parameters()], len(shards) == len(list(model.parameters())))


def _tracked_step(rank, world_size, wrapper_class):
    """One AdamW step under ``MemoryTracker`` watching the shards (``w``) and the full parameters (``model``):
    the breakdown at the optimizer step's peak, each category's own peak, the units' sizes."""
    model = GPT(CFG, seed=ADAMW.seed)
    w = wrapper_class(model)
    opt = make_optimizer(list(w.parameters()), ADAMW)
    x, y = global_batch(0, ADAMW.global_batch, CFG.seq_len, ADAMW.seed)
    with MemoryTracker([w, model], opt) as mt:
        loss = lm_loss(w(shard(x, rank, world_size)), shard(y, rank, world_size))
        loss.backward()
        del loss
        opt.step()
    units = [(sum(p.numel() for p in u.params), sum(s.numel() for s in u.shards)) for u in w.units]
    return dict(mt.phase_peaks["optimizer"]), dict(mt.category_peaks), units


def _suite(rank, world_size):
    runs = {}
    for name, tc in (("sgd", SGD), ("adamw", ADAMW)):
        runs["fsdp2", name] = zero.train_zero(rank, world_size, CFG, tc, 3, wrapper_class=FSDP2DataParallel)
        runs["sharded_optimizer", name] = _sharded_optimizer(rank, world_size, tc)
    runs["fsdp2", "accumulate"] = zero.train_zero(rank, world_size, CFG, SGD, 3, accumulation=2,
                                                  wrapper_class=FSDP2DataParallel)
    runs["fsdp2", "prefetch"] = zero.train_zero(rank, world_size, CFG, ADAMW, 3, prefetch=True,
                                                wrapper_class=FSDP2DataParallel)
    runs["fully_shard"] = zero.train_fsdp2(rank, world_size, CFG, ADAMW)
    runs["grad_shards"] = _grad_shards(rank, world_size)
    runs["memory"] = _tracked_step(rank, world_size, FSDP2DataParallel)
    runs["memory", "keeps_full_grad"] = _tracked_step(rank, world_size, KeepFullGrad)
    return runs


@functools.cache
def suite(world_size):
    return launch(_suite, world_size, timeout=240)


@functools.cache
def baseline(tc):
    return train_baseline(CFG, tc)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("run", "tc"), [(("fsdp2", "sgd"), SGD), (("fsdp2", "adamw"), ADAMW),
                                         (("fsdp2", "accumulate"), SGD), (("fsdp2", "prefetch"), ADAMW)])
def test_per_parameter_sharding_matches_the_baseline_and_fully_shard(world_size, run, tc):
    for rank, runs in enumerate(suite(world_size)):
        report = compare(baseline(tc), runs[run])
        assert report.ok, f"{run}, rank {rank}: {report}"
        if tc is ADAMW:
            assert compare(runs["fully_shard"], runs[run], noise=baseline(tc).noise).ok, \
                f"{run} vs fully_shard, rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_parameter_has_its_own_gradient_shard_after_backward(world_size):
    for runs in suite(world_size):
        shards_ok, full_none, one_each = runs["grad_shards"]
        assert one_each and all(shards_ok) and all(full_none)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("tc", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_sharded_optimizer_matches_the_baseline_and_partitions_the_state(world_size, tc):
    ranks = suite(world_size)
    for rank, runs in enumerate(ranks):
        result, _ = runs["sharded_optimizer", tc.optimizer]
        report = compare(baseline(tc), result)
        assert report.ok, f"rank {rank}: {report}"
    local = [runs["sharded_optimizer", tc.optimizer][1] for runs in ranks]
    total = sum(p.numel() for p in GPT(CFG).parameters())
    assert sum(local) == total and max(local) < total / world_size * 1.5


def estimator_errors(states: dict[str, int], n: int) -> list[str]:
    """Where the model states measured at the optimizer step leave the ZeRO-3 estimate by more than 2% (the
    tolerance of tests/test_zero.py's flat form: the padding rows are the difference), per category and in
    total. fp32 weights and gradients, K = 8 (AdamW's m and v)."""
    est = training_memory(CFG, precision="fp32", optimizer="adamw", micro_batch=ADAMW.global_batch // n,
                          layout=ParallelLayout(dp=n, zero=3), activation_formula="adapted")
    predicted = {**{cat: est[cat] for cat in MODEL_STATES},
                 "total": zero_memory_per_device(PSI, K=8, N_d=n, stage=3, param_bytes=4, grad_bytes=4)}
    measured = {**{cat: states[cat] for cat in MODEL_STATES}, "total": sum(states[cat] for cat in MODEL_STATES)}
    return [f"{k}: measured {measured[k]} B, estimated {v:.0f} B" for k, v in predicted.items()
            if abs(measured[k] - v) > 0.02 * v]


@pytest.mark.slow
def test_measured_memory_by_category_matches_the_zero3_estimate():
    """At 2 ranks: model states (sharded: Ψ/N each) within 2% of the estimate, and exactly the shards' bytes;
    activations within 1% of the adapted formula (tests/test_memory.py's tolerance: the gathered weights saved
    for backward count as parameters, not activations); the parameters' own peak is the shards plus the
    gathered root (kept from forward to backward) and one block, as for the flat form in tests/test_zero.py.
    (At 4 ranks the padding rows -- up to N-1 per parameter, not per unit -- put the parameters 4.9% above Ψ/N:
    the cost the module docstring of ``fsdp2`` states.)"""
    n = 2
    est = training_memory(CFG, precision="fp32", optimizer="adamw", micro_batch=ADAMW.global_batch // n,
                          layout=ParallelLayout(dp=n, zero=3), activation_formula="adapted")
    for rank, runs in enumerate(suite(n)):
        states, peaks, units = runs["memory"]
        assert estimator_errors(states, n) == [], f"rank {rank}"
        shards = 4 * sum(s for _, s in units)
        assert states["parameters"] == states["gradients"] == shards
        assert states["optimizer_state"] == 2 * shards + 4 * len(list(GPT(CFG).parameters()))  # + step counters
        assert peaks["activations"] == pytest.approx(est["activations"], rel=0.01)
        root, block = 4 * units[-1][0], 4 * max(full for full, _ in units[:-1])
        assert peaks["parameters"] == shards + root + block


@pytest.mark.slow
def test_a_variant_that_keeps_the_full_gradients_fails_the_estimate():
    states, _, _ = suite(2)[0]["memory", "keeps_full_grad"]
    errors = estimator_errors(states, 2)
    assert any(e.startswith("gradients") for e in errors) and any(e.startswith("total") for e in errors), errors
    assert states["gradients"] >= 4 * PSI  # the full gradients, on top of the shards


def test_partition_is_greedy_and_balanced():
    assert partition([10, 1, 7, 3], 2) == [0, 0, 1, 1]  # 10 -> 0, 7 -> 1, 3 -> 1 (7 < 10), 1 -> 0 (tie 10 = 10)
    assert partition([5, 5, 5, 5], 4) == [0, 1, 2, 3]


def test_per_parameter_sharding_refuses_other_stages():
    with pytest.raises(ValueError, match="stage 3"):
        FSDP2DataParallel(GPT(CFG), 2)
