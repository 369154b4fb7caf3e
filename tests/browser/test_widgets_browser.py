"""The course's widgets in a real JupyterLab and browser, driven as a learner would (see conftest.py).

Each test opens a copy of the chapter's notebook, runs all cells, moves the widget's controls by mouse and by
keyboard, and checks after every move that the page shows what ``course_lib`` computes in the test process for
the same settings: the printed numbers and the figure, byte for byte. Screenshots: ``artifacts/browser/``.
Skip them with ``make test-fast`` or ``pytest -m "not browser"``.
"""

from __future__ import annotations

import os

import pytest

try:
    from playwright.sync_api import expect
except ImportError:  # a learner without the test extras; CI has them (and fails here if not)
    if os.environ.get("CI"):
        raise
    pytest.skip("Playwright for Python is missing: pip install -e '.[test]' (or make setup)",
                allow_module_level=True)

from course_lib.viz.memory import CONTROL_DESCRIPTIONS as MEMORY
from course_lib.viz.memory import MemoryBudgetWidget, memory_budget_widget
from tests.browser.conftest import WidgetUI, mirror_from_notebook


def _expect_memory_budget(ui: WidgetUI, mirror: MemoryBudgetWidget, step: str) -> None:
    """The page shows ``mirror``'s verdict, layout line, table and figure; then a screenshot of the step."""
    verdict, layout, *table = mirror.text.split("\n")
    expect(ui.html(0), f"verdict after {step!r}").to_have_text(f"{verdict}\n{layout}", use_inner_text=True)
    expect(ui.container.locator("pre"), f"budget table after {step!r}").to_have_text("\n".join(table))
    ui.expect_image(mirror.image.value, step=step)
    ui.screenshot(step)


def test_memory_budget_widget(lab):
    lab.open_notebook("00_budgets.ipynb")
    lab.run_all()
    ui = lab.widget("course-memory-budget", name="memory_budget")

    # the same widget, built in this process from the notebook's own call: the values to expect
    mirror = mirror_from_notebook("00_budgets.ipynb", memory_budget_widget)
    _expect_memory_budget(ui, mirror, "initial")
    shown = [mirror.image.value]

    def step(name: str, **change) -> None:
        mirror.set(**change)
        _expect_memory_budget(ui, mirror, name)
        assert mirror.image.value not in shown, f"{name}: the figure should change"
        shown.append(mirror.image.value)

    # the model preset, by mouse: open the dropdown, pick another preset
    model = "mixtral-8x7b" if mirror.controls["model"].value != "mixtral-8x7b" else "llama3-70b"
    ui.select_by_mouse(MEMORY["model"], model)
    step("model_by_mouse", model=model)

    # the ZeRO stage, by keyboard: focus the dropdown, open it, one option up, Enter
    zero = mirror.controls["zero"]
    assert zero.index > 0, "the notebook's widget should start above ZeRO-0"
    ui.choose_by_keyboard(MEMORY["zero"], "ArrowUp")
    step("zero_by_keyboard", zero=zero.options[zero.index - 1])

    # the DP degree, by typing into the dropdown (type-ahead picks the option "8")
    assert mirror.controls["dp"].value != 8
    ui.press(MEMORY["dp"], "8")
    step("dp_by_typing", dp=8)

    # the batch, by typing a number into its field
    batch = mirror.controls["batch"].value + 1
    ui.type_into(MEMORY["batch"], str(batch))
    step("batch_by_typing", batch=batch)

    # inference, by mouse: the training-only controls are disabled
    ui.click("inference")
    step("inference_by_mouse", mode="inference")
    expect(ui.input(MEMORY["zero"])).to_be_disabled()
    expect(ui.input(MEMORY["kv_bytes"])).to_be_enabled()

    # TP, by keyboard, in inference
    tp = mirror.controls["tp"]
    ui.choose_by_keyboard(MEMORY["tp"], "ArrowDown")
    step("tp_by_keyboard", tp=tp.options[tp.index + 1])

    # back to training, by keyboard (focus the button, Space)
    ui.button("training").focus()
    lab.page.keyboard.press("Space")
    step("training_by_keyboard", mode="training")
    expect(ui.input(MEMORY["zero"])).to_be_enabled()
