"""Chapter 03 — ZeRO and FSDP, checked on real ranks.

1. ``shard_range(numel, world_size, rank)``: the (start, end) a rank owns, two ints, for every rank of sizes that
   the world size divides and does not, up to 6.7e9 elements.
2. ``zero1_sgd_step(param, grad, state, lr, momentum)``: one ZeRO-1 step of SGD with momentum; over several steps,
   every rank's ``param`` against single-process SGD (``torch.optim.SGD`` semantics) on the averaged gradient, the
   momentum kept in ``state["momentum_buffer"]`` against this rank's shard of one process's, and the bytes sent.
3. ``gather_unit(shard, numel, shapes)``: an FSDP unit's parameters from the ranks' shards; exact values in the
   shard's dtype, the storage the returned tensors share, the shard left unchanged, and the bytes sent.
4. ``grad_shard(grad)`` (find the bug): this rank's shard of the gradient averaged over ranks, in the input's
   dtype and length, on sizes the world size divides and does not, float32 and float64.

On the ranks every collective is counted (``torch.distributed.ProcessGroup`` methods, which ``dist.*``,
``course_lib.comm`` and point-to-point messages all end in), with the bytes a rank sends under the ring algorithm
(chapter 01), exactly. All-reduce, broadcast and the other collectives are refused with a message.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from course_lib.grading import core
from course_lib.grading.cases import each, ranks, several
from course_lib.grading.core import (
    CheckFailed,
    CheckResult,
    Exercise,
    expect_close,
    expect_equal,
    guard_visible_checks,
    run_check,
)
from course_lib.parallel.zero_unit import FlatLayout

GRADER_PARAMETERS = {"seed": 1}
LAUNCH_TIMEOUT_S = 30.0
"""A launched check stops the ranks after this long (below the grader's 60 s per check)."""

_ALLOWED = {  # ProcessGroup method -> the torch.distributed call that ends in it
    "all_gather_single": "dist.all_gather_into_tensor", "_allgather_base": "dist.all_gather_into_tensor",
    "allgather": "dist.all_gather", "reduce_scatter_single": "dist.reduce_scatter_tensor",
    "_reduce_scatter_base": "dist.reduce_scatter_tensor", "reduce_scatter": "dist.reduce_scatter",
    "send": "dist.send", "recv": "dist.recv", "barrier": "dist.barrier",
}
_REFUSED = {
    "allreduce": "dist.all_reduce", "allreduce_coalesced": "dist.all_reduce_coalesced",
    "broadcast": "dist.broadcast", "reduce": "dist.reduce", "gather": "dist.gather", "scatter": "dist.scatter",
    "alltoall": "dist.all_to_all", "alltoall_base": "dist.all_to_all_single",
    "all_to_all_single": "dist.all_to_all_single", "allgather_coalesced": "dist.all_gather_coalesced",
    "allgather_into_tensor_coalesced": "dist.all_gather_into_tensor (coalesced)",
    "reduce_scatter_tensor_coalesced": "dist.reduce_scatter_tensor (coalesced)",
    "all_gather_single_coalesced": "dist.all_gather_into_tensor (coalesced)",
    "reduce_scatter_single_coalesced": "dist.reduce_scatter_tensor (coalesced)",
}


class RefusedCollective(RuntimeError):  # noqa: N818 - reads as what happened
    """Raised on a rank when the learner's function calls a collective ZeRO does not use here."""


# ----------------------------------------------------------------------------------------------------------------
# On the ranks


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _counting(log: list[tuple[str, int]]) -> contextlib.AbstractContextManager[None]:
    """Record (torch.distributed call, bytes this rank sends on a ring) for every collective of this process;
    make the refused ones raise."""
    def sent(name: str, n: int, args: tuple) -> int:
        if name in ("all_gather_single", "_allgather_base"):
            return (n - 1) * _nbytes(args[0]) // n  # output: V
        if name in ("reduce_scatter_single", "_reduce_scatter_base"):
            return (n - 1) * _nbytes(args[1]) // n  # input: V
        if name == "allgather":
            return (n - 1) * sum(_nbytes(t) for t in args[1])  # N-1 chunks of the input
        if name == "reduce_scatter":
            return (n - 1) * sum(_nbytes(t) for t in args[0])  # N-1 chunks the size of the output
        if name == "send":
            return sum(_nbytes(t) for t in args[0])
        return 0

    def guard(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        if name not in _ALLOWED:
            return core.refusal(RefusedCollective,
                           f"it called {_REFUSED[name]}: ZeRO reduce-scatters gradients (dist.reduce_scatter_tensor) "
                           "and all-gathers parameters (dist.all_gather_into_tensor); an all-reduce would put the "
                           "whole reduced tensor on every rank, which is what ZeRO avoids")

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            log.append((_ALLOWED[name], sent(name, self.size(), args)))
            return original(self, *args, **kwargs)
        return counted

    return core.patch_process_group((*_ALLOWED, *_REFUSED), guard)


def _param0(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _grad(numel: int, seed: int, step: int, rank: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * seed + 100 * step + rank + 1))


def _zero1_on_rank(rank: int, world_size: int, fn: Callable[..., Any], numel: int, steps: int, lr: float,
                   momentum: float, seed: int) -> dict[str, Any]:
    param = _param0(numel, seed)
    state: dict[str, Any] = {}
    out: dict[str, Any] = {"params": [], "buffers": [], "comm": []}
    for step in range(steps):
        grad = _grad(numel, seed, step, rank)  # the function may modify it: the caller does not reuse it
        log: list[tuple[str, int]] = []
        with _counting(log):
            fn(param, grad, state, lr, momentum)
        buf = state.get("momentum_buffer")
        out["params"].append(param.detach().clone())
        out["buffers"].append(buf.detach().clone() if isinstance(buf, torch.Tensor) else buf)
        out["comm"].append(log)
    return out


def _storage_facts(t: Any) -> dict[str, Any]:
    if not isinstance(t, torch.Tensor):
        return {"tensor": False}
    st = t.untyped_storage()
    return {"tensor": True, "storage": st.data_ptr(), "storage_bytes": st.nbytes(),
            "offset_bytes": t.data_ptr() - st.data_ptr(), "value": t.detach().clone()}


def _gather_on_rank(rank: int, world_size: int, fn: Callable[..., Any], shapes: Sequence[tuple[int, ...]],
                    seed: int, dtype: str = "float32") -> dict[str, Any]:
    numel = sum(math.prod(s) for s in shapes)
    padded = -(-numel // world_size) * world_size
    s = padded // world_size
    flat = torch.zeros(padded, dtype=getattr(torch, dtype))
    flat[:numel] = _param0(numel, seed)
    shard = flat[rank * s:(rank + 1) * s].clone()
    before = shard.clone()
    log: list[tuple[str, int]] = []
    with _counting(log):
        got = fn(shard, numel, [tuple(x) for x in shapes])
    facts = [_storage_facts(t) for t in got] if isinstance(got, list | tuple) else None
    return {"type": type(got).__name__, "facts": facts, "comm": log, "shard_modified": not torch.equal(shard, before)}


def _grad_shard_on_rank(rank: int, world_size: int, fn: Callable[..., Any], cases: Sequence[int], seed: int,
                        dtypes: Sequence[torch.dtype]) -> list[dict[str, Any]]:
    out = []
    for dtype in dtypes:
        for numel in cases:
            grad = _grad(numel, seed, 0, rank).to(dtype)
            log: list[tuple[str, int]] = []
            with _counting(log):
                got = fn(grad.clone())
            out.append({"got": got.detach().clone() if isinstance(got, torch.Tensor) else got, "comm": log})
    return out


# ----------------------------------------------------------------------------------------------------------------
# In the learner's process


_launch = functools.partial(
    core.launch_check, hang_hint=": a collective that some ranks called and others did not, or with other sizes?",
    guard_errors=("RefusedCollective",))
"""``launch_check(target, world_size, *args, timeout=...)`` with this chapter's hang hint; a ``RefusedCollective``
is reported with its own message."""


def _check_comm(log: list[tuple[str, int]], want: int, what: str, rank: int) -> None:
    sent = sum(b for _, b in log)
    if sent != want:
        calls = ", ".join(f"{name} ({b:,} B)" for name, b in log) or "no collective at all"
        raise CheckFailed(f"rank {rank} sent {sent:,} bytes in {what}; {want:,} expected. It called: {calls}")


def check_shard_range(fn: Callable[[int, int, int], tuple[int, int]],
                      cases: tuple[tuple[int, int], ...] = ((10, 4), (8, 4), (1, 3), (5, 1), (5_000_000_001, 32))
                      ) -> CheckResult:
    """For every (numel, world_size) case and every rank: ``fn(numel, world_size, rank)`` must be the pair of
    ints ``FlatLayout.build([...], [(numel,)], world_size).bounds(rank)``."""
    def body() -> str:
        count = 0
        for numel, n in cases:
            lay = FlatLayout.build(["x"], [(numel,)], n)
            for r in range(n):
                got = fn(numel, n, r)
                what = (f"shard_range(numel={numel}, world_size={n}, rank={r}) (padded to {lay.padded_numel}, "
                        f"S = {lay.shard_numel})")
                if not isinstance(got, tuple) or len(got) != 2 or not all(
                        isinstance(v, int) and not isinstance(v, bool) for v in got):
                    raise CheckFailed(f"{what} must return a tuple of two ints (start, end), got {got!r}")
                expect_equal(got, lay.bounds(r), what)
                count += 1
        return f"{count} (case, rank) pairs correct"
    return run_check("shard_range", body)


def _check_zero1_case(fn: Callable[..., None], world_size: int, numel: int, steps: int, lr: float, momentum: float,
                      seed: int, timeout: float) -> str:
    n = world_size
    if numel % n:
        raise ValueError(f"the check needs numel ({numel}) divisible by world_size ({n})")
    s = numel // n
    results = _launch(_zero1_on_rank, n, fn, numel, steps, lr, momentum, seed, timeout=timeout)
    ref, buf = _param0(numel, seed), None
    for step in range(steps):
        g = sum(_grad(numel, seed, step, r) for r in range(n)) / n
        buf = g.clone() if buf is None else momentum * buf + g
        ref = ref - lr * buf
        for r, res in enumerate(results):
            expect_close(res["params"][step], ref, f"rank {r}'s param after step {step + 1} ({n} ranks, numel "
                         f"{numel}; SGD lr={lr}, momentum={momentum} on the gradient averaged over ranks)")
            mine = res["buffers"][step]
            if not isinstance(mine, torch.Tensor):
                raise CheckFailed(f"rank {r}: state['momentum_buffer'] after step {step + 1} should be a tensor "
                                  f"(this rank's shard of the momentum), got {type(mine).__name__}")
            if mine.shape != (s,):
                raise CheckFailed(f"rank {r}: state['momentum_buffer'] has shape {tuple(mine.shape)}; ZeRO-1 "
                                  f"keeps only this rank's shard of the optimizer state: shape ({s},) "
                                  f"(numel {numel} / {n} ranks)")
            expect_close(mine, buf[r * s:(r + 1) * s], f"rank {r}'s momentum shard after step {step + 1} "
                         f"(elements [{r * s}, {(r + 1) * s}) of the momentum)")
            _check_comm(res["comm"][step], 2 * (n - 1) * 4 * numel // n,
                        f"step {step + 1} (a reduce-scatter and an all-gather of {4 * numel:,} bytes each "
                        f"send 2 x (N-1)/N x V)", r)
    return (f"{n} ranks, numel {numel}, {steps} steps: every rank's param and momentum shard right; "
            f"{2 * (n - 1) * 4 * numel // n:,} bytes sent per rank and step")


ZERO1_CASES = ((4, 16, 2, 0.1, 0.9), (3, 9, 3, 0.05, 0.5), (2, 10, 2, 0.1, 0.9))
"""The visible check's (ranks, numel, steps, lr, momentum): 4, 3 and 2 ranks, two learning rates and momenta."""


def check_zero1_sgd_step(fn: Callable[..., None], cases: tuple[tuple[int, int, int, float, float], ...] = ZERO1_CASES,
                         seed: int = 0, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, numel, steps, lr, momentum). After each step every rank's ``param`` must equal
    single-process SGD with momentum on the gradient averaged over ranks; ``state["momentum_buffer"]`` must be this
    rank's shard of the momentum (numel / N elements); each call sends 2 (N-1)/N x 4 numel bytes (reduce-scatter +
    all-gather)."""
    return run_check("zero1_sgd_step", lambda: "; ".join(
        _check_zero1_case(fn, *case, seed, timeout) for case in cases))


def _check_gather_case(fn: Callable[..., list[torch.Tensor]], world_size: int, shapes: tuple[tuple[int, ...], ...],
                       dtype: str, seed: int, timeout: float) -> str:
    n = world_size
    lay = FlatLayout.build([f"p{i}" for i in range(len(shapes))], shapes, n)
    flat = torch.zeros(lay.padded_numel, dtype=getattr(torch, dtype))
    flat[:lay.numel] = _param0(lay.numel, seed)
    es = flat.element_size()
    expected = lay.views(flat)
    results = _launch(_gather_on_rank, n, fn, [tuple(s) for s in shapes], seed, dtype, timeout=timeout)
    for r, res in enumerate(results):
        facts = res["facts"]
        if facts is None or len(facts) != len(shapes):
            raise CheckFailed(f"rank {r}: gather_unit must return a list of {len(shapes)} tensors (one per shape "
                              f"{list(shapes)}), got {res['type']}" + (f" of {len(facts)}" if facts else ""))
        for i, (f, e) in enumerate(zip(facts, expected, strict=True)):
            if not f["tensor"]:
                raise CheckFailed(f"rank {r}: element {i} of the result is not a tensor")
            expect_close(f["value"], e, f"rank {r}'s parameter {i} (shape {tuple(e.shape)}, at offset "
                         f"{lay.offsets[i]} of the unit; {n} ranks, {lay.numel} elements padded to "
                         f"{lay.padded_numel})", rtol=0.0, atol=0.0)
        storages = {f["storage"] for f in facts}
        if len(storages) != 1:
            raise CheckFailed(f"rank {r}: the {len(shapes)} parameters live in {len(storages)} different storages;"
                              " they must be views of the one gathered buffer (no copies: a copy doubles the "
                              "unit's memory at the peak, and one resize of the buffer must free them all)")
        if facts[0]["storage_bytes"] != es * lay.padded_numel:
            raise CheckFailed(f"rank {r}: the parameters are views of a buffer of {facts[0]['storage_bytes']:,} "
                              f"bytes; the gathered unit is {lay.padded_numel} {dtype} = "
                              f"{es * lay.padded_numel:,} bytes (the buffer takes the shard's dtype)")
        for i, f in enumerate(facts):
            if f["offset_bytes"] != es * lay.offsets[i]:
                raise CheckFailed(f"rank {r}: parameter {i} starts {f['offset_bytes']} bytes into the buffer; "
                                  f"expected {es * lay.offsets[i]} (element {lay.offsets[i]})")
        if res["shard_modified"]:
            raise CheckFailed(f"rank {r}: the function modified its input shard; leave it as it was")
        _check_comm(res["comm"], (n - 1) * es * lay.padded_numel // n,
                    f"gathering the unit (one all-gather of {es * lay.padded_numel:,} bytes sends (N-1)/N x V)", r)
    return (f"{n} ranks, shapes {list(shapes)} ({lay.numel} elements padded to {lay.padded_numel}): views of one "
            f"buffer, exact; {(n - 1) * es * lay.padded_numel // n:,} bytes sent per rank")


GATHER_CASES = ((4, ((3, 5), (7,), (2, 2)), "float32"), (3, ((4, 4), (1,), (2,)), "float64"),
                (2, ((5,), (2, 3), (1,)), "float32"))
"""The visible check's (ranks, shapes, dtype): 4, 3 and 2 ranks, a float64 unit, a unit N divides."""


def check_gather_unit(fn: Callable[..., list[torch.Tensor]],
                      cases: tuple[tuple[int, tuple[tuple[int, ...], ...], str], ...] = GATHER_CASES, seed: int = 0,
                      timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, shapes, dtype). Every rank must return the unit's parameters (shapes, in order, in the
    shard's dtype) exactly, as views of one buffer holding the whole padded unit (parameter i at its offset), leave
    its shard unchanged, and send (N-1)/N x the padded unit's bytes (one all-gather)."""
    return run_check("gather_unit", lambda: "; ".join(
        _check_gather_case(fn, n, tuple(shapes), dtype, seed, timeout) for n, shapes, dtype in cases))


def _check_grad_shard_case(fn: Callable[[torch.Tensor], torch.Tensor], world_size: int, cases: tuple[int, ...],
                           dtypes: tuple[torch.dtype, ...], seed: int, timeout: float) -> str:
    n = world_size
    results = _launch(_grad_shard_on_rank, n, fn, list(cases), seed, list(dtypes), timeout=timeout)
    for k, (dtype, numel) in enumerate((d, c) for d in dtypes for c in cases):
        lay = FlatLayout.build(["g"], [(numel,)], n)
        mean = torch.zeros(lay.padded_numel, dtype=dtype)
        mean[:numel] = sum(_grad(numel, seed, 0, r).to(dtype) for r in range(n)) / n
        elem = torch.empty((), dtype=dtype).element_size()
        for r, per_rank in enumerate(results):
            lo, hi = lay.bounds(r)
            expect_close(per_rank[k]["got"], mean[lo:hi], f"rank {r}'s gradient shard (numel {numel} padded to "
                         f"{lay.padded_numel} on {n} ranks: elements [{lo}, {hi}) of the mean gradient, in the "
                         f"input's dtype {str(dtype).removeprefix('torch.')})")
            _check_comm(per_rank[k]["comm"], (n - 1) * elem * lay.padded_numel // n,
                        f"numel {numel} (one reduce-scatter of the padded {elem * lay.padded_numel:,} bytes "
                        "sends (N-1)/N x V)", r)
    kinds = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    return f"{n} ranks, numel {list(cases)}, {kinds}: every rank's shard right, one reduce-scatter each"


GRAD_SHARD_CASES = ((4, (16, 10)), (3, (9, 11)), (2, (2, 7)))
"""The visible check's (ranks, numels): 4, 3 and 2 ranks, numels that divide and that need padding."""


def check_grad_shard(fn: Callable[[torch.Tensor], torch.Tensor],
                     cases: tuple[tuple[int, tuple[int, ...]], ...] = GRAD_SHARD_CASES,
                     dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64), seed: int = 0,
                     timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, numels). For each dtype and numel: every rank's result must be its shard (``FlatLayout``
    bounds) of the padded gradient averaged over ranks, a tensor of S elements in the input's dtype, from one
    reduce-scatter of the padded buffer."""
    return run_check("grad_shard", lambda: "; ".join(
        _check_grad_shard_case(fn, n, tuple(numels), tuple(dtypes), seed, timeout) for n, numels in cases))


EXERCISES = [
    Exercise("shard_range", "Owner rule with padding", 2, "shard_range", check_shard_range,
             hidden=[{"cases": ((1, 1), (7, 2), (9, 3), (2, 8), (1000, 7), (43791, 4), (6_738_415_616, 64))}]),
    Exercise("zero1_sgd_step", "A ZeRO-1 optimizer step on real ranks", 4, "zero1_sgd_step", check_zero1_sgd_step,
             hidden=[{"cases": ((2, 12, 3, 0.1, 0.9),), "seed": 1}, {"cases": ((3, 9, 2, 0.05, 0.5),), "seed": 2},
                     {"cases": ((4, 1000, 2, 0.2, 0.8),), "seed": 3}],
             allowed=("course_lib.comm",)),
    Exercise("gather_unit", "Gather an FSDP unit as views of one buffer", 3, "gather_unit", check_gather_unit,
             hidden=[{"cases": ((2, ((5,), (2, 3)), "float32"),), "seed": 1},
                     {"cases": ((3, ((4, 4), (1,), (3,)), "float32"),), "seed": 2},
                     {"cases": ((4, ((33, 33), (65,)), "float32"),), "seed": 3},
                     {"cases": ((2, ((3, 3), (5,)), "float64"),), "seed": 4}],
             allowed=("course_lib.comm",)),
    Exercise("grad_shard", "Find the bug: the gradient reduce-scatter", 3, "grad_shard", check_grad_shard,
             hidden=[{"cases": ((2, (2, 7, 1)),), "seed": 1}, {"cases": ((3, (9, 3, 11)),), "seed": 2},
                     {"cases": ((4, (8780, 17457)),), "seed": 3}],
             allowed=("course_lib.comm",)),
]

def _ranks_of(calls: list[dict]) -> set[str]:
    sizes = [case[0] for case in each(calls)]
    return several(sizes, "world sizes").union(*(ranks(n) for n in sizes))


def _padding(numel: int, n: int) -> str:
    return "a buffer that needs padding" if numel % n else "a buffer N divides"


CASE_CLASSES = {
    "shard_range": lambda calls: {_padding(numel, n) for numel, n in each(calls)}
    | {"one rank" for _, n in each(calls) if n == 1} | {"fewer elements than ranks" for m, n in each(calls) if m < n}
    | {"more than 2^32 elements" for m, _ in each(calls) if m > 2**32},
    "zero1_sgd_step": lambda calls: _ranks_of(calls) | several((c[3:] for c in each(calls)), "learning rates"),
    "gather_unit": lambda calls: _ranks_of(calls) | {_padding(sum(math.prod(x) for x in shapes), n)
                                                     for n, shapes, _ in each(calls)}
    | {dtype for *_, dtype in each(calls)},
    "grad_shard": lambda calls: _ranks_of(calls) | {_padding(m, n) for n, numels in each(calls) for m in numels}
    | {str(d) for c in calls for d in c["dtypes"]},
}

guard_visible_checks(globals(), EXERCISES)
