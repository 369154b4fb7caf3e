"""Chapter 04 — tensor parallelism. Every exercise runs the learner's code on real gloo ranks.

1. ``sp_region(x, norm_w, w1, b1, w2, b2)``: a sequence-parallel region (Korthikanti et al. 2022) on real ranks:
   x is this rank's sequence shard [b, s/t, h]; RMSNorm on the shard (replicated ``norm_w``), g-bar (all-gather
   along the sequence forward, reduce-scatter backward), the column -> row GELU MLP from this rank's shards, g
   (reduce-scatter forward, all-gather backward), then the replicated ``b2`` on the shard. The replicated
   parameters' gradients (``norm_w``, ``b2``) are all-reduced over the ranks in backward (forgetting it leaves
   each rank with its own tokens' gradient: the copies drift apart). Checked: output shard, every gradient, the
   comm log (a second backward all-gather, re-gathering a saved shard as the library does, is allowed).
2. ``copy_to_region(x)`` (find the bug): Megatron's f, identity forward, all-reduce of the gradient backward. The
   colleague's version averages the gradient over the ranks (divides by t, as DP would); the fixed one sums it.
3. ``tp_mlp(x, w1, b1, w2, b2)``: a GELU MLP column -> row from this rank's shards (``w1`` [f/t, h] rows of fc1,
   ``b1`` its slice of fc1's bias, ``w2`` [h, f/t] columns of fc2, ``b2`` fc2's whole bias, added once), with f in
   and g out (the library's ``tp.copy_to_tensor_parallel_region`` / ``tp.reduce_from_tensor_parallel_region`` or
   the learner's own). Checked: output, input gradient, every shard's gradient vs the matching slice of one
   process, and one all-reduce of b*s*h each way.
4. ``vocab_parallel_cross_entropy(logits, targets)``: mean cross-entropy from this rank's vocabulary shard
   [..., V/t] (rank r holds columns [r V/t, (r+1) V/t)); exactly three ``comm.all_reduce`` calls of b*s fp32
   values forward (max, target logit, sum of exponentials) and no gathered logits; stable for logits x 1000;
   gradient of each shard = the slice of the single-process gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from course_lib import comm
from course_lib.grading import core
from course_lib.grading.core import CheckFailed, CheckResult, Exercise, expect_close, guard_visible_checks, run_check
from course_lib.model import MLP, GPTConfig

GRADER_PARAMETERS = {"seed": 1}
LAUNCH_TIMEOUT_S = 40.0
"""A launched check stops the ranks after this long (below the grader's 60 s per check)."""

_launch = functools.partial(
    core.launch_check, hang_hint=" (a collective that not every rank calls, or calls in another order?)",
    course_files=("course_lib/grading/ch04.py", "course_lib/comm.py", "course_lib/parallel/tp_comm.py"))


def _rand(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ops(log: comm.CommLog) -> list[tuple[str, int]]:
    return [(r.op, r.tensor_bytes) for r in log.records]


# ----------------------------------------------------------------------------------------------------------------
# 1. a sequence-parallel region


def _sp_reference(h: int, seed: int) -> dict[str, torch.Tensor]:
    mlp = _mlp_reference(h, seed)
    return {"norm_w": 1.0 + 0.1 * _rand((h,), seed + 9), "w1": mlp.fc1.weight.detach(), "b1": mlp.fc1.bias.detach(),
            "w2": mlp.fc2.weight.detach(), "b2": mlp.fc2.bias.detach()}


def sp_reference_forward(x: torch.Tensor, norm_w: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
                         w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """One process: ``GeLU(RMSNorm(x) W1^T + b1) W2^T + b2``, RMSNorm with eps 1e-5 over the last dim."""
    return F.linear(F.gelu(F.linear(F.rms_norm(x, (x.shape[-1],), norm_w, eps=1e-5), w1, b1)), w2, b2)


def _sp_on_rank(rank: int, world_size: int, fn: Callable[..., Any], shape: tuple[int, int, int],
                seed: int) -> dict[str, Any]:
    ref = _sp_reference(shape[-1], seed)
    shards = [ref["norm_w"], ref["w1"].chunk(world_size, 0)[rank], ref["b1"].chunk(world_size)[rank],
              ref["w2"].chunk(world_size, 1)[rank], ref["b2"]]
    params = [s.clone().requires_grad_(True) for s in shards]
    x = _rand(shape, seed + 1).chunk(world_size, 1)[rank].clone().requires_grad_(True)
    upstream = _rand(shape, seed + 2).chunk(world_size, 1)[rank]
    with comm.recording() as fwd:
        out = fn(x, *params)
    if not isinstance(out, torch.Tensor):
        return {"type": type(out).__name__}
    if tuple(out.shape) != tuple(x.shape):
        return {"type": f"Tensor of shape {tuple(out.shape)}, expected this rank's shard {tuple(x.shape)}"}
    with comm.recording() as bwd:
        out.backward(upstream)
    return {"type": "Tensor", "out": out.detach().clone(), "x_grad": x.grad, "grads": [p.grad for p in params],
            "fwd": _ops(fwd), "bwd": _ops(bwd)}


def _sp_comm_problem(fwd: list[tuple[str, int]], bwd: list[tuple[str, int]], full: int, h: int) -> str:
    """'' when the comm log is an SP region's: forward one all-gather and one reduce-scatter of the full activation;
    backward one reduce-scatter, one or two all-gathers (the second: re-gathering a saved shard) and all-reduces
    of the two replicated parameters' gradients (2h fp32 values, in one call or two); else what is wrong."""
    if sorted(fwd) != [("all_gather", full), ("reduce_scatter", full)]:
        return (f"forward: expected one all-gather (g-bar) and one reduce-scatter (g) of the whole [b, s, h] "
                f"activation ({full} B) through course_lib.comm, got {fwd}")
    gathers = [op for op in bwd if op == ("all_gather", full)]
    scatters = [op for op in bwd if op == ("reduce_scatter", full)]
    reduced = [b for op, b in bwd if op == "all_reduce"]
    if len(scatters) != 1 or len(gathers) not in (1, 2) or sum(reduced) != 2 * h * 4 or \
            len(gathers) + len(scatters) + len(reduced) != len(bwd):
        return (f"backward: expected one reduce-scatter and one all-gather of {full} B (a second all-gather if you "
                f"re-gather a saved shard) and all-reduces of {2 * h * 4} B in all (the replicated parameters' "
                f"gradients), got {bwd}")
    return ""


def check_sp_region(fn: Callable, world_size: int = 2, shape: tuple[int, int, int] = (2, 8, 16), seed: int = 0,
                    timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    def body() -> str:
        if shape[1] % world_size:
            raise ValueError(f"check_sp_region: the sequence length {shape[1]} must divide by {world_size} ranks")
        results = _launch(_sp_on_rank, world_size, fn, tuple(shape), seed, timeout=timeout)
        ref = _sp_reference(shape[-1], seed)
        params = {k: v.clone().requires_grad_(True) for k, v in ref.items()}
        x = _rand(shape, seed + 1).requires_grad_(True)
        out = sp_reference_forward(x, **params)
        out.backward(_rand(shape, seed + 2))
        names = ["norm_w", "w1", "b1", "w2", "b2"]
        full_grads = [params[k].grad for k in names]
        full = x.numel() * 4
        for r, res in enumerate(results):
            if res["type"] != "Tensor":
                raise CheckFailed(f"rank {r}: sp_region must return a torch.Tensor, got {res['type']}")
            tol = {"rtol": 1e-4, "atol": 1e-5}
            expect_close(res["out"], out.detach().chunk(world_size, 1)[r], f"rank {r}: output vs tokens "
                         f"[{r} s/t, {r + 1} s/t) of the single-process block", **tol)
            if res["x_grad"] is None:
                raise CheckFailed(f"rank {r}: x.grad is None: the output must depend on x through autograd")
            expect_close(res["x_grad"], x.grad.chunk(world_size, 1)[r], f"rank {r}: gradient of this rank's "
                         "sequence shard x", **tol)
            for name, g, want in zip(names, res["grads"], full_grads, strict=True):
                want = want.chunk(world_size, 0)[r] if name in ("w1", "b1") else \
                    want.chunk(world_size, 1)[r] if name == "w2" else want
                if g is None:
                    raise CheckFailed(f"rank {r}: {name} got no gradient")
                replicated = " (replicated: every rank must end with the gradient of all s tokens)" \
                    if name in ("norm_w", "b2") else ""
                expect_close(g, want, f"rank {r}: gradient of {name} vs one process's{replicated}", **tol)
            problem = _sp_comm_problem(res["fwd"], res["bwd"], full, shape[-1])
            if problem:
                raise CheckFailed(f"rank {r}: {problem}")
        return f"{world_size} ranks, x {tuple(shape)}: output, every gradient and the comm log of an SP region"
    return run_check("sp_region", body)


# ----------------------------------------------------------------------------------------------------------------
# 2. f (find the bug)


def _region_on_rank(rank: int, world_size: int, fn: Callable[..., Any], shape: tuple[int, ...],
                    seed: int) -> dict[str, Any]:
    x = _rand(shape, seed + rank).requires_grad_(True)
    before = x.detach().clone()
    upstream = _rand(shape, seed + 100 + rank)
    with comm.recording() as fwd:
        out = fn(x)
    if not isinstance(out, torch.Tensor):
        return {"type": type(out).__name__}
    with comm.recording() as bwd:
        out.backward(upstream)
    return {"type": "Tensor", "out": out.detach().clone(), "grad": None if x.grad is None else x.grad.clone(),
            "x_after": x.detach().clone(), "x_before": before, "fwd": _ops(fwd), "bwd": _ops(bwd)}


def check_copy_to_region(fn: Callable, world_size: int = 2, shape: tuple[int, ...] = (2, 3, 4), seed: int = 0,
                         timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    name = "copy_to_region"

    def body() -> str:
        results = _launch(_region_on_rank, world_size, fn, tuple(shape), seed, timeout=timeout)
        xs = [_rand(shape, seed + r) for r in range(world_size)]
        ups = [_rand(shape, seed + 100 + r) for r in range(world_size)]
        nbytes = xs[0].numel() * 4
        for r, res in enumerate(results):
            if res["type"] != "Tensor":
                raise CheckFailed(f"rank {r}: {name}(x) must return a torch.Tensor, got {res['type']}")
            if not torch.equal(res["x_after"], res["x_before"]):
                raise CheckFailed(f"rank {r}: {name} modified its input x in place: work on a copy")
            if res["grad"] is None:
                raise CheckFailed(f"rank {r}: x.grad is None after backward: the output must stay connected to x "
                                  "(a torch.autograd.Function)")
            expect_close(res["out"], xs[r], f"rank {r}: forward of f = x, unchanged")
            expect_close(res["grad"], sum(ups), f"rank {r}: backward of f = the sum of the upstream gradients "
                         f"over {world_size} ranks (each rank's shard used the same x)")
            if res["fwd"] != [] or res["bwd"] != [("all_reduce", nbytes)]:
                raise CheckFailed(f"rank {r}: communication through course_lib.comm: expected forward [] "
                                  f"and backward {[('all_reduce', nbytes)]}, got {res['fwd']} and {res['bwd']}")
        return f"{world_size} ranks, shape {tuple(shape)}: forward, backward and the comm log correct"
    return run_check(name, body)


# ----------------------------------------------------------------------------------------------------------------
# 3. the TP MLP


def _mlp_reference(d_model: int, seed: int) -> MLP:
    torch.manual_seed(seed)
    mlp = MLP(GPTConfig(d_model=d_model, n_head=1))
    with torch.no_grad():
        mlp.fc1.bias.copy_(_rand(tuple(mlp.fc1.bias.shape), seed + 7) * 0.1)
        mlp.fc2.bias.copy_(_rand(tuple(mlp.fc2.bias.shape), seed + 8) * 0.1)
    return mlp


def _mlp_on_rank(rank: int, world_size: int, fn: Callable[..., Any], shape: tuple[int, int, int],
                 seed: int) -> dict[str, Any]:
    mlp = _mlp_reference(shape[-1], seed)
    shards = [mlp.fc1.weight.detach().chunk(world_size, 0)[rank], mlp.fc1.bias.detach().chunk(world_size)[rank],
              mlp.fc2.weight.detach().chunk(world_size, 1)[rank], mlp.fc2.bias.detach()]
    params = [s.clone().requires_grad_(True) for s in shards]
    x = _rand(shape, seed + 1).requires_grad_(True)
    with comm.recording() as fwd:
        out = fn(x, *params)
    if not isinstance(out, torch.Tensor):
        return {"type": type(out).__name__}
    if tuple(out.shape) != tuple(shape):
        return {"type": f"Tensor of shape {tuple(out.shape)}, expected {tuple(shape)}"}
    with comm.recording() as bwd:
        (out * _rand(tuple(shape), seed + 2)).sum().backward()
    return {"type": "Tensor", "out": out.detach().clone(), "x_grad": x.grad,
            "grads": [p.grad for p in params], "fwd": _ops(fwd), "bwd": _ops(bwd)}


def check_tp_mlp(fn: Callable, world_size: int = 2, shape: tuple[int, int, int] = (2, 8, 32), seed: int = 0,
                 timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    def body() -> str:
        results = _launch(_mlp_on_rank, world_size, fn, tuple(shape), seed, timeout=timeout)
        ref = _mlp_reference(shape[-1], seed)
        x = _rand(shape, seed + 1).requires_grad_(True)
        out = ref(x)
        (out * _rand(shape, seed + 2)).sum().backward()
        full = [ref.fc1.weight.grad, ref.fc1.bias.grad, ref.fc2.weight.grad, ref.fc2.bias.grad]
        names = ["w1 (fc1 rows)", "b1 (fc1 bias slice)", "w2 (fc2 columns)", "b2 (fc2 bias)"]
        nbytes = x.numel() * 4
        for r, res in enumerate(results):
            if res["type"] != "Tensor":
                raise CheckFailed(f"rank {r}: tp_mlp must return a torch.Tensor, got {res['type']}")
            expect_close(res["out"], out.detach(), f"rank {r}: tp_mlp output vs the single-process MLP", rtol=1e-4,
                         atol=1e-6)
            if res["x_grad"] is None:
                raise CheckFailed(f"rank {r}: x.grad is None: the output must depend on x through autograd")
            expect_close(res["x_grad"], x.grad, f"rank {r}: input gradient (did f all-reduce it in backward?)",
                         rtol=1e-4, atol=1e-6)
            for i, (name, g) in enumerate(zip(names, res["grads"], strict=True)):
                want = full[i].chunk(world_size, 0)[r] if i < 2 else full[i].chunk(world_size, 1)[r] if i == 2 \
                    else full[i]
                if g is None:
                    raise CheckFailed(f"rank {r}: {name} got no gradient")
                expect_close(g, want, f"rank {r}: gradient of {name} vs the slice of one process's gradient",
                             rtol=1e-4, atol=1e-6)
            if res["fwd"] != [("all_reduce", nbytes)] or res["bwd"] != [("all_reduce", nbytes)]:
                raise CheckFailed(f"rank {r}: expected one all-reduce of {nbytes} B forward (g) and one backward (f) "
                                  f"through course_lib.comm, got forward {res['fwd']}, backward {res['bwd']}")
        return f"{world_size} ranks, x {tuple(shape)}: output, input and shard gradients match one process"
    return run_check("tp_mlp", body)


# ----------------------------------------------------------------------------------------------------------------
# 4. vocab-parallel cross-entropy


def _ce_inputs(n: int, vocab: int, scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _rand((n, vocab), seed) * scale
    targets = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed + 1))
    return logits, targets


def _ce_on_rank(rank: int, world_size: int, fn: Callable[..., Any], n: int, vocab: int, scale: float,
                seed: int) -> dict[str, Any]:
    logits, targets = _ce_inputs(n, vocab, scale, seed)
    shard = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
    with comm.recording() as fwd:
        loss = fn(shard, targets)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        return {"type": f"{type(loss).__name__} {getattr(loss, 'shape', '')}"}
    with comm.recording() as bwd:
        loss.backward()
    return {"type": "scalar", "loss": loss.detach().clone(), "grad": shard.grad,
            "fwd": [(r.op, r.tensor_bytes) for r in fwd.records], "bwd": _ops(bwd)}


def check_vocab_parallel_cross_entropy(fn: Callable, world_size: int = 2, n: int = 16, vocab: int = 64,
                                       scale: float = 1.0, seed: int = 0,
                                       timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    def body() -> str:
        results = _launch(_ce_on_rank, world_size, fn, n, vocab, scale, seed, timeout=timeout)
        logits, targets = _ce_inputs(n, vocab, scale, seed)
        full = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(full, targets)
        ref.backward()
        for r, res in enumerate(results):
            if res["type"] != "scalar":
                raise CheckFailed(f"rank {r}: must return the mean loss as a 0-d tensor, got {res['type']}")
            if not torch.isfinite(res["loss"]):
                raise CheckFailed(f"rank {r}: the loss is not finite for logits scaled by {scale:g}: subtract the "
                                  "global max before exponentiating")
            expect_close(res["loss"], ref.detach(), f"rank {r}: loss vs F.cross_entropy of the full logits "
                         f"(x{scale:g})", rtol=1e-5, atol=1e-5)
            if res["grad"] is None:
                raise CheckFailed(f"rank {r}: the logit shard got no gradient")
            expect_close(res["grad"], full.grad.chunk(world_size, -1)[r], f"rank {r}: gradient of the logit shard "
                         "vs the slice of the single-process gradient", rtol=1e-4, atol=1e-7)
            expected = [("all_reduce", n * 4)] * 3
            if res["fwd"] != expected:
                raise CheckFailed(f"rank {r}: expected exactly 3 all-reduces of {n} fp32 values ({n * 4} B) through "
                                  f"course_lib.comm (max, target logit, sum of exponentials), got {res['fwd']}")
        return f"{world_size} ranks, {n} tokens, vocabulary {vocab}, logits x{scale:g}: loss, gradients and bytes"
    return run_check("vocab_parallel_cross_entropy", body)


SP_OFF_LIMITS = (
    *(f"course_lib.parallel.tp_comm.{name}" for name in (
        "GatherFromSequenceParallelRegion", "ReduceScatterToSequenceParallelRegion",
        "ScatterToSequenceParallelRegion", "SequenceParallelLinears", "sequence_parallel_linears",
        "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
        "scatter_to_sequence_parallel_region", "all_gather_along", "reduce_scatter_along")),
    "course_lib.parallel.tp_layers.enter_tp_region", "course_lib.parallel.tp_layers.leave_tp_region",
    "course_lib.parallel.tp_layers.TensorParallelMLP")
"""The library's SP region pieces: the exercise's answer."""

EXERCISES = [
    Exercise("sp_region", "A sequence-parallel region on ranks", 4, "sp_region", check_sp_region,
             hidden=[{"world_size": 4, "shape": (1, 8, 16), "seed": 2},
                     {"world_size": 2, "shape": (3, 4, 8), "seed": 7}],
             off_limits=SP_OFF_LIMITS),
    Exercise("copy_to_region", "Find the bug: f's backward, averaged", 2, "copy_to_region",
             check_copy_to_region, hidden=[{"world_size": 4, "shape": (4, 2, 2), "seed": 3}],
             off_limits=("course_lib.parallel.tp_comm.CopyToTensorParallelRegion",
                         "course_lib.parallel.tp_comm.copy_to_tensor_parallel_region")),
    Exercise("tp_mlp", "A column-parallel then row-parallel MLP", 3, "tp_mlp", check_tp_mlp,
             hidden=[{"world_size": 4, "shape": (1, 4, 16), "seed": 4}],
             off_limits=("course_lib.parallel.tp_layers.TensorParallelMLP",
                         "course_lib.parallel.tp_layers.ColumnParallelLinear",
                         "course_lib.parallel.tp_layers.RowParallelLinear")),
    Exercise("vocab_parallel_cross_entropy", "Vocab-parallel cross-entropy", 3, "vocab_parallel_cross_entropy",
             check_vocab_parallel_cross_entropy,
             hidden=[{"world_size": 4, "n": 12, "vocab": 32, "scale": 1000.0, "seed": 5},
                     {"world_size": 2, "n": 1, "vocab": 8, "seed": 6}],
             off_limits=("course_lib.parallel.tp_layers.vocab_parallel_cross_entropy",)),
]

guard_visible_checks(globals(), EXERCISES)
