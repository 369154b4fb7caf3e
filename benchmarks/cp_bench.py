"""Context parallelism measured: activation memory per rank of ring attention against full attention, and the
step time of the zig-zag layout against the contiguous one under a causal mask.

1. **Memory** (normal mode, real compute): the bytes autograd saves for the backward of one attention layer
   (``course_lib.measure.memtrack.MemoryTracker``, category "activations"), ring attention on each of cp ranks holding
   s/cp tokens vs PyTorch's SDPA on one process holding all s. Goal: ratio x cp within 10 % of 1 (each rank
   keeps q, k, v, out and the log-sum-exp of its own tokens only; the blocks it receives are freed after use).
2. **Step time** (emulated-device mode): forward + backward of ring attention, each block sleeping
   ``seconds_per_pair`` x its visible (q, k) pairs (twice that in backward), so cp ranks run side by side even
   on 2 cores (``cp_attention.EmulatedDeviceAttention``). The ring moves in lockstep: every step waits for the
   busiest rank, so the modelled ratio zig-zag / contiguous is ``viz.cp.lockstep_work``'s, ~cp/(2cp - 1).
   Goal: measured ratio < 1. Times: median over repeats of the slowest rank.
3. **Ring vs Ulysses** (``cp_ulysses``): bytes one rank sends per attention layer, forward + backward, both
   measured (our own send/recv) next to their formulas, and the step time on the same emulated device (a pair
   costs in proportion to the heads a block computes: Ulysses' blocks hold H/cp heads). The links are not
   emulated: the times compare the compute schedules (Ulysses needs no zig-zag), the bytes the traffic.

Run: ``python benchmarks/cp_bench.py [--cp 2 4 --seq 1024 --step-seq 256 --repeats 5]`` (about a minute).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.estimates.accounting import ring_kv_bytes, ring_sends_per_layer
from course_lib.measure.memtrack import MemoryTracker
from course_lib.parallel import cp_attention as ca
from course_lib.parallel.cp_ulysses import ulysses_attention, ulysses_bytes_per_rank
from course_lib.runtime.launch import launch
from course_lib.viz.cp import lockstep_work

B, H, D = 1, 4, 32


def _qkv(seq: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, seq, D, generator=g) for _ in range(3)]


def full_attention_bytes(seq: int) -> int:
    q, k, v = (t.requires_grad_() for t in _qkv(seq))
    with MemoryTracker() as mt:
        out = ca.reference_attention(q, k, v, causal=True)
    del out
    return int(mt.category_peaks["activations"])


def ring_attention_bytes(rank: int, cp: int, seq: int) -> int:
    q, k, v = (ca.shard_sequence(t, rank, cp, "zigzag", dim=2).requires_grad_() for t in _qkv(seq))
    pos = ca.all_positions(seq, cp, "zigzag")
    with MemoryTracker() as mt:
        out = ca.ring_attention(q, k, v, pos, 2, True)
    del out
    return int(mt.category_peaks["activations"])


def ring_step_time(rank: int, cp: int, seq: int, layout: str, seconds_per_pair: float, repeats: int) -> float:
    q, k, v = (ca.shard_sequence(t, rank, cp, layout, dim=2).requires_grad_() for t in _qkv(seq))
    pos = ca.all_positions(seq, cp, layout)
    kernel = ca.EmulatedDeviceAttention(seconds_per_pair)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        out = ca.ring_attention(q, k, v, pos, ca.chunks_per_rank(layout), True, kernel=kernel)
        out.sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def ring_vs_ulysses(rank: int, cp: int, seq: int, seconds_per_pair: float, repeats: int) -> dict[str, tuple]:
    """(median step time, bytes sent by our own sends) of one causal attention layer, forward + backward."""
    q, k, v = (ca.shard_sequence(t, rank, cp, "zigzag", dim=2).requires_grad_() for t in _qkv(seq))
    pos = ca.all_positions(seq, cp, "zigzag")
    kernel = ca.EmulatedDeviceAttention(seconds_per_pair, n_head=H)
    out = {}
    for name, fn in (("ring", ca.ring_attention), ("ulysses", ulysses_attention)):
        times, sent = [], 0
        for i in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            with comm.recording() as log:
                fn(q, k, v, pos, 2, True, None, kernel).sum().backward()
            times.append(time.perf_counter() - t0)
            sent = sum(r.sent_bytes for r in log.records if r.op == "send") if i == 0 else sent
        out[name] = (statistics.median(times[1:]), sent)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq", type=int, default=1024, help="sequence length for the memory part")
    ap.add_argument("--step-seq", type=int, default=256, help="sequence length for the step-time part")
    ap.add_argument("--seconds-per-pair", type=float, default=4e-6)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()

    full = full_attention_bytes(a.seq)
    print(f"activation memory of one causal attention layer, b={B} h={H} d={D} s={a.seq}, fp32 (measured, tracker)")
    print(f"{'cp':>3} | {'full (1 rank)':>13} | {'ring per rank':>13} | {'ring x cp / full':>16} | goal: 1 +- 0.1")
    for cp in a.cp:
        per_rank = max(launch(ring_attention_bytes, cp, a.seq, timeout=120))
        ratio = per_rank * cp / full
        verdict = "PASS" if abs(ratio - 1) <= 0.1 else "MISS"
        print(f"{cp:>3} | {full:>13,} | {per_rank:>13,} | {ratio:>16.3f} | {verdict}")

    print(f"\nstep time (forward + backward) of causal ring attention, s={a.step_seq}, emulated device "
          f"({a.seconds_per_pair:g} s per visible pair, x2 in backward), median of {a.repeats}, slowest rank")
    print(f"{'cp':>3} | {'contiguous s':>12} | {'zig-zag s':>9} | {'measured ratio':>14} | {'modelled':>8} | goal < 1")
    for cp in a.cp:
        t = {layout: max(launch(ring_step_time, cp, a.step_seq, layout, a.seconds_per_pair, a.repeats,
                                timeout=300)) for layout in ca.LAYOUTS}
        ratio = t["zigzag"] / t["contiguous"]
        model = lockstep_work(a.step_seq, cp, "zigzag") / lockstep_work(a.step_seq, cp, "contiguous")
        print(f"{cp:>3} | {t['contiguous']:>12.3f} | {t['zigzag']:>9.3f} | {ratio:>14.3f} | {model:>8.3f} | "
              f"{'PASS' if ratio < 1 else 'MISS'}")

    print(f"\nring (zig-zag) vs Ulysses, one causal layer, s={a.step_seq}, H={H} heads (MHA), d={D}, fp32: bytes per "
          f"rank forward + backward (measured = formula?), step time on the emulated device")
    print(f"{'cp':>3} | {'ring B':>8} | {'Ulysses B':>9} | {'formulas':>8} | {'ring s':>7} | {'Ulysses s':>9} "
          "| bytes U/R")
    for cp in a.cp:
        res = launch(ring_vs_ulysses, cp, a.step_seq, a.seconds_per_pair, a.repeats, timeout=300)
        sends = ring_sends_per_layer(cp)
        ring_formula = sum(sends.values()) * ring_kv_bytes(a.step_seq, B, H, D, cp, 4)
        uly_formula = sum(ulysses_bytes_per_rank(a.step_seq, B, H, H, D, cp, 4).values())
        b_r, b_u = res[0]["ring"][1], res[0]["ulysses"][1]
        t_r, t_u = (max(r[n][0] for r in res) for n in ("ring", "ulysses"))
        ok = "PASS" if (b_r, b_u) == (ring_formula, uly_formula) else "MISS"
        print(f"{cp:>3} | {b_r:>8} | {b_u:>9} | {ok:>8} | {t_r:>7.3f} | {t_u:>9.3f} | {b_u / b_r:.2f}")


if __name__ == "__main__":
    main()
