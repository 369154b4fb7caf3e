"""The course's widgets in a real JupyterLab and browser, driven as a learner would (see conftest.py).

Each test opens a copy of the chapter's notebook, runs all cells, moves the widget's controls by mouse and by
keyboard, and checks after every move that the page shows what ``course_lib`` computes in the test process for
the same settings: the printed numbers and the figure, byte for byte. Screenshots: ``artifacts/browser/``.
Skip them with ``make test-fast`` or ``pytest -m "not browser"``.
"""

from __future__ import annotations

import math
import re
import time

from course_lib.estimates.cost import collective_time
from course_lib.estimates.memory_budget import format_bytes
from course_lib.viz.comm import CONTROL_DESCRIPTIONS as COMM
from course_lib.viz.comm import FITTED, CollectiveCostWidget, collective_cost_widget
from course_lib.viz.memory import CONTROL_DESCRIPTIONS as MEMORY
from course_lib.viz.memory import MemoryBudgetWidget, memory_budget_widget
from course_lib.viz.schedule import CONTROL_DESCRIPTIONS as BUBBLE
from course_lib.viz.schedule import BubbleWidget, bubble_widget
from tests.browser.conftest import EXPECT_MS, WidgetUI, mirror_from_notebook, require_playwright, widget_cells

expect = require_playwright()


def _expect_memory_budget(ui: WidgetUI, mirror: MemoryBudgetWidget, step: str) -> None:
    """The page shows ``mirror``'s verdict (and note), layout line, table and figure; then a screenshot."""
    lines = mirror.text.split("\n")
    head = 3 if mirror.note else 2  # verdict, the note of a preset that changed the sequence length, layout
    expect(ui.html(0), f"verdict after {step!r}").to_have_text("\n".join(lines[:head]), use_inner_text=True)
    expect(ui.container.locator("pre"), f"budget table after {step!r}").to_have_text("\n".join(lines[head:]))
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
    zero = mirror.controls["zero_stage"]
    assert zero.index > 0, "the notebook's widget should start above ZeRO-0"
    ui.choose_by_keyboard(MEMORY["zero_stage"], "ArrowUp")
    step("zero_by_keyboard", zero_stage=zero.options[zero.index - 1])

    # the DP degree, by typing into the dropdown (type-ahead picks the option "8")
    assert mirror.controls["dp"].value != 8
    ui.press(MEMORY["dp"], "8")
    step("dp_by_typing", dp=8)

    # the batch, by typing a number into its field
    batch = mirror.controls["batch"].value + 1
    ui.type_into(MEMORY["batch"], str(batch))
    step("batch_by_typing", batch=batch)

    # a nonsense batch: the error, by name, and no figure at all (neither a stale one nor a broken image)
    ui.type_into(MEMORY["batch"], "0")
    mirror.set(batch=0)
    expect(ui.html(0)).to_have_text(mirror.text, use_inner_text=True)
    assert "micro_batch must be an int >= 1, got 0" in mirror.text
    expect(ui.image()).to_be_hidden()
    ui.screenshot("batch_zero")
    ui.type_into(MEMORY["batch"], str(batch))
    mirror.set(batch=batch)
    _expect_memory_budget(ui, mirror, "batch_back")

    # how to use its dropdowns from the keyboard, said in the widget (JupyterLab keeps a closed list's arrows)
    expect(ui.container.locator(".course-keyboard-hint")).to_be_visible()

    # inference, by mouse: the training-only controls are disabled
    ui.click("inference")
    step("inference_by_mouse", mode="inference")
    expect(ui.input(MEMORY["zero_stage"])).to_be_disabled()
    expect(ui.input(MEMORY["kv_bytes"])).to_be_enabled()

    # TP, by keyboard, in inference
    tp = mirror.controls["tp"]
    ui.choose_by_keyboard(MEMORY["tp"], "ArrowDown")
    step("tp_by_keyboard", tp=tp.options[tp.index + 1])

    # back to training, by keyboard (focus the button, Space)
    ui.button("training").focus()
    lab.page.keyboard.press("Space")
    step("training_by_keyboard", mode="training")
    expect(ui.input(MEMORY["zero_stage"])).to_be_enabled()


# ----------------------------------------------------------------------------------------------------------------
# 01_collectives: the collective-cost calculator

_NUM = r"([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)"  # a number as format_seconds / :.3g write it (captured)
_TIME = _NUM + r"\s+(ns|µs|ms|s)"  # format_seconds: captures the number and its unit
_UNIT_S = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


def _literal(text: str) -> str:
    """``text`` as a regex, any run of whitespace matching any run (the page's inner text breaks lines at <br>
    and drops leading spaces)."""
    return r"\s+".join(re.escape(word) for word in text.split())


def _fitted_pattern(mirror: CollectiveCostWidget) -> str:
    """What the page shows on the link "this machine (fitted)" for ``mirror``'s op, size and ranks: the parts that
    do not depend on the link (size, steps, bytes per step and per rank, busbw factor: ``mirror.breakdown``)
    literally, the measured ones (time, alpha, beta, latency, bandwidth, algbw, busbw, the note) as captured
    numbers. Groups: t, unit, alpha, unit, beta GB/s, latency, unit, bandwidth, unit, algbw, busbw."""
    v, b = mirror.values(), mirror.breakdown
    ws = r"\s+"
    nbytes, step_bytes, sent = (format_bytes(b[k], digits=3) for k in ("nbytes", "step_bytes", "bytes_per_rank"))
    return "".join([
        r"^\s*", _literal(f"{v['op']} of {nbytes} on {v['world_size']} ranks over {FITTED}:"),
        ws, _TIME, ws, _literal(f"= {b['steps']:.0f} steps x (alpha"), ws, _TIME, ws,
        _literal(f"+ {step_bytes} / beta"), ws, _NUM, ws, _literal("GB/s) = latency"), ws, _TIME,
        ws, _literal("+ bandwidth"), ws, _TIME, ws,
        _literal(f"each rank sends {sent}; algbw = V/t ="), ws, _NUM, ws,
        _literal(f"GB/s, busbw = algbw x {b['busbw_factor']:.3g} ="), ws, _NUM, ws,
        _literal("GB/s (nccl-tests convention)"), r"\s+\S[\s\S]*$",  # then the note: where the fit comes from
    ])


def _expect_collective_cost(ui: WidgetUI, mirror: CollectiveCostWidget, shown: list[bytes], step: str) -> None:
    """The page shows ``mirror``'s prediction, word for word, and the link's source; the figure changed (it also
    draws the link fitted in the notebook, which this process cannot rebuild); then a screenshot."""
    link = mirror.links[mirror.controls["link"].value]
    expect(ui.html(0), f"prediction after {step!r}").to_have_text("\n".join([*mirror.text.split("\n"), link.source]),
                                                                  use_inner_text=True)
    ui.lab.wait_kernel_idle()  # the figure is drawn after the text: wait for the step's last redraw
    ui.expect_new_image(shown, step=step)
    ui.screenshot(step)


def _expect_collective_cost_fitted(ui: WidgetUI, mirror: CollectiveCostWidget, shown: list[bytes],
                                   step: str) -> None:
    """On "this machine (fitted)": the page shows ``_fitted_pattern(mirror)``, and its measured numbers agree with
    each other as ``course_lib.estimates.cost`` computes them (within the rounding of three significant digits)."""
    pattern = _fitted_pattern(mirror)
    expect(ui.html(0), f"prediction after {step!r}").to_have_text(re.compile(pattern), use_inner_text=True)
    ui.lab.wait_kernel_idle()
    ui.expect_new_image(shown, step=step)
    ui.screenshot(step)
    g = re.match(pattern, ui.html(0).inner_text()).groups()  # type: ignore[union-attr]
    t, alpha, latency, bandwidth = (float(g[i]) * _UNIT_S[g[i + 1]] for i in (0, 2, 5, 7))
    beta, algbw, busbw = float(g[4]) * 1e9, float(g[9]) * 1e9, float(g[10]) * 1e9
    v, b = mirror.values(), mirror.breakdown
    assert beta > 0 and alpha >= 0, f"{step}: the fitted link shows alpha {alpha} s, beta {beta} B/s"
    model = collective_time(v["op"], b["nbytes"], v["world_size"], alpha, beta)
    for name, got, want in (("time", t, model), ("latency", latency, b["steps"] * alpha),
                            ("bandwidth", bandwidth, b["steps"] * b["step_bytes"] / beta),
                            ("algbw", algbw, b["nbytes"] / t), ("busbw", busbw, algbw * b["busbw_factor"])):
        assert math.isclose(got, want, rel_tol=0.02, abs_tol=1e-9), (
            f"{step}: the page's {name} {got:.4g} is not what course_lib.estimates.cost gives for its "
            f"alpha {alpha:.4g} s and beta {beta:.4g} B/s: {want:.4g}")


def test_collective_cost_widget(lab):
    lab.open_notebook("01_collectives.ipynb")
    lab.run_cells(widget_cells("01_collectives.ipynb", "collective_cost_widget"))
    ui = lab.widget("course-collective-cost", name="collective_cost")

    # the same widget, built here from the notebook's own call, less what the notebook measures (the fitted link,
    # the measured points, their note): it gives the exact text of every vendor link
    mirror = mirror_from_notebook("01_collectives.ipynb", collective_cost_widget, fitted=None, measured=(),
                                  note=None, draw=False)
    shown: list[bytes] = []
    _expect_collective_cost(ui, mirror, shown, "initial")

    def step(name: str, **change) -> None:
        mirror.set(**change)
        _expect_collective_cost(ui, mirror, shown, name)

    # the collective, by mouse: open the dropdown, pick another one
    assert mirror.controls["op"].value != "reduce_scatter"
    ui.select_by_mouse(COMM["op"], "reduce_scatter")
    step("collective_by_mouse", op="reduce_scatter")

    # the size, by typing into the slider's readout (in MB: a log slider takes the value, not its exponent)
    assert mirror.controls["size_mb"].value != 1000
    ui.type_into_readout(COMM["size_mb"], "1000")
    expect(ui.slider(COMM["size_mb"])).to_have_attribute("aria-valuenow", "3.0")  # the handle holds log10(MB)
    step("size_by_typing", size_mb=1000.0)

    # the size, by the slider's keys: 4 steps of 0.05 down in log10(MB) -> 10^2.8 MB
    ui.press_slider(COMM["size_mb"], "ArrowLeft", 4)
    expect(ui.slider(COMM["size_mb"])).to_have_attribute("aria-valuenow", "2.8")
    expect(ui.readout(COMM["size_mb"])).to_have_text(f"{10**2.8:.3g}")
    step("size_by_keyboard", size_mb=10**2.8)

    # the number of ranks, by keyboard: open the list (Alt+ArrowDown), two options down, Enter
    ranks = mirror.controls["world_size"]
    ui.choose_by_keyboard(COMM["world_size"], "ArrowDown", "ArrowDown")
    step("ranks_by_keyboard", world_size=ranks.options[ranks.index + 2])

    # a fixed link preset, by mouse: InfiniBand between nodes
    assert mirror.controls["link"].value != "InfiniBand NDR 400G"
    ui.select_by_mouse(COMM["link"], "InfiniBand NDR 400G")
    step("link_by_mouse", link="InfiniBand NDR 400G")

    # the link fitted in the notebook, by keyboard (offered only when the notebook's fit succeeded)
    # (ipywidgets writes option labels with non-breaking spaces)
    options = [o.replace("\xa0", " ") for o in ui.input(COMM["link"]).locator("option").all_inner_texts()]
    assert options[:-1] == list(mirror.links) or options == list(mirror.links), options
    if options[-1] == FITTED:
        down = options.index(FITTED) - options.index("InfiniBand NDR 400G")
        ui.choose_by_keyboard(COMM["link"], *["ArrowDown"] * down)
        _expect_collective_cost_fitted(ui, mirror, shown, "fitted_link_by_keyboard")

    # back to a vendor link, by mouse: exact text again
    ui.select_by_mouse(COMM["link"], "NVLink 3 (A100)")
    step("link_back_by_mouse", link="NVLink 3 (A100)")


# ----------------------------------------------------------------------------------------------------------------
# 05_pipeline_parallel: the pipeline-bubble explorer


def _squash(text: str) -> str:
    """``text`` with every run of whitespace made one space (the page's inner text of a ``<pre>`` keeps the
    mirror's alignment spaces; the error's ``<b>..<br><b>`` gives a newline)."""
    return " ".join(text.split())


def _expect_bubble(ui: WidgetUI, mirror: BubbleWidget, shown: list[bytes], step: str) -> None:
    """The page shows ``mirror``'s text, exactly (whitespace aside), and its Gantt chart, byte for byte, which is
    none shown before; or, for an invalid combination, the message and no chart. Then a screenshot."""
    expect(ui.html(0), f"text after {step!r}").to_have_text(mirror.text, use_inner_text=True)
    ui.lab.wait_kernel_idle()  # the chart is drawn after the text
    assert _squash(ui.html(0).inner_text()) == _squash(mirror.text), step
    if mirror.error is None:
        assert mirror.image.value not in shown, f"{step}: the mirror's chart should change"
        ui.expect_image(mirror.image.value, step=step)
        shown.append(mirror.image.value)
    else:
        assert mirror.text.splitlines()[-1].startswith("invalid combination: "), mirror.text
        expect(ui.html(0).locator("b", has_text="invalid combination")).to_be_visible()
        deadline = time.monotonic() + EXPECT_MS / 1000
        while ui.image_bytes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ui.image_bytes() == b"", f"{step}: an invalid combination should show no chart"
    ui.screenshot(step)


def test_bubble_widget(lab):
    lab.open_notebook("05_pipeline_parallel.ipynb")
    lab.run_cells(widget_cells("05_pipeline_parallel.ipynb", "bubble_widget"))
    ui = lab.widget("course-bubble", name="bubble")

    # the same widget, built here from the notebook's own call: the text and the chart to expect
    mirror = mirror_from_notebook("05_pipeline_parallel.ipynb", bubble_widget)
    start = mirror.values()
    assert start["schedule"] == "1f1b" and start["p"] == 4 and start["m"] == 8 and start["v"] == 2, start
    shown: list[bytes] = []
    _expect_bubble(ui, mirror, shown, "initial")

    def step(name: str, **change) -> None:
        mirror.set(**change)
        _expect_bubble(ui, mirror, shown, name)

    def v_enabled(enabled: bool) -> None:
        target = ui.control(BUBBLE["v"]).locator(".noUi-target")
        if enabled:
            expect(target, "v applies to interleaved 1F1B").not_to_have_attribute("disabled", re.compile(".*"))
        else:
            expect(target, "v is disabled outside interleaved 1F1B").to_have_attribute("disabled", re.compile(".*"))

    v_enabled(False)

    # the schedule, by mouse: GPipe (all forwards, then all backwards)
    ui.select_by_mouse(BUBBLE["schedule"], "GPipe (AFAB)")
    step("gpipe_by_mouse", schedule="gpipe")
    v_enabled(False)

    # p, by the slider's keys: 4 -> 2 (ArrowLeft twice; each press redraws)
    ui.set_slider_by_keyboard(BUBBLE["p"], 2)
    step("p_by_keyboard", p=2)

    # the schedule, by mouse: 1F1B
    ui.select_by_mouse(BUBBLE["schedule"], "1F1B")
    step("1f1b_by_mouse", schedule="1f1b")

    # m, by typing into the slider's readout: 8 -> 12
    ui.type_into_readout(BUBBLE["m"], "12")
    expect(ui.slider(BUBBLE["m"])).to_have_attribute("aria-valuenow", "12.0")
    step("m_by_typing", m=12)

    # the schedule, by mouse: interleaved 1F1B, where v applies
    ui.select_by_mouse(BUBBLE["schedule"], "interleaved 1F1B")
    step("interleaved_by_mouse", schedule="interleaved")
    v_enabled(True)

    # v, by the slider's keys: 2 -> 3
    ui.set_slider_by_keyboard(BUBBLE["v"], 3)
    step("v_by_keyboard", v=3)

    # an invalid combination: m = 13 on p = 2 does not split into torch's 6 equal rounds: the message, no chart
    ui.type_into_readout(BUBBLE["m"], "13")
    step("invalid_m_by_typing", m=13)
    assert mirror.error is not None and "Try m = 12 or 14." in mirror.error, mirror.error

    # recover, by the slider's keys: m 13 -> 14
    ui.set_slider_by_keyboard(BUBBLE["m"], 14)
    step("recover_m_by_keyboard", m=14)
    assert mirror.error is None

    # the last stage's cost, by the slider's keys: 1.0 -> 1.5 (5 steps of 0.1)
    ui.press_slider(BUBBLE["imbalance"], "ArrowRight", 5)
    expect(ui.slider(BUBBLE["imbalance"])).to_have_attribute("aria-valuenow", "1.5")
    expect(ui.readout(BUBBLE["imbalance"])).to_have_text("1.5")
    step("last_stage_cost_by_keyboard", imbalance=1.5)

    # back to 1F1B, by mouse: v is disabled again and the last stage still costs x1.5
    ui.select_by_mouse(BUBBLE["schedule"], "1F1B")
    step("1f1b_again_by_mouse", schedule="1f1b")
    v_enabled(False)
