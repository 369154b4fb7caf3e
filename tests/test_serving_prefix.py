"""Prefix caching: greedy equality with uncached generation (hits, misses, eviction under pressure, preemption),
block accounting, copy-on-write, and mutations (a hash without its prefix, a freed block still referenced)."""

from __future__ import annotations

import pytest
import torch

from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.serving import prefix_cache
from course_lib.serving.engine import Engine, generate_uncached
from course_lib.serving.loadgen import Request, chat_trace
from course_lib.serving.paged import PagedKVCache
from course_lib.serving.prefix_cache import PrefixCachingKVCache, block_hashes
from course_lib.serving.roofline import StepCost
from course_lib.serving.scheduler import Scheduler, SimClock

CFG = GPTConfig(seq_len=128, n_kv_head=2, pos="rope", mlp="swiglu", norm="rmsnorm", bias=False)
COST = StepCost.for_model("llama3-8b", "H100 80GB", overhead_s=1e-3)
CHATS = dict(n_chats=4, turns=3, rate=200.0, system_len=20, user=(2, 6), answer=(2, 6), output=(2, 8),
             think_s=0.01)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class CheckedScheduler(Scheduler):
    """Checks the cache's block accounting after every step (a prefix cache's check covers the references)."""

    def _step(self, items, preempted):
        record = super()._step(items, preempted)
        self.cache.check_no_leak()
        return record


def _serve(requests, cache, model, **kw):
    return CheckedScheduler(Engine(model, cache), clock=SimClock(COST), max_batch=kw.pop("max_batch", 4),
                            **kw).run(requests)


def _reference(model, requests):
    return {r.id: generate_uncached(model, r.prompt, r.max_new_tokens) for r in requests}


def test_hash_chain_depends_on_every_earlier_block():
    a, b = block_hashes([1, 2, 3, 4, 5, 6], 2), block_hashes([9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3 and a[0] != b[0] and a[1] != b[1]  # same tokens in block 1, different prefix
    assert block_hashes([1, 2, 3, 4, 5], 2) == a[:2]  # only full blocks are hashed


@pytest.mark.parametrize("n_blocks", [200, 24])
def test_prefix_cached_serving_is_greedy_equal_with_hits_and_no_leak(n_blocks):
    model = GPT(CFG, seed=0).eval()
    requests = chat_trace(**CHATS)
    cache = PrefixCachingKVCache(CFG, n_blocks=n_blocks, block_size=4)
    result = _serve(requests, cache, model)
    assert result.outputs() == _reference(model, requests)
    assert cache.hit_rate > 0.3
    assert not cache.block_tables
    cache.check_no_leak()
    if n_blocks == 24:  # under pressure: cached blocks were evicted, sequences preempted, tokens still exact
        assert cache.evictions > 0 and sum(len(s.preempted) for s in result.steps) > 0


def test_a_fully_cached_prompt_copies_its_last_block_on_write():
    model = GPT(CFG, seed=0).eval()
    prompt = torch.arange(8)  # two full blocks of 4
    requests = [Request(0, prompt, 3, 0.0), Request(1, prompt.clone(), 5, 1.0)]
    cache = PrefixCachingKVCache(CFG, n_blocks=16, block_size=4)
    result = _serve(requests, cache, model)
    assert result.outputs() == _reference(model, requests)
    assert cache.hit_tokens == 7 and cache.copies == 1  # the last token is recomputed into a private copy
    cache.check_no_leak()


def test_prefix_caching_lowers_ttft_and_memory_on_a_shared_system_prompt():
    """The same trace, the same scheduler, without and with prefix caching, on the simulated clock. The system
    prompt is 600 tokens, past the H100's critical batch (295): its prefill is compute-bound, so every position
    not recomputed is time saved (a prompt below it would cost one weight read either way)."""
    cfg = GPTConfig(seq_len=1024, pos="rope")
    model = GPT(cfg, seed=0).eval()
    requests = chat_trace(**{**CHATS, "n_chats": 3, "turns": 2, "system_len": 600})
    plain, cached = PagedKVCache(cfg, n_blocks=800, block_size=16), PrefixCachingKVCache(cfg, n_blocks=800,
                                                                                           block_size=16)
    a, b = _serve(requests, plain, model), _serve(requests, cached, model)
    assert a.outputs() == b.outputs()
    assert b.summary()["ttft_p50"] < a.summary()["ttft_p50"] and cached.hit_rate > 0.5
    assert max(s.in_use_tokens for s in b.steps) < max(s.in_use_tokens for s in a.steps)


def test_mutation_a_block_hash_that_ignores_its_prefix_is_caught(monkeypatch):
    """The second prompt repeats its first block: a hash of the block's tokens alone finds block 0 again for
    block 1 and hands positions 4..7 the K/V computed for positions 0..3, after another prefix (none). At
    initialisation the blocks barely move the logits (the embedding decides the argmax), so the blocks' matrices
    are scaled x5: the wrong K/V then shows in the tokens."""
    cfg = GPTConfig(seq_len=64)
    model = GPT(cfg, seed=0).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("blocks.") and p.dim() == 2:
                p.mul_(5)
    block = [50, 51, 52, 53]
    requests = [Request(0, torch.tensor([*block, 9]), 6, 0.0), Request(1, torch.tensor([*block, *block, 9]), 6, 1.0)]
    ref = _reference(model, requests)
    assert _serve(requests, PrefixCachingKVCache(cfg, n_blocks=16, block_size=4), model).outputs() == ref

    def tokens_only(tokens, block_size):
        return [hash(tuple(tokens[i * block_size:(i + 1) * block_size])) for i in range(len(tokens) // block_size)]

    monkeypatch.setattr(prefix_cache, "block_hashes", tokens_only)
    cache = PrefixCachingKVCache(cfg, n_blocks=16, block_size=4)
    assert _serve(requests, cache, model).outputs() != ref


class FreesReferencedBlocks(PrefixCachingKVCache):
    """Mutation: a sequence's end gives its blocks back whatever their reference count (others still read them)."""

    def free(self, seq):
        for b in self.block_tables.pop(seq):
            self.ref[b] = 0
            if b in self.hash_of:
                self.evictable[b] = None
            else:
                self.allocator.release([b])


def test_mutation_a_freed_block_still_referenced_is_caught():
    model = GPT(CFG, seed=0).eval()
    cache = FreesReferencedBlocks(CFG, n_blocks=200, block_size=4)
    with pytest.raises(AssertionError, match="block accounting broken"):
        _serve(chat_trace(**CHATS), cache, model)
