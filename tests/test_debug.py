"""Chapter 11's instruments, each on a correct run (no alarm) and on an injected bug (named correctly), and each
with a mutation of the detector that makes its check fail (``*_mutation`` tests: the check itself can go red).

The clinic's broken runs end to end (symptom, diagnosis, fix) are in ``tests/test_debug_clinic.py``."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.debug import checksums, desync, drift, hang, nonfinite, recorder, watch
from course_lib.debug.clinic import CFG, bf16_model
from course_lib.debug.recorder import Entry, Trace
from course_lib.model import GPT
from course_lib.parallel.loop import observing
from course_lib.parallel.runs import train_dp, train_tp
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import MeshShape
from course_lib.train import TrainConfig, TrainResult, train_single

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------- the recorder


def _recorded(rank: int, world_size: int, capacity: int = 100, counting: type = recorder.FlightRecorder) -> dict:
    import os

    os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
    sub = comm.name_group(dist.new_group([0, 1]), "pair")
    rec = counting(capacity)
    t = torch.ones(6)
    with rec.recording():
        comm.all_reduce(t)
        comm.all_reduce(t, group=sub)
        comm.broadcast(t, 0)
        comm.all_gather(torch.empty(12), t, group=sub)
        work = comm.all_reduce(t, async_op=True)
        before_wait = rec.trace().entries[-1].end
        work.wait()
    torch_fr = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    return {"trace": rec.trace(), "before_wait": before_wait,
            "torch": [(e["profiling_name"].split(":")[1], e["collective_seq_id"]) for e in torch_fr["entries"]]}


def _check_recorder(results: list[dict]) -> None:
    for r, got in enumerate(results):
        entries = got["trace"].entries
        ours = [(e.op, e.group_seq) for e in entries]
        assert ours == [("all_reduce", 1), ("all_reduce", 1), ("broadcast", 2), ("all_gather", 2), ("all_reduce", 3)]
        # PyTorch's own Flight Recorder numbers each process group's collectives the same way
        assert [(op, seq) for op, seq in got["torch"] if op != "barrier"][-5:] == [
            ("all_reduce", 1), ("all_reduce", 1), ("broadcast", 2), ("all_gather", 2), ("all_reduce", 3)], r
        assert entries[3].shapes == ((6,), (12,)) and entries[3].dtype == "float32"
        assert entries[1].group == "pair" and entries[1].ranks == (0, 1)
        assert entries[0].site.startswith("test_debug.py:") and "_recorded" in entries[0].site
        assert got["before_wait"] is None and all(e.end is not None for e in entries)  # async: ends at wait()


def test_recorder_numbers_each_group_as_pytorch_flight_recorder_does():
    _check_recorder(launch(_recorded, 2))


class _OneCounter(recorder.FlightRecorder):
    """Mutation: one sequence number for every group (PyTorch's op_id, not the per-group collective_seq_id)."""

    def _started(self, record, group, tensors):
        super()._started(record, group, tensors)
        e = self._entries[-1]
        self._entries[-1] = Entry(e.seq, e.seq + 1, *list(e.__dict__.values())[2:])


def test_recorder_mutation():
    with pytest.raises(AssertionError):
        _check_recorder(launch(_recorded, 2, counting=_OneCounter))


def test_ring_buffer_keeps_the_last_entries():
    def body(rank, world_size):
        rec = recorder.FlightRecorder(capacity=3)
        with rec.recording():
            for _ in range(5):
                comm.all_reduce(torch.ones(1))
        return rec.trace()
    trace = launch(body, 2)[0]
    assert [e.group_seq for e in trace.entries] == [3, 4, 5] and trace.dropped == 2
    with pytest.raises(ValueError, match="capacity"):
        recorder.FlightRecorder(0)


# ---------------------------------------------------------------------------------------------- desync, hang

SITE = (("train.py", 10, "step"),)


def _e(seq, op, ranks, group="tp", shape=(4,), site=SITE, end=1.0, step=0, start=None):
    return Entry(seq, seq, op, group, tuple(ranks), (shape,), "float32", None, step, site,
                 float(seq) if start is None else start, end)


def _traces(calls: dict[int, list[Entry]], finished=()) -> list[Trace]:
    return [Trace(r, es, finished=r in finished) for r, es in calls.items()]


def _extra_gather_on_rank0() -> list[Trace]:
    """dp=2 x tp=2: rank 0 calls an all_gather on tp where every tp group calls an all_reduce."""
    ar = functools.partial(_e, op="all_reduce")
    calls = {r: [ar(1, ranks=(2 * (r // 2), 2 * (r // 2) + 1))] for r in range(4)}
    calls[0].append(_e(2, "all_gather", (0, 1), end=None, site=(("snap.py", 3, "after_step"),)))
    calls[1].append(ar(2, ranks=(0, 1), end=None))
    calls[2].append(ar(2, ranks=(2, 3)))
    calls[3].append(ar(2, ranks=(2, 3)))
    calls[2].append(_e(3, "all_reduce", (0, 2), group="dp", end=None))
    calls[3].append(_e(3, "all_reduce", (1, 3), group="dp", end=None))
    return _traces(calls)


def _check_desync(first_desync) -> None:
    same = {r: [_e(1, "all_reduce", (0, 1)), _e(2, "broadcast", (0, 1))] for r in range(2)}
    assert first_desync(_traces(same)) is None
    d = first_desync(_extra_gather_on_rank0())
    assert (d.group, d.ranks, d.position, d.kind, d.culprits, d.certain) == ("tp", (0, 1), 2, "op", (0,), True)
    # the same op and shape from another line (two same-sized all-reduces swapped): silent in the backend
    swapped = {0: [_e(1, "all_reduce", (0, 1, 2), site=(("a.py", 1, "f"),))],
               1: [_e(1, "all_reduce", (0, 1, 2), site=(("b.py", 2, "g"),))],
               2: [_e(1, "all_reduce", (0, 1, 2), site=(("a.py", 1, "f"),))]}
    d = first_desync(_traces(swapped))
    assert (d.kind, d.culprits) == ("call site", (1,))
    # a rank that returned without the last call (uneven data) is the one missing it; a late rank is not wrong
    uneven = {0: [_e(1, "all_reduce", (0, 1)), _e(2, "all_reduce", (0, 1), end=None)], 1: [_e(1, "all_reduce", (0, 1))]}
    d = first_desync(_traces(uneven, finished={1}))
    assert (d.kind, d.culprits, d.calls[1]) == ("missing", (1,), None)
    assert first_desync(_traces(uneven)) is None
    shapes = {0: [_e(1, "all_reduce", (0, 1), shape=(4,))], 1: [_e(1, "all_reduce", (0, 1), shape=(8,))]}
    d = first_desync(_traces(shapes))
    assert (d.kind, d.certain, d.culprits) == ("shape", False, (0, 1))


def test_desync_names_the_first_disagreement_and_its_culprit():
    _check_desync(desync.first_desync)


def test_desync_mutation(monkeypatch):
    monkeypatch.setattr(desync, "_reference", lambda *a: None)  # no tie-break from the other tp groups
    with pytest.raises(AssertionError):
        _check_desync(desync.first_desync)


def _check_hang(hang_report) -> None:
    report = hang_report(_extra_gather_on_rank0(), 4, {0: "  File x.py, line 3"})
    states = {s.rank: (s.state, s.waits_for) for s in report.ranks}
    assert states == {0: ("blocked", (1,)), 1: ("blocked", (0,)), 2: ("blocked", (0,)), 3: ("blocked", (1,))}
    assert report.root == (0,) and report.cycle and report.desync.culprits == (0,)
    assert "everyone waits for: rank(s) [0]" in str(report)
    uneven = {0: [_e(1, "all_reduce", (0, 1)), _e(2, "all_reduce", (0, 1), end=None)], 1: [_e(1, "all_reduce", (0, 1))]}
    report = hang_report(_traces(uneven, finished={1}), 2)
    assert report.root == (1,) and not report.cycle and report.ranks[1].state == "finished"
    report = hang_report(_traces({0: uneven[0]}), 3)  # rank 1 still running elsewhere, rank 2 without a dump
    assert [s.state for s in report.ranks] == ["blocked", "unknown", "unknown"] and report.root == (1,)


def test_hang_report_names_who_everyone_waits_for():
    _check_hang(hang.hang_report)


def test_hang_mutation(monkeypatch):
    real = hang._waits_for
    monkeypatch.setattr(hang, "_waits_for", lambda r, c, t: ((), "nobody") if r == 0 else real(r, c, t))
    with pytest.raises(AssertionError):
        _check_hang(hang.hang_report)


# -------------------------------------------------------------------------------------------------- checksums


def test_fingerprint_is_exact_and_sees_one_bit():
    g = torch.Generator().manual_seed(0)
    for t in (torch.randn(3, 5, generator=g), torch.randn(7, generator=g).bfloat16(), torch.randn(4).double(),
              torch.zeros(0), torch.arange(6)):
        assert checksums.fingerprint(t) == checksums.fingerprint(t.clone())
        if t.numel() and t.is_floating_point():
            flipped = t.clone()
            flipped.view(-1)[-1] = torch.nextafter(flipped.view(-1)[-1], torch.tensor(float("inf"), dtype=t.dtype))
            assert checksums.fingerprint(flipped) != checksums.fingerprint(t)
    assert checksums.fingerprint(torch.zeros(2, 3)) != checksums.fingerprint(torch.zeros(3, 2))
    big = torch.randn(1 << 20 | 5, generator=g)
    assert checksums.fingerprint(big) != checksums.fingerprint(torch.cat([big[:-1], big[-1:] * 2]))


def _tp_checked(rank, world_size, broken: bool, mutated: bool = False):
    from course_lib.debug.clinic import replicated_norm
    from course_lib.parallel.tp import gpt_plan

    if mutated:  # in this rank's process only: compare the tp shards as if they were replicas
        checksums.copy_key = lambda p, coords: ()

    plan = gpt_plan(CFG) | ({"blocks.*.norm1": replicated_norm} if broken else {})
    with observing(checksums.ReplicaChecksums(MeshShape(tp=world_size))) as checks:
        train_tp(rank, world_size, CFG, TrainConfig(steps=2, global_batch=4), sequence_parallel=True, plan=plan)
    return checks.reports


def _check_checksums(results_ok, results_bug) -> None:
    ok = results_ok[0]
    assert ok[0].compared >= 5 and not any(c.alarm for c in ok), [c.describe() for c in ok]
    bug = results_bug[0]
    assert not bug[0].alarm and bug[1].alarm  # before training the broadcast made the copies equal
    first = bug[1].mismatches[0]
    assert (bug[1].step, first.name, first.odd) == (0, "blocks.0.norm1.weight", (1,))
    assert [m.name for m in bug[1].mismatches] == [f"blocks.{i}.norm1.{w}" for i in (0, 1) for w in ("weight", "bias")]


def test_replica_checksums_quiet_on_tp_sp_and_name_the_unsummed_norm():
    _check_checksums(launch(_tp_checked, 2, False), launch(_tp_checked, 2, True))


def test_checksums_mutation():
    with pytest.raises(AssertionError):
        _check_checksums(launch(_tp_checked, 2, False, True), launch(_tp_checked, 2, True, True))


def test_checksum_majority_and_tie():
    rows = [(r, [("w", (), 7 if r != 2 else 8)]) for r in range(4)]
    assert checksums.compare(rows).mismatches == [checksums.Mismatch("w", (2,), (0, 1, 2, 3))]
    rows = [(0, [("w", (), 1)]), (1, [("w", (), 2)])]
    assert checksums.compare(rows).mismatches[0].odd == (1,)  # a tie: the copies unlike the lowest rank's
    assert checksums.same_batches([[1, 2], [1, 3]], [[0, 1]]) == [(0, [0, 1])]


# ------------------------------------------------------------------------------------------------------ drift


def _check_drift(test) -> None:
    tc = TrainConfig(steps=4, global_batch=8)
    for dtype in (torch.float32, torch.bfloat16):
        fn = GPT if dtype == torch.float32 else bf16_model
        ref = train_single(CFG, tc, fn, dtype=dtype)
        others = drift.noise_runs(CFG, tc, dtype=dtype, model_fn=fn)
        correct = train_single(CFG, tc, fn, accumulation=8, dtype=dtype)  # a correct run in an order not measured
        assert test(ref, correct, others).verdict == drift.NOISE, dtype
        wrong = train_single(CFG, TrainConfig(steps=4, global_batch=8, lr=1.2e-3), fn, dtype=dtype)  # lr x 1.2
        verdict = test(ref, wrong, others)
        assert (verdict.verdict, verdict.first_step) == (drift.BUG, 1), (dtype, verdict.describe())


def test_drift_separates_noise_from_a_bug_in_fp32_and_bf16():
    _check_drift(drift.drift_test)
    with pytest.raises(ValueError, match="same steps"):
        drift.drift_test(TrainResult([1.0], {}), TrainResult([1.0, 2.0], {}), [TrainResult([1.0], {})])


def test_drift_mutation():
    def unmeasured(ref, cand, others):  # mutation: no noise measured (the reference against itself): floor only
        return drift.drift_test(ref, cand, [TrainResult(ref.losses, ref.params)])
    with pytest.raises(AssertionError):
        _check_drift(unmeasured)


@pytest.mark.slow
def test_drift_false_alarm_rate_on_correct_runs_on_ranks():
    """20 seeds of a correct data-parallel run on 2 and on 4 ranks, in fp32 and in bf16: none called a bug, and the
    largest difference stays under half its tolerance (measured: 0.17 at most)."""
    def runs(rank, world_size, dtype):
        out = []
        for seed in range(20):
            tc = TrainConfig(steps=4, global_batch=8, seed=seed)
            res = train_dp(rank, world_size, CFG, tc, model_fn=None if dtype == torch.float32 else bf16_model)
            out.append(TrainResult(res.losses, res.params))
        return out
    single = {}  # (seed, dtype): the one-process run and its noise runs, the same for either world size
    for world_size in (2, 4):
        for dtype in (torch.float32, torch.bfloat16):
            fn = GPT if dtype == torch.float32 else bf16_model
            for seed, cand in enumerate(launch(runs, world_size, dtype, timeout=600)[0]):
                tc = TrainConfig(steps=4, global_batch=8, seed=seed)
                if (seed, dtype) not in single:
                    single[seed, dtype] = (train_single(CFG, tc, fn, dtype=dtype),
                                           drift.noise_runs(CFG, tc, dtype=dtype, model_fn=fn))
                verdict = drift.drift_test(single[seed, dtype][0], cand, single[seed, dtype][1])
                assert verdict.verdict == drift.NOISE, (world_size, dtype, seed, verdict.describe())
                assert max(*verdict.ratios, verdict.param_ratio) < 0.5, (world_size, dtype, seed, verdict.describe())


# -------------------------------------------------------------------------------------------- non-finite


def _nan_on(rank, world_size, bad_rank, watch_backward=True):
    from course_lib.debug.clinic import MaskedMeanDP, Sampler

    class NoBackward(nonfinite.NonFiniteWatch):  # mutation: forward and reduced values only
        def _forward_hook(self, name):
            hook = super()._forward_hook(name)
            return lambda m, a, out: hook(m, a, out.detach() if isinstance(out, torch.Tensor) else out)

    w = nonfinite.NonFiniteWatch() if watch_backward else NoBackward()
    with observing(w):
        train_dp(rank, world_size, CFG, TrainConfig(steps=3, global_batch=8), data_parallel=MaskedMeanDP,
                 sampler=Sampler(8, CFG.seq_len, empty=(bad_rank, 1)))
    return w.first


def _check_nonfinite(found: list) -> None:
    first = nonfinite.first_nonfinite(found)
    assert [(f.rank, f.step, f.phase, f.module) for f in first] == [(1, 1, "backward", "lm_head")]
    assert found[0].phase == "reduced gradient"  # rank 0 only received it


def test_first_nonfinite_names_the_rank_that_made_it():
    _check_nonfinite(launch(_nan_on, 2, 1))
    assert nonfinite.first_nonfinite([None, None]) == []


def test_nonfinite_mutation():
    with pytest.raises(AssertionError):
        _check_nonfinite(launch(_nan_on, 2, 1, False))


# ------------------------------------------------------------------------------------------------- watch


def test_watch_reports_a_hang_with_every_ranks_state(no_leftover_ranks):
    def stuck(rank, world_size):
        t = torch.ones(3)
        comm.all_reduce(t)
        if rank == 0:
            comm.all_reduce(t)  # rank 1 returns: rank 0 waits forever
        return rank
    w = watch.run(stuck, 2, instruments=watch.Instruments(stall_s=0.5), timeout=4)
    assert w.reports is None and w.hang.root == (1,)
    assert [s.state for s in w.hang.ranks] == ["blocked", "finished"]
    assert w.desync.culprits == (1,) and w.desync.kind == "missing"
    with pytest.raises(RuntimeError, match="did not finish"):
        _ = w.results
