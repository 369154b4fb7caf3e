"""Serving, measured: continuous vs static batching on one mixed-length trace, and TP = 2 decode vs one rank.

1. **Batching.** The same Poisson trace (mixed prompt lengths, outputs of 2-60 tokens, fixed seed) served by the
   tiny GPT with a paged KV cache under static and continuous batching, twice: on the **simulated** clock (each
   step costs what the same step costs Llama 3 8B on an H100 by the roofline, + 1 ms; deterministic) and on the
   **wall-clock** of this machine (real step times, arrivals replayed in real time). Columns: throughput
   (output tokens / s), p99 TTFT, p99 ITL; the ratio continuous / static. Goal: throughput ratio >= 1.5.
2. **TP decode.** Wall-clock median seconds of one decode step of a wider GPT (d_model 256, 8 heads, 2 layers) at
   batch 1 and at a large batch, on one rank and with TP = 2 (two all-reduces per layer), and the time spent in
   the all-reduces. Per-token time of a sequence = the step time; TP / one rank < 1 means TP lowers the
   inter-token latency. At batch 1 the step is latency-bound by the 2L all-reduces (gloo's ~100 us per ring step),
   so TP loses; the compute per rank halves with TP and grows with the batch, so the ratio falls as the batch grows
   and crosses 1 where half the compute saved exceeds the all-reduces' cost (the crossover). On GPUs decode is
   memory-bound and NCCL's latency is a few us, so the crossover is at batch 1 already for large models (see
   ``course_lib.serving.budget.predict``).
3. **Speculative decoding.** Greedy, draft = the first layer of an 8-layer GPT, on the emulated device (target
   steps cost Llama 3 8B's on an H100, draft steps its first 4 layers', both slowed 10x) and on the wall clock:
   acceptance rate, tokens per verification, speed-up at each k and the best one.
4. **Prefix caching.** Multi-turn chats with a shared 512-token system prompt, without and with automatic prefix
   caching, simulated clock and wall clock: hit rate, TTFT p50 / p99 ratio (goal >= 2x lower), peak KV memory.

5. **Disaggregated prefill / decode** on 2 real ranks (prefill rank -> K/V over isend/recv -> decode rank) against
   2 colocated replicas (whole prompts, and chunked at 256 tokens) on a trace with 1200-1800-token prompts, the
   simulated clock of Llama 3 8B on H100s and an InfiniBand NDR link for the transfer: K/V bytes moved (measured =
   formula), TTFT p50 / p99 and ITL p99 of each.

Run: ``python benchmarks/serving_bench.py [--requests 32 --big-batch 64]`` (about a minute on 2 idle cores).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from course_lib import data
from course_lib.model import GPT
from course_lib.model_config import PRESETS, GPTConfig
from course_lib.runtime.launch import launch
from course_lib.serving.disagg import colocated_serve, disaggregated_serve, kv_transfer_bytes
from course_lib.serving.engine import Engine
from course_lib.serving.loadgen import chat_trace, poisson_trace
from course_lib.serving.metrics import summarize
from course_lib.serving.paged import PagedKVCache
from course_lib.serving.prefix_cache import PrefixCachingKVCache
from course_lib.serving.roofline import StepCost
from course_lib.serving.scheduler import Scheduler, SimClock, WallClock
from course_lib.serving.speculative import draft_from_layers, speculative_generate, speedup_vs_k
from course_lib.serving.tp_decode import decode_step_times


def batching(n_requests: int, rate: float, seed: int) -> None:
    torch.set_num_threads(1)
    cfg = GPTConfig(seq_len=128)
    model = GPT(cfg, seed=0).eval()
    trace = poisson_trace(n_requests, rate, short_prompt=(4, 16), long_prompt=(32, 64), output=(2, 60), seed=seed)
    print(f"batching: {n_requests} requests, Poisson {rate:g}/s, max_batch 8, paged cache (blocks of 16)")
    print(f"{'clock':>11} {'policy':>11} {'tokens/s':>9} {'TTFT p99':>10} {'ITL p99':>9}")
    for label, make_clock in (("simulated", lambda: SimClock(StepCost.for_model("llama3-8b", "H100 80GB",
                                                                                    overhead_s=1e-3))),
                              ("wall-clock", WallClock)):
        summaries = {}
        for policy in ("static", "continuous"):
            cache = PagedKVCache(cfg, n_blocks=400, block_size=16)
            s = Scheduler(Engine(model, cache), policy=policy, max_batch=8, clock=make_clock()).run(trace).summary()
            summaries[policy] = s
            print(f"{label:>11} {policy:>11} {s['throughput_tok_s']:9.0f} {s['ttft_p99'] * 1e3:8.1f}ms "
                  f"{s['itl_p99'] * 1e3:7.2f}ms")
        c, st = summaries["continuous"], summaries["static"]
        print(f"{label:>11} continuous / static: throughput {c['throughput_tok_s'] / st['throughput_tok_s']:.2f}x, "
              f"p99 TTFT {c['ttft_p99'] / st['ttft_p99']:.2f}x")


def tp_decode(big_batch: int, steps: int) -> None:
    cfg = GPTConfig(seq_len=64, n_head=8, d_model=256, n_layer=2)
    batches = [1, big_batch]
    one = launch(decode_step_times, 1, cfg, batches, mode="replicas", steps=steps, timeout=300)[0]
    tp = launch(decode_step_times, 2, cfg, batches, steps=steps, timeout=300)[0]
    print(f"\nTP decode (wall-clock, d_model {cfg.d_model}, {cfg.n_layer} layers, medians of {steps} steps)")
    print(f"{'batch':>6} {'one rank':>10} {'TP=2':>10} {'all-reduce':>11} {'TP/one':>7}")
    for i, b in enumerate(batches):
        print(f"{b:6d} {one['step_s'][i] * 1e3:8.2f}ms {tp['step_s'][i] * 1e3:8.2f}ms "
              f"{tp['allreduce_s'][i] * 1e3:9.2f}ms {tp['step_s'][i] / one['step_s'][i]:7.2f}")


def speculative(slow: float = 10) -> None:
    torch.set_num_threads(1)
    target = GPT(GPTConfig(seq_len=128, n_layer=8), seed=0).eval()
    draft, prompt = draft_from_layers(target, 1), data.encode("The cat sat on ")
    cost_t = StepCost.for_model("llama3-8b", "H100 80GB").slowed(slow)
    cost_d = StepCost.for_model(dataclasses.replace(PRESETS["llama3-8b"], n_layer=4), "H100 80GB").slowed(slow)
    print("\nspeculative decoding (greedy, outputs == the target's; emulated device = Llama 3 8B on an H100, "
          f"{slow:g}x slower)")
    rows = speedup_vs_k(target, draft, prompt, 48, [1, 2, 3, 4, 6], cost_t, cost_d)
    for r in rows:
        print(f"k={r['k']}: a {r['acceptance']:.2f}, tokens/verification {r['tokens_per_verification']:.2f} "
              f"(formula {r['formula']:.2f}), speed-up emulated {r['speedup_measured']:.2f}x "
              f"(modelled {r['speedup_modelled']:.2f}x)")
    best = max(rows, key=lambda r: r["speedup_measured"])
    base = speculative_generate(target, None, prompt, 48, 0).wall_s
    wall = base / speculative_generate(target, draft, prompt, 48, best["k"]).wall_s
    print(f"best k={best['k']}: {best['speedup_measured']:.2f}x on the emulated device at acceptance "
          f"{best['acceptance']:.2f}; wall clock of this CPU at that k: {wall:.2f}x")


def prefix_caching() -> None:
    torch.set_num_threads(1)
    cfg = GPTConfig(seq_len=1024, pos="rope")
    model = GPT(cfg, seed=0).eval()
    chats = chat_trace(8, 3, rate=20.0, system_len=512, user=(16, 48), answer=(32, 96), output=(8, 24),
                       think_s=0.2, seed=0)
    print("\nprefix caching: 8 chats x 3 turns, 512-token shared system prompt, blocks of 16")
    for label, make_clock in (("simulated", lambda: SimClock(StepCost.for_model("llama3-8b", "H100 80GB",
                                                                                    overhead_s=1e-3))),
                              ("wall-clock", WallClock)):
        out = {}
        for name, cls in (("paged", PagedKVCache), ("prefix", PrefixCachingKVCache)):
            cache = cls(cfg, n_blocks=600, block_size=16)
            res = Scheduler(Engine(model, cache), max_batch=8, clock=make_clock()).run(chats)
            out[name] = (res.summary(), max(s.in_use_tokens for s in res.steps), getattr(cache, "hit_rate", 0.0))
        (a, mem_a, _), (b, mem_b, hit) = out["paged"], out["prefix"]
        print(f"{label:>11}: hit rate {hit:.0%}, TTFT p50 {a['ttft_p50'] / b['ttft_p50']:.2f}x lower, p99 "
              f"{a['ttft_p99'] / b['ttft_p99']:.2f}x lower, peak KV positions {mem_a} -> {mem_b}")


def disaggregation() -> None:
    cfg = GPTConfig(seq_len=2048, pos="rope")
    trace = poisson_trace(16, rate=100.0, short_prompt=(4, 32), long_prompt=(1200, 1800), p_long_prompt=0.25,
                          output=(8, 32), seed=0)
    prefill, decode = launch(disaggregated_serve, 2, cfg, trace, timeout=600)
    assert prefill["sent_bytes"] == decode["received_bytes"]
    formula = sum(kv_transfer_bytes(cfg, r.prompt.numel()) for r in trace)
    print(f"\ndisaggregated prefill/decode (simulated, Llama 3 8B on H100s, InfiniBand NDR): K/V moved "
          f"{decode['received_bytes']} B measured, {formula} B by the formula")
    rows = {"disaggregated": summarize(decode["records"])}
    for label, budget in (("colocated", None), ("colocated, chunked 256", 256)):
        rows[label] = summarize([r for rank in launch(colocated_serve, 2, cfg, trace, token_budget=budget,
                                                      timeout=600) for r in rank])
    for label, s in rows.items():
        print(f"{label:>23}: TTFT p50 {s['ttft_p50'] * 1e3:6.1f} ms p99 {s['ttft_p99'] * 1e3:6.1f} ms, "
              f"ITL p99 {s['itl_p99'] * 1e3:5.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=300.0)
    ap.add_argument("--big-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    batching(args.requests, args.rate, args.seed)
    tp_decode(args.big_batch, args.steps)
    speculative()
    prefix_caching()
    disaggregation()


if __name__ == "__main__":
    main()
