"""What one serving GPU holds and how fast it decodes: the inference budget turned into capacity and latency.

Memory (``course_lib.estimates.memory.inference_memory``, the article's inference budget): weights + KV cache +
workspace + communication + headroom. What is left after weights and workspace, divided by one sequence's KV cache,
is the number of sequences the GPU can keep in flight:

    max concurrent sequences = floor((capacity / (1 + headroom) - weights - workspace - comm) / kv_per_sequence)

Time of one decode step per GPU (roofline, :mod:`course_lib.serving.roofline`, plus TP's all-reduces):

    step = max(FLOPs / peak, (weights + KV cache) / bandwidth) + 2 L x all_reduce(batch x h x 2 bytes, t)

The all-reduce is priced by ``course_lib.estimates.cost.all_reduce_time``: by default the cheapest of the ring, one-shot
and two-shot algorithms (``allreduce="best"``: a decode step's few-kB all-reduce is latency-bound, and serving
engines use one-shot kernels whose latency barely grows with t); ``allreduce="ring"`` prices NCCL's ring.
Each sequence gets one token per step: inter-token latency = step; throughput = batch / step. Prefill of the
prompt is compute-bound: TTFT ~ 2 N x context / (t x peak) (no queueing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.estimates import hardware
from course_lib.estimates.cost import AllReduceAlgorithm, all_reduce_time
from course_lib.estimates.layout import ParallelLayout, params_per_rank
from course_lib.estimates.memory import inference_memory, kv_cache_bytes
from course_lib.estimates.memory_budget import MemoryBudget
from course_lib.model_config import PRESETS, GPTConfig

QUANTISATION: dict[str, float] = {"bf16": 2, "int8": 1, "int4": 0.5}
"""Bytes per weight. The KV cache stays bf16 here (2 bytes) whatever the weights."""


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


def predict(config: GPTConfig | str, gpu: str = "H100 80GB", *, batch: int = 1, context: int = 4096,
            quant: str = "bf16", tp: int = 1, link: str | None = None, headroom: float = 0.10,
            allreduce: AllReduceAlgorithm = "best") -> ServingPrediction:
    """Memory per GPU, max concurrent sequences and decode step time of ``config`` served with TP ``tp``.

    ``gpu`` and ``link`` are keys of the hardware catalogue (``course_lib.estimates.hardware``); ``link=None`` is the
    GPU's own link inside a server (``GPU.intra_link``: NVLink 4 for an H100)."""
    c = PRESETS[config] if isinstance(config, str) else config
    card = hardware.gpu(gpu)
    lk = hardware.link(card.intra_link if link is None else link)
    if quant not in QUANTISATION:
        raise ValueError(f"unknown quantisation {quant!r}; choose one of {list(QUANTISATION)}")
    wb = QUANTISATION[quant]
    budget = inference_memory(c, batch=batch, context_len=context, weight_bytes_per_param=wb, tp=tp,
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
    comm_s = 2 * c.n_layer * all_reduce_time(batch * c.d_model * 2, tp, lk.alpha, lk.beta, allreduce)
    step = max(compute_s, memory_s) + comm_s
    ttft = 2 * n_rank * context / peak + 2 * c.n_layer * all_reduce_time(context * c.d_model * 2, tp, lk.alpha,
                                                                          lk.beta, allreduce)
    return ServingPrediction(batch, budget, capacity, max_seqs, step, compute_s, memory_s, comm_s, ttft)
