"""Case classes: the kinds of input a check exercises, so that a notebook's self-check tests what the grader does.

A *case class* is a kind of input the specification allows and a plausible mistake gets wrong: another world size,
two world sizes (a hard-coded rank count), GQA, a sub-group, another dtype, a sequence whose order matters. Each
chapter module declares ``CASE_CLASSES``: per exercise key, a function that names the classes a list of check calls
exercises (each call's keyword arguments, the check's defaults filled in). The visible check is the call a
notebook's self-check makes (the exercise's ``visible`` arguments); the grader's hidden checks vary only values,
so every class they exercise together must be among the visible call's: ``missing`` lists the exceptions.

    .venv/bin/python -m course_lib.grading.cases      # every exercise's visible and hidden classes
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from course_lib.grading.core import Exercise

Classifier = Callable[[Sequence[Mapping[str, Any]]], set[str]]
"""Names the case classes of a list of calls (each a dict of every keyword argument of the check)."""


def arguments(check: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Every keyword argument ``check(answer, **kwargs)`` runs with: ``kwargs`` over the check's defaults."""
    params = list(inspect.signature(check).parameters.values())[1:]
    unknown = set(kwargs) - {p.name for p in params}
    if unknown:
        raise TypeError(f"{check.__name__} takes no argument {sorted(unknown)}")
    return {p.name: kwargs.get(p.name, p.default) for p in params}


def visible_classes(module: ModuleType, ex: Exercise) -> set[str]:
    """The classes the notebook's self-check exercises (the exercise's visible call)."""
    return module.CASE_CLASSES[ex.key]([arguments(ex.check, ex.visible)])


def hidden_classes(module: ModuleType, ex: Exercise) -> set[str]:
    """The classes the grader's hidden checks exercise, taken together (two world sizes across two calls count)."""
    return module.CASE_CLASSES[ex.key]([arguments(ex.check, h) for h in ex.hidden])


def missing(module: ModuleType) -> dict[str, set[str]]:
    """Per exercise of ``module``, the hidden checks' classes that its visible check does not exercise."""
    return {ex.key: gap for ex in module.EXERCISES if (gap := hidden_classes(module, ex) - visible_classes(module, ex))}


# ----------------------------------------------------------------------------------------------------------------
# Classes several chapters use


def ranks(n: int) -> set[str]:
    """A world size's classes: 2 ranks (the ring's neighbours are one rank), more, an odd number."""
    return {"1 rank"} if n == 1 else {"2 ranks"} if n == 2 else {"more than 2 ranks"} | (
        {"an odd number of ranks"} if n % 2 else set())


def several(values: Iterable[Any], what: str) -> set[str]:
    """``{"several <what>"}`` when ``values`` holds two different ones (a hard-coded value fails one of them)."""
    return {f"several {what}"} if len(set(values)) > 1 else set()


def each(calls: Sequence[Mapping[str, Any]], key: str = "cases") -> list[Any]:
    """The items of argument ``key`` over every call, in order (the cases a list of calls runs)."""
    return [item for call in calls for item in call[key]]


def main(argv: list[str] | None = None) -> int:
    from course_lib.grading.in_kernel import chapter_module

    chapters = argv or sorted(p.stem[2:] for p in Path(__file__).parent.glob("ch[0-9][0-9].py"))
    gaps = 0
    for ch in chapters:
        module = chapter_module(ch)
        for ex in module.EXERCISES:
            if ex.key not in getattr(module, "CASE_CLASSES", {}):
                print(f"{ch} {ex.key}: no case classes declared")
                gaps += 1
                continue
            visible, hidden = visible_classes(module, ex), hidden_classes(module, ex)
            print(f"{ch} {ex.key}\n  visible: {'; '.join(sorted(visible))}\n  hidden:  {'; '.join(sorted(hidden))}")
            if hidden - visible:
                print(f"  MISSING from the visible check: {'; '.join(sorted(hidden - visible))}")
                gaps += 1
    return 1 if gaps else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
