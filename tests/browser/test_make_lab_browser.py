"""`make lab` as a learner gets it, in a real JupyterLab and browser: the server `make lab` would start (its root,
start page and app settings read from `make -n lab` in a small git clone of the course), not the session's test
server. No news prompt, the file browser in the learner's notebooks/, exercises that open unmodified, and a
chapter run and saved that leaves the repository's `git status` clean."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from course_lib.course import my_copy
from tests.browser.conftest import Lab, _start_server, _stop_server, require_playwright
from tests.test_my_copy import _course, _git_status, _lab_command

expect = require_playwright()

NEWS = "official Jupyter news"
NOTIFICATION = "@jupyterlab/apputils-extension:notification"


@pytest.fixture
def make_lab(chromium_executable, tmp_path):
    """(server, course repository, start page): JupyterLab started as `make lab` starts it, on a fresh copy."""
    repo = _course(tmp_path)
    lab = _lab_command(repo)
    root = Path(re.search(r'--ServerApp.root_dir="([^"]+)"', lab).group(1))
    settings = Path(re.search(r'--LabApp.app_settings_dir="([^"]+)"', lab).group(1))
    page = re.search(r"--LabApp.default_url=/lab/tree/(\S+)", lab).group(1)
    my_copy.sync(root, repo)  # what `make lab` runs first (make my-copy)
    old_style = json.loads((root / "exercises" / "00_budgets.ipynb").read_text())
    old_style["metadata"]["language_info"] = {"name": "python"}  # how exercises were stored before
    (root / "exercises" / "old_style.ipynb").write_text(json.dumps(old_style))
    server = _start_server(tmp_path / "lab", root=root, app_settings_dir=settings)
    try:
        server.wait_ready()
        yield server, repo, page
    finally:
        left = _stop_server(server)
        assert not left, f"processes started by JupyterLab outlived it: {left}"


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
        deadline, cells = time.monotonic() + 60, course
        while cells[last]["outputs"] and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                cells = json.loads(saved.read_text())["cells"]
            except ValueError:  # read while the server writes it
                pass
        assert not cells[last]["outputs"], "the run was not saved to the learner's copy"
        assert "before all_reduce" in json.dumps(cells[hello]["outputs"])
        assert _git_status(repo) == "", "running and saving a chapter changed the repository"
        expect(lab.page.get_by_text(NEWS)).to_have_count(0)  # long after start-up: the prompt never came

        # exercises open unmodified; one stored the old way (language_info {"name": "python"}) does not
        lab.open_notebook("exercises/00_budgets.ipynb", workspace="exercise")
        lab.page.wait_for_timeout(2000)
        assert _dirty_tabs(lab) == 0, "exercises/00_budgets.ipynb opened modified"
        lab.open_notebook("exercises/old_style.ipynb", workspace="old")
        expect(lab.page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-dirty")).to_have_count(1)

        # the check can fail: with the learner's own setting back at JupyterLab's default, the prompt shows
        server.api("PUT", f"lab/api/settings/{NOTIFICATION}", {"raw": json.dumps({"fetchNews": "none"})})
        lab.open_notebook(start, workspace="news")
        expect(lab.page.get_by_text(NEWS)).to_be_visible()
    finally:
        lab.page.close()
        server.shutdown_sessions()
