"""How long does it take to start ranks? Cold (first launch: starts the forkserver, imports torch) and warm
(every later launch) round trips of ``course_lib.runtime.launch``, measured side by side in one run.

Targets on a 2-core laptop: warm round trip of 4 ranks <= 0.3 s, cold <= 8 s. Run: ``python benchmarks/launch_bench.py``
(the cold figure is only cold in a fresh interpreter, as here).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from course_lib.runtime.launch import launch

WARM_TARGET_S, COLD_TARGET_S = 0.3, 8.0


def _all_reduce_once(rank: int, world_size: int) -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def main(world_size: int = 4, repeats: int = 20) -> None:
    start = time.perf_counter()
    launch(_all_reduce_once, world_size)
    cold = time.perf_counter() - start
    warm = []
    for _ in range(repeats):
        start = time.perf_counter()
        launch(_all_reduce_once, world_size)
        warm.append(time.perf_counter() - start)
    med = statistics.median(warm)
    print(f"launch of {world_size} ranks (one all_reduce each), {repeats} warm repeats")
    print(f"  cold round trip   : {cold:6.2f} s   target <= {COLD_TARGET_S} s   ratio {cold / COLD_TARGET_S:.2f}")
    print(f"  warm round trip   : {med:6.3f} s   target <= {WARM_TARGET_S} s   ratio {med / WARM_TARGET_S:.2f}"
          f"   (min {min(warm):.3f}, max {max(warm):.3f})")
    print(f"  cold / warm       : {cold / med:6.1f} x")


if __name__ == "__main__":
    main()
