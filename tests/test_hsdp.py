"""HSDP (hybrid sharded data parallelism): FSDP2's shards over ``dp_shard``, replicated over ``dp_replicate``.

At 4 ranks, dp = dp_replicate 2 x dp_shard 2 (torchtitan's layout, ``course_lib.runtime.mesh``: the shard index is the
faster one, so the shard groups are {0, 1}, {2, 3} and the replicate groups {0, 2}, {1, 3}, which is also what
``init_device_mesh((2, 2), ("dp_replicate", "dp_shard"))`` builds):

* the composed run (``ParallelConfig(MeshShape(dp=4, dp_replicate=2), zero_stage=3)``, AdamW, 3 steps) matches
  ``train_baseline`` within ``compare``'s fp32-noise tolerance, every replica bit-for-bit equal; its comm log
  holds one reduce-scatter over "dp_shard" and one all-reduce over "dp_replicate" per unit and step;
* in bf16 compute (fp32 master shards) it matches the baseline within NOISE_MULTIPLE x the bf16 noise of this
  training, measured by plain FSDP in bf16 over the 4 ranks against the same baseline;
* the module's parameters and gradient shards equal PyTorch's ``fully_shard`` on that 2-D ``DeviceMesh``
  (gloo), names, shapes, dtypes and values bit for bit, fp32 and bf16 (both reduce-scatter over the shard group,
  then all-reduce over the replicate group; the means divide by powers of two, exact), and our placements
  ``{"dp_replicate": R, "dp_shard": S(0)}`` read as DTensor's ``(Replicate(), Shard(0))``;
* a checkpoint saved by HSDP after step 1 (``checkpoint.save_whole``, through the placements) resumes on HSDP and on
  ZeRO-2 over dp 4, equal to the uninterrupted run and to the baseline;
* HSDP x TP, HSDP x CP and HSDP x PP (8 ranks, slow): dp_replicate 2 x dp_shard 2 x (tp 2 | cp 2 | pp 2) match
  the baseline (under the pipeline each stage's shards are all-reduced over dp_replicate at its REDUCE_GRAD).

Mutations that go red: the all-reduce over the replicas skipped (replicas drift, the baseline is missed); the
shards reduce-scattered over the whole dp group instead of the shard group (the gradient summed over the wrong
ranks and scaled wrong); the groups built with the wrong stride (shard and replicate groups swapped: still a mean
over all four ranks, so the baseline cannot tell, but every shard differs from ``fully_shard``'s).
"""

from __future__ import annotations

import functools
import tempfile
import types

import pytest
import torch

from course_lib.data import global_batch, shard
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel.compose import STEPS, data_parallel, parallelize, with_step
from course_lib.parallel.config import ParallelConfig, check_composable
from course_lib.parallel.fsdp2 import FSDP2DataParallel, PerParameterUnit, dim0_chunk
from course_lib.parallel.fsdp2_pipeline import StageSharding
from course_lib.parallel.placement import Replicate, Shard, placements_of
from course_lib.parallel.placement_ops import describe, merge_parameters
from course_lib.parallel.runs import Checkpointing, merge_composed, train_parallel
from course_lib.parallel.zero_unit import default_units
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import Mesh, MeshError, MeshShape
from course_lib.train import NOISE_MULTIPLE, Fp32Noise, TrainResult, compare, make_optimizer, train_baseline
from tests.test_zero_fsdp2 import ADAMW, CFG, CFG_2D, DTYPES, _local, mismatches

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

HSDP = {"dp": 4, "dp_replicate": 2}
AXES = ("dp_replicate", "dp_shard")
SAVE_AFTER = 1
RESUME_ON = {"hsdp": ParallelConfig(MeshShape(**HSDP), zero_stage=3),
             "zero2_dp4": ParallelConfig(MeshShape(dp=4), zero_stage=2)}


class SkipsReplicaAllReduce(PerParameterUnit):
    """Mutation: the reduce-scattered shard is never all-reduced over the replicas."""

    def all_reduce_replicas(self, out: torch.Tensor) -> None:
        pass


class ShardsOverAllDP(Mesh):
    """Mutation: the shard group is the whole dp group (the replicas' all-reduce still follows)."""

    def group(self, *axes: str):  # type: ignore[no-untyped-def]
        return super().group("dp", *[a for a in axes if a != "dp_shard"]) if "dp_shard" in axes \
            else super().group(*axes)


class WrongStride(Mesh):
    """Mutation: the shard group strides by dp_shard and the replicate group by 1 (the two swapped)."""

    def group(self, *axes: str):  # type: ignore[no-untyped-def]
        swap = {"dp_shard": "dp_replicate", "dp_replicate": "dp_shard", "cp": None}  # cp = 1 here
        return super().group(*[swap.get(a, a) for a in axes if swap.get(a, a)])


def _with_unit(unit: type[PerParameterUnit]) -> functools.partial[FSDP2DataParallel]:
    """FSDP2 built on ``unit`` (a mutation passes its own unit class)."""
    return functools.partial(FSDP2DataParallel, unit=unit)


def _torch_hsdp(model: GPT, dtype: torch.dtype) -> None:
    """PyTorch's HSDP: ``fully_shard`` on every block, then the root, over its own 2-D mesh (replicate, shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=AXES)
    policy = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype)
    for block in default_units(model)[:-1]:
        fully_shard(block, mesh=dmesh, mp_policy=policy)
    fully_shard(model, mesh=dmesh, mp_policy=policy)


def _run(rank, world_size, kind="ours", dtype=torch.float32, steps=ADAMW.steps, unit_class=PerParameterUnit,
         mesh_class=Mesh, degrees=None):
    """Train ``steps`` AdamW steps on this rank's slice of the global batch (its dp coordinate); after every
    backward record the module's own gradient shards, after every step its parameters; at the end the whole
    parameters (fp32) and the global-batch mean losses."""
    model = GPT(CFG, seed=ADAMW.seed)
    if kind == "fully_shard":
        _torch_hsdp(model, dtype)
        w, dp_rank = model, rank
    else:
        mesh = mesh_class(**(degrees or HSDP))
        w, dp_rank = _with_unit(unit_class)(model, mesh=mesh, param_dtype=dtype), mesh.coord("dp")
    opt = make_optimizer(list(model.parameters()), ADAMW)
    record, losses = [], []
    for step in range(steps):
        x, y = global_batch(step, ADAMW.global_batch, CFG.seq_len, ADAMW.seed)
        loss = lm_loss(w(shard(x, dp_rank, world_size)).float(), shard(y, dp_rank, world_size))
        loss.backward()
        losses.append(loss.item())
        grads = {n: None if p.grad is None else _local(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        record.append((grads, {n: _local(p) for n, p in model.named_parameters()}))
    out = {"record": record}
    if kind == "fully_shard":
        out["placements"] = {n: tuple(str(pl) for pl in p.placements) for n, p in model.named_parameters()}
        return out
    out["placements"] = {n: placements_of(p) for n, p in model.named_parameters()}
    out["described"] = {n: describe(p, AXES) for n, p in model.named_parameters()}
    out["result"] = TrainResult(w.reduce_losses(torch.tensor(losses)).tolist(), w.full_parameters())
    out["events"] = list(w.events)
    return out


def _refused_device_mesh() -> str:
    try:
        Mesh(**HSDP).device_mesh("dp")
    except ValueError as e:
        return str(e)
    return ""


def _suite(rank, world_size, folder):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = Mesh(**HSDP)
    dmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=AXES)
    ours_dmesh = mesh.device_mesh(*AXES)
    runs = {"groups": {a: mesh.ranks(a) for a in AXES},
            "torch_groups": {a: dmesh[a].mesh.tolist() for a in AXES},  # this rank's group in each
            "our_device_mesh": ours_dmesh.mesh.tolist(),
            "refused_device_mesh": _refused_device_mesh()}
    runs["composed"] = train_parallel(rank, world_size, CFG, ADAMW, ParallelConfig(MeshShape(**HSDP), zero_stage=3),
                                      checkpoint=Checkpointing(save_to=folder, save_after=SAVE_AFTER))
    for name, other in RESUME_ON.items():
        runs["resumed", name] = train_parallel(rank, world_size, CFG, ADAMW, other,
                                               checkpoint=Checkpointing(resume_from=folder))
    for name, dtype in DTYPES.items():
        if name == "fp16":
            continue
        for kind in ("ours", "fully_shard"):
            runs[kind, name] = _run(rank, world_size, kind, dtype)
    runs["fsdp_1d", "bf16"] = _run(rank, world_size, dtype=torch.bfloat16, degrees={"dp": 4})
    runs["skips_all_reduce"] = _run(rank, world_size, unit_class=SkipsReplicaAllReduce)
    runs["shards_over_all_dp"] = _run(rank, world_size, mesh_class=ShardsOverAllDP)
    runs["wrong_stride"] = _run(rank, world_size, mesh_class=WrongStride)
    return runs


@functools.cache
def suite():
    return launch(_suite, 4, tempfile.mkdtemp(prefix="hsdp-ckpt-"), timeout=400)


@functools.cache
def baseline():
    return train_baseline(CFG, ADAMW)


def _bf16_noise(bf16: TrainResult, ref: TrainResult) -> Fp32Noise:
    """The rounding error of this training in bf16 compute, measured: plain FSDP in bf16 against the fp32
    baseline (per step |loss diff|, per tensor max |param diff|), the noise the HSDP bf16 run must absorb."""
    return Fp32Noise([abs(a - b) for a, b in zip(bf16.losses, ref.losses, strict=True)],
                     {n: float((bf16.params[n] - t).abs().max()) for n, t in ref.params.items()})


# ---------------------------------------------------------------------------------------------- the rank layout


def test_the_rank_layout_is_torchtitans_and_device_meshs():
    s = MeshShape(dp=4, tp=2, dp_replicate=2)
    assert s.dp_shard == 2
    assert s.all_groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # tp fastest, then dp_shard
    assert s.all_groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert s.all_groups("dp_shard", "tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert s.coords(6) == {"tp": 0, "cp": 0, "dp": 3, "pp": 0, "ep": 0, "edp": 3, "dp_replicate": 1,
                           "dp_shard": 1}
    plain = MeshShape(dp=4)  # dp_replicate = 1: the shard group is dp's, the replicas are single ranks
    assert plain.all_groups("dp_shard") == plain.all_groups("dp") and plain.all_groups("dp_replicate") == [
        [0], [1], [2], [3]]
    assert "dp_shard" not in plain.coords(0)  # the sub-axes show only when they split dp
    for rank, runs in enumerate(suite()):
        assert runs["groups"] == {"dp_replicate": [rank % 2, rank % 2 + 2], "dp_shard": [rank // 2 * 2,
                                                                                          rank // 2 * 2 + 1]}
        assert runs["groups"] == runs["torch_groups"], rank
        assert runs["our_device_mesh"] == [[0, 1], [2, 3]]


def test_bad_splits_and_stages_are_refused_with_the_fix():
    with pytest.raises(MeshError, match=r"dp_replicate=3 does not divide dp=4: .* \(choose dp_replicate in "
                                        r"\[1, 2, 4\], or dp a multiple of 3"):
        MeshShape(dp=4, dp_replicate=3)
    with pytest.raises(MeshError, match=r"dp_replicate=0: every degree must be an int >= 1"):
        ParallelConfig(MeshShape(dp=4, dp_replicate=0))
    for stage in (0, 1, 2):
        with pytest.raises(ValueError, match=rf"dp_replicate=2 is hybrid sharding .* with zero_stage={stage} "
                                             r"nothing is sharded .*: use zero_stage=3, or dp_replicate=1"):
            ParallelConfig(MeshShape(**HSDP), zero_stage=stage).validate(CFG)
        no_groups = types.SimpleNamespace(shape=MeshShape(**HSDP), rank=0)  # a mesh without any process group
        with pytest.raises(ValueError, match=r"use zero_stage=3, or dp_replicate=1"):  # refused before a group
            parallelize(GPT(CFG), no_groups, ParallelConfig(MeshShape(**HSDP), zero_stage=stage))  # is needed
    # HSDP x PP composes (each stage's FSDP2 shards replicated over dp_replicate): no refusal; parity is below
    check_composable(MeshShape(dp=4, dp_replicate=2, pp=2), GPTConfig(n_layer=2), zero_stage=3)
    with pytest.raises(ValueError, match="dp already holds dp_replicate x dp_shard"):
        MeshShape(**HSDP).group_ranks(0, "dp", "dp_shard")
    assert "with dp_replicate > 1 dp is dp_replicate x dp_shard" in suite()[0]["refused_device_mesh"]


# ---------------------------------------------------------------------------------------------- parity


def test_hsdp_matches_the_baseline_and_its_replicas_agree():
    results = suite()
    merged = merge_composed([r["composed"] for r in results])  # raises if two replicas drifted apart
    report = compare(baseline(), merged)
    assert report.ok, report
    per_step = results[0]["composed"].step_comm[0]
    units = len(default_units(GPT(CFG)))
    assert [r.group for r in per_step if r.op == "reduce_scatter"] == ["dp_shard"] * units
    assert [r.group for r in per_step if r.op == "all_reduce"] == ["dp_replicate"] * units


@pytest.mark.parametrize("name", RESUME_ON)
def test_a_checkpoint_saved_by_hsdp_resumes_on_hsdp_and_on_another_mesh(name):
    """Saved through the placements (each shard gathered over dp_shard, written by the first replica), cut
    again by the new mesh's placements on resume."""
    resumed = merge_composed([r["resumed", name] for r in suite()])
    ref = baseline()
    assert compare(merge_composed([r["composed"] for r in suite()]).from_step(SAVE_AFTER), resumed,
                   noise=ref.noise).ok
    assert compare(ref.from_step(SAVE_AFTER), resumed).ok


def test_hsdp_in_bf16_matches_the_baseline_within_the_bf16_noise():
    results, ref = suite(), baseline()
    for kind in ("ours", "fsdp_1d"):
        merge_parameters([r[kind, "bf16"]["result"].params for r in results])  # replicas equal
    hsdp, fsdp = results[0]["ours", "bf16"]["result"], results[0]["fsdp_1d", "bf16"]["result"]
    assert all(p.dtype == torch.float32 for p in hsdp.params.values())
    noise = _bf16_noise(fsdp, ref)
    assert noise.largest()[0] > 0  # bf16 rounding shows
    report = compare(ref, hsdp, noise=noise)
    assert report.ok, f"{report} (tolerance {NOISE_MULTIPLE:g} x the bf16 noise of plain FSDP)"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_parameters_gradient_shards_and_placements_are_fully_shards_hsdp(dtype):
    names = [n for n, _ in GPT(CFG).named_parameters()]
    for rank, runs in enumerate(suite()):
        ours, ref = runs["ours", dtype], runs["fully_shard", dtype]
        assert len(ours["record"]) == len(ref["record"]) == ADAMW.steps
        assert mismatches(ours, ref) == [], f"rank {rank}, {dtype}"
        shard_rank = rank % 2
        for name, p in GPT(CFG).named_parameters():
            lo, hi = dim0_chunk(p.shape[0], 2, shard_rank)
            assert ours["record"][0][0][name].shape == (hi - lo, *p.shape[1:]), (rank, name)
            assert ours["placements"][name] == {"dp_replicate": Replicate(), "dp_shard": Shard(0, p.shape[0])}
            assert ours["described"][name] == "(" + ", ".join(ref["placements"][name]) + ")" == "(R, S(0))"
        assert list(ours["placements"]) == names


# ---------------------------------------------------------------------------------------------- mutations


def test_skipping_the_replicas_all_reduce_is_caught():
    results = suite()
    with pytest.raises(ValueError, match="replicas drifted apart"):
        merge_parameters([r["skips_all_reduce"]["result"].params for r in results])
    assert not compare(baseline(), results[0]["skips_all_reduce"]["result"]).ok
    assert not any(op == "all_reduce" for op, _ in results[0]["skips_all_reduce"]["events"])
    assert any(op == "all_reduce" for op, _ in results[0]["ours", "fp32"]["events"])


def test_reduce_scattering_over_the_whole_dp_group_is_caught():
    results = suite()
    assert mismatches(results[0]["shards_over_all_dp"], results[0]["fully_shard", "fp32"])
    assert not compare(baseline(), results[0]["shards_over_all_dp"]["result"]).ok


def test_groups_with_the_wrong_stride_differ_from_fully_shard():
    results = suite()
    # the mean is still over all four ranks, so the training itself is right ...
    assert compare(baseline(), results[0]["wrong_stride"]["result"]).ok
    # ... but rank 1 holds shard 0 where PyTorch's rank 1 holds shard 1 (and rank 2 the reverse)
    for rank in (1, 2):
        assert mismatches(results[rank]["wrong_stride"], results[rank]["fully_shard", "fp32"]), rank


# ---------------------------------------------------------------------------------------------- HSDP x TP


CFG_CP = GPTConfig(bias=False, n_layer=2, d_model=32, n_head=4, seq_len=16)  # zig-zag: seq_len % (2 cp) == 0
WITH_OTHER_AXIS = {"tp": (CFG_2D, {"tp": 2}), "cp": (CFG_CP, {"cp": 2})}


def _hsdp_with(rank, world_size, cfg, degrees):
    return train_parallel(rank, world_size, cfg, ADAMW, ParallelConfig(MeshShape(**HSDP, **degrees), zero_stage=3))


@pytest.mark.slow
@pytest.mark.parametrize("axis", WITH_OTHER_AXIS)
def test_hsdp_with_tensor_or_context_parallelism_matches_the_baseline(axis):
    """dp_replicate 2 x dp_shard 2 x (tp 2 | cp 2), 8 ranks. TP: each TP shard cut again over dp_shard, its GQA
    K/V gradients (``Partial`` on tp) summed over tp after the dp_shard reduce-scatter and the dp_replicate
    all-reduce. CP: the shards live on dp_shard x cp (torchtitan's dp_shard_cp), recorded "dp_shard+cp"."""
    cfg, degrees = WITH_OTHER_AXIS[axis]
    results = launch(_hsdp_with, 8, cfg, degrees, timeout=400)
    assert [r.coords["dp_shard"] for r in results[:4]] == [0, 0, 1, 1]  # tp or cp fastest, then dp_shard
    report = compare(train_baseline(cfg, ADAMW), merge_composed(results))
    assert report.ok, report


# ---------------------------------------------------------------------------------------------- HSDP x PP


CFG_PP = CFG.with_(n_layer=4)  # two blocks per stage; d_model 33: the shards' padding rows are exercised
HSDP_PP = ParallelConfig(MeshShape(**HSDP, pp=2), zero_stage=3, schedule="1f1b", microbatches=2)


def _stages_without_replicas(run) -> None:
    """Mutation of the data-parallel step: each stage sharded over dp_shard, its replicas never all-reduced."""
    pipe = run.pipe
    run.dp = StageSharding({int(k): st for k, st in pipe.stages.items()}, run.mesh.group("dp_shard"),
                           groups=run.mesh, axis="dp_shard")
    pipe.connect(run.dp.reduce, engine=run.dp)


def _hsdp_pipeline(rank, world_size):
    skips = with_step(STEPS, data_parallel, _stages_without_replicas)
    return {"hsdp": train_parallel(rank, world_size, CFG_PP, ADAMW, HSDP_PP),
            "skips_replicas": train_parallel(rank, world_size, CFG_PP, ADAMW, HSDP_PP, steps=skips)}


@pytest.mark.slow
def test_hsdp_with_pipeline_parallelism_matches_the_baseline():
    """dp_replicate 2 x dp_shard 2 x pp 2, 8 ranks (1F1B, 2 micro-batches): each stage's parameters are FSDP2
    shards over dp_shard, replicated over dp_replicate (``fsdp2_pipeline`` with ``replicate_group``); its
    ``REDUCE_GRAD`` reduce-scatters over dp_shard and all-reduces the shards over dp_replicate, once per unit and
    step. Every copy of a parameter bit-for-bit equal (``merge_composed``), the result the baseline's. Without
    the replicas' all-reduce (a mutated data-parallel step) the replicas drift apart."""
    runs = launch(_hsdp_pipeline, 8, timeout=400)
    results = [r["hsdp"] for r in runs]
    assert [(r.coords["pp"], r.coords["dp_replicate"], r.coords["dp_shard"]) for r in results] == [
        (pp, rep, sh) for pp in (0, 1) for rep in (0, 1) for sh in (0, 1)]
    report = compare(train_baseline(CFG_PP, ADAMW), merge_composed(results))
    assert report.ok, report
    for r in results:
        for step in r.step_comm:
            scattered = [c.group for c in step if c.op == "reduce_scatter"]
            reduced = [c.group for c in step if c.op == "all_reduce" and c.group == "dp_replicate"]
            assert scattered and set(scattered) == {"dp_shard"}, (r.rank, scattered)
            assert len(reduced) == len(scattered), (r.rank, reduced, scattered)
    with pytest.raises(ValueError, match=r"drifted apart|reports losses"):
        merge_composed([r["skips_replicas"] for r in runs])
