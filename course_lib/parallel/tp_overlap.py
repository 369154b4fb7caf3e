"""Overlapping tensor-parallel communication with compute: the collective matmul.

Under sequence parallelism a column-parallel GEMM needs the all-gathered input,
``Y_r = AllGather(x) W_r^T``, and waits for all of it. But the all-gather is a ring of t - 1 steps
that each pass one s/t shard, and the GEMM splits by rows into t partial GEMMs
(``Y_r[shard j] = x_j W_r^T``): at step i a rank multiplies shard (r - i) mod t while passing it on.
Same bytes, (t - 1)/t x V per rank (our send/recv: measured), in another order: the collective
matmul (Wang et al. 2023, ASPLOS '23) of Megatron-LM's ``--tp-comm-overlap`` and torchtitan's async
TP; the row-parallel GEMM's reduce-scatter decomposes alike, in reverse.

With c the time of one partial GEMM (1/t of the GEMM) and m of one ring step::

    sequential   (t - 1) m + t c            exposed communication  (t - 1) m
    overlapped   (t - 1) max(c, m) + c      exposed communication  (t - 1) max(0, m - c)

The transfer hides once c >= m. Per shard of n tokens c = 2 n h (o/t) / F and m = n h e / B (F
FLOP/s, B link bytes/s, o output features, e bytes per element), i.e. once o / t >= e F / (2 B)
(``hide_threshold_features``): high t shrinks the local GEMMs below it. The timing is emulated
(``EmulatedCost``) to follow the schedule, not the OS. Chapter 04 measures it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import comm
from course_lib.parallel.cp_attention import ring_peers, ring_shift
from course_lib.parallel.tp_comm import SEQ_DIM, SequenceParallelLinears

__all__ = ["CollectiveMatmul", "EmulatedCost", "collective_matmul", "exposed_comm_seconds",
           "hide_threshold_features", "measure_exposed_comm", "ring_source"]


@dataclass(frozen=True)
class EmulatedCost:
    """An emulated device: ``gemm_s`` seconds per partial GEMM (one shard's), ``step_s`` per ring
    step (one shard's transfer, from issue to completion). Sleeps cost no CPU; the real GEMMs and
    sends still run."""

    gemm_s: float
    step_s: float


def exposed_comm_seconds(t: int, gemm_s: float, step_s: float, overlap: bool) -> float:
    """Exposed communication of one collective matmul: (t-1) m sequential, (t-1) max(0, m - c)
    overlapped."""
    return (t - 1) * (max(0.0, step_s - gemm_s) if overlap else step_s)


def hide_threshold_features(element_bytes: float, flops: float, link_bytes_per_s: float) -> float:
    """The local output width o/t above which a partial GEMM hides one ring step: e F / (2 B)."""
    return element_bytes * flops / (2 * link_bytes_per_s)


def ring_source(rank: int, step: int, t: int) -> int:
    """The shard rank ``rank`` holds at ring step ``step``: its own at 0, then the previous rank's,
    ...: (r - i) mod t (a public seam: the partial GEMM's output rows go where this says)."""
    return (rank - step) % t


def _ring_matmul(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                 biases: tuple[torch.Tensor | None, ...], group: comm.Group, overlap: bool,
                 cost: EmulatedCost | None) -> tuple[torch.Tensor, ...]:
    r, t, nxt, prv = ring_peers(group)
    parts: list[list[torch.Tensor | None]] = [[None] * t for _ in weights]

    def gemm(shard: torch.Tensor, src: int) -> None:
        for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
            parts[i][src] = F.linear(shard, w, b)
        if cost is not None:
            time.sleep(cost.gemm_s)

    def finish(works: list, issued: float) -> None:
        for w in works:
            w.wait()
        if cost is not None:  # the emulated link: no earlier than step_s after the step was issued
            time.sleep(max(0.0, cost.step_s - (time.perf_counter() - issued)))

    held = x.contiguous()
    if overlap:  # step i: multiply shard (r - i) mod t while it travels on
        for i in range(t):
            if i < t - 1:
                issued = time.perf_counter()
                incoming, works = ring_shift(held, nxt, prv, group)
            gemm(held, ring_source(r, i, t))
            if i < t - 1:
                finish(works, issued)
                held = incoming
    else:  # the all-gather's ring first, then the t partial GEMMs
        shards = {r: held}
        for i in range(t - 1):
            issued = time.perf_counter()
            incoming, works = ring_shift(held, nxt, prv, group)
            finish(works, issued)
            held = shards[ring_source(r, i + 1, t)] = incoming
        for src in range(t):
            gemm(shards[src], src)
    return tuple(torch.cat(p, dim=SEQ_DIM) for p in parts)


class CollectiveMatmul(SequenceParallelLinears):
    """``Y_j = AllGather(x) W_j^T + b_j`` by t partial GEMMs around a ring (overlapped or not); the
    backward is ``SequenceParallelLinears``' (re-gather overlapped with the input-gradient GEMMs,
    then reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group, overlap: bool,
                cost: EmulatedCost | None,
                *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.has_bias, ctx.n_args = group, [b is not None for b in biases], 4
        ctx.save_for_backward(x, *weights)
        return _ring_matmul(x, weights, biases, group, overlap, cost)


def collective_matmul(x: torch.Tensor, linears: list[tuple[torch.Tensor, torch.Tensor | None]],
                      group: comm.Group = None, overlap: bool = True,
                      cost: EmulatedCost | None = None) -> tuple[torch.Tensor, ...]:
    """The column-parallel GEMMs of ``linears`` on the all-gathered sequence shards ``x`` [b, s/t,
    h], the all-gather decomposed into ring steps overlapped with partial GEMMs (``overlap=False``:
    gather, then multiply). Autograd-capable; equal to ``tp_comm.sequence_parallel_linears``."""
    if dist.get_world_size(group) == 1:
        return tuple(F.linear(x, w, b) for w, b in linears)
    return CollectiveMatmul.apply(x, group, overlap, cost, *(p for wb in linears for p in wb))


def measure_exposed_comm(rank: int, world_size: int, cost: EmulatedCost, *, tokens: int = 64,
                         d_in: int = 64, d_out: int = 64, repeats: int = 5) -> dict[str, float]:
    """A ``launch`` target: the median exposed communication (wall time minus the t emulated partial
    GEMMs) of one forward collective matmul, sequential and overlapped, on the emulated device
    (after one untimed call)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, tokens // world_size, d_in, generator=g)
    w = torch.randn(d_out // world_size, d_in, generator=g)
    with torch.no_grad():  # warm-up, not timed: the first send to each peer sets up its connection
        collective_matmul(x, [(w, None)], None, True, EmulatedCost(0.0, 0.0))
    out = {}
    for overlap in (False, True):
        exposed = []
        for _ in range(repeats):
            comm.barrier()
            start = time.perf_counter()
            with torch.no_grad():
                collective_matmul(x, [(w, None)], None, overlap, cost)
            exposed.append(time.perf_counter() - start - world_size * cost.gemm_s)
        out["overlapped" if overlap else "sequential"] = statistics.median(exposed)
    return out
