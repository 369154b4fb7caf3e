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


def chat_trace(n_chats: int, turns: int, *, rate: float, system_len: int = 32, user: tuple[int, int] = (4, 12),
               answer: tuple[int, int] = (4, 12), output: tuple[int, int] = (4, 12), think_s: float = 0.05,
               vocab_size: int = 256, seed: int = 0) -> list[Request]:
    """Multi-turn chats that all begin with one shared system prompt of ``system_len`` tokens: chat c starts at a
    Poisson arrival (``rate`` chats per second) and its turn j arrives ``j x think_s`` later with the prompt
    system + (user message, earlier answer) of turns 0 .. j-1 + the new user message, so each turn's prompt
    extends the previous one. The earlier answers are stand-in tokens (the trace is fixed before anything is
    generated), as a chat client sends back the history it shows. Ids are in arrival order."""
    if n_chats < 1 or turns < 1 or rate <= 0:
        raise ValueError(f"need n_chats >= 1, turns >= 1 and rate > 0, got {n_chats}, {turns}, {rate}")
    g = torch.Generator().manual_seed(seed)

    def tokens(lo_hi: tuple[int, int]) -> torch.Tensor:
        return torch.randint(0, vocab_size, (int(torch.randint(lo_hi[0], lo_hi[1] + 1, (1,), generator=g)),),
                             generator=g)

    system = torch.randint(0, vocab_size, (system_len,), generator=g)
    raw, t = [], 0.0
    for c in range(n_chats):
        if c:
            t += float(torch.empty(1).exponential_(rate, generator=g))
        history = system
        for j in range(turns):
            prompt = torch.cat([history, tokens(user)])
            n_out = int(torch.randint(output[0], output[1] + 1, (1,), generator=g))
            raw.append((t + j * think_s, c, prompt, n_out))
            history = torch.cat([prompt, tokens(answer)])
    raw.sort(key=lambda r: (r[0], r[1]))
    return [Request(i, p, n, a) for i, (a, _, p, n) in enumerate(raw)]
