"""Chapter 11 — debugging distributed runs: the collective-sequence comparison, triage of hidden broken runs, and a
bug to find from its symptom.

1. ``first_desync(calls, finished)``: the tool the chapter's flight recorder needs, for any mesh: each rank's calls
   as plain dicts; compare group by group, position by position; name the first disagreement (by start time) and
   its culprits (majority; a tie broken by the other groups of the same axis; a rank that finished without the call;
   else every member). Checked against ``course_lib.debug.desync`` on traces of dp x tp meshes, uneven finishes,
   late ranks, calls interleaved across groups in another order on some ranks, call-site swaps, two desyncs.
2. ``diagnose(suspect)``: a broken run of the clinic the chapter never ran (other ranks, steps, meshes, scalings),
   as a ``clinic.Case`` without its answer: return a ``clinic.Diagnosis`` (bug class, the ranks whose code or state
   is wrong, the first step it shows, the collective / parameter / module) and a fix (``{part: replacement}``, at
   most as many parts as are broken). The diagnosis must equal the injected bug's; the fix is run and must restore
   parity with one process (a bf16 run's difference is noise: "no bug", no fix). Wrong answers get the reason
   (the victim named instead of the culprit, noise called a bug, a step off by one, the wrong part replaced).
3. ``train_clipped(rank, world_size, steps, seed)`` (find the bug): a colleague's data-parallel loop with gradient
   clipping; replicas agree, the loss leaves one process's (clipped on the local gradients, before the
   all-reduce). Fixed: parity with the single-process clipped run on 4 ranks (2 and another seed hidden), replicas
   equal bit for bit, no more communication than the colleague's loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from course_lib import comm
from course_lib.data import global_batch
from course_lib.debug import clinic
from course_lib.debug.desync import first_desync as library_desync
from course_lib.debug.recorder import Entry, Trace
from course_lib.grading.cases import each
from course_lib.grading.core import CheckFailed, CheckResult, Exercise, guard_visible_checks, launch_check, run_check
from course_lib.model import GPT, lm_loss
from course_lib.train import TrainResult, compare, with_fp32_noise

GRADER_PARAMETERS = {"seed": 1}
LAUNCH_TIMEOUT_S = 40.0

# ------------------------------------------------------------------------------ 1. the sequence comparison

SITE = "train.py:10 step"


def call(n: int, op: str, ranks: Sequence[int], group: str = "tp", shape: tuple[int, ...] = (4,), site: str = SITE,
         t: float | None = None, returned: bool = True) -> dict[str, Any]:
    """One call as the exercise gives it: the ``n``-th on its group, started at ``t``."""
    return {"group": group, "ranks": list(ranks), "n": n, "op": op, "shapes": [list(shape)], "dtype": "float32",
            "site": site, "t": float(n) if t is None else t, "returned": returned}


def as_traces(calls: dict[int, list[dict[str, Any]]], finished: set[int]) -> list[Trace]:
    """The library's traces of the exercise's plain calls (what the reference answer is computed from)."""
    def entry(i: int, c: dict[str, Any]) -> Entry:
        file, _, rest = c["site"].partition(":")
        line, _, func = rest.partition(" ")
        return Entry(i, c["n"], c["op"], c["group"], tuple(c["ranks"]), tuple(tuple(s) for s in c["shapes"]),
                     c["dtype"], None, None, ((file, int(line), func),), c["t"], 1.0 if c["returned"] else None)
    return [Trace(r, [entry(i, c) for i, c in enumerate(cs)], finished=r in finished) for r, cs in calls.items()]


def _extra_gather() -> tuple[dict, set]:
    """dp = 2 x tp = 2: rank 0 calls an all_gather on tp where both tp groups call an all_reduce."""
    calls = {r: [call(1, "all_reduce", (2 * (r // 2), 2 * (r // 2) + 1))] for r in range(4)}
    calls[0].append(call(2, "all_gather", (0, 1), site="snap.py:3 after_step", returned=False))
    calls[1].append(call(2, "all_reduce", (0, 1), returned=False))
    for r in (2, 3):
        calls[r] += [call(2, "all_reduce", (2, 3)), call(1, "all_reduce", (r - 2, r), group="dp", t=3.0,
                                                          returned=False)]
    return calls, set()


def _interleaved() -> tuple[dict, set]:
    """Ranks 2 and 3 call their dp all-reduce before their tp one (legal: groups are independent), then rank 3
    calls a broadcast on dp where rank 1 calls an all-reduce."""
    calls = {}
    for r in range(4):
        tp = (2 * (r // 2), 2 * (r // 2) + 1)
        dp = (r % 2, r % 2 + 2)
        mine = [call(1, "all_reduce", tp, t=1.0), call(1, "all_reduce", dp, group="dp", t=2.0)]
        calls[r] = mine[::-1] if r >= 2 else mine
        calls[r].append(call(2, "broadcast" if r == 3 else "all_reduce", dp, group="dp", t=5.0, returned=r % 2 == 0))
    return calls, set()


def _two_desyncs() -> tuple[dict, set]:
    """Two groups disagree; the one listed second started first."""
    calls = {0: [call(1, "all_reduce", (0, 1), group="a", t=9.0), call(1, "all_reduce", (0, 2), group="b", t=1.0)],
             1: [call(1, "broadcast", (0, 1), group="a", t=9.0)],
             2: [call(1, "all_gather", (0, 2), group="b", t=1.0)]}
    return calls, set()


def _finished_and_late() -> tuple[dict, set]:
    """pp pair (2, 3): rank 3 returned after one call where rank 2 made a second (the culprit: the tie is broken by
    the rank that finished); tp pair (0, 1): rank 1 is one call behind but still running (late, no desync), from
    before the pp pair's second call started."""
    calls = {r: [call(n, "all_reduce", (0, 1), t=float(n)) for n in range(1, 4 - r)] for r in (0, 1)}
    calls[1][-1]["returned"] = False
    calls[2] = [call(1, "send_recv", (2, 3), group="pp", t=1.5), call(2, "send_recv", (2, 3), group="pp", t=3.5,
                                                                         returned=False)]
    calls[3] = [call(1, "send_recv", (2, 3), group="pp", t=1.5)]
    return calls, {3}


def _shape_tie_first() -> tuple[dict, set]:
    """dp x tp, ranks 1 and 3 ordering their dp call before their tp call; two desyncs: a shape on the dp pair
    (0, 2) (broken by the other dp pair) and, started earlier but listed later, a shape tie on an ep pair alone."""
    calls = {}
    for r in range(4):
        tp, dp = (2 * (r // 2), 2 * (r // 2) + 1), (r % 2, r % 2 + 2)
        mine = [call(1, "all_reduce", tp, t=1.0), call(1, "all_reduce", dp, group="dp", t=2.0)]
        calls[r] = (mine[::-1] if r % 2 else mine) + [
            call(2, "all_reduce", dp, group="dp", shape=(8,) if r == 2 else (4,), t=4.0, returned=False)]
    calls[1].append(call(1, "all_to_all", (1, 3), group="ep", shape=(2, 6), t=3.0, returned=False))
    calls[3].append(call(1, "all_to_all", (1, 3), group="ep", shape=(6, 2), t=3.0, returned=False))
    return calls, set()


SCENARIOS: dict[str, Callable[[], tuple[dict, set]]] = {
    "agree": lambda: ({r: [call(1, "all_reduce", (0, 1)), call(2, "broadcast", (0, 1))] for r in range(2)}, set()),
    "extra_gather": _extra_gather,
    "call_site": lambda: ({r: [call(1, "all_reduce", (0, 1, 2), site="b.py:2 g" if r == 1 else "a.py:1 f")]
                           for r in range(3)}, set()),
    "uneven": lambda: ({0: [call(1, "all_reduce", (0, 1)), call(2, "all_reduce", (0, 1), returned=False)],
                        1: [call(1, "all_reduce", (0, 1))]}, {1}),
    "late": lambda: ({0: [call(1, "all_reduce", (0, 1)), call(2, "all_reduce", (0, 1), returned=False)],
                      1: [call(1, "all_reduce", (0, 1))]}, set()),
    "interleaved": _interleaved,
    "two_desyncs": _two_desyncs,
    "shape_tie": lambda: ({0: [call(1, "all_reduce", (0, 1), shape=(4,))],
                           1: [call(1, "all_reduce", (0, 1), shape=(8,))]}, set()),
    "finished_and_late": _finished_and_late,
    "shape_tie_first": _shape_tie_first,
}
"""Traces the check compares answers on (the chapter's cases and the ones a mesh adds)."""

SCENARIO_CLASSES = {
    "agree": {"no desync"},
    "extra_gather": {"an op mismatch", "a tie broken by the other groups of the axis", "several groups of a label"},
    "call_site": {"a call-site mismatch", "a strict majority"},
    "uneven": {"a rank that finished without the call", "a tie broken by the rank that finished"},
    "late": {"a late rank (no desync)"},
    "interleaved": {"groups called in another order on some ranks", "an op mismatch",
                    "a tie broken by the other groups of the axis", "several groups of a label"},
    "two_desyncs": {"two desyncs: the first by start time, not by listing", "an op mismatch",
                    "a tie left unbroken: every member"},
    "shape_tie": {"a shape mismatch", "a tie left unbroken: every member"},
    "finished_and_late": {"a rank that finished without the call", "a tie broken by the rank that finished",
                          "a late rank (no desync)"},
    "shape_tie_first": {"groups called in another order on some ranks", "a shape mismatch",
                        "two desyncs: the first by start time, not by listing", "a tie left unbroken: every member",
                        "several groups of a label"},
}
"""What each scenario exercises: what differs, how the culprits are decided, what must not count as a desync."""


def expected_desync(calls: dict[int, list[dict[str, Any]]], finished: set[int]) -> dict[str, Any] | None:
    d = library_desync(as_traces(calls, finished))
    return None if d is None else {"group": d.group, "ranks": list(d.ranks), "n": d.position,
                                   "culprits": list(d.culprits)}


def _why(name: str, got: Any, want: dict[str, Any] | None) -> str:
    if want is None and got is None:
        return ""
    late = "a rank that has not reached a call and has not finished is late, not wrong"
    if want is None:
        hint = {"late": late,
                "interleaved": "compare each group on its own: ranks may order calls on different groups differently",
                }.get(name, "every group's calls agree")
        return f"scenario {name!r}: expected None (no desync), got {got!r}: {hint}"
    if got is None:
        return (f"scenario {name!r}: you found no desync, but call #{want['n']} of group {want['group']} "
                f"{want['ranks']} differs between its members (compare op, shapes, dtype and the calling line)")
    if not isinstance(got, dict) or set(got) != {"group", "ranks", "n", "culprits"}:
        return (f"scenario {name!r}: return None or a dict with keys group, ranks, n, culprits; got {got!r:.120}")
    for key in ("group", "ranks", "n"):
        if got[key] != want[key]:
            hint = late if "a late rank (no desync)" in SCENARIO_CLASSES.get(name, ()) else \
                "the first by start time, each group on its own"
            return (f"scenario {name!r}: the first desync is call #{want['n']} of group {want['group']} "
                    f"{want['ranks']}; you found {key} = {got[key]!r} ({hint})")
    culprits = sorted(got["culprits"]) if isinstance(got["culprits"], list | tuple) else got["culprits"]
    if culprits != want["culprits"]:
        members = set(want["ranks"])
        if isinstance(culprits, list) and set(culprits) == members - set(want["culprits"]):
            return (f"scenario {name!r}: you named the rank(s) {culprits} that called what the others expect (the "
                    f"victims); the culprit is the odd one out: {want['culprits']}")
        if isinstance(culprits, list) and set(culprits) == members:
            return (f"scenario {name!r}: you named every member; here the tie is broken (by the other groups of "
                    f"the same axis at the same position, or by a rank that returned without the call)")
        return f"scenario {name!r}: culprits {want['culprits']}, got {got['culprits']!r}"
    return ""


def check_first_desync(fn: Callable, scenarios: Sequence[str] = ("agree", "extra_gather", "call_site",
                                                                 "finished_and_late", "shape_tie_first")
                       ) -> CheckResult:
    def body() -> str:
        for name in scenarios:
            calls, finished = SCENARIOS[name]()
            want = expected_desync(calls, finished)
            got = fn({r: [dict(c) for c in cs] for r, cs in calls.items()}, set(finished))
            if isinstance(got, dict) and "culprits" in got:
                got = dict(got, ranks=list(got.get("ranks", [])))
            why = _why(name, got, want)
            if why:
                raise CheckFailed(why)
        return f"{len(scenarios)} scenarios: the first desync and its culprits"
    return run_check("first_desync", body)


# ------------------------------------------------------------------------------ 2. triage


def _diagnosis_problem(got: Any, want: clinic.Diagnosis, world_size: int) -> str:
    if not isinstance(got, clinic.Diagnosis):
        return f"return (clinic.Diagnosis(...), fix); got {type(got).__name__} as the diagnosis"
    if got.bug != want.bug:
        if want.bug == clinic.NO_BUG:
            return (f"you called it {got.bug!r}; this run's difference from one process is the noise of its own "
                    "precision: measured in its dtype (the drift test), it is no bug")
        if got.bug == clinic.NO_BUG:
            return "you called it noise; the instruments show a bug (a checksum, the drift test or a stuck rank)"
        return f"the bug class is not {got.bug!r}: read which instrument fires, and on which tensor or collective"
    if tuple(sorted(got.ranks)) != tuple(sorted(want.ranks)):
        if want.bug == clinic.HANG and got.ranks and set(got.ranks) <= set(range(world_size)) - set(want.ranks):
            return (f"ranks {list(got.ranks)} only wait (victims); name the rank whose call differs from its "
                    "peers' (the desync's culprit)")
        return f"ranks: {list(got.ranks)} are not the ranks whose code or state is wrong"
    if got.step != want.step:
        off = "off by one" if isinstance(got.step, int) and want.step is not None and abs(got.step - want.step) == 1 \
            else "not the first step the instruments show it"
        return f"step {got.step}: {off} (a check 'after step s' names step s; before training is -1)"
    if got.where != want.where:
        return f"where {got.where!r}: the first diverging collective (op on group), parameter or module is another"
    return ""


DIAGNOSE_CASES = (("no_broadcast", (4, (2,))), ("hang", ()))
"""The visible check's broken runs (clinic case, its arguments): one that finishes, one that hangs."""


def check_diagnose(fn: Callable, cases: tuple[tuple[str, tuple], ...] = DIAGNOSE_CASES) -> CheckResult:
    """``fn`` on each broken run of ``cases``: the diagnosis the injected bug's, the fix restoring parity."""
    return run_check("diagnose", lambda: "; ".join(_diagnose_case(fn, case, args) for case, args in cases))


def _diagnose_case(fn: Callable, case: str, args: tuple) -> str:
    c = clinic.CASES[case](*args)
    got = fn(c.suspect())
    if not isinstance(got, tuple) or len(got) != 2 or not isinstance(got[1], dict):
        raise CheckFailed(f"diagnose must return (clinic.Diagnosis, dict of parts), got {got!r:.100}")
    diagnosis, fix = got
    problem = _diagnosis_problem(diagnosis, c.answer, c.world_size)
    if problem:
        raise CheckFailed(f"{case} on {c.world_size} ranks: {problem}")
    if not c.repair:
        if fix:
            raise CheckFailed(f"{case}: nothing is broken, so nothing to replace; you replaced {sorted(fix)}")
        return f"{case}: no bug, correctly"
    if not fix or len(fix) > len(c.repair) or set(fix) - set(c.parts):
        raise CheckFailed(f"{case}: replace the broken part only (one of {sorted(c.parts)}), got "
                          f"{sorted(fix) or 'nothing'}")
    fixed = c.with_parts(**fix)
    w = fixed.run()
    if w.hang is not None or w.error:
        raise CheckFailed(f"{case}: with your fix the run still fails: {w.error or 'it hangs'}")
    alarm = w.checksum_alarm()
    if alarm or any(r.nonfinite for r in w.reports):
        raise CheckFailed(f"{case}: with your fix {alarm.describe() if alarm else 'a value is not finite'}")
    report = compare(c.baseline(), c.result(w))
    if not report.ok:
        raise CheckFailed(f"{case}: with your fix (replacing {sorted(fix)}) the run is still not one "
                          f"process's: {str(report).splitlines()[0]}")
    return f"{case}: diagnosed, and fixed by replacing {sorted(fix)}"


# ------------------------------------------------------------------------------ 3. find the bug

CLIP = 1.0
"""The colleague's gradient-norm limit (the tiny model's norms are 1.1-1.5 in its first steps: clipping acts)."""


def single_clipped(steps: int, seed: int) -> TrainResult:
    """One process: the global batch's mean loss, its gradient clipped to ``CLIP``, AdamW; with its fp32 noise."""
    def train(dtype: torch.dtype) -> TrainResult:
        model = GPT(clinic.CFG, seed).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)
        losses = []
        for step in range(steps):
            x, y = global_batch(step, 8, clinic.CFG.seq_len, seed)
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model(x).to(torch.promote_types(dtype, torch.float32)), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            losses.append(loss.item())
        return TrainResult(losses, {k: v.detach().float().clone() for k, v in model.named_parameters()})
    return with_fp32_noise(train)


def _counted(rank: int, world_size: int, fn: Callable, steps: int, seed: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    with comm.recording() as log:
        losses, params = fn(rank, world_size, steps, seed)
    return {"losses": losses, "params": {k: v.detach().float().cpu() for k, v in params.items()},
            "calls": log.count(), "ops": sorted({r.op for r in log.records})}


def check_train_clipped(fn: Callable, world_size: int = 4, steps: int = 4, seed: int = 0) -> CheckResult:
    def body() -> str:
        got = launch_check(_counted, world_size, fn, steps, seed, timeout=LAUNCH_TIMEOUT_S,
                           hang_hint=": does every rank make the same calls in the same order?")
        first = got[0]
        for r, g in enumerate(got[1:], 1):
            bad = [k for k, v in g["params"].items() if not torch.equal(v, first["params"][k])]
            if bad:
                raise CheckFailed(f"rank {r}'s weights differ from rank 0's ({bad[0]}, {len(bad)} tensors): the "
                                  "replicas must stay equal bit for bit")
        budget = steps * (len(first["params"]) + 1)
        if first["calls"] > budget or set(first["ops"]) - {"all_reduce"}:
            raise CheckFailed(f"{first['calls']} collectives ({first['ops']}) in {steps} steps: the colleague's loop "
                              f"makes {budget} all-reduces; fix the order, do not add communication (a broadcast of "
                              "the weights would hide the bug, at the cost of the whole model every step)")
        ref = single_clipped(steps, seed)
        report = compare(ref, TrainResult(list(first["losses"]), first["params"]))
        if not report.ok:
            raise CheckFailed(f"{world_size} ranks, seed {seed}: not the single-process clipped run: "
                              f"{str(report).splitlines()[0]}")
        return f"{world_size} ranks, {steps} steps: replicas equal, the same run as one process"
    return run_check("train_clipped", body)


DEBUG_TOOLS = ("watch", "checksums", "nonfinite", "drift", "hang", "desync", "recorder")
"""The debugging kit a diagnosis may use; of the clinic, only what a case hands out and the fixes' parts."""
CLINIC_PARTS = ("Case", "Diagnosis", "Sampler", "snapshot_step", "dropout_model", "CFG")

EXERCISES = [
    Exercise("first_desync", "The collective-sequence comparison, for any mesh: the first desync and its culprit", 4,
             "first_desync", check_first_desync,
             hidden=[{"scenarios": ("uneven", "late", "interleaved")}, {"scenarios": ("two_desyncs", "shape_tie")}]),
    Exercise("diagnose", "Triage hidden broken runs: the bug, its ranks, its step, where, and a fix", 5, "diagnose",
             check_diagnose,
             hidden=[{"cases": (("accumulation", ("none",)),)}, {"cases": (("bf16_noise", ()),)},
                     {"cases": (("hang", (1, 0)),)}, {"cases": (("non_finite", (0, 1)),)},
                     {"cases": (("dropout_rng", ()),)}, {"cases": (("no_broadcast", (2, (1,))),)}],
             allowed=(*(f"course_lib.debug.{m}" for m in DEBUG_TOOLS),
                      *(f"course_lib.debug.clinic.{name}" for name in CLINIC_PARTS),
                      "course_lib.runtime.mesh.MeshShape", "course_lib.parallel.dp.DataParallel",
                      "course_lib.parallel.pp_executor.PipelineExecutor",
                      "course_lib.parallel.compose.data_parallel")),
    Exercise("train_clipped", "Find the bug: replicas agree, the loss does not", 3, "train_clipped",
             check_train_clipped, hidden=[{"world_size": 2, "steps": 3, "seed": 1}],
             allowed=("course_lib.comm", "course_lib.model", "course_lib.data", "course_lib.debug.clinic.CFG",
                      "course_lib.grading.ch11.CLIP")),
]

RUN_OUTCOMES = {"hang": "a run that hangs: the recorder alone, no results",
                **dict.fromkeys((k for k in clinic.CASES if k != "hang"),
                                "a run that finishes: its instruments and the drift test")}
"""The diagnosis's classes: how the broken run ends, which decides what the answer can read at all. A hung run has
no results and stops every other instrument (they are collectives too), so only its recorder's desync names the
culprit; a run that finishes is read by its checksums, NaN hooks, batch fingerprints and, when none fires, the
drift test in its own precision (a bug, or the noise of bf16). Which of those fires is the triage itself, what the
hidden runs grade: a self-check holding one run per instrument would list the hidden bug kinds, and each is a
launched run of 5-20 s where the grader allows a check 60 s, so the visible check holds one run of each ending."""

CASE_CLASSES = {
    "first_desync": lambda calls: set().union(*(SCENARIO_CLASSES[s] for call in calls for s in call["scenarios"])),
    "diagnose": lambda calls: {RUN_OUTCOMES[case] for case, _ in each(calls)},
    # the world size is an argument of the loop (no hard-coded one to catch) and no ring is involved: what the bug
    # needs is replicas whose local gradients, and so local norms, differ, and steps where clipping acts
    "train_clipped": lambda calls: {"replicas with different local gradients" for c in calls if c["world_size"] > 1}
    | {"several steps, clipping acting" for c in calls if c["steps"] > 1},
}

guard_visible_checks(globals(), EXERCISES)
