"""Tests for course_lib.viz.cp: the work matrix and per-step counts against the library's own pair counts and the
load-balance formulas, the figure, and the widget driven from the kernel side. Pure and fast (Agg, no ranks)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
from matplotlib.figure import Figure

from course_lib.model_config import PRESETS
from course_lib.parallel.cp_attention import LAYOUTS, causal_pairs
from course_lib.viz import cp as vc


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matrix_and_steps_agree_with_the_pair_counts(cp, layout):
    s = 32
    m = vc.work_matrix(s, cp, layout)
    assert (m[np.triu_indices(s, 1)] == -1).all() and (m >= 0).sum() == s * (s + 1) // 2
    per_rank = [int((m == r).sum()) for r in range(cp)]
    assert per_rank == causal_pairs(s, cp, layout)
    assert vc.step_work(s, cp, layout).sum(axis=0).tolist() == per_rank


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_lockstep_time_is_cp_over_2cp_minus_1_of_contiguous(cp):
    s, c = 16 * cp, 16  # c tokens per rank
    contiguous, zigzag = vc.lockstep_work(s, cp, "contiguous"), vc.lockstep_work(s, cp, "zigzag")
    assert contiguous == c * (c + 1) // 2 + (cp - 1) * c * c  # diagonal, then a full block every step
    half = c // 2
    assert zigzag == 2 * half * (half + 1) // 2 + half * half + (cp - 1) * 2 * half * half
    assert zigzag / contiguous == pytest.approx(cp / (2 * cp - 1), rel=2 / c)  # -> 1/2 for large cp


def test_figure_and_widget():
    fig = vc.plot_cp_work(32, 4, "zigzag")
    assert isinstance(fig, Figure) and len(fig.axes) == 3
    w = vc.cp_work_widget(draw=False)
    text = w.set(cp=4, layout="contiguous", seq_len=40)
    assert w.summary["seq_len"] == 32 and w.summary["imbalance"] == pytest.approx(
        max(causal_pairs(32, 4, "contiguous")) / (sum(causal_pairs(32, 4, "contiguous")) / 4))
    assert "max/mean" in text and "contiguous" in text
    assert "max/mean 1.00" in w.set(layout="zigzag")
    cfg = PRESETS["llama3-8b"]
    w.set(model="llama3-8b", context=131072, cp=8)
    assert w.summary["kv_bytes"] == 2 * (131072 // 8) * cfg.kv_heads * cfg.head_dim * 2
    with pytest.raises(KeyError):
        w.set(ring=3)
    drawn = vc.CPWorkWidget(cp=2)
    assert drawn.image.value[:4] == b"\x89PNG"
