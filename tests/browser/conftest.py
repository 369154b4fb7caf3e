"""End-to-end widget tests: a real JupyterLab driven by a real browser, as a learner uses the course.

A kernel-side test (``w.set(...)``) passes even when the page shows nothing: no widget manager, a broken front-end
version, an exception that only happens in the browser. These fixtures start what a learner runs and drive it:

* ``chromium_executable`` (session): Debian's ``chromium`` (apt), driven by Playwright for Python with
  ``executable_path``; ``playwright install`` (which downloads its own browser) is never needed. Missing: the
  tests are skipped with how to enable them, except under ``CI`` where that is a failure.
* ``jupyter_lab_process`` / ``jupyter_lab`` (session): JupyterLab on a free port of 127.0.0.1 (``port=0``, read
  back from its runtime file), its runtime/config/data/settings/workspace/IPython dirs and a copy of
  ``notebooks/`` in a temp dir (autosave never touches the repository); started before the browser, waited for
  after. At the end: one SIGTERM to its process group, a wait (10 s), SIGKILL to the group; the kernels it
  started run in their own sessions, so they are tracked with psutil and must be gone too (else an error).
* ``browser`` (session): chromium with a fresh user-data dir.
* ``lab`` (function): a fresh page: ``open_notebook`` (waits for the status bar's kernel "Idle": the toolbar's
  circle says idle before a kernel exists), ``run_all`` (Edit > Clear Outputs, Run > Run All Cells, fails fast
  on a traceback), ``run_cells`` (the same for the cells a widget needs, :func:`widget_cells`: the whole chapter
  runs in nbval, and chapter 00's test keeps Run All), ``widget(css_class)``. After the test: console log (and a
  page screenshot on failure) in ``artifacts/browser/``, no uncaught page exception, kernels shut down.
* :class:`WidgetUI` (from ``lab.widget``): controls by their label (``CONTROL_DESCRIPTIONS``):
  ``select_by_mouse``, ``choose_by_keyboard``, ``press`` (type-ahead), ``type_into``, ``set_slider_by_keyboard``,
  ``press_slider``, ``type_into_readout``, ``click``; ``html(n)``, ``text``, ``image_bytes``/``expect_image``
  (``expect_new_image`` for a figure drawn from the notebook's measurements); ``screenshot(step)`` to
  ``artifacts/browser/<widget>/NN_<step>.png``.

Keyboard in JupyterLab: keys that are notebook command-mode shortcuts (ArrowUp/Down, A, B, M, Y, 1-6, ...) go to
the notebook, not to a closed dropdown (jupyter-widgets/ipywidgets#3912): open the list first
(``choose_by_keyboard``: Alt+ArrowDown, arrows, Enter); sliders take ArrowLeft/Right.

A new widget needs only a test function: open its notebook, ``lab.run_cells(widget_cells(notebook, factory))``,
``lab.widget("course-...")``, move its controls, compare with what ``course_lib`` computes in the test process
(see ``test_widgets_browser.py``).
"""

from __future__ import annotations

import ast
import base64
import builtins
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

try:
    from playwright.sync_api import Locator, Page, expect, sync_playwright
except ImportError:  # reported by the chromium_executable fixture (fail in CI, skip elsewhere)
    Locator = Page = expect = sync_playwright = None  # type: ignore[assignment,misc]



def require_playwright() -> Any:
    """Playwright's ``expect`` for a browser test module, called at its top: a learner without the test extras
    skips the module; CI has them (and fails here if not)."""
    if expect is None:
        if os.environ.get("CI"):
            raise ImportError("Playwright for Python is missing: pip install -e '.[test]' (or make setup)")
        pytest.skip("Playwright for Python is missing: pip install -e '.[test]' (or make setup)",
                    allow_module_level=True)
    return expect


REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ARTIFACTS = REPO / "artifacts" / "browser"

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
SERVER_START_S = 120  # JupyterLab imports a lot: slow to answer on a loaded machine
KERNEL_START_MS = 180_000  # opening a notebook: JupyterLab's front end, then the kernel's first start
RUN_ALL_MS = 420_000  # a whole notebook on 2 loaded cores (00_budgets launches ranks)
EXPECT_MS = 30_000  # Playwright's default is 5 s: one widget round trip + a matplotlib redraw under load
TEST_TIMEOUT_S = 900  # pytest-timeout for a browser test (it also pays for the session's start)

HOW_TO_ENABLE = (
    "The browser tests need Debian's chromium and Playwright for Python (no `playwright install`): "
    "on Debian/Ubuntu run `sudo apt-get install chromium` (or `sudo make browser-deps`), "
    "or point COURSE_CHROMIUM at a Chromium/Chrome binary; Playwright comes with `pip install -e '.[test]'`. "
    "Quick runs without a browser: `make test-fast` or `pytest -m 'not browser'`."
)

if expect is not None:
    expect.set_options(timeout=EXPECT_MS)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Every test under tests/browser is a browser test (so ``-m "not browser"`` deselects it) and gets a timeout
    that leaves room for JupyterLab's start and a first run of a notebook on a loaded machine."""
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.browser)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


# ----------------------------------------------------------------------------------------------------------------
# chromium


def find_chromium() -> str | None:
    """COURSE_CHROMIUM, else Debian's /usr/bin/chromium, else `chromium` on PATH."""
    for candidate in (os.environ.get("COURSE_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="session")
def chromium_executable() -> str:
    missing = []
    if sync_playwright is None:
        missing.append("the Python package playwright is not installed")
    path = find_chromium()
    if path is None:
        missing.append("no chromium found (COURSE_CHROMIUM, /usr/bin/chromium, PATH)")
    if missing:
        msg = "; ".join(missing) + ". " + HOW_TO_ENABLE
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser tests, but {msg}", pytrace=False)
        pytest.skip(msg)
    return path  # type: ignore[return-value]


@pytest.fixture(scope="session")
def browser(chromium_executable, tmp_path_factory):
    """A persistent chromium context on a fresh user-data dir (one browser for the session)."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=chromium_executable, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000}, timeout=120_000)
        try:
            yield context
        finally:
            context.close()


# ----------------------------------------------------------------------------------------------------------------
# JupyterLab


@dataclass
class JupyterLabServer:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT/
    token: str
    root: Path  # the server's root dir: a copy of notebooks/ (or the folder given to _start_server)
    runtime: Path
    log: Path
    kernel_pids: set[int] = field(default_factory=set)

    def wait_ready(self, timeout_s: float = SERVER_START_S) -> None:
        """Wait until the server has written its port (``--ServerApp.port=0``: the OS picks a free one) and its
        REST API answers."""
        if self.url:
            return
        deadline = time.monotonic() + timeout_s
        info = self.runtime / f"jpserver-{self.proc.pid}.json"
        while time.monotonic() < deadline and self.proc.poll() is None:
            if info.exists():
                try:
                    url = f"http://127.0.0.1:{json.loads(info.read_text())['port']}/"
                    self.url = url
                    self.api("GET", "api/status")
                    return
                except (OSError, ValueError, KeyError):
                    self.url = ""
            time.sleep(0.25)
        code = self.proc.poll()
        why = f"exited with code {code}" if code is not None else f"did not answer in {timeout_s:.0f} s"
        raise RuntimeError(f"JupyterLab {why}; the end of its log:\n" + self.log.read_text(errors="replace")[-4000:])

    def api(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path.lstrip("/"), method=method, data=data,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def remember_kernels(self) -> None:
        """Note the processes the server started so far (kernels run in their own sessions, outside its group)."""
        try:
            self.kernel_pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def shutdown_sessions(self) -> None:
        """Shut down every kernel session (after a test: the next one starts from a clean server)."""
        self.remember_kernels()
        for s in self.api("GET", "api/sessions"):
            self.api("DELETE", f"api/sessions/{s['id']}")


def _write_lab_settings(settings: Path) -> None:
    """User settings of the temp JupyterLab: no news/update checks (no network, no toast over the page)."""
    files = {
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                            "checkForUpdates": False},
    }
    for rel, value in files.items():
        (settings / rel).parent.mkdir(parents=True, exist_ok=True)
        (settings / rel).write_text(json.dumps(value))


def _start_server(base: Path, root: Path | None = None, app_settings_dir: Path | None = None,
                  make_lab: dict[str, Any] | None = None) -> JupyterLabServer:
    """Start JupyterLab in ``base`` (a temp dir) and return at once (see :meth:`JupyterLabServer.wait_ready`).

    By default it serves a copy of ``notebooks/`` with the test's own user settings (no news, no update checks).
    ``root``: serve that folder instead; ``app_settings_dir``: JupyterLab's app settings dir (``make lab`` passes
    the project's ``jupyter/lab/settings``), and then no user settings are written, so what the page shows is
    what those settings give a learner. ``make_lab``: what else ``make lab`` gives the server (``cwd``, its
    ``workspaces`` folder, its other ``args``, ``env`` for the terminals it opens)."""
    make_lab = make_lab or {}
    dirs = {k: base / k for k in ("root", "runtime", "config", "data", "settings", "workspaces", "ipython")}
    if root is None:
        shutil.copytree(REPO / "notebooks", dirs["root"], ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    else:
        dirs["root"] = root
    if "workspaces" in make_lab:
        dirs["workspaces"] = make_lab["workspaces"]
    for k, d in dirs.items():
        if k != "root":
            d.mkdir(parents=True, exist_ok=True)
    if app_settings_dir is None:
        _write_lab_settings(dirs["settings"])
    token = secrets.token_hex(24)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # the kernel runs as a learner's
    env.update(JUPYTER_TOKEN=token, JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
               JUPYTER_CONFIG_DIR=str(dirs["config"]), JUPYTER_DATA_DIR=str(dirs["data"]),
               JUPYTERLAB_SETTINGS_DIR=str(dirs["settings"]), JUPYTERLAB_WORKSPACES_DIR=str(dirs["workspaces"]),
               IPYTHONDIR=str(dirs["ipython"]), **make_lab.get("env", {}))
    log = base / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0",
           "--ServerApp.port_retries=0", f"--ServerApp.root_dir={dirs['root']}",
           f"--LabApp.user_settings_dir={dirs['settings']}", f"--LabApp.workspaces_dir={dirs['workspaces']}",
           "--LabApp.extension_manager=readonly", *make_lab.get("args", [])]  # no PyPI queries
    if app_settings_dir is not None:
        cmd.append(f"--LabApp.app_settings_dir={app_settings_dir}")
    if os.geteuid() == 0:  # containers and CI often run as root
        cmd.append("--allow-root")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=make_lab.get("cwd", dirs["root"]), env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return JupyterLabServer(proc=proc, url="", token=token, root=dirs["root"], runtime=dirs["runtime"], log=log)


def _stop_server(server: JupyterLabServer) -> list[str]:
    """One SIGTERM to the server's process group, wait up to 10 s, then SIGKILL the group. Returns the
    processes it started that were still alive afterwards (killed here; the caller reports them)."""
    server.remember_kernels()
    started = []
    for pid in server.kernel_pids:
        try:
            started.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    pgid = server.proc.pid  # start_new_session: the server leads its own group
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        server.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait(timeout=10)
    _, alive = psutil.wait_procs(started, timeout=10)  # kernels exit when the server shuts them down
    left = []
    for p in alive:
        try:
            left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return left


@pytest.fixture(scope="session")
def jupyter_lab_process(chromium_executable, tmp_path_factory) -> Iterator[JupyterLabServer]:
    """JupyterLab, started (not yet answering: the browser starts meanwhile); stopped at the end of the session."""
    server = _start_server(tmp_path_factory.mktemp("jupyterlab"))
    try:
        yield server
    finally:
        left = _stop_server(server)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(server.log, ARTIFACTS / "jupyterlab.log")
        assert not left, f"processes started by JupyterLab outlived it (killed now): {left}"


@pytest.fixture(scope="session")
def jupyter_lab(jupyter_lab_process) -> JupyterLabServer:
    """The session's JupyterLab, answering."""
    jupyter_lab_process.wait_ready()
    return jupyter_lab_process


# ----------------------------------------------------------------------------------------------------------------
# The page and the widgets


def _exact(text: str) -> re.Pattern:
    return re.compile(rf"^\s*{re.escape(text)}\s*$")


class WidgetUI:
    """One displayed ipywidgets container (found by its CSS class), driven as a learner would.

    Controls are found by their ``description`` (the label next to them, e.g. ``CONTROL_DESCRIPTIONS``).
    """

    def __init__(self, lab: Lab, container: Locator, name: str) -> None:
        self.lab, self.page, self.container, self.name = lab, lab.page, container, name
        self.steps = 0
        self.dir = ARTIFACTS / name
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)

    # ---- finding controls

    def control(self, description: str) -> Locator:
        """The control's box (``.widget-inline-hbox``): its label reads exactly ``description``."""
        label = self.page.locator("label.widget-label", has_text=_exact(description))
        box = self.container.locator(".widget-inline-hbox").filter(has=label)
        expect(box, f"no control labelled {description!r} in {self.name}").to_have_count(1)
        return box

    def input(self, description: str) -> Locator:
        """The control's <select>/<input>/<textarea> (ipywidgets links its label to it)."""
        return self.container.get_by_label(description, exact=True)

    def button(self, text: str) -> Locator:
        """A button (e.g. one of ToggleButtons' options) by its text."""
        return self.container.get_by_role("button", name=text, exact=True)

    # ---- changing controls

    def select_by_mouse(self, description: str, option: str) -> None:
        """Click a dropdown, then pick ``option`` (its label) from the list."""
        select = self.input(description)
        select.click()
        select.select_option(label=option)

    def choose_by_keyboard(self, description: str, *keys: str) -> None:
        """Focus a dropdown, open its list with Alt+ArrowDown, move with ``keys`` (e.g. "ArrowUp"), Enter.

        Not plain arrows on the closed dropdown: in JupyterLab they move the notebook's cell selection
        instead (command-mode shortcuts take them first; jupyter-widgets/ipywidgets#3912).
        """
        self.input(description).focus()
        self.page.keyboard.press("Alt+ArrowDown")
        for key in keys:
            self.page.keyboard.press(key)
        self.page.keyboard.press("Enter")

    def press(self, description: str, *keys: str) -> None:
        """Focus a control (dropdown, text field, slider handle) and press keys, e.g. type-ahead "8" on a
        dropdown. Keys that are JupyterLab command-mode shortcuts (arrows, A, B, M, Y, 1-6, ...) go to the
        notebook instead of a closed dropdown: use :meth:`choose_by_keyboard` there."""
        target = self.input(description)
        (target if target.count() else self.slider(description)).focus()
        for key in keys:
            self.page.keyboard.press(key)

    def type_into(self, description: str, text: str) -> None:
        """Select a text/number field's content, type ``text`` and press Enter (ipywidgets sends on Enter/blur)."""
        field_ = self.input(description)
        field_.click(click_count=3)
        self.page.keyboard.type(text)
        self.page.keyboard.press("Enter")

    def slider(self, description: str) -> Locator:
        """A slider's handle (noUiSlider: role=slider, aria-valuenow)."""
        return self.control(description).get_by_role("slider").first

    def set_slider_by_keyboard(self, description: str, value: float, max_presses: int = 200) -> None:
        """Focus a slider's handle and press ArrowRight/ArrowLeft until it reads ``value`` (ArrowUp/Down would
        move the notebook's cell selection in JupyterLab instead)."""
        handle = self.slider(description)
        handle.focus()
        direction = 0
        for _ in range(max_presses):
            before = handle.get_attribute("aria-valuenow") or "nan"
            now = float(before)
            if math.isclose(now, value, rel_tol=1e-9, abs_tol=1e-9):
                return
            step = 1 if now < value else -1
            if direction and step != direction:
                raise AssertionError(f"slider {description!r} cannot land on {value} (it went past, to {now})")
            direction = step
            self.page.keyboard.press("ArrowRight" if step > 0 else "ArrowLeft")
            expect(handle, f"slider {description!r} did not move").not_to_have_attribute("aria-valuenow", before)
        raise AssertionError(f"slider {description!r} did not reach {value} in {max_presses} presses")

    def press_slider(self, description: str, key: str, times: int = 1) -> None:
        """Focus a slider's handle and press ``key`` (ArrowLeft/ArrowRight: one step each) ``times`` times. For
        sliders :meth:`set_slider_by_keyboard` cannot read: noUiSlider writes ``aria-valuenow`` with one decimal
        (a step of 0.05 may not change it) and a log slider's handle holds the exponent, not the value."""
        self.slider(description).focus()
        for _ in range(times):
            self.page.keyboard.press(key)

    def readout(self, description: str) -> Locator:
        """A slider's readout: the number beside it, which ipywidgets lets the learner edit."""
        return self.control(description).locator(".widget-readout")

    def type_into_readout(self, description: str, text: str) -> None:
        """Select a slider's readout, type ``text`` and press Enter: the slider takes the typed value (clamped to
        its range; a log slider's value, not its exponent)."""
        self.readout(description).click(click_count=3)
        self.page.keyboard.type(text)
        self.page.keyboard.press("Enter")

    def click(self, text: str) -> None:
        self.button(text).click()

    # ---- reading

    def html(self, nth: int = 0) -> Locator:
        """The ``nth`` HTML widget (e.g. a verdict, a table) inside the container."""
        return self.container.locator(".widget-html-content").nth(nth)

    def text(self, selector: str = ".widget-html-content", nth: int = 0) -> str:
        return self.container.locator(selector).nth(nth).inner_text()

    def image(self, nth: int = 0) -> Locator:
        return self.container.locator("img").nth(nth)

    def image_bytes(self, nth: int = 0) -> bytes:
        """The bytes the ``nth`` image shows (ipywidgets' Image uses a blob: URL; a data: URL works too)."""
        js = """async (img) => {
            if (!img.src) return "";
            const blob = await (await fetch(img.src)).blob();
            return await new Promise(done => {
                const r = new FileReader(); r.onload = () => done(r.result.split(",", 2)[1]); r.readAsDataURL(blob);
            });
        }"""
        return base64.b64decode(self.image(nth).evaluate(js))

    def expect_image(self, expected: bytes, nth: int = 0, timeout_s: float = EXPECT_MS / 1000, step: str = "") -> None:
        """Wait until the ``nth`` image shows exactly ``expected`` (PNG bytes computed in the test process)."""
        deadline = time.monotonic() + timeout_s
        got = b""
        while time.monotonic() < deadline:
            got = self.image_bytes(nth)
            if got == expected:
                return
            time.sleep(0.2)
        (self.dir / f"{step or 'image'}_expected.png").write_bytes(expected)
        (self.dir / f"{step or 'image'}_shown.png").write_bytes(got)
        raise AssertionError(f"{self.name}: the figure shown ({len(got)} B) is not the one expected "
                             f"({len(expected)} B) after {step!r}; both saved in {self.dir}")

    def expect_new_image(self, seen: list[bytes], nth: int = 0, timeout_s: float = EXPECT_MS / 1000,
                         step: str = "") -> bytes:
        """Wait until the ``nth`` image shows a figure that is none of ``seen``, append it to ``seen``, return it.
        For a figure the test process cannot rebuild byte for byte (drawn from the notebook's measurements):
        call it once the page shows the step's final text and the kernel is idle, so that the figure is that
        step's, not one drawn on the way (a slider moved by several key presses redraws after each)."""
        deadline = time.monotonic() + timeout_s
        got = self.image_bytes(nth)
        while got in seen and time.monotonic() < deadline:
            time.sleep(0.2)
            got = self.image_bytes(nth)
        if got in seen:
            raise AssertionError(f"{self.name}: the figure did not change after {step!r} (it is the one shown "
                                 f"{len(seen) - seen.index(got)} step(s) before)")
        seen.append(got)
        return got

    def screenshot(self, step: str) -> Path:
        """Save the widget as ``artifacts/browser/<widget>/<NN>_<step>.png``."""
        path = self.dir / f"{self.steps:02d}_{step}.png"
        self.steps += 1
        self.container.scroll_into_view_if_needed()
        self.container.screenshot(path=str(path), animations="disabled")
        return path


class Lab:
    """A fresh browser page on the session's JupyterLab."""

    def __init__(self, page: Page, server: JupyterLabServer) -> None:
        self.page, self.server = page, server
        self.notebook = ""  # the open notebook, relative to the server's root
        self.page_errors: list[str] = []
        self.console: list[str] = []
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        page.on("console", lambda m: self.console.append(f"[{m.type}] {m.text}"))

    def open_notebook(self, path: str, workspace: str = "test") -> None:
        """Open ``path`` (relative to notebooks/, a copy) in a fresh workspace and wait for its kernel."""
        self.notebook = path
        url = f"{self.server.url}lab/workspaces/{workspace}/tree/{path}?reset&token={self.server.token}"
        self.page.goto(url, timeout=KERNEL_START_MS)
        expect(self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")).to_be_visible(
            timeout=KERNEL_START_MS)
        self.wait_kernel_idle(KERNEL_START_MS)
        self.server.remember_kernels()

    def kernel_status(self) -> Locator:
        """The status bar's kernel item, "Python 3 (ipykernel) | Idle" (the toolbar's circle says idle before a
        kernel exists; this text shows the kernel's real state)."""
        return self.page.locator("#jp-main-statusbar").get_by_text(re.compile(r"\|\s*(Idle|Busy|Starting|"
                                                                              r"Connecting|Restarting|Unknown|"
                                                                              r"Initializing|Dead|No Kernel)"))

    def wait_kernel_idle(self, timeout_ms: float = EXPECT_MS) -> None:
        expect(self.kernel_status()).to_have_text(re.compile(r"\|\s*Idle\s*$"), timeout=timeout_ms)

    def menu(self, top: str, item: str) -> None:
        """Click a menu of the menu bar, then one of its items (what a learner does)."""
        self.page.locator(".lm-MenuBar-item", has_text=_exact(top)).click()
        self.page.locator(".lm-Menu-item:not(.lm-mod-disabled)", has_text=_exact(item)).click()

    def run_all(self, timeout_ms: float = RUN_ALL_MS) -> None:
        """Edit > Clear Outputs of All Cells, Run > Run All Cells; wait until every code cell has run and the kernel
        is idle. Fails early with the traceback if a cell raises (except cells tagged ``raises-exception``, which
        JupyterLab, like papermill and nbval, runs past)."""
        self._clear_outputs()
        self.menu("Run", "Run All Cells")
        self._wait_run(None, timeout_ms)

    def run_cells(self, cells: list[int], timeout_ms: float = RUN_ALL_MS) -> None:
        """Edit > Clear Outputs of All Cells, then each of ``cells`` (indices into the notebook's cells, e.g.
        :func:`widget_cells`) as a learner runs one: a click on its prompt, Ctrl+Enter (JupyterLab queues them);
        wait as :meth:`run_all` does, for these cells."""
        self._clear_outputs()
        panel = self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")
        for index in cells:
            panel.nth(index).locator(".jp-InputPrompt").click()
            self.page.keyboard.press("Control+Enter")
        self._wait_run(cells, timeout_ms)

    def _clear_outputs(self) -> None:
        self.menu("Edit", "Clear Outputs of All Cells")
        self.page.wait_for_function("""() => [...document.querySelectorAll(
            '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt')]
            .every(p => !/\\d/.test(p.textContent))""")

    def _wait_run(self, cells: list[int] | None, timeout_ms: float) -> None:
        """Until the code cells among ``cells`` (every one if None) show an execution count, then the kernel idle;
        a traceback in any cell fails at once."""
        nb = json.loads((self.server.root / self.notebook).read_text())
        expected_errors = [i for i, c in enumerate(nb["cells"])
                           if "raises-exception" in c.get("metadata", {}).get("tags", [])]
        state = self.page.wait_for_function("""([expectedErrors, only]) => {
            const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
            const cells = [...panel.querySelectorAll('.jp-Cell')];
            for (const [i, cell] of cells.entries()) {
                if (expectedErrors.includes(i)) continue;
                for (const o of cell.querySelectorAll('.jp-OutputArea-output'))
                    if (/Traceback \\(most recent call last\\)|Error\\s*Traceback/.test(o.textContent))
                        return `error in cell ${i}: ` + o.textContent.slice(-3000);
            }
            const ps = cells.filter((c, i) => c.classList.contains('jp-CodeCell') && (!only || only.includes(i)))
                .map(c => c.querySelector('.jp-InputArea-prompt').textContent);
            return ps.length > 0 && ps.every(p => /\\[\\d+\\]/.test(p)) ? 'done' : false;
        }""", arg=[expected_errors, cells], timeout=timeout_ms, polling=500).json_value()
        assert state == "done", f"a cell raised while running cells of {self.notebook}:\n{state}"
        self.wait_kernel_idle(timeout_ms)

    def widget(self, css_class: str, name: str | None = None) -> WidgetUI:
        """The one displayed widget container with this CSS class (``w.add_class(...)``), scrolled into view."""
        container = self.page.locator(f".jp-NotebookPanel:not(.lm-mod-hidden) .{css_class}")
        expect(container, f"the page shows no widget .{css_class}").to_have_count(1)
        container.scroll_into_view_if_needed()
        expect(container).to_be_visible()
        return WidgetUI(self, container, name or css_class.removeprefix("course-").replace("-", "_"))

    def assert_no_errors(self) -> None:
        """No uncaught exception in the page, no widget that failed to render."""
        assert not self.page_errors, f"exceptions in the browser: {self.page_errors}"
        failed = self.page.get_by_text("Error displaying widget")
        assert failed.count() == 0, "a widget failed to render in the browser"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item (the ``lab`` fixture screenshots the page when the test failed)."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def lab(jupyter_lab_process, browser, jupyter_lab, request) -> Iterator[Lab]:
    """A fresh page per test (JupyterLab boots while the browser starts); afterwards its console is saved (and a
    screenshot of the whole page if the test failed), its kernels shut down, the page closed."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page()
    lab = Lab(page, jupyter_lab)
    name = request.node.name
    try:
        yield lab
        report = getattr(request.node, "report_call", None)
        if report is not None and report.failed:
            page.screenshot(path=str(ARTIFACTS / f"{name}.failure.png"), full_page=True)
        else:
            lab.assert_no_errors()
    finally:
        (ARTIFACTS / f"{name}.console.log").write_text("\n".join(lab.console + lab.page_errors) + "\n")
        page.close()
        jupyter_lab.shutdown_sessions()


def mirror_from_notebook(notebook: str | Path, factory: Callable[..., Any], **overrides: Any) -> Any:
    """Build in the test process the widget a notebook displays: the first call ``factory(...)`` in its code,
    with ``overrides`` (which must give every argument that is not a literal there). A test then compares the
    page with this widget's own ``.text`` and figure: it never hard-codes the notebook's settings or numbers."""
    name = factory.__name__
    nb = json.loads((REPO / "notebooks" / notebook).read_text())
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or name not in source:
            continue
        source = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name:
                args = [ast.literal_eval(a) for a in node.args]
                kwargs, computed = {}, []
                for k in node.keywords:
                    if k.arg in overrides:
                        continue
                    try:
                        kwargs[k.arg] = ast.literal_eval(k.value)
                    except ValueError:
                        computed.append(k.arg)
                if computed:
                    raise ValueError(f"{name}(...) in notebooks/{notebook}: {computed} are computed in the notebook; "
                                     "pass them to mirror_from_notebook as keyword arguments")
                return factory(*args, **kwargs, **overrides)
    raise LookupError(f"no call to {name}(...) in notebooks/{notebook}")


def _cell_tree(source: str) -> ast.Module:
    return ast.parse("\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))))


def _defined(tree: ast.AST) -> set[str]:
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(n.name)
    return names


def _free(tree: ast.AST) -> set[str]:
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return used - _defined(tree) - set(dir(builtins))


def widget_cells(notebook: str, factory: str) -> list[int]:
    """The cells of ``notebook`` (indices) that show its ``var = factory(...)`` widget as the notebook leaves it:
    every code cell up to the one importing ``factory`` (parameters, imports, seeds), the cell that makes the widget,
    each later cell using ``var`` (until one rebinds it), and, transitively, the last earlier cell defining each
    name those cells read. The rest of the chapter runs in nbval; a name missed here fails the run with its
    NameError, never a silent pass."""
    cells = json.loads((REPO / "notebooks" / notebook).read_text())["cells"]
    code = {i: _cell_tree("".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"}
    setup = next(i for i, tree in code.items() if factory in _defined(tree))
    made = next(i for i, tree in code.items() if i > setup and factory in _free(tree))
    var = next(node.targets[0].id for node in code[made].body if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == factory)
    targets = [made]
    for i, tree in code.items():
        if i > made:
            if var in _defined(tree):
                break
            if var in _free(tree):
                targets.append(i)
    need, todo = {i for i in code if i <= setup} | set(targets), list(targets)
    while todo:
        cell = todo.pop()
        for name in _free(code[cell]):
            sources = [i for i in code if i < cell and name in _defined(code[i])]
            if sources and sources[-1] not in need:
                need.add(sources[-1])
                todo.append(sources[-1])
    return sorted(need)
