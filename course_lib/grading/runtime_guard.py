"""While a check runs, the library refuses to be called by the learner's code beyond what the exercise allows.

``guard(allowed, name)`` installs a profile function (``sys.setprofile``; ``threading.setprofile`` for threads
started meanwhile) for the duration of a check; ``for_ranks(target)`` wraps a launch target so that every rank
installs the same guard. On each call of library code (its file lies in a library's folder, or its code object
equals one of the library's: a copied ``__code__``) that ``allowed`` does not permit, it finds the nearest caller
that is not Python's or an installed package's (``functools.partial``, torch's ``Module.__call__``, code ``exec``
compiled from a string are looked through). When that caller is the learner's, the call raises ``LibraryRefused``
naming the function and what the exercise allows, before its first line runs. The library's own calls pass (the
check's, an allowed helper's), and so do autograd's (a backward the engine runs) and the grader's instruments (its
nested functions and methods). The first refusal is kept: the check scores 0 with it even when the answer catches
the exception; an answer that removes the guard (``sys.setprofile``) is refused too.

Its limits: code copied as text is the learner's own (reading the library is allowed); a library function the
answer hands back for the check to call runs as the check's; deliberate tampering with the grader inside the
kernel is ``course_lib.grading.isolation``'s stated limit.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from course_lib.grading.allowlist import (
    LEARNER_CODE,
    LIBRARY_CODE,
    Allowed,
    code_kind,
    library_codes,
    refusal_message,
)


class LibraryRefused(Exception):  # noqa: N818 - reads as the verdict it carries
    """The learner's code called the library's code that the exercise does not allow."""


@dataclass
class Guard:
    """One check's guard: what is allowed, the answer's name, and the first refusal (None while there is none)."""

    allowed: Allowed
    name: str
    refused: str | None = None


GRADER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_ACTIVE: Guard | None = None
_KINDS: dict[int, tuple[types.CodeType, str]] = {}
"""id(code) -> (code, kind): the code is kept so that its id is never reused while cached."""
_VERDICTS: dict[int, tuple[types.CodeType, bool]] = {}
"""id(code) -> (code, refusable) for the active guard."""


def _kind(code: types.CodeType) -> str:
    hit = _KINDS.get(id(code))
    if hit is None:
        kind = code_kind(code.co_filename)
        if kind == LEARNER_CODE and code in library_codes():
            kind = LIBRARY_CODE  # the library's code object, copied under another file name
        hit = _KINDS[id(code)] = (code, kind)
    return hit[1]


def _refusable(code: types.CodeType, guard: Guard) -> bool:
    hit = _VERDICTS.get(id(code))
    if hit is None:
        verdict = _kind(code) == LIBRARY_CODE and code.co_name != "<module>" and not _instrument(code) and \
            not guard.allowed.permits_code(code)  # importing a module runs its code: that is no call
        hit = _VERDICTS[id(code)] = (code, verdict)
    return hit[1]


def _instrument(code: types.CodeType) -> bool:
    """The checks' own instruments, which the learner's code calls through what a check hands it (a patched
    ``ProcessGroup`` method, a logged work handle): the grader's nested functions and methods. Its module-level
    functions (the checks' reference answers among them) stay refused."""
    return code.co_filename.startswith(GRADER_DIR) and "." in code.co_qualname


def _caller(frame: types.FrameType | None) -> types.FrameType | None:
    """The nearest frame from ``frame`` outwards whose code is the library's or the learner's; None when the call
    comes from autograd's engine (a backward hook, a ``Function.backward``: run by ``loss.backward()``, not called by
    whoever called it)."""
    while frame is not None and _kind(frame.f_code) not in (LIBRARY_CODE, LEARNER_CODE):
        if frame.f_code is _ENGINE:
            return None
        frame = frame.f_back
    return frame


def _refuse(guard: Guard, what: str) -> None:
    message = refusal_message(guard.name, [f"calls {what}"], guard.allowed)
    guard.refused = guard.refused or message
    raise LibraryRefused(message)


def _profile(frame: types.FrameType, event: str, arg: Any) -> None:
    guard = _ACTIVE
    if event == "call" and guard is not None:
        code = frame.f_code
        if code is _THREAD_SETPROFILE or _refusable(code, guard):
            caller = _caller(frame.f_back)
            if caller is not None and _kind(caller.f_code) == LEARNER_CODE:
                _refuse(guard, _describe(frame))
    elif event == "c_call" and arg is sys.setprofile and guard is not None:
        caller = _caller(frame)
        if caller is not None and _kind(caller.f_code) == LEARNER_CODE:
            _refuse(guard, "sys.setprofile (the grader's guard)")


_THREAD_SETPROFILE = threading.setprofile.__code__
_ENGINE = torch.autograd.graph._engine_run_backward.__code__


def _describe(frame: types.FrameType) -> str:
    """The library's dotted path of the function ``frame`` runs."""
    code = frame.f_code
    if code is _THREAD_SETPROFILE:
        return "threading.setprofile (the grader's guard)"
    return library_codes().get(code) or f"{frame.f_globals.get('__name__', '?')}.{code.co_qualname}"


@contextlib.contextmanager
def guard(allowed: Sequence[str], name: str) -> Iterator[Guard]:
    """Refuse, in this process and in the ranks ``for_ranks`` starts, every call of the library's code that
    ``allowed`` does not permit and that the learner's code makes; yields the ``Guard`` (its ``refused``). Inside
    another guard (a check that calls another check) the outer one stays in force."""
    global _ACTIVE
    if _ACTIVE is not None:
        yield _ACTIVE
        return
    state = Guard(Allowed(tuple(allowed)), name)
    before, before_threads = sys.getprofile(), threading.getprofile()
    _VERDICTS.clear()
    _ACTIVE = state
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    try:
        yield state
    finally:
        if state.refused is None and (sys.getprofile() is not _profile or _ACTIVE is not state):
            state.refused = refusal_message(name, ["removed the grader's guard"], state.allowed)
        sys.setprofile(before)
        threading.setprofile(before_threads)
        _ACTIVE = None
        _VERDICTS.clear()


def for_ranks(target: Callable[..., Any]) -> Callable[..., Any]:
    """``target`` as each rank should run it: under the active guard (``target`` itself when none is active)."""
    active = _ACTIVE
    if active is None:
        return target
    return functools.partial(_guarded_rank, active.allowed.paths, active.name, target)


def _guarded_rank(allowed: tuple[str, ...], name: str, target: Callable[..., Any], *args: Any,
                  **kwargs: Any) -> Any:
    with guard(allowed, name) as state:
        try:
            result = target(*args, **kwargs)
        except BaseException:
            if state.refused is None:
                raise
    if state.refused is not None:
        raise LibraryRefused(state.refused)
    return result


def refused_on_a_rank(message: str) -> None:
    """Record a refusal a rank reported, as the active guard's first (the check then scores 0 with it)."""
    if _ACTIVE is not None and _ACTIVE.refused is None:
        _ACTIVE.refused = message
