"""The course's mesh checkpoint against PyTorch's Distributed Checkpoint (DCP), measured side by side in the same
ranks on the same model and data-parallel mesh (``course_lib.failures.checkpoint_cost``): bytes each rank writes against
the formula B = 12 P (fp32 weights + AdamW's m and v), save and load time, and DCP's ``async_save`` (the time
training blocks vs until the write is done), as ratios. Times are medians over ``--repeats`` runs, each into a
fresh folder; CPU gloo on a laptop disk, so they say how the two spread the work, not what a parallel file system
does.

Run: ``python benchmarks/checkpoint_bench.py [--world-size 2 --d-model 128 --n-layer 4 --repeats 3]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from course_lib.failures.checkpoint_cost import checkpoint_bytes, measure_checkpoint_cost
from course_lib.model import GPT, num_params
from course_lib.model_config import GPTConfig
from course_lib.runtime.launch import launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    cfg = GPTConfig(d_model=a.d_model, n_layer=a.n_layer, bias=False)
    params = num_params(GPT(cfg))
    runs = []
    for _ in range(a.repeats):
        with tempfile.TemporaryDirectory() as d:
            runs.append(launch(measure_checkpoint_cost, a.world_size, d, cfg, timeout=600))
    first = runs[0]

    def med(field: str) -> float:  # the slowest rank's time (barriers around each), median over repeats
        return statistics.median(max(getattr(c, field) for c in run) for run in runs)

    print(f"model: {params:,} parameters, formula B = 12 P = {checkpoint_bytes(params):,} bytes; "
          f"{a.world_size} data-parallel ranks")
    print("bytes written per rank (measured file sizes):")
    for r, c in enumerate(first):
        print(f"  rank {r}: ours {c.ours_bytes:>12,}   DCP {c.dcp_bytes:>12,}")
    print(f"  total / B: ours {sum(c.ours_bytes for c in first) / checkpoint_bytes(params):.3f}, "
          f"DCP {sum(c.dcp_bytes for c in first) / checkpoint_bytes(params):.3f}")
    print(f"{'':24}{'ours':>10}{'DCP':>10}{'DCP / ours':>12}")
    for what in ("save", "load"):
        o, d = med(f"ours_{what}_s"), med(f"dcp_{what}_s")
        print(f"{what + ' (s)':24}{o:>10.3f}{d:>10.3f}{d / o:>12.2f}")
    block, total = med("dcp_async_block_s"), med("dcp_async_total_s")
    print(f"DCP async_save: blocks {block:.3f} s, done after {total:.3f} s (blocking / sync save = "
          f"{block / med('dcp_save_s'):.2f})")
    print(f"same tensors after DCP's load and ours: {all(c.same_tensors for run in runs for c in run)}")


if __name__ == "__main__":
    main()
