"""course_lib.train: the single-process baseline, the parity check, and a real data-parallel run against both.

The distributed check is a naive data-parallel loop written here (same seed, rank r trains on its shard of the
global batch, gradients all-reduced through course_lib.comm and divided by the world size, same optimizer). It
must match ``train_baseline`` within the noise-derived tolerance of ``course_lib.train`` at world sizes 2 and 4;
the same loop without the division must fail, far beyond it -- so the harness is shown able to fail.

SGD (with momentum) is the optimizer of the distributed check because it shows a wrong gradient scale at once.
Adam would hide a missing 1/N (it is nearly scale-invariant), and it turns rounding noise into full-size steps
for parameters whose gradient is mathematically zero (the key bias: softmax ignores a per-query constant): the
baseline's float64 run measures that noise too, and the tolerance on such a tensor grows with it.
"""

from __future__ import annotations

import copy
import itertools
import math
import subprocess
import tomllib
from pathlib import Path

import pytest
import torch

from course_lib import comm, data
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.runtime.launch import launch
from course_lib.train import (
    FLOOR_ULPS,
    NOISE_MULTIPLE,
    UNIT_ROUNDOFF,
    Fp32Noise,
    TrainConfig,
    TrainResult,
    assert_parity,
    compare,
    copy_parameters,
    make_optimizer,
    train_baseline,
    with_fp32_noise,
)

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")
CFG = GPTConfig()  # the default tiny model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's spin-waiting makes
    them tens of times slower (measured: 6 baseline steps 0.1 s with one thread, 8 s with two under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference() -> TrainResult:
    return train_baseline(CFG, TrainConfig(steps=3, optimizer="sgd", lr=1e-2))


# ------------------------------------------------------------------------------------------ the baseline


@pytest.mark.parametrize(("optimizer", "drop"), [("sgd", 0.2), ("adamw", 1.0)])
def test_baseline_loss_decreases(optimizer, drop):
    losses = train_baseline(CFG, TrainConfig(steps=5, optimizer=optimizer, lr=1e-2)).losses
    assert len(losses) == 5
    assert losses[0] == pytest.approx(math.log(CFG.vocab_size), abs=0.05)  # untrained: about uniform
    assert losses[-1] < losses[0] - drop, losses
    assert all(b < a for a, b in itertools.pairwise(losses)), losses


def test_baseline_is_bitwise_deterministic(reference):
    torch.manual_seed(1234)  # the global RNG must play no part
    again = train_baseline(CFG, TrainConfig(steps=3, optimizer="sgd", lr=1e-2))
    assert again.losses == reference.losses
    assert again.params.keys() == reference.params.keys()
    assert all(torch.equal(again.params[k], reference.params[k]) for k in reference.params)
    other = train_baseline(CFG, TrainConfig(steps=3, optimizer="sgd", lr=1e-2, seed=1))
    assert other.losses != reference.losses


def test_baseline_starts_from_the_seeded_model_and_trains_every_parameter(reference):
    untrained = train_baseline(CFG, TrainConfig(steps=0))
    assert untrained.losses == []
    init = copy_parameters(GPT(CFG, seed=0))
    assert all(torch.equal(untrained.params[k], init[k]) for k in init)
    assert reference.params.keys() == init.keys()
    # the key bias is the exception: its gradient is mathematically zero (softmax ignores a constant per query)
    assert all(not torch.equal(reference.params[k], init[k]) for k in init if "k_proj.bias" not in k)


@pytest.mark.parametrize(("optimizer", "cls"), [("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW)])
def test_make_optimizer_uses_every_setting(optimizer, cls):
    tc = TrainConfig(optimizer=optimizer, lr=0.3, weight_decay=0.125, momentum=0.5)
    params = list(GPT(CFG).parameters())
    opt = make_optimizer(params, tc)
    assert type(opt) is cls
    (group,) = opt.param_groups
    assert group["params"] == params
    assert (group["lr"], group["weight_decay"], group["foreach"]) == (0.3, 0.125, False)
    if optimizer == "sgd":
        assert group["momentum"] == 0.5


def test_unknown_optimizer_is_refused():
    model = GPT(CFG)
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        make_optimizer(list(model.parameters()), TrainConfig(optimizer="lamb"))


# ------------------------------------------------------------------------------------------ compare


def _copy(result: TrainResult) -> TrainResult:
    return copy.deepcopy(result)


def test_compare_passes_identical_results(reference):
    report = compare(reference, _copy(reference))
    assert report.ok and report.problems == []
    assert report.max_loss_diff == 0 and report.max_param_diff == 0 and report.worst_ratio == 0
    assert str(report).startswith("parity PASS") and f"{NOISE_MULTIPLE:g} x the fp32 noise" in str(report)
    assert assert_parity(reference, _copy(reference)).ok


def _allowed(reference: TrainResult, name: str) -> torch.Tensor:
    """The rule of ``course_lib.train``, written out: NOISE_MULTIPLE x the run's noise + FLOOR_ULPS ulp."""
    return NOISE_MULTIPLE * reference.noise.largest()[0] + FLOOR_ULPS * UNIT_ROUNDOFF * reference.params[name].abs()


def test_the_baseline_measures_its_fp32_noise_against_float64(reference):
    noise = reference.noise
    assert noise.params.keys() == reference.params.keys() and len(noise.losses) == len(reference.losses)
    largest, _ = noise.largest()
    assert 0 < largest < 1e-5  # rounding: tiny, yet not zero
    assert noise.losses[0] < 1e-5 * reference.losses[0]
    again = train_baseline(CFG, TrainConfig(steps=3, optimizer="sgd", lr=1e-2)).noise
    assert again == noise  # deterministic: the same kernels give the same rounding


def test_with_fp32_noise_runs_the_training_in_both_precisions(reference):
    seen = []

    def train(dtype):
        seen.append(dtype)
        return TrainResult([1.0 + (dtype == torch.float64) * 1e-7], {"w": torch.zeros(2, dtype=dtype) + 0.5})

    result = with_fp32_noise(train)
    assert seen == [torch.float32, torch.float64]
    assert result.noise.losses == [pytest.approx(1e-7)] and result.noise.params == {"w": 0.0}


def test_compare_accepts_differences_within_tolerance(reference):
    cand = _copy(reference)
    name = "blocks.0.mlp.fc1.weight"
    cand.params[name] += 0.5 * _allowed(reference, name)
    cand.losses = [v + 0.5 * NOISE_MULTIPLE * reference.noise.loss() for v in cand.losses]
    report = compare(reference, cand)
    assert report.ok, str(report)
    assert 0 < report.max_param_diff < float(_allowed(reference, name).max())
    assert 0.4 < report.worst_ratio < 0.6  # half the tolerance, up to the rounding of the fp32 parameter


def test_compare_refuses_differences_just_beyond_tolerance(reference):
    cand = _copy(reference)
    name = "blocks.0.mlp.fc2.weight"
    cand.params[name][0, 0] += 1.5 * float(_allowed(reference, name)[0, 0])
    report = compare(reference, cand)
    assert not report.ok and 1.4 < report.worst_ratio < 1.6
    assert report.problems == [f"{name}: max |diff| {report.max_param_diff:.3e}"]


def test_compare_needs_a_noise_or_a_stated_tolerance(reference):
    bare = TrainResult(reference.losses, reference.params)  # not from train_baseline: no noise measured
    with pytest.raises(ValueError, match="no fp32 noise"):
        compare(bare, _copy(bare))
    assert compare(bare, _copy(bare), noise=reference.noise).ok
    assert compare(bare, _copy(bare), rtol=0.0, atol=0.0).ok  # a stated tolerance: here exact equality
    assert "|a-b| <= 0 + 0*|ref|" in str(compare(bare, _copy(bare), rtol=0.0, atol=0.0))


def test_from_step_keeps_the_parameters_and_the_noise_of_the_run(reference):
    tail = reference.from_step(1)
    assert tail.losses == reference.losses[1:] and tail.params is reference.params
    assert tail.noise is reference.noise


def test_compare_names_a_parameter_perturbed_beyond_tolerance(reference):
    cand = _copy(reference)
    name = "blocks.1.attn.v_proj.weight"
    cand.params[name][3, 5] += 1e-3
    report = compare(reference, cand)
    assert not report.ok
    assert report.worst_param == name
    assert report.max_param_diff == pytest.approx(1e-3, rel=1e-3)
    assert report.max_loss_diff == 0
    assert len(report.problems) == 1 and name in report.problems[0]
    assert "FAIL" in str(report) and name in str(report)


def test_compare_catches_a_nan_parameter(reference):
    cand = _copy(reference)
    cand.params["lm_head.weight"][0, 0] = float("nan")
    report = compare(reference, cand)
    assert not report.ok
    assert any("lm_head.weight" in p for p in report.problems)


def test_compare_catches_a_perturbed_loss(reference):
    cand = _copy(reference)
    cand.losses[1] += 1e-3
    report = compare(reference, cand)
    assert not report.ok
    assert report.max_loss_diff == pytest.approx(1e-3, rel=1e-3)
    assert len(report.problems) == 1 and "losses differ" in report.problems[0]


def test_compare_catches_a_missing_step(reference):
    cand = _copy(reference)
    cand.losses = cand.losses[:-1]
    report = compare(reference, cand)
    assert not report.ok and report.max_loss_diff == float("inf")
    assert f"{len(reference.losses) - 1} losses, expected {len(reference.losses)}" in report.problems


def test_compare_catches_missing_and_extra_parameters(reference):
    cand = _copy(reference)
    del cand.params["norm_f.weight"]
    cand.params["blocks.0.attn.q_proj.weight.shard0"] = torch.zeros(2)
    report = compare(reference, cand)
    assert not report.ok
    assert "missing parameters: ['norm_f.weight']" in report.problems
    assert "unexpected parameters: ['blocks.0.attn.q_proj.weight.shard0']" in report.problems


def test_compare_catches_a_shape_mismatch(reference):
    cand = _copy(reference)
    name = "blocks.0.attn.q_proj.weight"
    cand.params[name] = cand.params[name][:32]  # e.g. a tensor-parallel shard returned instead of the full weight
    report = compare(reference, cand)
    assert not report.ok
    assert report.worst_param == name and report.max_param_diff == float("inf")
    assert f"{name}: shape (32, 64), expected (64, 64)" in report.problems


def test_compare_refuses_an_empty_reference():
    report = compare(TrainResult([], {}), TrainResult([], {}), noise=Fp32Noise([], {}))
    assert not report.ok  # nothing compared is not a pass


def test_assert_parity_raises_with_the_report(reference):
    cand = _copy(reference)
    cand.params["tok_emb.weight"] *= 1.01
    with pytest.raises(AssertionError) as info:
        assert_parity(reference, cand)
    assert str(info.value) == str(compare(reference, cand))
    assert "parity FAIL" in str(info.value) and "tok_emb.weight" in str(info.value)
    assert assert_parity(reference, cand, rtol=0.02).ok  # a looser tolerance passes it


def test_make_test_runs_the_parity_tests_again_on_generic_kernels():
    """Another kernel path rounds differently: ``make test`` reruns the tests marked ``generic_kernels`` on PyTorch's
    generic kernels, so a tolerance that holds only on this CPU's AVX2/AVX-512 kernels fails there too. The marked
    set follows the marker's rule (tests/conftest.py ``GENERIC_KERNELS``, whose every pattern a whole collection
    checks): every axis, the compositions and the stated tolerances have their entry."""
    from tests.conftest import GENERIC_KERNELS

    repo = Path(__file__).resolve().parents[1]
    plan = subprocess.run(["make", "-n", "-s", "--no-print-directory", "test", "VENV=.venv",
                           "PIP_TORCH=2.13.0+cpu"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr  # what `make test` would run, lanes and all (nothing is run)
    assert ('ATEN_CPU_CAPABILITY=default .venv/bin/python -m pytest tests -n 2 --dist loadscope --durations=25 '
            '-m "generic_kernels and not browser"') in plan.stdout, plan.stdout
    markers = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("parity:") for m in markers) and any(m.startswith("generic_kernels:") for m in markers)
    axes = {"dp", "zero", "fsdp2", "tp", "cp", "ep", "pp", "contract", "compositions", "tolerances"}
    assert set(GENERIC_KERNELS) == axes and all(GENERIC_KERNELS.values())


def test_report_lists_at_most_ten_problems(reference):
    cand = _copy(reference)
    for k in cand.params:
        cand.params[k] = cand.params[k] + 1.0
    report = compare(reference, cand)
    assert len(report.problems) == len(reference.params) > 10
    assert len(str(report).splitlines()) == 1 + 10


# ------------------------------------------------------------------------------------------ data parallel


def _naive_dp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig, divide: bool) -> TrainResult:
    model = GPT(cfg, seed=tc.seed)  # same seed on every rank: nothing to broadcast
    opt = make_optimizer(list(model.parameters()), tc)
    losses = []
    for step in range(tc.steps):
        x, y = data.global_batch(step, tc.global_batch, cfg.seq_len, tc.seed)
        x, y = data.shard(x, rank, world_size), data.shard(y, rank, world_size)
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # one all-reduce per step: every gradient and the loss in one flat buffer (38 small calls cost more
        # than the training itself on two oversubscribed cores)
        params = list(model.parameters())
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
        comm.all_reduce(flat)
        losses.append(flat[-1].item() / world_size)  # equal shards: the global mean is the mean of rank means
        if divide:
            flat /= world_size
        for p, g in zip(params, flat[:-1].split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p.grad))
        opt.step()
    return TrainResult(losses, copy_parameters(model))


def _dp_both_ways(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig) -> dict:
    comm.log().clear()
    right = _naive_dp(rank, world_size, cfg, tc, divide=True)
    calls, nbytes = comm.log().count("all_reduce"), sum(r.tensor_bytes for r in comm.log().select("all_reduce"))
    wrong = _naive_dp(rank, world_size, cfg, tc, divide=False)
    return {"right": right, "wrong": wrong, "all_reduce_calls": calls, "all_reduce_bytes": nbytes}


@pytest.mark.parity
@pytest.mark.parametrize("world_size", [2, 4])
def test_naive_data_parallel_matches_the_baseline_and_a_missing_division_is_caught(reference, world_size):
    tc = TrainConfig(steps=3, optimizer="sgd", lr=1e-2)
    out = launch(_dp_both_ways, world_size, CFG, tc, timeout=120)
    n_params = sum(p.numel() for p in reference.params.values())
    for rank, got in enumerate(out):
        assert got["all_reduce_calls"] == tc.steps
        assert got["all_reduce_bytes"] == tc.steps * 4 * (n_params + 1)
        report = compare(reference, got["right"])
        assert report.ok, f"rank {rank}: {report}"
        bad = compare(reference, got["wrong"])
        assert not bad.ok, f"rank {rank}: the harness missed gradients {world_size}x too large"
        assert bad.worst_ratio > 100  # far beyond the noise, not at its edge
        assert bad.max_loss_diff > 1e-3  # the second step already sees the wrong update
    first = out[0]["right"].params
    for got in out[1:]:  # every replica holds the same weights
        assert all(torch.equal(got["right"].params[k], first[k]) for k in first)
