"""Chapter 11's collective-timeline widget in a real JupyterLab and browser, driven as a learner would (see
conftest.py): after every move the page shows what ``course_lib.viz.debug`` draws in the test process from the
same hang (the clinic's case run again here: its traces are the same call for call), text and figure byte for
byte."""

from __future__ import annotations

from course_lib.debug import clinic
from course_lib.viz.debug import CONTROL_DESCRIPTIONS as TIMELINES
from course_lib.viz.debug import timeline_widget
from tests.browser.conftest import mirror_from_notebook, require_playwright, widget_cells

expect = require_playwright()


def test_timeline_widget(lab):
    lab.open_notebook("11_debugging.ipynb")
    lab.run_cells(widget_cells("11_debugging.ipynb", "timeline_widget"))
    ui = lab.widget("course-timelines", name="timelines")
    hung = clinic.hang().run()
    mirror = mirror_from_notebook("11_debugging.ipynb", timeline_widget, traces=hung.traces, desync=hung.desync)

    def check(step: str) -> None:
        expect(ui.html(0), f"text after {step!r}").to_have_text(mirror.text, use_inner_text=True)
        ui.expect_image(mirror.image.value, step=step)
        ui.screenshot(step)

    mirror.set(group="tp", window=10)  # where the notebook's next cell leaves it
    check("after_run_all")
    ui.select_by_mouse(TIMELINES["group"], "every group")
    mirror.set(group="every group")
    check("every_group_by_mouse")
    ui.set_slider_by_keyboard(TIMELINES["window"], 14)
    mirror.set(window=14)
    check("window_by_keyboard")
    lab.assert_no_errors()
