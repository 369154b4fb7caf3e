"""Device-true code: the DP, ZeRO, pipeline and composed (TP, CP, PP through ``parallelize``) steps allocate
nothing without the model's device and put no float64 on the wire (``course_lib.runtime.device_audit``), and the audit
does catch both bugs when a variant adds them through a public seam (a device-less bucket buffer; a float64 loss
reduction; a device-less ZeRO gradient shard). One launch at 2 ranks runs every form once under the audit.
"""

from __future__ import annotations

import functools

import pytest
import torch

from course_lib import comm
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.parallel import dp, runs, zero, zero_unit
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.fsdp2 import FSDP2DataParallel
from course_lib.runtime.device_audit import DeviceAudit
from course_lib.runtime.launch import device, launch
from course_lib.runtime.mesh import MeshShape
from course_lib.train import TrainConfig

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, bias=False, pos="rope")
TC = TrainConfig(steps=2, global_batch=4)


class DevicelessBuckets(dp.DataParallel):
    """Bucket buffers allocated without a device: fine on a CPU, wrong on a GPU."""

    def build_buckets(self, params=None) -> list[dp.Bucket]:
        return [dp.Bucket(b.params, b.key, torch.zeros(b.buffer.numel(), dtype=b.buffer.dtype))
                for b in super().build_buckets(params)]


class Float64Losses(dp.DataParallel):
    """Reduces the reported losses in float64, which NCCL would not take."""

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        losses = local.double()
        comm.all_reduce(losses, group=self.group)
        return losses / self.world_size


class DevicelessShardGrad(zero_unit.FlatParamUnit):
    def reduce_gradients(self) -> torch.Tensor:
        return super().reduce_gradients() + torch.zeros(self.layout.shard_numel)


DevicelessZero = functools.partial(zero.ZeroDataParallel, unit=DevicelessShardGrad)


DP_MODES = ("naive", "bucketed", "overlapped")  # "scheduled" runs under the pipeline (composed-pp2)
RUNS = {
    **{f"dp-{m}": functools.partial(runs.train_dp, mode=m, bucket_mb=0.001) for m in DP_MODES},
    **{f"zero-{s}": functools.partial(runs.train_zero, stage=s) for s in range(4)},
    "zero-3-bf16": functools.partial(runs.train_zero, stage=3, param_dtype=torch.bfloat16),
    "fsdp2": functools.partial(runs.train_zero, stage=3, sharding=FSDP2DataParallel),
    **{f"pp-{s}": functools.partial(runs.train_pp, schedule=s, microbatches=2) for s in ("1f1b", "zb_h1")},
    **{f"composed-{axis}2": functools.partial(runs.train_parallel, parallel=ParallelConfig(MeshShape(**{axis: 2})))
       for axis in ("tp", "cp", "pp")},
    "composed-tp2-sp": functools.partial(runs.train_parallel,
                                         parallel=ParallelConfig(MeshShape(tp=2), sequence_parallel=True)),
    "broken-buckets": functools.partial(runs.train_dp, data_parallel=DevicelessBuckets),
    "broken-float64": functools.partial(runs.train_dp, data_parallel=Float64Losses),
    "broken-zero": functools.partial(runs.train_zero, stage=2, sharding=DevicelessZero),
}


def _audited(rank: int, world_size: int) -> dict[str, list[str]]:
    out = {}
    for name, run in RUNS.items():
        with DeviceAudit(device()) as audit:
            def model_fn(cfg, seed, audit=audit):
                with audit.paused():  # the model is built on the CPU, then moved: not the library's allocation
                    return GPT(cfg, seed)
            run(rank, world_size, CFG, TC, model_fn=model_fn)
        out[name] = sorted({f.kind + " " + f.where.rsplit("/", 1)[-1] for f in audit.findings})
    return out


@functools.cache
def audited() -> list[dict[str, list[str]]]:
    return launch(_audited, 2, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RUNS if not n.startswith("broken")])
def test_every_form_is_device_true(name):
    for rank, found in enumerate(audited()):
        assert found[name] == [], f"{name}, rank {rank}: {found[name]}"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "expected"), [("broken-buckets", "factory without device test_device.py"),
                                                ("broken-float64", "float64 collective"),
                                                ("broken-zero", "factory without device test_device.py")])
def test_the_audit_catches_a_deviceless_allocation_and_a_float64_collective(name, expected):
    for found in audited():
        assert any(f.startswith(expected) for f in found[name]), found[name]


def test_the_audit_in_one_process():
    with DeviceAudit("cpu") as audit:
        torch.zeros(3, device="cpu")
        torch.zeros_like(torch.ones(2, device="cpu"))
        with audit.paused():
            torch.ones(2)
        torch.arange(4)
    assert [(f.kind, f.call) for f in audit.findings] == [("factory without device", "torch.arange")]
