"""The grader: exercises generated from solutions, full marks for solutions, zero for untouched exercises, wrong
answers rejected, and broken notebooks graded in bounded time with nothing left running.

A graded notebook costs ~11 s before its first cell (papermill's import, the kernel's start, torch and the checks
imported in the kernel), so each notebook is graded once and every assertion about it reads that run: the untouched
exercise is graded through the CLI, as a learner grades it (exit status, the printed total, the JSON report and the
scores); the CLI's other exit statuses are tested without a kernel. The chapters' wrong and other right answers run
in this process, on its warm rank launcher. The notebook runs are ``slow`` (chapter 00's solution stays in ``make
test-fast``); those with a time limit are ``serial`` (their own lane, tests/conftest.py).
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import time
from pathlib import Path

import nbformat
import psutil
import pytest
import torch

from course_lib.grading import allowlist, cli, core, grader, in_kernel, notebooks
from tests.conftest import _rank_processes
from tests.grading_fixtures import REFUSED

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((REPO / "solutions").glob("*.ipynb"))
CHAPTERS = [p.name[:2] for p in SOLUTIONS]


def test_there_are_solutions_and_each_has_at_least_three_exercises():
    assert SOLUTIONS
    for ch in CHAPTERS:
        assert len(grader.chapter_module(ch).EXERCISES) >= 3, ch


def test_exercises_are_in_sync_with_their_solutions():
    stale = notebooks.sync(check=True)
    assert not stale, f"run `python -m course_lib.grading.notebooks`: out of date {stale}"


def test_strip_source_replaces_blocks_at_their_indentation_with_the_hint():
    src = "def f(x):\n    ### BEGIN SOLUTION hint: double it\n    y = 2 * x\n    return y\n    ### END SOLUTION\n"
    assert notebooks.strip_source(src) == 'def f(x):\n    raise NotImplementedError("double it")'
    with pytest.raises(ValueError, match="without ### END"):
        notebooks.strip_source("### BEGIN SOLUTION\nx = 1\n")


def test_exercise_notebooks_contain_no_solution_and_no_outputs():
    for sol in SOLUTIONS:
        ex = nbformat.read(REPO / "exercises" / sol.name, as_version=4)
        for cell in ex.cells:
            assert "BEGIN SOLUTION" not in cell.source
            if cell.cell_type == "code":
                assert not cell.outputs


def test_no_fixture_uses_a_library_object_its_exercise_does_not_allow():
    """Read without running (a few seconds for every chapter): a wrong answer refused for what it uses would prove
    nothing about the checks, a right one would not score. What the runtime guard alone sees shows in the checked
    runs (test_grading_cases.py's wrong answers, the right answers' full marks)."""
    assert REFUSED in allowlist.refusal_message("`f`", ["uses course_lib.comm"], allowlist.Allowed(()))
    refused = {}
    for ch in CHAPTERS:
        fixtures = importlib.import_module(f"tests.grading_fixtures.ch{ch}")
        for ex in grader.chapter_module(ch).EXERCISES:
            for fixture in [*fixtures.WRONG.get(ex.key, []), *getattr(fixtures, "RIGHT", {}).get(ex.key, [])]:
                why = ex.refusal(fixture)
                if why is not None:
                    refused[f"{ch} {ex.key} {fixture.__name__}"] = why.message
    assert not refused, refused


def test_checkers_do_not_accept_a_tensor_or_a_list_for_a_number():
    for got in (torch.tensor(6.0), [6], [[6]], True):
        with pytest.raises(core.CheckFailed):
            core.expect_number(got, 6, "x")
    core.expect_number(6, 6, "x")
    with pytest.raises(core.CheckFailed, match="shape"):
        core.expect_close(torch.ones(2, 1), torch.ones(2), "t")
    with pytest.raises(core.CheckFailed, match=r"index \(1,\)"):
        core.expect_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), "t")


def _graded_run(stem: str):
    """``slow``, but chapter 00's (the shortest notebook) also in ``make test-fast``: one real graded run there."""
    return [pytest.mark.fast] if stem.startswith("00_") else [pytest.mark.slow]


@pytest.mark.parametrize("solution", [pytest.param(p, id=p.stem, marks=_graded_run(p.stem)) for p in SOLUTIONS])
def test_solution_scores_full_marks(solution):
    full = grader.grade_notebook(solution)
    assert full.points == full.max_points > 0, full.table()
    assert not full.problems and not full.failure, full.table()
    assert all(s.ok and "checks passed" in s.reason for s in full.scores), full.table()


@pytest.mark.slow
def test_untouched_exercise_scores_zero_through_the_cli(tmp_path, capsys):
    """The learner's command on a blank exercise whose checks launch ranks (chapter 01): a partial score (here 0)
    is a result, not a crash: exit 0, the total printed, the JSON report written; every exercise scores 0 as not
    implemented. Each other chapter's blank exercises: test_grading_cases.py, exercise by exercise."""
    out = tmp_path / "report.json"
    solution = next(p for p in SOLUTIONS if p.name.startswith("01_"))
    code = cli.main([str(REPO / "exercises" / solution.name), "--out", str(out), "--my-work",
                     str(tmp_path / "no_copy")])
    assert code == 0
    (report,) = json.loads(out.read_text())
    assert report["points"] == 0 < report["max_points"], report
    assert all(s["points"] == 0 and "not implemented" in s["reason"] for s in report["scores"]), report
    assert f"total: 0/{report['max_points']} points over 1 notebook(s)" in capsys.readouterr().out


def _with_extra_cell(tmp_path: Path, source: str, after: int) -> Path:
    nb = nbformat.read(REPO / "solutions" / "00_budgets_exercises.ipynb", as_version=4)
    nb.cells.insert(after, nbformat.v4.new_code_cell(source))
    path = tmp_path / "00_budgets.ipynb"
    nbformat.write(nb, path)
    return path


def _no_children_left():
    left = _rank_processes()  # children of this test process, multiprocessing's long-lived helpers aside
    assert not left, f"grading left processes running: {[psutil.Process(p).cmdline() for p in left]}"


@pytest.mark.slow
@pytest.mark.serial
def test_an_infinite_loop_costs_only_time_not_the_other_exercises(tmp_path):
    path = _with_extra_cell(tmp_path, "while True:\n    pass", after=3)
    start = time.monotonic()
    # the loop burns a core until the cell limit: 10 s, over twice the longest other cell of chapter 00 on 2
    # loaded cores (1 s quiet, about 4 s in make test)
    report = grader.grade_notebook(path, timeout=150, cell_timeout=10)
    assert report.points == report.max_points, report.table()
    assert time.monotonic() - start < 120
    _no_children_left()


@pytest.mark.slow
@pytest.mark.serial
def test_a_notebook_that_kills_its_kernel_scores_zero_with_the_reason(tmp_path):
    path = _with_extra_cell(tmp_path, "import os\nos._exit(1)", after=5)
    report = grader.grade_notebook(path, timeout=120, cell_timeout=30)
    assert report.points == 0
    assert any("kernel died" in s.reason for s in report.scores), report.table()
    _no_children_left()


@pytest.mark.slow
@pytest.mark.serial
def test_a_notebook_past_its_time_limit_is_stopped(tmp_path):
    path = _with_extra_cell(tmp_path, "import time\ntime.sleep(600)", after=3)
    start = time.monotonic()
    report = grader.grade_notebook(path, timeout=15, cell_timeout=300)
    assert time.monotonic() - start < 60
    assert report.points == 0
    assert any("did not finish within 15 s" in s.reason for s in report.scores), report.table()
    _no_children_left()


def test_the_cli_exit_status_says_usage_or_strict(monkeypatch):
    """Without a kernel (the real runs: test_untouched_exercise_scores_zero_through_the_cli): 2 when no notebook
    is found; 0 for any score, unless --strict and a mark is missing."""
    reports = []
    monkeypatch.setattr(grader, "grade", lambda *a, **k: reports)  # exit codes without running notebooks
    assert cli.main(["nothing/"]) == 2  # no notebook found
    reports.append(grader.NotebookReport("x.ipynb", "00", [grader.ExerciseScore("k", "t", 1, 2, False, "no")]))
    assert cli.main(["x.ipynb"]) == 0
    assert cli.main(["x.ipynb", "--strict"]) == 1
    reports[0].scores[0] = grader.ExerciseScore("k", "t", 2, 2, True, "ok")
    assert cli.main(["x.ipynb", "--strict"]) == 0


def test_the_course_exercise_named_grades_the_learners_copy_and_says_so(tmp_path, monkeypatch, capsys):
    """`make grade NB=exercises/...` in the course folder names the course's untouched blank copy; the learner's
    answers are in my_work/exercises/. The grader grades those, in one line says so; --as-named grades the
    course's copy and says the learner's edited copy is not graded."""
    name = "00_budgets_exercises.ipynb"
    course, mine = REPO / "exercises" / name, tmp_path / "exercises" / name
    graded: list[list[Path]] = []
    monkeypatch.setattr(grader, "grade", lambda paths, *a, **k: graded.append(list(paths)) or [
        grader.NotebookReport(str(paths[0]), "00", [grader.ExerciseScore("k", "t", 1, 1, True, "ok")])])
    assert cli.main([str(course), "--my-work", str(tmp_path)]) == 0
    assert graded.pop() == [course] and "your copy" not in capsys.readouterr().out  # no copy: as named
    mine.parent.mkdir()
    nb = nbformat.read(course, as_version=4)
    nbformat.write(nb, mine)
    assert cli.main([str(course), "--my-work", str(tmp_path)]) == 0
    assert graded.pop() == [mine]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "copy" in ln]
    assert lines == [f"grading your copy {mine}: {course} is the course's untouched copy (--as-named grades it)"]
    assert cli.main([str(course), "--my-work", str(tmp_path), "--as-named"]) == 0
    assert graded.pop() == [course] and "not graded" not in capsys.readouterr().out  # the same cells: nothing lost
    next(c for c in nb.cells if c.cell_type == "code").source += "\nanswer = 42"
    nbformat.write(nb, mine)
    assert cli.main([str(course), "--my-work", str(tmp_path), "--as-named"]) == 0
    assert graded.pop() == [course]
    assert f"your edited copy {mine} is not graded" in capsys.readouterr().out
    assert grader.learners_copy(tmp_path / "elsewhere.ipynb", tmp_path) == (tmp_path / "elsewhere.ipynb", None)
    repo = tmp_path / "course"  # a learner who works in the course's own copy: it is graded as named
    (repo / "exercises").mkdir(parents=True)
    nbformat.write(nb, repo / "exercises" / name)
    monkeypatch.setattr(grader, "REPO", repo)
    assert grader.learners_copy(repo / "exercises" / name, tmp_path) == (repo / "exercises" / name, None)


def test_visible_bucket_check_rejects_a_dropped_partial_bucket():
    from course_lib.grading import ch02
    from tests.grading_fixtures.ch02 import buckets_drop_the_last_partial_one

    assert not ch02.check_assign_buckets(buckets_drop_the_last_partial_one).ok
    assert ch02.check_assign_buckets.unguarded(ch02.reference_buckets).ok  # the library's own, unguarded


def _notebook_function(notebook: Path, name: str, namespace: dict) -> object:
    """Define ``name`` as the notebook's own cell defines it (the cell's other statements are not run)."""
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type == "code" and f"def {name}(" in cell.source:
            tree = ast.parse(cell.source)
            defs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name]
            exec(compile(ast.Module(defs, type_ignores=[]), str(notebook), "exec"), namespace)
            return namespace[name]
    raise AssertionError(f"{notebook.name} defines no {name}")


def test_chapter_00_find_the_bug_fails_as_shipped_and_passes_once_fixed():
    from course_lib.grading import ch00

    notebook = REPO / "solutions" / "00_budgets_exercises.ipynb"
    colleague = _notebook_function(notebook, "model_states_per_gpu_from_a_colleague", {})
    visible = ch00.check_model_states_per_gpu(colleague)
    assert not visible.ok and "optimizer_state" in visible.message, visible  # the notebook's symptom
    assert colleague(7.5e9, 1, 1, 64, 3) == ch00.reference_model_states(7.5e9, 1, 1, 64, 3)  # right for pure DP
    fixed = _notebook_function(notebook, "model_states_per_gpu", {})
    exercise = next(ex for ex in ch00.EXERCISES if ex.key == "model_states_per_gpu")
    assert in_kernel.grade_exercise(exercise, {"model_states_per_gpu": fixed}).ok
    assert not in_kernel.grade_exercise(exercise, {"model_states_per_gpu": colleague}).ok


def test_ch08_stated_formulas_sit_well_inside_the_tolerance_on_every_mesh_the_grader_tries():
    """predict_mesh's spec (``predict_mesh_spec``) against the library's planner on the visible and the hidden
    meshes: within 3/4 of each tolerance, so an answer that follows the notebook's formulas is never called wrong;
    the cases include pp > 1, cp > 1 and ZeRO-3."""
    from course_lib.grading import ch08
    from course_lib.model_config import PRESETS

    ex = next(e for e in ch08.EXERCISES if e.key == "predict_mesh")
    cases = [*ch08.PREDICT_CASES, *(c for h in ex.hidden for c in h["cases"])]
    assert any(c[1].get("pp", 1) > 1 for c in cases) and any(c[1].get("cp", 1) > 1 for c in cases)
    assert any(c[6] == 3 for c in cases)
    for name, *rest in cases:
        spec = ch08.predict_mesh_spec(PRESETS[name], *rest)
        lib = ch08.library_prediction(PRESETS[name], *rest)
        for key, rtol in (("model_state_bytes", ch08.MEMORY_RTOL), ("step_s", ch08.TIME_RTOL)):
            assert abs(spec[key] / lib[key] - 1) <= 0.75 * rtol, (name, rest, key, spec[key] / lib[key])


@pytest.mark.slow
def test_ch08_on_rank_check_names_the_weight_passes_the_reduction_missed():
    """The on-rank half alone (the data check would stop this answer first): a REDUCE_GRAD after the last I
    trains on 4 ranks, and the check says which W ran after the all-reduce had started."""
    from course_lib.grading import ch08
    from tests.grading_fixtures.ch08 import reduce_after_last_i

    result = ch08.check_grad_reduce_on_ranks(reduce_after_last_i)
    assert not result.ok
    assert "W1 after its REDUCE_GRAD" in result.message and "missed those weight gradients" in result.message, \
        result.message


def test_chapter_05_find_the_bug_fails_as_shipped_on_the_stage_without_the_loss():
    import torch.distributed as dist

    from course_lib.grading import ch05
    from course_lib.model import lm_loss

    namespace = {"torch": torch, "dist": dist, "lm_loss": lm_loss}
    colleague = _notebook_function(REPO / "solutions" / "05_pipeline_parallel_exercises.ipynb",
                                   "gpipe_step_from_a_colleague", namespace)
    visible = ch05.check_gpipe_step(colleague, m=4, batch=8)
    assert not visible.ok and visible.message.startswith("rank 0's gradient"), visible  # the stated symptom
    assert ch05.check_gpipe_step(colleague, m=4, batch=16).ok  # b = m rows per micro-batch: the bug is the 1/b


def _other_right_answers():
    for ch in CHAPTERS:
        fixtures = importlib.import_module(f"tests.grading_fixtures.ch{ch}")
        for ex in grader.chapter_module(ch).EXERCISES:
            for right in getattr(fixtures, "RIGHT", {}).get(ex.key, []):
                yield pytest.param(ex, right, id=f"{ch}-{ex.key}-{right.__name__}")


@pytest.mark.slow  # ranks launched for most: make test, not make test-fast
@pytest.mark.parametrize("exercise, right", list(_other_right_answers()))
def test_correct_answers_other_than_the_solutions_score_full_marks(exercise, right):
    """The specification allows them (a ring run the other way round, ...): the grader must too."""
    result = in_kernel.grade_exercise(exercise, {exercise.function: right})
    assert result.ok, f"{right.__name__} ({right.__doc__}) was rejected: {result.message}"


# ----------------------------------------------------------------------------------------------------------------
# The exercises themselves: not copyable from their chapter

RUN = 8
"""Tokens in a run: a solution token counts as copied when it lies in a run of RUN consecutive tokens (names,
operators, numbers, strings; layout and comments ignored) that also occurs in the chapter's code."""
COPIED_SHARE = 0.6
"""Above this share of copied tokens a solution block is the chapter's code with other names."""
MIN_TOKENS = 15
"""Shorter blocks (a one-line formula) are not measured: any right answer shares most of its tokens."""
NOT_YET_REWRITTEN: set[tuple[str, str]] = set()
"""Known copies of a chapter's code left to rewrite (none since every exercise became a step beyond its chapter):
the test fails when one appears."""


def _tokens(source: str) -> list[str]:
    import io
    import tokenize

    code = "\n".join(line.strip() for line in source.splitlines())
    kinds = (tokenize.NAME, tokenize.OP, tokenize.NUMBER, tokenize.STRING)
    try:
        return [t.string for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.type in kinds]
    except tokenize.TokenError:
        return []


def copied_share(answer: str, chapter_code: str) -> float:
    """The share of ``answer``'s tokens inside a run of RUN tokens that the chapter's code also has."""
    mine, theirs = _tokens(answer), _tokens(chapter_code)
    runs = {tuple(theirs[i:i + RUN]) for i in range(len(theirs) - RUN + 1)}
    covered = [False] * len(mine)
    for i in range(len(mine) - RUN + 1):
        if tuple(mine[i:i + RUN]) in runs:
            covered[i:i + RUN] = [True] * RUN
    return sum(covered) / max(1, len(mine))


def _defined(source: str) -> str:
    """The first function or class a cell defines ('' when none)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    return next((n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)), "")


def _solution_blocks(solution: Path) -> list[tuple[str, str]]:
    """(the cell's function or class, a solution block's code) for every block of every cell."""
    out = []
    for cell in nbformat.read(solution, as_version=4).cells:
        if cell.cell_type == "code":
            for block in re.findall(r"### BEGIN SOLUTION[^\n]*\n(.*?)### END SOLUTION", cell.source, re.S):
                out.append((_defined(cell.source), block))
    return out


def _chapter_code(chapter: str) -> str:
    nb = nbformat.read(next((REPO / "notebooks").glob(f"{chapter}_*.ipynb")), as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


def test_no_solution_can_be_copied_from_its_chapter():
    copied = set()
    for solution in SOLUTIONS:
        chapter = solution.name[:2]
        code = _chapter_code(chapter)
        for name, block in _solution_blocks(solution):
            if len(_tokens(block)) >= MIN_TOKENS and copied_share(block, code) > COPIED_SHARE:
                copied.add((chapter, name))
    assert copied == NOT_YET_REWRITTEN, f"copied from the chapter: {sorted(copied - NOT_YET_REWRITTEN)}; " \
        f"no longer copied (remove from NOT_YET_REWRITTEN): {sorted(NOT_YET_REWRITTEN - copied)}"


def test_the_measure_tells_a_copy_from_a_rewrite():
    chapter = "def f(x, n):\n    out = torch.zeros(n)\n    for i in range(n):\n        out[i] = x[i] * 2 + 1\n" \
              "    return out\n"
    renamed = chapter.replace("f(x, n)", "g(x, n)")
    assert copied_share(renamed, chapter) > 0.9
    assert copied_share("def g(y):\n    return torch.stack([v * 2 + 1 for v in y])\n", chapter) < 0.3


SPOILED_NOT_YET_REWRITTEN: set[tuple[str, str]] = set()
"""Known find-the-bugs whose buggy code is the chapter's (issue 26; chapter 09 is another session's)."""


def test_no_find_the_bug_shows_its_bug_in_the_chapter():
    """The colleague's buggy code (a function or class named *colleague* or Buggy*) is not the chapter's code."""
    spoiled = set()
    for solution in SOLUTIONS:
        code = _chapter_code(solution.name[:2])
        for cell in nbformat.read(solution, as_version=4).cells:
            name = _defined(cell.source) if cell.cell_type == "code" else ""
            if ("colleague" in name or name.lower().startswith("buggy")) and \
                    copied_share(cell.source.split("\nprint(")[0], code) > COPIED_SHARE:
                spoiled.add((solution.name[:2], name))
    assert spoiled == SPOILED_NOT_YET_REWRITTEN, spoiled
