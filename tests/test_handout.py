"""The learners' handout: no solutions in it, and its exercises' imports resolve to the handout's own course_lib."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib import handout

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("handout") / "course"
    handout.write_handout(folder)
    return folder


def test_the_handout_has_the_course_and_no_solutions(out):
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*handout.FOLDERS, *(f for f in handout.FILES if (REPO / f).exists())])
    assert not (out / "solutions").exists() and not (out / "tests").exists()
    assert sorted(p.name for p in (out / "exercises").glob("*.ipynb")) == \
        sorted(p.name for p in (REPO / "solutions").glob("*.ipynb"))
    for nb in out.rglob("*.ipynb"):
        assert handout.SOLUTION_MARK not in nb.read_text(), nb
    assert not list(out.rglob("__pycache__"))
    assert handout.solution_leaks(out) == []


def test_a_solution_left_in_the_handout_is_caught(out, tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "x.ipynb").write_text(json.dumps({"cells": [{"source": "### BEGIN SOLUTION\n"}]}))
    assert sorted(p.name for p in handout.solution_leaks(tmp_path)) == ["solutions", "x.ipynb"]
    with pytest.raises(handout.HandoutError, match="not empty"):
        handout.write_handout(out)


def _import_cells(nb_path: Path) -> list[str]:
    nb = nbformat.read(nb_path, as_version=4)
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        tree = ast.parse(cell.source)
        if tree.body and all(isinstance(n, ast.Import | ast.ImportFrom) for n in tree.body):
            cells.append(cell.source)
    return cells


def test_the_exercises_import_from_the_handout(out):
    """Run every import-only cell of every exercise, in a fresh interpreter whose course_lib is the handout's."""
    script = ["import course_lib, pathlib",
              f"assert pathlib.Path(course_lib.__file__).resolve().is_relative_to({str(out.resolve())!r})"]
    count = 0
    for nb in sorted((out / "exercises").glob("*.ipynb")):
        cells = _import_cells(nb)
        assert cells, f"{nb.name} imports nothing"
        script += cells
        count += len(cells)
    env = {**os.environ, "PYTHONPATH": str(out)}
    proc = subprocess.run([sys.executable, "-c", "\n".join(script)], cwd=out / "exercises", env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert count >= len(list((out / "exercises").glob("*.ipynb")))


def test_the_cli_refuses_a_folder_that_is_not_empty(out, capsys):
    assert handout.main([str(out)]) == 1
    assert "not empty" in capsys.readouterr().err
