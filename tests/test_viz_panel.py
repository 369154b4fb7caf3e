"""What every ControlPanel widget does the same way: a slider drag redraws once (final values only), and a panel
with dropdowns says in the widget how to use them from the keyboard (JupyterLab keeps the arrow keys of a closed
list for moving between cells); and the memory widget's size boxes, presets and invalid settings."""

from __future__ import annotations

import ipywidgets as W
import pytest

from course_lib.viz.comm import collective_cost_widget
from course_lib.viz.cp import cp_work_widget
from course_lib.viz.memory import memory_budget_widget
from course_lib.viz.mesh import PlannerWidget
from course_lib.viz.moe import moe_dispatch_widget
from course_lib.viz.panel import KEYBOARD_HINT, ControlPanel
from course_lib.viz.schedule import bubble_widget
from course_lib.viz.serving import ServingBudgetPanel, TracePanel
from course_lib.viz.topology import TopologyWidget
from course_lib.viz.tp import tp_cost_widget
from course_lib.viz.zero import zero_memory_widget

FACTORIES = {
    "memory": lambda: memory_budget_widget(draw=False),
    "zero": lambda: zero_memory_widget(draw=False),
    "comm": collective_cost_widget,
    "bubble": bubble_widget,
    "cp": cp_work_widget,
    "moe": moe_dispatch_widget,
    "serving": lambda: ServingBudgetPanel(draw=False),
    "trace": lambda: TracePanel(draw=False),
    "tp": tp_cost_widget,
    "planner": PlannerWidget,
    "topology": TopologyWidget,
}


@pytest.fixture(scope="module", params=list(FACTORIES))
def panel(request) -> ControlPanel:
    return FACTORIES[request.param]()


def test_every_control_reports_only_its_final_value(panel):
    for name, control in panel.controls.items():
        if control.has_trait("continuous_update"):
            assert control.continuous_update is False, f"{type(panel).__name__}.{name} redraws during a drag"


def test_a_panel_with_dropdowns_explains_the_keyboard_in_the_widget(panel):
    lists = [c for c in panel.controls.values() if isinstance(c, W.Dropdown)]
    hints = [c for c in panel.children if isinstance(c, W.Label) and c.value == KEYBOARD_HINT]
    assert len(hints) == (1 if lists else 0)
    assert all(c.tooltip for c in lists)
    panel._settle_controls()  # idempotent: no second hint
    assert sum(isinstance(c, W.Label) and c.value == KEYBOARD_HINT for c in panel.children) == len(hints)


def test_a_drag_redraws_once_not_once_per_step():
    class Counting(ControlPanel):
        def __init__(self) -> None:
            super().__init__()
            self.controls = {"x": W.IntSlider(value=0, min=0, max=10)}  # continuous_update=True by default
            self.children = [self.controls["x"]]
            self.redraws = 0
            self._watch()

        def update(self) -> None:
            self.redraws += 1

        @property
        def text(self) -> str:
            return str(self.controls["x"].value)

    w = Counting()
    assert w.controls["x"].continuous_update is False  # the browser sends the value when the drag ends
    assert w.set(x=7) == "7" and w.redraws == 1


@pytest.mark.parametrize("field, value, message", [
    ("n_layer", 0, "n_layer must be a positive int, got 0"),
    ("d_model", -5, "d_model must be a positive int, got -5"),
    ("batch", 0, "micro_batch must be an int >= 1, got 0"),
    ("seq_len", -5, "seq_len must be an int >= 1"),
])
def test_memory_widget_shows_the_error_for_a_nonsense_size_instead_of_clamping(field, value, message):
    w = memory_budget_widget(model="llama3-8b")
    text = w.set(**{field: value})
    assert w.controls[field].value == value  # kept as typed, not clamped to 1
    assert text.startswith("invalid settings: ") and message in text
    assert w.budget is None and w.image.layout.display == "none"  # no stale figure, no broken image
    w.set(**{field: 2 if field != "d_model" else 4096})
    assert w.budget is not None and w.image.layout.display is None and w.image.value


def test_memory_widget_says_when_a_preset_changes_the_sequence_length():
    w = memory_budget_widget(model="llama2-7b", draw=False)
    assert w.controls["seq_len"].value == 4096 and "sequence length set" not in w.text
    w.controls["model"].value = "llama3-8b"  # as a learner picks it from the list
    assert w.controls["seq_len"].value == 8192
    assert "sequence length set to 8,192 tokens, the context length of llama3-8b (was 4,096)" in w.text
    assert "sequence length set to" in w.verdict_html.value
    w.controls["batch"].value = 2  # the next change clears it
    assert "sequence length set" not in w.text
    assert "sequence length set" not in w.set(model="llama2-7b", seq_len=2048)  # chosen together: nothing to point out
    assert w.controls["seq_len"].value == 2048


def test_memory_widget_never_shows_an_empty_image():
    w = memory_budget_widget(draw=False)
    assert w.image.layout.display == "none" and not w.image.value
