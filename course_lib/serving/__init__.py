"""Serving: a KV cache (contiguous and paged), an engine that runs the tiny GPT with it, a scheduler (static,
continuous, chunked prefill, preemption by recompute), a load generator, latency metrics, the roofline, and
tensor-parallel decode vs replicas.

    kv_cache.py   the cache interface and the contiguous layout
    paged.py      fixed-size blocks, block tables, free list (vLLM's PagedAttention)
    engine.py     prefill and decode steps over a flat batch of segments; generation; the uncached reference
    scheduler.py  which sequences run each step; simulated and wall clocks
    loadgen.py    a Poisson trace with mixed prompt and output lengths
    metrics.py    TTFT, ITL, TPOT, end-to-end latency, throughput, percentiles
    roofline.py   the roofline, the step cost model, micro-benchmarks of this machine
    tp_decode.py  tensor-parallel decode (heads and KV cache split over ranks) vs independent replicas
"""
