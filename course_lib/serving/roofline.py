"""The roofline of a device, and what it says about prefill and decode.

Roofline model (Williams, Waterman & Patterson 2009): a kernel that does F FLOPs and moves B bytes takes at least

    time = max(F / peak_flops, B / mem_bandwidth)

Its arithmetic intensity I = F / B decides which term wins; the machine's **ridge point** is
I* = peak_flops / mem_bandwidth. For a decoder step over a batch of ``b`` tokens, the matrix multiplies do
2 FLOPs per weight per token and read every weight once (``bytes_per_param`` bytes each), so

    I(b) ~ 2 b / bytes_per_param       and the critical batch  b* = I* x bytes_per_param / 2

That critical batch applies to the **weights** only. Each sequence of a decode batch also reads its own KV
cache, every step, and that read is not shared: per token, a decode step at batch b and context c moves

    bytes per token = weight_bytes / b + kv_bytes_per_token x c          (Pope et al. 2022, Sec. 2)

so the weights' share falls as 1/b but the cache's does not. Attention over the cache does 4 h FLOPs per layer
and cached position for 2 n_kv d_head x bytes_per_elem bytes, an intensity of 2 n_head / (n_kv x bytes) FLOP/byte
(1 for multi-head attention in bf16, 8 with 8-way grouped-query attention): a constant of the model, not of the
batch, far left of every ridge. Attention over the cache **never becomes compute-bound**; batching amortises the
weights only, and once the batch's KV reads rival the weights, tokens/s grows much slower than the batch.
Prefill (b = prompt tokens) sits right of the weights' ridge: compute-bound. H100 SXM bf16:
989e12 / 3.35e12 = 295 FLOP/byte, b* ~ 295 tokens.

:class:`StepCost` turns this into the simulated clock's cost of a scheduler step (and the emulated device's,
``EmulatedClock``); :func:`emulated_decode_throughput` runs real decode steps of the engine on that
emulated device; :func:`measure_bandwidth`, :func:`measure_flops` and :func:`decode_throughput` are wall-clock
micro-benchmarks of the machine the notebook runs on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from course_lib.estimates import hardware
from course_lib.estimates.memory import kv_cache_bytes
from course_lib.model_config import PRESETS, GPTConfig, param_count


def ridge_point(peak_flops: float, mem_bandwidth: float) -> float:
    """I* = peak / bandwidth, FLOP per byte: kernels below it are memory-bound."""
    return peak_flops / mem_bandwidth


def critical_batch(peak_flops: float, mem_bandwidth: float, bytes_per_param: float = 2) -> float:
    """Tokens per step at which a weight-streaming step turns compute-bound: I* x bytes_per_param / 2."""
    return ridge_point(peak_flops, mem_bandwidth) * bytes_per_param / 2


def decode_bytes_per_token(weight_bytes: float, kv_bytes_per_token: float, batch: int, context: int) -> float:
    """Bytes a decode step moves per generated token: ``weight_bytes / batch + kv_bytes_per_token x context``."""
    if batch < 1 or context < 0:
        raise ValueError(f"need batch >= 1 and context >= 0, got batch={batch}, context={context}")
    return weight_bytes / batch + kv_bytes_per_token * context


def attention_intensity(config: GPTConfig | str, kv_bytes: float = 2) -> float:
    """FLOP per byte of attention over the KV cache: 4 L h / (2 L n_kv d_head kv_bytes) = 2 n_head / (n_kv kv_bytes).

    Independent of the batch and the context: each sequence reads its own cache, so batching never raises it."""
    c = PRESETS[config] if isinstance(config, str) else config
    return 2 * c.n_head / (c.kv_heads * kv_bytes)


def decode_intensity(config: GPTConfig | str, batch: int, context: int, bytes_per_param: float = 2) -> float:
    """FLOP per byte of a whole decode step: (2 N b + 4 L h c b) / (N bytes_per_param + kv_bytes_per_token c b).

    As the batch grows it tends to (2 N + 4 L h c) / (kv_bytes_per_token c), not to infinity: the weights' share
    of the bytes vanishes, the cache's does not."""
    c = PRESETS[config] if isinstance(config, str) else config
    n = param_count(c)
    flops = 2 * n * batch + 4 * c.n_layer * c.d_model * context * batch
    return flops / (n * bytes_per_param + kv_cache_bytes(c, 1, kv_bytes=bytes_per_param) * context * batch)


def decode_critical_batch(config: GPTConfig | str, context: int, peak_flops: float, mem_bandwidth: float,
                          bytes_per_param: float = 2) -> float:
    """Batch at which a decode step at ``context`` turns compute-bound (``decode_intensity`` = the ridge I*):

        b = I* N bytes_per_param / (2 N + 4 L h c - I* kv_bytes_per_token c)

    ``inf`` when the denominator is <= 0: past the context c = 2 N / (I* kv_bytes_per_token - 4 L h) no batch
    makes decode compute-bound, because every added sequence brings its own cache to read. At c = 0 it is the
    weights' ``critical_batch``."""
    c = PRESETS[config] if isinstance(config, str) else config
    n, ridge = param_count(c), ridge_point(peak_flops, mem_bandwidth)
    denom = 2 * n + 4 * c.n_layer * c.d_model * context - ridge * kv_cache_bytes(c, 1, kv_bytes=bytes_per_param) \
        * context
    return ridge * n * bytes_per_param / denom if denom > 0 else float("inf")


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

    def slowed(self, factor: float) -> StepCost:
        """The same device running ``factor`` times slower (peak and bandwidth divided, overhead multiplied): an
        emulated device slow enough that a CPU's real work hides under its sleeps; its times / factor are the
        original device's."""
        if factor <= 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        return dataclasses.replace(self, peak_flops=self.peak_flops / factor,
                                   mem_bandwidth=self.mem_bandwidth / factor, overhead_s=self.overhead_s * factor,
                                   label=f"{self.label}, {factor:g}x slower")

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


def emulated_decode_throughput(model: torch.nn.Module, cost: StepCost, batches: Sequence[int], context: int,
                               steps: int = 3) -> tuple[list[float], int]:
    """Tokens/s of real decode steps of the engine on the **emulated device** ``cost`` (measured wall clock).

    Each step feeds one token to each of ``b`` sequences holding ``context`` cached positions (the cache is
    reserved, not prefilled: its values do not change the time), runs :class:`~course_lib.serving.engine.Engine`
    on it, then sleeps until the step has lasted ``cost(work)`` (``EmulatedClock``); tokens/s is
    ``b x steps`` over the measured time. Returns the tokens/s at each batch and the number of steps whose real
    compute outlasted the emulated step (``EmulatedClock.overruns``: those points fall below the model)."""
    from course_lib.serving.engine import Engine, Segment
    from course_lib.serving.kv_cache import ContiguousKVCache

    out, overruns = [], 0
    for b in batches:
        cache = ContiguousKVCache(model.config, b, context + steps)
        engine, clock = Engine(model, cache), EmulatedClock(cost)
        for i in range(b):
            cache.reserve(i, context + steps)
        tokens = torch.zeros(1, dtype=torch.long)
        t0 = clock.now()
        for k in range(steps):
            clock.step_begin()
            engine.forward([Segment(i, tokens, context + k) for i in range(b)])
            clock.step_done(StepWork(new_tokens=b, attended=b * (context + k + 1), cached_tokens=b * (context + k),
                                     n_seqs=b))
        out.append(b * steps / (clock.now() - t0))
        overruns += clock.overruns
    return out, overruns


class SimClock:
    """Simulated seconds: a step takes ``cost(StepWork)``; waiting for an arrival jumps to it."""

    mode = "simulated"

    def __init__(self, cost: Callable[[StepWork], float]) -> None:
        self.cost, self.t = cost, 0.0

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def step_begin(self) -> None:
        pass

    def step_done(self, work: StepWork) -> None:
        self.t += self.cost(work)


class WallClock:
    """Real seconds since the clock was made (``time.perf_counter``); waiting sleeps."""

    mode = "wall-clock"

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))

    def step_begin(self) -> None:
        pass

    def step_done(self, work: StepWork) -> None:
        pass  # real time passed by itself


class EmulatedClock(WallClock):
    """Wall clock of an emulated device: :meth:`step_done` sleeps until ``cost(work)`` seconds have passed since
    :meth:`step_begin` (the same idea as ``course_lib.measure.instrument.EmulatedDeviceGPT``: a sleep costs no CPU, as a
    GPU kernel is a wait from the host's side). ``overruns`` counts steps whose real compute took longer."""

    mode = "emulated device"

    def __init__(self, cost: Callable[[StepWork], float]) -> None:
        super().__init__()
        self.cost, self.overruns, self._begin = cost, 0, 0.0

    def step_begin(self) -> None:
        self._begin = self.now()

    def step_done(self, work: StepWork) -> None:
        left = self._begin + self.cost(work) - self.now()
        if left < 0:
            self.overruns += 1
        time.sleep(max(0.0, left))
