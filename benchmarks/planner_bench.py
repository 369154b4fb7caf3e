"""The planner against published runs and against itself, side by side in one run.

1. Megatron-LM's H100 weak-scaling table (Megatron-Core r0.8, 1.7B to 462B): for each row, the published TP x PP
   and MFU next to the planner's pick with DP fixed at 48 as in the study, and where the published mesh ranks when
   the planner is left free. Goals: TP and PP equal for most rows; predicted MFU within 10 points for most rows;
   the published mesh in the top 3 when free.
2. The 512-GPU Llama-3 70B, 32K-token example (TP 8, PP 4, CP 4, DP 4): its place among the meshes that fit.
3. The same 16 GPUs with DGX (NVLink + InfiniBand) and with PCIe + Ethernet links: the best mesh of each, and the
   ratio of their predicted step times.
4. How long planning takes (enumerate, prune by memory, rank): seconds per plan.

    python benchmarks/planner_bench.py        # about 20 s on a laptop core

Not a test: the golden checks live in tests/test_planner.py; this prints the whole picture with its numbers.
"""

from __future__ import annotations

import time

from course_lib import planner as P


def main() -> None:
    t0 = time.perf_counter()
    rows = P.check_megatron()
    t_megatron = time.perf_counter() - t0
    print("1. Megatron-LM weak scaling on H100, seq 2048 (published vs planner, DP fixed at 48)")
    print(f"{'model':>6} {'GPUs':>5} | {'TPxPP pub':>9} {'planner':>8} {'same':>5} | {'MFU pub':>7} {'pred':>6} "
          f"{'gap':>6} | {'free place':>10}")
    same = close = top3 = 0
    for r in rows:
        c = r.pinned.candidate
        ok = (c.tp, c.pp) == (r.tp, r.pp)
        gap = r.pinned.mfu - r.mfu
        same, close, top3 = same + ok, close + (abs(gap) <= 0.10), top3 + (r.free_place is not None
                                                                            and r.free_place <= 3)
        print(f"{r.name:>6} {r.gpus:>5} | {f'{r.tp}x{r.pp}':>9} {f'{c.tp}x{c.pp}':>8} {'yes' if ok else 'no':>5} | "
              f"{r.mfu:>7.2f} {r.pinned.mfu:>6.2f} {gap:>+6.2f} | {r.free_place!s:>10}")
    n = len(rows)
    print(f"TP x PP equal: {same}/{n}; MFU within 10 points: {close}/{n}; published mesh in the free top 3: "
          f"{top3}/{n}  ({t_megatron / (2 * n):.2f} s per plan)")

    t0 = time.perf_counter()
    res = P.plan("llama3-70b", P.cluster("dgx-h100", 64), 64, 32768, zero_stages=(1,),
                 recomputes=("selective", "full"), micro_batches=(1,))
    t_big = time.perf_counter() - t0
    meshes = [(q.candidate.tp, q.candidate.pp, q.candidate.cp, q.candidate.dp) for q in res.ranked]
    place = meshes.index((8, 4, 4, 4)) + 1 if (8, 4, 4, 4) in meshes else None
    best = res.ranked[0]
    print(f"\n2. Llama-3 70B, 32K tokens, 512 H100, global batch 64: TP 8 x PP 4 x CP 4 x DP 4 is {place} of "
          f"{len(res.ranked)} fitting meshes ({res.rejected_memory} of {res.considered} rejected by memory; "
          f"{t_big:.2f} s). Best: TP {best.candidate.tp} PP {best.candidate.pp} CP {best.candidate.cp} "
          f"DP {best.candidate.dp}, predicted MFU {best.mfu:.2f}; the example's predicted step / best's = "
          f"{res.ranked[place - 1].step_s / best.step_s:.3f}" if place else "")

    print("\n3. Llama-2 7B, seq 4096, global batch 64, 16 GPUs, two kinds of links")
    picks = {}
    for name in ("dgx-h100", "pcie-h100-ethernet"):
        p = P.plan("llama2-7b", P.cluster(name, 2), 64, 4096).ranked[0]
        picks[name] = p
        c = p.candidate
        print(f"{name:>20}: DP {c.dp} TP {c.tp} PP {c.pp} CP {c.cp} ZeRO-{c.zero} mb {c.micro_batch}: "
              f"{p.step_s:.2f} s/step, MFU {p.mfu:.2f}")
    ratio = picks["pcie-h100-ethernet"].step_s / picks["dgx-h100"].step_s
    differ = (picks["dgx-h100"].candidate.dp, picks["dgx-h100"].candidate.pp) != (
        picks["pcie-h100-ethernet"].candidate.dp, picks["pcie-h100-ethernet"].candidate.pp)
    print(f"slow links / fast links, predicted step time: {ratio:.2f}; different meshes: {differ}")


if __name__ == "__main__":
    main()
