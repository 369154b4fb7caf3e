"""What every check is made of: a result with a reason, exercises with points, and precise comparisons.

A check never just says "wrong": it names the first difference it found (which rank, which tensor, which index,
expected vs got), so a learner can act on it. ``launch_check`` does the same for a learner's function run on ranks:
a rank's exception or a hang becomes a failure that says which rank, what it raised and where; on the ranks,
``patch_process_group`` and ``refusal`` let a check count the learner's communication and refuse what the exercise
must not use. Every check runs under its exercise's allow-list (``Exercise.allowed``: ``allowlist`` before it runs,
``runtime_guard`` while it runs, on the ranks too).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import signal
import traceback
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from course_lib.grading import runtime_guard
from course_lib.grading.allowlist import Allowed, static_refusal
from course_lib.runtime.launch import RankError, RankTimeout, launch


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
    runs — ``visible`` with the notebook's own settings, ``hidden`` with others. ``allowed``: the ``course_lib``
    objects (dotted paths of modules, classes, functions, methods) the answer may use; any other object of the
    library that it reaches scores 0 with the reason (``course_lib.grading.allowlist``). ``check`` is the check run
    under that allow-list (the chapter's function is kept as ``check.unguarded``)."""

    key: str
    title: str
    points: int
    function: str
    check: Callable[..., CheckResult]
    visible: dict[str, Any] = field(default_factory=dict)
    hidden: Sequence[dict[str, Any]] = ()
    allowed: Sequence[str] = ()

    def __post_init__(self) -> None:
        self.check = self._guarded(getattr(self.check, "unguarded", self.check))  # dataclasses.replace re-guards

    def refusal(self, answer: Any) -> CheckResult | None:
        """A FAIL saying why, when ``answer``'s code reaches a library object the exercise does not allow; None
        when it reaches none."""
        why = static_refusal(answer, Allowed(tuple(self.allowed)), f"`{self.function}`")
        return CheckResult(self.key, False, why) if why else None

    def _guarded(self, check: Callable[..., CheckResult]) -> Callable[..., CheckResult]:
        @functools.wraps(check)
        def guarded(answer: Any, *args: Any, **kwargs: Any) -> CheckResult:
            refused = self.refusal(answer)
            if refused:
                return refused
            with runtime_guard.guard(self.allowed, f"`{self.function}`") as state:
                try:
                    result = check(answer, *args, **kwargs)
                except Exception:  # what a refusal broke: the refusal is the reason
                    if state.refused is None:
                        raise
            return CheckResult(self.key, False, state.refused) if state.refused else result
        guarded.unguarded = check  # type: ignore[attr-defined]
        return guarded


def guard_visible_checks(namespace: dict[str, Any], exercises: Sequence[Exercise]) -> None:
    """Bind each ``check_<name>`` a notebook calls (in the chapter module's ``namespace``) to its exercise's
    guarded check, so the self-check refuses what the grader refuses. Two exercises sharing one check function:
    the one whose ``function`` is the answer's name."""
    shared: dict[str, list[Exercise]] = {}
    for ex in exercises:
        shared.setdefault(ex.check.__name__, []).append(ex)
    for name, owners in shared.items():
        @functools.wraps(owners[0].check)
        def visible(answer: Any, *args: Any, _owners: list[Exercise] = owners, **kwargs: Any) -> CheckResult:
            ex = next((e for e in _owners if e.function == getattr(answer, "__name__", None)), _owners[0])
            return ex.check(answer, *args, **kwargs)
        namespace[name] = visible


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


def expect_int(got: Any, expected: int, what: str) -> None:
    """A Python ``int`` (not a float, even a whole one; not a bool, a tensor or a numpy scalar) equal to
    ``expected``: where a specification says integers (bytes, counts), ``8.0`` is a different answer."""
    if type(got) is not int:
        raise CheckFailed(f"{what}: expected the Python int {expected!r}, got {type(got).__name__} ({got!r}); the "
                          "specification asks for an integer (use // for an exact division)")
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


# ----------------------------------------------------------------------------------------------------------------
# Checks that run the learner's function on ranks


PG_POINT_TO_POINT = ("send", "recv")
"""``torch.distributed.ProcessGroup`` methods that ``dist.send`` / ``isend`` / ``recv`` / ``irecv`` end in."""
PG_COLLECTIVES = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
                  "all_gather_single", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single", "gather",
                  "scatter", "alltoall", "alltoall_base", "all_to_all_single", "barrier")
"""``torch.distributed.ProcessGroup`` methods of the collectives (their names vary between torch versions; a
method this torch lacks is skipped by ``patch_process_group``)."""


@contextlib.contextmanager
def patch_process_group(names: Iterable[str],
                        wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """On a rank, for the duration: each ``torch.distributed.ProcessGroup`` method of ``names`` that this torch
    has is replaced by ``wrap(name, original)`` (a wrapper that counts and calls ``original``, or a ``refusal``);
    the originals are put back on exit (as the class held them: a method, so that a later call binds ``self``).
    Every ``dist.*`` call, ``course_lib.comm``'s included, ends in them."""
    pg = dist.ProcessGroup
    saved = {name: inspect.getattr_static(pg, name) for name in names if hasattr(pg, name)}
    for name in saved:
        setattr(pg, name, wrap(name, getattr(pg, name)))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(pg, name, method)


class LoggedWork:
    """An async handle that calls ``on_wait()`` when waited on, then waits on the real one: lets a check see *when*
    the learner waits (inside backward? before computing?)."""

    def __init__(self, work: Any, on_wait: Callable[[], None]) -> None:
        self._work, self._on_wait = work, on_wait

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._on_wait()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def refusal(error: type[Exception], message: str) -> Callable[..., Any]:
    """A ``ProcessGroup`` method that raises ``error(message)`` however it is called (list the class name in
    ``launch_check``'s ``guard_errors`` so that the learner reads ``message`` as it is)."""
    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise error(message)
    return refused


def rank_location(traceback_text: str) -> str:
    """' (at fn, line 12)' for the innermost frame of a rank's traceback; '' when it has none."""
    frames = [ln.strip() for ln in traceback_text.splitlines() if ln.strip().startswith("File ")]
    if not frames:
        return ""
    parts = [p.strip() for p in frames[-1].split(",")]  # File "...", line 12, in fn
    return f" (at {parts[-1].removeprefix('in ')}, {parts[1]})" if len(parts) >= 3 else ""


def waiting_location(stack: str, course_files: Sequence[str]) -> str:
    """'in recv, called from my_fn line 9' from a faulthandler stack (most recent call first): the innermost call,
    and the innermost frame outside torch and ``course_files`` (paths the course's own frames end with), which is
    the learner's; '' when the stack has no frames."""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', stack)
    if not frames:
        return ""
    inner = frames[0][2]
    mine = next(((f, ln, fn) for f, ln, fn in frames
                 if "/torch/" not in f and not f.endswith(tuple(course_files))), None)
    return f"in {inner}" + (f", called from {mine[2]} line {mine[1]}" if mine and mine[2] != inner else "")


def launch_check(target: Callable[..., Any], world_size: int, *args: Any, timeout: float, hang_hint: str,
                 course_files: Sequence[str] | None = None, guard_errors: Collection[str] = ()) -> list[Any]:
    """``course_lib.runtime.launch.launch(target, world_size, *args, timeout=timeout)``: what each rank returned, in
    rank order; a rank's exception or a hang becomes what a check reports.

    * A hang (``RankTimeout``): ``CheckFailed`` "ranks [..] of N did not finish within T s and were stopped",
      then ``hang_hint`` verbatim (the chapter's likely causes, with its leading punctuation), then, unless
      ``course_files`` is None, where the first unfinished rank was waiting (``waiting_location``).
    * ``NotImplementedError`` on a rank: re-raised here with its message (``run_check`` says "not implemented
      yet").
    * ``runtime_guard.LibraryRefused`` on a rank (the learner called the library's code the exercise does not
      allow): recorded as the check's refusal, and ``CheckFailed`` "rank r: <message>".
    * An exception whose class name is in ``guard_errors`` (the chapter's own guard, e.g. a refused collective,
      whose message already explains): ``CheckFailed`` "rank r: <message>".
    * Any other: ``CheckFailed`` "rank r of N raised <type>: <message> (at fn, line L)".
    """
    try:
        return launch(runtime_guard.for_ranks(target), world_size, *args, timeout=timeout)
    except RankTimeout as err:
        where = ""
        if course_files is not None:
            r = err.ranks[0]
            where = waiting_location(err.stacks.get(r, ""), course_files)
            where = f"; rank {r} was waiting {where}" if where else ""
        raise CheckFailed(f"ranks {err.ranks} of {world_size} did not finish within {timeout:g} s and were stopped"
                          f"{hang_hint}{where}") from None
    except RankError as err:
        message = str(err.original) if err.original is not None else str(err).split("\n")[0]
        if err.exc_type == "NotImplementedError":
            raise NotImplementedError(message) from None
        if err.exc_type == runtime_guard.LibraryRefused.__name__:
            runtime_guard.refused_on_a_rank(f"rank {err.rank}: {message}")
            raise CheckFailed(f"rank {err.rank}: {message}") from None
        if err.exc_type in guard_errors:
            raise CheckFailed(f"rank {err.rank}: {message}") from None
        raise CheckFailed(f"rank {err.rank} of {world_size} raised {err.exc_type}: {message}"
                          f"{rank_location(err.remote_traceback)}") from None
