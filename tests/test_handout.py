"""The learners' handout: no solutions in it, its exercises' imports resolve to the handout's own course_lib, and it
stands alone: its README's commands run there, every link and cited file is in it, its install has no test tools."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.course import handout

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("handout") / "course"
    handout.write_handout(folder)
    return folder


def test_the_handout_has_the_course_and_no_solutions(out):
    shipped = [*handout.FOLDERS, *handout.FILES, *handout.WRITTEN, "tests"]
    assert sorted(p.name for p in out.iterdir()) == sorted(shipped)
    assert not (out / "solutions").exists() and not (out / "tests" / "grading_fixtures").exists()
    assert sorted(p.name for p in (out / "tests").iterdir()) == sorted(
        {"__init__.py", "conftest.py"} | {Path(p).name for p in handout.cited_paths(out)})
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


# ----------------------------------------------------------------------------------------------------------------
# Standing alone


def _make(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    return subprocess.run(["make", "-s", "--no-print-directory", *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=120)


def _readme_commands(folder: Path) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (folder / "README.md").read_text(), re.DOTALL)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if line.split("#")[0].strip()]


def test_the_readme_commands_run_in_the_handout(out, tmp_path):
    """Each command of the handout's README, run in a copy of the handout: set-up as a dry run (nothing installed),
    the lab as `make -n` (it would start a server), the rest for real."""
    folder = Path(shutil.copytree(out, tmp_path / "course"))
    venv = f"VENV={tmp_path / 'venv'}"
    commands = _readme_commands(folder)
    assert [c.split()[:2] for c in commands] == [["make", "setup"], ["make", "lab"], ["make", "my-copy"],
                                                 ["make", "grade"]], "a new command in the README: run it here"
    for command in commands:
        target, *args = command.split()[1:]
        if target == "setup":
            proc = _make(folder, "setup", venv, "DRY_RUN=1", "PIP_TORCH=2.13.0+cpu", *args)
            assert proc.returncode == 0, proc.stderr
            install = [line for line in proc.stdout.splitlines() if "pip install -e" in line]
            assert len(install) == 1 and install[0].endswith("pip install -e ."), proc.stdout  # no test tools
            assert "test tools" not in proc.stdout and not (tmp_path / "venv").exists()
        elif target in ("lab", "grade"):
            proc = _make(folder, "-n", target, venv, "PIP_TORCH=2.13.0+cpu", *args)
            assert proc.returncode == 0, proc.stderr
            assert ('/bin/jupyter" lab' if target == "lab" else '-m course_lib.grading "my_work/') in proc.stdout
        else:  # my-copy: the command make would run (its set-up prerequisite not executed), then that command
            proc = _make(folder, "-n", target, venv, "PIP_TORCH=2.13.0+cpu", *args)
            assert proc.returncode == 0, proc.stderr
            run = [line for line in proc.stdout.splitlines() if "-m course_lib.course.my_copy" in line]
            assert len(run) == 1, proc.stdout
            module_args = shlex.split(run[0].split(" -m ", 1)[1])
            copy = subprocess.run([sys.executable, "-m", *module_args], cwd=folder, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(folder)}, timeout=120)
            assert copy.returncode == 0, copy.stderr
    for part in ("notebooks", "exercises"):
        assert sorted(p.name for p in (folder / "my_work" / part).glob("*.ipynb")) == \
            sorted(p.name for p in (folder / part).glob("*.ipynb")), part
    graded = next(c for c in commands if c.startswith("make grade")).split("NB=")[1].split()[0]
    assert (folder / graded).is_file(), f"the README grades {graded}, which make my-copy did not create"


def test_the_makefile_has_the_learners_targets_only(out):
    for target in ("test", "handout", "site", "lint", "test-notebooks"):
        proc = _make(out, "-n", target)
        assert proc.returncode != 0 and "No rule to make target" in proc.stderr, target
    makefile = (out / "Makefile").read_text()
    assert "NB_PARALLEL" not in makefile and "NBVAL" not in makefile, "a test lane's setting left behind"
    proc = _make(out, "exercises")  # not the course's (it needs solutions/), and not silent
    assert proc.returncode == 0 and "make my-copy" in proc.stdout
    assert _make(out, "torch-plan", "PIP_TORCH=2.13.0+cpu").stdout.strip() == "pip-default"


def test_only_the_targets_asked_for_and_what_they_need_are_kept():
    course = "# header\n\nVAR = 1\n\n.PHONY: a b c\n\na: b\n\techo a\n\n## b's comment\nb: | d\n\techo b\n\n" \
             "c: a\n\techo c\n\nd:\n\techo d\n"
    cut = handout.learner_makefile(course, targets=("a",))
    assert "# header" not in cut and "VAR = 1" in cut and "## b's comment" in cut
    assert ".PHONY: a b d exercises\n" in cut and "echo d" in cut and "echo c" not in cut


def _links(text: str) -> list[str]:
    return [link for link in re.findall(r"\]\(([^)#\s]+)", text) if not re.match(r"[a-z]+:", link)]


def test_every_link_and_cited_file_is_in_the_handout(out):
    readme = (out / "README.md").read_text()
    assert _links(readme), "the README links its chapters"
    missing = [link for link in _links(readme) if not (out / link).exists()]
    for nb in [*out.glob("notebooks/*.ipynb"), *out.glob("exercises/*.ipynb")]:
        for cell in nbformat.read(nb, as_version=4).cells:
            if cell.cell_type == "markdown":
                missing += [f"{nb.name}: {link}" for link in _links(cell.source) if not (nb.parent / link).exists()]
    missing += [p for p in handout.cited_paths(out) if not (out / p).exists()]
    named = re.findall(r"`((?:benchmarks|tests|notebooks|exercises)/[\w./-]+)`", readme)
    missing += [p for p in named if not (out / p).exists()]
    assert not missing, f"the handout points at what it does not ship: {missing}"
    assert "make test" not in readme and "solutions" not in readme and "make exercises" not in readme
    assert not re.search(r"\bgit\b", readme, re.I), "the handout is a folder, not a repository: its README says so"


def test_git_ignores_the_learners_venv_and_work(out, tmp_path):
    folder = Path(shutil.copytree(out, tmp_path / "course"))
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    made = [".venv/bin/python", "my_work/01_collectives.ipynb", "course_lib/__pycache__/x.pyc",
            "notebooks/.ipynb_checkpoints/x.ipynb", "gradebook.csv"]
    for path in made:
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text("")
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=folder, check=True,
                            capture_output=True, text=True).stdout
    untracked = {line[3:] for line in status.splitlines()}
    assert "notebooks/00_budgets.ipynb" in untracked and "Makefile" in untracked
    assert not untracked & set(made), f"git would show the learner's own files: {untracked & set(made)}"


def test_the_learners_install_has_no_test_tools(out):
    import tomllib

    tools = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(t.startswith("playwright==") for t in tools) and any(t.startswith("pytest==") for t in tools)
    env = (out / "environment.yml").read_text()
    assert not [t for t in tools if t in env], "environment.yml installs the test tools"
    assert "torch==" in env and "- -e ." in env
    teacher = _make(REPO, "-n", "setup", "VENV=/nonexistent/venv", "PIP_TORCH=2.13.0+cpu").stdout
    assert teacher.count('-e ".[test]"') == 1  # the course's own set-up keeps the test tools
