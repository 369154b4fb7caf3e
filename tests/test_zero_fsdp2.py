"""FSDP2-style per-parameter sharding (``course_lib.parallel.fsdp2``) and the optimizer-level ZeRO-1
(``ShardedOptimizer``).

FSDP2's contract, checked against PyTorch's ``fully_shard`` (gloo, a 1-D ``DeviceMesh``) at 2 and 4 ranks, in
fp32, bf16 and fp16 compute (``param_dtype``; gradients reduced in it, ``MixedPrecisionPolicy``'s default): after
wrapping, the module's own ``named_parameters()`` are the shards (names, shapes, fp32, ``Shard(0)`` recorded on
``dp``) and the optimizer is built on ``model.parameters()``; after each backward every one carries a gradient
of its shard's shape in fp32; gradients and parameters over two AdamW steps are *bitwise* those of
``fully_shard`` (both run the same kernels on the same rows, both reduce with gloo's ring sum, and dividing by
N = 2 or 4 -- in fp16 by 2 before the sum and N/2 after -- is exact; green under ``ATEN_CPU_CAPABILITY=default``
too). Two plausible bugs make that comparison fail: a missing 1/N in the gradient
mean, a wrong shard offset (rank r's rows from r floor(d0 / N) instead of r ceil(d0 / N)). Parity with
``train_baseline`` (``compare``'s default tolerance) with SGD, AdamW, gradient accumulation, prefetch and each
``reshard_after_forward`` (None, True, False); ``False`` keeps the gathered weights from forward to backward (4 Ψ
bytes more parameters between them, no all-gather in backward: counted in the comm log). FSDP + TP on dp 2 x tp 2
(TP's local tensors sharded again; the ``Partial`` K/V gradients of GQA summed over tp) matches one process, and
fails without that sum. Besides: the optimizer
state partitioned by ``ShardedOptimizer``, and the memory measured by ``MemoryTracker`` against the estimator
(the ZeRO-3 formula) with a variant that keeps the full gradients.

The model has odd sizes (as in tests/test_zero.py: d_model 33, d_ff 65, seq_len 15) so that dim 0 of most
parameters does not divide by 2 or 4: the padding rows (at 4 ranks also a shorter last chunk) are exercised.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from course_lib import comm
from course_lib.data import global_batch, shard
from course_lib.estimates.layout import ParallelLayout
from course_lib.estimates.memory import training_memory
from course_lib.estimates.model_states import zero_memory_per_device
from course_lib.measure.memtrack import MemoryTracker
from course_lib.model import GPT, lm_loss, num_params
from course_lib.model_config import GPTConfig
from course_lib.parallel import oracles
from course_lib.parallel.dp import DataParallel
from course_lib.parallel.dp_reduce import partial_axes
from course_lib.parallel.fsdp2 import FSDP2DataParallel, PerParameterUnit, dim0_chunk
from course_lib.parallel.loop import train_loop
from course_lib.parallel.oracles import TorchFullyShard
from course_lib.parallel.placement import Shard, placement
from course_lib.parallel.runs import train_zero
from course_lib.parallel.sharded_optimizer import ShardedOptimizer, partition
from course_lib.parallel.sharding import model_state_bytes
from course_lib.parallel.tp import apply_tp
from course_lib.parallel.tp_comm import all_gather_along
from course_lib.parallel.tp_layers import vocab_parallel_cross_entropy
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import Mesh
from course_lib.train import TrainConfig, TrainResult, compare, copy_parameters, make_optimizer, train_baseline

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(bias=False, d_model=33, n_head=3, d_ff=65, n_layer=3, seq_len=15)
SGD = TrainConfig(optimizer="sgd", lr=1e-2)
ADAMW = TrainConfig(optimizer="adamw", lr=1e-3)
PSI = num_params(GPT(CFG))
MODEL_STATES = ("parameters", "gradients", "optimizer_state")
CFG_2D = GPTConfig(bias=False, d_model=36, n_head=4, n_kv_head=1, n_layer=2, seq_len=15)  # K/V: 9 rows, replicated
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # fp16: split 1/N (pre, post)


class KeepFullGradUnit(PerParameterUnit):
    """Never drops the full gradients after the reduce-scatter: Ψ x 4 bytes more gradients than FSDP holds."""

    def free_grads(self) -> None:
        pass


class NoMeanUnit(PerParameterUnit):
    """Mutation: sums the gradients over the ranks and forgets the 1/N of the mean."""

    def divide_factors(self, dtype: torch.dtype) -> tuple[int, int]:
        return 1, 1


class FloorOffsetUnit(PerParameterUnit):
    """Mutation: rank r's rows start at r floor(d0 / N) instead of r ceil(d0 / N) (its chunk overlaps the
    previous rank's when N does not divide d0, and the last rows belong to nobody)."""

    def chunk_rows(self, i: int) -> tuple[int, int]:
        d0 = self.shapes[i][0]
        lo = self.shard_rank * (d0 // self.world_size)
        return lo, min(lo + self.rows[i], d0)


class ForgetsPartial(FSDP2DataParallel):
    """Mutation: never sums the gradients recorded ``Partial`` over their axis."""

    def finish_gradient_sync(self) -> None:
        pass


def _variant(unit: type[PerParameterUnit]) -> functools.partial[FSDP2DataParallel]:
    """FSDP2 built on the mutated ``unit`` (the one object the form takes for it)."""
    return functools.partial(FSDP2DataParallel, unit=unit)


KeepFullGrad = _variant(KeepFullGradUnit)
WRAPPERS = {"ours": FSDP2DataParallel, "fully_shard": TorchFullyShard, "no_mean": _variant(NoMeanUnit),
            "floor_offset": _variant(FloorOffsetUnit)}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A ``fully_shard`` DTensor's local shard (its unpadded chunk); our shards are plain tensors already."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _module_shards(rank, world_size, kind, dtype, steps=2):
    """Wrap, build AdamW on ``model.parameters()``, train ``steps`` steps; after every backward record the
    module's own named parameters' gradients (local shards), after every step the parameters."""
    model = GPT(CFG, seed=ADAMW.seed)
    w = WRAPPERS[kind](model, param_dtype=dtype)
    opt = make_optimizer(list(model.parameters()), ADAMW)
    record = []
    for step in range(steps):
        x, y = global_batch(step, ADAMW.global_batch, CFG.seq_len, ADAMW.seed)
        lm_loss(w(shard(x, rank, world_size)).float(), shard(y, rank, world_size)).backward()
        grads = {n: None if p.grad is None else _local(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        record.append((grads, {n: _local(p) for n, p in model.named_parameters()}))
    out = {"record": record}
    if kind != "fully_shard":
        out["optimizer_on_module"] = {id(p) for p in model.parameters()} == {id(p) for p in w.parameters()}
        out["placements"] = {n: placement(p, "dp") for n, p in model.named_parameters()}
    return out


def _reshard_probe(rank, world_size, reshard_after_forward):
    """One forward and backward: the parameter bytes alive between them and the all-gathers in each."""
    model = GPT(CFG, seed=0)
    w = FSDP2DataParallel(model, reshard_after_forward=reshard_after_forward)
    x, y = global_batch(0, 8, CFG.seq_len, 0)
    with comm.recording() as fwd:
        loss = lm_loss(w(shard(x, rank, world_size)), shard(y, rank, world_size))
    between = model_state_bytes(w.units, w.param_dtype)["parameters"]
    with comm.recording() as bwd:
        loss.backward()
    shards = {id(s) for s in w.parameters()}
    return {"between": between, "shards": 4 * sum(pad.numel() for u in w.units for pad in u.padded),
            "units": len(w.units), "forward_gathers": fwd.count("all_gather"),
            "backward_gathers": bwd.count("all_gather"),
            "module_is_sharded": {id(p) for p in model.parameters()} == shards}


def _fsdp_tp(rank, world_size, wrapper_class):
    """FSDP + TP on dp 2 x tp 2: ``apply_tp`` (its K/V replicated under GQA, gradients ``Partial`` on tp),
    then FSDP over dp on the TP-local tensors; SGD; the whole parameters gathered over both axes. Also the
    number of FSDP shards recorded ``Partial`` per axis (what the wrapper must sum there)."""
    mesh = Mesh(dp=2, tp=2)
    model = GPT(CFG_2D, seed=SGD.seed)
    apply_tp(model, mesh.group("tp"))
    dims = {n: getattr(placement(p, "tp"), "dim", None) for n, p in model.named_parameters()}
    w = wrapper_class(model, mesh=mesh)
    opt = make_optimizer(list(model.parameters()), SGD)
    loss = functools.partial(vocab_parallel_cross_entropy, group=mesh.group("tp"))
    out = train_loop(w, opt, CFG_2D, SGD, data_rank=mesh.coord("dp"), data_size=mesh.size("dp"), loss_fn=loss)
    full = {n: t if dims[n] is None else all_gather_along(t, dims[n], mesh.group("tp"))
            for n, t in w.full_parameters().items()}
    partial: dict[str, int] = {}
    for s in w.parameters():
        for axis in partial_axes(s):
            partial[axis] = partial.get(axis, 0) + 1
    return TrainResult(out.losses, full), sorted(partial.values())


def _sharded_optimizer(rank, world_size, tc):
    model = GPT(CFG, seed=tc.seed)
    opt_cls, kw = (torch.optim.SGD, {"momentum": tc.momentum}) if tc.optimizer == "sgd" else (torch.optim.AdamW, {})
    opt = ShardedOptimizer(model.parameters(), opt_cls, lr=tc.lr, weight_decay=tc.weight_decay, foreach=False, **kw)
    out = train_loop(DataParallel(model), opt, CFG, tc, data_rank=rank, data_size=world_size)
    local = sum(p.numel() for g in opt.optimizer.param_groups for p in g["params"])
    return TrainResult(out.losses, copy_parameters(model)), local


def _tracked_step(rank, world_size, wrapper_class):
    """One AdamW step under ``MemoryTracker`` watching the module (its shards) and the gathered full weights:
    the breakdown at the optimizer step's peak, each category's own peak, the units' sizes (full, padded
    shards, shards)."""
    model = GPT(CFG, seed=ADAMW.seed)
    w = wrapper_class(model)
    opt = make_optimizer(list(model.parameters()), ADAMW)
    x, y = global_batch(0, ADAMW.global_batch, CFG.seq_len, ADAMW.seed)
    full = nn.ParameterList([p for u in w.units for p in u.params])  # 0 bytes now; gathered in the step
    with MemoryTracker([model, full], opt) as mt:
        loss = lm_loss(w(shard(x, rank, world_size)), shard(y, rank, world_size))
        loss.backward()
        del loss
        opt.step()
    units = [(sum(p.numel() for p in u.params), sum(pad.numel() for pad in u.padded),
              sum(s.numel() for s in u.shards)) for u in w.units]
    return dict(mt.phase_peaks["optimizer"]), dict(mt.category_peaks), units


def _suite(rank, world_size):
    out = {}
    fsdp2 = functools.partial(train_zero, rank, world_size, CFG, sharding=FSDP2DataParallel)
    for name, tc in (("sgd", SGD), ("adamw", ADAMW)):
        out["fsdp2", name] = fsdp2(tc, 3)
        out["sharded_optimizer", name] = _sharded_optimizer(rank, world_size, tc)
    out["fsdp2", "accumulate"] = fsdp2(SGD, 3, accumulation=2)
    out["fsdp2", "prefetch"] = fsdp2(ADAMW, 3, prefetch=True)
    for raf in (True, False):
        out["fsdp2", f"reshard={raf}"] = fsdp2(ADAMW, 3, reshard_after_forward=raf)
        out["probe", raf] = _reshard_probe(rank, world_size, raf)
    out["fully_shard"] = oracles.train_fsdp2(rank, world_size, CFG, ADAMW)
    for dtype in DTYPES:
        for kind in ("ours", "fully_shard"):
            out["shards", kind, dtype] = _module_shards(rank, world_size, kind, DTYPES[dtype])
    for kind in ("no_mean", "floor_offset"):
        out["shards", kind, "fp32"] = _module_shards(rank, world_size, kind, torch.float32, steps=1)
    if world_size == 4:
        out["2d"] = _fsdp_tp(rank, world_size, FSDP2DataParallel)
        out["2d", "forgets_partial"] = _fsdp_tp(rank, world_size, ForgetsPartial)
    out["memory"] = _tracked_step(rank, world_size, FSDP2DataParallel)
    out["memory", "keeps_full_grad"] = _tracked_step(rank, world_size, KeepFullGrad)
    return out


@functools.cache
def suite(world_size):
    return launch(_suite, world_size, timeout=300)


@functools.cache
def baseline(tc):
    return train_baseline(CFG, tc)


def mismatches(ours: dict, reference: dict) -> list[str]:
    """Where our module's named parameters and gradient shards differ from ``fully_shard``'s after each step
    (names, shapes, dtypes, values bit for bit); over the steps both recorded."""
    out = []
    for step, ((g, p), (g_ref, p_ref)) in enumerate(zip(ours["record"], reference["record"], strict=False)):
        for what, got, ref in (("grad", g, g_ref), ("param", p, p_ref)):
            if list(got) != list(ref):
                out.append(f"step {step}: {what} names {list(got)}, fully_shard {list(ref)}")
                continue
            for name, t in got.items():
                r = ref[name]
                if t is None or t.shape != r.shape or t.dtype != r.dtype:
                    out.append(f"step {step}: {what} {name}: {None if t is None else (tuple(t.shape), t.dtype)}, "
                               f"fully_shard {(tuple(r.shape), r.dtype)}")
                elif not torch.equal(t, r):
                    out.append(f"step {step}: {what} {name}: max |diff| {(t - r).abs().max().item():.2e}")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_module_parameters_and_gradient_shards_are_fully_shards(world_size, dtype):
    for rank, runs in enumerate(suite(world_size)):
        ours, ref = runs["shards", "ours", dtype], runs["shards", "fully_shard", dtype]
        assert len(ours["record"]) == len(ref["record"]) == 2
        assert mismatches(ours, ref) == [], f"rank {rank}, {dtype}"
        assert ours["optimizer_on_module"], "the module's parameters are not the wrapper's shards"
        names = [name for name, _ in GPT(CFG).named_parameters()]
        assert list(ours["placements"]) == names
        for name, p in GPT(CFG).named_parameters():
            lo, hi = dim0_chunk(p.shape[0], world_size, rank)
            for grads, _ in ours["record"]:
                assert grads[name].shape == (hi - lo, *p.shape[1:]), (rank, name)
                assert grads[name].dtype == torch.float32, (rank, name)
            assert ours["placements"][name] == Shard(0, p.shape[0]), (rank, name)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mutation", ["no_mean", "floor_offset"])
def test_a_missing_mean_or_a_wrong_shard_offset_differs_from_fully_shard(world_size, mutation):
    wrong = [mismatches(runs["shards", mutation, "fp32"], runs["shards", "fully_shard", "fp32"])
             for runs in suite(world_size)]
    assert any(wrong), f"{mutation} went unnoticed"


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("run", "tc"), [(("fsdp2", "sgd"), SGD), (("fsdp2", "adamw"), ADAMW),
                                         (("fsdp2", "accumulate"), SGD), (("fsdp2", "prefetch"), ADAMW),
                                         (("fsdp2", "reshard=True"), ADAMW), (("fsdp2", "reshard=False"), ADAMW)])
def test_per_parameter_sharding_matches_the_baseline_and_fully_shard(world_size, run, tc):
    for rank, runs in enumerate(suite(world_size)):
        report = compare(baseline(tc), runs[run])
        assert report.ok, f"{run}, rank {rank}: {report}"
        if tc is ADAMW:
            assert compare(runs["fully_shard"], runs[run], noise=baseline(tc).noise).ok, \
                f"{run} vs fully_shard, rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_reshard_after_forward_false_keeps_the_gathered_weights_until_backward(world_size):
    """True: the module holds only its shards between forward and backward, and backward gathers every unit
    again; False: every full weight (4 Ψ bytes) stays alive and backward gathers none. Both end sharded. Over
    a training run: 2 all-gathers per unit and step, or 1."""
    for rank, runs in enumerate(suite(world_size)):
        free, keep = runs["probe", True], runs["probe", False]
        units = free["units"]
        assert free["forward_gathers"] == keep["forward_gathers"] == units, rank
        assert (free["backward_gathers"], keep["backward_gathers"]) == (units, 0), rank
        assert (free["between"], keep["between"]) == (free["shards"], free["shards"] + 4 * PSI), rank
        assert free["module_is_sharded"] and keep["module_is_sharded"], rank
        gathers = {raf: [sum(op == "all_gather" for op, _ in step) for step in runs["fsdp2", f"reshard={raf}"].events]
                   for raf in (True, False)}
        assert gathers == {True: [2 * units] * ADAMW.steps, False: [units] * ADAMW.steps}, rank


@pytest.mark.slow
def test_fsdp_on_a_tensor_parallel_model_matches_the_baseline_and_needs_its_partial_sums():
    """dp 2 x tp 2: FSDP shards TP's local tensors again on dim 0 and sums the K/V gradients (replicated over
    tp under GQA, recorded ``Partial``) over tp: parity with one process; without that sum it fails."""
    base = train_baseline(CFG_2D, SGD)
    for rank, runs in enumerate(suite(4)):
        result, partial = runs["2d"]
        assert partial == [2 * CFG_2D.n_layer], f"rank {rank}: partial shards {partial} (k and v of each block)"
        report = compare(base, result)
        assert report.ok, f"rank {rank}: {report}"
    assert not any(compare(base, runs["2d", "forgets_partial"][0]).ok for runs in suite(4))


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
                          layout=ParallelLayout(dp=n, zero_stage=3), activation_formula="adapted")
    predicted = {**{cat: est[cat] for cat in MODEL_STATES},
                 "total": zero_memory_per_device(PSI, K=8, N_d=n, stage=3, param_bytes=4, grad_bytes=4)}
    measured = {**{cat: states[cat] for cat in MODEL_STATES}, "total": sum(states[cat] for cat in MODEL_STATES)}
    return [f"{k}: measured {measured[k]} B, estimated {v:.0f} B" for k, v in predicted.items()
            if abs(measured[k] - v) > 0.02 * v]


@pytest.mark.slow
def test_measured_memory_by_category_matches_the_zero3_estimate():
    """At 2 ranks: model states (sharded: Ψ/N each) within 2% of the estimate, and exactly the shards' bytes
    (parameters and gradients: the padded buffers; Adam's m and v: the shards' own shapes); activations within
    1% of the adapted formula (tests/test_memory.py's tolerance: the gathered weights saved for backward count
    as parameters, not activations); the parameters' own peak is the shards plus the gathered root (kept from
    forward to backward) and one block, as for the flat form in tests/test_zero.py. (At 4 ranks the padding
    rows -- up to N-1 per parameter, not per unit -- put the parameters 4.9% above Ψ/N: the cost the module
    docstring of ``fsdp2`` states.)"""
    n = 2
    est = training_memory(CFG, precision="fp32", optimizer="adamw", micro_batch=ADAMW.global_batch // n,
                          layout=ParallelLayout(dp=n, zero_stage=3), activation_formula="adapted")
    for rank, runs in enumerate(suite(n)):
        states, peaks, units = runs["memory"]
        assert estimator_errors(states, n) == [], f"rank {rank}"
        padded = 4 * sum(pad for _, pad, _ in units)
        assert states["parameters"] == states["gradients"] == padded
        own = 4 * sum(s for _, _, s in units)
        assert states["optimizer_state"] == 2 * own + 4 * len(list(GPT(CFG).parameters()))  # + step counters
        assert peaks["activations"] == pytest.approx(est["activations"], rel=0.01)
        root, block = 4 * units[-1][0], 4 * max(full for full, _, _ in units[:-1])
        assert peaks["parameters"] == padded + root + block


@pytest.mark.slow
def test_a_variant_that_keeps_the_full_gradients_fails_the_estimate():
    states, _, _ = suite(2)[0]["memory", "keeps_full_grad"]
    errors = estimator_errors(states, 2)
    assert any(e.startswith("gradients") for e in errors) and any(e.startswith("total") for e in errors), errors
    assert states["gradients"] >= 4 * PSI  # the full gradients, on top of the shards


def test_partition_is_greedy_and_balanced():
    assert partition([10, 1, 7, 3], 2) == [0, 0, 1, 1]  # 10 -> 0, 7 -> 1, 3 -> 1 (7 < 10), 1 -> 0 (tie 10 = 10)
    assert partition([5, 5, 5, 5], 4) == [0, 1, 2, 3]


def test_per_parameter_sharding_refuses_other_stages_and_dtypes():
    with pytest.raises(ValueError, match="stage 3"):
        FSDP2DataParallel(GPT(CFG), 2)
    with pytest.raises(ValueError, match="reduce_dtype"):
        FSDP2DataParallel(GPT(CFG), reduce_dtype=torch.int8)


def test_dim0_chunks_are_torch_chunks_padded_with_empty_ones():
    for size in (1, 3, 5, 15, 33, 64):
        for n in (2, 3, 4):
            rows = torch.arange(size)
            expected = [c.tolist() for c in torch.chunk(rows, n)]
            expected += [[]] * (n - len(expected))
            assert [rows[slice(*dim0_chunk(size, n, r))].tolist() for r in range(n)] == expected, (size, n)
