"""Chapter 02 — data parallelism.

1. ``assign_buckets(sizes, cap)``: DDP's bucket assignment, lists of indices; exact, on empty, single, capped and
   uncapped cases.
2. ``average_gradients(model, group=None)``: on real ranks (2 and 4, inside sub-groups, with a frozen parameter),
   every ``.grad`` must be one process's gradient on the group's rows, identical on the group's ranks.
3. ``accumulation_step(model, optimizer, micro)``: one optimizer step of a ``dp.DataParallel`` model over this
   rank's micro-batches (1 to 4); losses and parameters against one process with SGD, replicas identical, and the
   all-reduces counted per step.
4. ``dp_bytes_per_step(n_params, bytes_per_grad, n, accumulation)``: bytes one rank sends per optimizer step.
5. ``overlap_buckets(params, buckets)``: gradient hooks and a ``finish()``; on real ranks, each all-reduce is seen
   where the process group sees it (its size, its bucket, its order, whether backward was still running, whether
   anything waited) over several steps, buckets completing in and out of order, and every gradient compared with
   one process's.
6. ``fixed_overlap_buckets(params, buckets)`` (find the bug): the check of 5, over more steps.

Launched checks run the learner's function (shipped by cloudpickle, as a notebook cell's) on ``world_size`` gloo
ranks through ``course_lib.runtime.launch`` with a time limit, so a hang fails the check with where each rank waited.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.data import global_batch, micro_batches, shard
from course_lib.estimates import accounting
from course_lib.grading import core
from course_lib.grading.cases import each, ranks, several
from course_lib.grading.core import (
    CheckFailed,
    CheckResult,
    Exercise,
    expect_close,
    expect_number,
    guard_visible_checks,
    run_check,
)
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel import dp
from course_lib.train import TrainConfig, TrainResult, compare, copy_parameters, make_optimizer, train_baseline

GRADER_PARAMETERS = {"seed": 1}
LAUNCH_TIMEOUT_S = 40.0
"""A launched check stops the ranks after this long (below the grader's 60 s per check)."""
CFG = GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16, bias=False)
"""The model of the launched checks: 15 gradient tensors, 117 kB; bias-free (see ``course_lib.parallel.dp``)."""
BUCKET_MB = 0.02
"""~20 kB buckets: the checks' model makes 3 of them."""


# ----------------------------------------------------------------------------------------------------------------
# Launching the learner's function


_launch = functools.partial(
    core.launch_check, hang_hint=" (a collective that not every rank of the group calls, or calls in another order?)",
    course_files=("course_lib/grading/ch02.py", "course_lib/comm.py", "course_lib/parallel/dp.py"))
"""``launch_check(target, world_size, *args, timeout=...)`` with this chapter's hang hint."""


def _group_of(rank: int, world_size: int, groups: int) -> tuple[Any, list[int]]:
    """Split the ranks into ``groups`` consecutive DP groups (every rank creates every group, in order)."""
    size = world_size // groups
    mine, members = None, []
    for g in range(groups):
        ranks = list(range(g * size, (g + 1) * size))
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine, members = pg, ranks
    return mine, members


# ----------------------------------------------------------------------------------------------------------------
# 1. assign_buckets


def reference_buckets(sizes: Sequence[int], cap: int) -> list[list[int]]:
    """The answer, from ``dp.assign_buckets`` (which takes tensors already in reverse order)."""
    tensors = [torch.empty(s, dtype=torch.uint8, device="meta") for s in reversed(sizes)]
    n = len(sizes)
    return [[n - 1 - i for i in bucket] for bucket in dp.assign_buckets(tensors, cap)]


def _describe_buckets(buckets: list[list[int]], sizes: Sequence[int]) -> str:
    return ", ".join(f"{b} ({sum(sizes[i] for i in b)} B)" for b in buckets[:4]) + (" ..." if len(buckets) > 4 else "")


DEFAULT_BUCKET_CASES: tuple[tuple[tuple[int, ...], int], ...] = (
    ((400, 100, 300, 200, 500, 100), 500),
    ((4, 4, 4, 4), 0),
    ((100, 300, 200, 400, 100), 500),  # the last bucket, [0], is partly filled: it must still be returned
    ((), 100),
    ((3, 1, 2), 100),  # one bucket holds everything
    ((700, 20, 30), 40),  # a tensor alone over the cap closes its own bucket
)


def check_assign_buckets(fn: Callable[[list[int], int], list[list[int]]],
                         cases: tuple[tuple[tuple[int, ...], int], ...] = DEFAULT_BUCKET_CASES) -> CheckResult:
    """``fn(sizes, cap)`` must return ``reference_buckets(sizes, cap)`` exactly: a list of lists of ints."""
    def body() -> str:
        for sizes, cap in cases:
            what = f"assign_buckets({list(sizes)}, cap={cap})"
            got = fn(list(sizes), cap)
            expected = reference_buckets(sizes, cap)
            if not isinstance(got, list) or not all(isinstance(b, list) and all(isinstance(i, int) for i in b)
                                                    for b in got):
                raise CheckFailed(f"{what} must return a list of lists of ints (parameter indices), got {got!r}")
            if got != expected:
                k = next((k for k, (g, e) in enumerate(zip(got, expected, strict=False)) if g != e),
                         min(len(got), len(expected)))
                g = got[k] if k < len(got) else "(none)"
                e = expected[k] if k < len(expected) else "(none)"
                raise CheckFailed(f"{what}: first difference at bucket {k}: expected {e}, got {g}. Expected "
                                  f"{len(expected)} buckets {_describe_buckets(expected, sizes)}; got {len(got)}: "
                                  f"{_describe_buckets(got, sizes) if got else '[]'}")
        return f"{len(cases)} cases exact"
    return run_check("assign_buckets", body)


# ----------------------------------------------------------------------------------------------------------------
# 2. average_gradients


def _average_on_rank(rank: int, world_size: int, fn: Callable[..., Any], batch: int, seed: int, groups: int,
                     freeze: tuple[str, ...]) -> dict[str, Any]:
    model = GPT(CFG, seed=seed)
    for name in freeze:
        model.get_parameter(name).requires_grad_(False)
    x, y = global_batch(seed, batch, CFG.seq_len, seed)
    lm_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    if groups > 1:
        group, _ = _group_of(rank, world_size, groups)
        fn(model, group=group)
    else:
        fn(model)
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def _single_process_grads(batch: int, seed: int, part: int, parts: int,
                          freeze: tuple[str, ...]) -> dict[str, torch.Tensor | None]:
    """Gradient of the mean loss over rows ``part`` of ``parts`` (a group's rows: its ranks' shards, together)."""
    model = GPT(CFG, seed=seed)
    for name in freeze:
        model.get_parameter(name).requires_grad_(False)
    x, y = global_batch(seed, batch, CFG.seq_len, seed)
    lm_loss(model(shard(x, part, parts)), shard(y, part, parts)).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _check_average_case(fn: Callable[..., None], world_size: int, groups: int, freeze: tuple[str, ...], batch: int,
                        seed: int, timeout: float) -> str:
    results = _launch(_average_on_rank, world_size, fn, batch, seed, groups, tuple(freeze), timeout=timeout)
    size = world_size // groups
    where = f"{world_size} ranks" + (f", {groups} groups of {size} (group=...)" if groups > 1 else "") + \
        (f", {', '.join(freeze)} frozen" if freeze else "")
    for rank, grads in enumerate(results):
        g = rank // size
        expected = _single_process_grads(batch, seed, g, groups, tuple(freeze))
        for name, want in expected.items():
            got = grads[name]
            if want is None:
                if got is not None:
                    raise CheckFailed(f"rank {rank} ({where}): {name} is frozen (requires_grad=False, .grad None) but "
                                      "has a gradient after average_gradients: skip parameters whose .grad is None")
                continue
            if got is None:
                raise CheckFailed(f"rank {rank} ({where}): {name}.grad is None after average_gradients")
            expect_close(got, want, f"rank {rank} ({where}): {name}.grad vs one process on the "
                         f"{batch // groups} rows of its group", rtol=1e-4, atol=1e-7)
        first = results[g * size]
        for name, got in grads.items():
            if got is not None and not torch.equal(got, first[name]):
                raise CheckFailed(f"rank {rank} and rank {g * size} hold different {name}.grad: every replica "
                                  "must end with the same averaged gradient")
    return f"{where}: every gradient is the group's average"


AVERAGE_CASES = ((4, 2, ("pos_emb.weight",)), (2, 1, ()))
"""The visible check's (ranks, groups, frozen parameters): 4 ranks in 2 sub-groups with a frozen parameter;
2 ranks in one group."""


def check_average_gradients(fn: Callable[..., None],
                            cases: tuple[tuple[int, int, tuple[str, ...]], ...] = AVERAGE_CASES, batch: int = 8,
                            seed: int = 0, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, groups, frozen parameter names). On each rank: a local backward on its shard of the global
    batch, then ``fn(model)`` (``fn(model, group=g)`` with ``groups`` > 1: consecutive groups of world_size /
    groups ranks). Every rank's ``.grad`` must then be the single-process gradient of the mean loss over its
    group's rows (rtol 1e-4), identical on the ranks of a group; frozen parameters keep ``.grad = None``."""
    return run_check("average_gradients", lambda: "; ".join(
        _check_average_case(fn, n, groups, tuple(freeze), batch, seed, timeout) for n, groups, freeze in cases))


# ----------------------------------------------------------------------------------------------------------------
# 3. accumulation_step


def _accumulate_on_rank(rank: int, world_size: int, fn: Callable[..., Any], tc: TrainConfig,
                        accumulation: int) -> dict[str, Any]:
    model = GPT(CFG, seed=tc.seed)
    wrapped = dp.DataParallel(model, mode="overlapped", bucket_mb=BUCKET_MB)
    opt = make_optimizer(list(model.parameters()), tc)
    losses, calls = [], []
    for step in range(tc.steps):
        x, y = global_batch(step, tc.global_batch, CFG.seq_len, tc.seed)
        micro = micro_batches(shard(x, rank, world_size), shard(y, rank, world_size), accumulation)
        with comm.recording() as log:
            loss = fn(wrapped, opt, micro)
        calls.append([log.count("all_reduce"), len(log.records)])
        losses.append(loss)
    return {"losses": losses, "calls": calls, "params": copy_parameters(model), "buckets": len(wrapped.buckets)}


def _check_accumulation_case(fn: Callable[..., Any], world_size: int, accumulation: int, seed: int, steps: int,
                             timeout: float) -> str:
    tc = TrainConfig(optimizer="sgd", steps=steps, global_batch=8, seed=seed)
    try:
        results = _launch(_accumulate_on_rank, world_size, fn, tc, accumulation, timeout=timeout)
    except CheckFailed as err:
        if "previous step's gradients were never averaged" in str(err):
            raise CheckFailed(f"{err} [with several micro-batches: every micro-batch but the last must run under "
                              "`with model.no_sync():`; after the last backward, model.finish_gradient_sync()]"
                              ) from None
        raise
    rows = 8 // world_size // accumulation
    where = f"{world_size} ranks, {accumulation} micro-batch{'es' if accumulation > 1 else ''} of {rows} " \
            f"row{'s' if rows > 1 else ''}"
    buckets = results[0]["buckets"]
    for rank, res in enumerate(results):
        for step, (calls, records) in enumerate(res["calls"]):
            if calls != buckets:
                more = (" — an all-reduce for every micro-batch: the first ones must run under no_sync()"
                        if calls > buckets else "")
                raise CheckFailed(f"rank {rank}, step {step} ({where}): {calls} all-reduces during the step, "
                                  f"expected {buckets} (one per bucket, on the last micro-batch only){more}")
            if records != calls:
                raise CheckFailed(f"rank {rank}, step {step}: {records - calls} communication calls besides the "
                                  "gradient all-reduces (a step needs no other)")
        for step, loss in enumerate(res["losses"]):
            if isinstance(loss, bool) or not isinstance(loss, int | float):
                raise CheckFailed(f"rank {rank}, step {step}: return this rank's mean loss as a Python float "
                                  f"(loss.item()), got {type(loss).__name__} ({loss!r})")
    ref = train_baseline(CFG, tc)
    mean_losses = [sum(r["losses"][s] for r in results) / world_size for s in range(steps)]
    if not math.isclose(mean_losses[0], ref.losses[0], rel_tol=1e-5, abs_tol=1e-6):
        raise CheckFailed(f"step 0 ({where}): the mean over ranks of the returned losses is {mean_losses[0]:.6g}, "
                          f"one process gets {ref.losses[0]:.6g} (return this rank's mean loss over its "
                          "micro-batches: the sum of the micro-batch losses divided by their number)")
    report = compare(ref, TrainResult(ref.losses, results[0]["params"]))
    if not report.ok:
        raise CheckFailed(f"{where}: after {steps} SGD steps rank 0's parameters differ from one process trained "
                          f"on the same global batches: {report.problems[0]} (max |diff| "
                          f"{report.max_param_diff:.3g} on {report.worst_param}). The accumulated gradient must be "
                          "that of the mean loss over all micro-batches: each loss divided by their number, "
                          "gradients zeroed once per step")
    for step, (got, want) in enumerate(zip(mean_losses, ref.losses, strict=True)):
        if not math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6):
            raise CheckFailed(f"step {step} ({where}): the mean over ranks of the returned losses is {got:.6g}, "
                              f"one process gets {want:.6g}")
    for rank, res in enumerate(results[1:], start=1):
        for name, value in res["params"].items():
            if not torch.equal(value, results[0]["params"][name]):
                raise CheckFailed(f"rank {rank}'s {name} differs from rank 0's: the replicas drifted apart")
    return f"{where}: same training as one process, {buckets} all-reduces per step"


ACCUMULATION_CASES = ((2, 2), (4, 1))
"""The visible check's (ranks, micro-batches): 2 ranks with 2 micro-batches, 4 ranks with one (no no_sync)."""


def check_accumulation_step(fn: Callable[..., Any], cases: tuple[tuple[int, int], ...] = ACCUMULATION_CASES,
                            seed: int = 0, steps: int = 2, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, micro-batches). ``steps`` optimizer steps, each a call ``fn(model, optimizer, micro)`` with a
    ``dp.DataParallel`` (overlapped, 0.02 MiB buckets) model, SGD (lr 1e-2, momentum) and this rank's
    micro-batches of the global batch of 8. The losses (mean over ranks of the returned values) and the final
    parameters must match ``train_baseline`` (``train.compare``: within 8 x its fp32 noise), every replica must be
    identical, and each step must issue exactly one all-reduce per bucket."""
    return run_check("accumulation_step", lambda: "; ".join(
        _check_accumulation_case(fn, n, m, seed, steps, timeout) for n, m in cases))


# ----------------------------------------------------------------------------------------------------------------
# 4. dp_bytes_per_step


DEFAULT_BYTES_CASES: tuple[tuple[int, int, int, int], ...] = ((6_738_415_616, 2, 8, 1), (1_000_000, 4, 4, 4),
                                                              (10, 4, 1, 2))


def check_dp_bytes_per_step(fn: Callable[[int, int, int, int], float],
                            cases: tuple[tuple[int, int, int, int], ...] = DEFAULT_BYTES_CASES) -> CheckResult:
    """``fn(n_params, bytes_per_grad, n, accumulation)`` must return 2 (n-1)/n x n_params x bytes_per_grad."""
    def body() -> str:
        for n_params, es, n, m in cases:
            want = accounting.allreduce_bytes_per_rank(n_params * es, n)
            expect_number(fn(n_params, es, n, m), want, f"dp_bytes_per_step(n_params={n_params:,}, bytes_per_grad="
                          f"{es}, n={n}, accumulation={m})")
        return f"{len(cases)} cases correct"
    return run_check("dp_bytes_per_step", body)



# ----------------------------------------------------------------------------------------------------------------
# 5. overlap_buckets


def _overlap_on_rank(rank: int, world_size: int, fn: Callable[..., Any], tc: TrainConfig,
                     order: str) -> dict[str, Any]:
    """``order="backward"``: ``params`` in the order backward produces them; ``"last_first"``: the parameter whose
    gradient comes last is listed first, so bucket 0 completes last and the later buckets complete before it."""
    model = GPT(CFG, seed=tc.seed)
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    if order == "last_first":
        params = [params[-1], *params[:-1]]
    buckets = dp.assign_buckets(params, int(BUCKET_MB * 2**20))
    phase, calls, waits = ["setup"], [], []

    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            ts = tensors if isinstance(tensors, list | tuple) else [tensors]
            calls.append((phase[0], sum(t.numel() for t in ts), str(ts[0].dtype)))
            return core.LoggedWork(original(self, tensors, *args, **kwargs), lambda: waits.append(phase[0]))
        return wrapped

    opt = make_optimizer(list(model.parameters()), tc)
    steps, grads, waited = [], [], []
    with core.patch_process_group(("allreduce",), counting):
        finish = fn(params, buckets)
        for step in range(tc.steps):
            x, y = global_batch(step, tc.global_batch, CFG.seq_len, tc.seed)
            opt.zero_grad()
            calls.clear()
            waits.clear()
            phase[0] = "backward"
            lm_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
            phase[0] = "finish()"
            finish()
            phase[0] = "step"
            steps.append(list(calls))
            waited.append(list(waits))
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            opt.step()
    return {"calls": steps, "grads": grads, "waits": waited,
            "bucket_numels": [sum(params[j].numel() for j in b) for b in buckets]}


def _check_overlap_case(fn: Callable[..., Any], world_size: int, steps: int, order: str, seed: int,
                        timeout: float) -> str:
    tc = TrainConfig(optimizer="sgd", lr=1e-2, steps=steps, global_batch=8, seed=seed)
    results = _launch(_overlap_on_rank, world_size, fn, tc, order, timeout=timeout)
    numels = results[0]["bucket_numels"]
    for rank, res in enumerate(results):
        for step, waits in enumerate(res["waits"]):
            if "backward" in waits:
                raise CheckFailed(f"rank {rank}, step {step}: {waits.count('backward')} all-reduce(s) waited on "
                                  "inside backward (a hook that waits stalls the backward until the network is "
                                  "done: no overlap); wait only in finish()")
        for step, calls in enumerate(res["calls"]):
            late = [c for c in calls if c[0] != "backward"]
            if late:
                raise CheckFailed(f"rank {rank}, step {step}: {len(late)} all-reduce(s) issued in {late[0][0]}; "
                                  "every bucket's all-reduce must start from a gradient hook while backward runs "
                                  "(that is the overlap), none may wait for finish()")
            sizes = [c[1] for c in calls]
            if sizes != numels:
                raise CheckFailed(f"rank {rank}, step {step}: all-reduces of {sizes} elements during backward, "
                                  f"expected one per bucket in bucket order, {numels} (one flat buffer per "
                                  "bucket; a bucket is launched only after every bucket before it)")
            if any(c[2] != "torch.float32" for c in calls):
                raise CheckFailed(f"rank {rank}, step {step}: all-reduce payloads {[c[2] for c in calls]}: keep "
                                  "the gradients' dtype (float32) in the bucket buffer")
    model = GPT(CFG, seed=seed)
    opt = make_optimizer(list(model.parameters()), tc)
    for step in range(steps):
        x, y = global_batch(step, tc.global_batch, CFG.seq_len, tc.seed)
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        for rank, res in enumerate(results):
            for name, p in model.named_parameters():
                expect_close(res["grads"][step][name], p.grad, f"rank {rank}, step {step}: {name}.grad after "
                             "finish() vs one process on the whole global batch", rtol=1e-4, atol=1e-7)
        opt.step()
    return (f"{world_size} ranks, {len(numels)} buckets: one all-reduce per bucket, in order, during backward; "
            f"gradients = one process's for {steps} steps")


OVERLAP_CASES = ((2, 2, "backward"), (4, 2, "last_first"))
"""The visible check's (ranks, steps, order): 2 ranks; 4 ranks whose buckets complete out of order."""
FIXED_OVERLAP_CASES = ((2, 3, "backward"), (4, 3, "last_first"))
"""The find-the-bug's: three steps (its bug shows from the second)."""


def check_overlap_buckets(fn: Callable[..., Any], cases: tuple[tuple[int, int, str], ...] = OVERLAP_CASES,
                          seed: int = 0, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, steps, order). ``finish = fn(params, buckets)`` once (``params`` in backward order, ``buckets``
    from ``dp.assign_buckets``), then ``steps`` SGD steps of forward, backward, ``finish()``, ``optimizer.step()`` on
    this rank's shard of the global batch of 8. Each step: exactly one float32 all-reduce per bucket, of the
    bucket's size, in bucket order, all issued while backward runs and none in ``finish()``, none waited on during
    backward; after ``finish()`` every gradient is the single-process gradient of the global batch (rtol 1e-4), on
    every rank. ``order``: see ``_overlap_on_rank`` (with ``"last_first"`` the buckets complete out of order)."""
    return run_check("overlap_buckets", lambda: "; ".join(
        _check_overlap_case(fn, n, steps, order, seed, timeout) for n, steps, order in cases))


def check_fixed_overlap_buckets(fn: Callable[..., Any], cases: tuple[tuple[int, int, str], ...] = FIXED_OVERLAP_CASES,
                                seed: int = 0, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """``check_overlap_buckets`` over three steps and more."""
    return check_overlap_buckets(fn, cases, seed, timeout)


EXERCISES = [
    Exercise("assign_buckets", "DDP's bucket assignment", 3, "assign_buckets", check_assign_buckets,
             hidden=[{"cases": (((10, 20, 30), 1000), ((), 25), ((5, 5, 5, 5, 5), 10), ((1, 2, 3, 4, 5, 6, 7), 6),
                                ((8, 8, 8), 8), ((100,), 1))}]),
    Exercise("average_gradients", "All-reduce and average the gradients", 3, "average_gradients",
             check_average_gradients,
             hidden=[{"cases": ((2, 1, ()),), "seed": 1}, {"cases": ((4, 2, ()),), "seed": 2},
                     {"cases": ((2, 1, ("pos_emb.weight",)),), "seed": 3}],
             allowed=("course_lib.comm",)),
    Exercise("accumulation_step", "A gradient-accumulation step with no_sync", 4, "accumulation_step",
             check_accumulation_step,
             hidden=[{"cases": ((4, 2),), "seed": 1}, {"cases": ((2, 4),), "seed": 2},
                     {"cases": ((2, 1),), "seed": 3}],
             allowed=("course_lib.comm", "course_lib.model.lm_loss", *(f"course_lib.parallel.dp.DataParallel.{name}"
                                                                     for name in ("forward", "no_sync",
                                                                                  "finish_gradient_sync")))),
    Exercise("dp_bytes_per_step", "Bytes per rank and optimizer step", 2, "dp_bytes_per_step",
             check_dp_bytes_per_step,
             hidden=[{"cases": ((1, 4, 1, 1), (133_760, 4, 2, 2), (123, 2, 3, 8), (70_553_706_496, 2, 1024, 16))}]),
    Exercise("overlap_buckets", "Overlapped, bucketed gradient hooks", 4, "overlap_buckets", check_overlap_buckets,
             hidden=[{"cases": ((4, 2, "backward"),), "seed": 1}, {"cases": ((2, 3, "backward"),), "seed": 2},
                     {"cases": ((2, 2, "last_first"),), "seed": 3}],
             allowed=("course_lib.comm",)),
    Exercise("fixed_overlap_buckets", "Find the bug: overlap that works for one step", 3, "fixed_overlap_buckets",
             check_fixed_overlap_buckets,
             hidden=[{"cases": ((4, 3, "backward"),), "seed": 1}, {"cases": ((2, 4, "last_first"),), "seed": 2}],
             allowed=("course_lib.comm",)),
]

def _ranks_of(calls: list[dict]) -> set[str]:
    sizes = [case[0] for case in each(calls)]
    return several(sizes, "world sizes").union(*(ranks(n) for n in sizes))


def _bucket_classes(calls: list[dict]) -> set[str]:
    out = set()
    for sizes, cap in each(calls):
        buckets = [sum(sizes[i] for i in b) for b in reference_buckets(sizes, cap)]
        out |= {"no tensors"} if not sizes else {"cap 0: a bucket a tensor"} if cap == 0 else set()
        if cap > 0 and buckets:
            out |= {"one bucket holds everything"} if len(buckets) == 1 else set()
            out |= {"a last bucket under the cap"} if buckets[-1] < cap else set()
            out |= {"a bucket exactly at the cap" for b in buckets if b == cap}
            out |= {"a tensor alone over the cap"} if max(sizes) > cap else set()
    return out


CASE_CLASSES = {
    "assign_buckets": _bucket_classes,
    "average_gradients": lambda calls: _ranks_of(calls) | {"sub-groups" for _, g, _ in each(calls) if g > 1}
    | {"a frozen parameter" for *_, frozen in each(calls) if frozen},
    "accumulation_step": lambda calls: _ranks_of(calls) | {"one micro-batch" if m == 1 else "several micro-batches"
                                                           for _, m in each(calls)},
    "dp_bytes_per_step": lambda calls: {"one rank" if n == 1 else "several ranks" for _, _, n, _ in each(calls)}
    | {"accumulation" for *_, m in each(calls) if m > 1} | several((es for _, es, _, _ in each(calls)), "widths")
    | {"more than 2^32 bytes" for p, es, _, _ in each(calls) if p * es > 2**32},
    "overlap_buckets": lambda calls: _ranks_of(calls) | {"buckets completing out of order" for *_, order in
                                                         each(calls) if order != "backward"},
    "fixed_overlap_buckets": lambda calls: _ranks_of(calls) | {"three steps or more" for _, steps, _ in each(calls)
                                                               if steps >= 3}
    | {"buckets completing out of order" for *_, order in each(calls) if order != "backward"},
}

guard_visible_checks(globals(), EXERCISES)
