"""The flat-buffer picture: one cell per element coloured by its parameter, the padding hatched, one bar per rank."""

import pytest
from matplotlib.colors import to_hex

from course_lib.parallel.zero_unit import FlatLayout
from course_lib.viz.flat_layout import PAD_COLOR, PARAM_COLORS, plot_flat_layout


def test_cells_padding_and_owner_bars_follow_the_layout():
    lay = FlatLayout.build(["w", "b"], [(2, 3), (3,)], 4)  # 9 elements padded to 12, S = 3
    ax = plot_flat_layout(lay).axes[0]
    cells = ax.patches[:12]
    assert [to_hex(c.get_facecolor()) for c in cells] == [PARAM_COLORS[0]] * 6 + [PARAM_COLORS[1]] * 3 + [PAD_COLOR] * 3
    bars = ax.patches[12:]
    assert len(bars) == 4 and [round(b.get_x()) for b in bars] == [0, 3, 6, 9]
    texts = [t.get_text() for t in ax.texts]
    assert "padding (3)" in texts and "[9, 12)" in texts and "w [2, 3]" in texts


def test_a_layout_too_large_to_draw_is_refused():
    with pytest.raises(ValueError, match="at most 200"):
        plot_flat_layout(FlatLayout.build(["w"], [(300,)], 2))
