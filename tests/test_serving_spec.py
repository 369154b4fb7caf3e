"""Speculative decoding: greedy output identical to the target's, KV rollback, and the rejection rule's output
distribution equal to the target's (chi-square tests with a stated false-alarm rate)."""

from __future__ import annotations

import pytest
import torch

from course_lib.grading.ch09 import chi2_pvalue, emitted_counts, target_and_draft
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.serving import speculative
from course_lib.serving.engine import generate_uncached
from course_lib.serving.roofline import StepCost, StepWork
from course_lib.serving.speculative import (
    accept_sampled,
    check_draft,
    draft_from_layers,
    expected_tokens_per_verification,
    speculative_generate,
)
from tests.grading_fixtures.ch09 import verify_ratio_upside_down, verify_residual_from_p

CONFIGS = {
    "mha-learned": GPTConfig(seq_len=48, n_layer=4),
    "gqa-rope-swiglu": GPTConfig(seq_len=48, n_layer=4, n_kv_head=2, pos="rope", mlp="swiglu", norm="rmsnorm",
                                 bias=False),
}
ALPHA = 1e-3
"""False-alarm rate of each chi-square test: a correct rule fails it with probability 1e-3 on a fresh stream of
draws (the generators are seeded, so a given run is deterministic)."""


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompt(n, seed=0, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_greedy_speculative_output_is_the_targets_greedy_output(name, k):
    target = GPT(CONFIGS[name], seed=1).eval()
    prompt = _prompt(5)
    ref = generate_uncached(target, prompt, 24)
    for n_layer in (1, 2):
        res = speculative_generate(target, draft_from_layers(target, n_layer), prompt, 24, k)
        assert res.tokens == ref, (n_layer, k)
        assert sum(res.proposed) <= k * res.target_steps


@pytest.mark.parametrize("k", [1, 3, 4])
def test_draft_equal_to_the_target_accepts_everything(k):
    target = GPT(CONFIGS["mha-learned"], seed=2).eval()
    prompt = _prompt(4)
    res = speculative_generate(target, draft_from_layers(target, target.config.n_layer), prompt, 20, k)
    assert res.tokens == generate_uncached(target, prompt, 20)
    assert res.acceptance_rate == 1.0
    # every verification but the last (cut short by max_new_tokens) emits k + 1 = the formula at a = 1
    assert all(n == k + 1 for n in (a + 1 for a in res.accepted[:-1]))
    assert expected_tokens_per_verification(1.0, k) == k + 1


def test_mutation_a_cache_not_rolled_back_after_a_rejection_is_caught(monkeypatch):
    target = GPT(CONFIGS["mha-learned"], seed=1).eval()
    prompt = _prompt(5)
    ref = generate_uncached(target, prompt, 24)
    draft = draft_from_layers(target, 1)
    assert speculative_generate(target, draft, prompt, 24, 3).tokens == ref
    monkeypatch.setattr(speculative._Model, "rollback", lambda self, n_keep: None)  # keeps the rejected K/V
    try:
        got = speculative_generate(target, draft, prompt, 24, 3).tokens
    except (RuntimeError, ValueError):  # or the positions run out: nothing left to feed
        got = None
    assert got != ref


def test_expected_tokens_per_verification_formula():
    assert expected_tokens_per_verification(0.0, 4) == 1.0
    assert expected_tokens_per_verification(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_verification(0.8, 3) == pytest.approx(sum(0.8**i for i in range(4)))
    with pytest.raises(ValueError, match="0 <= a <= 1"):
        expected_tokens_per_verification(1.5, 2)


def test_a_mismatched_draft_is_named():
    target = GPT(GPTConfig(seq_len=48), seed=0).eval()
    with pytest.raises(ValueError, match=r"draft vocabulary \(128 tokens\) differs from the target's \(256\)"):
        check_draft(target, GPT(GPTConfig(seq_len=48, vocab_size=128)))
    with pytest.raises(ValueError, match=r"draft context seq_len=32 is shorter than the target's \(48\)"):
        speculative_generate(target, GPT(GPTConfig(seq_len=32)), _prompt(3), 4, 2)
    with pytest.raises(ValueError, match="exceed the target's seq_len=48"):
        speculative_generate(target, None, _prompt(40), 9, 0)
    with pytest.raises(ValueError, match=r"n_layer must be in 1\.\.2"):
        draft_from_layers(target, 3)


# ------------------------------------------------------------------------------------------ rejection sampling


def _rule_pvalues(rule, n: int = 20000, vocab: int = 4, k: int = 2, seed: int = 0) -> list[float]:
    """p-values of the tokens emitted at each position i = 0 .. k (k: the bonus) against p[i] (the grader's
    sampling)."""
    g = torch.Generator().manual_seed(seed)
    p, q = target_and_draft(vocab, k, g)
    return [chi2_pvalue(counts, p[i]) for i, counts in enumerate(emitted_counts(rule, p, q, n, g))]


def test_rejection_sampling_emits_the_targets_distribution():
    assert min(_rule_pvalues(accept_sampled)) > ALPHA


@pytest.mark.parametrize("mutant", [verify_ratio_upside_down, verify_residual_from_p])
def test_mutations_of_the_rejection_rule_are_caught(mutant):
    assert min(_rule_pvalues(mutant)) < ALPHA


def test_sampled_speculative_decoding_draws_from_the_target_end_to_end():
    """A GPT with an 8-token vocabulary: the first two emitted tokens of seeded speculative sampling (draft = the
    first layer, k = 2) against the target's exact probabilities, p(t1) and sum_t1 p(t1) p(t2 | t1)."""
    cfg = GPTConfig(seq_len=16, n_layer=2, vocab_size=8, d_model=32)
    target = GPT(cfg, seed=3).eval()
    with torch.no_grad():  # sharpen the logits so that draft and target differ visibly
        target.lm_head.weight.mul_(40)
    draft, prompt = draft_from_layers(target, 1), _prompt(3, vocab=8)
    with torch.no_grad():
        p1 = torch.softmax(target(prompt[None])[0, -1].double(), -1)
        p2 = sum(p1[t] * torch.softmax(target(torch.cat([prompt, torch.tensor([t])])[None])[0, -1].double(), -1)
                 for t in range(8))
    g = torch.Generator().manual_seed(0)
    first, second = torch.zeros(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    accepted = 0
    for _ in range(1500):
        res = speculative_generate(target, draft, prompt, 2, 2, temperature=1.0, generator=g)
        first[res.tokens[0]] += 1
        second[res.tokens[1]] += 1
        accepted += res.accepted[0]
    assert 0 < accepted < 1500  # the draft is rejected sometimes: the residual draw is exercised
    assert chi2_pvalue(first, p1) > ALPHA and chi2_pvalue(second, p2) > ALPHA


def test_emulated_device_time_is_the_sum_of_the_step_costs():
    target = GPT(CONFIGS["mha-learned"], seed=1).eval()
    cost = StepCost.for_model("llama3-8b", "H100 80GB").slowed(0.05)  # 20x faster: short sleeps
    res = speculative_generate(target, draft_from_layers(target, 1), _prompt(5), 12, 2, cost_target=cost,
                               cost_draft=cost)
    assert res.device_s >= (res.target_steps + res.draft_steps) * cost(StepWork(1, 1, 0, 1))
    assert res.wall_s >= res.device_s  # the emulated clock sleeps at least the modelled time
