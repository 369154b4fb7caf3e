"""Serving latency metrics, from the times at which each request's output tokens came out.

For a request that arrived at ``a`` and produced tokens at ``t_1 < t_2 < ... < t_n``:

* **TTFT** (time to first token) = t_1 - a: queueing + prefill (+ the first decode's sampling);
* **ITL** (inter-token latency) = every gap t_{i+1} - t_i, i = 1 .. n-1 (a distribution: one value per gap);
* **TPOT** (time per output token) = (t_n - t_1) / (n - 1): the mean gap of one request (undefined for n = 1);
* **end-to-end latency** = t_n - a;
* **throughput** = all output tokens / (last token time - first arrival), tokens per second of the whole trace.

Percentiles (p50 / p90 / p99) interpolate linearly between order statistics (numpy's default, Hyndman & Fan
type 7). Tail latency is read from p99: with mixed prompt and output lengths, the mean hides the requests that
waited behind a long prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What happened to one request: when it arrived and when each of its output tokens came out (seconds)."""

    id: int
    arrival_s: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    preemptions: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival_s

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival_s


def percentiles(values: Sequence[float], ps: Sequence[int] = PERCENTILES) -> dict[str, float]:
    """{"p50": .., "p90": .., "p99": ..} with linear interpolation; NaN for no values."""
    if not len(values):
        return {f"p{p}": float("nan") for p in ps}
    return {f"p{p}": float(np.percentile(np.asarray(values, dtype=float), p)) for p in ps}


def summarize(records: Sequence[RequestRecord]) -> dict[str, float]:
    """The trace's metrics: ttft_p50.. , itl_p50.., tpot_p50.., e2e_p50.., throughput_tok_s, n_requests."""
    done = [r for r in records if r.token_times]
    if not done:
        raise ValueError("no request produced a token")
    out: dict[str, float] = {"n_requests": len(done)}
    series = {"ttft": [r.ttft for r in done], "itl": [g for r in done for g in r.itl],
              "tpot": [r.tpot for r in done if r.tpot is not None], "e2e": [r.e2e for r in done]}
    for name, values in series.items():
        out |= {f"{name}_{k}": v for k, v in percentiles(values).items()}
    span = max(r.token_times[-1] for r in done) - min(r.arrival_s for r in done)
    out["throughput_tok_s"] = sum(len(r.token_times) for r in done) / span
    return out


def format_summary(s: dict[str, float], unit: str = "ms") -> str:
    """One readable block: p50/p90/p99 of TTFT, ITL, TPOT and e2e, then throughput."""
    scale = {"ms": 1e3, "s": 1.0}[unit]
    lines = [f"{'':6}" + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES)]
    for name in ("ttft", "itl", "tpot", "e2e"):
        lines.append(f"{name:6}" + "".join(f"{s[f'{name}_p{p}'] * scale:>8.1f}{unit}" for p in PERCENTILES))
    lines.append(f"throughput {s['throughput_tok_s']:.1f} tokens/s over {int(s['n_requests'])} requests")
    return "\n".join(lines)
