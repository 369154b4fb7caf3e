"""Our overlapped, bucketed data parallelism against PyTorch's ``DistributedDataParallel``, side by side in one run.

Same model, same world size (2: no more ranks than the 2 cores of the course machine), same bucket cap, same data,
SGD. Each repeat runs one training step of each implementation, in alternating order (AB, BA, ...) so that drifts
in the machine's load hit both alike; a barrier starts every step on all ranks together, and a step's time is the
slowest rank's (zero_grad + forward + backward + gradient sync + optimizer step). Times are medians over repeats.

Prints the ratio ours / DDP at one bucket cap (goal: <= 1.1), then a bucket-size sweep. The ratio is the median over
repeats of (our step / DDP's step of the same repeat): paired steps ran back to back under the same load.

    python benchmarks/dp_bench.py                 # about a minute on a 2-core laptop
    python benchmarks/dp_bench.py --repeats 20    # steadier medians

Not a test: timings depend on the machine and its load (the load average is printed with the results).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from course_lib.data import global_batch, shard
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig, param_count
from course_lib.parallel import dp
from course_lib.runtime.launch import launch

GOAL = 1.1
CFG = GPTConfig(n_layer=4, d_model=256, n_head=4, seq_len=64, bias=False)  # 3.3 M parameters, 13 MB of fp32 grads
ROWS_PER_RANK = 4
HEADLINE_MB = 2.0  # 7 buckets: overlap has something to hide
SWEEP_MB = (0.0, 0.25, 1.0, 2.0, 4.0, 25.0)  # 0: one bucket per tensor; 25: DDP's default (one bucket here)


def _bench(rank: int, world_size: int, bucket_mb: float, repeats: int, warmup: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    impls = {}
    model = GPT(CFG, seed=0)
    impls["ours"] = (dp.DataParallel(model, mode="overlapped", bucket_mb=bucket_mb),
                     torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False))
    model = GPT(CFG, seed=0)
    impls["ddp"] = (DistributedDataParallel(model, bucket_cap_mb=bucket_mb),
                    torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False))
    times: dict[str, list[float]] = {name: [] for name in impls}
    for i in range(warmup + repeats):
        x, y = global_batch(i, ROWS_PER_RANK * world_size, CFG.seq_len)
        x, y = shard(x, rank, world_size), shard(y, rank, world_size)
        order = list(impls) if i % 2 == 0 else list(impls)[::-1]
        for name in order:
            wrapped, opt = impls[name]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            lm_loss(wrapped(x), y).backward()
            if name == "ours":
                wrapped.finish_gradient_sync()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
            if i >= warmup:
                times[name].append(elapsed.item())
    if rank == 0:
        times["n_buckets"] = [float(len(impls["ours"][0].buckets))]
    return times


def measure(bucket_mb: float, repeats: int, warmup: int = 2, world_size: int = 2) -> dict[str, float]:
    res = launch(_bench, world_size, bucket_mb, repeats, warmup, timeout=600)[0]
    ours, ddp = statistics.median(res["ours"]), statistics.median(res["ddp"])
    # the two steps of a repeat ran back to back under the same load: the median of their ratios is steadier
    # than the ratio of the medians when the machine's load drifts
    paired = statistics.median(o / d for o, d in zip(res["ours"], res["ddp"], strict=True))
    return {"ours": ours, "ddp": ddp, "ratio": paired, "buckets": int(res["n_buckets"][0])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=12, help="measured steps per implementation and setting")
    args = parser.parse_args(argv)
    n_params = param_count(CFG)
    print(f"model: GPT {CFG.n_layer} layers, d_model {CFG.d_model}, seq {CFG.seq_len}: {n_params / 1e6:.2f} M "
          f"parameters, {n_params * 4 / 1e6:.1f} MB of fp32 gradients; {ROWS_PER_RANK} rows per rank; SGD")
    print(f"setting: gloo on CPU, 2 ranks on {os.cpu_count()} cores; medians of {args.repeats} steps each, "
          "AB/BA interleaved; load average at start "
          f"{os.getloadavg()[0]:.1f}")
    start = time.perf_counter()
    head = measure(HEADLINE_MB, args.repeats)
    verdict = "meets" if head["ratio"] <= GOAL else "misses"
    print(f"\nbucket cap {HEADLINE_MB:g} MiB ({head['buckets']} buckets): ours (overlapped) "
          f"{head['ours'] * 1e3:.0f} ms, DDP {head['ddp'] * 1e3:.0f} ms per step -> "
          f"ratio ours / DDP = {head['ratio']:.2f} ({verdict} the goal <= {GOAL})")
    print(f"\n{'bucket cap (MiB)':>16} | {'buckets':>7} | {'ours (ms)':>9} | {'DDP (ms)':>8} | ours / DDP (paired)")
    for mb in SWEEP_MB:
        row = head if mb == HEADLINE_MB else measure(mb, args.repeats)
        label = f"{mb:g}" + (" (per tensor)" if mb == 0 else " (DDP default)" if mb == 25 else "")
        print(f"{label:>16} | {row['buckets']:>7} | {row['ours'] * 1e3:>9.0f} | {row['ddp'] * 1e3:>8.0f} | "
              f"{row['ratio']:.2f}")
    print(f"\n({time.perf_counter() - start:.0f} s; load average at the end {os.getloadavg()[0]:.1f}. Buckets: ours, "
          "reverse definition order, always; DDP rebuilds its buckets after the first step in the order the "
          "gradients arrived.)")


if __name__ == "__main__":
    main()
