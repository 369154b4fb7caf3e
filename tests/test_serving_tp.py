"""Tensor-parallel decode on real gloo ranks: the same greedy tokens as one rank, the KV cache split (or, with
t > n_kv heads, replicated) as the formula says, two all-reduces per layer per step."""

from __future__ import annotations

import pytest
import torch

from course_lib.estimates import memory
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import Mesh
from course_lib.serving.engine import generate
from course_lib.serving.tp_decode import TPDecodeEngine, check_tp, kv_heads_of, tp_generate

CONFIGS = {
    "mha": GPTConfig(seq_len=32, n_head=4),
    "gqa2": GPTConfig(seq_len=32, n_head=4, n_kv_head=2, pos="rope", mlp="swiglu", norm="rmsnorm", bias=False),
    "mqa": GPTConfig(seq_len=32, n_head=4, n_kv_head=1),
}
NEW = 6


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g) for n in (2, 7, 11)]


def _reference(cfg):
    torch.set_num_threads(1)
    return generate(GPT(cfg, seed=0).eval(), _prompts(), NEW)


class RoundRobinKVHeads(TPDecodeEngine):
    """Mutation: KV heads dealt out round-robin (rank % n_kv) instead of replicated to the ranks whose query
    heads use them -- what splitting K/V "like the query heads" does when t > n_kv."""

    def kv_heads(self):
        return [self.rank % self.config.kv_heads]


def _cases(rank, world_size):
    out = {name: tp_generate(rank, world_size, cfg, _prompts(), NEW) for name, cfg in CONFIGS.items()}
    if world_size == 4:
        out["mutant"] = tp_generate(rank, world_size, CONFIGS["gqa2"], _prompts(), NEW, engine_cls=RoundRobinKVHeads)
        out["mesh"] = tp_generate(rank, world_size, CONFIGS["gqa2"], _prompts(), NEW, mesh=Mesh(dp=2, tp=2))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("t", [2, 4])
def test_tp_decode_matches_one_rank_and_splits_the_cache(t):
    results = launch(_cases, t, timeout=120)
    for name, cfg in CONFIGS.items():
        ref = _reference(cfg)
        prompts = _prompts()
        max_len = max(p.numel() for p in prompts) + NEW
        for rank, res in enumerate(results):
            got = res[name]
            assert got["tokens"] == ref, f"{name}, t={t}, rank {rank}"
            # measured bytes of the allocated cache == 2 L ceil(n_kv/t) d_head x 4 B x tokens x sequences
            assert got["cache_bytes"] == memory.kv_cache_bytes(cfg, max_len, len(prompts), kv_bytes=4, tp=t)
            steps = got["step_comm"]
            assert len(steps) == NEW  # one prefill + NEW - 1 decode steps
            for i, records in enumerate(steps):
                n_tokens = sum(p.numel() for p in prompts) if i == 0 else len(prompts)
                assert [r.op for r in records] == ["all_reduce"] * (2 * cfg.n_layer)
                assert all(r.tensor_bytes == n_tokens * cfg.d_model * 4 for r in records)
                assert all(r.sent_bytes == 2 * (t - 1) * n_tokens * cfg.d_model * 4 // t for r in records)
    if t == 4:
        ref = _reference(CONFIGS["gqa2"])
        assert any(r["mutant"]["tokens"] != ref for r in results), "un-replicated KV heads went unnoticed"
        assert all(r["mesh"]["tokens"] == ref for r in results)


def test_kv_heads_are_split_or_replicated():
    assert [kv_heads_of(r, 2, 8, 4) for r in range(2)] == [[0, 1], [2, 3]]
    assert [kv_heads_of(r, 4, 8, 2) for r in range(4)] == [[0], [0], [1], [1]]  # replicated twice each
    assert [kv_heads_of(r, 8, 8, 1) for r in range(8)] == [[0]] * 8
    assert memory.kv_cache_bytes(CONFIGS["gqa2"], 10, tp=4) == memory.kv_cache_bytes(CONFIGS["gqa2"], 10, tp=2)


def test_tp_shapes_that_cannot_be_split_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="n_head=4 is not divisible by t=3"):
        check_tp(CONFIGS["mha"], 3)
    with pytest.raises(ValueError, match="n_kv_head=2 and t=3"):
        check_tp(GPTConfig(n_head=6, n_kv_head=2, d_model=48, d_ff=192), 3)
    with pytest.raises(ValueError, match="d_ff=10 is not divisible by t=4"):
        check_tp(GPTConfig(d_ff=10), 4)
