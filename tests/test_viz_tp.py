"""course_lib.viz.tp: the modelled cost of a TP block (bytes = the Megatron formula, the compute/comm ratio),
the rule of thumb checked against it, the figure and the widget driven from the kernel side. Pure and fast."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
from matplotlib.figure import Figure

from course_lib.estimates.accounting import block_bytes_per_rank
from course_lib.estimates.cost import collective_time
from course_lib.estimates.hardware import LINKS, Link, gpu
from course_lib.model_config import PRESETS, block_params
from course_lib.viz import tp as vt

NVLINK, PCIE, IB = LINKS["NVLink 4 (H100)"], LINKS["PCIe 4.0 x16"], LINKS["InfiniBand NDR 400G"]
H100 = gpu("H100 80GB").peak_flops


@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_bytes_and_time_follow_the_formula(t, sp):
    cfg = PRESETS["llama2-7b"]
    c = vt.tp_layer_cost(cfg, 4096, t, NVLINK, H100, sequence_parallel=sp)
    v = 4096 * cfg.d_model * 2
    # SP: TP's bytes + the 2 backward re-gathers of the saved s/t inputs
    assert c.bytes_per_rank == pytest.approx(block_bytes_per_rank(1, 4096, cfg.d_model, t, 2, sequence_parallel=sp))
    assert c.collectives == (10 if sp else 4)
    expected = (6 * collective_time("all_gather", v, t, NVLINK.alpha, NVLINK.beta)
                + 4 * collective_time("reduce_scatter", v, t, NVLINK.alpha, NVLINK.beta)) if sp else \
        4 * collective_time("all_reduce", v, t, NVLINK.alpha, NVLINK.beta)
    assert c.comm_s == pytest.approx(expected)
    flops = (6 * block_params(cfg) + 12 * cfg.d_model * cfg.seq_len) * 4096 / t
    assert c.compute_s == pytest.approx(flops / (H100 * 0.5))


def test_t1_has_no_communication_and_bad_inputs_are_refused():
    c = vt.tp_layer_cost(PRESETS["llama2-7b"], 16, 1, NVLINK, H100)
    assert (c.comm_s, c.bytes_per_rank, c.collectives, c.comm_bound) == (0.0, 0.0, 0, False)
    with pytest.raises(ValueError, match="tokens"):
        vt.tp_layer_cost(PRESETS["llama2-7b"], 0, 2, NVLINK, H100)


def test_ratio_does_not_depend_on_tokens_when_bandwidth_dominates():
    """Compute and comm both grow with tokens: with latency removed, their ratio is the same at 1k and 64k."""
    link = Link("no latency", 0.0, NVLINK.beta, "a test link")
    cfg = PRESETS["llama3-70b"]
    ratios = [(c.compute_s / c.comm_s) for c in (vt.tp_layer_cost(cfg, n, 8, link, H100) for n in (1024, 65536))]
    assert ratios[0] == pytest.approx(ratios[1])
    flops_per_token = 6 * block_params(cfg) + 12 * cfg.d_model * cfg.seq_len
    assert ratios[0] == pytest.approx(flops_per_token * link.beta / (8 * 7 * cfg.d_model * 2 * H100 * 0.5))


def test_rule_of_thumb_against_the_model():
    """At 4096 tokens per device on H100s, Llama-3-70B: NVLink keeps t = 8 compute-bound, PCIe only t = 2, and a
    network link makes even small t costly (a large share of the compute)."""
    cfg = PRESETS["llama3-70b"]

    def largest(link):
        return vt.largest_compute_bound_t([vt.tp_layer_cost(cfg, 4096, t, link, H100) for t in vt.DEGREES])

    assert largest(NVLINK) >= 8
    assert largest(PCIE) == 2
    assert vt.rule_of_thumb(NVLINK)[0] == 8 and vt.rule_of_thumb(PCIE)[0] == 2 and vt.rule_of_thumb(IB)[0] == 1
    one_token = [vt.tp_layer_cost(cfg, 1, t, NVLINK, H100) for t in (2, 8)]
    assert all(c.comm_bound for c in one_token)  # a training step of one token a device: latency-bound at t > 1


def test_decode_is_priced_as_chapter_09_prices_it():
    """Decode reads the weights and the KV cache: memory-bound, its per-block terms the whole model's step / L
    (``serving.budget.predict``), so that L blocks give chapter 09's time per token; with the small-message
    kernels TP cuts it nearly t-fold up to t = 8, NCCL's ring turns communication-bound past the node."""
    from course_lib.serving.budget import predict

    cfg = PRESETS["llama3-70b"]
    best = {t: vt.tp_decode_cost("llama3-70b", t, NVLINK.name, "H100 80GB") for t in (1, 2, 4, 8, 16)}
    ring = {t: vt.tp_decode_cost("llama3-70b", t, NVLINK.name, "H100 80GB", allreduce="ring") for t in (8, 16)}
    for t, c in best.items():
        step = predict("llama3-70b", "H100 80GB", batch=1, context=4096, tp=t, link=NVLINK.name).step_s
        assert cfg.n_layer * (c.work_s + c.comm_s) == pytest.approx(step)
        assert c.bound == "memory-bound" and c.memory_s > 100 * c.compute_s
    assert not best[1].fits and best[2].fits  # 141 GB of bf16 weights on one 80 GB GPU
    per_token = {t: c.work_s + c.comm_s for t, c in best.items()}
    assert 3.5 < per_token[2] / per_token[8] < 4  # nearly 4x from t = 2 to 8
    assert ring[8].bound == "memory-bound" and ring[16].comm_bound
    assert vt.tp_decode_cost("gpt2-124m", 8, NVLINK.name, "H100 80GB").valid is False  # 12 heads


def test_invalid_degrees_are_marked():
    costs = [vt.tp_layer_cost(PRESETS["gpt2-124m"], 1024, t, NVLINK, H100) for t in vt.DEGREES]
    assert [c.valid for c in costs] == [True, True, True, False, False, False]  # 12 heads
    assert vt.largest_compute_bound_t(costs) <= 4


def test_figure_and_widget():
    cfg = PRESETS["llama2-7b"]
    costs = [vt.tp_layer_cost(cfg, 4096, t, NVLINK, H100) for t in vt.DEGREES]
    fig = vt.plot_tp_cost(costs, cfg, NVLINK, 4096)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    w = vt.tp_cost_widget()
    first_text, first_image = w.text, w.image.value
    assert "compute-bound up to t=" in first_text and first_image
    text = w.set(link="PCIe 4.0 x16")
    assert "over PCIe at most 2" in text and w.largest_t == 2
    assert w.image.value != first_image
    w.set(sequence_parallel=True)
    assert [c.collectives for c in w.costs[1:]] == [10] * (len(vt.DEGREES) - 1)
    w.set(tokens=1)
    assert w.largest_t == 1 and "is stricter: t <= 1" in w.text
    text = w.set(step="decode", sequence_parallel=False)
    assert "ms per token" in text and "memory-bound" in text and w.largest_t >= 8
    assert w.image.value
    with pytest.raises(KeyError):
        w.set(nonsense=1)
    assert set(w.controls) == set(vt.CONTROL_DESCRIPTIONS)
