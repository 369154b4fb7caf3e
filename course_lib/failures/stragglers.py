"""Stragglers: the rank that makes everyone wait, found from per-rank step times.

In synchronous data parallelism every step ends in a collective (the gradient all-reduce) that no rank can leave
before the last one arrives. A slow rank (a throttled GPU, a noisy neighbour, a bad link) therefore shows twice:
its compute time is the longest, and its wait inside the collective the shortest -- everyone else's wait is its
extra compute. Per step and rank r, with c_r the compute time and w_r the time in the all-reduce::

    w_r ~ max_q c_q - c_r + transfer          (the last to arrive waits only for the transfer)

``find_straggler`` names the rank that waits least (median over steps), if every other rank waits for it by more
than a threshold, with its numbers. ``measure_step_times`` runs data-parallel steps on the emulated device
(``instrument.EmulatedDeviceGPT``: compute is a calibrated sleep, so ranks run side by side on 2 cores) with one
rank's device made ``slow`` times slower, and records c and w per step and rank. At scale the same reading is
done from a profiler's per-rank traces (PyTorch's Flight Recorder for collectives, NCCL's per-rank timings) or
the "straggler detection" of NVIDIA's Resiliency Extension.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib.data import global_batch, shard
from course_lib.measure.instrument import EmulatedDeviceGPT
from course_lib.model import lm_loss
from course_lib.model_config import GPTConfig

STRAGGLER_CONFIG = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, bias=False)


@dataclass(frozen=True)
class StepTimes:
    """``compute[s][r]`` and ``wait[s][r]`` (seconds) of step s on rank r."""

    compute: list[list[float]]
    wait: list[list[float]]

    def __post_init__(self) -> None:
        shapes = {len(row) for row in self.compute + self.wait}
        if len(self.compute) != len(self.wait) or not self.compute or len(shapes) != 1:
            raise ValueError(f"compute and wait must be equal, non-empty [steps][ranks] tables, got "
                             f"{len(self.compute)} and {len(self.wait)} steps with row lengths {sorted(shapes)}")


@dataclass(frozen=True)
class Straggler:
    """The rank everyone waited for: last to arrive in ``share`` of the steps; median waits (s) of it and of the
    others, and its median compute time over the others'."""

    rank: int
    share: float
    its_wait_s: float
    others_wait_s: float
    slowdown: float

    def __str__(self) -> str:
        return (f"rank {self.rank} is the straggler: last into the all-reduce in {self.share:.0%} of the steps; "
                f"it waits {self.its_wait_s * 1e3:.0f} ms there, the others {self.others_wait_s * 1e3:.0f} ms; "
                f"its compute takes {self.slowdown:.2f}x theirs")


def find_straggler(times: StepTimes, min_wait_share: float = 0.2) -> Straggler | None:
    """The straggler, or None: the rank with the smallest median wait (the one that arrives last), if every other
    rank's median wait exceeds its own by ``min_wait_share`` x the median compute time. Medians, so that one step
    in which another rank was descheduled does not decide."""
    compute, wait = torch.tensor(times.compute), torch.tensor(times.wait)
    world = compute.shape[1]
    if world < 2:
        raise ValueError("a straggler needs at least 2 ranks to wait for it")
    medians = wait.median(dim=0).values
    rank = int(medians.argmin())
    others = [q for q in range(world) if q != rank]
    its, theirs = float(medians[rank]), float(medians[others].min())
    if theirs - its < min_wait_share * float(compute.median()):
        return None
    share = float((wait.argmin(dim=1) == rank).double().mean())
    slowdown = float(compute[:, rank].median() / compute[:, others].median())
    return Straggler(rank, share, its, float(medians[others].median()), slowdown)


def measure_step_times(rank: int, world_size: int, steps: int = 6, slow_rank: int | None = None, slow: float = 1.5,
                       compute_s: float = 0.04, batch: int = 4) -> StepTimes:
    """Per rank: ``steps`` data-parallel steps on the emulated device, each forward + backward costing
    ``compute_s`` seconds of device time (``slow`` x that on ``slow_rank``), then one all-reduce of all gradients,
    after one step not recorded (the first pays for allocations and gloo's first connection). Returns every
    rank's times (gathered), the same on each rank."""
    if slow_rank is not None and not 0 <= slow_rank < world_size:
        raise ValueError(f"rank {rank}: slow_rank={slow_rank} is not a rank of {world_size}; "
                         f"choose 0..{world_size - 1}")
    cfg = STRAGGLER_CONFIG
    tokens = batch * cfg.seq_len
    probe = EmulatedDeviceGPT(cfg, flops_per_s=1.0)
    device_params = sum(p.numel() for p in probe.parameters()) - probe.tok_emb.weight.numel()
    device_params -= probe.pos_emb.weight.numel() if probe.pos_emb is not None else 0
    flops = 6 * device_params * tokens / compute_s  # forward 2x + backward 4x parameters x tokens
    model = EmulatedDeviceGPT(cfg, flops_per_s=flops / (slow if rank == slow_rank else 1.0))
    compute, wait = [], []
    for step in range(steps + 1):
        x, y = global_batch(step, batch * world_size, cfg.seq_len)
        t0 = time.perf_counter()
        lm_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        t1 = time.perf_counter()
        dist.all_reduce(flat)
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if step:
            compute.append(t1 - t0)
            wait.append(t2 - t1)
    rows: list[tuple[list[float], list[float]] | None] = [None] * world_size
    dist.all_gather_object(rows, (compute, wait))
    return StepTimes([[rows[r][0][s] for r in range(world_size)] for s in range(steps)],
                     [[rows[r][1][s] for r in range(world_size)] for s in range(steps)])
