"""The mesh figure and the planner widget, driven as a learner would: the widget's text is the planner's ranking,
every control redraws the figure, the best mesh is drawn while it is small enough to read, and no image is ever
left empty but visible."""

import pytest

from course_lib.planner import search as planner
from course_lib.runtime.mesh import MeshShape
from course_lib.viz.mesh import PlannerWidget, draw_mesh

PNG = b"\x89PNG"


def test_draw_mesh_has_one_square_per_rank_and_one_box_per_node():
    fig = draw_mesh(MeshShape(dp=2, tp=2, pp=2), ("dp",), gpus_per_node=4)
    patches = fig.axes[0].patches
    assert len(patches) == 8 + 2
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert {f"r{r}" for r in range(8)} <= set(labels) and {"node 0", "node 1"} <= set(labels)


def test_planner_widget_ranks_meshes_and_shows_errors_without_an_empty_image():
    w = PlannerWidget(model="llama2-7b", cluster="dgx-h100", nodes=2, global_batch=64, seq_len=4096)
    assert "valid meshes" in w.text and "best: dp=" in w.text and w._img.value
    fast = w.text
    assert w.set(cluster="pcie-h100-ethernet") != fast
    text = w.set(model="llama2-70b", nodes=1, global_batch=8)
    assert "0 ranked" in text and w._img.layout.display == "none"


def test_planner_widget_text_is_the_planners_ranking_and_every_control_redraws():
    w = PlannerWidget(model="llama2-7b", cluster="dgx-h100", nodes=1, global_batch=16, seq_len=4096)
    shown = [w._img.value]
    for change in ({"global_batch": 32}, {"seq_len": 8192}, {"cluster": "pcie-h100-ethernet"},
                   {"model": "llama3-8b"}, {"nodes": 2}):
        text = w.set(**change)
        v = w.values()
        ref = planner.plan(v["model"], planner.cluster(v["cluster"], v["nodes"]), v["global_batch"], v["seq_len"],
                           **PlannerWidget.SPACE)
        best = ref.ranked[0]
        assert text.startswith(f"{ref.considered} valid meshes, {ref.rejected_memory} do not fit in memory, "
                               f"{len(ref.ranked)} ranked; best: {best.candidate} (MFU {best.mfu:.0%}; "), change
        assert w._img.value[:4] == PNG and w._img.value not in shown, f"{change}: the ranking was not redrawn"
        shown.append(w._img.value)
        assert w._mesh.value[:4] == PNG and w._mesh.layout.display is None  # 8 or 16 GPUs: the best mesh drawn


def test_planner_widget_hides_the_mesh_picture_beyond_64_gpus_and_refuses_unknown_controls():
    w = PlannerWidget(model="llama2-7b", cluster="dgx-h100", nodes=8, global_batch=32, seq_len=4096)
    assert w._mesh.value[:4] == PNG and w._mesh.layout.display is None  # 64 GPUs: still drawn
    w.set(nodes=16)
    assert "ranked; best:" in w.text and w._img.value[:4] == PNG  # the ranking is still shown ...
    assert w._mesh.value == b"" and w._mesh.layout.display == "none"  # ... but 128 squares would not be readable
    with pytest.raises(KeyError, match="unknown control"):
        w.set(gpus=8)
