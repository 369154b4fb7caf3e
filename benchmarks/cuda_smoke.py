"""CUDA + NCCL smoke test: one DP, one ZeRO-3 and one pipeline training run on GPUs, each checked against the
single-process CPU baseline and watched by ``course_lib.runtime.device_audit`` (no device-less allocation, no float64
collective). Prints PASS/FAIL per wrapper and exits non-zero on any failure; without CUDA it says so and exits 0.

    python benchmarks/cuda_smoke.py                          # world size 1 (starts its own NCCL group)
    torchrun --nproc-per-node=2 benchmarks/cuda_smoke.py      # more ranks where there are more GPUs

Tolerance: |a - b| <= 1e-5 + 1e-4 |ref| (GPU kernels reassociate sums differently from the CPU's; TF32 is off).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.runtime.device_audit import DeviceAudit
from course_lib.runtime.launch import device
from course_lib.train import TrainConfig, compare, train_baseline

CFG = GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=16, bias=False)
TC = TrainConfig(steps=2, global_batch=8, optimizer="sgd", lr=1e-2)


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device here; nothing to check")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if "RANK" not in os.environ:  # plain python: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = train_baseline(CFG, TC)
    runs = {"DataParallel": lambda **kw: runs.train_dp(rank, world, CFG, TC, **kw),
            "ZeroDataParallel(stage 3)": lambda **kw: runs.train_zero(rank, world, CFG, TC, 3, **kw),
            "PipelineParallel(1f1b)": lambda **kw: runs.train_pp(rank, world, CFG, TC, "1f1b", 2, **kw)}
    failed = 0
    for name, run in runs.items():
        with DeviceAudit(device()) as audit:
            def model_fn(cfg, seed, audit=audit):
                with audit.paused():
                    return GPT(cfg, seed)
            t0 = time.perf_counter()
            try:
                result = run(model_fn=model_fn)
                error = None
            except Exception as e:
                result, error = None, f"{type(e).__name__}: {e}"
            seconds = time.perf_counter() - t0
        if result is not None and name.startswith("Pipeline"):
            parts = [None] * world
            dist.all_gather_object(parts, result)
            result = runs.merge_results(parts)
        if error is None:
            report = compare(reference, result, rtol=1e-4, atol=1e-5)
            problems = ([] if report.ok else [str(report)]) + [str(f) for f in audit.findings]
        else:
            problems = [error]
        verdict = "PASS" if not problems else "FAIL"
        failed += bool(problems)
        if rank == 0:
            print(f"{verdict} {name} on {device()} x {world} (nccl), {seconds:.2f} s"
                  + "".join(f"\n    {p}" for p in sorted(set(problems))))
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
