"""The planner against published runs and against itself, side by side in one run.

1. Every published run of ``course_lib.planner.published`` (Megatron-LM's H100 weak-scaling table at sequence
   4096, MT-NLG 530B, BLOOM 176B, OPT-175B, Llama 3 405B at 8K and 128K, DeepSeek-V3, and NVIDIA's NeMo
   AutoModel rows for Qwen3-30B-A3B and Kimi K2): the published mesh and MFU, the planner's MFU for that mesh, the
   gap, and the place of the published mesh among the planner's distinct meshes (only what the study fixed held
   fixed), with the time of the free plan (wall clock and this process's CPU time: on a shared machine the
   second is the steadier), fresh caches for each run.
2. The same 16 GPUs with DGX (NVLink + InfiniBand) and with PCIe + Ethernet links: the best mesh of each, and the
   ratio of their predicted step times.

    python benchmarks/planner_bench.py        # about a minute on a laptop core

Not a test: the checks live in tests/test_planner_published.py; this prints the whole picture with its numbers.
"""

from __future__ import annotations

import time

from course_lib.planner import memory as planner_memory
from course_lib.planner import published as PP
from course_lib.planner import search as P


def main() -> None:
    print("1. Published runs (MFU as each source counts it; place among distinct meshes, best first)")
    print(f"{'run':>20} {'GPUs':>6} | {'published mesh':>26} | {'MFU pub':>7} {'pred':>5} {'gap':>6} | "
          f"{'place':>5} | {'plan s':>6} {'cpu s':>6} {'meshes':>6}")
    close = top5 = 0
    runs = PP.published_runs()
    for run in runs:
        planner_memory.clear_caches()
        cl = P.cluster(run.cluster, run.nodes)
        t0, c0 = time.perf_counter(), time.process_time()
        free = P.plan(run.cfg, cl, run.global_batch, run.seq_len, assume=run.assume, fixed=run.study_fixed,
                      **run.space)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        c = PP.check(run)
        mesh = " ".join(f"{k}{v}" for k, v in run.mesh.items() if v > 1)
        close += abs(c.gap) <= 0.10
        top5 += (c.free_place or 99) <= 5
        print(f"{run.name:>20} {run.nodes * P.CLUSTERS[run.cluster].gpus_per_node:>6} | {mesh:>26} | "
              f"{run.mfu:>7.2f} {c.predicted_mfu:>5.2f} {c.gap:>+6.2f} | {c.free_place!s:>5} | {wall:>6.2f} "
              f"{cpu:>6.2f} {free.considered:>6}")
    print(f"MFU within 10 points: {close}/{len(runs)}; published mesh in the top 5: {top5}/{len(runs)}")

    print("\n2. Llama-2 7B, seq 4096, global batch 64, 16 GPUs, two kinds of links")
    picks = {}
    for name in ("dgx-h100", "pcie-h100-ethernet"):
        t0 = time.perf_counter()
        p = P.plan("llama2-7b", P.cluster(name, 2), 64, 4096).best()
        picks[name] = p
        print(f"{name:>20}: {p.candidate}: {p.step_s:.2f} s/step, MFU {p.mfu:.2f} "
              f"({time.perf_counter() - t0:.2f} s to plan)")
    ratio = picks["pcie-h100-ethernet"].step_s / picks["dgx-h100"].step_s
    print(f"slow links / fast links, predicted step time: {ratio:.2f}")


if __name__ == "__main__":
    main()
