"""Data-parallel training across machines, checked against one process.

One script, three ways to run it:

    python examples/multinode_dp.py                      # 2 local ranks, no torchrun (course_lib.runtime.launch)
    torchrun --standalone --nproc-per-node=2 examples/multinode_dp.py
    # one machine per node: the same line on every node, only --node-rank differs
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=0 \
        --rdzv-backend=c10d --rdzv-endpoint=HOST_OF_NODE_0:29400 --rdzv-id=dp-demo examples/multinode_dp.py

Every rank trains the tiny GPT on its slice of each global batch (``course_lib.parallel.dp.train_dp``; the
gradients are averaged over *all* ranks, across nodes too). Then every rank trains the same model on the whole
batch in one process (``train_baseline``, a second or so) and compares: per-step losses and every final
parameter must agree (fp32, within 8 x the baseline's fp32 noise). Rank 0 prints the verdict; every rank exits 1
on FAIL, so each node's torchrun, and the job scheduler above it, sees the failure. See examples/README.md for the
commands on a real cluster and what changes with GPUs (NCCL).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

from course_lib.parallel.dp import MODES
from course_lib.parallel.runs import train_dp
from course_lib.runtime.launch import in_torchrun, launch
from course_lib.train import PARITY_MODEL, TrainConfig, TrainResult, compare, train_baseline


def train(rank: int, world_size: int, tc: TrainConfig, mode: str) -> tuple[str, TrainResult]:
    """What each rank runs: data-parallel training over every rank. Returns where it ran, and the result."""
    result = train_dp(rank, world_size, PARITY_MODEL, tc, mode=mode, bucket_mb=0.1)
    where = (f"rank {rank}: node {os.environ.get('GROUP_RANK', 0)}, "  # GROUP_RANK: torchrun's node rank
             f"local rank {os.environ.get('LOCAL_RANK', rank)}, host {socket.gethostname()}, pid {os.getpid()}")
    return where, TrainResult(result.losses, result.params)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8, help="rows per step, over all ranks")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw")
    parser.add_argument("--mode", choices=MODES, default="overlapped", help="how gradients are all-reduced")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to start without torchrun")
    args = parser.parse_args()
    # under torchrun WORLD_SIZE = nnodes x nproc-per-node; launch() then runs train() in this process
    world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
    lr = 1e-2 if args.optimizer == "sgd" else 1e-3
    tc = TrainConfig(steps=args.steps, global_batch=args.global_batch, optimizer=args.optimizer, lr=lr)

    if in_torchrun():
        # Join the job: torchrun gave every process RANK, WORLD_SIZE and the rendezvous (MASTER_ADDR/PORT).
        # gloo, not NCCL, even on a GPU node: this example computes on the CPU, and NCCL only moves CUDA
        # tensors (launch() would pick NCCL when it sees a GPU). gloo crosses nodes over plain TCP.
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        results = launch(train, world_size, tc, args.mode, timeout=120)  # every rank gets every rank's result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

    reference = train_baseline(PARITY_MODEL, tc)
    rank = int(os.environ.get("RANK", 0))
    runs = [run for _, run in results]
    report = compare(reference, runs[rank])
    replicas_agree = all(compare(runs[0], run, rtol=0, atol=0).ok for run in runs)  # bit-identical replicas
    ok = report.ok and replicas_agree
    if rank == 0:
        for where, _ in results:
            print(where)
        print(f"world size {world_size}, global batch {tc.global_batch}, {tc.steps} steps, {tc.optimizer}, "
              f"{args.mode} all-reduce")
        print(f"losses: {[round(x, 6) for x in runs[0].losses]}")
        print(report)
        print(f"replicas identical on every rank: {replicas_agree}")
        print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
