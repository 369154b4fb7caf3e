"""course_lib.parallel.zero: ZeRO-1/2/3 parity (baseline, FSDP2), comm counts and exact bytes, measured memory vs
the ZeRO formula, sharded checkpoints (same N, N=2 -> N=4, N -> one process, stop/resume bitwise), and broken
variants that must fail.

Launches are few and batched: one suite of runs at DP 2, one at DP 4 (which resumes the DP-2 checkpoints), one
in-process for error messages; the tests below read their results.

Parity configuration, as in tests/test_dp.py and for the same reason: the default tolerance cannot hold for
AdamW on a GPT with attention biases in *any* data-parallel layout (the gradient of ``k_proj.bias`` is zero in
exact arithmetic, rounding noise that AdamW turns into lr-sized steps; a single process that merely splits its
batch in two already differs by 7e-5). So: ``bias=False``, AdamW at lr 1e-3, and SGD (lr 1e-2), which is the
optimizer that exposes a missing 1/N (Adam's update hardly depends on the gradient's scale).

The model has odd sizes (d_model 33, d_ff 65, seq_len 15) so that the flat buffers need padding at N=2 (root:
1 element) and N=4 (root: 3, each block: 2): the padding is exercised, and counted in the exact byte checks.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest
import torch

from course_lib import comm
from course_lib.data import global_batch, micro_batches, shard
from course_lib.estimates import accounting
from course_lib.estimates.model_states import zero_memory_per_device
from course_lib.model import GPT, lm_loss, num_params
from course_lib.model_config import GPTConfig
from course_lib.parallel import checkpoint, oracles, zero, zero_unit
from course_lib.parallel.runs import train_zero
from course_lib.runtime.launch import launch
from course_lib.train import (
    Fp32Noise,
    TrainConfig,
    TrainResult,
    compare,
    copy_parameters,
    make_optimizer,
    train_baseline,
)

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(bias=False, d_model=33, n_head=3, d_ff=65, n_layer=3, seq_len=15)
PSI = num_params(GPT(CFG))
SGD = TrainConfig(optimizer="sgd", lr=1e-2)  # momentum 0.9, weight decay 0.01
ADAMW = TrainConfig(optimizer="adamw", lr=1e-3)
STOP_AT = 2  # the checkpoint runs stop after this many of the 3 steps
LAUNCH_TIMEOUT = 240


@functools.cache
def baseline(tc: TrainConfig) -> TrainResult:
    return train_baseline(CFG, tc)


def assert_ok(ref: TrainResult, got: TrainResult, what: str, noise: Fp32Noise | None = None) -> None:
    report = compare(ref, got, noise=noise)
    assert report.ok, f"{what}: {report}"


# ----------------------------------------------------------------------------------------------------------------
# What the ranks run (module-level: shipped to the ranks by value, see conftest)


class OwnerOffsetUnit(zero_unit.FlatParamUnit):
    """Every rank takes the shard of its right neighbour: a wrong owner offset (consistent on all ranks)."""

    def bounds(self) -> tuple[int, int]:
        return zero_unit.shard_bounds((self.shard_rank + 1) % self.world_size, self.layout.shard_numel)


class NoAverageUnit(zero_unit.FlatParamUnit):
    """Reduce-scatter sums the gradients and nobody divides by N."""

    def average(self, g: torch.Tensor) -> None:
        pass


def _broken_owner_offset(rank, world_size, tc):
    return train_zero(rank, world_size, CFG, tc, 3,
                      sharding=functools.partial(zero.ZeroDataParallel, unit=OwnerOffsetUnit))


def _broken_no_average(rank, world_size, tc):
    return train_zero(rank, world_size, CFG, tc, 2,
                      sharding=functools.partial(zero.ZeroDataParallel, unit=NoAverageUnit))


def _accumulate(rank, world_size, stage, m):
    """Stages 2/3 with m micro-batches per step: each backward reduce-scatters and adds into the shard's grad."""
    zdp = zero.ZeroDataParallel(GPT(CFG, seed=SGD.seed), stage)
    opt = make_optimizer(zdp.parameters(), SGD)
    losses = []
    for step in range(SGD.steps):
        x, y = global_batch(step, SGD.global_batch, CFG.seq_len, SGD.seed)
        total = torch.zeros(1)
        for xm, ym in micro_batches(shard(x, rank, world_size), shard(y, rank, world_size), m):
            loss = lm_loss(zdp(xm), ym) / m
            loss.backward()
            total += loss.detach()
        opt.step()
        zdp.after_step()
        opt.zero_grad(set_to_none=True)
        comm.all_reduce(total)
        losses.append(total.item() / world_size)
    return TrainResult(losses, zdp.full_parameters())


def _suite_dp2(rank, world_size, ckpt):
    out = {}
    for stage in (0, 1, 2, 3):
        out["zero", stage, "adamw"] = train_zero(rank, world_size, CFG, ADAMW, stage)
    for stage in (1, 2, 3):
        out["zero", stage, "sgd"] = train_zero(rank, world_size, CFG, SGD, stage)
    out["prefetch"] = train_zero(rank, world_size, CFG, ADAMW, 3, prefetch=True)
    out["raf", True] = train_zero(rank, world_size, CFG, ADAMW, 3, reshard_after_forward=True)
    out["raf", False] = train_zero(rank, world_size, CFG, ADAMW, 3, reshard_after_forward=False)
    out["fsdp2"] = oracles.train_fsdp2(rank, world_size, CFG, ADAMW)
    for stage in (1, 2, 3):
        out["bf16", stage] = train_zero(rank, world_size, CFG, ADAMW, stage, param_dtype=torch.bfloat16)
    for stage in (2, 3):
        out["accumulate", stage] = _accumulate(rank, world_size, stage, m=2)
    out["broken", "owner_offset"] = _broken_owner_offset(rank, world_size, ADAMW)
    out["broken", "no_average"] = _broken_no_average(rank, world_size, SGD)
    for stage in (1, 2, 3):  # stop after STOP_AT steps with a checkpoint, resume in a fresh engine
        path = f"{ckpt}/dp2_stage{stage}"
        out["stopped", stage] = train_zero(rank, world_size, CFG, replace(ADAMW, steps=STOP_AT), stage,
                                                 save_to=path)
        out["resumed", stage] = train_zero(rank, world_size, CFG, ADAMW, stage, resume_from=path)
    return out


def _suite_dp4(rank, world_size, ckpt):
    out = {}
    for stage in (0, 1, 2, 3):
        out["zero", stage, "adamw"] = train_zero(rank, world_size, CFG, ADAMW, stage)
    out["zero", 3, "sgd"] = train_zero(rank, world_size, CFG, SGD, 3)
    out["prefetch"] = train_zero(rank, world_size, CFG, ADAMW, 3, prefetch=True)
    out["fsdp2"] = oracles.train_fsdp2(rank, world_size, CFG, ADAMW)
    # re-sharding: checkpoints written by 2 ranks, read by 4 (same stage, and stage 1 -> stage 3)
    out["from_dp2", 3] = train_zero(rank, world_size, CFG, ADAMW, 3, resume_from=f"{ckpt}/dp2_stage3")
    out["from_dp2", 1] = train_zero(rank, world_size, CFG, ADAMW, 3, resume_from=f"{ckpt}/dp2_stage1")
    out["stopped", 2] = train_zero(rank, world_size, CFG, replace(ADAMW, steps=STOP_AT), 2,
                                         save_to=f"{ckpt}/dp4_stage2")
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("zero_ckpt")


@pytest.fixture(scope="module")
def runs2(ckpt):
    return launch(_suite_dp2, 2, str(ckpt), timeout=LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def runs4(ckpt, runs2):  # runs2 first: its checkpoints are read here
    return launch(_suite_dp4, 4, str(ckpt), timeout=LAUNCH_TIMEOUT)


@pytest.fixture
def runs(request):
    return request.getfixturevalue(f"runs{request.param}")


# ----------------------------------------------------------------------------------------------------------------
# The flat layout (no ranks needed)


def test_flat_layout_offsets_padding_and_owners():
    shapes = [(3, 5), (7,), (2, 2, 2)]  # 15 + 7 + 8 = 30 elements
    layout = zero_unit.FlatLayout.build(["a", "b", "c"], shapes, world_size=4)
    assert layout.offsets == (0, 15, 22)
    assert (layout.numel, layout.padded_numel, layout.shard_numel) == (30, 32, 8)
    ranges = [layout.bounds(r) for r in range(4)]
    assert ranges == [(0, 8), (8, 16), (16, 24), (24, 32)]  # contiguous, disjoint, cover the padded buffer
    flat = torch.arange(32.0)
    views = layout.views(flat)
    assert [tuple(v.shape) for v in views] == shapes
    assert views[1].tolist() == list(range(15, 22)) and views[1].data_ptr() == flat[15:].data_ptr()
    assert checkpoint.layout_from_json(json.loads(json.dumps(checkpoint.layout_to_json(layout)))) == layout
    assert zero_unit.FlatLayout.build(["a"], [(8,)], 4).padded_numel == 8  # no padding when N divides


def test_comm_formula_is_2_psi_and_3_psi():
    n, sizes = 4, [8, 12, 20]  # padded unit sizes, root last
    v = 4 * sum(sizes)
    ring = v * (n - 1) // n
    assert accounting.comm_bytes_per_step(sizes, n, 0) == {"all_reduce": 2 * ring, "all_gather": 0, "reduce_scatter": 0}
    # stage 0 does not pad: 10 elements over 4 ranks make ring chunks 3, 3, 2, 2 -- per-rank counts differ
    assert [accounting.comm_bytes_per_step([10], n, 0, rank=r)["all_reduce"] for r in range(n)] == [
        4 * (7 + 7), 4 * (7 + 8), 4 * (8 + 8), 4 * (8 + 7)]
    for stage in (1, 2):
        assert sum(accounting.comm_bytes_per_step(sizes, n, stage).values()) == 2 * ring
    assert sum(accounting.comm_bytes_per_step(sizes, n, 3, reshard_after_forward=True).values()) == 3 * ring
    assert sum(accounting.comm_bytes_per_step(sizes, n, 3, reshard_after_forward=False).values()) == 2 * ring
    assert sum(accounting.comm_bytes_per_step(sizes, n, 3).values()) == 3 * ring - 4 * 20 * (n - 1) // n  # root kept
    with pytest.raises(ValueError, match="multiples"):
        accounting.comm_bytes_per_step([7], 4, 1)


# ----------------------------------------------------------------------------------------------------------------
# Parity


@pytest.mark.parity
@pytest.mark.parametrize("runs", [2, 4], indirect=True)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parity_with_the_single_process_baseline_adamw(runs, stage):
    assert_ok(baseline(ADAMW), runs[0]["zero", stage, "adamw"], f"stage {stage}")


@pytest.mark.parity
@pytest.mark.parametrize(("world_size", "stage"), [(2, 1), (2, 2), (2, 3), (4, 3)])
def test_parity_with_sgd_which_exposes_a_missing_average(runs2, runs4, world_size, stage):
    runs = runs2 if world_size == 2 else runs4
    assert_ok(baseline(SGD), runs[0]["zero", stage, "sgd"], f"stage {stage} SGD at DP {world_size}")


@pytest.mark.parity
@pytest.mark.parametrize("runs", [2, 4], indirect=True)
def test_zero3_matches_fsdp2_and_the_baseline(runs):
    ours, fsdp2 = runs[0]["zero", 3, "adamw"], runs[0]["fsdp2"]
    assert_ok(baseline(ADAMW), fsdp2, "FSDP2 fully_shard")
    assert_ok(fsdp2, ours, "ours vs FSDP2", noise=baseline(ADAMW).noise)


@pytest.mark.parity
@pytest.mark.parametrize("variant", ["prefetch", ("raf", True), ("raf", False)])
def test_prefetch_and_reshard_options_do_not_change_the_result(runs2, runs4, variant):
    assert_ok(baseline(ADAMW), runs2[0][variant], str(variant))
    if variant == "prefetch":
        assert_ok(baseline(ADAMW), runs4[0][variant], "prefetch at DP 4")


@pytest.mark.parity
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_over_micro_batches(runs2, stage):
    assert_ok(baseline(SGD), runs2[0]["accumulate", stage], f"stage {stage}, 2 micro-batches")


def test_every_replica_is_bitwise_identical(runs4):
    """Stages 0-2 report each rank's own full replica: the all-gather after the step must refresh all of them."""
    for stage in (0, 1, 2):
        ref = runs4[0]["zero", stage, "adamw"].params
        for rank in range(1, 4):
            other = runs4[rank]["zero", stage, "adamw"].params
            assert all(torch.equal(other[n], ref[n]) for n in ref), (stage, rank)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_bf16_compute_with_fp32_master_shards(runs2, stage):
    run, fp32, ref = runs2[0]["bf16", stage], runs2[0]["zero", stage, "adamw"], baseline(ADAMW)
    rel = max(abs(a - b) / b for a, b in zip(run.losses, ref.losses, strict=True))
    assert 0 < rel < 1e-2  # bf16 rounding shows, but it is the same training
    assert all(p.dtype == torch.float32 for p in run.params.values())  # gathered from the fp32 masters
    for op in ("all_gather", "reduce_scatter"):  # bf16 on the wire: half the bytes
        assert [r.tensor_bytes for r in run.comm[1].select(op)] == [b.tensor_bytes // 2
                                                                   for b in fp32.comm[1].select(op)]
    # model states, exactly: bf16 weights and gradients (stage 3: none resident but the masters), fp32 master
    # shards + Adam m, v (K = 12 per owned element), and an fp32 gradient shard for the fp32 optimizer
    # (ZeRO's formula omits it; DeepSpeed keeps one too)
    _, padded = _units(run)
    psi_pad, owned, units = sum(padded), sum(padded) // 2, len(padded)
    expected = {1: {"parameters": 2 * psi_pad, "gradients": 2 * psi_pad + 4 * owned},
                2: {"parameters": 2 * psi_pad, "gradients": 4 * owned},
                3: {"parameters": 0, "gradients": 4 * owned}}[stage]
    expected["optimizer_state"] = 12 * owned + 4 * units
    assert run.memory == expected


# ----------------------------------------------------------------------------------------------------------------
# Broken variants must fail parity


@pytest.mark.parity
def test_a_wrong_shard_owner_offset_fails_parity(runs2):
    report = compare(baseline(ADAMW), runs2[0]["broken", "owner_offset"])
    assert not report.ok and report.max_loss_diff > 1e-3, report


@pytest.mark.parity
def test_forgetting_to_average_fails_parity_with_sgd(runs2):
    report = compare(baseline(SGD), runs2[0]["broken", "no_average"])
    assert not report.ok and report.worst_ratio > 100, report


# ----------------------------------------------------------------------------------------------------------------
# Communication: calls per unit per step, exact bytes


def _units(run):
    return [u["name"] for u in run.units], [u["padded_numel"] for u in run.units]


EXPECTED_CALLS = {  # (collective, calls per block unit, calls for the root unit) per step
    ("zero", 0, "adamw"): {"all_reduce": (1, 1)},
    ("zero", 1, "adamw"): {"reduce_scatter": (1, 1), "all_gather": (1, 1)},
    ("zero", 2, "adamw"): {"reduce_scatter": (1, 1), "all_gather": (1, 1)},
    ("zero", 3, "adamw"): {"reduce_scatter": (1, 1), "all_gather": (2, 1)},  # the root stays gathered
    "prefetch": {"reduce_scatter": (1, 1), "all_gather": (2, 1)},
    ("raf", True): {"reduce_scatter": (1, 1), "all_gather": (2, 2)},
    ("raf", False): {"reduce_scatter": (1, 1), "all_gather": (1, 1)},
}


@pytest.mark.parametrize("key", list(EXPECTED_CALLS), ids=str)
def test_collectives_per_unit_per_step_and_exact_bytes(runs2, key):
    n = 2
    for rank, rank_runs in enumerate(runs2):
        run = rank_runs[key]
        names, padded = _units(run)
        assert names == ["blocks.0", "blocks.1", "blocks.2", ""] and len(run.comm) == ADAMW.steps
        stage = key[1] if key[0] == "zero" else 3
        raf = key[1] if key[0] == "raf" else None
        expected_bytes = accounting.comm_bytes_per_step(padded, n, stage, raf, rank=rank)
        for step, (log, events) in enumerate(zip(run.comm, run.events, strict=True)):
            for op in ("all_reduce", "all_gather", "reduce_scatter"):
                per_block, per_root = EXPECTED_CALLS[key].get(op, (0, 0))
                counts = [sum(1 for e in events if e == (op, name)) for name in names]
                assert counts == [per_block] * 3 + [per_root], (rank, step, op, counts)
                assert log.count(op) == sum(counts)  # the log saw exactly the unit collectives, nothing else
                # each call moved its unit's padded buffer; ring bytes (N-1)/N x V, exactly
                sizes = {4 * p: name for name, p in zip(names, padded, strict=True)}
                assert all(r.tensor_bytes in sizes for r in log.select(op))
                assert log.sent_bytes(op) == expected_bytes[op], (rank, step, op)
            assert log.count() == sum(log.count(op) for op in ("all_reduce", "all_gather", "reduce_scatter"))


def test_bytes_per_step_are_2_psi_and_3_psi_with_padding_stated(runs2, runs4):
    for n, runs in ((2, runs2), (4, runs4)):
        run = runs[0]["zero", 1, "adamw"]
        _, padded = _units(run)
        psi_pad = sum(padded)
        assert 0 <= psi_pad - PSI <= len(padded) * (n - 1)  # at most N-1 padding elements per unit
        assert psi_pad - PSI == {2: 1, 4: 3 + 3 * 2}[n]  # root 17457 elements, blocks 8778 each
        ring = 4 * psi_pad * (n - 1) // n  # bytes a rank sends to all-gather (or reduce-scatter) Ψ_pad fp32
        for stage in (1, 2):
            assert runs[0]["zero", stage, "adamw"].comm[-1].sent_bytes() == 2 * ring
        # stage 0 (plain DP) does not pad: its all-reduce chunks differ by at most one element per unit
        dp_bytes = runs[0]["zero", 0, "adamw"].comm[-1].sent_bytes()
        assert abs(dp_bytes - 2 * 4 * PSI * (n - 1) / n) <= 2 * 4 * len(padded)
        root = 4 * padded[-1] * (n - 1) // n
        assert runs[0]["zero", 3, "adamw"].comm[-1].sent_bytes() == 3 * ring - root
    assert runs2[0]["raf", True].comm[-1].sent_bytes() == 3 * 4 * (PSI + 1) // 2  # the paper's 3Ψ, N=2


def test_stage3_schedule_with_and_without_prefetch(runs2):
    """Step 2's collectives in issue order. Without prefetch a unit is gathered when it is needed; with it, one
    unit ahead: in backward the next block's all-gather is issued before this block's reduce-scatter."""
    root, b0, b1, b2 = "", "blocks.0", "blocks.1", "blocks.2"
    ag, rs = "all_gather", "reduce_scatter"
    forward = [(ag, root), (ag, b0), (ag, b1), (ag, b2)]
    plain = runs2[0]["zero", 3, "adamw"]
    assert plain.events[1] == [*forward, (ag, b2), (rs, b2), (ag, b1), (rs, b1), (ag, b0), (rs, b0), (rs, root)]
    prefetch = runs2[0]["prefetch"]
    assert prefetch.events[1] == [*forward, (ag, b2), (ag, b1), (rs, b2), (ag, b0), (rs, b1), (rs, b0), (rs, root)]
    names, padded = _units(plain)
    size = dict(zip(names, padded, strict=True))
    gathered = [u for op, u in plain.events[1] if op == ag]
    assert [r.tensor_bytes for r in plain.comm[1].select(ag)] == [4 * size[u] for u in gathered]


# ----------------------------------------------------------------------------------------------------------------
# Memory: measured model states vs ZeRO's formula


@pytest.mark.parametrize("runs", [2, 4], indirect=True)
def test_measured_model_states_follow_the_zero_formula(runs):
    n = len(runs)
    totals = []
    for stage in (0, 1, 2, 3):
        run = runs[0]["zero", stage, "adamw"]
        _, padded = _units(run)  # stage 0 does not pad
        m = run.memory
        # the formula with fp32 weights and grads, K = 8 (Adam m and v)
        formula = {"parameters": 4 * PSI / (n if stage >= 3 else 1),
                   "gradients": 4 * PSI / (n if stage >= 2 else 1),
                   "optimizer_state": 8 * PSI / (n if stage >= 1 else 1)}
        for cat, predicted in formula.items():
            assert abs(m[cat] - predicted) <= 0.02 * predicted, (stage, cat, m[cat], predicted)
        total = sum(m.values())
        predicted_total = zero_memory_per_device(PSI, K=8, N_d=n, stage=stage, param_bytes=4, grad_bytes=4)
        assert abs(total - predicted_total) <= 0.02 * predicted_total, (stage, total, predicted_total)
        # and exactly: padded flat buffers + one 4-byte AdamW step counter per flat shard
        owned = sum(padded) // (n if stage >= 1 else 1)
        assert m["optimizer_state"] == 8 * owned + 4 * len(padded)
        assert m["parameters"] == 4 * sum(padded) // (n if stage >= 3 else 1)
        assert m["gradients"] == 4 * sum(padded) // (n if stage >= 2 else 1)
        totals.append(total)
    assert totals[0] > totals[1] > totals[2] > totals[3]


def test_stage3_peak_parameters_show_what_prefetch_and_resharding_cost(runs2):
    run = runs2[0]["zero", 3, "adamw"]
    _, padded = _units(run)
    shards = 4 * sum(padded) // 2
    root, block = 4 * padded[-1], 4 * max(padded[:-1])
    assert run.peak["parameters"] == shards + root + block  # the root stays gathered, one block at a time
    assert runs2[0]["prefetch"].peak["parameters"] == shards + root + 2 * block  # the next block in flight
    assert runs2[0]["raf", True].peak["parameters"] == shards + root + block
    assert runs2[0]["raf", False].peak["parameters"] == shards + 4 * sum(padded)  # the whole model
    # gradients: the root's full gradient buffer lives through the whole backward (lm_head's gradient comes
    # first, the embeddings' last); each block's lives from its pre-backward to its reduce-scatter
    s_block, s_root = 4 * padded[0] // 2, 4 * padded[-1] // 2
    assert run.peak["gradients"] == root + 3 * s_block + max(block, s_root)


# ----------------------------------------------------------------------------------------------------------------
# Sharded checkpoints


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stop_and_resume_is_bitwise_identical(runs2, stage):
    full, stopped, resumed = (runs2[0][k, stage] if k != "zero" else runs2[0]["zero", stage, "adamw"]
                              for k in ("zero", "stopped", "resumed"))
    assert resumed.start_step == STOP_AT and len(resumed.losses) == ADAMW.steps - STOP_AT
    assert stopped.losses + resumed.losses == full.losses
    for name, value in full.params.items():
        assert torch.equal(resumed.params[name], value), name


def test_checkpoint_files_hold_one_shard_per_rank_and_the_layout(ckpt, runs2):
    path = ckpt / "dp2_stage3"
    meta = json.loads((path / "metadata.json").read_text())
    assert (meta["world_size"], meta["num_shards"], meta["stage"], meta["step"]) == (2, 2, 3, STOP_AT)
    assert [u["name"] for u in meta["units"]] == ["blocks.0", "blocks.1", "blocks.2", ""]
    root = meta["units"][-1]
    assert [p["name"] for p in root["params"]] == ["tok_emb.weight", "pos_emb.weight", "norm_f.weight",
                                                   "norm_f.bias", "lm_head.weight"]
    assert root["params"][1] == {"name": "pos_emb.weight", "shape": [15, 33], "offset": 256 * 33}
    assert (root["numel"], root["padded_numel"]) == (17457, 17458)
    files = sorted(p.name for p in path.glob("shard_*.pt"))
    assert files == ["shard_00000_of_00002.pt", "shard_00001_of_00002.pt"]
    for f in files:
        units = torch.load(path / f, weights_only=True)["units"]
        assert sum(u["param"].numel() for u in units.values()) == (PSI + 1) // 2  # half the model each
        assert set(units[""]["state"]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parity
@pytest.mark.parametrize("source", [1, 3])
def test_a_dp2_checkpoint_resumes_on_4_ranks(runs4, source):
    run = runs4[0]["from_dp2", source]  # saved by 2 ranks at stage `source`, resumed by 4 at stage 3
    ref = baseline(ADAMW)
    assert run.start_step == STOP_AT
    assert_ok(ref.from_step(STOP_AT), run, f"DP2 stage {source} -> DP4 stage 3")


def _continue_in_one_process(path):
    """Load a sharded checkpoint into a plain GPT and its plain AdamW, finish the run in this process."""
    model = GPT(CFG, seed=ADAMW.seed)
    opt = make_optimizer(list(model.parameters()), ADAMW)
    start = checkpoint.load_sharded_into_model(model, opt, path)
    losses = []
    for step in range(start, ADAMW.steps):
        x, y = global_batch(step, ADAMW.global_batch, CFG.seq_len, ADAMW.seed)
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return start, TrainResult(losses, copy_parameters(model))


@pytest.mark.parity
@pytest.mark.parametrize(("name", "world_size"), [("dp2_stage3", 2), ("dp4_stage2", 4)])
def test_a_sharded_checkpoint_becomes_a_single_process_one(ckpt, runs2, runs4, name, world_size):
    runs = runs2 if world_size == 2 else runs4
    stopped = runs[0]["stopped", int(name[-1])]
    params, states, step = checkpoint.load_sharded_state_dict(ckpt / name)
    assert step == STOP_AT
    assert params.keys() == stopped.params.keys()
    assert all(torch.equal(params[k], stopped.params[k]) for k in params)  # the saved weights, bit for bit
    assert set(states["lm_head.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert states["lm_head.weight"]["exp_avg"].shape == (256, 33)
    start, cont = _continue_in_one_process(ckpt / name)
    ref = baseline(ADAMW)
    assert start == STOP_AT
    assert_ok(ref.from_step(STOP_AT), cont, f"{name} -> one process")


# ----------------------------------------------------------------------------------------------------------------
# Errors that explain themselves (one rank, in this process)


def _errors(rank, world_size, ckpt):
    out = {}
    model, other = GPT(CFG), GPT(CFG)
    for key, call in {
        "stage": lambda: zero.ZeroDataParallel(model, stage=4),
        "root": lambda: zero.ZeroDataParallel(model, units=list(model.blocks)),
        "foreign": lambda: zero.ZeroDataParallel(model, units=[other.blocks[0], model]),
    }.items():
        try:
            call()
            out[key] = "no error"
        except ValueError as e:
            out[key] = str(e)
    zdp = zero.ZeroDataParallel(GPT(CFG), stage=1)
    x, y = global_batch(0, 2, CFG.seq_len)
    lm_loss(zdp(x), y).backward()
    try:
        lm_loss(zdp(x), y).backward()  # no after_step() in between
        out["accumulate"] = "no error"
    except RuntimeError as e:
        out["accumulate"] = str(e)
    other = zero.ZeroDataParallel(GPT(CFG.with_(n_layer=2)), stage=3)
    try:
        checkpoint.load_sharded(other, make_optimizer(other.parameters(), ADAMW), f"{ckpt}/dp2_stage3")
        out["mismatch"] = "no error"
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def test_errors_are_explained(ckpt, runs2):
    (out,) = launch(_errors, 1, str(ckpt))
    assert "ZeRO stage 4: the stages are 0" in out["stage"]
    assert "bottom-up" in out["root"]
    assert "not a submodule" in out["foreign"]
    assert "do not match" in out["mismatch"]
    assert "one backward per optimizer step" in out["accumulate"]


@pytest.mark.parity
def test_stage_invariants_hold_on_one_rank_too():
    def one(rank, world_size):
        return train_zero(rank, world_size, CFG, ADAMW, 3)

    (run,) = launch(one, 1)
    assert_ok(baseline(ADAMW), run, "stage 3 on a single rank")
    assert run.comm[0].sent_bytes() == 0 and run.comm[0].count("all_gather") == 7  # N = 1: calls, no bytes
