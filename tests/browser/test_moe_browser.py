"""Chapter 07's MoE dispatch widget in a real JupyterLab and browser, driven as a learner would (see conftest.py):
after every move the page shows what ``course_lib.viz.moe`` computes in the test process for the same settings,
the text and the figure byte for byte."""

from __future__ import annotations

from course_lib.viz.moe import CONTROL_DESCRIPTIONS as MOE
from course_lib.viz.moe import moe_dispatch_widget
from tests.browser.conftest import mirror_from_notebook, require_playwright, widget_cells

expect = require_playwright()


def test_moe_dispatch_widget(lab):
    lab.open_notebook("07_expert_parallel.ipynb")
    lab.run_cells(widget_cells("07_expert_parallel.ipynb", "moe_dispatch_widget"))
    ui = lab.widget("course-moe-dispatch", name="moe_dispatch")
    mirror = mirror_from_notebook("07_expert_parallel.ipynb", moe_dispatch_widget)

    def check(step: str) -> None:
        expect(ui.html(0), f"text after {step!r}").to_have_text(mirror.text, use_inner_text=True)
        ui.expect_image(mirror.image.value, step=step)
        ui.screenshot(step)

    check("initial")
    ui.select_by_mouse(MOE["ep"], "2")
    mirror.set(ep=2)
    check("ep_by_mouse")
    ui.set_slider_by_keyboard(MOE["skew"], 2.0)
    mirror.set(skew=2.0)
    check("skew_by_keyboard")
    ui.select_by_mouse(MOE["capacity_factor"], "dropless")
    mirror.set(capacity_factor=None)
    check("dropless_by_mouse")
    lab.assert_no_errors()
