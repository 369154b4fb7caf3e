"""Stage balancing for pipeline parallelism: how many blocks each stage holds, from measured costs.

Equal layer counts are not equal stages: stage 0 also embeds and the last stage runs the head and
the loss (with a 256-token vocabulary and tiny blocks the head is a big share). ``balance_stages``
returns the contiguous split minimizing the slowest stage from per-layer costs, ideally measured
(``measure_layer_costs``), optionally under a memory limit per stage: balance from measurements, not
from layer counts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from course_lib.data import global_batch
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel.pp_layers import stage_layers


def stage_costs(costs: Sequence[float], split: Sequence[int], first_extra: float = 0.0,
                last_extra: float = 0.0) -> list[float]:
    """The cost of each stage of ``split`` (blocks per stage): its blocks' costs, plus
    ``first_extra`` (embedding) on the first stage and ``last_extra`` (final norm, head, loss) on
    the last."""
    if sum(split) != len(costs):
        raise ValueError(f"split {list(split)} covers {sum(split)} layers, costs has {len(costs)}")
    out = [float(sum(costs[r.start:r.stop])) for r in stage_layers(list(split))]
    out[0] += first_extra
    out[-1] += last_extra
    return out


def balance_stages(costs: Sequence[float], n_stages: int, first_extra: float = 0.0,
                   last_extra: float = 0.0, memory: Sequence[float] | None = None,
                   memory_limit: float | None = None) -> list[int]:
    """The contiguous split of the layers into ``n_stages`` stages (>= 1 layer each) that minimizes
    the slowest stage's cost (the pipeline's clock: every step of the schedule waits for it).

    ``costs[i]``: layer i's cost (e.g. measured forward + backward seconds,
    ``measure_layer_costs``); the first stage also pays ``first_extra`` and the last ``last_extra``.
    With ``memory`` (per layer) and ``memory_limit``, only splits whose every stage fits are
    allowed. Exact (dynamic programming over split points, O(n_stages L^2)). Among equally good
    splits it returns the one with the earliest cuts.
    """
    n = len(costs)
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages must be a positive integer, got {n_stages!r}")
    if n_stages > n:
        raise ValueError(f"cannot cut {n} layers into {n_stages} stages of at least one layer each")
    if any(c < 0 for c in costs):
        raise ValueError(f"costs must be >= 0, got {list(costs)}")
    if (memory is None) != (memory_limit is None):
        raise ValueError("give both memory (per layer) and memory_limit, or neither")
    if memory is not None and len(memory) != n:
        raise ValueError(f"memory needs one value per layer ({n}), got {len(memory)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    mprefix = [0.0]
    for mem in memory or []:
        mprefix.append(mprefix[-1] + mem)
    inf = float("inf")

    def segment(k: int, i: int, j: int) -> float:  # stage k (0-based) = layers i..j-1
        if memory_limit is not None and mprefix[j] - mprefix[i] > memory_limit:
            return inf
        return (prefix[j] - prefix[i] + (first_extra if k == 0 else 0.0)
                + (last_extra if k == n_stages - 1 else 0.0))

    # best[k][j]: least max stage cost of layers 0..j-1 in stages 0..k; cut[k][j]: stage k's start
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = segment(0, 0, j)
    for k in range(1, n_stages):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                value = max(best[k - 1][i], segment(k, i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[n_stages - 1][n] == inf:
        raise ValueError(f"no split into {n_stages} stages keeps every stage within "
                         f"memory_limit={memory_limit}")
    bounds, j = [n], n
    for k in range(n_stages - 1, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [bounds[k + 1] - bounds[k] for k in range(n_stages)]


@dataclass(frozen=True)
class LayerCosts:
    """Measured forward + backward seconds (median over repeats) of the embedding, each block, and
    the final norm + head + loss, on this process: the inputs of ``balance_stages``."""

    embed: float
    blocks: list[float]
    head: float

    def balance(self, n_stages: int) -> list[int]:
        return balance_stages(self.blocks, n_stages, first_extra=self.embed, last_extra=self.head)


def measure_layer_costs(cfg: GPTConfig, micro_batch: int = 2, repeats: int = 5,
                        seed: int = 0) -> LayerCosts:
    """Time each piece of ``GPT(cfg)`` on a micro-batch: forward, then backward piece by piece (each
    piece's input detached, so its backward is timed alone). Run it where the stages will run (same
    threads, same device)."""
    model = GPT(cfg, seed=seed)
    x, y = global_batch(0, micro_batch, cfg.seq_len, seed)
    samples: list[list[float]] = [[] for _ in range(cfg.n_layer + 2)]
    for rep in range(repeats + 1):  # the first pass warms up
        pieces, times, h = [], [], None
        t = time.perf_counter()
        out = model.embed(x)
        times.append(time.perf_counter() - t)
        pieces.append((None, out))
        for block in model.blocks:
            h = out.detach().requires_grad_(True)
            t = time.perf_counter()
            out = block(h)
            times.append(time.perf_counter() - t)
            pieces.append((h, out))
        h = out.detach().requires_grad_(True)
        t = time.perf_counter()
        loss = lm_loss(model.head(h), y)
        times.append(time.perf_counter() - t)
        pieces.append((h, loss))
        grad = None
        for i in range(len(pieces) - 1, -1, -1):
            inp, out = pieces[i]
            t = time.perf_counter()
            out.backward(grad)
            times[i] += time.perf_counter() - t
            grad = inp.grad if inp is not None else None
        if rep > 0:
            for i, ti in enumerate(times):
                samples[i].append(ti)
    med = [statistics.median(s) for s in samples]
    return LayerCosts(med[0], med[1:-1], med[-1])
