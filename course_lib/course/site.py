"""The course as a static web site, for reading before installing anything.

    python -m course_lib.course.site site/          # or: make site; then open site/index.html

Built with nbconvert's HTML exporter (JupyterLab's look) and a small template (``site_templates/course``) that
adds a sidebar in chapter order, the exercises, a banner saying how to run the chapter for real, and previous/next
links. nbconvert is already installed with JupyterLab, so the site needs nothing beyond the course's own
dependencies and builds offline.

* Pages: ``index.html`` (the start page), ``notebooks/NN_topic.html`` (each chapter, with its committed outputs),
  ``exercises/NN_topic.html`` (the exercise notebooks: generated without solutions, never from ``solutions/``).
* Figures are embedded in the pages as ``data:`` images (no separate files to lose).
* Widgets need a kernel. On the site each one is drawn as its last saved state (its figure, its text and each
  control's value, read from the widget state the executed notebook stores), so it does not react to clicks: the
  page says so. Run the notebook in JupyterLab (``make lab``) to use it.
* Math is typeset by MathJax 2 in the browser. With ``jupyter-server-mathjax`` installed (a course dependency) its
  copy of MathJax goes into ``mathjax/`` and the site works offline; without it the pages load MathJax from
  nbconvert's CDN address, and offline the formulas show as TeX.
* Links between notebooks (``05_pipeline_parallel.ipynb``, ``../exercises/05_....ipynb``) become links between
  pages; a link to a chapter not in the build (not written yet) becomes plain text.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
from nbconvert import HTMLExporter

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = Path(__file__).resolve().parent / "site_templates"
START = "START_HERE.ipynb"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
LINK = re.compile(r'<a href="(?P<href>[^"#:]+\.ipynb)(?P<frag>#[^"]*)?"(?P<attrs>[^>]*)>(?P<text>.*?)</a>', re.S)
MATHJAX_PARTS = ("MathJax.js", "config", "extensions", "jax", "fonts", "LICENSE")  # not localization/: English only
MATHJAX_CONFIG = "TeX-AMS-MML_HTMLorMML-full,Safe"
WIDGET_NOTE = ("A widget, drawn as it was when the notebook was last run: it does not react here. "
               "Run the notebook (<code>make lab</code>) to use it.")


@dataclass(frozen=True)
class Page:
    source: Path  # the notebook
    href: str  # its page, relative to the site's root
    title: str


def _title(nb: nbformat.NotebookNode, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


def pages(repo: Path = REPO) -> tuple[list[Page], list[Page]]:
    """(chapters in order, start page first; exercise notebooks in order)."""
    def page(path: Path, href: str) -> Page:
        return Page(path, href, _title(nbformat.read(path, as_version=4), path.stem))

    start = repo / "notebooks" / START
    chapters = [page(start, "index.html")] if start.exists() else []
    chapters += [page(p, f"notebooks/{p.stem}.html") for p in sorted((repo / "notebooks").glob("[0-9][0-9]_*.ipynb"))]
    exercises = [page(p, f"exercises/{p.stem}.html") for p in sorted((repo / "exercises").glob("[0-9][0-9]_*.ipynb"))]
    return chapters, exercises


# ----------------------------------------------------------------------------------------------------------------
# Widgets as static HTML


def _widget_html(model_id: str, state: dict[str, Any], depth: int = 0) -> str:
    """One widget model (and its children) as static HTML, from the notebook's saved widget state."""
    model = state.get(model_id)
    if model is None or depth > 20:
        return ""
    name, s = model["model_name"], model["state"]
    if name in ("VBoxModel", "HBoxModel", "BoxModel", "GridBoxModel"):
        children = "".join(_widget_html(c.removeprefix("IPY_MODEL_"), state, depth + 1) for c in s.get("children", []))
        return f'<div class="{"course-hbox" if name == "HBoxModel" else "course-vbox"}">{children}</div>'
    if name == "ImageModel":
        data = next((b["data"] for b in model.get("buffers", []) if b.get("path") == ["value"]), "")
        if not data:
            return ""
        base64.b64decode(data, validate=True)  # a corrupt figure fails the build, not the reader
        return f'<img alt="widget figure" src="data:image/{s.get("format", "png")};base64,{data}">'
    if name in ("HTMLModel", "HTMLMathModel"):
        return f"<div>{s.get('value', '')}</div>"
    if name == "LabelModel":
        return f"<div>{html.escape(str(s.get('value', '')))}</div>"
    if "value" in s or "index" in s:  # sliders, dropdowns, checkboxes, toggles, text boxes
        value = s.get("value")
        if "_options_labels" in s and isinstance(s.get("index"), int):
            value = s["_options_labels"][s["index"]]
        label = s.get("description") or name.removesuffix("Model")
        return f'<span class="course-control">{html.escape(str(label))}: <b>{html.escape(str(value))}</b></span>'
    return ""


def render_widgets_statically(nb: nbformat.NotebookNode) -> int:
    """Replace every widget output by static HTML drawn from the saved widget state; drop the state.

    Returns how many widgets were drawn. A widget without saved state keeps its plain-text representation.
    """
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    drawn = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                continue
            body = _widget_html(view["model_id"], state)
            del out["data"][WIDGET_VIEW]
            if body:
                out["data"]["text/html"] = (f'<div class="course-widget">{body}'
                                            f'<div class="course-widget-note">{WIDGET_NOTE}</div></div>')
                out["data"].pop("text/plain", None)
                drawn += 1
    nb.metadata.pop("widgets", None)
    return drawn


# ----------------------------------------------------------------------------------------------------------------
# Links and pages


def _rewrite_links(body: str, page: Page, by_source: dict[Path, Page]) -> str:
    """Links to notebooks become links to their pages; links to notebooks not in the site become plain text."""
    here = page.source.parent
    depth = page.href.count("/")

    def replace(m: re.Match) -> str:
        target = by_source.get((here / m["href"]).resolve())
        if target is None:
            return f'<span class="course-missing" title="not in this build yet">{m["text"]}</span>'
        return f'<a href="{"../" * depth}{target.href}{m["frag"] or ""}"{m["attrs"]}>{m["text"]}</a>'

    return LINK.sub(replace, body)


def _banner(page: Page, is_exercise: bool) -> str:
    rel = page.source.relative_to(page.source.parents[1]).as_posix()
    what = "the exercises (no solutions here)" if is_exercise else "this chapter"
    return (f"This is a static copy of <code>{html.escape(rel)}</code>: the code ran when the notebook was "
            f"committed, on CPU ranks. To run {what} for real: clone the course, <code>make lab</code>, and open "
            f"<code>{html.escape(rel)}</code>. Widgets show their last state and do not react here.")


def install_mathjax(out: Path) -> str | None:
    """Copy jupyter-server-mathjax's MathJax into ``out/mathjax``; returns its script path relative to the site's
    root, or None when the package is not installed (the pages then use the CDN)."""
    try:
        import jupyter_server_mathjax
    except ImportError:
        return None
    static = Path(jupyter_server_mathjax.__file__).resolve().parent / "static"
    target = out / "mathjax"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for part in MATHJAX_PARTS:
        src = static / part
        if src.is_dir():
            shutil.copytree(src, target / part)
        else:
            shutil.copy2(src, target / part)
    return f"mathjax/MathJax.js?config={MATHJAX_CONFIG}"


def build(out: Path, repo: Path = REPO) -> list[Path]:
    """Write the site into ``out``; returns the pages written."""
    chapters, exercises = pages(repo)
    every = chapters + exercises
    by_source = {p.source.resolve(): p for p in every}
    exporter = HTMLExporter(template_name="course", extra_template_basedirs=[str(TEMPLATES)], embed_images=True)
    nav = {"chapters": [{"href": p.href, "title": p.title} for p in chapters],
           "exercises": [{"href": p.href, "title": p.title} for p in exercises]}
    mathjax = install_mathjax(out)
    cdn = exporter.mathjax_url
    written = []
    for group in (chapters, exercises):
        for i, page in enumerate(group):
            nb = nbformat.read(page.source, as_version=4)
            render_widgets_statically(nb)
            depth = page.href.count("/")
            exporter.mathjax_url = "../" * depth + mathjax if mathjax else cdn
            neighbour = {k: {"href": q.href, "title": q.title} if q else None for k, q in
                         (("prev", group[i - 1] if i > 0 else None),
                          ("next", group[i + 1] if i + 1 < len(group) else None))}
            resources = {"metadata": {"name": page.title, "path": str(page.source.parent)},
                         "course": {**nav, **neighbour, "href": page.href, "root": "../" * depth,
                                    "banner": _banner(page, group is exercises)}}
            body, _ = exporter.from_notebook_node(nb, resources=resources)
            target = out / page.href
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(_rewrite_links(body, page, by_source))
            written.append(target)
    (out / "pages.json").write_text(json.dumps([p.href for p in every], indent=1))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.course.site", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the folder to write the site into (created if missing)")
    args = parser.parse_args(argv)
    written = build(args.out)
    print(f"wrote {len(written)} pages to {args.out}; open {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
