"""Inside the learner's kernel: the grading cell the grader appends runs ``run_hidden_checks``, which grades every
exercise of the chapter (its visible check, then its hidden ones, each within ``CHECK_TIMEOUT_S``) in the
notebook's own namespace and writes the results signed with the run's key (``course_lib.grading.grader`` reads
them back and refuses a file this key did not sign).

Nothing here reads or writes notebooks: the kernel imports only the chapter's checks (and torch with them).
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

from course_lib.grading.core import CheckResult, Exercise, time_limit

CHECK_TIMEOUT_S = 60


def chapter_module(chapter: str) -> ModuleType:
    return importlib.import_module(f"course_lib.grading.ch{chapter}")


def grade_exercise(ex: Exercise, namespace: dict[str, Any]) -> CheckResult:
    """Run the visible and hidden checks of ``ex`` against the function the notebook defined."""
    fn = namespace.get(ex.function)
    if fn is None:
        return CheckResult(ex.key, False, f"the notebook defines no `{ex.function}`")
    refused = ex.refusal(fn)
    if refused:
        return refused
    settings = [ex.visible, *ex.hidden]
    for i, kwargs in enumerate(settings):
        with time_limit(CHECK_TIMEOUT_S, f"check {i + 1} of {ex.key}"):
            try:
                result = ex.check(fn, **kwargs)
            except AssertionError as exc:  # CheckFailed from the time limit
                result = CheckResult(ex.key, False, str(exc))
        if not result.ok:
            where = "the visible check" if i == 0 else f"hidden check {i} ({_describe(kwargs)})"
            return CheckResult(ex.key, False, f"{where}: {result.message}")
    return CheckResult(ex.key, True, f"all {len(settings)} checks passed")


def _describe(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "defaults"


def sign(results: dict[str, Any], key: str) -> str:
    """HMAC-SHA256 (RFC 2104) of the results' canonical JSON under the run's key."""
    return hmac.new(bytes.fromhex(key), json.dumps(results, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def run_hidden_checks(chapter: str, namespace: dict[str, Any], results_path: str, key: str) -> None:
    """Appended to the notebook by the grader: grade every exercise, writing signed results as they come."""
    results: dict[str, dict[str, Any]] = {}
    for ex in chapter_module(chapter).EXERCISES:
        res = grade_exercise(ex, namespace)
        results[ex.key] = {"ok": res.ok, "message": res.message}
        Path(results_path).write_text(json.dumps({"results": results, "mac": sign(results, key)}))
