"""The static course site in a real browser (Debian's chromium through Playwright, see conftest.py), served over
HTTP from 127.0.0.1: every page loads with no console error and no request leaving the machine, every image
loads, math is typeset by the site's own MathJax, and the "next" links walk the chapters in order."""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import nbformat
import pytest

from course_lib.course import site
from tests.browser.conftest import ARTIFACTS


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    try:
        import jupyter_server_mathjax  # noqa: F401
    except ImportError:
        msg = "jupyter-server-mathjax is not installed (the site's offline MathJax): pip install -e '.[test]'"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    out = tmp_path_factory.mktemp("site")
    site.build(out)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", out
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _mathjax_probe(message) -> bool:
    """MathJax 2's HTML-CSS output measures glyphs against a font "MathJax_Blank" whose source is about:blank;
    chromium reports that probe as a blocked font load. Nothing else is excused."""
    return "font at 'about:blank'" in message.text or message.location.get("url") == "about:blank"


def _has_math(page: site.Page) -> bool:
    nb = nbformat.read(page.source, as_version=4)
    return any("$" in c.source for c in nb.cells if c.cell_type == "markdown")


def test_every_page_loads_cleanly_with_its_images_and_math(browser, served):
    base, _ = served
    chapters, exercises = site.pages()
    problems: list[str] = []
    tab = browser.new_page()
    errors: list[str] = []
    outside: list[str] = []
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" and not _mathjax_probe(m) else None)
    tab.on("pageerror", lambda e: errors.append(str(e)))

    def route(r) -> None:
        if r.request.url.startswith(base) or r.request.url.startswith("data:"):
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    tab.route("**/*", route)
    log = []
    try:
        for page in chapters + exercises:
            errors.clear()
            outside.clear()
            tab.goto(base + page.href, wait_until="load", timeout=120_000)
            tab.wait_for_function("() => window.MathJax && MathJax.Hub", timeout=60_000)
            tab.evaluate("() => new Promise(done => MathJax.Hub.Queue(() => done(true)))")
            broken = tab.evaluate("() => [...document.images].filter(i => !(i.complete && i.naturalWidth > 0))"
                                  ".map(i => i.alt || i.src.slice(0, 40))")
            typeset = tab.evaluate("() => document.querySelectorAll('.MathJax, .MathJax_Display').length")
            math_errors = tab.evaluate("() => document.querySelectorAll('.MathJax_Error, merror').length")
            log.append(f"{page.href}: {len(errors)} console errors, {typeset} formulas, {len(broken)} broken images")
            if errors:
                problems.append(f"{page.href}: console errors {errors[:3]}")
            if outside:
                problems.append(f"{page.href}: requests leaving the machine {outside[:3]}")
            if broken:
                problems.append(f"{page.href}: images that did not load {broken}")
            if math_errors:
                problems.append(f"{page.href}: {math_errors} formulas MathJax could not typeset")
            if _has_math(page) and not typeset:
                problems.append(f"{page.href}: has $...$ math but MathJax typeset nothing")
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "site.log").write_text("\n".join(log + problems) + "\n")
        tab.screenshot(path=str(ARTIFACTS / "site_last_page.png"))
        tab.close()
    assert not problems, "\n".join(problems)


def test_next_links_walk_the_chapters_in_order(browser, served):
    base, out = served
    chapters, _ = site.pages()
    tab = browser.new_page()
    tab.route("**/*", lambda r: r.continue_() if r.request.url.startswith(base) else r.abort())
    try:
        tab.goto(base + chapters[0].href, wait_until="load")
        visited = [chapters[0].href]
        while tab.locator("a[rel=next]").count():
            tab.locator("a[rel=next]").click()
            tab.wait_for_load_state("load")
            visited.append(tab.url.removeprefix(base))
        assert visited == [p.href for p in chapters]
        assert json.loads((out / "pages.json").read_text())[: len(chapters)] == visited
    finally:
        tab.close()


def test_a_widgets_text_table_keeps_its_columns(browser, served):
    """The ZeRO widget's table is a <pre> of aligned columns: the lab theme gives output <pre> the UI font, so
    the site sets the code font back (a proportional font breaks the columns)."""
    base, _ = served
    tab = browser.new_page()
    tab.route("**/*", lambda r: r.continue_() if r.request.url.startswith(base) else r.abort())
    try:
        tab.goto(base + "notebooks/03_zero_fsdp.html", wait_until="load")
        table = tab.locator("div.course-widget pre").first
        style = table.evaluate("e => [getComputedStyle(e).fontFamily, getComputedStyle(e).whiteSpace]")
        assert "mono" in style[0].lower() and style[1] == "pre", style
        widths = table.evaluate("""e => ['iiiiiiiiii', 'MMMMMMMMMM'].map(s => {
            const probe = document.createElement('span'); probe.textContent = s; e.appendChild(probe);
            const w = probe.getBoundingClientRect().width; probe.remove(); return w; })""")
        assert abs(widths[0] - widths[1]) < 0.5, f"not monospace: {widths}"
    finally:
        tab.close()
