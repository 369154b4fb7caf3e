"""What do chapter 11's instruments cost? Measured side by side in one run, on 2 ranks:

* the flight recorder: the time per ``comm.all_reduce`` of a small tensor with and without it (the difference is
  the recording: a stack walk and an entry per call);
* a replica checksum: ``fingerprint`` of every parameter of the course's GPT, against one training step of it.

Run: ``python benchmarks/debug_bench.py``. Medians over repeats; on 2 shared cores the figures vary with the load.
"""

from __future__ import annotations

import statistics
import time

import torch

from course_lib import comm
from course_lib.debug.checksums import fingerprint
from course_lib.debug.recorder import FlightRecorder
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.runtime.launch import launch

CALLS = 400


def _per_call(rank: int, world_size: int, recorded: bool) -> float:
    torch.set_num_threads(1)
    t = torch.ones(16)
    recorder = FlightRecorder(CALLS)
    with recorder.recording() if recorded else comm.recording():
        start = time.perf_counter()
        for _ in range(CALLS):
            comm.all_reduce(t)
        return (time.perf_counter() - start) / CALLS


def main(repeats: int = 5) -> None:
    launch(_per_call, 2, False)  # start the forkserver
    plain = statistics.median(max(launch(_per_call, 2, False)) for _ in range(repeats))
    recorded = statistics.median(max(launch(_per_call, 2, True)) for _ in range(repeats))
    print(f"all_reduce of 16 floats on 2 ranks, {CALLS} calls, median of {repeats} launches")
    print(f"  without the recorder : {plain * 1e6:8.1f} us per call")
    print(f"  with the recorder    : {recorded * 1e6:8.1f} us per call   (+{(recorded - plain) * 1e6:.1f} us)")
    torch.set_num_threads(1)
    model = GPT(GPTConfig())
    x = torch.randint(0, 256, (8, 32))
    checks, steps = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        [fingerprint(p) for p in model.parameters()]
        checks.append(time.perf_counter() - start)
        start = time.perf_counter()
        lm_loss(model(x), x).backward()
        steps.append(time.perf_counter() - start)
    n = sum(p.numel() for p in model.parameters())
    print(f"fingerprints of the GPT's {len(list(model.parameters()))} tensors ({n:,} parameters):"
          f" {statistics.median(checks) * 1e3:.1f} ms, one forward + backward of 8 x 32 tokens:"
          f" {statistics.median(steps) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
