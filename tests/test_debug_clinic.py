"""The clinic's broken runs show their symptom deterministically (same step, same rank, same collective or tensor,
on every run, whatever the load: nothing here depends on timing but the hang's timeout), and each fix restores
parity with one process (the bf16 case: noise by the drift test, never a bug)."""

from __future__ import annotations

import pytest

from course_lib.debug import clinic, drift
from course_lib.debug.checksums import same_batches
from course_lib.debug.watch import Watched
from course_lib.train import compare, train_baseline

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _alarm(w: Watched) -> tuple:
    c = w.checksum_alarm()
    return (c.step, c.mismatches[0].name, c.mismatches[0].odd) if c else None


def _symptom(case: clinic.Case, w: Watched) -> clinic.Diagnosis:
    """What the instruments show, as a diagnosis (the bug class read off the case: this checks the symptom)."""
    a = case.answer
    if case.key == "hang":
        d = w.hang.desync
        call = d.calls[d.culprits[0]]
        assert w.hang.root == d.culprits and w.hang.cycle
        return clinic.Diagnosis(a.bug, d.culprits, call.step, f"{call.op} on {call.group}")
    if case.key in ("partial_not_summed", "dropout_rng", "no_broadcast"):
        step, name, odd = _alarm(w)
        return clinic.Diagnosis(a.bug, a.ranks if case.key == "partial_not_summed" else odd, step, name)
    if case.key == "non_finite":
        (first,) = [f for f in (r.nonfinite for r in w.reports) if f is not None and f.phase == "backward"]
        return clinic.Diagnosis(a.bug, (first.rank,), first.step, first.module)
    assert _alarm(w) is None  # the rest keep their replicas equal
    verdict = case.drift(w)[2]
    if case.key == "same_data":
        dup = same_batches([r.batches for r in w.reports], [list(range(case.world_size))])
        assert [i for i, _ in dup] == list(range(case.tc.steps))
    if case.key == "skipped_batch":
        resumed = [r.batches for r in w.reports]
        fixed = [r.batches for r in case.run(fixed=True).reports]
        assert resumed[0][0] != fixed[0][0] and resumed[0][0] == _batch_after(case, 0)
    if verdict.verdict == drift.NOISE:
        return clinic.Diagnosis(clinic.NO_BUG)
    return clinic.Diagnosis(a.bug, a.ranks, verdict.first_step)


def _batch_after(case: clinic.Case, rank: int) -> int:
    from course_lib.debug.checksums import fingerprint

    x, _ = clinic.Sampler(case.tc.global_batch, clinic.CFG.seq_len, case.tc.seed)(case.resume_at + 1, rank,
                                                                                   case.world_size)
    return fingerprint(x)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(clinic.CASES))
def test_each_broken_run_shows_its_symptom(key, no_leftover_ranks):
    case = clinic.CASES[key]()
    assert _symptom(case, case.run()) == case.answer


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("key", [k for k in clinic.CASES if k != "bf16_noise"])
def test_each_fix_restores_parity(key):
    case = clinic.CASES[key]()
    w = case.run(fixed=True)
    assert w.hang is None and _alarm(w) is None
    assert not any(r.nonfinite for r in w.reports)
    base = train_baseline(clinic.CFG, case.tc, case.model_fn)
    report = compare(base.from_step(case.resume_at or 0), case.result(w))
    assert report.ok, report


@pytest.mark.slow
def test_bf16_fails_the_fp32_rule_and_is_noise_by_its_own():
    case = clinic.bf16_noise()
    ref, got, verdict = case.drift(case.run())
    fp32_rule = compare(ref, got, noise=train_baseline(clinic.CFG, case.tc).noise)
    assert not fp32_rule.ok and fp32_rule.worst_ratio > 100
    assert verdict.verdict == drift.NOISE


def test_hidden_variants_move_the_answer():
    assert clinic.no_broadcast(4, (2,)).answer.ranks == (2,)
    assert clinic.hang(only_rank=3, after=2).answer == clinic.Diagnosis(clinic.HANG, (3,), 2, "all_gather on tp")
    assert clinic.non_finite(0, 1).answer.ranks == (0,)
    with pytest.raises(KeyError):
        clinic.CASES["nope"]
