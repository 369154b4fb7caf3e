"""A load generator: a trace of requests with Poisson arrivals and mixed prompt and output lengths, fixed seed.

Arrivals of a Poisson process of rate ``rate`` (requests per second) have exponential gaps of mean 1 / rate.
Lengths are a mix, as real traffic is: most requests are short chats, a few carry long prompts (documents) or
ask for long answers; that mix is what makes static batching wait for the longest member and what makes one
long prefill delay everyone's next token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Request:
    """A prompt (``[n]`` token ids) that wants ``max_new_tokens`` output tokens, arriving at ``arrival_s``."""

    id: int
    prompt: torch.Tensor
    max_new_tokens: int
    arrival_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt.dim() != 1 or self.prompt.numel() < 1 or self.max_new_tokens < 1:
            raise ValueError(f"request {self.id}: need a non-empty 1-D prompt and max_new_tokens >= 1, got "
                             f"shape {tuple(self.prompt.shape)} and {self.max_new_tokens}")


def poisson_trace(n: int, rate: float, *, vocab_size: int = 256, short_prompt: tuple[int, int] = (2, 8),
                  long_prompt: tuple[int, int] = (16, 24), p_long_prompt: float = 0.2,
                  output: tuple[int, int] = (2, 24), seed: int = 0) -> list[Request]:
    """``n`` requests: exponential inter-arrival gaps of mean 1/rate (``rate=inf``: all at time 0); prompt
    lengths uniform in ``short_prompt`` or, with probability ``p_long_prompt``, in ``long_prompt``; output lengths
    uniform in ``output`` (bounds inclusive). The same ``seed`` gives the same trace."""
    if n < 1 or rate <= 0:
        raise ValueError(f"need n >= 1 and rate > 0, got n={n}, rate={rate}")
    g = torch.Generator().manual_seed(seed)

    def uniform(lo_hi: tuple[int, int]) -> int:
        return int(torch.randint(lo_hi[0], lo_hi[1] + 1, (1,), generator=g))

    t, out = 0.0, []
    for i in range(n):
        if rate != float("inf") and i:
            t += float(torch.empty(1).exponential_(rate, generator=g))
        plen = uniform(long_prompt if float(torch.rand(1, generator=g)) < p_long_prompt else short_prompt)
        prompt = torch.randint(0, vocab_size, (plen,), generator=g)
        out.append(Request(i, prompt, uniform(output), t))
    return out
