"""What every check is made of: a result with a reason, exercises with points, and precise comparisons.

A check never just says "wrong": it names the first difference it found (which rank, which tensor, which index,
expected vs got), so a learner can act on it.
"""

from __future__ import annotations

import contextlib
import signal
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CheckResult:
    """Outcome of one check: ``ok`` and a one-paragraph reason (the first difference found)."""

    name: str
    ok: bool
    message: str

    def __str__(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.message}"


class CheckFailed(AssertionError):  # noqa: N818 - reads as the verdict it carries
    """Raised inside a check with the reason the learner will read."""


@dataclass
class Exercise:
    """One graded exercise: the notebook function it grades (``function``), its points, and the checks the grader
    runs — ``visible`` with the notebook's own settings, ``hidden`` with others."""

    key: str
    title: str
    points: int
    function: str
    check: Callable[..., CheckResult]
    visible: dict[str, Any] = field(default_factory=dict)
    hidden: Sequence[dict[str, Any]] = ()


def run_check(name: str, body: Callable[[], str | None]) -> CheckResult:
    """Run ``body``; a ``CheckFailed`` becomes a FAIL with its message, any other exception a FAIL with the error."""
    try:
        return CheckResult(name, True, body() or "correct")
    except CheckFailed as exc:
        return CheckResult(name, False, str(exc))
    except NotImplementedError as exc:
        return CheckResult(name, False, f"not implemented yet ({exc})" if str(exc) else "not implemented yet")
    except Exception as exc:  # the learner's code may raise anything: report it
        last = traceback.extract_tb(exc.__traceback__)[-1]
        return CheckResult(name, False, f"raised {type(exc).__name__}: {exc} (at {last.name}, line {last.lineno})")


def expect_close(got: Any, expected: torch.Tensor, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Raise ``CheckFailed`` naming the first mismatching index unless ``got`` is a tensor close to ``expected``
    with the same shape and dtype (a list, a 0-d tensor or a tensor of another shape is rejected)."""
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
    if got.shape != expected.shape:
        raise CheckFailed(f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}")
    if got.dtype != expected.dtype:
        raise CheckFailed(f"{what}: expected dtype {expected.dtype}, got {got.dtype}")
    bad = ~torch.isclose(got, expected, rtol=rtol, atol=atol)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise CheckFailed(f"{what}: first difference at index {idx}: expected {expected[idx].item():.6g}, "
                          f"got {got[idx].item():.6g} ({int(bad.sum())} of {bad.numel()} elements differ)")


def expect_equal(got: Any, expected: Any, what: str) -> None:
    """Exact equality for plain values (ints, strings, lists of them), with a readable message."""
    if type(got) is not type(expected) and not (isinstance(got, int | float) and isinstance(expected, int | float)):
        raise CheckFailed(f"{what}: expected a {type(expected).__name__} ({expected!r}), got {type(got).__name__} "
                          f"({got!r})")
    if got != expected:
        raise CheckFailed(f"{what}: expected {expected!r}, got {got!r}")


def expect_number(got: Any, expected: float, what: str, rel: float = 1e-9) -> None:
    """A Python or numpy scalar (not a tensor, not a list) within ``rel`` of ``expected``."""
    if isinstance(got, torch.Tensor | list | tuple | bool) or not hasattr(got, "__float__"):
        raise CheckFailed(f"{what}: expected a plain number, got {type(got).__name__} ({got!r})")
    if abs(float(got) - expected) > rel * max(abs(expected), 1e-12):
        raise CheckFailed(f"{what}: expected {expected:.6g}, got {float(got):.6g}")


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Bound a single-process check (SIGALRM; main thread only) so an infinite loop fails instead of hanging."""
    def _expired(signum: int, frame: Any) -> None:
        raise CheckFailed(f"{what} did not finish within {seconds:g} s (an infinite loop, or a rank waiting?)")

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
