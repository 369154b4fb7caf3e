"""course_lib.parallel.dp: parity (baseline, DistributedDataParallel), accumulation, comm counts and bytes,
tied / frozen / unused parameters, and broken variants that must fail.

Launches are few and batched (each costs seconds of rank start-up on 2 cores): one launch at DP 2 (parity
suite) and one at DP 4 (parity suite plus counts, special parameters and broken variants); every test reads
their cached results.

Parity configuration. The default tolerance (|a-b| <= 1e-6 + 1e-5 |ref|) holds for every run here with SGD
(lr 1e-2) and AdamW at lr 1e-3 on ``GPTConfig(bias=False)``. It cannot hold for AdamW on the default
``bias=True`` GPT in *any* data-parallel layout, PyTorch's DDP included: the gradient of ``k_proj.bias`` is zero
in exact arithmetic (softmax ignores a shift shared by all scores of a query), so it is pure rounding noise, and
AdamW divides it by its own RMS, turning noise into lr-sized steps (max diff ~7e-5 at lr 1e-2). At lr 1e-2 and
DP 4, AdamW's near-sign first step also lifts q/k weight differences to ~2e-6 (DDP: 2.3e-6). SGD is checked too
because it is the optimizer that exposes a missing 1/N or 1/m: Adam's update does not depend on the gradient's
scale, which is how a "loss not divided by the number of micro-batches" bug can hide under Adam.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from course_lib import comm
from course_lib.data import global_batch, shard
from course_lib.estimates import accounting
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel import dp, oracles, runs
from course_lib.parallel.contract import broadcast_from_first
from course_lib.runtime.launch import RankError, RankTimeout, launch
from course_lib.train import (
    TrainConfig,
    TrainResult,
    assert_parity,
    compare,
    copy_parameters,
    make_optimizer,
    train_baseline,
)

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(bias=False)
TIED = CFG.with_(tie_embeddings=True)
SGD = TrainConfig(optimizer="sgd", lr=1e-2)  # momentum 0.9, weight decay 0.01
ADAMW = TrainConfig(optimizer="adamw", lr=1e-3)
OPTS = {"sgd": SGD, "adamw": ADAMW}
BUCKET_MB = 0.1  # ~100 KiB: the 0.53 MB tiny GPT then makes 4 buckets (overlap and ordering are exercised)
FROZEN = ("pos_emb.weight", "blocks.0.norm1.weight")
LAUNCH_TIMEOUT = 180
MODES = ("naive", "bucketed", "overlapped")  # dp.MODES less "scheduled": a pipeline's REDUCE_GRAD launches it


# ----------------------------------------------------------------------------------------------------------------
# Single-process references


@functools.cache
def baseline(cfg: GPTConfig, tc: TrainConfig) -> TrainResult:
    return train_baseline(cfg, tc)


@functools.cache
def reference(cfg: GPTConfig, tc: TrainConfig, model_fn=GPT, freeze=()) -> TrainResult:
    """The baseline for models with frozen or extra parameters."""
    return train_baseline(cfg, tc, model_fn=model_fn, freeze=freeze)


class GPTWithExtras(GPT):
    """The GPT plus two odd-sized parameters: ``rare`` (7 logit offsets, used only by rows that contain
    ``RARE_TOKEN``, so some ranks get no gradient for it while others do) and ``never`` (3 values, never used)."""

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__(config, seed)
        self.rare = nn.Parameter(torch.full((7,), 0.1))
        self.never = nn.Parameter(torch.ones(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = super().forward(idx)
        hit = (idx == RARE_TOKEN).any(dim=1)
        if hit.any():
            offset = hit[:, None, None].float() * self.rare
            logits = torch.cat([logits[..., :7] + offset, logits[..., 7:]], dim=-1)
        return logits


def _rare_token(n: int) -> int:
    """A token in DP rank 0's rows of step 0 but not in rank n-1's: ``rare`` is then used on some ranks only."""
    x, _ = global_batch(0, SGD.global_batch, CFG.seq_len, SGD.seed)
    first, last = set(shard(x, 0, n).flatten().tolist()), set(shard(x, n - 1, n).flatten().tolist())
    return min(first - last)


RARE_TOKEN = _rare_token(4)


# ----------------------------------------------------------------------------------------------------------------
# Variants that must fail parity


class NoDivide(dp.DataParallel):
    """Forgets the 1/N: gradients come out N times too large."""

    def average(self, summed: torch.Tensor) -> None:
        pass


class DropLastBucket(dp.DataParallel):
    """Never all-reduces the last (partial) bucket: its parameters keep their local gradients."""

    def build_buckets(self, params=None) -> list[dp.Bucket]:
        return super().build_buckets(params)[:-1]


# ----------------------------------------------------------------------------------------------------------------
# Rank functions: many runs per launch


def _parity_suite(rank: int, world_size: int) -> dict:
    out = {}
    for opt, tc in OPTS.items():
        for mode in MODES:
            out["dp", mode, opt] = runs.train_dp(rank, world_size, CFG, tc, mode=mode, bucket_mb=BUCKET_MB)
        out["torch_ddp", opt] = oracles.train_torch_ddp(rank, world_size, CFG, tc)
    for mode in MODES:
        out["accum", mode, "sgd"] = runs.train_dp(rank, world_size, CFG, SGD, mode=mode, bucket_mb=BUCKET_MB,
                                                 accumulation=2)
    out["accum", "overlapped", "adamw"] = runs.train_dp(rank, world_size, CFG, ADAMW, mode="overlapped",
                                                       bucket_mb=BUCKET_MB, accumulation=2)
    return out


def _special_suite(rank: int, world_size: int) -> dict:
    out = _parity_suite(rank, world_size)  # its SGD runs give the counts of naive, bucketed 0.1, overlapped 0.1
    one_step = TrainConfig(optimizer="sgd", steps=1)
    for mb in (0.0, 0.05, 1000.0):
        out["dp", "bucketed", "sgd", mb] = runs.train_dp(rank, world_size, CFG, one_step, mode="bucketed", bucket_mb=mb)
    for mode in MODES:
        out["tied", mode] = runs.train_dp(rank, world_size, TIED, SGD, mode=mode, bucket_mb=BUCKET_MB)
        out["frozen", mode] = runs.train_dp(rank, world_size, CFG, SGD, mode=mode, bucket_mb=BUCKET_MB,
                                           freeze=FROZEN)
    for mode in ("naive", "overlapped"):
        for find in (True, False):
            out["extras", mode, find] = runs.train_dp(rank, world_size, CFG, SGD, mode=mode, bucket_mb=BUCKET_MB,
                                                     model_fn=GPTWithExtras, find_unused_parameters=find)
    out["broken", "no_divide"] = runs.train_dp(rank, world_size, CFG, SGD, mode="bucketed", bucket_mb=BUCKET_MB,
                                              data_parallel=NoDivide)
    out["broken", "drop_last_bucket"] = runs.train_dp(rank, world_size, CFG, ADAMW, mode="bucketed",
                                                     bucket_mb=BUCKET_MB, data_parallel=DropLastBucket)
    # broadcast_parameters: every rank starts from its own seed and ends with rank 0's weights
    model = GPT(CFG, seed=100 + rank)
    with comm.recording() as log:
        broadcast_from_first(model, None)
    out["broadcast"] = (copy_parameters(model), log.count("broadcast"))
    # a second synchronising forward without finish_gradient_sync() in between is refused
    model = dp.DataParallel(GPT(CFG), mode="overlapped")
    x, y = global_batch(0, 2, CFG.seq_len)
    lm_loss(model(x), y).backward()
    try:
        model(x)
        out["forgot_finish"] = "no error"
    except RuntimeError as e:
        out["forgot_finish"] = str(e)
    model.finish_gradient_sync()  # the launched all-reduces still complete on every rank
    out |= _scheduled(rank, world_size)
    return out


def _scheduled(rank: int, world_size: int) -> dict:
    """Scheduled mode (a pipeline's REDUCE_GRAD): nothing reduces by itself, ``launch(params)`` reduces a
    stage's parameters; the averaged gradients are the bucketed mode's, and a stage never launched is refused."""
    x, y = (shard(t, rank, world_size) for t in global_batch(0, SGD.global_batch, CFG.seq_len, SGD.seed))
    out, grads = {}, {}
    for mode in ("bucketed", "scheduled"):
        model = GPT(CFG)
        w = dp.DataParallel(model, mode=mode, bucket_mb=BUCKET_MB)
        with comm.recording() as log:
            lm_loss(w(x), y).backward()
        if mode == "scheduled":
            out["scheduled_backward_calls"] = log.count()
            blocks = list(model.blocks.parameters())
            in_blocks = {id(p) for p in blocks}
            w.launch([p for p in model.parameters() if id(p) not in in_blocks])  # two "stages", in turn
            w.launch(blocks)
        w.finish_gradient_sync()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    # the same sums in other buckets: gloo's ring adds an element's N terms g_r in an order set by its chunk;
    # each sum is within (N-1) u S of the exact one (u = 2^-24, S = sum_r |g_r|: N-1 fp32 additions), so the two
    # means differ by at most 2 (N-1) u S / N < 2 u S (the margin covers the rounding of S itself)
    plain = GPT(CFG)
    lm_loss(plain(x), y).backward()
    sums = {name: p.grad.abs() for name, p in plain.named_parameters()}
    for t in sums.values():
        comm.all_reduce(t)
    out["scheduled_unequal"] = [n for n, g in grads["scheduled"].items()
                                if not bool(((g - grads["bucketed"][n]).abs() <= 2 * 2 ** -24 * sums[n]).all())]
    model = GPT(CFG)
    w = dp.DataParallel(model, mode="scheduled")
    lm_loss(w(x), y).backward()
    w.launch(list(model.blocks.parameters()))  # the other stage's REDUCE_GRAD never runs
    try:
        w.finish_gradient_sync()
        out["scheduled_missed"] = "no error"
    except RuntimeError as e:
        out["scheduled_missed"] = str(e)
    return out


_SUITES: dict[int, list[dict] | Exception] = {}


def _launch_suite(n: int) -> list[dict]:
    """Every rank's runs: the parity suite at DP 2; at DP 4 also the special suite. One launch each, its result
    (or its failure, so that a broken implementation does not relaunch for every test) kept for the session."""
    if n not in _SUITES:
        try:
            _SUITES[n] = launch(_special_suite if n == 4 else _parity_suite, n, timeout=LAUNCH_TIMEOUT)
        except (RankError, RankTimeout) as e:
            _SUITES[n] = e
    if isinstance(_SUITES[n], Exception):
        raise _SUITES[n]
    return _SUITES[n]


@pytest.fixture(params=[2, 4], ids=lambda n: f"dp{n}")
def parity_runs(request) -> tuple[int, list[dict]]:
    return request.param, _launch_suite(request.param)


@pytest.fixture
def special_runs() -> list[dict]:
    return _launch_suite(4)


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def _check_every_rank(ref: TrainResult, per_rank: list[TrainResult], label: str) -> runs.RunResult:
    """Rank 0 matches ``ref`` (``course_lib.train``'s noise rule), and every replica is bitwise identical to rank 0."""
    report = assert_parity(ref, per_rank[0])
    print(f"{label}: {report}")
    for r, res in enumerate(per_rank[1:], start=1):
        assert res.losses == per_rank[0].losses, f"{label}: rank {r} reports other losses"
        for name, value in res.params.items():
            assert torch.equal(value, per_rank[0].params[name]), f"{label}: replica {r} drifted on {name}"
    return per_rank[0]


def _grad_sizes(model: nn.Module) -> list[int]:
    """Bytes of each trainable gradient, in the order DP reduces them (reverse definition order)."""
    return [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad][::-1]


def _expected_buckets(sizes: list[int], cap_mb: float) -> list[int]:
    """Bucket sizes in bytes, computed here independently: fill in order, close once >= cap."""
    cap, buckets, current = int(cap_mb * 1024 * 1024), [], 0
    for s in sizes:
        current += s
        if current >= cap:
            buckets.append(current)
            current = 0
    return buckets + ([current] if current else [])


def _grad_records(res: runs.RunResult, step: int) -> list[comm.CommRecord]:
    return [r for r in res.step_comm[step] if r.op == "all_reduce"]


def _two_ring_phases(n: int) -> float:
    return 2 * (n - 1) / n


# ----------------------------------------------------------------------------------------------------------------
# Parity


@pytest.mark.parity
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", MODES)
def test_parity_with_the_single_process_baseline(parity_runs, mode, opt):
    n, ranks = parity_runs
    _check_every_rank(baseline(CFG, OPTS[opt]), [r["dp", mode, opt] for r in ranks], f"DP{n} {mode} {opt}")


@pytest.mark.parity
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_parity_with_torch_distributed_data_parallel(parity_runs, opt):
    n, ranks = parity_runs
    ddp = _check_every_rank(baseline(CFG, OPTS[opt]), [r["torch_ddp", opt] for r in ranks], f"DDP{n} {opt}")
    for mode in MODES:
        report = assert_parity(ddp, ranks[0]["dp", mode, opt], noise=baseline(CFG, OPTS[opt]).noise)
        print(f"DP{n} {mode} {opt} vs DistributedDataParallel: {report}")


@pytest.mark.parity
@pytest.mark.parametrize("mode, opt", [("naive", "sgd"), ("bucketed", "sgd"), ("overlapped", "sgd"),
                                       ("overlapped", "adamw")])
def test_gradient_accumulation_with_no_sync(parity_runs, mode, opt):
    n, ranks = parity_runs
    res = _check_every_rank(baseline(CFG, OPTS[opt]), [r["accum", mode, opt] for r in ranks],
                            f"DP{n} {mode} {opt} 2 micro-batches")
    calls = len(list(GPT(CFG).parameters())) if mode == "naive" else len(_expected_buckets(
        _grad_sizes(GPT(CFG)), BUCKET_MB))
    for rank_runs in ranks:
        for t in rank_runs["accum", mode, opt].timeline:
            assert t.micro_comm_calls == [0, calls], f"step {t.step}: collectives per micro-batch {t.micro_comm_calls}"
    assert len(res.timeline) == SGD.steps


def test_global_batch_arithmetic():
    assert accounting.global_batch_size(micro_batch=1, accumulation_steps=2, dp_degree=4) == SGD.global_batch
    assert accounting.allreduce_bytes_per_rank(1000, 4) == 1500


# ----------------------------------------------------------------------------------------------------------------
# Communication: counts and bytes


@pytest.mark.slow  # the 4-rank launch: make test, not make test-fast
def test_naive_reduces_each_parameter_once_and_sends_2_n_minus_1_over_n(special_runs):
    n = len(special_runs)
    sizes = _grad_sizes(GPT(CFG))
    for rank, suite in enumerate(special_runs):
        res = suite["dp", "naive", "sgd"]
        for step in range(len(res.timeline)):
            records = _grad_records(res, step)
            assert [r.tensor_bytes for r in records] == sizes, f"rank {rank} step {step}"
            assert sum(r.sent_bytes for r in records) == sum(r.recv_bytes for r in records) \
                == _two_ring_phases(n) * sum(sizes)
            assert res.step_comm[step] == records  # nothing else communicates during a step


@pytest.mark.slow  # the 4-rank launch: make test, not make test-fast
@pytest.mark.parametrize("bucket_mb", [0.0, 0.05, BUCKET_MB, 1000.0])
def test_bucketed_sends_one_all_reduce_per_bucket(special_runs, bucket_mb):
    n = len(special_runs)
    sizes = _grad_sizes(GPT(CFG))
    expected = _expected_buckets(sizes, bucket_mb)
    if bucket_mb == 0.0:
        assert len(expected) == len(sizes)  # every gradient its own bucket: the naive count
    if bucket_mb == 1000.0:
        assert len(expected) == 1  # one flat buffer
    for suite in special_runs:
        res = suite["dp", "bucketed", "sgd"] if bucket_mb == BUCKET_MB else suite["dp", "bucketed", "sgd", bucket_mb]
        for step in range(len(res.timeline)):
            records = _grad_records(res, step)
            assert [r.tensor_bytes for r in records] == expected
            assert sum(r.sent_bytes for r in records) == _two_ring_phases(n) * sum(sizes)
    print(f"bucket_mb={bucket_mb}: {len(expected)} buckets of {expected} bytes")


@pytest.mark.slow  # the 4-rank launch: make test, not make test-fast
def test_overlapped_launches_the_same_buckets_in_order(special_runs):
    expected = _expected_buckets(_grad_sizes(GPT(CFG)), BUCKET_MB)
    assert len(expected) == 4
    for suite in special_runs:
        res = suite["dp", "overlapped", "sgd"]
        for step in range(len(res.timeline)):
            assert [r.tensor_bytes for r in _grad_records(res, step)] == expected
            assert res.timeline[step].micro_comm_calls == [len(expected)]


@pytest.mark.slow  # the 4-rank launch: make test, not make test-fast
def test_broadcast_gives_every_rank_the_weights_of_rank_0(special_runs):
    rank0 = copy_parameters(GPT(CFG, seed=100))
    for params, calls in (suite["broadcast"] for suite in special_runs):
        assert calls == len(rank0)
        for name, value in params.items():
            assert torch.equal(value, rank0[name]), name


# ----------------------------------------------------------------------------------------------------------------
# Tied, frozen and unused parameters


@pytest.mark.parity
@pytest.mark.parametrize("mode", MODES)
def test_tied_embeddings_are_reduced_once(special_runs, mode):
    n = len(special_runs)
    _check_every_rank(baseline(TIED, SGD), [r["tied", mode] for r in special_runs], f"tied {mode}")
    tied, untied = GPT(TIED), GPT(CFG)
    assert len(list(tied.parameters())) == len(list(untied.parameters())) - 1
    sizes = _grad_sizes(tied)
    assert sum(sizes) == sum(_grad_sizes(untied)) - TIED.vocab_size * TIED.d_model * 4
    records = _grad_records(special_runs[0]["tied", mode], 0)
    expected = sizes if mode == "naive" else _expected_buckets(sizes, BUCKET_MB)
    assert [r.tensor_bytes for r in records] == expected
    assert sum(r.sent_bytes for r in records) == _two_ring_phases(n) * sum(sizes)


@pytest.mark.parity
@pytest.mark.parametrize("mode", MODES)
def test_frozen_parameters_are_not_communicated(special_runs, mode):
    ref = reference(CFG, SGD, freeze=FROZEN)
    res = _check_every_rank(ref, [r["frozen", mode] for r in special_runs], f"frozen {mode}")
    model = GPT(CFG)
    for name in FROZEN:
        model.get_parameter(name).requires_grad_(False)
        assert torch.equal(res.params[name], copy_parameters(GPT(CFG))[name])  # untouched
    sizes = _grad_sizes(model)
    expected = sizes if mode == "naive" else _expected_buckets(sizes, BUCKET_MB)
    assert [r.tensor_bytes for r in _grad_records(res, 0)] == expected


def test_the_reference_loop_is_train_baseline():
    ref, local = baseline(CFG, SGD), reference(CFG, SGD)
    assert ref.losses == local.losses
    assert all(torch.equal(ref.params[k], local.params[k]) for k in ref.params)


def _zero_gradient_steps(value: torch.Tensor, tc: TrainConfig) -> torch.Tensor:
    """What ``tc``'s optimizer does to a parameter whose gradient is zeros (not None) every step."""
    q = nn.Parameter(value.clone())
    opt = make_optimizer([q], tc)
    for _ in range(tc.steps):
        q.grad = torch.zeros_like(q)
        opt.step()
    return q.detach()


@pytest.mark.parity
@pytest.mark.parametrize("mode", ["naive", "overlapped"])
def test_parameters_without_gradient(special_runs, mode):
    """``rare`` has a gradient on rank 0 but none on rank 3 at step 0 (treated as zeros there: parity holds);
    ``never`` has none anywhere: with find_unused_parameters it keeps ``.grad = None`` like the baseline and is
    never updated; without, it receives a zero gradient, which weight decay and momentum still act on."""
    n = len(special_runs)
    x, _ = global_batch(0, SGD.global_batch, CFG.seq_len, SGD.seed)
    has_rare = [bool((shard(x, r, n) == RARE_TOKEN).any()) for r in range(n)]
    assert has_rare[0] and not has_rare[-1], has_rare  # the situation under test really occurs
    ref = reference(CFG, SGD, model_fn=GPTWithExtras)
    assert torch.equal(ref.params["never"], torch.ones(3))
    assert not torch.equal(ref.params["rare"], torch.full((7,), 0.1))

    found = _check_every_rank(ref, [r["extras", mode, True] for r in special_runs], f"unused {mode}")
    assert torch.equal(found.params["never"], torch.ones(3))
    sizes = _grad_sizes(GPTWithExtras(CFG))
    assert sizes[-2:] == [3 * 4, 7 * 4]  # never, rare: not divisible by N, the exact per-rank ring counts apply
    numels = [s // 4 for s in (sizes if mode == "naive" else _expected_buckets(sizes, BUCKET_MB))]
    for rank, suite in enumerate(special_runs):
        *grads, used_map = _grad_records(suite["extras", mode, True], 0)
        assert [r.tensor_bytes for r in grads] == [4 * k for k in numels]
        assert used_map.tensor_bytes == 4 * len(sizes)  # one int32 per parameter
        assert sum(r.sent_bytes for r in grads) == sum(comm.ring_bytes("all_reduce", k, 4, n, rank)[0]
                                                       for k in numels)

    not_found = special_runs[0]["extras", mode, False]
    decayed = _zero_gradient_steps(torch.ones(3), SGD)
    assert not torch.equal(decayed, torch.ones(3))
    assert torch.equal(not_found.params["never"], decayed)
    assert len(_grad_records(not_found, 0)) == len(numels)  # no used-map exchange without the flag


# ----------------------------------------------------------------------------------------------------------------
# Broken variants must fail


@pytest.mark.parity
@pytest.mark.parametrize("variant, opt", [("no_divide", "sgd"), ("drop_last_bucket", "adamw")])
def test_broken_variants_fail_parity(special_runs, variant, opt):
    report = compare(baseline(CFG, OPTS[opt]), special_runs[0]["broken", variant])
    print(f"{variant}: {report}")
    assert not report.ok
    if variant == "drop_last_bucket":  # the unreduced parameters differ between replicas too
        a, b = special_runs[0]["broken", variant].params, special_runs[1]["broken", variant].params
        assert not torch.equal(a["tok_emb.weight"], b["tok_emb.weight"])


def test_forgetting_finish_gradient_sync_is_an_error(special_runs):
    for suite in special_runs:
        assert "call finish_gradient_sync()" in suite["forgot_finish"]


def test_scheduled_mode_reduces_what_is_launched_and_refuses_a_stage_never_launched(special_runs):
    for suite in special_runs:
        assert suite["scheduled_backward_calls"] == 0  # no hook reduces anything by itself
        assert suite["scheduled_unequal"] == []
        assert "never reduced this step" in suite["scheduled_missed"]
        assert "REDUCE_GRAD" in suite["scheduled_missed"]
