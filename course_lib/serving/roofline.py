"""The roofline of a device, and what it says about prefill and decode.

Roofline model (Williams, Waterman & Patterson 2009): a kernel that does F FLOPs and moves B bytes takes at least

    time = max(F / peak_flops, B / mem_bandwidth)

Its arithmetic intensity I = F / B decides which term wins; the machine's **ridge point** is
I* = peak_flops / mem_bandwidth. For a decoder step over a batch of ``b`` tokens, the matrix multiplies do
2 FLOPs per weight per token and read every weight once (``bytes_per_param`` bytes each), so

    I(b) ~ 2 b / bytes_per_param       and the critical batch  b* = I* x bytes_per_param / 2

Decode (b = number of sequences, one token each) sits far left of the ridge: memory-bound, its time is the time
to stream the weights (+ the KV cache) and barely grows with b, so tokens/s grows ~linearly in b until b*.
Prefill (b = prompt tokens) sits right of it: compute-bound. H100 SXM bf16: 989e12 / 3.35e12 = 295 FLOP/byte,
b* ~ 295 tokens.

:class:`StepCost` turns this into the simulated clock's cost of a scheduler step; :func:`measure_bandwidth`,
:func:`measure_flops` and :func:`decode_throughput` are micro-benchmarks of the machine the notebook runs on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from course_lib import hardware
from course_lib.memory import kv_cache_bytes
from course_lib.model import PRESETS, GPTConfig, param_count


def ridge_point(peak_flops: float, mem_bandwidth: float) -> float:
    """I* = peak / bandwidth, FLOP per byte: kernels below it are memory-bound."""
    return peak_flops / mem_bandwidth


def critical_batch(peak_flops: float, mem_bandwidth: float, bytes_per_param: float = 2) -> float:
    """Tokens per step at which a weight-streaming step turns compute-bound: I* x bytes_per_param / 2."""
    return ridge_point(peak_flops, mem_bandwidth) * bytes_per_param / 2


@dataclass(frozen=True)
class StepWork:
    """What one engine step did: ``new_tokens`` fed, ``attended`` (query, key) pairs, ``cached_tokens`` read."""

    new_tokens: int
    attended: int
    cached_tokens: int
    n_seqs: int


@dataclass(frozen=True)
class StepCost:
    """Roofline time of a step: ``overhead_s + max(FLOPs / peak_flops, bytes / mem_bandwidth)``, with

    FLOPs = 2 N new_tokens + 4 L h attended (Kaplan et al. 2020's 2N per token; QK^T and AV),
    bytes = weight_bytes + kv_bytes_per_token x (cached_tokens + new_tokens) (weights and the KV cache read once).
    """

    n_params: float
    weight_bytes: float
    kv_bytes_per_token: float
    n_layer: int
    d_model: int
    peak_flops: float
    mem_bandwidth: float
    overhead_s: float = 0.0
    label: str = ""

    @classmethod
    def for_model(cls, config: GPTConfig | str, gpu: str = "H100 80GB", bytes_per_param: float = 2,
                  overhead_s: float = 0.0) -> StepCost:
        """The cost of ``config`` (a preset name or a config) on ``gpu`` (a key of ``hardware.GPUS``)."""
        c = PRESETS[config] if isinstance(config, str) else config
        card = hardware.gpu(gpu)
        n = param_count(c)
        return cls(n, n * bytes_per_param, kv_cache_bytes(c, 1, kv_bytes=bytes_per_param), c.n_layer, c.d_model,
                   card.peak_flops, card.mem_bandwidth, overhead_s, f"{c.name} on {card.name}")

    def flops(self, w: StepWork) -> float:
        return 2 * self.n_params * w.new_tokens + 4 * self.n_layer * self.d_model * w.attended

    def bytes(self, w: StepWork) -> float:
        return self.weight_bytes + self.kv_bytes_per_token * (w.cached_tokens + w.new_tokens)

    def __call__(self, w: StepWork) -> float:
        return self.overhead_s + max(self.flops(w) / self.peak_flops, self.bytes(w) / self.mem_bandwidth)


# ----------------------------------------------------------------------------------------------------------------
# Micro-benchmarks of this machine (medians of repeats; wall-clock)


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_bandwidth(n_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Memory bandwidth, bytes/s: a copy of ``n_bytes`` reads and writes each byte once (2 x n_bytes moved)."""
    src = torch.empty(n_bytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return 2 * n_bytes / _median_time(lambda: dst.copy_(src), repeats)


def measure_flops(n: int = 1024, repeats: int = 5) -> float:
    """Matmul throughput, FLOP/s: an n x n x n fp32 matmul does 2 n^3 FLOPs."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _median_time(lambda: a @ b, repeats)


def decode_throughput(batches: Sequence[int], d_model: int = 1024, n_layer: int = 4,
                      repeats: int = 5) -> list[float]:
    """Tokens/s of a decode-like step (``n_layer`` square fp32 weight matrices, one token per sequence) at each
    batch size: the weights are read once per step whatever the batch, so tokens/s grows with the batch until
    the step turns compute-bound."""
    weights = [torch.randn(d_model, d_model) / d_model**0.5 for _ in range(n_layer)]

    def step(x: torch.Tensor) -> torch.Tensor:
        for w in weights:
            x = x @ w
        return x

    return [b / _median_time(lambda b=b: step(torch.randn(b, d_model)), repeats) for b in batches]
