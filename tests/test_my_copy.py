"""The learner's copy (``course_lib/course/my_copy.py``, ``make my-copy``, ``make lab``): running and saving a chapter
in ``make lab`` never changes a tracked file, a ``git pull`` brings new notebooks without touching the learner's
edits, and the project's JupyterLab settings turn the news toast off."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.course import my_copy
from course_lib.grading.notebooks import exercise_name

REPO = Path(__file__).resolve().parents[1]
EX00 = f"exercises/{exercise_name('00_budgets.ipynb')}"
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]


def _course(tmp_path: Path, names: tuple[str, ...] = ("START_HERE.ipynb", "00_budgets.ipynb")) -> Path:
    """A small git repository laid out as the course: the real Makefile, .gitignore and settings, a few notebooks."""
    repo = tmp_path / "course"
    for folder in ("notebooks", "exercises"):
        (repo / folder).mkdir(parents=True)
        for name in names:
            name = exercise_name(name) if folder == "exercises" else name
            if (REPO / folder / name).exists():
                shutil.copy(REPO / folder / name, repo / folder / name)
    for name in ("Makefile", ".gitignore", "pyproject.toml"):
        shutil.copy2(REPO / name, repo / name)  # its time too: the course's .venv is newer, as after `make setup`
    shutil.copytree(REPO / "jupyter", repo / "jupyter")
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "course"]):
        subprocess.run([*GIT, "-C", str(repo), *cmd], check=True, capture_output=True)
    return repo


def _git_status(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=all"], check=True,
                          capture_output=True, text=True).stdout


def _lab_command(repo: Path) -> str:
    """What ``make lab`` would run there (``make -n``: nothing installed or started)."""
    out = subprocess.run(["make", "-s", "--no-print-directory", "-n", "lab", "VENV=/nonexistent/venv",
                          "PIP_TORCH=2.13.0+cpu"], cwd=repo, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _edit_first_code_cell(path: Path, source: str) -> None:
    nb = nbformat.read(path, as_version=4)
    next(c for c in nb.cells if c.cell_type == "code").source = source
    nbformat.write(nb, path)


def test_first_run_copies_every_notebook_and_a_second_run_does_nothing(tmp_path):
    repo = _course(tmp_path)
    work = repo / "my_work"
    report = my_copy.sync(work, repo)
    wanted = sorted(f"{d}/{p.name}" for d in my_copy.FOLDERS for p in (repo / d).glob("*.ipynb"))
    assert sorted(report.copied) == wanted and len(wanted) == 3
    assert all((work / rel).read_bytes() == (repo / rel).read_bytes() for rel in wanted)
    again = my_copy.sync(work, repo)
    assert (again.copied, again.updated, again.kept, again.moved) == ([], [], [], [])
    assert _git_status(repo) == "", "my_work/ must be ignored by git"


def test_a_pull_brings_new_notebooks_refreshes_run_ones_and_keeps_edited_ones(tmp_path):
    repo = _course(tmp_path)
    work = repo / "my_work"
    my_copy.sync(work, repo)
    ran = work / "notebooks" / "START_HERE.ipynb"
    nb = nbformat.read(ran, as_version=4)
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="I ran it\n")]  # running is not editing
    nbformat.write(nb, ran)
    mine = work / EX00
    _edit_first_code_cell(mine, "my_answer = 42")
    my_answers = mine.read_text()
    # the course moves on (a git pull): both notebooks change, a chapter is added
    for rel in ("notebooks/START_HERE.ipynb", EX00):
        _edit_first_code_cell(repo / rel, "world_size = 8  # the course's new version")
    shutil.copy(REPO / "notebooks" / "01_collectives.ipynb", repo / "notebooks")
    report = my_copy.sync(work, repo)
    assert report.copied == ["notebooks/01_collectives.ipynb"]
    assert report.updated == ["notebooks/START_HERE.ipynb"]
    assert ran.read_bytes() == (repo / "notebooks" / "START_HERE.ipynb").read_bytes()
    assert report.kept == [EX00] and mine.read_text() == my_answers
    line = next(ln for ln in report.lines(work, repo) if ln.startswith("kept"))
    assert str(repo / EX00) in line  # where to compare
    assert my_copy.sync(work, repo).kept == [EX00]  # said again until the learner acts
    assert mine.read_text() == my_answers


def test_an_edited_exercise_is_kept_quietly_while_the_course_has_nothing_new(tmp_path):
    repo = _course(tmp_path)
    work = repo / "my_work"
    my_copy.sync(work, repo)
    _edit_first_code_cell(work / EX00, "my_answer = 42")
    report = my_copy.sync(work, repo)
    assert (report.copied, report.updated, report.kept) == ([], [], [])
    assert "my_answer" in (work / EX00).read_text()


def test_a_broken_record_or_notebook_never_costs_the_learners_file(tmp_path):
    repo = _course(tmp_path)
    work = repo / "my_work"
    my_copy.sync(work, repo)
    (work / my_copy.RECORD).write_text("not json")
    (work / EX00).write_text("half-written")
    _edit_first_code_cell(repo / EX00, "world_size = 8  # the course's new version")
    report = my_copy.sync(work, repo)
    assert (work / EX00).read_text() == "half-written"
    assert report.updated == [] and report.copied == []


def test_the_earlier_flat_copy_of_an_exercise_moves_where_its_links_work(tmp_path):
    repo = _course(tmp_path)
    work = repo / "my_work"
    work.mkdir()
    shutil.copy(repo / EX00, work / "00_budgets.ipynb")  # the old `make my-copy`
    _edit_first_code_cell(work / "00_budgets.ipynb", "my_answer = 42")
    report = my_copy.sync(work, repo)
    assert report.moved == [f"{work / '00_budgets.ipynb'} -> {work / EX00}"]
    assert "my_answer" in (work / EX00).read_text()
    assert not (work / "00_budgets.ipynb").exists() and EX00 not in report.copied


def test_an_exercise_under_the_chapters_name_moves_to_the_exercises_name_with_its_record(tmp_path):
    """Exercises were once named like their chapters (two tabs of one name): the learner's edited copy follows."""
    repo = _course(tmp_path)
    work = repo / "my_work"
    my_copy.sync(work, repo)
    old = work / "exercises" / "00_budgets.ipynb"
    (work / EX00).rename(old)
    record = json.loads((work / my_copy.RECORD).read_text())
    record["exercises/00_budgets.ipynb"] = record.pop(EX00)
    (work / my_copy.RECORD).write_text(json.dumps(record))
    _edit_first_code_cell(old, "my_answer = 42")
    report = my_copy.sync(work, repo)
    assert report.moved == [f"{old} -> {work / EX00}"] and report.copied == []
    assert "my_answer" in (work / EX00).read_text() and not old.exists()
    record = json.loads((work / my_copy.RECORD).read_text())
    assert EX00 in record and "exercises/00_budgets.ipynb" not in record


def _make_n(where: Path, *args: str) -> str:
    out = subprocess.run(["make", "-s", "--no-print-directory", "-n", *args, "VENV=/nonexistent/venv",
                          "PIP_TORCH=2.13.0+cpu"], cwd=where, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_grade_in_the_learners_copy_grades_that_copy_through_the_course(tmp_path):
    """JupyterLab's terminal starts in my_work/ (the server runs there); `make grade NB=exercises/...` typed there
    grades the learner's file, by the course's Makefile, as does the chapters' `NB=my_work/exercises/...`."""
    repo = _course(tmp_path)
    work = repo / "my_work"
    my_copy.sync(work, repo)
    assert f'cd "{work.name}" && ' in _lab_command(repo)  # the server's (so the terminal's) folder
    grade = _make_n(work, "grade", f"NB={EX00}")
    assert f'-m course_lib.grading "{work / EX00}" --my-work "{work}"' in grade, grade
    grade = _make_n(work, "grade", f"NB=my_work/{EX00}")
    assert f'-m course_lib.grading "my_work/{EX00}" --my-work "{work}"' in grade, grade
    assert _git_status(repo) == ""


def test_each_copy_of_the_course_keeps_its_own_jupyterlab_workspace(tmp_path):
    """JupyterLab's per-user workspace reopened one copy's tabs (and started their kernels) in another: `make lab`
    keeps it inside the copy, in a folder git ignores."""
    one, two = _course(tmp_path / "one"), _course(tmp_path / "two")
    spaces = [re.search(r'--LabApp.workspaces_dir="([^"]+)"', _lab_command(r)).group(1) for r in (one, two)]
    assert [Path(s).is_relative_to(r) for s, r in zip(spaces, (one, two), strict=True)] == [True, True]
    inside = Path(spaces[0], "lab-a511.jupyterlab-workspace").relative_to(one)
    assert subprocess.run(["git", "-C", str(one), "check-ignore", "-q", str(inside)]).returncode == 0


def test_make_lab_serves_the_learners_copy_and_make_my_copy_runs_the_module(tmp_path):
    repo = _course(tmp_path)
    lab = _lab_command(repo)
    assert f'--ServerApp.root_dir="{repo / "my_work"}"' in lab
    assert "--LabApp.default_url=/lab/tree/notebooks/START_HERE.ipynb" in lab
    assert lab.index("-m course_lib.course.my_copy --dest \"my_work\"") < lab.index('/bin/jupyter" lab')  # copy, serve
    other = subprocess.run(["make", "-s", "-n", "lab", "VENV=/nonexistent/venv", "MY_WORK=elsewhere"], cwd=repo,
                           capture_output=True, text=True, timeout=120).stdout
    assert f'--ServerApp.root_dir="{repo / "elsewhere"}"' in other and '--dest "elsewhere"' in other
    ignored = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", "my_work/notebooks/x.ipynb"])
    assert ignored.returncode == 0, "make lab must serve a folder git ignores"


@pytest.mark.slow
def test_running_a_chapter_in_make_lab_and_saving_it_leaves_git_status_clean(tmp_path):
    """What a learner does: `make lab` (copy, then serve my_work/), run cells of the start page in a kernel, and
    JupyterLab saves it (autosave, Ctrl+S: the server's contents manager). Then `git status` is clean. The same
    save through a server rooted at the repository (the former `make lab`) modifies a tracked notebook."""
    from jupyter_server.services.contents.filemanager import FileContentsManager
    from nbclient import NotebookClient

    repo = _course(tmp_path)
    lab = _lab_command(repo)
    root = Path(re.search(r'--ServerApp.root_dir="([^"]+)"', lab).group(1))
    page = re.search(r"--LabApp.default_url=/lab/tree/(\S+)", lab).group(1)
    assert my_copy.main(["--repo", str(repo), "--dest", str(root)]) == 0
    opened = root / page
    nb = nbformat.read(opened, as_version=4)
    first_launch = next(i for i, c in enumerate(nb.cells) if "launch(hello" in c.source)
    run = nbformat.from_dict(nb)
    run.cells = run.cells[:first_launch + 1]  # parameters, imports, the first cell that starts ranks
    NotebookClient(run, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(opened.parent)}},
                   ).execute()
    nb.cells[:first_launch + 1] = run.cells
    assert "rank 0" in "".join(o.get("text", "") for o in nb.cells[first_launch].outputs)
    model = {"type": "notebook", "format": "json", "content": json.loads(nbformat.writes(nb))}
    FileContentsManager(root_dir=str(root)).save(model, page)
    assert _git_status(repo) == ""
    assert "rank 0" in opened.read_text()
    assert my_copy.sync(root, repo).updated == [] and "rank 0" in opened.read_text()  # its run is kept
    FileContentsManager(root_dir=str(repo)).save(model, "notebooks/START_HERE.ipynb")
    assert _git_status(repo).split() == ["M", "notebooks/START_HERE.ipynb"]


def test_the_shipped_settings_turn_the_news_toast_off():
    """JupyterLab asks "get notified about official Jupyter news?" while fetchNews is "none" (its default);
    `make lab` passes jupyter/lab/settings as the app settings dir, whose overrides.json makes "false" the default
    (a learner's own user setting still wins)."""
    from jupyterlab_server.settings_utils import _get_overrides, get_settings

    lab = _lab_command(REPO)
    settings_dir = Path(re.search(r'--LabApp.app_settings_dir="([^"]+)"', lab).group(1))
    assert settings_dir == REPO / "jupyter" / "lab" / "settings"
    overrides, error = _get_overrides(str(settings_dir))
    assert not error
    schemas = Path(sys.prefix) / "share" / "jupyter" / "lab" / "schemas"
    plugin = "@jupyterlab/apputils-extension:notification"
    result, _ = get_settings(str(settings_dir), str(schemas), str(settings_dir / "no-user-settings"), plugin,
                             overrides)
    props = result["schema"]["properties"]
    assert props["fetchNews"]["default"] == "false" and props["checkForUpdates"]["default"] is False
    plain, _ = get_settings(str(settings_dir), str(schemas), str(settings_dir / "no-user-settings"), plugin, {})
    assert plain["schema"]["properties"]["fetchNews"]["default"] == "none"  # what shows the toast
