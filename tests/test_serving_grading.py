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


def _passes(fn) -> bool:
    return ch09.check_schedule_step(fn).ok and all(
        ch09.check_schedule_step(fn, **kw).ok for kw in EXERCISE.hidden)


def test_the_check_accepts_a_right_step():
    assert _passes(ch09._schedule_step_reference)
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
    assert ch09.check_verify_sampled(accept_sampled).ok
    assert all(ch09.check_verify_sampled(accept_sampled, **kw).ok for kw in exercise.hidden)
    for wrong in WRONG["verify_sampled"]:
        result = ch09.check_verify_sampled(wrong)
        assert not result.ok, wrong.__name__


def _step(model, cache, tokens, start, rope_from_zero):
    """A cached step with the right mask and GQA; ``rope_from_zero`` rotates q and k at positions 0 .. n-1 of the
    step instead of start .. start+n-1 (the classic cached-RoPE bug)."""
    import torch
    import torch.nn.functional as F

    from course_lib.model import apply_rope, rope_cos_sin

    n, d = tokens.numel(), model.config.head_dim
    pos = torch.arange(start, start + n)
    x = model.tok_emb(tokens) + (model.pos_emb(pos) if model.pos_emb is not None else 0)
    for layer, blk in enumerate(model.blocks):
        a, h = blk.attn, blk.norm1(x)
        q, k, v = (p(h).view(n, -1, d).transpose(0, 1) for p in (a.q_proj, a.k_proj, a.v_proj))
        if a.rope:
            cos, sin = rope_cos_sin(0, d, positions=torch.arange(n) if rope_from_zero else pos)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(layer, 0, start, k, v)
        k, v = cache.read(layer, 0, start + n)
        rep = q.shape[0] // k.shape[0]
        mask = torch.arange(start + n)[None, :] <= pos[:, None]
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0),
                                           attn_mask=mask)
        x = x + a.o_proj(y.transpose(0, 1).reshape(n, -1))
        x = x + blk.mlp(blk.norm2(x))
    return model.lm_head(model.norm_f(x[-1]))


def test_the_step_check_needs_rope_at_absolute_positions():
    assert ch09.check_step_logits(functools.partial(_step, rope_from_zero=False)).ok
    result = ch09.check_step_logits(functools.partial(_step, rope_from_zero=True))
    assert not result.ok and "rope-gqa model" in result.message
