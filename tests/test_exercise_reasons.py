"""The wrong answers to 07's batch-priority routing and 09's paged decode are refused with the reason a learner
needs: the mistake named (or, for the find-the-bug, the symptom), not only a differing index."""

from __future__ import annotations

import pytest

from course_lib.grading import ch07, ch09, grader
from tests.grading_fixtures import ch07 as fx07
from tests.grading_fixtures import ch09 as fx09

REASONS = [
    (ch07, "batch_priority_routing", fx07.bpr_token_order, "token after token (the chapter's rule)"),
    (ch07, "batch_priority_routing", fx07.bpr_token_major, "every first choice is queued before any second"),
    (ch07, "batch_priority_routing", fx07.bpr_priority_by_logit, "the largest router probability"),
    (ch07, "batch_priority_routing", fx07.bpr_capacity_floor, "no expert kept more than 1 of its C"),
    (ch07, "batch_priority_routing", fx07.bpr_unstable_ties, "a tie: the earlier token goes first"),
    (ch09, "paged_decode", fx09.paged_blocks_reshaped_as_heads, "right for seq_lens none, wrong for 6, 1, 12, 3"),
    (ch09, "paged_decode", fx09.paged_without_the_new_token, "leaving out the new token's own position"),
    (ch09, "paged_decode", fx09.paged_whole_last_block, "the slots past seq_len hold what an earlier sequence"),
    (ch09, "paged_decode", fx09.paged_gqa_tiled, "a K/V head serves H / H_kv consecutive query heads"),
]


@pytest.mark.parametrize("module, key, wrong, reason", REASONS, ids=[r[2].__name__ for r in REASONS])
def test_the_refusal_names_the_mistake(module, key, wrong, reason):
    exercise = next(e for e in module.EXERCISES if e.key == key)
    result = grader.grade_exercise(exercise, {exercise.function: wrong})
    assert not result.ok and reason in result.message, result.message


def test_the_colleagues_paged_decode_passes_their_test_and_fails_past_one_block():
    """The find-the-bug's stated symptom: right while every sequence fits in one block."""
    assert ch09.check_paged_decode(fx09.paged_blocks_reshaped_as_heads, lens=(3, 1, 4)).ok
    assert not ch09.check_paged_decode(fx09.paged_blocks_reshaped_as_heads).ok
