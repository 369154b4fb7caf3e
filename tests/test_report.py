"""The run record: every field the checklist asks for, computed one way, with bad input refused."""

import pytest

from course_lib import comm
from course_lib.estimates import cost
from course_lib.measure.report import Scaling, comm_summary, record_run
from course_lib.model_config import GPTConfig, param_count

CFG = GPTConfig()


def _rec(op, group, sent, seconds, kind=None):
    return comm.CommRecord(op, group, 2, sent, sent, sent, seconds, bytes_kind=kind)


def test_comm_summary_averages_per_step_and_keeps_the_bytes_kind():
    steps = [[_rec("all_reduce", "dp", 100, 0.01), _rec("all_reduce", "dp", 100, 0.03), _rec("send", "pp", 8, 0.0)],
             [_rec("all_reduce", "dp", 100, 0.02), _rec("all_reduce", "dp", 100, 0.02), _rec("send", "pp", 8, 0.0)]]
    s = comm_summary(steps)
    assert s["all_reduce@dp"] == {"calls": 2, "sent_bytes": 200, "bytes_kind": "modelled",
                                  "seconds": pytest.approx(0.04)}
    assert s["send@pp"]["bytes_kind"] == "measured" and s["send@pp"]["calls"] == 1


def test_record_uses_the_median_step_and_the_course_mfu():
    r = record_run(CFG, world_size=4, mesh={"dp": 2, "tp": 2}, global_batch=8, local_batch=4,
                   step_seconds=[0.5, 0.1, 0.2], peak_flops=1e12)
    assert r.step_s == 0.2 and r.tokens_per_step == 8 * CFG.seq_len
    assert r.tokens_per_s == pytest.approx(8 * CFG.seq_len / 0.2)
    assert r.mfu == pytest.approx(cost.mfu(r.tokens_per_s, param_count(CFG), 1e12, 4, CFG.n_layer, CFG.d_model,
                                           CFG.seq_len))
    text = r.table()
    for what in ("model", "code version", "topology", "batch", "throughput", "MFU", "scaling", "loss parity"):
        assert what in text
    assert "dp=2 x tp=2" in text and "not measured" in text


def test_scaling_names_its_kind_and_baseline():
    strong = Scaling("strong", baseline_ranks=1, baseline_step_s=1.0, ranks=4, step_s=0.3125)
    assert strong.efficiency == pytest.approx(0.8) and "strong scaling 80%" in str(strong)
    weak = Scaling("weak", baseline_ranks=1, baseline_step_s=1.0, ranks=4, step_s=1.25)
    assert weak.efficiency == pytest.approx(0.8) and "1-rank baseline" in str(weak)


@pytest.mark.parametrize("kwargs, needle", [(dict(step_seconds=[]), "step_seconds"),
                                            (dict(step_seconds=[0.0]), "step_seconds"),
                                            (dict(world_size=0), "world_size"),
                                            (dict(local_batch=True), "local_batch")])
def test_bad_input_is_named(kwargs, needle):
    args = dict(world_size=2, mesh={"dp": 2}, global_batch=8, local_batch=4, step_seconds=[0.1]) | kwargs
    with pytest.raises(ValueError, match=needle):
        record_run(CFG, **args)


def test_a_long_runs_checkpoint_restarts_and_stragglers_are_recorded():
    """The checklist's additions for long runs (chapter 10): the checkpoint's blocking time and bytes, the
    restarts with the resumed run's parity, the straggler verdict; absent ones are left out of the table."""
    plain = record_run(CFG, world_size=2, mesh={"dp": 2}, global_batch=4, local_batch=2, step_seconds=[0.1])
    assert not any(k in plain.table() for k in ("checkpoint", "restarts", "stragglers"))
    r = record_run(CFG, world_size=2, mesh={"dp": 2}, global_batch=4, local_batch=2, step_seconds=[0.1],
                   checkpoint_s=0.0125, checkpoint_bytes=3_000_000, restarts=1,
                   restart_parity="bit for bit the uninterrupted run", stragglers="rank 1 is the straggler")
    rows = dict(r.rows())
    assert rows["checkpoint"] == "12 ms blocking training, 3.00 MB per save"
    assert rows["restarts"] == "1; bit for bit the uninterrupted run"
    assert rows["stragglers"] == "rank 1 is the straggler"


@pytest.mark.parametrize("bad", [{"restarts": -1}, {"restarts": 1.5}, {"checkpoint_bytes": True},
                                 {"checkpoint_s": -0.1}, {"checkpoint_s": float("nan")}])
def test_a_long_runs_fields_refuse_nonsense(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        record_run(CFG, world_size=2, mesh={"dp": 2}, global_batch=4, local_batch=2, step_seconds=[0.1], **bad)
