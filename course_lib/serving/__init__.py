"""Serving: a KV cache (contiguous and paged), an engine that runs the tiny GPT with it, a scheduler (static,
continuous, chunked prefill, preemption by recompute), a load generator, latency metrics, the roofline with KV
reads, tensor-parallel decode vs replicas, speculative decoding and prefix caching.

    kv_cache.py   the cache interface and the contiguous layout
    paged.py      fixed-size blocks, block tables, free list (vLLM's PagedAttention)
    engine.py     prefill and decode steps over a flat batch of segments; generation; the uncached reference
    scheduler.py  which sequences run each step; simulated, wall and emulated-device clocks
    prefix_cache.py  automatic prefix caching: block hash chain, reference counts, LRU eviction, copy-on-write
    speculative.py   speculative decoding: draft proposals, one target verification, KV rollback, rejection rule
    loadgen.py    a Poisson trace with mixed prompt and output lengths; multi-turn chats with a shared prompt
    metrics.py    TTFT, ITL, TPOT, end-to-end latency, throughput, percentiles
    roofline.py   the roofline with KV reads, the step cost model, decode on the emulated device
    tp_decode.py  tensor-parallel decode (heads and KV cache split over ranks) vs independent replicas
"""
