"""Tests for course_lib.viz.timeline: the interval arithmetic behind "hidden" and "exposed", the breakdown of a
synthetic step, the figure (one panel per run, two lanes per rank, its mode always stated), and the recording
wrapper on real ranks (it changes no result; it records what happened in each mode).

Timing is never asserted as a number (the machine is shared); only the structure of what was recorded: which
spans exist, how many collectives, their order inside the step."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import functools
import time

import pytest
import torch
from matplotlib.figure import Figure

from course_lib.data import global_batch
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel import dp
from course_lib.parallel.loop import StepTime
from course_lib.parallel.runs import RunResult, train_dp
from course_lib.runtime.launch import launch
from course_lib.train import TrainConfig
from course_lib.viz import timeline as tl
from course_lib.viz.timeline import Span

CFG = GPTConfig(bias=False)
SGD = TrainConfig(optimizer="sgd", steps=3)
BUCKET_MB = 0.1  # 4 buckets for the tiny GPT
MODES = ("naive", "bucketed", "overlapped")  # DataParallel's modes that reduce by themselves (not "scheduled")
DEVICE_FLOPS = 5e9  # an emulated device: the tiny GPT's backward of 4 rows then sleeps >= 12 ms
LINK_GBPS = 0.02  # an emulated link of 20 MB/s: 2 ranks' 535 kB of gradients take >= 27 ms per step on it


# ----------------------------------------------------------------------------------------------------------------
# Interval arithmetic


def test_union_merges_overlapping_and_touching_intervals():
    assert tl.union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert tl.union([]) == []
    assert tl.union_length([(0, 2), (1, 3), (10, 11)]) == 4


def test_intersection_length_counts_only_common_time():
    assert tl.intersection_length([(0, 10)], [(2, 3), (5, 7)]) == 3
    assert tl.intersection_length([(0, 1)], [(1, 2)]) == 0
    assert tl.intersection_length([(0, 4), (6, 9)], [(3, 7), (8, 20)]) == 1 + 1 + 1
    assert tl.intersection_length([], [(0, 1)]) == 0


def test_clip_and_minus_split_an_interval_into_hidden_and_exposed_parts():
    comm, compute = [(2, 8)], [(0, 5), (6, 7)]
    hidden, exposed = tl._clip(comm, compute), tl._minus(comm, compute)
    assert hidden == [(2, 5), (6, 7)]
    assert exposed == [(5, 6), (7, 8)]
    assert sum(b - a for a, b in hidden + exposed) == 6


def test_span_validates_kind_and_order():
    with pytest.raises(ValueError, match="unknown span kind"):
        Span(0, "idle", 0, 1)
    with pytest.raises(ValueError, match="before it starts"):
        Span(0, "forward", 2, 1)
    assert Span(0, "comm", 1.0, 1.5).seconds == 0.5


# ----------------------------------------------------------------------------------------------------------------
# A synthetic step


def _synthetic(step: int = 0, shift: float = 0.0, wait: float = 1.0) -> list[Span]:
    """rank 0: forward 0-2, backward 2-6, a bucket in flight 4-7 (2 s under backward, 1 s after), wait 6-7,
    optimizer 7-7.5. rank 1: input stall 0-1, then the same shifted by 1."""
    s = shift
    r0 = [Span(0, "forward", s + 0, s + 2, step), Span(0, "backward", s + 2, s + 6, step),
          Span(0, "comm", s + 4, s + 7, step, "bucket 0"), Span(0, "wait", s + 6, s + 6 + wait, step),
          Span(0, "optimizer", s + 6 + wait, s + 6.5 + wait, step)]
    r1 = [Span(1, "input", s + 0, s + 1, step)] + [Span(1, x.kind, x.start + 1, x.end + 1, step, x.label) for x in r0]
    return r0 + r1


def test_breakdown_separates_hidden_from_exposed_communication():
    spans = _synthetic()
    b0 = tl.breakdown(spans, 0, 0)
    assert (b0.compute, b0.comm, b0.hidden, b0.exposed, b0.input, b0.optimizer, b0.total) == (6, 3, 2, 1, 0, 0.5, 7.5)
    assert b0.hidden_fraction == pytest.approx(2 / 3)
    b1 = tl.breakdown(spans, 1, 0)
    assert (b1.input, b1.total, b1.hidden) == (1, 8.5, 2)
    assert "rank 1" in str(b1) and "input wait 1000 ms" in str(b1)
    with pytest.raises(ValueError, match="no spans"):
        tl.breakdown(spans, 2, 0)


def test_typical_step_is_the_median_one_and_skips_the_warm_up():
    spans = _synthetic(0, 0, wait=50) + _synthetic(1, 100, wait=1) + _synthetic(2, 200, wait=3) + \
        _synthetic(3, 300, wait=2)
    assert tl.typical_step(spans) == 3  # durations of steps 1..3: 8.5, 10.5, 9.5 -> median 9.5
    assert tl.typical_step(_synthetic(0)) == 0


def test_spans_from_step_times_lays_steps_end_to_end():
    res = [StepTime(0, 0.3, 0.1, 0.05, 0.2, 4, 100, [4]), StepTime(1, 0.2, 0.0, 0.05, 0.2, 4, 100, [4])]
    spans = tl.spans_from_step_times(res, rank=1)
    assert [(s.kind, s.step) for s in spans] == [("backward", 0), ("wait", 0), ("optimizer", 0),
                                                 ("backward", 1), ("wait", 1), ("optimizer", 1)]
    assert spans[3].start == pytest.approx(0.45) and spans[-1].end == pytest.approx(0.7)
    assert tl.breakdown(spans, 1, 0).exposed == pytest.approx(0.1)


# ----------------------------------------------------------------------------------------------------------------
# The figure


def test_plot_draws_one_panel_per_run_two_lanes_per_rank_and_states_its_mode():
    panels = {"bucketed": _synthetic(), "overlapped": _synthetic()}
    fig = tl.plot_timeline(panels, note="synthetic spans (test)")
    assert isinstance(fig, Figure)
    axes = [ax for ax in fig.axes if ax.get_yticklabels()]
    assert len(axes) == 2
    labels = [t.get_text() for t in axes[0].get_yticklabels()]
    assert labels == ["rank 0 compute", "rank 0 comm", "rank 1 compute", "rank 1 comm"]
    assert "synthetic spans (test)" in fig._suptitle.get_text()
    assert axes[1].get_title(loc="left").startswith("overlapped (step 0)")
    assert "(2000 hidden, 1000 exposed)" in axes[0].get_title(loc="left")
    hidden = [c for c in axes[0].collections if tuple(c.get_facecolor()[0][:3]) == matplotlib.colors.to_rgb(
        tl.COLORS["hidden"])]
    assert len(hidden) == 2  # one hidden-comm bar set per rank


def test_plot_refuses_a_figure_without_its_mode_or_data():
    with pytest.raises(ValueError, match="how the times were produced"):
        tl.plot_timeline({"x": _synthetic()}, note="")
    with pytest.raises(ValueError, match="no panels"):
        tl.plot_timeline({}, note="n")
    with pytest.raises(ValueError, match="no spans in step 5"):
        tl.plot_timeline({"x": _synthetic()}, note="n", step=5)


# ----------------------------------------------------------------------------------------------------------------
# Recording on real ranks


def _record_suite(rank: int, world_size: int) -> dict:
    out = {}
    for mode in MODES:
        out[mode] = tl.record_train_dp(rank, world_size, CFG, SGD, mode=mode, bucket_mb=BUCKET_MB)
        out["plain", mode] = train_dp(rank, world_size, CFG, SGD, mode=mode, bucket_mb=BUCKET_MB)
    for mode in MODES:
        out["slow", mode] = tl.record_train_dp(rank, world_size, CFG, SGD, mode=mode, bucket_mb=BUCKET_MB,
                                                link_gbps=LINK_GBPS)
    out["device"] = tl.record_train_dp(rank, world_size, CFG, SGD, mode="overlapped", bucket_mb=BUCKET_MB,
                                        model_fn=functools.partial(tl.EmulatedDeviceGPT, flops_per_s=DEVICE_FLOPS))
    out["stall"] = tl.record_train_dp(rank, world_size, CFG, SGD, mode="overlapped", bucket_mb=BUCKET_MB,
                                       input_delay_s={1: 0.05}, accumulation=2)
    return out


@functools.cache
def _runs() -> list[dict]:
    return launch(_record_suite, 2, timeout=180)


def _n_buckets() -> int:
    params = [p for p in GPT(CFG).parameters()][::-1]
    return len(dp.assign_buckets(params, int(BUCKET_MB * 2**20)))


@pytest.mark.usefixtures("no_leftover_ranks")
@pytest.mark.parametrize("mode", MODES)
def test_recording_changes_no_result(mode):
    for runs in _runs():
        rec, plain = runs[mode].result, runs["plain", mode]
        assert rec.losses == plain.losses
        assert all(torch.equal(rec.params[k], plain.params[k]) for k in plain.params)


@pytest.mark.parametrize("mode", MODES)
def test_recorded_spans_per_step(mode):
    n_params, n_buckets = len(list(GPT(CFG).parameters())), _n_buckets()
    for rank, runs in enumerate(_runs()):
        spans = runs[mode].spans
        assert {s.rank for s in spans} == {rank}
        for step in range(SGD.steps):
            mine = [s for s in spans if s.step == step]
            kinds = [s.kind for s in mine if s.kind != "comm"]
            assert kinds == ["forward", "backward", "wait", "optimizer"], kinds
            fwd, bwd, wait = (next(s for s in mine if s.kind == k) for k in ("forward", "backward", "wait"))
            assert fwd.end <= bwd.start + 1e-9 and bwd.end <= wait.start
            comms = [s for s in mine if s.kind == "comm"]
            assert len(comms) == (n_params if mode == "naive" else n_buckets)
            for c in comms:
                assert c.end <= wait.end + 1e-6  # complete before finish_gradient_sync returns
                if mode == "overlapped":
                    assert c.start >= fwd.end  # launched from the backward hooks
                else:
                    assert c.start >= wait.start  # launched after backward, inside the wait
            b = tl.breakdown(spans, rank, step)
            if mode != "overlapped":
                assert b.hidden == 0


@pytest.mark.parametrize("mode", MODES)
def test_an_emulated_link_delays_every_collective_by_its_bytes_and_keeps_the_result(mode):
    n_calls = len(list(GPT(CFG).parameters())) if mode == "naive" else _n_buckets()
    for runs in _runs():
        rec = runs["slow", mode]
        assert compare_equal(rec.result, runs["plain", mode])
        for step in range(SGD.steps):
            calls = [r for r in rec.result.step_comm[step] if r.op == "all_reduce"]
            comms = sorted((s for s in rec.spans if s.kind == "comm" and s.step == step), key=lambda s: s.start)
            assert len(calls) == len(comms) == n_calls
            # one collective at a time on the link: the k-th completes no earlier than k transfers after the first
            # was issued, each of its ring bytes over the emulated bandwidth
            elapsed = 0.0
            for rec_call, span in zip(calls, comms, strict=True):
                elapsed += rec_call.sent_bytes / (LINK_GBPS * 1e9)
                assert span.end - comms[0].start >= elapsed - 1e-4
                assert span.seconds >= rec_call.sent_bytes / (LINK_GBPS * 1e9) - 1e-4


def test_input_stall_is_recorded_once_per_step_on_the_stalled_rank_only():
    r0, r1 = (runs["stall"].spans for runs in _runs())
    assert not [s for s in r0 if s.kind == "input"]
    stalls = [s for s in r1 if s.kind == "input"]
    assert [s.step for s in stalls] == list(range(SGD.steps))
    assert all(s.seconds >= 0.05 for s in stalls)
    # two micro-batches per step: two forwards and two backwards, the first without communication
    for step in range(SGD.steps):
        assert [s.kind for s in r1 if s.step == step and s.kind in ("input", "forward", "backward")] == [
            "input", "forward", "backward", "forward", "backward"]


def compare_equal(a: RunResult, b: RunResult) -> bool:
    return a.losses == b.losses and all(torch.equal(a.params[k], b.params[k]) for k in b.params)


def test_link_bandwidth_must_be_positive():
    def body(rank, world_size):
        tl.RecordingDataParallel(GPT(CFG), link_gbps=0)

    with pytest.raises(ValueError, match="link_gbps"):
        launch(body, 1)


def _matmul_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("tok_emb", "pos_emb")))


def test_the_emulated_device_computes_what_gpt_computes_and_waits_for_its_flops():
    x, y = global_batch(0, 4, CFG.seq_len)
    ref, emu = GPT(CFG, 0), tl.EmulatedDeviceGPT(CFG, 0, flops_per_s=DEVICE_FLOPS)
    t0 = time.perf_counter()
    out = emu(x)
    t1 = time.perf_counter()
    lm_loss(out, y).backward()
    t2 = time.perf_counter()
    ref_out = ref(x)
    lm_loss(ref_out, y).backward()
    assert torch.equal(out, ref_out)
    for (name, p), q in zip(emu.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    forward_s = 2 * _matmul_params(ref) * x.numel() / DEVICE_FLOPS
    assert t1 - t0 >= forward_s
    assert t2 - t1 >= 2 * forward_s
    with pytest.raises(ValueError, match="flops_per_s"):
        tl.EmulatedDeviceGPT(CFG, 0, flops_per_s=0)


def test_on_the_emulated_device_training_is_unchanged_and_backward_lasts_its_flops():
    rows = SGD.global_batch // 2
    backward_s = 4 * _matmul_params(GPT(CFG)) * rows * CFG.seq_len / DEVICE_FLOPS
    for runs in _runs():
        assert compare_equal(runs["device"].result, runs["plain", "overlapped"])
        for s in (s for s in runs["device"].spans if s.kind == "backward"):
            assert s.seconds >= backward_s
