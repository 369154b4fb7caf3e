"""What one serving GPU holds and how fast it decodes: the inference budget turned into capacity and latency.

Memory (``course_lib.estimates.memory.inference_memory``, the article's inference budget): weights + KV cache +
workspace + communication + headroom. The workspace is sized as engines profile it: one step of ``token_budget`` tokens
(vLLM V1 runs a dummy forward of ``max_num_batched_tokens`` before it sizes the KV cache), not the whole batch's
prompts at once, so the capacity does not depend on the batch:

    max concurrent sequences = floor((capacity / (1 + headroom) - weights - workspace - comm) / kv_per_sequence)

Time of one decode step per GPU (roofline, :mod:`course_lib.serving.roofline`, plus TP's all-reduces):

    step = max(FLOPs / peak, (weights + KV cache) / bandwidth) + 2 L x all_reduce(batch x h x 2 bytes, t)

The all-reduce (:func:`decode_all_reduce_time`): ``"ring"`` is NCCL's ring at the protocol NCCL's own cost model
picks for the message (:func:`nccl_all_reduce`: LL for a decode step's few kB), ``"one_shot"``/``"two_shot"``
the small-message kernels of serving engines (``course_lib.estimates.cost.all_reduce_time``), ``"best"`` the cheapest.
Each sequence gets one token per step: inter-token latency = step; throughput = batch / step. Prefill of the
prompt is compute-bound: TTFT ~ 2 N x context / (t x peak) (no queueing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.estimates import hardware
from course_lib.estimates.cost import SHOT_MAX_BYTES, AllReduceAlgorithm, all_reduce_time, collective_steps
from course_lib.estimates.layout import ParallelLayout, params_per_rank
from course_lib.estimates.memory import inference_memory, kv_cache_bytes
from course_lib.estimates.memory_budget import MemoryBudget, check_count
from course_lib.model_config import PRESETS, GPTConfig

QUANTISATION: dict[str, float] = {"bf16": 2, "int8": 1, "int4": 0.5}
"""Bytes per weight. The KV cache stays bf16 here (2 bytes) whatever the weights."""
TOKEN_BUDGET = 8192
"""Tokens one engine step may carry: vLLM V1's ``max_num_batched_tokens`` for its API server on a GPU of 70 GiB or
more that is not an A100 (its offline ``LLM`` class: 16384; on smaller GPUs and A100s: 2048 served, 8192 offline),
``EngineArgs.get_batch_defaults`` in vllm/engine/arg_utils.py."""


def nccl_ring_times(nbytes: float, n: int, link: hardware.Link) -> dict[str, float]:
    """NCCL's modelled time of a ring all-reduce of ``nbytes`` on ``n`` ranks, by protocol (seconds): its fixed
    cost + 2(n-1) steps of the protocol's latency + 2(n-1)/n V over the bandwidth the protocol carries
    (``hardware.NCCL_*``; tuning.cc's model without its per-architecture caps). A link outside NCCL's tables
    gets its own ``alpha`` and no fixed cost for every protocol."""
    steps, per_step = collective_steps("all_reduce", nbytes, n)
    if n == 1:
        return dict.fromkeys(hardware.NCCL_PROTOCOLS, 0.0)
    base = hardware.NCCL_RING_BASE_LATENCY if link.nccl_link else dict.fromkeys(hardware.NCCL_PROTOCOLS, 0.0)
    return {p: base[p] + steps * (link.protocol_alpha(p) + per_step / (link.beta * hardware.NCCL_PROTOCOL_BANDWIDTH[p]))
            for p in hardware.NCCL_PROTOCOLS}


def nccl_all_reduce(nbytes: float, n: int, link: hardware.Link) -> tuple[float, str]:
    """(seconds, protocol) of the ring all-reduce NCCL's tuner picks: the protocol its cost model prices lowest
    (NVIDIA/nccl src/graph/tuning.cc). Left out: NCCL's tree and NVLS algorithms."""
    times = nccl_ring_times(nbytes, n, link)
    protocol = min(times, key=times.get)
    return times[protocol], protocol


def decode_all_reduce_time(nbytes: float, t: int, link: hardware.Link,
                           algorithm: AllReduceAlgorithm = "best") -> float:
    """One TP all-reduce of ``nbytes`` over ``t`` ranks: ``"ring"`` NCCL's (:func:`nccl_all_reduce`),
    ``"one_shot"``/``"two_shot"`` a serving engine's kernel (``cost.all_reduce_time`` at the link's alpha),
    ``"best"`` the cheapest of the three (one- and two-shot only up to ``cost.SHOT_MAX_BYTES``)."""
    ring = nccl_all_reduce(nbytes, t, link)[0]
    if algorithm == "ring":
        return ring
    if algorithm != "best":
        return all_reduce_time(nbytes, t, link.alpha, link.beta, algorithm)
    if nbytes > SHOT_MAX_BYTES:
        return ring
    return min(ring, *(all_reduce_time(nbytes, t, link.alpha, link.beta, a) for a in ("one_shot", "two_shot")))


@dataclass(frozen=True)
class ServingPrediction:
    """The budget per GPU and the predicted decode step (seconds) split into its roofline terms."""

    batch: int
    budget: MemoryBudget
    capacity_bytes: float
    max_sequences: int
    step_s: float
    compute_s: float
    memory_s: float
    comm_s: float
    ttft_s: float

    @property
    def fits(self) -> bool:
        return self.budget.total <= self.capacity_bytes

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of the whole TP group (one replica)."""
        return self.batch / self.step_s

    @property
    def bound(self) -> str:
        """The largest of the step's three terms: compute, memory (weights + KV cache) or the TP all-reduces."""
        terms = {"compute-bound": self.compute_s, "memory-bound": self.memory_s,
                 "communication-bound": self.comm_s}
        return max(terms, key=terms.get)


def serving_budget(config: GPTConfig | str, *, batch: int, context: int, weight_bytes: float = 2, tp: int = 1,
                   token_budget: int = TOKEN_BUDGET, headroom: float = 0.10) -> MemoryBudget:
    """Memory per GPU while serving ``batch`` sequences of ``context`` tokens: their weights and KV cache, and the
    workspace and communication buffers of one engine step of ``token_budget`` tokens spread over the ``batch``
    sequences (the step vLLM profiles; rounded up to whole tokens per sequence). A batch larger than the token
    budget cannot decode in one step: ``ValueError``."""
    check_count("batch", batch)
    check_count("token_budget", token_budget)
    if batch > token_budget:
        raise ValueError(f"batch={batch} sequences decode one token each per step, more than token_budget="
                         f"{token_budget} tokens a step; raise the token budget or lower the batch")
    held = inference_memory(config, batch=batch, context_len=context, prefill_chunk=1,
                            weight_bytes_per_param=weight_bytes, tp=tp, headroom=0)
    step = inference_memory(config, batch=batch, context_len=context, prefill_chunk=-(-token_budget // batch),
                            weight_bytes_per_param=weight_bytes, tp=tp, headroom=0)
    parts = {"weights": held["weights"], "kv_cache": held["kv_cache"], "workspace": step["workspace"],
             "communication": step["communication"]}
    parts["headroom"] = headroom * sum(parts.values())
    return MemoryBudget(parts, label=f"{held.label}, workspace: one {token_budget}-token step")


def predict(config: GPTConfig | str, gpu: str = "H100 80GB", *, batch: int = 1, context: int = 4096,
            quant: str = "bf16", tp: int = 1, link: str | None = None, headroom: float = 0.10,
            allreduce: AllReduceAlgorithm = "best", token_budget: int = TOKEN_BUDGET) -> ServingPrediction:
    """Memory per GPU (:func:`serving_budget`), max concurrent sequences and decode step time of ``config``
    served with TP ``tp``.

    ``gpu`` and ``link`` are keys of the hardware catalogue (``course_lib.estimates.hardware``); ``link=None`` is the
    GPU's own link inside a server (``GPU.intra_link``: NVLink 4 for an H100)."""
    c = PRESETS[config] if isinstance(config, str) else config
    card = hardware.gpu(gpu)
    lk = hardware.link(card.intra_link if link is None else link)
    if quant not in QUANTISATION:
        raise ValueError(f"unknown quantisation {quant!r}; choose one of {list(QUANTISATION)}")
    wb = QUANTISATION[quant]
    budget = serving_budget(c, batch=batch, context=context, weight_bytes=wb, tp=tp, token_budget=token_budget,
                            headroom=headroom)
    capacity = card.bytes
    kv_seq = kv_cache_bytes(c, context, 1, 2, tp)
    fixed = budget["weights"] + budget["workspace"] + budget["communication"]
    max_seqs = max(0, math.floor((capacity / (1 + headroom) - fixed) / kv_seq))
    peak, bw = card.peak_flops, card.mem_bandwidth
    n_rank = sum(params_per_rank(c, ParallelLayout(tp=tp)).values())
    flops = 2 * n_rank * batch + 4 * c.n_layer * c.d_model * context * batch / tp
    compute_s = flops / peak
    memory_s = (budget["weights"] + budget["kv_cache"]) / bw
    comm_s = 2 * c.n_layer * decode_all_reduce_time(batch * c.d_model * 2, tp, lk, allreduce)
    step = max(compute_s, memory_s) + comm_s
    ttft = 2 * n_rank * context / peak + 2 * c.n_layer * decode_all_reduce_time(context * c.d_model * 2, tp, lk,
                                                                                 allreduce)
    return ServingPrediction(batch, budget, capacity, max_seqs, step, compute_s, memory_s, comm_s, ttft)
