"""The static course site: built from the committed notebooks, every internal link resolves (fragments included),
every image is embedded, the sidebar is in chapter order with consistent previous/next links, widgets are drawn
from their saved state, and no solution reaches a page."""

from __future__ import annotations

import base64
import json
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import nbformat
import pytest

from course_lib.course import site

REPO = Path(__file__).resolve().parents[1]


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (href, rel)
        self.images: list[str] = []
        self.ids: set[str] = set()
        self.sidebar: list[str] = []
        self._in_sidebar = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "nav" and "course-sidebar" in (a.get("class") or ""):
            self._in_sidebar = 1
        if tag == "a" and a.get("href"):
            self.links.append((a["href"], a.get("rel") or ""))
            if self._in_sidebar:
                self.sidebar.append(a["href"])
        if tag == "img":
            self.images.append(a.get("src") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "nav":
            self._in_sidebar = 0


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    site.build(out)
    return out


def _pages(out: Path) -> list[Path]:
    return [out / href for href in json.loads((out / "pages.json").read_text())]


def test_every_chapter_and_exercise_has_a_page(built):
    chapters, exercises = site.pages()
    assert chapters[0].href == "index.html"
    assert [p.source.name for p in chapters[1:]] == sorted(p.name for p in (REPO / "notebooks").glob("[0-9]*.ipynb"))
    assert [p.source.parent.name for p in exercises] == ["exercises"] * len(exercises)
    for path in _pages(built):
        assert path.exists(), path


def test_every_internal_link_resolves_and_every_image_is_embedded(built):
    parsed = {path.resolve(): _parse(path) for path in _pages(built)}
    checked = 0
    for path, page in parsed.items():
        for href, _ in page.links:
            url = urlsplit(href)
            if url.scheme in ("http", "https", "mailto"):
                continue
            target = (path.parent / url.path).resolve() if url.path else path
            assert target in parsed, f"{path.name}: link {href} goes nowhere"
            if url.fragment:
                assert url.fragment in parsed[target].ids, f"{path.name}: link {href}: no such anchor"
            checked += 1
        for src in page.images:
            assert src.startswith("data:image/"), f"{path.name}: image not embedded: {src[:80]}"
            base64.b64decode(src.split(",", 1)[1], validate=True)
    assert checked > 10 * len(parsed)  # the sidebar alone links every page from every page


def test_sidebar_in_chapter_order_and_prev_next_consistent(built):
    chapters, exercises = site.pages()
    for group in (chapters, exercises):
        for i, page in enumerate(group):
            parsed = _parse(built / page.href)
            depth = "../" * page.href.count("/")
            assert parsed.sidebar == [f"{depth}index.html", *(depth + p.href for p in chapters + exercises)]
            rel = {r: h for h, r in parsed.links if r in ("prev", "next")}
            assert rel.get("prev") == (depth + group[i - 1].href if i else None)
            assert rel.get("next") == (depth + group[i + 1].href if i + 1 < len(group) else None)


def test_widgets_are_drawn_from_their_saved_state_and_no_solution_is_published(built):
    for page in site.pages()[0]:
        nb = nbformat.read(page.source, as_version=4)
        state = nb.metadata.get("widgets", {}).get(site.WIDGET_STATE, {}).get("state", {})
        views = [o["data"][site.WIDGET_VIEW]["model_id"] for c in nb.cells for o in c.get("outputs", [])
                 if site.WIDGET_VIEW in o.get("data", {})]
        html = (built / page.href).read_text()
        assert html.count('<div class="course-widget">') == sum(m in state for m in views), page.href
        assert "widget-view+json" not in html and "widget-state+json" not in html
    solution = nbformat.read(REPO / "solutions" / "00_budgets_exercises.ipynb", as_version=4)
    answer = next(line.strip() for c in solution.cells for line in c.source.splitlines()
                  if line.strip().startswith("return 2 * n_layer"))
    for path in _pages(built):
        text = path.read_text()
        assert "BEGIN SOLUTION" not in text, path
    assert answer not in (built / "exercises" / "00_budgets_exercises.html").read_text()


def test_a_widget_is_drawn_with_its_figure_and_control_values():
    png = base64.b64encode(b"\x89PNG fake").decode()
    state = {
        "box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_img", "IPY_MODEL_s", "IPY_MODEL_d"]}},
        "img": {"model_name": "ImageModel", "state": {"format": "png"},
                "buffers": [{"path": ["value"], "encoding": "base64", "data": png}]},
        "s": {"model_name": "IntSliderModel", "state": {"description": "stages p", "value": 4}},
        "d": {"model_name": "DropdownModel", "state": {"description": "schedule", "index": 1,
                                                       "_options_labels": ["GPipe", "1F1B"]}},
    }
    nb = nbformat.v4.new_notebook(metadata={"widgets": {site.WIDGET_STATE: {"state": state}}})
    cell = nbformat.v4.new_code_cell("w", outputs=[nbformat.v4.new_output(
        "display_data", {site.WIDGET_VIEW: {"model_id": "box"}, "text/plain": "Panel(...)"})])
    nb.cells.append(cell)
    assert site.render_widgets_statically(nb) == 1
    out = cell.outputs[0]["data"]["text/html"]
    assert f'src="data:image/png;base64,{png}"' in out
    assert "stages p: <b>4</b>" in out and "schedule: <b>1F1B</b>" in out
    assert "does not react here" in out
    assert "widgets" not in nb.metadata


def test_a_widgets_keyboard_hint_is_left_out_of_the_site(built):
    """The hint says how to use a live dropdown; on the site nothing reacts, so it would only mislead."""
    from course_lib.viz.panel import INTERACTIVE_ONLY, KEYBOARD_HINT

    drawn = [p for p in site.pages()[0] if '<div class="course-widget">' in (built / p.href).read_text()]
    assert drawn and not [p.href for p in drawn if KEYBOARD_HINT[:40] in (built / p.href).read_text()]
    state = {"box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_t", "IPY_MODEL_h"]}},
             "t": {"model_name": "HTMLModel", "state": {"value": "<pre>a  | b</pre>"}},
             "h": {"model_name": "LabelModel", "state": {"value": KEYBOARD_HINT,
                                                         "_dom_classes": [INTERACTIVE_ONLY]}}}
    html = site._widget_html("box", state)
    assert "<pre>a  | b</pre>" in html and KEYBOARD_HINT not in html


def test_a_link_to_a_chapter_not_in_the_build_becomes_text(tmp_path):
    page = site.Page(tmp_path / "notebooks" / "03_x.ipynb", "notebooks/03_x.html", "03")
    known = site.Page(tmp_path / "notebooks" / "05_y.ipynb", "notebooks/05_y.html", "05")
    body = '<a href="04_z.ipynb">04</a> <a href="05_y.ipynb#top">05</a> <a href="../exercises/05_y.ipynb">ex</a>'
    out = site._rewrite_links(body, page, {known.source.resolve(): known})
    assert out.startswith('<span class="course-missing"')
    assert '<a href="../notebooks/05_y.html#top">05</a>' in out
    assert '<a href="../exercises' not in out and "ex</span>" in out
