"""The mesh figure and the planner widget, driven as a learner would."""

from course_lib.mesh import MeshShape
from course_lib.viz.mesh import PlannerWidget, draw_mesh


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
