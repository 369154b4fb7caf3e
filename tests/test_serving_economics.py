"""Decode economics: the small-message all-reduce, the roofline with KV reads, the emulated device, and the
length check of generate()."""

from __future__ import annotations

import pytest
import torch

from course_lib.estimates import hardware
from course_lib.estimates.cost import all_reduce_time, collective_time
from course_lib.estimates.memory import inference_memory, kv_cache_bytes
from course_lib.model import GPT
from course_lib.model_config import PRESETS, GPTConfig, param_count
from course_lib.serving import roofline
from course_lib.serving.budget import decode_all_reduce_time, nccl_all_reduce, nccl_ring_times, predict, serving_budget
from course_lib.serving.engine import generate
from course_lib.serving.roofline import EmulatedClock, StepCost, StepWork

NVLINK = hardware.link(hardware.gpu("H100 80GB").intra_link)


def test_all_reduce_algorithms_hand_computed():
    a, b, v = 3e-6, 100e9, 16e3
    assert all_reduce_time(v, 8, a, b, "ring") == pytest.approx(14 * a + 14 * (v / 8) / b)
    assert all_reduce_time(v, 8, a, b, "ring") == collective_time("all_reduce", v, 8, a, b)
    assert all_reduce_time(v, 8, a, b, "one_shot") == pytest.approx(a + 7 * v / b)
    assert all_reduce_time(v, 8, a, b, "two_shot") == pytest.approx(2 * a + 2 * 7 / 8 * v / b)
    times = [all_reduce_time(v, 8, a, b, alg) for alg in ("ring", "one_shot", "two_shot")]
    assert all_reduce_time(v, 8, a, b) == min(times)
    assert all_reduce_time(v, 1, a, b) == 0.0
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'tree'"):
        all_reduce_time(v, 8, a, b, "tree")


def test_small_messages_pick_one_shot_large_ones_the_ring():
    a, b = NVLINK.alpha, NVLINK.beta
    small, large = 16e3, 1e9
    assert all_reduce_time(small, 8, a, b) == all_reduce_time(small, 8, a, b, "one_shot")
    assert all_reduce_time(large, 8, a, b) == all_reduce_time(large, 8, a, b, "ring")
    # one-shot latency barely grows with t; the ring's grows as 2(t-1)
    one = [all_reduce_time(small, t, a, b, "one_shot") for t in (2, 8)]
    ring = [all_reduce_time(small, t, a, b, "ring") for t in (2, 8)]
    assert one[1] / one[0] < 1.2 and ring[1] / ring[0] > 5


def test_nccl_ring_is_priced_at_the_protocol_nccls_model_picks():
    """tuning.cc's ring model, hand-computed: base + 2(t-1) hwLat + 2(t-1)/t V / (beta x share); LL wins a decode
    step's 16 kB (0.6 us a step over NVLink against Simple's 3.4), Simple wins a 64 MB prefill all-reduce."""
    v, b = 16384, NVLINK.beta
    times = nccl_ring_times(v, 8, NVLINK)
    assert times["LL"] == pytest.approx(6.6e-6 + 14 * (0.6e-6 + v / 8 / (0.5 * b)))
    assert times["Simple"] == pytest.approx(8.4e-6 + 14 * (3.4e-6 + v / 8 / b))
    assert times["LL128"] == pytest.approx(14e-6 + 14 * (1.9e-6 + v / 8 / (0.92 * b)))
    assert nccl_all_reduce(v, 8, NVLINK) == (times["LL"], "LL")
    assert nccl_all_reduce(4096 * v, 8, NVLINK)[1] == "Simple"
    assert nccl_all_reduce(v, 1, NVLINK)[0] == 0.0
    assert decode_all_reduce_time(v, 8, NVLINK, "ring") == times["LL"]
    # a link outside NCCL's tables: its own alpha for every protocol, no fixed cost
    plain = hardware.Link("fitted", 1e-6, b, "a test link")
    assert nccl_ring_times(v, 8, plain)["Simple"] == pytest.approx(collective_time("all_reduce", v, 8, 1e-6, b))


def test_tp8_decode_names_the_bound_that_dominates():
    """Priced at the protocol NCCL picks (LL), the ring's all-reduces no longer exceed the memory time at t = 8;
    the Simple protocol's latency (what the ring pays for large messages) would."""
    ring = predict("llama3-70b", "H100 80GB", batch=1, context=4096, tp=8, allreduce="ring")
    best = predict("llama3-70b", "H100 80GB", batch=1, context=4096, tp=8)
    simple = 2 * PRESETS["llama3-70b"].n_layer * nccl_ring_times(PRESETS["llama3-70b"].d_model * 2, 8, NVLINK)["Simple"]
    assert simple > ring.memory_s > ring.comm_s and ring.bound == "memory-bound"
    assert best.comm_s < ring.comm_s / 3 and best.bound == "memory-bound"
    # one sequence's inter-token latency keeps falling from t = 4 to t = 8, with either all-reduce
    for alg in ("ring", "best"):
        assert predict("llama3-70b", batch=1, tp=8, allreduce=alg).step_s < predict("llama3-70b", batch=1, tp=4,
                                                                                  allreduce=alg).step_s


def test_workspace_is_one_token_budget_step_so_capacity_does_not_shrink_with_the_batch():
    """Sized for the whole batch's prompts at once, capacity fell 126 -> 99 -> 72 as the batch grew 1 -> 32 -> 64;
    sized as engines profile it (one step of the token budget), it is the same at every batch that fits."""
    caps = {b: predict("llama3-70b", batch=b, context=4096, tp=4) for b in (1, 32, 64, 125, 126)}
    assert len({p.max_sequences for p in caps.values()}) == 1
    assert caps[125].fits and not caps[126].fits and caps[1].max_sequences == 125
    small, large = (serving_budget("llama3-70b", batch=32, context=4096, tp=4, token_budget=n) for n in (2048, 8192))
    for n, b in ((2048, small), (8192, large)):  # vLLM's profiling step: n tokens over the 32 sequences
        step = inference_memory("llama3-70b", batch=32, context_len=4096, prefill_chunk=n // 32, tp=4)
        assert (b["workspace"], b["communication"]) == (step["workspace"], step["communication"])
    assert large["kv_cache"] == small["kv_cache"] == kv_cache_bytes("llama3-70b", 4096, 32, 2, 4)
    with pytest.raises(ValueError, match="more than token_budget=16"):
        serving_budget("llama3-70b", batch=32, context=4096, token_budget=16)


def test_decode_bytes_per_token_and_intensity_include_the_kv_cache():
    c = PRESETS["llama3-8b"]
    cost = StepCost.for_model(c, "H100 80GB")
    b, ctx = 64, 4096
    work = StepWork(new_tokens=b, attended=b * (ctx + 1), cached_tokens=b * ctx, n_seqs=b)
    per_token = roofline.decode_bytes_per_token(cost.weight_bytes, cost.kv_bytes_per_token, b, ctx)
    assert per_token == pytest.approx((cost.bytes(work) - cost.kv_bytes_per_token * b) / b)
    # attention over the cache: 2 n_head / (n_kv x 2 bytes) = 2 x 32 / (8 x 2) = 4 FLOP/byte, whatever the batch
    assert roofline.attention_intensity(c) == 4.0
    ridge = roofline.ridge_point(cost.peak_flops, cost.mem_bandwidth)
    intensities = [roofline.decode_intensity(c, bb, ctx) for bb in (1, 64, 4096, 10**6)]
    assert intensities == sorted(intensities) and intensities[-1] < ridge  # never compute-bound at this context
    n, kv = param_count(c), kv_cache_bytes(c, 1)
    limit = (2 * n + 4 * c.n_layer * c.d_model * ctx) / (kv * ctx)
    assert intensities[-1] == pytest.approx(limit, rel=1e-3) and limit > roofline.attention_intensity(c)
    # the critical batch: the weights' 295 at no context, infinite past c = 2N / (I* kv - 4 L h) ~ 420 tokens
    crit = [roofline.decode_critical_batch(c, ctx_, cost.peak_flops, cost.mem_bandwidth) for ctx_ in (0, 128, 4096)]
    assert crit[0] == pytest.approx(roofline.critical_batch(cost.peak_flops, cost.mem_bandwidth, 2))
    assert crit[0] < crit[1] < float("inf") == crit[2]
    assert roofline.decode_intensity(c, round(crit[1]), 128) == pytest.approx(ridge, rel=1e-2)


def test_the_emulated_clock_lasts_the_modelled_time_at_least():
    cost = StepCost.for_model("llama3-8b", "H100 80GB")
    clock = EmulatedClock(cost)
    work = StepWork(1, 1, 0, 1)
    clock.step_begin()
    t0 = clock.now()
    clock.step_done(work)
    assert clock.now() - t0 >= cost(work) and clock.mode == "emulated device"
    slow = cost.slowed(10)
    assert slow(work) == pytest.approx(10 * cost(work))


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_generate_refuses_a_request_longer_than_the_context_for_every_position_type(pos):
    model = GPT(GPTConfig(seq_len=24, pos=pos)).eval()
    with pytest.raises(ValueError, match=r"prompt 0: 23 tokens \+ max_new_tokens=2 = 25 exceed the model's "
                                         rf"seq_len=24 \({pos} positions\)"):
        generate(model, [torch.zeros(23, dtype=torch.long)], 2)
    assert len(generate(model, [torch.zeros(22, dtype=torch.long)], 2)[0]) == 2
