"""The int8 KV cache: bytes measured = the formula, the rounding error within its bound, greedy agreement with
the fp32 cache measured (not assumed)."""

from __future__ import annotations

import torch

from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.serving.engine import generate
from course_lib.serving.kv_quant import Int8PagedKVCache, dequantize, quantize
from course_lib.serving.paged import PagedKVCache

CFG = GPTConfig(seq_len=64, n_kv_head=2, pos="rope", mlp="swiglu", norm="rmsnorm", bias=False)


def test_quantisation_error_is_at_most_half_a_step():
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
    q, s = quantize(x)
    assert q.dtype == torch.int8 and s.shape == (3, 5, 1)
    assert ((dequantize(q, s) - x).abs() <= s / 2 + 1e-7).all()  # round to nearest: |error| <= scale / 2
    q0, s0 = quantize(torch.zeros(2, 8))
    assert (dequantize(q0, s0) == 0).all()


def test_int8_cache_bytes_measured_equal_the_formula_and_about_half_of_bf16():
    cache = Int8PagedKVCache(CFG, n_blocks=4, block_size=8)
    per_token = 2 * CFG.n_layer * CFG.kv_heads * (CFG.head_dim + 4)
    assert cache.bytes_per_token == per_token
    assert cache.allocated_bytes() == per_token * 4 * 8  # int8 values + fp32 scales, measured from the tensors
    bf16 = PagedKVCache(CFG, n_blocks=4, block_size=8, dtype=torch.bfloat16)
    assert bf16.allocated_bytes() / cache.allocated_bytes() == 2 * CFG.head_dim / (CFG.head_dim + 4)


def test_int8_cache_reads_what_was_written_within_the_bound():
    cache = Int8PagedKVCache(CFG, n_blocks=4, block_size=4)
    cache.reserve(0, 6)
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(CFG.kv_heads, 6, CFG.head_dim, generator=g) for _ in range(2))
    cache.write(0, 0, 0, k, v)
    k2, v2 = cache.read(0, 0, 6)
    bound = k.abs().amax(-1, keepdim=True) / 127 / 2 + 1e-6
    assert ((k2 - k).abs() <= bound).all() and ((v2 - v).abs() <= v.abs().amax(-1, keepdim=True) / 254 + 1e-6).all()


def test_greedy_agreement_with_the_fp32_cache_is_measured():
    """The int8 cache changes the logits by a little, so greedy tokens may part ways after a near-tie; the share of
    tokens identical before the first difference is measured, and only required to be most of them."""
    torch.set_num_threads(1)
    model = GPT(CFG, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (3, 9, 17)]
    ref = generate(model, prompts, 24, cache=PagedKVCache(CFG, n_blocks=40, block_size=4))
    got = generate(model, prompts, 24, cache=Int8PagedKVCache(CFG, n_blocks=40, block_size=4))
    agree = [next((i for i, (a, b) in enumerate(zip(r, q, strict=True)) if a != b), len(r)) for r, q in
             zip(ref, got, strict=True)]
    assert sum(agree) / sum(map(len, ref)) >= 0.5, agree
