"""Chapter 05 — pipeline parallelism: two schedules, two steps on real ranks, and a bug to find in one of them.

1. ``one_f_one_b_order(p, m, rank)``: one rank's compute actions under 1F1B (Narayanan et al. 2021) as "F3" / "B3"
   strings, exact, for every rank of several (p, m), m < p included.
2. ``zb_h1_schedule(p, m)``: a ZB-H1 schedule (Qi et al. 2023) as ``course_lib.parallel.schedules`` data. Any
   schedule passes that ``validate`` accepts, has no B, and, simulated with F = I = W = 1, has ZB-H1's bubble
   (p-1)/(3m+p-1) with 1F1B's memory (at most min(p, m) micro-batches in flight per rank).
3. ``deep_pipeline_step(stage, x, y, m)``: one 1F1B training step on p real ranks (3 visible; 2 and 4 hidden,
   m < p included). Checked: every stage's gradients against one process's for the full-batch mean loss, the
   returned losses, and every rank's messages in order (peer, size, dtype; ``expected_messages``). Collectives
   are refused.
4. ``gpipe_step(stage, x, y, m)`` (find the bug): the same check on two ranks, in GPipe's order.
5. ``shape_that_hides_the_bug()``: a (batch, m), m >= 2, on which the colleague's step of 4 passes parity (the
   notebook then runs the colleague's step on it, ungraded, to show it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from course_lib.data import global_batch
from course_lib.estimates import cost
from course_lib.grading import core
from course_lib.grading.cases import each, several
from course_lib.grading.core import CheckFailed, CheckResult, Exercise, expect_close, guard_visible_checks, run_check
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel import pp_layers, pp_stages, schedules
from course_lib.parallel.schedule_run import simulate
from course_lib.parallel.schedules import validate

GRADER_PARAMETERS = {"seed": 1}
LAUNCH_TIMEOUT_S = 30.0
"""A launched check stops the ranks after this long (below the grader's 60 s per check)."""



class RefusedCollective(RuntimeError):  # noqa: N818 - reads as what happened
    """Raised on a rank when the learner's pipeline step calls a collective instead of send / recv."""


def check_one_f_one_b_order(fn: Callable, cases: tuple[tuple[int, int], ...] = ((4, 8), (4, 4), (5, 3), (2, 3))
                            ) -> CheckResult:
    """cases: (p, m): every rank's compute actions against ``schedules.one_f_one_b``; more, as many and fewer
    micro-batches than stages."""
    def body() -> str:
        for p, m in cases:
            for rank in range(p):
                expected = [f"{a.kind.value}{a.microbatch}" for a in schedules.one_f_one_b(p, m)[rank] if a.is_compute]
                got = fn(p, m, rank)
                if not isinstance(got, list) or not all(isinstance(a, str) for a in got):
                    raise CheckFailed(f"one_f_one_b_order({p}, {m}, {rank}) must return a list of strings, got "
                                      f"{got!r}")
                if got != expected:
                    i = next((i for i, (g, e) in enumerate(zip(got, expected, strict=False)) if g != e),
                             min(len(got), len(expected)))
                    raise CheckFailed(f"rank {rank} of p={p}, m={m}: first difference at position {i}: expected "
                                      f"{expected[i:i + 3]}..., got {got[i:i + 3]}... (expected {len(expected)} "
                                      f"actions, got {len(got)})")
        return f"every rank correct for (p, m) in {list(cases)}"
    return run_check("one_f_one_b_order", body)


def check_zb_h1_schedule(fn: Callable, cases: tuple[tuple[int, int], ...] = ((4, 8), (2, 2), (1, 2), (3, 5))
                         ) -> CheckResult:
    """For each (p, m) with m >= p: a valid schedule of I/W backwards with ZB-H1's bubble and 1F1B's memory."""
    def body() -> str:
        for p, m in cases:
            sched = fn(p, m)
            what = f"zb_h1_schedule(p={p}, m={m})"
            if not isinstance(sched, list) or not all(isinstance(r, list) for r in sched):
                raise CheckFailed(f"{what} must return a list of p lists of schedules.Action, got "
                                  f"{type(sched).__name__}")
            try:
                validate(sched, p, m)
            except schedules.ScheduleError as err:
                raise CheckFailed(f"{what} is not a valid schedule: {err}") from None
            kinds = {a.kind.value for rank in sched for a in rank}
            if "B" in kinds or not {"I", "W"} <= kinds:
                raise CheckFailed(f"{what}: ZB-H1 splits every backward into I (input gradient) and W (weight "
                                  f"gradient); the schedule uses {sorted(kinds)}")
            sim = simulate(sched)  # F = I = W = 1
            formula = cost.bubble_fraction("zb_h1", p, m)
            if abs(sim.bubble_fraction - formula) > 1e-9:
                one = cost.bubble_fraction("one_f_one_b", p, m)
                hint = " (1F1B's: the W's are not filling the drain)" if abs(sim.bubble_fraction - one) < 1e-9 else ""
                raise CheckFailed(f"{what}: simulated bubble fraction {sim.bubble_fraction:.4f}{hint}; ZB-H1's is "
                                  f"(p-1)/(3m+p-1) = {formula:.4f}")
            limit = min(p, m)
            if max(sim.peak_in_flight) > limit:
                raise CheckFailed(f"{what}: peak micro-batches in flight per rank {sim.peak_in_flight} (held from F "
                                  f"to W); ZB-H1 keeps 1F1B's memory, at most min(p, m) = {limit}")
        return f"{len(cases)} cases: valid, bubble (p-1)/(3m+p-1), at most min(p, m) in flight"
    return run_check("zb_h1_schedule", body)


# ----------------------------------------------------------------------------------------------------------------
# Pipeline steps on real ranks

_CFG = GPTConfig(n_layer=4, d_model=16, n_head=2, seq_len=8, bias=False)
"""Four blocks: up to four stages of at least one block each."""


def _p2p_log(log: list[tuple[str, int, str, int]]) -> contextlib.AbstractContextManager[None]:
    """Record (send|recv, bytes, dtype, peer rank) of every point-to-point message; refuse every collective."""
    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        if name not in core.PG_POINT_TO_POINT:
            return core.refusal(RefusedCollective, "a pipeline stage only talks to its neighbours with point-to-point "
                                "messages (dist.isend / dist.irecv); it called a collective")

        def logged(self: Any, tensors: list[torch.Tensor], peer: int, *args: Any, **kwargs: Any) -> Any:
            for t in tensors:
                log.append((name, t.numel() * t.element_size(), str(t.dtype).removeprefix("torch."), peer))
            return original(self, tensors, peer, *args, **kwargs)
        return logged
    return core.patch_process_group((*core.PG_POINT_TO_POINT, *core.PG_COLLECTIVES), wrap)


def _stage(rank: int, p: int, seed: int) -> pp_stages.Stage:
    """Stage ``rank`` of ``p``, the first stages one block longer where p does not divide the blocks (3: 2, 1, 1)."""
    split = [_CFG.n_layer // p + (i < _CFG.n_layer % p) for i in range(p)]
    layers = pp_layers.stage_layers(pp_layers.layer_split(_CFG.n_layer, p, split))
    return pp_stages.Stage(GPT(_CFG, seed=seed), rank, p, layers[rank])


def _pipeline_on_rank(rank: int, world_size: int, fn: Callable[..., Any], m: int, batch: int,
                      seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    stage = _stage(rank, world_size, seed)
    x, y = global_batch(seed, batch, _CFG.seq_len, seed)
    log: list[tuple[str, int, str, int]] = []
    with _p2p_log(log):
        losses = fn(stage, x, y, m)
    grads = {n: (q.grad.detach().clone() if q.grad is not None else None) for n, q in stage.named_parameters()}
    return {"losses": losses, "grads": grads, "log": log}


_launch = functools.partial(
    core.launch_check, hang_hint=": a receive with no matching send (rank r receives from r-1 and sends to r+1 at "
    "F, receives from r+1 and sends to r-1 at B), a message of another shape, or two neighbours each blocked in a "
    "send to the other (gloo's dist.send returns only once the peer has posted the matching receive: use dist.isend "
    "and wait for the sends at the end)?", guard_errors=("RefusedCollective",))


def expected_messages(schedule: schedules.Schedule, p: int, rank: int) -> list[tuple[str, int]]:
    """(send|recv, peer) of rank ``rank``'s messages, in the order of its compute actions: at F it receives the
    activation from rank - 1 (none on the first) and sends its output to rank + 1 (none on the last); at B it
    receives the output's gradient from rank + 1 (none on the last) and sends its input's gradient to rank - 1."""
    out: list[tuple[str, int]] = []
    for a in (a for a in schedule[rank] if a.is_compute):
        before, after = (rank - 1, rank + 1) if a.kind is schedules.Kind.F else (rank + 1, rank - 1)
        out += [("recv", before)] if 0 <= before < p else []
        out += [("send", after)] if 0 <= after < p else []
    return out


def _step_case(fn: Callable[..., Any], schedule: Callable[[int, int], schedules.Schedule], label: str, p: int, m: int,
               batch: int, seed: int, timeout: float) -> str:
    if batch % m:
        raise ValueError(f"the check needs batch ({batch}) divisible by m ({m})")
    results = _launch(_pipeline_on_rank, p, fn, m, batch, seed, timeout=timeout)
    x, y = global_batch(seed, batch, _CFG.seq_len, seed)
    ref = GPT(_CFG, seed=seed)
    lm_loss(ref(x), y).backward()
    ref_grads = {n: q.grad for n, q in ref.named_parameters()}
    micro = [lm_loss(ref(xj), yj).item() for xj, yj in zip(x.chunk(m), y.chunk(m), strict=True)]
    nbytes = (batch // m) * _CFG.seq_len * _CFG.d_model * 4
    sched = schedule(p, m)
    for r, res in enumerate(results):
        expected = expected_messages(sched, p, r)
        got = [(op, peer) for op, _, _, peer in res["log"]]
        if got != expected:
            i = next((i for i, (g, e) in enumerate(zip(got, expected, strict=False)) if g != e),
                     min(len(got), len(expected)))
            order = [str(a) for a in sched[r] if a.is_compute]
            raise CheckFailed(f"rank {r} of {p}: its messages (op, peer) in order were {got}; {label}'s actions "
                              f"{order} give {expected}; first difference at message {i}")
        for op, size, dtype, _ in res["log"]:
            if size != nbytes or dtype != "float32":
                raise CheckFailed(f"rank {r}: a {op} of {size:,} bytes ({dtype}); every message is one float32 "
                                  f"[b, s, h] = [{batch // m}, {_CFG.seq_len}, {_CFG.d_model}] tensor, "
                                  f"{nbytes:,} bytes")
        for pname, g in res["grads"].items():
            if g is None:
                raise CheckFailed(f"rank {r}: {pname}.grad is None after the step")
            expect_close(g, ref_grads[pname], f"rank {r}'s gradient of {pname} (p={p}, m={m}, batch={batch}; "
                         "the gradient of the full-batch mean loss)", rtol=1e-4, atol=1e-6)
    for r, res in enumerate(results[:-1]):
        if res["losses"] != []:
            raise CheckFailed(f"rank {r} must return [] (the losses live on the last stage), got "
                              f"{res['losses']!r}")
    last = results[-1]["losses"]
    if not isinstance(last, list) or not all(type(v) is float for v in last) or len(last) != m:
        raise CheckFailed(f"rank {p - 1} (the last) must return a list of {m} Python floats (each micro-batch's "
                          f"unscaled mean loss, loss.item()), got {last!r}")
    for j, (got_loss, want) in enumerate(zip(last, micro, strict=True)):
        if abs(got_loss - want) > 1e-5 * max(1.0, abs(want)):
            raise CheckFailed(f"rank {p - 1}'s loss of micro-batch {j}: expected {want:.6f} (unscaled), got "
                              f"{got_loss:.6f}")
    sent = sum(op == "send" for r in range(p) for op, _ in expected_messages(sched, p, r))
    return (f"p={p}, m={m}, batch={batch}: gradients of every stage right, {sent} messages of {nbytes:,} B in "
            f"{label} order")


def _check_step(name: str, fn: Callable[..., Any], schedule: Callable[[int, int], schedules.Schedule], label: str,
                cases: tuple[tuple[int, int, int], ...], seed: int, timeout: float) -> CheckResult:
    """For each (p, m, batch) of ``cases``: p ranks run ``fn(stage, x, y, m)``; the gradients of every stage must be
    those of ``lm_loss`` on the full batch in one process; the last rank returns the m unscaled micro-batch losses
    (Python floats), the others []; every message is float32 [b, s, h]; each rank's messages are
    ``expected_messages(schedule(p, m), p, rank)``."""
    return run_check(name, lambda: "; ".join(_step_case(fn, schedule, label, *case, seed, timeout) for case in cases))


DEEP_CASES = ((3, 4, 8), (4, 2, 8), (2, 4, 8))
"""The visible check's (p, m, batch): a middle rank; fewer micro-batches than stages; two stages."""


def check_deep_pipeline_step(fn: Callable[..., Any], cases: tuple[tuple[int, int, int], ...] = DEEP_CASES,
                             seed: int = 0, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (p, m, batch). ``fn(stage, x, y, m)`` on p ranks in 1F1B's order: full-batch gradients, float32
    [b, s, h] messages to and from both neighbours, unscaled losses on the last rank."""
    return _check_step("deep_pipeline_step", fn, schedules.one_f_one_b, "1F1B", cases, seed, timeout)


def check_gpipe_step(fn: Callable[..., Any], m: int = 4, batch: int = 8, seed: int = 0,
                     timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """Two ranks in GPipe's order (all m forwards, then all m backwards), checked as ``check_deep_pipeline_step``."""
    return _check_step("gpipe_step", fn, schedules.gpipe, "GPipe", ((2, m, batch),), seed, timeout)


def check_shape_that_hides_the_bug(fn: Callable[[], tuple[int, int]]) -> CheckResult:
    """``fn()`` = (batch, m), ints, m >= 2, m divides batch, on which the colleague's step passes its check."""
    def body() -> str:
        got = fn()
        if not (isinstance(got, tuple) and len(got) == 2 and all(type(v) is int for v in got)):
            raise CheckFailed(f"shape_that_hides_the_bug() must return a pair of ints (batch, m), got {got!r}")
        batch, m = got
        if m < 2 or batch < 1 or batch % m:
            raise CheckFailed(f"(batch, m) = {got}: need m >= 2 micro-batches and m dividing batch")
        b = batch // m
        if b != m:
            raise CheckFailed(f"(batch, m) = {got}: b = batch / m = {b} rows per micro-batch; the colleague's "
                              f"gradients are then {m}/{b} = {m / b:.3g} x one process's, and parity catches that")
        return f"(batch, m) = {got}: b = m = {m}, the colleague's factor m / b is 1"
    return run_check("shape_that_hides_the_bug", body)


def check_colleague_on_shape(colleague: Callable[..., Any], shape_fn: Callable[[], tuple[int, int]],
                            seed: int = 0) -> CheckResult:
    """The colleague's GPipe step run on two ranks on the learner's ``shape_fn()`` = (batch, m): a demonstration
    (not graded) that the shape hides the bug; "not implemented yet" until ``shape_fn`` is written."""
    def body() -> str:
        batch, m = shape_fn()
        result = check_gpipe_step(colleague, m=m, batch=batch, seed=seed)
        if not result.ok:
            raise CheckFailed(f"the colleague's step on (batch, m) = ({batch}, {m}) is caught: {result.message}")
        return f"the colleague's step passes on (batch, m) = ({batch}, {m}): {result.message}"
    return run_check("the colleague's step on your shape", body)


SCHEDULE_DATA = ("course_lib.parallel.schedules.Action", "course_lib.parallel.schedules.Kind")
"""A schedule as the library's data: its actions and their kinds."""
STAGE_STEP = ("course_lib.comm", "course_lib.model.lm_loss", "course_lib.parallel.pp_stages.Stage", *SCHEDULE_DATA)
"""What a training step on pipeline stages is given: the comm layer, the loss, the stages, the schedule's data."""

EXERCISES = [
    Exercise("one_f_one_b_order", "1F1B action list for one rank", 3, "one_f_one_b_order", check_one_f_one_b_order,
             hidden=[{"cases": ((2, 2), (3, 7), (6, 6), (5, 2))}]),
    Exercise("zb_h1_schedule", "A ZB-H1 schedule, validated by the simulator", 4, "zb_h1_schedule",
             check_zb_h1_schedule, hidden=[{"cases": ((1, 1), (2, 5), (3, 3), (3, 7), (5, 10), (8, 16))}],
             allowed=SCHEDULE_DATA),
    Exercise("deep_pipeline_step", "One 1F1B step on p real ranks: the middle ranks", 5, "deep_pipeline_step",
             check_deep_pipeline_step,
             hidden=[{"cases": ((4, 2, 6),), "seed": 1}, {"cases": ((2, 3, 6),), "seed": 3},
                     {"cases": ((3, 6, 12),), "seed": 4}],
             allowed=(*STAGE_STEP, "course_lib.parallel.schedules.one_f_one_b")),
    Exercise("gpipe_step", "Find the bug: a GPipe step on two real ranks", 4, "gpipe_step", check_gpipe_step,
             hidden=[{"m": 2, "batch": 6, "seed": 1}, {"m": 8, "batch": 16, "seed": 2},
                     {"m": 4, "batch": 12, "seed": 3}, {"m": 3, "batch": 6, "seed": 4}],
             allowed=STAGE_STEP),
    Exercise("shape_that_hides_the_bug", "Predict: the shape where the colleague's bug passes", 2,
             "shape_that_hides_the_bug", check_shape_that_hides_the_bug),
]

def _micro_batches(p: int, m: int) -> str:
    return "fewer micro-batches than stages" if m < p else "as many micro-batches as stages" if m == p else \
        "more micro-batches than stages"


CASE_CLASSES = {
    "one_f_one_b_order": lambda calls: {_micro_batches(p, m) for p, m in each(calls)}
    | {"two stages" if p == 2 else "more than two stages" for p, _ in each(calls)},
    "zb_h1_schedule": lambda calls: {"one stage" if p == 1 else _micro_batches(p, m) for p, m in each(calls)}
    | {"an odd number of stages" for p, _ in each(calls) if p % 2 and p > 1},
    "deep_pipeline_step": lambda calls: {_micro_batches(p, m) for p, m, _ in each(calls)}
    | {"two stages" if p == 2 else "a middle stage" for p, _, _ in each(calls)}
    | several((p for p, _, _ in each(calls)), "pipeline depths"),
    "gpipe_step": lambda calls: {"several micro-batches, b != m (the bug shows)" for c in calls
                                 if c["m"] > 1 and c["batch"] != c["m"] ** 2},
    "shape_that_hides_the_bug": lambda calls: {"a shape predicted"},
}

guard_visible_checks(globals(), EXERCISES)
