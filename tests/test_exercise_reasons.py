"""The wrong answers to 07's batch-priority routing, 09's paged decode and 11's desync comparison and triage are
refused with the reason a learner needs: the mistake named (or, for the find-the-bug, the symptom), not only a
differing index."""

from __future__ import annotations

import pytest

from course_lib.grading import ch07, ch09, ch11, in_kernel
from tests.grading_fixtures import ch07 as fx07
from tests.grading_fixtures import ch09 as fx09
from tests.grading_fixtures import ch11 as fx11

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
    (ch11, "first_desync", fx11.desync_names_the_victims, "the victims); the culprit is the odd one out"),
    (ch11, "first_desync", fx11.desync_without_tie_break, "the tie is broken (by the other groups of the same axis"),
    (ch11, "first_desync", fx11.desync_late_is_missing, "has not finished is late, not wrong"),
    (ch11, "diagnose", fx11.diagnose_step_off_by_one, "step 0: off by one"),
    (ch11, "diagnose", fx11.diagnose_replaces_everything, "replace the broken part only"),
]


@pytest.mark.parametrize("module, key, wrong, reason", REASONS, ids=[r[2].__name__ for r in REASONS])
def test_the_refusal_names_the_mistake(module, key, wrong, reason):
    exercise = next(e for e in module.EXERCISES if e.key == key)
    result = in_kernel.grade_exercise(exercise, {exercise.function: wrong})
    assert not result.ok and reason in result.message, result.message


def test_the_colleagues_paged_decode_passes_their_test_and_fails_past_one_block():
    """The find-the-bug's stated symptom: right while every sequence fits in one block."""
    assert ch09.check_paged_decode(fx09.paged_blocks_reshaped_as_heads, lens=(3, 1, 4)).ok
    assert not ch09.check_paged_decode(fx09.paged_blocks_reshaped_as_heads).ok


@pytest.mark.slow  # a hang waited for: make test, not make test-fast
def test_triage_names_the_culprit_not_the_victims_and_calls_bf16_noise_no_bug():
    """The issue's two wrong diagnoses: the ranks that only wait in a hang named as culprits; a bf16 run's distance
    from one process called a bug."""
    victims = ch11.check_diagnose(fx11.diagnose_names_victims, cases=(("hang", (1, 0)),))
    assert not victims.ok and "only wait (victims)" in victims.message, victims.message
    noise = ch11.check_diagnose(fx11.diagnose_noise_as_bug, cases=(("bf16_noise", ()),))
    assert not noise.ok and "it is no bug" in noise.message, noise.message
