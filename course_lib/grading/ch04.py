"""Chapter 04 — tensor parallelism. Every exercise runs the learner's code on real gloo ranks (2 and 4) and
compares it with one process; communication is read from ``course_lib.comm``'s log.

1. ``sp_region(x, norm_w, w1, b1, w2, b2)``: a sequence-parallel region (Korthikanti et al. 2022). Checked: each
   rank's output shard, the gradient of x and of every parameter (the replicated ones included), and the kind and
   size of each collective forward and backward.
2. ``vocab_parallel_embedding(ids, weight)``: a vocabulary-parallel embedding (Shoeybi et al. 2019). Checked: the
   output on every rank, the shard's gradient against its rows of one process's, ids left unchanged, and the
   collectives forward and backward; the ids include the first and last id of every shard.
3. ``gqa_attention(x, wq, wk, wv, wo, n_head=, n_kv_head=)``: causal grouped-query attention (Ainslie et al. 2023)
   split by heads, with t dividing n_kv_head and n_kv_head dividing t. Checked: the output, the gradients of x
   and of every shard, and each collective's size and group size.
4. ``vocab_parallel_cross_entropy(logits, targets)``: the mean cross-entropy from this rank's vocabulary shard.
   Checked: the loss (finite for logits x 1000), each shard's gradient, and the forward's collectives.

Each check runs two world sizes at least (and, where a size is the answer's to read, two vocabularies): an answer
that hard-codes the rank count or the vocabulary fails the notebook's self-check, not only the grader.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from course_lib import comm
from course_lib.grading import core
from course_lib.grading.cases import each, ranks, several
from course_lib.grading.core import CheckFailed, CheckResult, Exercise, expect_close, guard_visible_checks, run_check
from course_lib.layers import MLP, Attention
from course_lib.model_config import GPTConfig

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


def _mlp_reference(d_model: int, seed: int) -> MLP:
    torch.manual_seed(seed)
    mlp = MLP(GPTConfig(d_model=d_model, n_head=1))
    with torch.no_grad():
        mlp.fc1.bias.copy_(_rand(tuple(mlp.fc1.bias.shape), seed + 7) * 0.1)
        mlp.fc2.bias.copy_(_rand(tuple(mlp.fc2.bias.shape), seed + 8) * 0.1)
    return mlp


def _sp_reference(h: int, seed: int) -> dict[str, torch.Tensor]:
    mlp = _mlp_reference(h, seed)
    return {"norm_w": 1.0 + 0.1 * _rand((h,), seed + 9), "w1": mlp.fc1.weight.detach(), "b1": mlp.fc1.bias.detach(),
            "w2": mlp.fc2.weight.detach(), "b2": mlp.fc2.bias.detach()}


def sp_reference_forward(x: torch.Tensor, norm_w: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
                         w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """One process: ``GeLU(RMSNorm(x) W1^T + b1) W2^T + b2``, RMSNorm with eps 1e-5 over the last dim."""
    return F.linear(F.gelu(F.linear(F.rms_norm(x, (x.shape[-1],), norm_w, eps=1e-5), w1, b1)), w2, b2)


_PRODUCTS = frozenset({F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
                       torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.einsum})
"""The products a column-parallel layer may be written with."""


class _ProductInputs(TorchFunctionMode):
    """On a rank, while the learner's forward runs: the activation of every product with ``weight`` (a tensor
    sharing its storage: the weight, its transpose, a view), flattened to rows of the weight's input width."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.storage, self.width, self.rows = weight.untyped_storage().data_ptr(), weight.shape[-1], []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _PRODUCTS:
            flat = [x for a in args for x in (a if isinstance(a, list | tuple) else [a])]
            operands = [a for a in flat if isinstance(a, torch.Tensor)]
            mine = [a for a in operands if a.untyped_storage().data_ptr() == self.storage]
            inputs = [a for a in operands if a.untyped_storage().data_ptr() != self.storage and a.dim() >= 2
                      and a.shape[-1] == self.width]  # a bias is 1-D
            if mine and len(inputs) == 1:
                self.rows.append(inputs[0].detach().reshape(-1, self.width).clone())
        return func(*args, **(kwargs or {}))


def _sp_on_rank(rank: int, world_size: int, fn: Callable[..., Any], shape: tuple[int, int, int],
                seed: int) -> dict[str, Any]:
    ref = _sp_reference(shape[-1], seed)
    shards = [ref["norm_w"], ref["w1"].chunk(world_size, 0)[rank], ref["b1"].chunk(world_size)[rank],
              ref["w2"].chunk(world_size, 1)[rank], ref["b2"]]
    params = [s.clone().requires_grad_(True) for s in shards]
    x = _rand(shape, seed + 1).chunk(world_size, 1)[rank].clone().requires_grad_(True)
    upstream = _rand(shape, seed + 2).chunk(world_size, 1)[rank]
    seen = _ProductInputs(params[1])
    with comm.recording() as fwd, seen:
        out = fn(x, *params)
    if not isinstance(out, torch.Tensor):
        return {"type": type(out).__name__}
    if tuple(out.shape) != tuple(x.shape):
        return {"type": f"Tensor of shape {tuple(out.shape)}, expected this rank's shard {tuple(x.shape)}"}
    with comm.recording() as bwd:
        out.backward(upstream)
    return {"type": "Tensor", "out": out.detach().clone(), "x_grad": x.grad, "grads": [p.grad for p in params],
            "fwd": _ops(fwd), "bwd": _ops(bwd), "w1_rows": torch.cat(seen.rows) if seen.rows else None}


SP_CASES = ((2, (2, 8, 16)), (4, (2, 8, 16)))
"""The visible check's (ranks, shape): two world sizes, two sequences a batch (their order shows)."""


def _sp_comm_problem(fwd: list[tuple[str, int]], bwd: list[tuple[str, int]], full: int, h: int) -> str:
    """'' when the comm log is an SP region's: forward one all-gather and one reduce-scatter of the full activation;
    backward one reduce-scatter, one or two all-gathers (the second: re-gathering a saved shard) and all-reduces
    of the two replicated parameters' gradients (2h fp32 values, in one call or two); else what is wrong."""
    if sorted(fwd) != [("all_gather", full), ("reduce_scatter", full)]:
        return (f"forward: expected one all-gather (g) and one reduce-scatter (g-bar) of the whole [b, s, h] "
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


def _in_order(rows: torch.Tensor | None, normed: torch.Tensor, what: str) -> None:
    """The rows the column-parallel product saw are the whole sequence's, in order (skipped when the check saw no
    product with w1)."""
    if rows is None:
        return
    want = normed.reshape(-1, normed.shape[-1])
    if rows.shape == want.shape and torch.allclose(rows, want, rtol=1e-4, atol=1e-5):
        return
    b, s = normed.shape[:2]
    raise CheckFailed(f"{what}: the product with w1 saw {rows.shape[0]} rows that are not the {b} x {s} tokens of the "
                      "sequences in order: g joins the shards along the sequence (dim 1), rank r's tokens after "
                      "rank r-1's, so that the layers of the region see every sequence whole (joined along "
                      "another dim, the tokens of the sequences mix: token by token the MLP cannot tell, the "
                      "attention an SP region also wraps can)")


def _check_sp_case(fn: Callable, world_size: int, shape: tuple[int, int, int], seed: int, timeout: float) -> str:
    if shape[1] % world_size:
        raise ValueError(f"check_sp_region: the sequence length {shape[1]} must divide by {world_size} ranks")
    where = f"{world_size} ranks, x {tuple(shape)}"
    results = _launch(_sp_on_rank, world_size, fn, tuple(shape), seed, timeout=timeout)
    ref = _sp_reference(shape[-1], seed)
    params = {k: v.clone().requires_grad_(True) for k, v in ref.items()}
    x = _rand(shape, seed + 1).requires_grad_(True)
    out = sp_reference_forward(x, **params)
    out.backward(_rand(shape, seed + 2))
    normed = F.rms_norm(x.detach(), (shape[-1],), ref["norm_w"], eps=1e-5)
    names = ["norm_w", "w1", "b1", "w2", "b2"]
    full_grads = [params[k].grad for k in names]
    full = x.numel() * 4
    for r, res in enumerate(results):
        if res["type"] != "Tensor":
            raise CheckFailed(f"{where}, rank {r}: sp_region must return a torch.Tensor, got {res['type']}")
        tol = {"rtol": 1e-4, "atol": 1e-5}
        expect_close(res["out"], out.detach().chunk(world_size, 1)[r], f"{where}, rank {r}: output vs tokens "
                     f"[{r} s/t, {r + 1} s/t) of the single-process block", **tol)
        if res["x_grad"] is None:
            raise CheckFailed(f"{where}, rank {r}: x.grad is None: the output must depend on x through autograd")
        expect_close(res["x_grad"], x.grad.chunk(world_size, 1)[r], f"{where}, rank {r}: gradient of this rank's "
                     "sequence shard x", **tol)
        for name, g, want in zip(names, res["grads"], full_grads, strict=True):
            want = want.chunk(world_size, 0)[r] if name in ("w1", "b1") else \
                want.chunk(world_size, 1)[r] if name == "w2" else want
            if g is None:
                raise CheckFailed(f"{where}, rank {r}: {name} got no gradient")
            replicated = " (replicated: every rank must end with the gradient of all s tokens)" \
                if name in ("norm_w", "b2") else ""
            expect_close(g, want, f"{where}, rank {r}: gradient of {name} vs one process's{replicated}", **tol)
        problem = _sp_comm_problem(res["fwd"], res["bwd"], full, shape[-1])
        if problem:
            raise CheckFailed(f"{where}, rank {r}: {problem}")
        _in_order(res["w1_rows"], normed, f"{where}, rank {r}")
    return where


def check_sp_region(fn: Callable, cases: tuple[tuple[int, tuple[int, int, int]], ...] = SP_CASES, seed: int = 0,
                    timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, the whole x's shape [b, s, h]): output shard, every gradient and the comm log against one
    process, and the rows the product with w1 sees (the whole sequences, in order)."""
    def body() -> str:
        done = [_check_sp_case(fn, t, shape, seed, timeout) for t, shape in cases]
        return f"{'; '.join(done)}: output, every gradient, the comm log and the sequence order of an SP region"
    return run_check("sp_region", body)


# ----------------------------------------------------------------------------------------------------------------
# 2. a vocabulary-parallel embedding


def _emb_inputs(vocab: int, h: int, ids_shape: tuple[int, ...], world_size: int,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The table [V, h], ids [*ids_shape] whose first entries are the shard edges (0, V-1, r V/t and r V/t - 1:
    where an off-by-one in the mask shows), and the output's gradient (the same on every rank)."""
    table = _rand((vocab, h), seed)
    ids = torch.randint(0, vocab, ids_shape, generator=torch.Generator().manual_seed(seed + 1))
    n = vocab // world_size
    edges = [0, vocab - 1, *(e for r in range(1, world_size) for e in (r * n - 1, r * n))]
    flat = ids.view(-1)
    flat[:min(len(edges), flat.numel())] = torch.tensor(edges[:flat.numel()])
    return table, ids, _rand((*ids_shape, h), seed + 2)


def _emb_on_rank(rank: int, world_size: int, fn: Callable[..., Any], vocab: int, h: int,
                 ids_shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    table, ids, upstream = _emb_inputs(vocab, h, ids_shape, world_size, seed)
    weight = table.chunk(world_size)[rank].clone().requires_grad_(True)
    given = ids.clone()
    with comm.recording() as fwd:
        out = fn(given, weight)
    if not isinstance(out, torch.Tensor):
        return {"type": type(out).__name__}
    if tuple(out.shape) != (*ids_shape, h):
        return {"type": f"Tensor of shape {tuple(out.shape)}, expected {(*ids_shape, h)}"}
    with comm.recording() as bwd:
        out.backward(upstream)
    return {"type": "Tensor", "out": out.detach().clone(), "grad": weight.grad, "ids_kept": torch.equal(given, ids),
            "fwd": _ops(fwd), "bwd": _ops(bwd)}


def _check_embedding_case(fn: Callable, world_size: int, vocab: int, h: int, ids_shape: tuple[int, ...], seed: int,
                          timeout: float) -> str:
    if vocab % world_size:
        raise ValueError(f"check_vocab_parallel_embedding: the vocabulary {vocab} must divide by {world_size}")
    where = f"{world_size} ranks, vocabulary {vocab}, ids {tuple(ids_shape)}"
    results = _launch(_emb_on_rank, world_size, fn, vocab, h, tuple(ids_shape), seed, timeout=timeout)
    table, ids, upstream = _emb_inputs(vocab, h, tuple(ids_shape), world_size, seed)
    full = table.clone().requires_grad_(True)
    want = F.embedding(ids, full)
    want.backward(upstream)
    nbytes = want.numel() * 4
    n = vocab // world_size
    for r, res in enumerate(results):
        if res["type"] != "Tensor":
            raise CheckFailed(f"{where}, rank {r}: vocab_parallel_embedding must return a torch.Tensor, got "
                              f"{res['type']}")
        if not res["ids_kept"]:
            raise CheckFailed(f"{where}, rank {r}: the ids were modified in place: shift and mask a copy")
        expect_close(res["out"], want.detach(), f"{where}, rank {r}: output vs one process's embedding of all ids (ids "
                     f"outside [{r * n}, {(r + 1) * n}) must contribute nothing on rank {r})")
        if res["grad"] is None:
            raise CheckFailed(f"{where}, rank {r}: the weight shard got no gradient: the output must depend on it "
                              "through autograd")
        expect_close(res["grad"], full.grad.chunk(world_size)[r], f"{where}, rank {r}: gradient of the shard vs rows "
                     f"[{r * n}, {(r + 1) * n}) of one process's (the output's gradient is already the same on "
                     "every rank: nothing to sum in backward)")
        if res["fwd"] != [("all_reduce", nbytes)] or res["bwd"] != []:
            raise CheckFailed(f"{where}, rank {r}: expected one all-reduce of the [b, s, h] output ({nbytes} B) "
                              f"forward and nothing backward, through course_lib.comm (the table is never gathered),"
                              f" got forward {res['fwd']}, backward {res['bwd']}")
    return where


EMBEDDING_CASES = ((2, 16, 8, (2, 5)), (4, 12, 4, (3, 4)))
"""The visible check's (ranks, vocabulary, h, ids shape): two world sizes, two vocabularies and shard sizes."""


def check_vocab_parallel_embedding(fn: Callable, cases: tuple[tuple[int, int, int, tuple[int, ...]], ...] =
                                   EMBEDDING_CASES, seed: int = 0, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, V, h, ids shape); ``fn(ids, weight)`` on ranks, ``weight`` rows [r V/t, (r+1) V/t) of the
    table: the full embedding on every rank, the shard's gradient = its rows of one process's, one all-reduce of
    b*s*h fp32 forward, none backward; the ids include every shard edge."""
    def body() -> str:
        done = [_check_embedding_case(fn, *case, seed, timeout) for case in cases]
        return f"{'; '.join(done)} (shard edges included): output, shard gradients, one all-reduce forward"
    return run_check("vocab_parallel_embedding", body)


# ----------------------------------------------------------------------------------------------------------------
# 3. tensor-parallel attention with grouped-query K/V heads


def kv_heads_of_rank(n_kv_head: int, t: int, rank: int) -> range:
    """The K/V heads rank ``rank`` of ``t`` holds (vLLM's placement, ``QKVParallelLinear``): heads
    [r n_kv/t, (r+1) n_kv/t) when t divides n_kv_head; when n_kv_head divides t, head r // (t / n_kv), each head
    replicated on t / n_kv ranks."""
    if n_kv_head % t == 0:
        per = n_kv_head // t
        return range(rank * per, (rank + 1) * per)
    head = rank // (t // n_kv_head)
    return range(head, head + 1)


def _gqa_reference(h: int, n_head: int, n_kv_head: int, seq: int, seed: int) -> Attention:
    torch.manual_seed(seed)
    return Attention(GPTConfig(d_model=h, n_head=n_head, n_kv_head=n_kv_head, seq_len=seq, bias=False))


def _gqa_shards(ref: Attention, t: int, rank: int, grads: bool = False) -> list[torch.Tensor]:
    """Rank ``rank``'s [wq, wk, wv, wo] (or their gradients): its query heads' rows of q_proj and columns of
    o_proj, and the rows of its K/V heads in k_proj and v_proj."""
    d, nq = ref.head_dim, ref.n_head // t
    kv = kv_heads_of_rank(ref.n_kv_head, t, rank)
    q_rows, kv_rows = slice(rank * nq * d, (rank + 1) * nq * d), slice(kv.start * d, kv.stop * d)
    get = (lambda m: m.weight.grad) if grads else (lambda m: m.weight.detach())
    return [get(ref.q_proj)[q_rows], get(ref.k_proj)[kv_rows], get(ref.v_proj)[kv_rows], get(ref.o_proj)[:, q_rows]]


def _gqa_on_rank(rank: int, world_size: int, fn: Callable[..., Any], shape: tuple[int, int, int], n_head: int,
                 n_kv_head: int, seed: int) -> dict[str, Any]:
    ref = _gqa_reference(shape[-1], n_head, n_kv_head, shape[1], seed)
    params = [s.clone().requires_grad_(True) for s in _gqa_shards(ref, world_size, rank)]
    x = _rand(shape, seed + 1).requires_grad_(True)
    with comm.recording() as fwd:
        out = fn(x, *params, n_head=n_head, n_kv_head=n_kv_head)
    if not isinstance(out, torch.Tensor):
        return {"type": type(out).__name__}
    if tuple(out.shape) != tuple(shape):
        return {"type": f"Tensor of shape {tuple(out.shape)}, expected {tuple(shape)}"}
    with comm.recording() as bwd:
        out.backward(_rand(shape, seed + 2))
    return {"type": "Tensor", "out": out.detach().clone(), "x_grad": x.grad, "grads": [p.grad for p in params],
            "fwd": [(r.op, r.tensor_bytes, r.group_size) for r in fwd.records],
            "bwd": [(r.op, r.tensor_bytes, r.group_size) for r in bwd.records]}


def _gqa_comm_problem(fwd: list[tuple[str, int, int]], bwd: list[tuple[str, int, int]], t: int, full: int,
                      kv_bytes: int, replicas: int) -> str:
    """'' when forward is one all-reduce of the output over the t ranks (g) and backward one of the input's
    gradient (f) plus, for replicated K/V heads, all-reduces of the K/V gradients (in one call or two) over the
    ``replicas`` ranks that hold the same heads; else what is wrong."""
    if fwd != [("all_reduce", full, t)]:
        return f"forward: expected one all-reduce of the [b, s, h] output ({full} B) over the {t} ranks, got {fwd}"
    rest = [c for c in bwd if c != ("all_reduce", full, t)]
    kv = [(b, n) for op, b, n in rest if op == "all_reduce"]
    if len(bwd) - len(rest) != 1:
        return f"backward: expected one all-reduce of the input's gradient ({full} B) over the {t} ranks, got {bwd}"
    if replicas == 1:
        return "" if not rest else (f"backward: each K/V head lives on one rank here (t divides n_kv_head): its "
                                    f"gradient is complete, nothing to sum; got {rest} besides f's all-reduce")
    if len(kv) != len(rest) or sum(b for b, _ in kv) != kv_bytes or any(n != replicas for _, n in kv):
        return (f"backward: the K/V gradients ({kv_bytes} B in all) must be summed over the {replicas} ranks that "
                f"hold the same K/V head (a group of {replicas}, not the {t} ranks); got {rest} (op, bytes, group "
                "size) besides f's all-reduce")
    return ""


def _check_gqa_case(fn: Callable, world_size: int, n_head: int, n_kv_head: int, shape: tuple[int, int, int],
                    seed: int, timeout: float) -> str:
    if n_head % world_size or n_head % n_kv_head or (n_kv_head % world_size and world_size % n_kv_head):
        raise ValueError(f"check_gqa_attention: needs t={world_size} dividing n_head={n_head}, n_kv_head="
                         f"{n_kv_head} dividing n_head, and t and n_kv_head dividing one another")
    results = _launch(_gqa_on_rank, world_size, fn, tuple(shape), n_head, n_kv_head, seed, timeout=timeout)
    ref = _gqa_reference(shape[-1], n_head, n_kv_head, shape[1], seed)
    x = _rand(shape, seed + 1).requires_grad_(True)
    out = ref(x)
    out.backward(_rand(shape, seed + 2))
    replicas = max(1, world_size // n_kv_head)
    kv_bytes = 2 * ref.head_dim * shape[-1] * 4
    tol = {"rtol": 1e-4, "atol": 1e-5}
    how = f"each K/V head on {replicas} ranks" if replicas > 1 else f"{n_kv_head // world_size} K/V heads a rank"
    where = f"{world_size} ranks, {n_head} query heads, {n_kv_head} K/V heads ({how})"
    for r, res in enumerate(results):
        if res["type"] != "Tensor":
            raise CheckFailed(f"{where}, rank {r}: gqa_attention must return a torch.Tensor, got {res['type']}")
        expect_close(res["out"], out.detach(), f"{where}, rank {r}: output vs one process's attention", **tol)
        problem = _gqa_comm_problem(res["fwd"], res["bwd"], world_size, x.numel() * 4, kv_bytes, replicas)
        if problem:
            raise CheckFailed(f"{where}, rank {r}: {problem}")
        if res["x_grad"] is None:
            raise CheckFailed(f"{where}, rank {r}: x.grad is None: the output must depend on x through autograd")
        expect_close(res["x_grad"], x.grad, f"{where}, rank {r}: gradient of x (every rank's heads read x)", **tol)
        heads = kv_heads_of_rank(n_kv_head, world_size, r)
        holders = [q for q in range(world_size) if kv_heads_of_rank(n_kv_head, world_size, q) == heads]
        names = ["wq (its query heads of q_proj)", "wk (its K/V heads of k_proj)", "wv (its K/V heads of v_proj)",
                 "wo (its query heads of o_proj)"]
        for i, (name, g, want) in enumerate(zip(names, res["grads"], _gqa_shards(ref, world_size, r, True),
                                                strict=True)):
            if g is None:
                raise CheckFailed(f"{where}, rank {r}: {name} got no gradient")
            shared = f" (K/V heads {list(heads)} are held by ranks {holders}: each rank's gradient covers only " \
                "its own query heads; the head's gradient is their sum)" if i in (1, 2) and replicas > 1 else ""
            expect_close(g, want, f"{where}, rank {r}: gradient of {name} vs one process's{shared}", **tol)
    return where


GQA_CASES = ((4, 4, 2, (2, 8, 16)), (2, 8, 4, (2, 8, 16)), (4, 4, 1, (1, 6, 16)))
"""The visible check's (ranks, n_head, n_kv_head, x shape): each K/V head on 2 of 4 ranks, two K/V heads a rank,
one K/V head on all 4 ranks (MQA)."""


def check_gqa_attention(fn: Callable, cases: tuple[tuple[int, int, int, tuple[int, int, int]], ...] = GQA_CASES,
                        seed: int = 0, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, n_head, n_kv_head, x shape); ``fn(x, wq, wk, wv, wo, n_head=, n_kv_head=)`` on ranks:
    causal GQA attention, query heads split over the ranks, K/V heads placed by ``kv_heads_of_rank``; output,
    every gradient and the comm log vs one process."""
    def body() -> str:
        done = [_check_gqa_case(fn, *case, seed, timeout) for case in cases]
        return f"{'; '.join(done)}: output, every gradient and the comm log"
    return run_check("gqa_attention", body)


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


def _check_ce_case(fn: Callable, world_size: int, n: int, vocab: int, scale: float, seed: int,
                   timeout: float) -> str:
    results = _launch(_ce_on_rank, world_size, fn, n, vocab, scale, seed, timeout=timeout)
    logits, targets = _ce_inputs(n, vocab, scale, seed)
    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full, targets)
    ref.backward()
    where = f"{world_size} ranks, {n} tokens, vocabulary {vocab}, logits x{scale:g}"
    for r, res in enumerate(results):
        if res["type"] != "scalar":
            raise CheckFailed(f"{where}, rank {r}: must return the mean loss as a 0-d tensor, got {res['type']}")
        if not torch.isfinite(res["loss"]):
            raise CheckFailed(f"{where}, rank {r}: the loss is not finite: subtract the global max before "
                              "exponentiating")
        expect_close(res["loss"], ref.detach(), f"{where}, rank {r}: loss vs F.cross_entropy of the full logits",
                     rtol=1e-5, atol=1e-5)
        if res["grad"] is None:
            raise CheckFailed(f"{where}, rank {r}: the logit shard got no gradient")
        expect_close(res["grad"], full.grad.chunk(world_size, -1)[r], f"{where}, rank {r}: gradient of the logit "
                     "shard vs the slice of the single-process gradient", rtol=1e-4, atol=1e-7)
        expected = [("all_reduce", n * 4)] * 3
        if res["fwd"] != expected:
            raise CheckFailed(f"{where}, rank {r}: expected exactly 3 all-reduces of {n} fp32 values ({n * 4} B) "
                              "through course_lib.comm (max, target logit, sum of exponentials), got "
                              f"{res['fwd']}")
    return where


CE_CASES = ((2, 16, 64, 1.0), (4, 12, 32, 1000.0))
"""The visible check's (ranks, tokens, vocabulary, logit scale): two world sizes and vocabularies, logits x 1000."""


def check_vocab_parallel_cross_entropy(fn: Callable, cases: tuple[tuple[int, int, int, float], ...] = CE_CASES,
                                       seed: int = 0, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (ranks, tokens, V, scale): the mean loss and the shard's gradient against one process, three
    all-reduces of N fp32 values forward."""
    def body() -> str:
        done = [_check_ce_case(fn, *case, seed, timeout) for case in cases]
        return f"{'; '.join(done)}: loss, gradients and bytes"
    return run_check("vocab_parallel_cross_entropy", body)



EXERCISES = [
    Exercise("sp_region", "A sequence-parallel region on ranks", 4, "sp_region", check_sp_region,
             hidden=[{"cases": ((4, (1, 8, 16)),), "seed": 2}, {"cases": ((2, (3, 4, 8)),), "seed": 7}],
             allowed=("course_lib.comm",)),
    Exercise("vocab_parallel_embedding", "A vocabulary-parallel embedding on ranks", 3, "vocab_parallel_embedding",
             check_vocab_parallel_embedding,
             hidden=[{"cases": ((4, 32, 4, (3, 4)),), "seed": 3}, {"cases": ((2, 6, 3, (1, 7)),), "seed": 8}],
             allowed=("course_lib.comm", "course_lib.parallel.tp_comm.reduce_from_tensor_parallel_region")),
    Exercise("gqa_attention", "TP attention with GQA: where the K/V heads go", 4, "gqa_attention",
             check_gqa_attention,
             hidden=[{"cases": ((4, 8, 1, (1, 6, 16)),), "seed": 4}, {"cases": ((2, 12, 6, (2, 4, 24)),), "seed": 9},
                     {"cases": ((4, 8, 2, (2, 5, 16)),), "seed": 10}],
             allowed=("course_lib.comm", "course_lib.parallel.tp_comm.copy_to_tensor_parallel_region",
                      "course_lib.parallel.tp_comm.reduce_from_tensor_parallel_region")),
    Exercise("vocab_parallel_cross_entropy", "Vocab-parallel cross-entropy", 3, "vocab_parallel_cross_entropy",
             check_vocab_parallel_cross_entropy,
             hidden=[{"cases": ((4, 12, 48, 1000.0),), "seed": 5}, {"cases": ((2, 1, 8, 1.0),), "seed": 6}],
             allowed=("course_lib.comm",)),
]

def _ranks_of(calls: list[dict]) -> set[str]:
    sizes = [case[0] for case in each(calls)]
    return several(sizes, "world sizes").union(*(ranks(t) for t in sizes))


def _kv_placement(t: int, n_kv: int) -> str:
    return ("MQA: one K/V head on every rank" if n_kv == 1 else "one K/V head a rank" if n_kv == t else
            "several K/V heads a rank" if n_kv > t else "a K/V head on a sub-group of ranks")


CASE_CLASSES = {
    "sp_region": lambda calls: _ranks_of(calls) | {"several sequences a batch: their order shows"
                                                   for _, shape in each(calls) if shape[0] > 1},
    "vocab_parallel_embedding": lambda calls: _ranks_of(calls) | {"the ids at every shard edge"}
    | several((c[1] for c in each(calls)), "vocabularies") | several((c[1] // c[0] for c in each(calls)), "shards"),
    "gqa_attention": lambda calls: _ranks_of(calls) | {_kv_placement(c[0], c[2]) for c in each(calls)}
    | {"a K/V head on more than 2 ranks" for c in each(calls) if c[0] // c[2] > 2},
    "vocab_parallel_cross_entropy": lambda calls: _ranks_of(calls) | several((c[2] for c in each(calls)),
                                                                             "vocabularies")
    | {"logits x 1000" if c[3] >= 1000 else "logits of order 1" for c in each(calls)},
}

guard_visible_checks(globals(), EXERCISES)
