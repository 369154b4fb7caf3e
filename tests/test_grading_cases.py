"""Self-checks test what the grader tests: every case class a hidden check exercises is exercised by the notebook's
visible check, the notebook's self-check is the grader's visible check, and, for every exercise, the blank scores
nothing and every wrong answer fails the visible check and a hidden one, with a reason (the solutions' full marks:
test_grading.py, one graded run per notebook)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import types
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import cases, grader, in_kernel
from tests.conftest import define_in_cell
from tests.grading_fixtures import REFUSED

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((REPO / "solutions").glob("*.ipynb"))
CHAPTERS = [p.name[:2] for p in SOLUTIONS]

EXTENDED = {chapter: tuple(ex.key for ex in grader.chapter_module(chapter).EXERCISES) for chapter in CHAPTERS}
"""Every exercise of every chapter: each has at least MIN_WRONG wrong answers, all rejected twice."""
MIN_WRONG = 5


def _exercise(chapter: str, key: str):
    return next(ex for ex in grader.chapter_module(chapter).EXERCISES if ex.key == key)


# ----------------------------------------------------------------------------------------------------------------
# Case classes


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_visible_check_exercises_every_case_class_of_the_hidden_ones(chapter):
    module = grader.chapter_module(chapter)
    assert set(module.CASE_CLASSES) == {ex.key for ex in module.EXERCISES}, "an exercise without case classes"
    for ex in module.EXERCISES:
        assert cases.visible_classes(module, ex), ex.key
    assert cases.missing(module) == {}, "hidden classes the notebook's self-check never meets"


def test_a_hidden_check_of_a_new_kind_is_reported():
    """The comparison can fail: the TP exercise's visible check cut to one setting misses the others' classes."""
    module = grader.chapter_module("09")
    ex = dataclasses.replace(_exercise("09", "tp_kv_heads"), visible={"cases": ((2, 4, 2),)})
    fake = types.SimpleNamespace(EXERCISES=[ex], CASE_CLASSES=module.CASE_CLASSES)
    gap = cases.missing(fake)["tp_kv_heads"]
    assert {"more than 2 ranks", "several world sizes", "MQA: one K/V head on every rank"} <= gap, gap


def test_arguments_fill_the_defaults_and_refuse_unknown_names():
    def check(fn, world_size=2, seed=0):
        return fn

    assert cases.arguments(check, {"seed": 3}) == {"world_size": 2, "seed": 3}
    with pytest.raises(TypeError, match="no argument"):
        cases.arguments(check, {"worldsize": 4})
    assert cases.ranks(2) == {"2 ranks"} and cases.ranks(3) == {"more than 2 ranks", "an odd number of ranks"}
    assert cases.several([4, 4], "world sizes") == set() and cases.several([2, 4], "x") == {"several x"}


def _self_check_calls(solution: Path, check: str, function: str) -> list[ast.Call]:
    """The notebook's calls ``chNN.<check>(<function>, ...)``."""
    calls = []
    for cell in nbformat.read(solution, as_version=4).cells:
        if cell.cell_type == "code":
            calls += [node for node in ast.walk(ast.parse(cell.source)) if isinstance(node, ast.Call)
                      and isinstance(node.func, ast.Attribute) and node.func.attr == check
                      and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == function]
    return calls


@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_the_notebooks_self_check_is_the_graders_visible_check(solution):
    """Each exercise's self-check cell passes the learner's function and at most the seed besides the exercise's
    ``visible`` arguments, as literals: what the classes above were computed for."""
    for ex in grader.chapter_module(solution.name[:2]).EXERCISES:
        calls = _self_check_calls(solution, ex.check.__name__, ex.function)
        assert calls, f"{solution.name}: no self-check {ex.check.__name__}({ex.function}, ...)"
        for call in calls:
            given = {kw.arg: kw.value for kw in call.keywords if kw.arg != "seed"}
            assert {k: ast.literal_eval(v) for k, v in given.items()} == dict(ex.visible), (ex.key, ast.unparse(call))


# ----------------------------------------------------------------------------------------------------------------
# Every exercise: solution, blank, wrong answers


def _notebook_namespace(notebook: Path) -> dict:
    """The imports, functions and classes of every code cell, defined as notebook cells define them (one module
    ``__main__``, so that a launched check ships them by value)."""
    keep = [node for cell in nbformat.read(notebook, as_version=4).cells if cell.cell_type == "code"
            for node in ast.parse(cell.source).body
            if isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef)]
    return define_in_cell(ast.unparse(ast.Module(keep, type_ignores=[])), f"/tmp/ipykernel_0/{notebook.stem}.py")


def _extended():
    for chapter, keys in EXTENDED.items():
        for key in keys:
            yield pytest.param(chapter, key, id=f"{chapter}-{key}")


@pytest.mark.slow  # ranks launched: make test, not make test-fast
@pytest.mark.parametrize("chapter, key", list(_extended()))
def test_the_blank_scores_nothing_as_not_implemented(chapter, key):
    """The blank exercise, each exercise on its own. That the solution scores full on every check, visible and
    hidden, is test_grading.py::test_solution_scores_full_marks (the grader's whole run, the same checks)."""
    ex = _exercise(chapter, key)
    name = next(p.name for p in SOLUTIONS if p.name.startswith(chapter))
    blank = in_kernel.grade_exercise(ex, _notebook_namespace(REPO / "exercises" / name))
    assert not blank.ok and "not implemented" in blank.message, blank.message


def _wrong(chapter: str, key: str) -> list:
    return importlib.import_module(f"tests.grading_fixtures.ch{chapter}").WRONG[key]


def test_each_extended_exercise_has_enough_wrong_answers():
    few = {(ch, key): len(_wrong(ch, key)) for ch, keys in EXTENDED.items() for key in keys
           if len(_wrong(ch, key)) < MIN_WRONG}
    assert not few, few


BY_DESIGN = {
    ("11", "diagnose", "diagnose_noise_as_bug"): (
        "by design: the self-check never shows a run without a bug (telling bf16 noise from a bug is the triage the "
        "hidden runs grade; a visible no-bug run would list the hidden kinds): only the grader rejects it"),
}
"""Wrong answers the self-check lets through by design, each with its reason: strict, so that a visible case that
catches one turns its entry red until it is removed here."""


def _wrong_answers():
    for chapter, keys in EXTENDED.items():
        for key in keys:
            for wrong in _wrong(chapter, key):
                reason = BY_DESIGN.get((chapter, key, wrong.__name__))
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                yield pytest.param(chapter, key, wrong, id=f"{chapter}-{key}-{wrong.__name__}", marks=marks)


@pytest.mark.slow  # 341 answers through their checks, ranks launched: make test, not make test-fast
@pytest.mark.parametrize("chapter, key, wrong", list(_wrong_answers()))
def test_a_wrong_answer_fails_the_visible_check_and_a_hidden_one(chapter, key, wrong):
    """Every wrong answer of every exercise (the grader runs these same checks). A check that takes no settings
    (a prediction) has no hidden ones: the grader's check is the notebook's."""
    ex = _exercise(chapter, key)
    visible = ex.check(wrong, **ex.visible)
    assert not visible.ok and visible.message, f"{wrong.__name__} passes the notebook's self-check"
    assert REFUSED not in visible.message, f"{wrong.__name__} is refused by the allow-list: {visible.message}"
    if not ex.hidden and list(inspect.signature(ex.check).parameters) == ["fn"]:
        return
    failed = []  # as the grader, stop at the first hidden check that rejects it (unless that is a refusal)
    for kwargs in ex.hidden:
        result = ex.check(wrong, **kwargs)
        if not result.ok and result.message:
            failed.append(result.message)
            if REFUSED not in result.message:
                break
    assert failed, f"{wrong.__name__} passes every hidden check"
    assert any(REFUSED not in m for m in failed), f"{wrong.__name__} is refused by the allow-list: {failed[0]}"
