"""Pipeline schedules: the bubble formulas hold exactly in simulation, validation catches broken orders, and our
orders are torch.distributed.pipelining's.

Costs: ``(cost_f, cost_b)`` = (1, 2) is the usual backward = 2 x forward; (1, 1) equal costs. Split backwards
use cost_w = cost_b / 2 unless said, so the default costs give F = I = W = 1.
"""

import itertools
import math

import pytest

from course_lib.parallel.schedule_run import peak_in_flight, simulate
from course_lib.parallel.schedules import (
    Action,
    Kind,
    ScheduleError,
    add_send_recv,
    gpipe,
    interleaved_groups,
    interleaved_one_f_one_b,
    one_f_one_b,
    validate,
    zb_h1,
)

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741
COSTS = [(1.0, 2.0), (1.0, 1.0)]


def order(schedule: list[list[Action]]) -> list[list[str]]:
    return [[str(a) for a in actions] for actions in schedule]


def test_action_notation_is_torchs() -> None:
    assert str(Action(F, 0, 1)) == "1F0"
    assert str(Action(Kind.SEND_B, 3, 2)) == "2SEND_B3"
    assert Action(Kind.SEND_F, 0, 1).peer_stage == 2
    assert Action(Kind.RECV_B, 0, 1).peer_stage == 2
    assert Action(Kind.RECV_F, 0, 1).peer_stage == 0
    assert Action(F, 0, 1).peer_stage is None


def test_small_orders_by_hand() -> None:
    assert order(gpipe(2, 2)) == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]
    assert order(one_f_one_b(3, 4)) == [
        ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"],
        ["1F0", "1F1", "1B0", "1F2", "1B1", "1F3", "1B2", "1B3"],
        ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"],
    ]
    assert order(zb_h1(2, 3)) == [
        ["0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0I2", "0W2"],
        ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1W2"],
    ]


@pytest.mark.parametrize(("cost_f", "cost_b"), COSTS)
@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
def test_gpipe_and_1f1b_bubble_is_exact(build, cost_f: float, cost_b: float) -> None:
    for p in range(1, 7):
        for m in range(1, 13):  # m < p included
            sim = simulate(build(p, m), cost_f, cost_b)
            assert sim.makespan == pytest.approx((m + p - 1) * (cost_f + cost_b), rel=1e-12)
            assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12, abs=1e-15)
            assert sim.bubble_ratio == pytest.approx((p - 1) / m, rel=1e-12, abs=1e-15)  # Megatron's form


@pytest.mark.parametrize(("cost_f", "cost_b"), COSTS)
def test_interleaved_bubble_is_v_times_smaller(cost_f: float, cost_b: float) -> None:
    checked = 0
    for p in range(1, 6):
        for m in range(p, 4 * p + 1, p):
            for v in range(1, 5):
                sim = simulate(interleaved_one_f_one_b(p, m, v), cost_f, cost_b)  # costs per chunk
                assert sim.bubble_ratio == pytest.approx((p - 1) / (v * m), rel=1e-12, abs=1e-15), (p, m, v)
                assert sim.makespan == pytest.approx((v * m + p - 1) * (cost_f + cost_b), rel=1e-12)
                checked += 1
    assert checked == 5 * 4 * 4


def torch_accepts(p: int, m: int) -> bool:
    """torch 2.13's ScheduleInterleaved1F1B: max(1, m // p) rounds of equal size must divide m."""
    return m % max(1, m // p) == 0


def test_interleaved_groups() -> None:
    """torch's rounds and Megatron-Core's microbatch_group_size_per_vp_stage, by hand (p = 4)."""
    assert interleaved_groups(4, 8) == [4, 4] == interleaved_groups(4, 8, group=4)  # Megatron-LM's groups of p
    assert interleaved_groups(4, 6) == [6] and interleaved_groups(4, 10) == [5, 5]
    assert interleaved_groups(4, 3) == [3]  # m < p: one group, smaller than p
    assert interleaved_groups(4, 10, group=5) == [5, 5] and interleaved_groups(4, 10, group=6) == [6, 4]
    assert interleaved_groups(4, 10, group=10) == [10]
    accepted = [m for m in range(1, 25) if torch_accepts(4, m)]
    assert [m for m in range(1, 25) if m not in accepted] == [9, 11, 13, 14, 17, 18, 19, 21, 22, 23]


@pytest.mark.parametrize(("cost_f", "cost_b"), COSTS)
def test_interleaved_bubble_holds_for_every_grouping_of_at_least_p(cost_f: float, cost_b: float) -> None:
    """m not a multiple of p: torch's rounds and every Megatron-Core group size it accepts keep (p-1)/(v m), exactly,
    as long as every group holds at least p micro-batches; a group of fewer than p (m < p) leaves the ranks waiting
    on each other: a larger bubble than the formula's."""
    checked = 0
    for p in range(2, 6):
        for v in (2, 3):
            for m in range(p, 4 * p + 2):
                groupings = [None] * torch_accepts(p, m) + [n for n in range(p, m + 1) if m % n == 0 or m % n >= p]
                for group in groupings:
                    sim = simulate(interleaved_one_f_one_b(p, m, v, group), cost_f, cost_b)
                    assert sim.bubble_ratio == pytest.approx((p - 1) / (v * m), rel=1e-12), (p, m, v, group)
                    checked += 1
            for m in range(1, p):
                sim = simulate(interleaved_one_f_one_b(p, m, v), cost_f, cost_b)
                assert sim.bubble_ratio > (p - 1) / (v * m) * (1 + 1e-9), (p, m, v)
    assert checked == 418


def test_zb_h1_bubble_is_a_third_of_1f1b_with_equal_costs() -> None:
    """F = I = W = 1 (cost_b = 2, cost_w = 1): bubble (p-1) * 1 against 1F1B's (p-1) * 3, for m >= p."""
    for p in range(2, 7):
        for m in range(p, 3 * p + 1):
            zb = simulate(zb_h1(p, m), cost_f=1, cost_b=2, cost_w=1)
            ref = simulate(one_f_one_b(p, m), cost_f=1, cost_b=2)
            zb_bubble = p * zb.makespan - sum(zb.busy)
            ref_bubble = p * ref.makespan - sum(ref.busy)
            assert zb_bubble / p == pytest.approx(p - 1)
            assert zb_bubble / ref_bubble == pytest.approx(1 / 3)
            assert zb.bubble_ratio == pytest.approx((p - 1) / (3 * m))


@pytest.mark.parametrize(("t_f", "t_i", "t_w"), [(1, 1, 1), (1, 1, 0.5), (1, 2, 1), (2, 1, 1), (1.5, 2, 0.25)])
def test_zb_h1_bubble_formula_holds_when_w_is_the_cheapest(t_f: float, t_i: float, t_w: float) -> None:
    """Qi et al.'s (p-1)(t_f + t_i - t_w) is exact in simulation for t_w <= min(t_f, t_i) and m >= p."""
    for p in (2, 3, 5):
        for m in (p, 2 * p + 1):
            sim = simulate(zb_h1(p, m), cost_f=t_f, cost_b=t_i + t_w, cost_w=t_w)
            assert sim.makespan == pytest.approx(m * (t_f + t_i + t_w) + (p - 1) * (t_f + t_i - t_w))


def test_zb_h1_formula_breaks_outside_its_conditions() -> None:
    """W dearer than I: the delayed W's no longer fit in the bubble. m < p: the critical path is longer."""
    p, m = 4, 8
    t_f, t_i, t_w = 1, 1, 2
    sim = simulate(zb_h1(p, m), cost_f=t_f, cost_b=t_i + t_w, cost_w=t_w)
    assert sim.makespan > m * (t_f + t_i + t_w) + (p - 1) * (t_f + t_i - t_w)
    assert simulate(zb_h1(4, 2)).makespan > 2 * 3 + 3


def test_peak_in_flight() -> None:
    p = 4
    for m in (2, 4, 8):
        assert peak_in_flight(gpipe(p, m)) == [m] * p
        assert peak_in_flight(one_f_one_b(p, m)) == [min(p - r, m) for r in range(p)]
        assert peak_in_flight(zb_h1(p, m)) == [min(p, m)] * p  # 1F1B's peak (rank 0's), counting until W
    for v in (2, 3):
        expected = [2 * (p - 1 - r) + (v - 1) * p + 1 for r in range(p)]  # chunk activations, 1/v of a stage
        assert peak_in_flight(interleaved_one_f_one_b(p, 8, v)) == expected
        # m = 6 runs as one group of 6: a longer warm-up, more in flight than m = 8's groups of 4
        want = [min(2 * (p - 1 - r) + (v - 1) * 6 + 1, 6 * v) for r in range(p)]
        assert peak_in_flight(interleaved_one_f_one_b(p, 6, v)) == want
        assert all(a > b for a, b in zip(want, expected, strict=True))
    assert simulate(one_f_one_b(3, 6)).peak_in_flight == [3, 2, 1]


def test_every_builder_passes_validation() -> None:
    for p in range(1, 6):
        for m in range(1, 11):
            validate(gpipe(p, m), p, m)
            validate(one_f_one_b(p, m), p, m)
            validate(zb_h1(p, m), p, m)
            if torch_accepts(p, m):
                for v in (1, 2, 3):
                    validate(interleaved_one_f_one_b(p, m, v), p, m, v)


def test_simulated_timeline_respects_dependencies() -> None:
    comm = 0.25
    sim = simulate(interleaved_one_f_one_b(2, 4, 2), cost_f=1, cost_b=2, comm=comm)
    p, n_stages = 2, 4
    end = {a: e for rank in sim.timeline for _, e, a in rank}
    for r, rank in enumerate(sim.timeline):
        for (_, prev_end, _), (start, _, _) in itertools.pairwise(rank):
            assert start >= prev_end  # one action at a time
        for start, _, a in rank:
            if a.kind is F and a.stage > 0:
                hop = comm if (a.stage - 1) % p != r else 0
                assert start >= end[Action(F, a.microbatch, a.stage - 1)] + hop
            if a.kind is B:
                assert start >= end[Action(F, a.microbatch, a.stage)]
                if a.stage < n_stages - 1:
                    hop = comm if (a.stage + 1) % p != r else 0
                    assert start >= end[Action(B, a.microbatch, a.stage + 1)] + hop


def test_gpipe_with_communication_pays_two_waves_of_hops() -> None:
    for p in (2, 3, 4):
        for m in (1, 4, 8):
            sim = simulate(gpipe(p, m), cost_f=1, cost_b=2, comm=0.5)
            assert sim.makespan == pytest.approx((m + p - 1) * 3 + 2 * (p - 1) * 0.5)


def test_per_stage_costs() -> None:
    m = 6
    uniform = simulate(one_f_one_b(3, m), per_stage_costs=[(1, 2, 1)] * 3)
    assert uniform.timeline == simulate(one_f_one_b(3, m)).timeline
    slow = simulate(one_f_one_b(3, m), per_stage_costs=[(1, 2, 1), (2, 4, 2), (1, 2, 1)])
    assert slow.busy == [m * 3, m * 6, m * 3]
    assert slow.makespan >= 1 + m * 6 + 2  # stage 0's first F, all of the slow stage's work, stage 0's last B
    assert slow.bubble_fraction > uniform.bubble_fraction
    with pytest.raises(ValueError, match="one \\(cost_f, cost_b, cost_w\\) per stage"):
        simulate(one_f_one_b(3, m), per_stage_costs=[(1, 2, 1)] * 2)
    with pytest.raises(ValueError, match="cost_w <= cost_b"):
        simulate(zb_h1(2, 2), cost_b=1, cost_w=2)


# ------------------------------------------------------------------------------------------- validation


def replace(schedule: list[list[Action]], rank: int, actions: list[str]) -> list[list[Action]]:
    """A copy of ``schedule`` whose list for ``rank`` is given in torch's notation ("1F0")."""
    kinds = {k.value: k for k in Kind}

    def parse(text: str) -> Action:
        stage, rest = text[0], text[1:]
        kind = rest.rstrip("0123456789")
        return Action(kinds[kind], int(rest[len(kind) :]), int(stage))

    return [[parse(t) for t in actions] if r == rank else list(a) for r, a in enumerate(schedule)]


@pytest.mark.parametrize(
    ("rank0", "rank1", "message"),
    [
        (["0B0", "0F0", "0F1", "0B1"], None, "0B0 runs before 0F0"),
        (["0F0", "0F1", "0B0"], None, "stage 0, micro-batch 1 needs one backward"),
        (["0F0", "0F1", "0B0", "0B1", "0B1"], None, "appears twice"),
        (["0F0", "0F1", "0B0", "0B1", "0I1", "0W1"], None, "needs one backward: either 0B1, or 0I1 and 0W1"),
        (["0F0", "0F1", "0B0", "1B1"], None, "lives on rank 1"),
        (["0F0", "0F1", "0F2", "0B0", "0B1"], None, "out of range"),
        (["0F0", "0F1", "0B0", "0W1", "0I1"], ["1F0", "1F1", "1B0", "1I1", "1W1"], "0W1 runs before 0I1"),
    ],
)
def test_validation_rejects_broken_orders(rank0: list[str], rank1: list[str] | None, message: str) -> None:
    broken = replace(gpipe(2, 2), 0, rank0)
    if rank1 is not None:
        broken = replace(broken, 1, rank1)
    with pytest.raises(ScheduleError, match=message):
        validate(broken, 2, 2)


def test_validation_finds_a_deadlock_that_each_rank_alone_cannot_see() -> None:
    """Rank 0's B0 waits for rank 1's B0, which comes after rank 1's F1, which waits for rank 0's F1."""
    schedule = replace(replace(one_f_one_b(2, 2), 0, ["0F0", "0B0", "0F1", "0B1"]), 1, ["1F1", "1F0", "1B0", "1B1"])
    with pytest.raises(
        ScheduleError, match=r"deadlock: .*rank 0 at 0B0 \(waits for 1B0\); rank 1 at 1F1 \(waits for 0F1\)"
    ):
        validate(schedule, 2, 2)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(schedule)


def test_validation_of_inputs() -> None:
    with pytest.raises(ScheduleError, match="p=3 lists, got 2"):
        validate(gpipe(2, 2), 3, 2)
    with pytest.raises(ScheduleError, match="missing 0F2"):
        validate(gpipe(2, 2), 2, 3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gpipe(0, 4), "p must be a positive integer, got 0"),
        (lambda: one_f_one_b(2, 0), "m must be a positive integer, got 0"),
        (lambda: zb_h1(2.0, 4), "p must be a positive integer, got 2.0"),
        (lambda: gpipe(True, 4), "p must be a positive integer, got True"),
        (lambda: interleaved_one_f_one_b(2, 4, 0), "v must be a positive integer"),
        (lambda: interleaved_one_f_one_b(4, 9, 2), r"max\(1, m // p\) = 2 rounds .* do not divide m=9"),
        (lambda: interleaved_one_f_one_b(4, 10, 2, group=4), "last group of 2 < p=4"),
        (lambda: interleaved_one_f_one_b(4, 10, 2, group=3), "p <= n <= m micro-batches; got n=3"),
        (lambda: interleaved_one_f_one_b(4, 10, 2, group=11), "got n=11"),
        (lambda: interleaved_one_f_one_b(4, 8, 2, group=0), "group must be a positive integer"),
    ],
)
def test_builders_reject_bad_sizes(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


# -------------------------------------------------------------------------------------- send / recv


def test_add_send_recv_gives_a_valid_schedule_with_the_same_timing() -> None:
    for schedule, (p, m, v) in [
        (gpipe(3, 4), (3, 4, 1)),
        (one_f_one_b(4, 8), (4, 8, 1)),
        (zb_h1(4, 6), (4, 6, 1)),
        (interleaved_one_f_one_b(2, 4, 2), (2, 4, 2)),
        (interleaved_one_f_one_b(3, 6, 3), (3, 6, 3)),
        (interleaved_one_f_one_b(1, 3, 2), (1, 3, 2)),  # one rank: no transfer at all
    ]:
        with_comm = add_send_recv(schedule)
        validate(with_comm, p, m, v)
        transfers = sum(not a.is_compute for rank in with_comm for a in rank)
        assert transfers == (4 * (p * v - 1) * m if p > 1 else 0)  # SEND + RECV, both directions, per boundary
        assert simulate(with_comm, comm=0.3).timeline == simulate(schedule, comm=0.3).timeline


def test_add_send_recv_posts_receives_in_send_order() -> None:
    """Rank 1 consumes micro-batch 1 first; rank 0 sends 0 first: both receives go before 1F1, 0 first."""
    schedule = [[Action(F, 0, 0), Action(F, 1, 0), Action(B, 0, 0), Action(B, 1, 0)]]
    schedule.append([Action(F, 1, 1), Action(F, 0, 1), Action(B, 0, 1), Action(B, 1, 1)])
    validate(schedule, 2, 2)
    with_comm = add_send_recv(schedule)
    assert order(with_comm)[1][:4] == ["1RECV_F0", "1RECV_F1", "1F1", "1F0"]
    validate(with_comm, 2, 2)

    naive = replace(with_comm, 1, ["1RECV_F1", "1F1", "1RECV_F0", "1F0", *order(with_comm)[1][4:]])
    with pytest.raises(ScheduleError, match=r"link rank 0 -> rank 1: receives posted as \['1RECV_F1', '1RECV_F0'\]"):
        validate(naive, 2, 2)


def test_validation_rejects_misplaced_or_missing_transfers() -> None:
    good = order(add_send_recv(one_f_one_b(2, 2)))
    assert good[0][:2] == ["0F0", "0SEND_F0"]
    assert good[1][:2] == ["1RECV_F0", "1F0"]
    late_recv = replace(add_send_recv(one_f_one_b(2, 2)), 1, [good[1][1], good[1][0], *good[1][2:]])
    with pytest.raises(ScheduleError, match="1RECV_F0 must come before 1F0"):
        validate(late_recv, 2, 2)
    early_send = replace(add_send_recv(one_f_one_b(2, 2)), 0, [good[0][1], good[0][0], *good[0][2:]])
    with pytest.raises(ScheduleError, match="0SEND_F0 must come after 0F0"):
        validate(early_send, 2, 2)
    missing = replace(add_send_recv(one_f_one_b(2, 2)), 0, [good[0][0], *good[0][2:]])
    with pytest.raises(ScheduleError, match="missing \\['0SEND_F0'\\]"):
        validate(missing, 2, 2)
    late_sends = ["0F0", "0F1", "0RECV_B0", "0B0", "0SEND_F0", "0SEND_F1", "0RECV_B1", "0B1"]
    with pytest.raises(
        ScheduleError, match=r"rank 0 at 0B0 \(waits for 1SEND_B0\); rank 1 at 1F0 \(waits for 0SEND_F0\)"
    ):
        validate(replace(add_send_recv(one_f_one_b(2, 2)), 0, late_sends), 2, 2)
    with pytest.raises(ValueError, match="compute-only"):
        add_send_recv(add_send_recv(one_f_one_b(2, 2)))


# ------------------------------------------------------------------------------------ against torch


def torch_compute_order(pipeline_order: dict[int, list] | list[list]) -> list[list[str]]:
    ranks = pipeline_order if isinstance(pipeline_order, list) else [pipeline_order[r] for r in sorted(pipeline_order)]
    return [[repr(a) for a in actions if a is not None and a.computation_type.value in "FBIW"] for actions in ranks]


def test_orders_match_torch_pipelining() -> None:
    """torch.distributed.pipelining builds its schedules as per-rank action lists in the same notation.

    Private helpers, pinned by torch==2.13.0: the IR of GPipe and 1F1B, and the per-rank builders of
    Interleaved1F1B and InterleavedZeroBubble (one stage per rank = ZB-H1).
    """
    from types import SimpleNamespace

    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    checked = 0
    for p in range(1, 6):
        for m in range(p, 3 * p + 1):
            state = SimpleNamespace(_num_stages=p, _n_microbatches=m)
            assert torch_compute_order(ts.ScheduleGPipe._get_pipeline_order(state)) == order(gpipe(p, m))
            theirs = torch_compute_order(ts.Schedule1F1B._get_pipeline_order(state))
            # torch's 1F1B *IR* numbers the last rank's forwards from 1 (its runtime, _step_microbatches, runs
            # F0 first): compare the other ranks.
            assert theirs[:-1] == order(one_f_one_b(p, m))[:-1]
            state = SimpleNamespace(n_local_stages=1, microbatches_per_round=p, pp_group_size=p, _n_microbatches=m)
            zb = [ts.ScheduleInterleavedZeroBubble._calculate_single_rank_operations(state, r) for r in range(p)]
            assert torch_compute_order(zb) == order(zb_h1(p, m))
            # ... and its F/I order with W left out is 1F1B, last rank included
            as_1f1b = [[a.replace("I", "B") for a in actions if "W" not in a] for actions in torch_compute_order(zb)]
            assert as_1f1b == order(one_f_one_b(p, m))
        for m in range(1, 3 * p + 1):  # every m torch takes, multiples of p or not, m < p too
            if not torch_accepts(p, m):
                continue
            for v in (2, 3, 4):
                rounds = max(1, m // p)  # what ScheduleInterleaved1F1B.__init__ sets
                state = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=p,
                                        _n_microbatches=m)
                ours = order(interleaved_one_f_one_b(p, m, v))
                theirs = [ts.ScheduleInterleaved1F1B._calculate_single_rank_operations(state, r) for r in range(p)]
                assert torch_compute_order(theirs) == ours, (p, m, v)
                checked += 1
    assert checked == 3 * 39


def test_gpipe_by_hand() -> None:
    """p = 4, m = 8, F = 1, B = 2: makespan (8 + 3) * 3 = 33, each rank busy 24: bubble 9/33 = 3/11."""
    sim = simulate(gpipe(4, 8))
    assert math.isclose(sim.bubble_fraction, 3 / 11)
    assert sim.busy == [24.0] * 4
