"""Chapter 08's planner widget in a real JupyterLab and browser, driven as a learner would (see conftest.py): after
every move the page shows what ``course_lib.viz.mesh.PlannerWidget`` computes in the test process for the same
settings, the ranking's text and both figures (the time bars, the best mesh) byte for byte, and no figure at all
when nothing fits."""

from __future__ import annotations

import ast
import json

from course_lib.viz.mesh import PlannerWidget
from tests.browser.conftest import REPO, WidgetUI, mirror_from_notebook, require_playwright, widget_cells

expect = require_playwright()

NOTEBOOK = "08_composing_4d.ipynb"


def _notebook_sets(notebook: str, variable: str) -> list[dict]:
    """The literal keyword arguments of every ``variable.set(...)`` the notebook runs, in order (the notebook
    moves the displayed widget itself after showing it: the page starts where the last of them left it)."""
    cells = json.loads((REPO / "notebooks" / notebook).read_text())["cells"]
    calls = []
    for cell in (c for c in cells if c["cell_type"] == "code"):
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "set"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == variable):
                calls.append({k.arg: ast.literal_eval(k.value) for k in node.keywords})
    return calls


def _expect_planner(ui: WidgetUI, mirror: PlannerWidget, step: str) -> None:
    expect(ui.html(0), f"ranking after {step!r}").to_have_text(mirror.text, use_inner_text=True)
    for nth, image in enumerate((mirror._img, mirror._mesh)):
        if image.value:
            ui.expect_image(image.value, nth=nth, step=f"{step}_{nth}")
        else:  # nothing to draw: the image is hidden, never an empty frame or a broken-image icon
            expect(ui.image(nth), f"figure {nth} after {step!r}").to_be_hidden()
    ui.screenshot(step)


def test_planner_widget(lab):
    lab.open_notebook(NOTEBOOK)
    lab.run_cells(widget_cells(NOTEBOOK, "PlannerWidget"))
    ui = lab.widget("course-planner", name="planner")
    mirror = mirror_from_notebook(NOTEBOOK, PlannerWidget)
    for change in _notebook_sets(NOTEBOOK, "widget"):
        mirror.set(**change)
    _expect_planner(ui, mirror, "initial")

    def step(name: str, **change) -> None:
        mirror.set(**change)
        _expect_planner(ui, mirror, name)

    assert mirror.values()["cluster"] != "pcie-h100-ethernet"
    ui.select_by_mouse("cluster", "pcie-h100-ethernet")
    step("cluster_by_mouse", cluster="pcie-h100-ethernet")

    seq = mirror.controls["seq_len"]
    ui.choose_by_keyboard("sequence", "ArrowDown")
    step("sequence_by_keyboard", seq_len=seq.options[seq.index + 1])

    ui.type_into("nodes", "1")
    step("nodes_by_typing", nodes=1)

    # a model that fits no mesh of one node: the text says so, and both figures disappear
    ui.select_by_mouse("model", "llama2-70b")
    step("nothing_fits_by_mouse", model="llama2-70b")
    assert " 0 ranked" in mirror.text and not mirror._img.value

    ui.select_by_mouse("model", "llama3-8b")
    step("fits_again_by_mouse", model="llama3-8b")
    assert mirror._img.value and mirror._mesh.value
    lab.assert_no_errors()
