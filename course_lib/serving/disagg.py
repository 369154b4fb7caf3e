"""Disaggregated prefill and decode on real ranks (DistServe, Zhong et al. 2024; Splitwise, Patel et al. 2024).

A colocated engine runs prefill and decode in the same steps, so a long prompt's prefill delays every running
sequence's next token (the ITL spikes of chapter 09's section 5). Disaggregation gives them separate ranks:

* **rank 0 (prefill)** takes the requests in arrival order, prefills each prompt, emits its first token and sends
  the prompt's K and V (every layer) to the decode rank with ``dist.isend``: per request
  ``2 x L x n_kv x d_head x bytes x tokens`` bytes (``memory.kv_cache_bytes``), counted from the tensors sent;
* **rank 1 (decode)** receives them with ``dist.recv``, writes them into its paged cache when it admits the
  request (:class:`ReceivedKVCache`) and runs continuous batching of decode steps only.

Time is simulated on each rank (``SimClock`` with the step cost of the served model); a request reaches the
decode rank when its prefill ends plus the modelled transfer of the served model's K/V over ``link``
(``alpha + bytes / beta``). :func:`colocated_serve` is the baseline at the same number of ranks: each rank a
replica with continuous batching of both kinds of step, serving every world_size-th request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from course_lib.estimates import hardware
from course_lib.estimates.memory import kv_cache_bytes
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.serving.engine import Engine, Segment
from course_lib.serving.kv_cache import ContiguousKVCache
from course_lib.serving.loadgen import Request
from course_lib.serving.metrics import RequestRecord
from course_lib.serving.paged import PagedKVCache
from course_lib.serving.roofline import StepCost, StepWork
from course_lib.serving.scheduler import Scheduler, SeqState, SimClock

_HEADER = 6  # request id, first token, prompt tokens, arrival, prefill end, ready at the decode rank (ns)


def kv_transfer_bytes(config: GPTConfig, n_tokens: int, elem_bytes: int = 4) -> int:
    """2 x L x n_kv x d_head x elem_bytes x n_tokens: one prompt's K and V, every layer."""
    return int(kv_cache_bytes(config, n_tokens, 1, elem_bytes))


class ReceivedKVCache(PagedKVCache):
    """A paged cache that admits a sequence with the K/V its prefill rank sent (``received[seq]``, a
    ``[L, 2, n_kv, n, d]`` tensor): :meth:`reserve_prefix` allocates the blocks, writes them, and reports the n
    positions as cached. A sequence preempted later is admitted the same way (only its outputs are recomputed)."""

    def __init__(self, config: GPTConfig, n_blocks: int, block_size: int = 16, **kw) -> None:
        super().__init__(config, n_blocks, block_size, **kw)
        self.received: dict[int, torch.Tensor] = {}

    def reserve_prefix(self, seq: int, tokens: list[int]) -> int | None:
        kv = self.received[seq]
        if not self.reserve(seq, len(tokens)):
            return None
        for layer in range(self.n_layer):
            self.write(layer, seq, 0, kv[layer, 0], kv[layer, 1])
        return kv.shape[3]


class DecodeScheduler(Scheduler):
    """A request arrives with its first token (``first_tokens``, emitted at ``prefill_end_s``) and its K/V."""

    def __init__(self, *args, first_tokens: dict[int, int], prefill_end_s: dict[int, float], **kw) -> None:
        super().__init__(*args, **kw)
        self.first_tokens, self.prefill_end_s = first_tokens, prefill_end_s

    def make_state(self, request: Request, record: RequestRecord) -> SeqState:
        first = self.first_tokens[request.id]
        record.tokens.append(first)
        record.token_times.append(self.prefill_end_s[request.id])
        return SeqState(request, [*request.prompt.tolist(), first], record)


def _prefill_rank(model: GPT, requests: Sequence[Request], cost: StepCost, link: hardware.Link,
                  dst: int) -> int:
    cfg = model.config
    clock = SimClock(cost)
    cache = ContiguousKVCache(cfg, 1, max(r.prompt.numel() for r in requests))
    engine, sends, sent = Engine(model, cache), [], 0
    for r in sorted(requests, key=lambda r: (r.arrival_s, r.id)):
        n = r.prompt.numel()
        clock.wait_until(r.arrival_s)
        cache.reserve(0, n)
        first = int(engine.forward([Segment(0, r.prompt, 0)]).argmax(-1))
        clock.step_done(StepWork(new_tokens=n, attended=n * (n + 1) // 2, cached_tokens=0, n_seqs=1))
        kv = torch.stack([torch.stack(cache.read(layer, 0, n)) for layer in range(cfg.n_layer)]).contiguous()
        ready = clock.now() + link.alpha + cost.kv_bytes_per_token * n / link.beta  # the served model's K/V
        header = torch.tensor([r.id, first, n, *(round(t * 1e9) for t in (r.arrival_s, clock.now(), ready))])
        sends += [dist.isend(header, dst), dist.isend(kv, dst)]
        sent += kv.numel() * kv.element_size()
        cache.free(0)
    for w in sends:
        w.wait()
    return sent


def _decode_rank(model: GPT, n_requests: int, max_new: dict[int, int], cost: StepCost, src: int, *,
                 max_batch: int, n_blocks: int, block_size: int) -> dict:
    cfg = model.config
    cache = ReceivedKVCache(cfg, n_blocks, block_size)
    first, prefill_end, arrival, requests, received = {}, {}, {}, [], 0
    for _ in range(n_requests):
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.recv(header, src)
        rid, tok, n, t_arr, t_end, t_ready = header.tolist()
        kv = torch.empty(cfg.n_layer, 2, cache.n_kv_heads, n, cfg.head_dim)
        dist.recv(kv, src)
        received += kv.numel() * kv.element_size()
        cache.received[rid] = kv
        first[rid], prefill_end[rid], arrival[rid] = tok, t_end / 1e9, t_arr / 1e9
        prompt = torch.zeros(n, dtype=torch.long)  # the decode rank never feeds the prompt: its K/V came instead
        requests.append(Request(rid, prompt, max_new[rid], t_ready / 1e9))
    sched = DecodeScheduler(Engine(model, cache), policy="continuous", max_batch=max_batch, clock=SimClock(cost),
                            first_tokens=first, prefill_end_s=prefill_end)
    result = sched.run(requests)
    for rec in result.records:
        rec.arrival_s = arrival[rec.id]
    cache.check_no_leak()
    return {"records": result.records, "received_bytes": received}


def disaggregated_serve(rank: int, world_size: int, config: GPTConfig, requests: Sequence[Request], *,
                        served: str = "llama3-8b", gpu: str = "H100 80GB", link: str = "InfiniBand NDR 400G",
                        overhead_s: float = 1e-3, max_batch: int = 16, n_blocks: int = 2000,
                        block_size: int = 16, seed: int = 0) -> dict:
    """A ``launch`` target on 2 ranks: rank 0 prefills, rank 1 decodes (greedy). Rank 0 returns
    ``{"sent_bytes"}``, rank 1 ``{"records", "received_bytes"}``. Step costs and the K/V transfer time are those
    of ``served`` on ``gpu`` and ``link``; the tokens are the tiny ``config`` model's."""
    if world_size != 2:
        raise ValueError(f"disaggregated_serve runs on 2 ranks (one prefill, one decode), got world_size={world_size}")
    short = [r.id for r in requests if r.max_new_tokens < 2]
    if short:
        raise ValueError(f"requests {short} want a single token: their prefill finishes them, there is nothing to "
                         "decode; give every request max_new_tokens >= 2")
    torch.set_num_threads(1)
    model = GPT(config, seed=seed).eval()
    cost = StepCost.for_model(served, gpu, overhead_s=overhead_s)
    if rank == 0:
        return {"sent_bytes": _prefill_rank(model, requests, cost, hardware.link(link), dst=1)}
    return _decode_rank(model, len(requests), {r.id: r.max_new_tokens for r in requests}, cost, src=0,
                        max_batch=max_batch, n_blocks=n_blocks, block_size=block_size)


def colocated_serve(rank: int, world_size: int, config: GPTConfig, requests: Sequence[Request], *,
                    served: str = "llama3-8b", gpu: str = "H100 80GB", overhead_s: float = 1e-3,
                    max_batch: int = 16, n_blocks: int = 2000, block_size: int = 16, token_budget: int | None = None,
                    seed: int = 0) -> list[RequestRecord]:
    """The baseline at the same number of ranks: each rank a replica serving ``requests[rank::world_size]``
    with continuous batching (chunked prefill with ``token_budget``); returns its records."""
    torch.set_num_threads(1)
    model = GPT(config, seed=seed).eval()
    cache = PagedKVCache(config, n_blocks, block_size)
    clock = SimClock(StepCost.for_model(served, gpu, overhead_s=overhead_s))
    mine = list(requests)[rank::world_size]
    return Scheduler(Engine(model, cache), policy="continuous", max_batch=max_batch, token_budget=token_budget,
                     clock=clock).run(mine).records
