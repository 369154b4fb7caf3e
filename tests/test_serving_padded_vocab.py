"""A padded vocabulary through every serving path: 200 real tokens padded to 256 rows (Megatron-LM's
``--make-vocab-size-divisible-by``). The engine must use the model's own head, whose padded logits are -inf, so
no path emits an id >= 200 and greedy output equals the uncached reference (the model's own forward) token for
token. With random weights an unmasked head picks a padding id within a few tokens on most prompts, so each test
here fails if the engine applies ``lm_head(norm_f(x))`` itself."""

from __future__ import annotations

import pytest
import torch

from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.runtime.launch import launch
from course_lib.serving.disagg import disaggregated_serve
from course_lib.serving.engine import Engine, Segment, generate, generate_uncached
from course_lib.serving.kv_cache import ContiguousKVCache
from course_lib.serving.kv_quant import Int8PagedKVCache
from course_lib.serving.loadgen import chat_trace, poisson_trace
from course_lib.serving.paged import PagedKVCache
from course_lib.serving.prefix_cache import PrefixCachingKVCache
from course_lib.serving.roofline import StepCost
from course_lib.serving.scheduler import Scheduler, SimClock
from course_lib.serving.speculative import draft_from_layers, speculative_generate
from course_lib.serving.tp_decode import tp_generate
from tests.test_serving import one_thread  # noqa: F401  (autouse: one thread for these tiny matrices)

VOCAB = 200
CFG = GPTConfig(vocab_size=VOCAB, make_vocab_size_divisible_by=128, seq_len=64, n_kv_head=2, pos="rope",
                mlp="swiglu", norm="rmsnorm", bias=False)
COST = StepCost.for_model("llama3-8b", "H100 80GB", overhead_s=1e-3)
NEW = 12
TRACE = dict(n=10, rate=400.0, vocab_size=VOCAB, short_prompt=(2, 6), long_prompt=(14, 20), output=(2, 16), seed=3)


@pytest.fixture(scope="module")
def model():
    return GPT(CFG, seed=1).eval()


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (1, 3, 5, 7, 9, 13)]


def _reference(model, requests):
    return {r.id: generate_uncached(model, r.prompt, r.max_new_tokens) for r in requests}


def _real_ids(outputs):
    return all(0 <= t < VOCAB for out in outputs for t in out)


def test_the_config_pads_and_the_reference_never_emits_padding(model):
    assert CFG.padded_vocab_size == 256 and model.lm_head.weight.shape[0] == 256
    assert _real_ids(generate_uncached(model, p, NEW) for p in _prompts())


def test_engine_logits_are_minus_inf_on_the_padding_for_both_returns(model):
    cache = ContiguousKVCache(CFG, 2, 16)
    for i in range(2):
        cache.reserve(i, 16)
    segments = [Segment(0, torch.arange(5), 0), Segment(1, torch.arange(3), 0)]
    last = Engine(model, cache).forward(segments)
    every = Engine(model, cache).forward([Segment(0, torch.arange(5), 0)], every_token=True)
    for logits in (last, every):
        assert logits.shape[-1] == 256
        assert torch.isneginf(logits[:, VOCAB:]).all() and torch.isfinite(logits[:, :VOCAB]).all()


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_batched_generation_equals_uncached_with_a_padded_vocabulary(model, cache):
    prompts = _prompts()
    kv = PagedKVCache(CFG, n_blocks=60, block_size=4) if cache == "paged" else None
    assert generate(model, prompts, NEW, cache=kv) == [generate_uncached(model, p, NEW) for p in prompts]


def test_sampling_and_the_int8_cache_never_emit_padding(model):
    """Temperature 3 flattens the softmax: 56 of 256 unmasked ids would take about a fifth of the draws."""
    prompts = _prompts()
    g = torch.Generator().manual_seed(0)
    assert _real_ids(generate(model, prompts, NEW, temperature=3.0, generator=g))
    assert _real_ids(generate(model, prompts, NEW, cache=Int8PagedKVCache(CFG, n_blocks=60, block_size=4)))


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_decoding_with_a_padded_vocabulary(model, k):
    prompt = _prompts()[3]
    draft = draft_from_layers(model, 1)
    assert speculative_generate(model, draft, prompt, NEW, k).tokens == generate_uncached(model, prompt, NEW)
    sampled = speculative_generate(model, draft, prompt, 40, k, temperature=3.0,
                                   generator=torch.Generator().manual_seed(0))
    assert _real_ids([sampled.tokens])


@pytest.mark.parametrize("cache", ["paged", "prefix"])
def test_scheduler_with_chunked_prefill_and_preemption_with_a_padded_vocabulary(model, cache):
    requests = chat_trace(3, 2, rate=200.0, system_len=12, user=(2, 5), answer=(2, 5), output=(2, 8),
                          think_s=0.01, vocab_size=VOCAB) if cache == "prefix" else poisson_trace(**TRACE)
    kv = PrefixCachingKVCache(CFG, n_blocks=24, block_size=4) if cache == "prefix" else \
        PagedKVCache(CFG, n_blocks=14, block_size=4)
    result = Scheduler(Engine(model, kv), max_batch=4, token_budget=6, clock=SimClock(COST)).run(requests)
    assert result.outputs() == _reference(model, requests)
    assert kv.hit_rate > 0 if cache == "prefix" else sum(len(s.preempted) for s in result.steps) > 0
    sampled = Scheduler(Engine(model, PagedKVCache(CFG, n_blocks=60, block_size=4)), max_batch=4,
                        clock=SimClock(COST), temperature=3.0).run(requests)
    assert _real_ids(sampled.outputs().values())


def _tp(rank, world_size):
    return tp_generate(rank, world_size, CFG, _prompts(), NEW, seed=1)["tokens"]


@pytest.mark.slow
def test_tensor_parallel_decode_with_a_padded_vocabulary(model):
    ref = [generate_uncached(model, p, NEW) for p in _prompts()]
    assert launch(_tp, 2, timeout=120) == [ref, ref]


@pytest.mark.slow
def test_disaggregated_serving_with_a_padded_vocabulary(model):
    requests = poisson_trace(**TRACE)  # every request wants >= 2 tokens: one prefilled, the rest decoded
    _, decode = launch(disaggregated_serve, 2, CFG, requests, seed=1, timeout=120)
    assert {r.id: r.tokens for r in decode["records"]} == _reference(model, requests)
