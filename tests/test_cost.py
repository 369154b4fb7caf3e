"""Cost formulas against hand-computed values, against the pipeline simulator, and FLOPs against torch's counter."""

import math
import random

import pytest

from course_lib.estimates.cost import (
    bubble_fraction,
    bubble_ratio,
    collective_bytes_per_rank,
    collective_steps,
    collective_time,
    fit_alpha_beta,
    mfu,
    training_flops_per_token,
)
from course_lib.estimates.hardware import gpu
from course_lib.parallel import schedules
from course_lib.parallel.schedule_run import simulate

# ------------------------------------------------------------------------------------------ pipelines


def test_bubble_formulas_by_hand() -> None:
    assert bubble_ratio("gpipe", 4, 8) == 3 / 8
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("one_f_one_b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_ratio("interleaved_one_f_one_b", 4, 8, v=2) == 3 / 16
    assert bubble_fraction("interleaved_one_f_one_b", 4, 8, v=2) == pytest.approx(3 / 19)
    assert bubble_ratio("zb_h1", 4, 8) == 3 / 24
    assert bubble_fraction("zb_h1", 4, 8) == pytest.approx(3 / 27)
    assert bubble_fraction("one_f_one_b", 1, 5) == 0.0
    assert bubble_fraction("one_f_one_b", 8, 32) == pytest.approx(7 / 39)  # the m = 4p rule of thumb: about 18 %


CASES = [(p, m, v) for p in (1, 2, 3, 4) for m in (p, 2 * p, 4 * p) for v in (1, 2, 3)]
CASES += [(4, m, v) for m in (6, 10) for v in (1, 2, 3)]  # m not a multiple of p: interleaved in torch's rounds


@pytest.mark.parametrize(("p", "m", "v"), CASES)
def test_bubble_formulas_match_the_simulator(p: int, m: int, v: int) -> None:
    """Uniform stages, backward = 2 x forward (ZB-H1: F = I = W = 1)."""
    runs = {"interleaved_one_f_one_b": (schedules.interleaved_one_f_one_b(p, m, v), v)}
    if v == 1:
        runs |= {
            "gpipe": (schedules.gpipe(p, m), 1),
            "one_f_one_b": (schedules.one_f_one_b(p, m), 1),
            "zb_h1": (schedules.zb_h1(p, m), 1),
        }
    for name, (schedule, chunks) in runs.items():
        sim = simulate(schedule, cost_f=1, cost_b=2)
        assert sim.bubble_ratio == pytest.approx(bubble_ratio(name, p, m, chunks), abs=1e-12), name
        assert sim.bubble_fraction == pytest.approx(bubble_fraction(name, p, m, chunks), abs=1e-12), name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("pipedream", 4, 8), "unknown schedule 'pipedream'"),
        (("gpipe", 4, 8, 2), "v must be 1, got 2"),
        (("interleaved_one_f_one_b", 4, 3, 2), r"m >= p \(groups of at least p micro-batches\); got m=3 < p=4"),
        (("zb_h1", 4, 2), "m >= p; got m=2 < p=4"),
        (("gpipe", 0, 8), "p must be a positive integer"),
    ],
)
def test_bubble_formulas_reject_bad_inputs(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bubble_ratio(*args)


# -------------------------------------------------------------------------------------- collectives


def test_bytes_per_rank_by_hand() -> None:
    V = 1000
    assert collective_bytes_per_rank("all_reduce", V, 4) == 1500  # 2 (n-1)/n V
    assert collective_bytes_per_rank("all_gather", V, 4) == 750  # (n-1)/n V
    assert collective_bytes_per_rank("reduce_scatter", V, 4) == 750
    assert collective_bytes_per_rank("all_to_all", V, 4) == 750
    assert collective_bytes_per_rank("broadcast", V, 4) == 1000
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        assert collective_bytes_per_rank(op, V, 1) == 0
        assert collective_time(op, V, 1, alpha=1e-5, beta=1e9) == 0


def test_collective_time_by_hand() -> None:
    alpha, beta = 1e-5, 1e9
    # all-reduce of 4 MB on 4 ranks: 6 steps of 1 MB, each 10 us + 1 ms
    assert collective_time("all_reduce", 4e6, 4, alpha, beta) == pytest.approx(6 * (1e-5 + 1e-3))
    assert collective_time("all_gather", 4e6, 4, alpha, beta) == pytest.approx(3 * (1e-5 + 1e-3))
    assert collective_time("broadcast", 4e6, 5, alpha, beta) == pytest.approx(3 * (1e-5 + 4e-3))  # ceil(log2 5)
    assert collective_steps("all_to_all", 8e6, 8) == (7, 1e6)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        steps, _ = collective_steps(op, 4e6, 4)
        expected = steps * alpha + collective_bytes_per_rank(op, 4e6, 4) / beta
        assert collective_time(op, 4e6, 4, alpha, beta) == pytest.approx(expected)


def test_ring_all_reduce_bandwidth_term_tends_to_2v_over_beta() -> None:
    V, beta = 1e9, 1e11
    times = [collective_time("all_reduce", V, n, 0.0, beta) for n in (2, 8, 64, 1024)]
    assert times == sorted(times)
    assert times[-1] == pytest.approx(2 * V / beta, rel=1e-3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: collective_time("gossip", 1, 4, 0, 1), "unknown collective 'gossip'"),
        (lambda: collective_time("all_reduce", 1, 0, 0, 1), "n \\(number of ranks\\) must be a positive integer"),
        (lambda: collective_time("all_reduce", -1, 4, 0, 1), "nbytes must be >= 0"),
        (lambda: collective_time("all_reduce", 1, 4, 0, 0), "beta > 0"),
    ],
)
def test_collectives_reject_bad_inputs(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_fit_recovers_alpha_beta() -> None:
    alpha, beta = 25e-6, 12e9
    sizes = [2.0**k for k in range(10, 27)]
    exact = [alpha + s / beta for s in sizes]
    fit_alpha, fit_beta = fit_alpha_beta(sizes, exact)
    assert fit_alpha == pytest.approx(alpha, rel=1e-6)
    assert fit_beta == pytest.approx(beta, rel=1e-9)

    rng = random.Random(0)
    noisy = [t * (1 + rng.uniform(-0.01, 0.01)) for t in exact for _ in range(5)]
    fit_alpha, fit_beta = fit_alpha_beta([s for s in sizes for _ in range(5)], noisy)
    assert fit_beta == pytest.approx(beta, rel=0.02)
    assert fit_alpha == pytest.approx(alpha, rel=0.5)  # latency is the hard part: large messages dominate the fit


def test_fit_a_collective_per_step() -> None:
    alpha, beta, n = 5e-6, 40e9, 8
    per_step_bytes, per_step_times = [], []
    for V in (1e6, 4e6, 16e6, 64e6):
        steps, step_bytes = collective_steps("all_reduce", V, n)
        per_step_bytes.append(step_bytes)
        per_step_times.append(collective_time("all_reduce", V, n, alpha, beta) / steps)
    assert fit_alpha_beta(per_step_bytes, per_step_times) == pytest.approx((alpha, beta))


def test_fit_rejects_what_it_cannot_fit() -> None:
    with pytest.raises(ValueError, match="two different message sizes"):
        fit_alpha_beta([1e6, 1e6], [1.0, 1.1])
    with pytest.raises(ValueError, match="does not grow with size"):
        fit_alpha_beta([1e3, 1e6], [1.0, 0.5])
    with pytest.raises(ValueError, match="differ in length"):
        fit_alpha_beta([1e3, 1e6], [1.0])


# ----------------------------------------------------------------------------------------- FLOPs, MFU


def test_training_flops_by_hand() -> None:
    assert training_flops_per_token(1e9) == 6e9
    assert training_flops_per_token(1e9, full_recompute=True) == 8e9
    L, h, s = 24, 2048, 2048
    assert training_flops_per_token(1e9, L, h, s) == 6e9 + 12 * L * h * s
    assert training_flops_per_token(1e9, L, h, s, full_recompute=True) == 8e9 + 16 * L * h * s


def test_training_flops_match_torch_flop_counter() -> None:
    """One transformer layer's matmuls (q, k, v, o projections, scores, weighted sum, 4h MLP), forward and
    backward, counted by torch: exactly s * (6N + 12 L h s) with N = 12 h^2 (biases and norms are not matmuls)."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    s, h, heads = 16, 32, 4
    d = h // heads
    torch.manual_seed(0)
    x = torch.randn(s, h, requires_grad=True)
    wq, wk, wv, wo = (torch.randn(h, h, requires_grad=True) for _ in range(4))
    w1, w2 = torch.randn(h, 4 * h, requires_grad=True), torch.randn(4 * h, h, requires_grad=True)

    def split(t):
        return t.view(s, heads, d).transpose(0, 1)

    with FlopCounterMode(display=False) as counter:
        q, k, v = split(x @ wq), split(x @ wk), split(x @ wv)
        attention = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), dim=-1) @ v
        y = attention.transpose(0, 1).reshape(s, h) @ wo
        out = torch.relu(y @ w1) @ w2
        out.sum().backward()
    n_params = 12 * h * h
    assert counter.get_total_flops() == s * training_flops_per_token(n_params, n_layer=1, d_model=h, seq_len=s)


def test_mfu_by_hand() -> None:
    # 1B parameters at 10k tokens/s on one A100: 6e13 FLOP/s of 312e12
    assert mfu(1e4, 1e9, gpu("A100 80GB").peak_flops) == pytest.approx(6e13 / 312e12)
    assert mfu(8e4, 1e9, gpu("H100 80GB").peak_flops, n_gpus=8) == pytest.approx(6e13 / 989e12)
    with_attention = mfu(1e4, 1e9, 1e15, n_layer=24, d_model=2048, seq_len=2048)
    assert with_attention == pytest.approx(1e4 * (6e9 + 12 * 24 * 2048 * 2048) / 1e15)
    with pytest.raises(ValueError, match="peak_flops > 0"):
        mfu(1e4, 1e9, 0)
