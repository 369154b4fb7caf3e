"""Our tensor parallelism (``course_lib.parallel.tp``) against DTensor's ``parallelize_module`` + ``loss_parallel``:
step time and bytes per step, measured side by side in one run, as ratios (ours / DTensor).

Both live in the same ranks and train the same GPT (rotary positions, which DTensor's SP plan needs; same seed,
same batch on every rank of the TP group), fp32, AdamW, with the same plan (``tp.gpt_plan`` / ``oracles.dtensor_plan``).

* **Time**: the median over ``--repeats`` training steps of each, interleaved (ours, DTensor, ours, ...) so that
  the machine's load drifts over both alike, each step after a barrier. Goal: ours / DTensor <= 1.1. CPU gloo is
  not NCCL: this says whether our Python (autograd Functions, the wrapper) costs more than DTensor's dispatch.
* **Bytes**: what one rank sends per step (ring bytes, ``comm``'s convention), ours from the comm log, DTensor's
  from ``oracles.DTensorCommLog`` (its collectives logged below its dispatch). Goal: 1.00 — forward and backward issue
  the same collectives. Under SP the norms' gradients are partial sums: ours adds them in one flat all-reduce;
  DTensor keeps them as ``Partial`` DTensors and all-reduces one each time an optimizer op reads it -- with
  AdamW (``foreach=False``: weight decay, first and second moment) 3 times per norm parameter, so the bytes ratio
  is a little below 1 (0.996 for the default model, 40 collectives against 93; measured 2026-12, 2 cores).
  Measured on the default model, t = 2: time ratio 0.45 (TP) and 0.85 (TP + SP), bytes ratio 1.000 and 0.996.

* **Overlap** (``--overlap``): the exposed communication of one column-parallel GEMM under SP, its all-gather
  done first or decomposed into ring steps overlapped with partial GEMMs (``parallel.tp_overlap``), on the
  emulated device (a partial GEMM costs ``c``, a ring step ``m``), next to the formulas (t-1) m and
  (t-1) max(0, m - c); the ratio overlapped / sequential.

Run: ``python benchmarks/tp_bench.py [--world-size 2 --d-model 128 --n-layer 4 --seq-len 64 --repeats 7 --sp]``,
``python benchmarks/tp_bench.py --overlap [--world-size 4]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch.distributed as dist

from course_lib import comm
from course_lib.data import global_batch
from course_lib.model import GPT, lm_loss, num_params
from course_lib.model_config import GPTConfig
from course_lib.parallel import oracles, tp, tp_overlap
from course_lib.parallel.dp_reduce import sum_partials
from course_lib.parallel.tp_layers import vocab_parallel_cross_entropy
from course_lib.runtime.launch import launch
from course_lib.train import TrainConfig, make_optimizer

TIME_GOAL = 1.1


def _rank(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig, sp: bool, repeats: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    ours = GPT(cfg, tc.seed)
    tp.apply_tp(ours, None, sequence_parallel=sp)
    opt_ours = make_optimizer(list(ours.parameters()), tc)
    theirs = GPT(cfg, tc.seed)
    parallelize_module(theirs, init_device_mesh("cpu", (world_size,)), oracles.dtensor_plan(cfg, sp))
    opt_theirs = make_optimizer(list(theirs.parameters()), tc)
    x, y = global_batch(0, tc.global_batch, cfg.seq_len, tc.seed)

    def step_ours() -> None:
        loss = vocab_parallel_cross_entropy(ours(x), y)
        loss.backward()
        sum_partials(ours.parameters(), {"tp": None})  # the data-parallel step's share: TP's partial sums
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)

    def step_theirs() -> None:
        with loss_parallel():
            loss = lm_loss(theirs(x), y)
            loss.backward()
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)

    with comm.recording() as log:
        step_ours()
    with oracles.DTensorCommLog(world_size, rank) as dlog:
        step_theirs()
    times: dict[str, list[float]] = {"ours": [], "dtensor": []}
    for _ in range(repeats):
        for name, step in (("ours", step_ours), ("dtensor", step_theirs)):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {"times": times, "bytes": (log.sent_bytes(), sum(r.sent_bytes for r in dlog.records)),
            "calls": (len(log.records), len(dlog.records))}


def overlap(t: int, repeats: int) -> None:
    """Exposed communication of the collective matmul, sequential vs overlapped, measured vs formula."""
    print(f"collective matmul, t={t}, emulated device: exposed communication (slowest rank, median of {repeats})")
    print(f"{'c ms':>5} {'m ms':>5} | {'sequential':>10} {'formula':>7} | {'overlapped':>10} {'formula':>7} | ratio")
    for c_s, m_s in ((0.01, 0.03), (0.02, 0.03), (0.03, 0.03), (0.04, 0.03)):
        cost = tp_overlap.EmulatedCost(gemm_s=c_s, step_s=m_s)
        res = launch(tp_overlap.measure_exposed_comm, t, cost, repeats=repeats, timeout=300)
        seq, ovl = (max(r[k] for r in res) for k in ("sequential", "overlapped"))
        f_seq, f_ovl = (tp_overlap.exposed_comm_seconds(t, c_s, m_s, o) for o in (False, True))
        print(f"{c_s * 1e3:>5.0f} {m_s * 1e3:>5.0f} | {seq * 1e3:>10.1f} {f_seq * 1e3:>7.1f} | {ovl * 1e3:>10.1f} "
              f"{f_ovl * 1e3:>7.1f} | {ovl / seq:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism on both")
    ap.add_argument("--overlap", action="store_true", help="the collective matmul's exposed comm instead")
    args = ap.parse_args()
    if args.overlap:
        overlap(args.world_size, args.repeats)
        return
    cfg = GPTConfig(bias=False, pos="rope", d_model=args.d_model, n_head=4, n_layer=args.n_layer, seq_len=args.seq_len)
    tc = TrainConfig(global_batch=args.batch)
    res = launch(_rank, args.world_size, cfg, tc, args.sp, args.repeats, timeout=600)
    ours = statistics.median(max(r["times"]["ours"][i] for r in res) for i in range(args.repeats))
    theirs = statistics.median(max(r["times"]["dtensor"][i] for r in res) for i in range(args.repeats))
    b_ours, b_theirs = res[0]["bytes"]
    c_ours, c_theirs = res[0]["calls"]
    print(f"TP t={args.world_size}{' + SP' if args.sp else ''}: GPT {num_params(GPT(cfg)) / 1e6:.2f} M parameters, "
          f"batch {args.batch} x {args.seq_len} tokens, fp32 AdamW, gloo CPU, {args.repeats} interleaved steps")
    print(f"  step time (median of the slowest rank): ours {ours * 1e3:.1f} ms, DTensor {theirs * 1e3:.1f} ms, "
          f"ratio {ours / theirs:.2f} (goal <= {TIME_GOAL})")
    print(f"  bytes sent per rank and step: ours {b_ours}, DTensor {b_theirs}, ratio {b_ours / b_theirs:.3f}; "
          f"collectives ours {c_ours}, DTensor {c_theirs}")


if __name__ == "__main__":
    main()
