"""The cross-node bytes figure and the topology widget, driven as a learner would."""

from course_lib.viz.topology import TopologyWidget, plot_cross_node


def test_plot_has_one_bar_per_order_and_group_and_a_tick_per_prediction():
    bars = {"tp-cp-ep-dp-pp": {"tp": 0, "dp": 300}, "dp-tp-cp-ep-pp": {"tp": 600, "dp": 0}}
    fig = plot_cross_node(bars, bars, {"tp": "modelled", "dp": "measured"})
    ax = fig.axes[0]
    assert len(ax.patches) == 4 and len(ax.collections) == 2
    assert [t.get_text() for t in ax.get_xticklabels()] == list(bars)
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"dp (measured)", "tp (modelled)", "predicted"}


def test_widget_shows_tp_leaving_the_node_only_when_the_order_or_the_node_size_says_so():
    w = TopologyWidget(model="llama2-7b", gpus_per_node=8, tp=8, dp=2)
    assert "tp 0.0 GB" in w.text and w._img.value and w._mesh.value
    assert "tp 0.0 GB" not in w.set(order="dp-tp-cp-ep-pp")
    assert w.crossing["tp-cp-ep-dp-pp"]["tp"] == 0 < w.crossing["dp-tp-cp-ep-pp"]["tp"]
    assert "tp 0.0 GB" not in w.set(order="tp-cp-ep-dp-pp", gpus_per_node=4)  # TP of 8 on nodes of 4 GPUs


def test_widget_reports_an_invalid_mesh_without_an_empty_image():
    w = TopologyWidget(model="llama2-7b", tp=8, dp=2)
    text = w.set(dp=4, global_batch=6)
    assert text.startswith("invalid:") and "global batch 6" in text
    assert w._img.layout.display == "none" and w._mesh.layout.display == "none"
