"""The newcomer's first hour: what `make setup`, `make lab`, `make my-copy` and `make exercises` do, checked
without installing or downloading anything (DRY_RUN=1, `make -n`, and the decision inputs given explicitly).
What the learner's copy does (`course_lib/course/my_copy.py`) is tested in test_my_copy.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import notebooks
from tests.conftest import venv_of_this_environment

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


def test_setup_silences_setuptools_editable_install_box_and_nothing_else(tmp_path):
    """pip shows setuptools' "Editable installation" box (an InformationOnly warning, nothing to act on) on every
    set-up: the install runs with a warning filter for that message only, which the test applies to setuptools'
    own warning."""
    install = next(line for line in _dry_setup(tmp_path, "PIP_TORCH=2.13.0+cpu") if "-e .[test]" in line)
    (quiet,) = re.findall(r'PYTHONWARNINGS="?(.+?)"? \S+/bin/python -m pip install -e', install)  # echo drops ""
    emit = ("from setuptools.warnings import InformationOnly as W\n"
            "W.emit('Editable installation.', 'Please be careful with folders')\nW.emit('Something else.', 'x')")
    for env, shown in (({"PYTHONWARNINGS": quiet}, False), ({}, True)):
        err = subprocess.run([sys.executable, "-c", emit], env={**os.environ, **env}, capture_output=True,
                             text=True, check=True).stderr
        assert ("Editable installation" in err) is shown and "Something else" in err, err


def test_lab_opens_a_browser_only_where_python_finds_one():
    """Without one (a server, a container), JupyterLab's open_browser=True only prints "No web browser found"."""
    def open_browser(**env: str) -> str:
        out = subprocess.run([shutil.which("make"), "-s", "-n", "lab", "PIP_TORCH=2.13.0+cpu"], cwd=REPO,
                             env={"PATH": "/nonexistent", "HOME": os.environ.get("HOME", "/"), **env},
                             capture_output=True, text=True, timeout=120).stdout
        return re.search(r"--ServerApp.open_browser=(\w+)", out).group(1)

    assert open_browser() == "False"  # no DISPLAY, no console browser on this PATH
    assert open_browser(BROWSER="firefox") == "True"


def _kernel_log(python: Path, monkeypatch) -> str:
    """What a kernel of ``python``'s environment writes on stderr from its start to its shutdown (one line of our
    own logged too)."""
    from jupyter_client import KernelManager

    specs = python.parents[1] / "share" / "jupyter"
    (specs / "kernels" / "python3").mkdir(parents=True)
    (specs / "kernels" / "python3" / "kernel.json").write_text(json.dumps(
        {"argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"], "language": "python",
         "display_name": "test"}))
    monkeypatch.setenv("JUPYTER_PATH", str(specs))
    err = python.parents[1] / "kernel.err"
    km = KernelManager(kernel_name="python3")
    with err.open("wb") as f:
        km.start_kernel(stderr=f, stdout=subprocess.DEVNULL)
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        kc.execute_interactive("import logging; logging.getLogger('IPKernelApp').warning('another notice')",
                               timeout=60)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    return err.read_text()


def test_the_kernels_tcp_notice_is_silenced_and_nothing_else(tmp_path, monkeypatch):
    """ipykernel's "running over TCP without encryption" (five lines per kernel in make lab's terminal) is dropped
    by the logging filter `make setup` installs into the environment (course_lib.course.kernel_log); another warning of
    the kernel still shows, and an environment without it still shows the notice."""
    from course_lib.course import kernel_log

    assert "-m course_lib.course.kernel_log" in "\n".join(_dry_setup(tmp_path, "PIP_TORCH=2.13.0+cpu"))
    quiet, plain = (venv_of_this_environment(tmp_path / name) for name in ("quiet", "plain"))
    installed = kernel_log.install(str(quiet.parents[1]))
    assert json.loads(installed.read_text()) == kernel_log.CONFIG
    for python, shown in ((quiet, False), (plain, True)):
        log = _kernel_log(python, monkeypatch)
        assert (kernel_log.UNENCRYPTED in log) is shown and "another notice" in log, log
    installed.write_text(json.dumps({"IPKernelApp": {"log_level": "INFO"}}))  # another setting is kept
    assert json.loads(kernel_log.install(str(quiet.parents[1])).read_text())["IPKernelApp"]["log_level"] == "INFO"


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
    assert "--LanguageServerManager.autodetect=False" in lab  # it only listed the servers it did not find


def test_my_copy_runs_the_copy_module_into_my_work_which_git_ignores():
    """What the copy does is tested in test_my_copy.py; here, that `make my-copy` runs it on MY_WORK."""
    dry = _make("-n", "my-copy", "VENV=/nonexistent/venv", "PIP_TORCH=2.13.0+cpu", "MY_WORK=mine").stdout
    assert '/nonexistent/venv/bin/python -m course_lib.course.my_copy --dest "mine"' in dry
    assert "my_work/" in (REPO / ".gitignore").read_text().splitlines()


@pytest.fixture
def one_chapter(tmp_path):
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    shutil.copy(REPO / "solutions" / "00_budgets_exercises.ipynb", solutions)
    assert notebooks.sync(solutions, exercises) == [exercises / "00_budgets_exercises.ipynb"]
    return solutions, exercises / "00_budgets_exercises.ipynb"


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
