"""The stage-cut picture: one box per layer, coloured by its stage, a cut marked between every two stages."""

import pytest
from matplotlib.colors import to_hex

from course_lib.viz.stages import STAGE_COLORS, plot_stage_cut


def test_one_box_per_layer_coloured_by_its_stage_and_a_cut_between_stages():
    fig = plot_stage_cut([2, 3, 1], shape=(2, 16, 32), ranks=[0, 1, 2])
    ax = fig.axes[0]
    boxes = ax.patches[:8]  # embed, 6 blocks, head
    owners = [0, 0, 0, 1, 1, 1, 2, 2]  # the embedding rides with stage 0, the head with the last
    assert [to_hex(b.get_facecolor()) for b in boxes] == [STAGE_COLORS[k] for k in owners]
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("activation [2, 16, 32]") == 2 and texts.count("its gradient [2, 16, 32]") == 2
    assert [t for t in texts if t.startswith("stage ")] == ["stage 0 on rank 0", "stage 1 on rank 1",
                                                             "stage 2 on rank 2"]


@pytest.mark.parametrize("split, ranks", [([], None), ([2, 0], None), ([2, 2], [0])])
def test_bad_splits_are_refused(split, ranks):
    with pytest.raises(ValueError):
        plot_stage_cut(split, shape=(1, 1, 1), ranks=ranks)
