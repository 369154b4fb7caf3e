"""Chapter 09's scheduler-step exercise: its check accepts a right step and rejects plausible wrong ones."""

from __future__ import annotations

import functools

import pytest

from course_lib.grading import ch09
from tests.grading_fixtures.ch09 import WRONG, _schedule

EXERCISE = next(e for e in ch09.EXERCISES if e.key == "schedule_step")


def ignores_the_batch_limit(running, waiting, token_budget, max_batch, free_blocks, block_size):
    return _schedule(running, waiting, token_budget, 10**6, free_blocks, block_size)


WRONG_STEPS = [*WRONG["schedule_step"], functools.partial(_schedule, return_blocks=False),  # blocks never back
               ignores_the_batch_limit]


def _passes(fn, check=ch09.check_schedule_step) -> bool:
    return check(fn).ok and all(check(fn, **kw).ok for kw in EXERCISE.hidden)


def test_the_check_accepts_a_right_step():
    assert _passes(ch09._schedule_step_reference, EXERCISE.check.unguarded)  # as an answer, the grader's own is refused
    assert _passes(_schedule)  # the fixtures' switchable step with every rule on: another implementation


@pytest.mark.parametrize("wrong", WRONG_STEPS, ids=lambda f: getattr(f, "__name__", "partial"))
def test_the_check_rejects_each_plausible_bug(wrong):
    assert not ch09.check_schedule_step(wrong).ok  # the visible cases already catch it


def test_a_wrong_return_shape_is_named():
    result = ch09.check_schedule_step(lambda *a: [(0, 1)])
    assert not result.ok and "must return (plan, preempted)" in result.message


def test_the_verify_check_accepts_the_rejection_rule_and_rejects_its_bugs():
    from course_lib.serving.speculative import accept_sampled

    exercise = next(e for e in ch09.EXERCISES if e.key == "verify_sampled")
    check = exercise.check.unguarded  # as an answer, the library's own is refused
    assert check(accept_sampled).ok
    assert all(check(accept_sampled, **kw).ok for kw in exercise.hidden)
    for wrong in WRONG["verify_sampled"]:
        result = ch09.check_verify_sampled(wrong)
        assert not result.ok, wrong.__name__


def test_the_paged_decode_reference_reads_what_the_librarys_paged_cache_wrote():
    """The check's reference (position by position through the table) against the library's PagedKVCache: three
    sequences grown turn by turn (their blocks interleaved in the pool), one decode query each."""
    import torch

    from course_lib.model_config import GPTConfig
    from course_lib.serving.paged import PagedKVCache

    cfg = GPTConfig(seq_len=32, n_head=4, n_kv_head=2, d_model=32)
    cache, lens, g = PagedKVCache(cfg, n_blocks=12, block_size=4), [6, 1, 11], torch.Generator().manual_seed(0)
    for step in range(max(lens)):
        for seq, n in enumerate(lens):
            if step < n:
                assert cache.reserve(seq, step + 1)
                cache.write(0, seq, step, torch.randn(2, 1, 8, generator=g), torch.randn(2, 1, 8, generator=g))
    tables = torch.zeros(3, 3, dtype=torch.long)
    for seq, table in cache.block_tables.items():
        tables[seq, :len(table)] = torch.tensor(table)
    q = torch.randn(3, 4, 8, generator=g)
    got = ch09._paged_attention(q, cache.k[0], cache.v[0], tables, torch.tensor(lens))
    for seq, n in enumerate(lens):
        k, v = cache.read(0, seq, n)
        want = torch.nn.functional.scaled_dot_product_attention(q[seq][:, None], k.repeat_interleave(2, 0),
                                                                v.repeat_interleave(2, 0))[:, 0]
        torch.testing.assert_close(got[seq], want)
