"""The request scheduler: which sequences run in each engine step, and how many of their tokens.

Policies (Yu et al. 2022, Orca, "iteration-level scheduling"; vLLM; Agrawal et al. 2024, Sarathi-Serve):

* ``static``: take up to ``max_batch`` waiting requests, run them until **all** have finished, only then take
  the next batch (a request that arrives meanwhile waits; a short one's slot idles while the longest finishes);
* ``continuous``: every step, finished sequences leave and waiting ones join (as long as a batch slot and
  cache memory are free); a newcomer's whole prompt is prefilled in the step it joins;
* ``continuous`` with ``token_budget``: **chunked prefill**; a step feeds at most ``token_budget`` tokens:
  every running decode first (one token each), then prompt chunks in arrival order. Long prompts no longer
  stall everyone's next token (ITL), at the price of their own time to first token (TTFT).

Memory: a sequence reserves cache for its prompt when it joins and grows by one position a step. When the
cache is full, the most recently admitted sequence is **preempted by recompute**: its memory is freed, it goes
back to the front of the queue keeping its output tokens, and when it rejoins its prompt + outputs are
prefilled again (vLLM's recompute preemption). A waiting sequence never holds cache memory.

Time comes from a clock (``roofline``): :class:`SimClock` advances by a cost model per step (deterministic, for
tests and for "what would this GPU do"); :class:`WallClock` reads ``time.perf_counter`` (what this machine really did);
:class:`EmulatedClock` is the wall clock of an **emulated device**: the real step runs, then the clock sleeps
until the step has lasted its modelled cost (measured time, robust to a busy CPU as long as the real compute
stays below the modelled one; the clock counts the steps where it did not).
Seams a variant overrides: :meth:`Scheduler.make_state`, :meth:`Scheduler.admit`, :meth:`Scheduler.plan`,
:meth:`Scheduler.preempt`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from course_lib.serving.engine import Engine, Segment, sample
from course_lib.serving.kv_cache import CacheFull
from course_lib.serving.loadgen import Request
from course_lib.serving.metrics import RequestRecord, summarize
from course_lib.serving.roofline import EmulatedClock, SimClock, StepWork, WallClock

Policy = Literal["static", "continuous"]


@dataclass
class SeqState:
    """A request being served: ``tokens`` = prompt + outputs so far; ``n_cached`` of them are in the cache."""

    request: Request
    tokens: list[int]
    record: RequestRecord
    n_cached: int = 0

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def finished(self) -> bool:
        return len(self.record.tokens) >= self.request.max_new_tokens

    def kind(self, n: int) -> str:
        """'prefill' (prompt), 'recompute' (prompt + outputs again after preemption) or 'decode' (one token)."""
        if not self.record.tokens:
            return "prefill"
        return "decode" if n == 1 and self.n_cached == len(self.tokens) - 1 else "recompute"


@dataclass
class StepRecord:
    """One engine step: when it ran, what each sequence fed (request id, kind, tokens), who was preempted, and
    the cache positions held by waiting sequences (always 0 unless preemption leaks), and the distinct positions
    of memory in use (shared prefix blocks counted once)."""

    start_s: float
    end_s: float
    work: list[tuple[int, str, int]]
    preempted: list[int]
    reserved_tokens: int
    held_by_waiting: int
    in_use_tokens: int = 0


@dataclass
class ServeResult:
    records: list[RequestRecord]
    steps: list[StepRecord]
    clock_mode: str
    policy: str
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        return summarize(self.records)

    def outputs(self) -> dict[int, list[int]]:
        return {r.id: r.tokens for r in self.records}


class Scheduler:
    """Serve a list of requests with ``engine`` under ``policy``; ``run(requests)`` -> :class:`ServeResult`."""

    def __init__(self, engine: Engine, *, policy: Policy = "continuous", max_batch: int = 8,
                 token_budget: int | None = None, clock: SimClock | WallClock | EmulatedClock | None = None,
                 temperature: float = 0.0, seed: int = 0) -> None:
        if policy not in ("static", "continuous"):
            raise ValueError(f"policy must be 'static' or 'continuous', got {policy!r}")
        if token_budget is not None and (policy == "static" or token_budget < 1):
            raise ValueError(f"token_budget (chunked prefill) needs policy='continuous' and >= 1, got "
                             f"{token_budget} with {policy!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine, self.cache = engine, engine.cache
        self.policy, self.max_batch, self.token_budget = policy, max_batch, token_budget
        self.clock = clock or WallClock()
        self.temperature = temperature
        self.generator = torch.Generator().manual_seed(seed)
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []

    # -- seams --------------------------------------------------------------------------------------------------

    def admit(self) -> None:
        """Move waiting sequences into the batch: static only when the batch is empty, continuous every step;
        first come first served, each one only if the cache can hold its tokens so far (a prefix cache may already
        hold their first positions: only the rest is prefilled)."""
        if self.policy == "static" and self.running:
            return
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            cached = self.cache.reserve_prefix(seq.id, seq.tokens)  # > 0 only with a prefix cache
            if cached is None:
                break
            seq.n_cached = cached
            self.running.append(self.waiting.popleft())

    def plan(self) -> list[tuple[SeqState, int]]:
        """(sequence, tokens to feed) for this step: decodes first, then prefill (chunks under a budget)."""
        budget = self.token_budget or float("inf")
        decodes = [s for s in self.running if s.record.tokens and s.n_cached == len(s.tokens) - 1]
        items = [(s, 1) for s in decodes]
        budget -= len(items)
        for s in self.running:
            if s in decodes or budget <= 0:
                continue
            n = int(min(len(s.tokens) - s.n_cached, budget))
            items.append((s, n))
            budget -= n
        return items

    def make_state(self, request: Request, record: RequestRecord) -> SeqState:
        """The state of a request that just arrived: its prompt, nothing cached, no output yet."""
        return SeqState(request, request.prompt.tolist(), record)

    def preempt(self, seq: SeqState) -> None:
        """Recompute preemption: free the sequence's cache, put it first in the queue, keep its outputs."""
        self.cache.free(seq.id)
        seq.n_cached = 0
        seq.record.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    # -- the loop -----------------------------------------------------------------------------------------------

    def _reserve(self, items: list[tuple[SeqState, int]]) -> tuple[list[tuple[SeqState, int]], list[int]]:
        """Grow each planned sequence's cache; when it is full, preempt the newest running sequence."""
        kept: list[tuple[SeqState, int]] = []
        preempted: list[int] = []
        for seq, n in items:
            if seq not in self.running:
                continue
            while not self.cache.reserve(seq.id, seq.n_cached + n):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    raise CacheFull(f"request {seq.id} needs {seq.n_cached + n} cached positions: more than the "
                                    "whole cache")
                self.preempt(victim)
                preempted.append(victim.id)
                kept = [(s, k) for s, k in kept if s is not victim]
                if victim is seq:
                    break
            else:
                kept.append((seq, n))
        return kept, preempted

    def run(self, requests: Sequence[Request]) -> ServeResult:
        limit = self.engine.config.seq_len
        for r in requests:
            if r.prompt.numel() + r.max_new_tokens > limit:
                raise ValueError(f"request {r.id}: {r.prompt.numel()} + {r.max_new_tokens} tokens exceed the "
                                 f"model's seq_len={limit}")
        pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.id)))
        records = {r.id: RequestRecord(r.id, r.arrival_s, r.prompt.numel()) for r in requests}
        steps: list[StepRecord] = []
        while pending or self.waiting or self.running:
            while pending and pending[0].arrival_s <= self.clock.now():
                r = pending.popleft()
                self.waiting.append(self.make_state(r, records[r.id]))
            self.admit()
            if not self.running:
                if not pending:
                    raise CacheFull(f"request {self.waiting[0].id} does not fit in an empty cache")
                self.clock.wait_until(pending[0].arrival_s)
                continue
            items, preempted = self._reserve(self.plan())
            steps.append(self._step(items, preempted))
        return ServeResult([records[r.id] for r in requests], steps, self.clock.mode, self.policy)

    def _step(self, items: list[tuple[SeqState, int]], preempted: list[int]) -> StepRecord:
        self.clock.step_begin()
        start = self.clock.now()
        device = self.engine.model.lm_head.weight.device
        segments = [Segment(s.id, torch.tensor(s.tokens[s.n_cached:s.n_cached + n], device=device), s.n_cached)
                    for s, n in items]
        logits = self.engine.forward(segments)
        self.clock.step_done(StepWork(
            new_tokens=sum(n for _, n in items), n_seqs=len(items),
            attended=sum(n * s.n_cached + n * (n + 1) // 2 for s, n in items),
            cached_tokens=sum(s.n_cached for s, _ in items)))
        now = self.clock.now()
        work = [(s.id, s.kind(n), n) for s, n in items]
        done_rows = []
        for row, (s, n) in enumerate(items):
            s.n_cached += n
            self.cache.commit(s.id, s.tokens[:s.n_cached])
            if s.n_cached == len(s.tokens):
                done_rows.append((row, s))
        if done_rows:
            nxt = sample(logits[[r for r, _ in done_rows]], self.temperature, self.generator).tolist()
            for t, (_, s) in zip(nxt, done_rows, strict=True):
                s.tokens.append(t)
                s.record.tokens.append(t)
                s.record.token_times.append(now)
                if s.finished:
                    self.cache.free(s.id)
                    self.running.remove(s)
        held = sum(self.cache.reserved_for(s.id) for s in self.waiting)
        return StepRecord(start, now, work, preempted, self.cache.reserved_tokens(), held,
                          self.cache.positions_in_use())
