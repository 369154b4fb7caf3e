"""Speculative decoding (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

A cheap **draft** model proposes ``k`` tokens one by one; the **target** scores all of them in one forward (k + 1
positions: decode is memory-bound, so k + 1 tokens cost about what one does); the longest agreeing prefix is
kept, plus one token of the target's own, and both KV caches are **rolled back** past the rejected proposals.

* greedy: proposal i is kept while it equals the target's argmax at that position; the output is exactly the
  target's greedy decoding, whatever the draft;
* sampling: proposal x ~ q is kept with probability min(1, p(x) / q(x)); the first rejected one is replaced by
  a draw from norm(max(0, p - q)); if all k are kept, a bonus token is drawn from the target's p at position
  k + 1. Every emitted token is then distributed exactly as the target's p (Leviathan et al., Theorem 1).

With a per-token acceptance probability a (independent across positions), one verification emits on average

    E[tokens per verification] = (1 - a^(k+1)) / (1 - a)                     (Leviathan et al., eq. 1)

and costs k draft steps + one target step: speed-up = E / (k c + 1) for a draft costing c target steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from course_lib.model import GPT
from course_lib.serving.engine import Engine, Segment
from course_lib.serving.paged import PagedKVCache
from course_lib.serving.roofline import EmulatedClock, StepWork


def expected_tokens_per_verification(a: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): tokens one verification emits when each proposal is accepted with probability a
    (k + 1 at a = 1: every proposal and the bonus token)."""
    if not 0 <= a <= 1 or k < 0:
        raise ValueError(f"need 0 <= a <= 1 and k >= 0, got a={a}, k={k}")
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def draft_from_layers(target: GPT, n_layer: int) -> GPT:
    """A draft that is the target's first ``n_layer`` blocks with its embeddings, final norm and head (weights
    copied): no training, same vocabulary and context; a layer-skipping draft (Zhang et al. 2024, "Draft & Verify"
    skip layers of the target; LayerSkip exits early)."""
    if not 1 <= n_layer <= target.config.n_layer:
        raise ValueError(f"n_layer must be in 1..{target.config.n_layer} (the target's layers), got {n_layer}")
    draft = GPT(dataclasses.replace(target.config, n_layer=n_layer)).eval()
    keep = {k: v for k, v in target.state_dict().items()
            if not (k.startswith("blocks.") and int(k.split(".")[1]) >= n_layer)}
    draft.load_state_dict(keep)
    return draft


def check_draft(target: GPT, draft: GPT) -> None:
    """A draft must speak the target's vocabulary and hold its context; else a ValueError naming what differs."""
    t, d = target.config, draft.config
    if t.vocab_size != d.vocab_size:
        raise ValueError(f"draft vocabulary ({d.vocab_size} tokens) differs from the target's ({t.vocab_size}): "
                         "its token ids would mean other tokens; use a draft trained with the target's tokenizer")
    if d.seq_len < t.seq_len:
        raise ValueError(f"draft context seq_len={d.seq_len} is shorter than the target's ({t.seq_len}): it could "
                         "not propose past its own context; use a draft with seq_len >= the target's")


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """Tokens kept by greedy verification: the drafts up to the first disagreement with the target's argmax,
    then the target's argmax there (``target_logits`` ``[k+1, vocab]``, row i predicts the token after draft i)."""
    best = target_logits.argmax(-1).tolist()
    m = 0
    while m < len(drafts) and drafts[m] == best[m]:
        m += 1
    return [*drafts[:m], best[m]]


def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator: torch.Generator) -> list[int]:
    """Rejection rule of Leviathan et al. / Chen et al.: ``p`` ``[k+1, vocab]`` target probabilities, ``q``
    ``[k, vocab]`` draft probabilities, ``drafts`` the k proposals (drawn from q). Keep proposal x with probability
    min(1, p(x)/q(x)); at the first rejection draw from norm(max(0, p - q)) and stop; if all are kept, draw a bonus
    token from p[k]."""
    out = []
    for i, x in enumerate(drafts):
        if float(torch.rand((), generator=generator)) * float(q[i, x]) < float(p[i, x]):  # u < p/q, no division
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    return out


@dataclass
class SpecResult:
    """Tokens emitted, one entry per verification of how many proposals it kept, and the time the loop took:
    ``device_s`` modelled (sum of the step costs, when given) and ``wall_s`` measured."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    target_steps: int = 0
    draft_steps: int = 0
    device_s: float = 0.0
    wall_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposals / proposals the target judged: a verification stops at its first rejection, so the
        proposals after it were never tested (counting them would bias a low). Under the formula's assumption
        (each tested proposal kept with probability a), this is the maximum-likelihood a. NaN when none."""
        tested = sum(self.accepted) + sum(1 for a, p in zip(self.accepted, self.proposed, strict=True) if a < p)
        return sum(self.accepted) / tested if tested else float("nan")

    @property
    def tokens_per_verification(self) -> float:
        return len(self.tokens) / self.target_steps


class _Model:
    """One model's engine, its one-sequence paged cache, how many positions it holds, and its emulated clock."""

    def __init__(self, model: GPT, n_positions: int, cost: Callable[[StepWork], float] | None,
                 block_size: int) -> None:
        cache = PagedKVCache(model.config, n_blocks=-(-n_positions // block_size), block_size=block_size)
        self.engine, self.n_cached, self.steps = Engine(model, cache), 0, 0
        self.clock = EmulatedClock(cost) if cost is not None else None
        self.cost, self.device_s = cost, 0.0

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Append ``tokens`` after the cached positions; logits of every one ``[len(tokens), vocab]``."""
        n, start = len(tokens), self.n_cached
        self.engine.cache.reserve(0, start + n)
        if self.clock is not None:
            self.clock.step_begin()
        logits = self.engine.forward([Segment(0, torch.tensor(tokens), start)], every_token=True)
        if self.clock is not None:
            work = StepWork(new_tokens=n, attended=n * start + n * (n + 1) // 2, cached_tokens=start, n_seqs=1)
            self.clock.step_done(work)
            self.device_s += self.cost(work)
        self.n_cached, self.steps = start + n, self.steps + 1
        return logits

    def rollback(self, n_keep: int) -> None:
        """Forget every cached position from ``n_keep`` on (the paged cache gives the blocks past it back)."""
        self.engine.cache.truncate(0, n_keep)
        self.n_cached = n_keep


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


@torch.no_grad()
def speculative_generate(target: GPT, draft: GPT | None, prompt: torch.Tensor, max_new_tokens: int, k: int, *,
                         temperature: float = 0.0, generator: torch.Generator | None = None,
                         cost_target: Callable[[StepWork], float] | None = None,
                         cost_draft: Callable[[StepWork], float] | None = None,
                         block_size: int = 4) -> SpecResult:
    """Generate ``max_new_tokens`` after ``prompt`` with ``draft`` proposing ``k`` tokens per target verification
    (``k = 0``: plain decoding with the target, the baseline). ``temperature == 0`` is greedy (the target's own
    greedy output), else seeded sampling with ``generator``. ``cost_target`` / ``cost_draft`` (step costs, e.g.
    ``StepCost``) run both models on an emulated device (``EmulatedClock``)."""
    if k < 0:
        raise ValueError(f"k (proposals per verification) must be >= 0, got {k}")
    if k and draft is None:
        raise ValueError("k > 0 needs a draft model")
    if draft is not None:
        check_draft(target, draft)
    if prompt.numel() + max_new_tokens > target.config.seq_len:
        raise ValueError(f"{prompt.numel()} prompt tokens + max_new_tokens={max_new_tokens} exceed the target's "
                         f"seq_len={target.config.seq_len}")
    if temperature and generator is None:
        generator = torch.Generator().manual_seed(0)
    n_pos = prompt.numel() + max_new_tokens
    tgt = _Model(target, n_pos, cost_target, block_size)
    drf = _Model(draft, n_pos, cost_draft, block_size) if k else None
    tokens, res = prompt.tolist(), SpecResult([])
    t0 = time.perf_counter()
    while len(res.tokens) < max_new_tokens:
        kk = min(k, max_new_tokens - len(res.tokens) - 1)  # never feed a position past prompt + max_new_tokens
        drafts, q = [], []
        if kk:
            logits = drf.feed(tokens[drf.n_cached:])[-1]
            for i in range(kk):
                q.append(_probs(logits, temperature) if temperature else logits)
                x = int(torch.multinomial(q[-1], 1, generator=generator)) if temperature else int(logits.argmax())
                drafts.append(x)
                if i + 1 < kk:
                    logits = drf.feed([x])[-1]
        fed = tokens[tgt.n_cached:] + drafts
        p = tgt.feed(fed)[-(kk + 1):]
        if temperature:
            new = accept_sampled(_probs(p, temperature), torch.stack(q) if q else p[:0], drafts, generator)
        else:
            new = accept_greedy(p, drafts)
        kept = len(new) - 1
        res.accepted.append(kept)
        res.proposed.append(kk)
        tgt.rollback(len(tokens) + kept)  # the target fed every proposal; keep the accepted ones
        if drf is not None:
            drf.rollback(min(drf.n_cached, len(tokens) + kept))
        tokens += new
        res.tokens += new
    res.wall_s = time.perf_counter() - t0
    res.target_steps, res.draft_steps = tgt.steps, drf.steps if drf else 0
    res.device_s = tgt.device_s + (drf.device_s if drf else 0.0)
    for m in (tgt, drf):
        if m is not None:
            m.engine.cache.free(0)
            m.engine.cache.check_no_leak()
    return res


def speedup_vs_k(target: GPT, draft: GPT, prompt: torch.Tensor, max_new_tokens: int, ks: list[int],
                 cost_target: Callable[[StepWork], float], cost_draft: Callable[[StepWork], float]) -> list[dict]:
    """Greedy speculative decoding at each k on the emulated device, against plain decoding (k = 0): per k the
    acceptance rate a, tokens per verification measured and by the formula at that a, and the speed-up measured
    (wall clock of the emulated device) and modelled (sum of step costs). Checks each output equals k = 0's."""
    base = speculative_generate(target, draft, prompt, max_new_tokens, 0, cost_target=cost_target)
    rows = []
    for k in ks:
        r = speculative_generate(target, draft, prompt, max_new_tokens, k, cost_target=cost_target,
                                 cost_draft=cost_draft)
        if r.tokens != base.tokens:
            raise AssertionError(f"k={k}: speculative greedy output differs from the target's greedy decoding")
        a = r.acceptance_rate
        rows.append({"k": k, "acceptance": a, "tokens_per_verification": r.tokens_per_verification,
                     "formula": expected_tokens_per_verification(a, k), "speedup_measured": base.wall_s / r.wall_s,
                     "speedup_modelled": base.device_s / r.device_s})
    return rows
