"""`make lab` as a learner gets it, in a real JupyterLab and browser: the server `make lab` would start (its folder,
root, start page, settings, workspace and other options read from `make -n lab` in a small git clone of the
course), not the session's test server. No news prompt, the file browser in the learner's notebooks/, exercises
that open unmodified, a chapter run and saved that leaves the repository's `git status` clean, a chapter and its
exercise on two tabs of different names, and JupyterLab's own terminal grading the learner's copy."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import nbformat
import pytest

from course_lib.course import my_copy
from course_lib.grading.notebooks import exercise_name
from tests.browser.conftest import REPO, Lab, _start_server, _stop_server, require_playwright
from tests.test_my_copy import _course, _git_status, _lab_command

expect = require_playwright()

NEWS = "official Jupyter news"
CHAPTER = "notebooks/00_budgets.ipynb"
EXERCISE = f"exercises/{exercise_name('00_budgets.ipynb')}"
NOTIFICATION = "@jupyterlab/apputils-extension:notification"


@pytest.fixture
def make_lab(chromium_executable, tmp_path):
    """(server, course repository, start page): JupyterLab started as `make lab` starts it, on a fresh copy."""
    stamp = REPO / ".venv" / ".installed"
    if not stamp.exists() or stamp.stat().st_mtime < (REPO / "pyproject.toml").stat().st_mtime:
        # `make grade` in the lab's terminal would reinstall this .venv from the small copy made below
        pytest.fail(f"{stamp} is older than pyproject.toml: run `make setup` first (as `make test` does)")
    repo = _course(tmp_path)
    lab = _lab_command(repo)
    root = Path(re.search(r'--ServerApp.root_dir="([^"]+)"', lab).group(1))
    settings = Path(re.search(r'--LabApp.app_settings_dir="([^"]+)"', lab).group(1))
    page = re.search(r"--LabApp.default_url=/lab/tree/(\S+)", lab).group(1)
    my_copy.sync(root, repo)  # what `make lab` runs first (make my-copy)
    old_style = json.loads((root / EXERCISE).read_text())
    old_style["metadata"]["language_info"] = {"name": "python"}  # how exercises were stored before
    (root / "exercises" / "old_style.ipynb").write_text(json.dumps(old_style))
    options = {"cwd": repo / re.search(r'cd "([^"]+)" &&', lab).group(1),
               "workspaces": Path(re.search(r'--LabApp.workspaces_dir="([^"]+)"', lab).group(1)),
               "args": re.findall(r"--(?:KernelManager|LanguageServerManager)\.\S+", lab),
               "env": {"VENV": str(REPO / ".venv")}}  # `make` in its terminal: this course's environment
    server = _start_server(tmp_path / "lab", root=root, app_settings_dir=settings, make_lab=options)
    try:
        server.wait_ready()
        yield server, repo, page
    finally:
        left = _stop_server(server)
        assert not left, f"processes started by JupyterLab outlived it: {left}"


def _saved_run(cells: list[dict], hello: int, last: int) -> bool:
    """The saved notebook holds the run: the launch cell's output, and no output in the last cell."""
    return not cells[last]["outputs"] and "before all_reduce" in json.dumps(cells[hello]["outputs"])


def _wait_workspace_holds(server, workspace: str, path: str, timeout_s: float = 60) -> None:
    """JupyterLab saves a workspace's layout a moment after it changes: wait until ``path`` is in it (opening
    another document by URL in that workspace before then restores a layout without it)."""
    deadline, data = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            data = server.api("GET", f"lab/api/workspaces/{workspace}")
        except OSError:  # not saved yet (404) or the server is busy
            data = {}
        if path in json.dumps(data):
            return
        time.sleep(0.5)
    raise AssertionError(f"workspace {workspace!r} never recorded {path} in {timeout_s:.0f} s: {data}")


def _dirty_tabs(lab: Lab) -> int:
    return lab.page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-dirty").count()


def test_make_lab_as_a_learner_sees_it(make_lab, browser):
    server, repo, start = make_lab
    lab = Lab(browser.new_page(), server)
    try:
        lab.open_notebook(start)
        # the file browser opens where the start page is: the learner's copy of notebooks/
        listing = lab.page.locator(".jp-FileBrowser .jp-DirListing-content")
        expect(listing.get_by_text("START_HERE.ipynb", exact=True)).to_be_visible()
        expect(lab.page.locator(".jp-FileBrowser .jp-BreadCrumbs")).to_contain_text("notebooks")
        assert _dirty_tabs(lab) == 0, "the start page opened modified"

        # run the page up to its first launch (4 ranks), after clearing every output, and save it
        saved = server.root / start
        course = json.loads(saved.read_text())["cells"]
        hello = next(i for i, c in enumerate(course) if "launch(hello" in "".join(c["source"]))
        last = max(i for i, c in enumerate(course) if c["cell_type"] == "code")
        assert course[last]["outputs"], "the course's version has the last cell's outputs"
        lab.menu("Edit", "Clear Outputs of All Cells")
        notebook = lab.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
        notebook.locator(".jp-Cell").nth(hello + 1).click()
        lab.menu("Run", "Run All Above Selected Cell")
        expect(notebook.get_by_text("before all_reduce").first).to_be_visible(timeout=180_000)
        lab.wait_kernel_idle(180_000)  # the launcher stops its ranks (slow on a loaded machine)
        notebook.locator(".jp-Cell").nth(hello).click()
        lab.page.keyboard.press("Escape")
        lab.page.keyboard.press("Control+s")  # what a learner presses (autosave does the same later)
        # an autosave may have written the cleared notebook before the run's outputs came: wait for the save
        # that has them (both conditions), not for the first file without the last cell's outputs
        deadline, cells = time.monotonic() + 90, course
        while not _saved_run(cells, hello, last) and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                cells = json.loads(saved.read_text())["cells"]
            except ValueError:  # read while the server writes it
                pass
        assert not cells[last]["outputs"], "the cleared outputs were not saved to the learner's copy"
        assert "before all_reduce" in json.dumps(cells[hello]["outputs"]), "the run was not saved"
        assert _git_status(repo) == "", "running and saving a chapter changed the repository"
        expect(lab.page.get_by_text(NEWS)).to_have_count(0)  # long after start-up: the prompt never came

        # exercises open unmodified; one stored the old way (language_info {"name": "python"}) does not
        lab.open_notebook(EXERCISE, workspace="exercise")
        lab.page.wait_for_timeout(2000)
        assert _dirty_tabs(lab) == 0, f"{EXERCISE} opened modified"
        lab.open_notebook("exercises/old_style.ipynb", workspace="old")
        expect(lab.page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-dirty")).to_have_count(1)

        # the check can fail: with the learner's own setting back at JupyterLab's default, the prompt shows
        server.api("PUT", f"lab/api/settings/{NOTIFICATION}", {"raw": json.dumps({"fetchNews": "none"})})
        lab.open_notebook(start, workspace="news")
        expect(lab.page.get_by_text(NEWS)).to_be_visible()
    finally:
        lab.page.close()
        server.shutdown_sessions()


def _tab_labels(lab: Lab) -> list[str]:
    return lab.page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab .lm-TabBar-tabLabel").all_inner_texts()


def test_the_learners_terminal_grades_the_learners_copy(make_lab, browser):
    """The learner solved the exercise in their copy (JupyterLab's root); the course's own copy is blank. From
    File > New > Terminal, `make grade NB=exercises/...` grades the learner's copy: full marks, not 0."""
    server, repo, _ = make_lab
    solved = nbformat.read(REPO / "solutions" / Path(EXERCISE).name, as_version=4)
    nbformat.write(solved, server.root / EXERCISE)
    lab = Lab(browser.new_page(), server)
    try:
        lab.open_notebook(CHAPTER, workspace="both")
        _wait_workspace_holds(server, "both", CHAPTER)
        lab.page.goto(f"{server.url}lab/workspaces/both/tree/{EXERCISE}?token={server.token}")
        expect(lab.page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab")).to_have_count(2, timeout=120_000)
        labels = _tab_labels(lab)
        assert len(set(labels)) == 2, f"a chapter and its exercise on two tabs of one name: {labels}"
        lab.page.locator(".lm-MenuBar-item", has_text="File").click()
        lab.page.locator(".lm-Menu-item", has_text=re.compile(r"^\s*New\s*$")).hover()
        lab.page.locator(".lm-Menu-item:not(.lm-mod-disabled)", has_text=re.compile(r"^\s*Terminal\s*$")).click()
        terminal = lab.page.locator(".jp-Terminal:not(.lm-mod-hidden) .xterm")
        expect(terminal).to_be_visible(timeout=60_000)
        terminal.click()
        lab.page.keyboard.type(f"pwd > where.txt; make grade NB={EXERCISE} > graded.txt 2>&1; echo END >> graded.txt")
        lab.page.keyboard.press("Enter")
        graded = server.root / "graded.txt"
        deadline = time.monotonic() + 400
        while not (graded.exists() and "END" in graded.read_text()) and time.monotonic() < deadline:
            time.sleep(1)
        assert (server.root / "where.txt").read_text().strip() == str(server.root), "the terminal opened elsewhere"
        out = graded.read_text()
        assert "total: 12/12 points" in out, out[-3000:]
        assert _git_status(repo) == ""
    finally:
        lab.page.close()
        server.shutdown_sessions()
