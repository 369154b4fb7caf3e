"""The newcomer's first hour: what `make setup`, `make lab`, `make my-copy` and `make exercises` do, checked
without installing or downloading anything (DRY_RUN=1, `make -n`, and the decision inputs given explicitly).
What the learner's copy does (`course_lib/course/my_copy.py`) is tested in test_my_copy.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import notebooks

REPO = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def _make(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["make", "-s", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    if check:
        assert out.returncode == 0, out.stderr
    return out


@pytest.mark.parametrize("inputs, plan", [
    (["OS_NAME=Linux", "HAS_NVIDIA=no", "PIP_TORCH=2.13.0"], "cpu-index"),  # PyPI's CUDA build would come
    (["OS_NAME=Linux", "HAS_NVIDIA=no", "PIP_TORCH=2.13.0+cpu"], "pip-default"),  # a local CPU wheel (CI)
    (["OS_NAME=Linux", "HAS_NVIDIA=no", "PIP_TORCH=installed"], "pip-default"),
    (["OS_NAME=Linux", "HAS_NVIDIA=yes", "PIP_TORCH=2.13.0"], "pip-default"),
    (["OS_NAME=Darwin", "HAS_NVIDIA=no", "PIP_TORCH=2.13.0"], "pip-default"),
    (["OS_NAME=Darwin", "TORCH_CPU=yes"], "cpu-index"),
    (["OS_NAME=Linux", "HAS_NVIDIA=no", "PIP_TORCH=2.13.0", "TORCH_CPU=no"], "pip-default"),
])
def test_the_torch_decision(inputs, plan):
    assert _make("torch-plan", *inputs).stdout.strip() == plan


def test_on_this_machine_torch_comes_from_what_plain_pip_finds():
    """Here (and in CI) pip's own configuration finds the CPU wheel: setup must not reach for another index."""
    assert _make("torch-plan").stdout.strip() == "pip-default"


def _dry_setup(tmp_path: Path, *inputs: str) -> list[str]:
    lines = _make("setup", f"VENV={tmp_path / 'venv'}", "DRY_RUN=1", *inputs).stdout.splitlines()
    assert not (tmp_path / "venv").exists(), "a dry run installed something"
    return lines


def test_setup_installs_the_cpu_wheel_into_the_venv_before_the_rest(tmp_path):
    lines = _dry_setup(tmp_path, "OS_NAME=Linux", "HAS_NVIDIA=no", "PIP_TORCH=2.13.0")
    venv_python = f"{tmp_path / 'venv'}/bin/python -m pip install"
    cpu = [i for i, line in enumerate(lines) if CPU_INDEX in line]
    rest = [i for i, line in enumerate(lines) if '-e .[test]' in line]
    assert len(cpu) == 1 and len(rest) == 1 and cpu[0] < rest[0]
    assert venv_python in lines[cpu[0]] and lines[cpu[0]].endswith("torch==2.13.0")
    pin = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"][0]
    assert pin == "torch==2.13.0"


def test_setup_shows_its_steps_and_leaves_torch_to_pip_where_it_finds_the_cpu_build(tmp_path):
    lines = _dry_setup(tmp_path, "OS_NAME=Linux", "HAS_NVIDIA=no", "PIP_TORCH=2.13.0+cpu")
    assert not any(CPU_INDEX in line for line in lines)
    assert [line[:8] for line in lines if line.startswith("==>")] == [f"==> {i}/4 " for i in range(1, 5)]
    install = next(line for line in lines if "-e .[test]" in line)
    assert "--quiet" not in install  # pip's progress is shown: the big install takes minutes


def _lab_command(*args: str) -> str:
    return _make("-n", "lab", "VENV=/nonexistent/venv", "PIP_TORCH=2.13.0+cpu", *args).stdout


def test_lab_serves_the_learners_copy_and_opens_the_start_page_on_localhost_with_a_token():
    lab = _lab_command()
    assert "--ServerApp.ip=127.0.0.1" in lab
    assert f'--ServerApp.root_dir="{REPO / "my_work"}"' in lab  # never the tracked notebooks (test_my_copy.py)
    assert "--LabApp.default_url=/lab/tree/notebooks/START_HERE.ipynb" in lab
    assert "token" not in lab.replace("token-protected", "")  # the token is jupyter's own, never disabled
    assert ("--allow-root" in lab) == (os.getuid() == 0)
    assert "--no-browser" in _lab_command("LAB_ARGS=--no-browser")


def test_my_copy_runs_the_copy_module_into_my_work_which_git_ignores():
    """What the copy does is tested in test_my_copy.py; here, that `make my-copy` runs it on MY_WORK."""
    dry = _make("-n", "my-copy", "VENV=/nonexistent/venv", "PIP_TORCH=2.13.0+cpu", "MY_WORK=mine").stdout
    assert '/nonexistent/venv/bin/python -m course_lib.course.my_copy --dest "mine"' in dry
    assert "my_work/" in (REPO / ".gitignore").read_text().splitlines()


@pytest.fixture
def one_chapter(tmp_path):
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    shutil.copy(REPO / "solutions" / "00_budgets.ipynb", solutions)
    assert notebooks.sync(solutions, exercises) == [exercises / "00_budgets.ipynb"]
    return solutions, exercises / "00_budgets.ipynb"


def _edit(path: Path, change) -> None:
    nb = nbformat.read(path, as_version=4)
    change(next(c for c in nb.cells if c.cell_type == "code" and "NotImplementedError" in c.source))
    nbformat.write(nb, path)


def test_make_exercises_keeps_an_exercise_whose_code_the_learner_edited(one_chapter):
    solutions, exercise = one_chapter
    _edit(exercise, lambda cell: setattr(cell, "source", "def my_answer():\n    return 42"))
    mine = exercise.read_text()
    kept: list[Path] = []
    assert notebooks.sync(solutions, exercise.parent, kept=kept) == []
    assert kept == [exercise] and exercise.read_text() == mine
    assert notebooks.sync(solutions, exercise.parent, force=True) == [exercise]
    assert "my_answer" not in exercise.read_text()


def test_make_exercises_overwrites_an_exercise_that_was_only_run(one_chapter):
    solutions, exercise = one_chapter
    _edit(exercise, lambda cell: cell.outputs.append(nbformat.v4.new_output("stream", text="ran it\n")))
    kept: list[Path] = []
    assert notebooks.sync(solutions, exercise.parent, kept=kept) == [exercise]
    assert not kept and "ran it" not in exercise.read_text()


def test_git_vouches_for_a_committed_exercise_but_not_for_local_edits(one_chapter):
    _, exercise = one_chapter
    nb = nbformat.read(exercise, as_version=4)
    del nb.metadata["course"]["generated"]  # from before fingerprints, or a merge of two generated versions
    nbformat.write(nb, exercise)
    assert notebooks.edited_by_hand(exercise)  # not in a git repository: cannot tell, so it is kept
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(exercise.parent)]
    for cmd in (["init", "-q"], ["add", exercise.name], ["commit", "-qm", "generated"]):
        subprocess.run(git + cmd, check=True, capture_output=True)
    assert not notebooks.edited_by_hand(exercise)  # committed as it is: the repository's, not a learner's
    _edit(exercise, lambda cell: setattr(cell, "source", "x = 1"))
    assert notebooks.edited_by_hand(exercise)


def test_the_cli_says_how_to_keep_the_work_and_exits_1(one_chapter, capsys):
    solutions, exercise = one_chapter
    _edit(exercise, lambda cell: setattr(cell, "source", "x = 1"))
    assert notebooks.main(["--solutions", str(solutions), "--exercises", str(exercise.parent)]) == 1
    out = capsys.readouterr().out
    assert f"kept: {exercise}" in out and "make my-copy" in out and "FORCE=1" in out
