"""Repo-wide checks on every notebook: what nbval, a clean clone and a learner's first view rely on.

(a) a cell compared by nbval (``# NBVAL_CHECK_OUTPUT``) prints nothing that floating-point noise can change;
(b) no relative link in a notebook or the README points at a file that does not exist, and every chapter links to
    the chapter before it (START_HERE before 00), the one after it and its exercise notebook;
(c) no word of the course's internal working notes reaches a learner;
(d) every notebook names the kernel ``make setup`` installs and stores the ``language_info`` that kernel reports
    (the exercises too: they are generated from the solutions), so it opens unmodified;
(e) the nbval marker is the last line of its cell, after the code a learner reads;
(f) no stored output is a stderr stream: a warning a learner would read on opening the notebook (and on the
    course site) is fixed where it comes from, not committed.

The rule of (a), precisely. Each compared cell has a tolerance: ``DEFAULT_TOLERANCE`` (the course's parity
tolerance, 1e-5), or the value of the cell's metadata key ``"tolerance"``. With tolerance ``10**-k`` a printed
decimal number may show at most ``k`` digits after its point. A number in scientific notation is refused unless its
mantissa is exactly 1 (``1e-5``, ``1E+03``: a stated tolerance or constant, not a measurement): ``1.7e-07`` is the
kind of float noise that differs between two machines. Version strings (``3.11.7``), words with digits
(``H100``, ``fp32``) and integers are not decimals and pass.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from course_lib.course.handout import exercises_of

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for d in ("notebooks", "solutions", "exercises") for p in (REPO / d).glob("*.ipynb"))
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (LLM scaling course)", "language": "python"}
MARKER = "# NBVAL_CHECK_OUTPUT"
DEFAULT_TOLERANCE = 1e-5
CHAPTERS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
JARGON = re.compile(r"\bseeds?\s+0\d\d\b|\bthe seeds\b|\bboth seeds\b|\banchors\b|\banchor implementations?\b|"
                    r"COURSE_DESIGN", re.IGNORECASE)

_NUMBER = re.compile(r"(?<![\w.])(?P<int>\d+(?:,\d{3})*)(?:\.(?P<frac>\d+))?(?:[eE](?P<exp>[-+]?\d+))?"
                     r"(?![\w]|\.\d)")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?(?P<md>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|(?:href|src)=[\"'](?P<html>[^\"']+)")


def unstable_numbers(text: str, tolerance: float = DEFAULT_TOLERANCE) -> list[str]:
    """The numbers in ``text`` a compared cell must not print (see the module docstring for the rule)."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    max_decimals = math.ceil(-math.log10(tolerance) - 1e-9)
    bad = []
    for m in _NUMBER.finditer(text):
        frac, exp = m.group("frac"), m.group("exp")
        if exp is not None and not (m.group("int") == "1" and frac is None):
            bad.append(m.group(0))
        elif exp is None and frac is not None and len(frac) > max_decimals:
            bad.append(m.group(0))
    return bad


def relative_links(markdown: str) -> list[str]:
    """Targets of markdown and HTML links / images that are files of this repository (no URL, no bare anchor)."""
    targets = [m.group("md") or m.group("html") for m in _LINK.finditer(markdown)]
    return [t for t in targets if not re.match(r"^([a-z][a-z0-9+.-]*:|#|/)", t, re.IGNORECASE)]


def dead_links(markdown: str, base: Path) -> list[str]:
    """Relative links of ``markdown`` (a file in ``base``) whose file does not exist."""
    dead = []
    for target in relative_links(markdown):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path and not (base / path).exists():
            dead.append(target)
    return dead


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _output_text(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        text = out.get("text") if out.get("output_type") == "stream" else out.get("data", {}).get("text/plain")
        parts.append("".join(text or []))
    return "\n".join(parts)


def stderr_outputs(nb: dict) -> list[str]:
    """``cell N: <first line>`` for every stored stderr stream output of a notebook (as a dict)."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                text = "".join(out.get("text") or []).strip()
                found.append(f"cell {i}: {text.splitlines()[0][:120] if text else '(empty)'}")
    return found


def _compared_cells(nb: dict) -> list[tuple[int, dict]]:
    """The cells nbval compares: tagged ``nbval-check-output``, or (the older way) marked with a comment line."""
    return [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and (
        MARKER in _source(c) or "nbval-check-output" in c.get("metadata", {}).get("tags", []))]


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


# ---------------------------------------------------------------------------------------------------------------
# The rules themselves, on small examples


@pytest.mark.parametrize("text, bad", [
    ("max |diff| = 1.7e-07", ["1.7e-07"]),
    ("6.8E-07 and 2.5e+03", ["6.8E-07", "2.5e+03"]),
    ("PASS (max |diff| < 1e-5)", []),
    ("tolerance 1e-06, scale 1E+03", []),
    ("12e-5 is not a power of ten", ["12e-5"]),
    ("loss 5.54641", []),
    ("loss 5.546412", ["5.546412"]),
    ("0.000001 at the end.", ["0.000001"]),
    ("1,229.34 GB and 85.90 GB", []),
    ("python 3.11.7, H100 80GB, fp32, llama2-70b, 0x7f3e", []),
    ("[1440000, 1440000] bytes, 2,880,000 sent", []),
    ("a ratio of 0.914.", []),
])
def test_unstable_numbers_rule(text, bad):
    assert unstable_numbers(text) == bad


def test_unstable_numbers_follows_the_tolerance():
    assert unstable_numbers("5.55 and 5.546", tolerance=1e-2) == ["5.546"]
    assert unstable_numbers("5.546", tolerance=1e-3) == []
    with pytest.raises(ValueError, match="tolerance"):
        unstable_numbers("1.0", tolerance=0)


def test_stderr_rule_rejects_an_injected_stderr_output(tmp_path):
    """A notebook written with a stderr output (as a kernel stores a warning) is rejected; stdout is not."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print('ok')", outputs=[nbformat.v4.new_output("stream", text="ok\n")]),
                nbformat.v4.new_code_cell("import warnings", outputs=[nbformat.v4.new_output(
                    "stream", name="stderr", text="findfont: Font family ['STIXGeneral'] not found.\n")])]
    path = tmp_path / "injected.ipynb"
    nbformat.write(nb, path)
    assert stderr_outputs(_load(path)) == ["cell 1: findfont: Font family ['STIXGeneral'] not found."]
    with pytest.raises(AssertionError, match="stderr"):
        test_no_stderr_output(path)
    nb.cells.pop()
    nbformat.write(nb, path)
    test_no_stderr_output(path)


def test_links_rule(tmp_path):
    (tmp_path / "here.ipynb").write_text("{}")
    text = ("[ok](here.ipynb) [anchor](here.ipynb#section) [web](https://pytorch.org) [mail](mailto:a@b.c) "
            "[top](#top) [gone](gone.ipynb) <a href=\"lost.html\">x</a> "
            "![img](missing.png) [spaced](<here.ipynb>)")
    assert dead_links(text, tmp_path) == ["gone.ipynb", "lost.html", "missing.png"]


@pytest.mark.parametrize("text, found", [
    ("as seed 000 says", True), ("seeds 000 and 003", True), ("The seeds' number", True),
    ("Both seeds open with it", True), ("the course's anchors had", True), ("see COURSE_DESIGN.md", True),
    ("other world sizes and seeds", False), ("seed = 0", False), ("bbox_to_anchor=(1, 1)", False),
])
def test_jargon_rule(text, found):
    assert bool(JARGON.search(text)) is found


# ---------------------------------------------------------------------------------------------------------------
# Every notebook of the repository


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 6 and (REPO / "notebooks" / "START_HERE.ipynb") in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_compared_cells_print_no_float_noise(path):
    problems = []
    for i, cell in _compared_cells(_load(path)):
        bad = unstable_numbers(_output_text(cell), cell.get("metadata", {}).get("tolerance", DEFAULT_TOLERANCE))
        if bad:
            problems.append(f"cell {i}: {bad}")
    assert not problems, f"{_rel(path)}: compared cells print float noise (print a verdict, an exact integer or " \
                         f"a value rounded to the tolerance): {problems}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_marker_is_the_last_line(path):
    late = [i for i, c in _compared_cells(_load(path))
            if MARKER in _source(c) and _source(c).rstrip().splitlines()[-1].strip() != MARKER]
    assert not late, f"{_rel(path)}: put {MARKER} on the last line of cells {late}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_kernelspec(path):
    assert _load(path)["metadata"].get("kernelspec") == KERNELSPEC


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_language_info_is_the_kernels(path):
    """The keys and values ipykernel sends when JupyterLab connects; only the Python patch version may differ
    (3.11.x: the course pins 3.11, not a patch release)."""
    from ipykernel.ipkernel import IPythonKernel

    kernel = dict(IPythonKernel.language_info)
    stored = dict(_load(path)["metadata"].get("language_info", {}))
    assert stored.pop("version", "").split(".")[:2] == kernel.pop("version").split(".")[:2], \
        f"{_rel(path)}: language_info has no Python 3.11 version"
    assert stored == kernel, f"{_rel(path)}: language_info {stored} is not the kernel's {kernel}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_no_stderr_output(path):
    found = stderr_outputs(_load(path))
    assert not found, f"{_rel(path)}: stderr stored in the outputs (fix the warning at its source, then " \
                      f"re-execute): {found}"


@pytest.mark.parametrize("path", [*NOTEBOOKS, REPO / "README.md"], ids=_rel)
def test_no_dead_relative_link(path):
    if path.suffix == ".md":
        text = path.read_text()
    else:
        text = "\n".join(_source(c) for c in _load(path)["cells"] if c["cell_type"] == "markdown")
    assert not dead_links(text, path.parent), f"{_rel(path)}: dead links {dead_links(text, path.parent)}"


@pytest.mark.parametrize("path", [*NOTEBOOKS, *sorted((REPO / "course_lib").rglob("*.py"))], ids=_rel)
def test_no_internal_jargon(path):
    if path.suffix == ".py":
        texts = path.read_text().splitlines()
    else:
        texts = [line for c in _load(path)["cells"] for line in (_source(c) + "\n" + _output_text(c)).splitlines()]
    hits = [line.strip()[:120] for line in texts if JARGON.search(line)]
    assert not hits, f"{_rel(path)}: cite the articles by title or author, or state the claim: {hits}"


@pytest.mark.parametrize("path", CHAPTERS, ids=_rel)
def test_every_chapter_links_its_neighbours_and_its_exercises(path):
    i = CHAPTERS.index(path)
    wanted = [CHAPTERS[i - 1].name if i else "START_HERE.ipynb", f"../exercises/{exercises_of(REPO, path).name}"]
    if i + 1 < len(CHAPTERS):
        wanted.append(CHAPTERS[i + 1].name)
    text = "\n".join(_source(c) for c in _load(path)["cells"] if c["cell_type"] == "markdown")
    targets = {t.split("#", 1)[0] for t in relative_links(text)}
    missing = [w for w in wanted if w not in targets]
    assert not missing, f"{_rel(path)}: link to {missing} (previous chapter, next chapter, exercises)"


MACHINE_PATH = re.compile(r"/(?:work|root|home|Users|tmp)/[\w.-]+")
"""An absolute path of the machine that executed the notebook (a checkout, a home, a kernel's temporary file)."""


def machine_paths(nb: dict) -> list[str]:
    """``cell N: <path>`` for every machine path in a stored output (text, not images)."""
    return [f"cell {i}: {m.group(0)}" for i, cell in enumerate(nb["cells"])
            for m in MACHINE_PATH.finditer(_output_text(cell))]


def test_machine_path_rule():
    nb = {"cells": [{"outputs": [{"output_type": "stream", "text": ['  File "/tmp/ipykernel_1/2.py", line 3\n']}]},
                    {"outputs": [{"output_type": "stream", "text": ['  File ".../course_lib/_worker.py"\n']}]}]}
    assert machine_paths(nb) == ["cell 0: /tmp/ipykernel_1"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_no_machine_path_in_outputs(path):
    found = machine_paths(_load(path))
    assert not found, f"{_rel(path)}: an output shows a path of the machine that ran it (sanitise it): {found}"
