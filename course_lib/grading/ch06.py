"""Chapter 06 — context parallelism.

1. ``merge_partials(out1, lse1, out2, lse2)``: two partial attention results merged; checked against full
   attention and its log-sum-exp for large scores, split points and head counts, and rows fully masked in one
   block or in both (finite, no NaN).
2. ``zigzag_positions(seq_len, cp, rank)``: the global positions a rank holds under the zig-zag layout, int64,
   exact; lengths that do not split must raise ``ValueError``.
3. ``ring_step(q, q_pos, kv, kv_pos, out, lse, group)``: one ring-attention step on real ranks; cp steps run
   against full causal attention, in one ring and in two rings of sub-groups, zig-zag and contiguous layouts, and
   the order of each step's transfers, attention and waits is watched.
4. ``FixedKernel`` (find the bug): a block-attention kernel whose ``backward`` the ring calls; the gradients of
   ring attention on 2 and 4 ranks against full attention.
5. ``ulysses_attention(q, k, v)``: DeepSpeed-Ulysses (Jacobs et al. 2023) on real ranks, GQA included; the output
   shard and the gradients of q, k and v against full attention, and the collectives (all-to-alls through
   ``course_lib.comm`` only) and their bytes each way.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from course_lib.grading import core
from course_lib.grading.cases import each, ranks, several
from course_lib.grading.core import (
    CheckFailed,
    CheckResult,
    Exercise,
    expect_close,
    guard_visible_checks,
    launch_check,
    run_check,
)
from course_lib.parallel import cp_attention as ca

GRADER_PARAMETERS = {"seed": 1}

_launch = functools.partial(
    launch_check, hang_hint=" (an isend without its matching irecv on the neighbour, or a wait that never comes?)",
    course_files=("course_lib/grading/ch06.py", "course_lib/comm.py", "course_lib/parallel/cp_attention.py"),
    guard_errors=("CheckFailed",))


def _tensor(got: Any, like: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{what} must be a torch.Tensor, got {type(got).__name__}")
    if got.shape != like.shape or got.dtype != like.dtype:
        raise CheckFailed(f"{what}: expected shape {tuple(like.shape)} {like.dtype}, got {tuple(got.shape)} "
                          f"{got.dtype}")
    if not torch.isfinite(got).all() and torch.isfinite(like).all():
        raise CheckFailed(f"{what} contains NaN or inf (an exp() without the max shift, or -inf - -inf?)")
    return got


# ----------------------------------------------------------------------------------------------------------------
# 1. merge_partials


def check_merge_partials(fn: Callable, scales: tuple[float, ...] = (1.0, 100.0), seed: int = 0, split: int = 5,
                         heads: int = 2) -> CheckResult:
    """Split 12 keys at ``split``, attend to each part (the library's block forward), merge with ``fn``: equal to
    full attention and its log-sum-exp; also a fully masked row in one block, and in both."""
    def body() -> str:
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(2, heads, 12, 8, generator=g) for _ in range(3))
        kern, scale = ca.BlockAttention(), 8 ** -0.5
        for s in scales:
            o1, l1 = kern.forward(q * s, k[:, :, :split], v[:, :, :split], scale, None)
            o2, l2 = kern.forward(q * s, k[:, :, split:], v[:, :, split:], scale, None)
            got = fn(o1, l1, o2, l2)
            if not isinstance(got, tuple) or len(got) != 2:
                raise CheckFailed(f"merge_partials must return a tuple (out, lse), got {type(got).__name__}")
            out = _tensor(got[0], o1, f"out (scores x{s:g})")
            lse = _tensor(got[1], l1, f"lse (scores x{s:g})")
            expect_close(out, torch.nn.functional.scaled_dot_product_attention(q * s, k, v), f"out (scores x{s:g})",
                         rtol=1e-4, atol=1e-5)
            expect_close(lse, torch.logsumexp(scale * (q * s) @ k.transpose(-1, -2), -1), f"lse (scores x{s:g})",
                         rtol=1e-5, atol=1e-4)
        mask = torch.ones(12, 12 - split, dtype=torch.bool)
        mask[3] = False  # row 3 sees nothing in the second block
        o1, l1 = kern.forward(q, k[:, :, :split], v[:, :, :split], scale, None)
        o2, l2 = kern.forward(q, k[:, :, split:], v[:, :, split:], scale, mask)
        out, lse = fn(o1, l1, o2, l2)
        expect_close(_tensor(out, o1, "out with a masked row")[:, :, 3], o1[:, :, 3], "row 3 (masked in block 2)")
        expect_close(lse[:, :, 3], l1[:, :, 3], "lse of row 3 (masked in block 2)")
        empty = torch.full_like(l1, float("-inf"))
        out, lse = fn(torch.zeros_like(o1), empty, torch.zeros_like(o1), empty)
        if torch.isnan(out).any() or torch.isnan(lse).any():
            raise CheckFailed("two fully masked blocks (lse = -inf on both sides) gave NaN: the weights must be 0")
        if not (out == 0).all() or not torch.isinf(lse).all():
            raise CheckFailed("two fully masked blocks must give out = 0 and lse = -inf")
        return f"exact for scores x{', x'.join(f'{s:g}' for s in scales)}, masked rows safe"
    return run_check("merge_partials", body)


# ----------------------------------------------------------------------------------------------------------------
# 2. zigzag_positions


def check_zigzag_positions(fn: Callable, cases: tuple[tuple[int, int], ...] = ((24, 4), (8, 2), (18, 3), (4, 1))
                           ) -> CheckResult:
    def body() -> str:
        for seq, cp in cases:
            for rank in range(cp):
                got = fn(seq, cp, rank)
                expected = ca.positions(seq, rank, cp, "zigzag")
                what = f"zigzag_positions({seq}, {cp}, {rank})"
                if not isinstance(got, torch.Tensor) or got.dtype != torch.int64:
                    raise CheckFailed(f"{what} must return an int64 tensor, got {got!r}")
                if got.tolist() != expected.tolist():
                    raise CheckFailed(f"{what}: expected {expected.tolist()}, got {got.tolist()}")
        seq, bad_cp = cases[0]
        # one length divisible by neither cp nor 2 cp, one divisible by cp but not by 2 cp
        for bad_seq in (seq + 2, bad_cp * (2 * (seq // (2 * bad_cp)) + 1)):
            try:
                fn(bad_seq, bad_cp, 0)
            except ValueError:
                continue
            raise CheckFailed(f"zigzag_positions({bad_seq}, {bad_cp}, 0) must raise ValueError: {bad_seq} tokens do "
                              f"not split into 2 x cp = {2 * bad_cp} equal chunks")
        return f"{len(cases)} layouts exact, bad lengths rejected"
    return run_check("zigzag_positions", body)


# ----------------------------------------------------------------------------------------------------------------
# 3. ring_step, on ranks


_ATTENTION_OPS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
                            torch.einsum, torch.baddbmm, torch.nn.functional.scaled_dot_product_attention})
"""The products that attending a block takes (``ca.BlockAttention().forward`` or a hand-written one)."""


class _Events(TorchFunctionMode):
    """On a rank, during one ``ring_step``: "compute" for every attention product, "post" for every send or
    receive started, "wait" when one is waited on, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _ATTENTION_OPS and (not self.log or self.log[-1] != "compute"):
            self.log.append("compute")
        return func(*args, **(kwargs or {}))

    def p2p(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def posted(pg: Any, *args: Any, **kwargs: Any) -> Any:
            self.log.append("post")
            return core.LoggedWork(original(pg, *args, **kwargs), lambda: self.log.append("wait"))
        return posted


def _step_problem(log: list[str], visible: bool, step: int) -> str | None:
    """What one step's events break: two posts, then (if any key is visible) the attention, then the waits."""
    posts, computes = log.count("post"), log.count("compute")
    if posts != 2:
        return f"step {step}: {posts} send/receive(s) started; one step sends the held block and receives one"
    if not visible:
        return (f"step {step}: the block held no visible key (every key after every query) but was attended "
                "anyway: skip a block nothing of which is visible") if computes else None
    if not computes:
        return None  # attention without a product the check recognises: the result is still compared
    first_compute = log.index("compute")
    if log.index("post") > first_compute or (log.count("post") and log[:first_compute].count("post") < 2):
        return (f"step {step}: the block was attended before both transfers started: start the send and the "
                "receive first, so that they run while this rank computes")
    if "wait" in log and log.index("wait") < first_compute:
        return (f"step {step}: a transfer was waited on before the block was attended: no overlap; wait only "
                "after computing")
    return None


def _ring_on_rank(rank: int, world_size: int, fn: Callable, seq: int, seed: int, layout: str,
                  rings: int) -> dict[str, Any]:
    """``rings`` disjoint rings over the world (ring i: ranks i, i + rings, ...), each run with its own group."""
    group, members = None, list(range(world_size))
    if rings > 1:
        groups = [(dist.new_group(list(range(i, world_size, rings))), list(range(i, world_size, rings)))
                  for i in range(rings)]
        group, members = groups[rank % rings]
    cp, me = len(members), members.index(rank)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, seq, 8, generator=g) for _ in range(3))
    pos = ca.all_positions(seq, cp, layout)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return ca.shard_sequence(t, me, cp, layout, dim=2)

    q_l, kv = mine(q), torch.stack((mine(k), mine(v)))
    out, lse = torch.zeros_like(q_l), torch.full(q_l.shape[:-1], -math.inf)
    problems = []
    for step in range(cp):
        kv_pos = pos[(me - step) % cp]
        events = _Events()
        try:
            with core.patch_process_group(core.PG_POINT_TO_POINT, events.p2p), events:
                got = fn(q_l, pos[me], kv, kv_pos, out, lse, group)
        except ValueError as err:
            if "not part of group" not in str(err):
                raise
            raise CheckFailed(f"step {step}, in a ring of the global ranks {members}: a peer outside the group "
                              f"({str(err).split(' is not')[0]}); send/recv take global ranks: the group's member "
                              "i is comm.global_rank(group, i)") from None
        if not isinstance(got, tuple) or len(got) != 3:
            raise CheckFailed(f"ring_step must return (out, lse, next_kv), got {type(got).__name__}")
        out, lse, kv = got
        if not isinstance(kv, torch.Tensor) or kv.shape != (2, *q_l.shape):
            raise CheckFailed(f"step {step}: next_kv must be the received [2, B, H, T, d] block")
        problem = _step_problem(events.log, bool((kv_pos[None, :] <= pos[me][:, None]).any()), step)
        if problem:
            problems.append(problem)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return {"diff": float((out - mine(ref)).abs().max()), "problems": problems}


def _check_ring_case(fn: Callable, world_size: int, seq: int, layout: str, rings: int, seed: int) -> str:
    results = _launch(_ring_on_rank, world_size, fn, seq, seed, layout, rings, timeout=60)
    worst = max(res["diff"] for res in results)
    where = f"{world_size} ranks in {rings} ring(s) of {world_size // rings}, {layout}, {seq} tokens"
    if not worst < 1e-5:
        raise CheckFailed(f"{where}: after the ring steps the output differs from full causal attention by "
                          f"{worst:.3g} (the mask from global positions? the merge?)")
    for r, res in enumerate(results):
        if res["problems"]:
            raise CheckFailed(f"rank {r} ({where}), {res['problems'][0]}")
    return where


RING_CASES = ((2, 12, "contiguous", 1), (3, 18, "zigzag", 1), (4, 16, "contiguous", 2))
"""The visible check's (ranks, tokens, layout, rings): 2 ranks; 3 (odd) in the zig-zag layout; two rings of 2,
each its own process group."""


def check_ring_step(fn: Callable, cases: tuple[tuple[int, int, str, int], ...] = RING_CASES,
                    seed: int = 0) -> CheckResult:
    """cases: (ranks, tokens, layout, rings): the ranks in ``rings`` disjoint rings (each its own process group
    when ``rings > 1``: peers are the group's members' global ranks) run cp steps; the output must equal full causal
    attention, and each step must start both transfers, then attend (skipping a block with no visible key), then
    wait."""
    def body() -> str:
        done = [_check_ring_case(fn, *case, seed) for case in cases]
        return f"{'; '.join(done)}: equal to full attention (max |diff| < 1e-5), transfers overlapped"
    return run_check("ring_step", body)


# ----------------------------------------------------------------------------------------------------------------
# 4. find the bug in the backward


def _grads_on_rank(rank: int, world_size: int, kernel_cls: type, seq: int, batch: int, seed: int) -> float:
    """The ring's dQ, dK, dV with ``kernel_cls`` against full attention's, for a batch of ``batch`` sequences and
    an upstream gradient that varies (a real loss's, not a sum's)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(batch, 2, seq, 8, generator=g) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ca.reference_attention(*full).backward(d_out)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return ca.shard_sequence(t, rank, world_size, "zigzag", dim=2)

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    out = ca.ring_attention(*local, ca.all_positions(seq, world_size, "zigzag"), 2, kernel=kernel_cls())
    out.backward(mine(d_out))
    return max(float((a.grad - mine(b.grad)).abs().max()) for a, b in zip(local, full, strict=True))


def _block_problem(kernel_cls: type, batch: int, seed: int) -> str | None:
    """One process, no ring: the queries against two blocks of keys, the backward summed over the blocks against
    autograd's, (a) with no mask at all (every block ``None``: attention that is not causal), (b) with a row that
    sees nothing in one block. None when both match."""
    g = torch.Generator().manual_seed(seed + 1)
    q, k, v, d_out = (torch.randn(batch, 2, 6, 8, generator=g) for _ in range(4))
    blocks = (slice(0, 3), slice(3, 6))
    masks = {"no mask (every key visible)": (None, None),
             "a row that sees nothing in the second block": (None, torch.ones(6, 3, dtype=torch.bool).index_fill(
                 0, torch.tensor([1]), False))}
    kern, scale = kernel_cls(), 8 ** -0.5
    for what, (m1, m2) in masks.items():
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = torch.cat([torch.ones(6, 3, dtype=torch.bool) if m1 is None else m1,
                          torch.ones(6, 3, dtype=torch.bool) if m2 is None else m2], 1)
        ref = torch.nn.functional.scaled_dot_product_attention(*full, attn_mask=mask)
        ref.backward(d_out)
        out = ref.detach()
        lse = torch.logsumexp((scale * q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")), -1)
        delta = (d_out * out).sum(-1)
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for ks, m in zip(blocks, (m1, m2), strict=True):
            got = kern.backward(q, k[:, :, ks], v[:, :, ks], scale, m, d_out, lse, delta)
            dq += got[0]
            dk[:, :, ks], dv[:, :, ks] = got[1], got[2]
        worst = max(float((a - b.grad).abs().max()) for a, b in zip((dq, dk, dv), full, strict=True))
        if not worst < 1e-5:
            return f"one process, two blocks of keys, {what}: dQ, dK, dV differ from autograd's by {worst:.3g}"
    return None


FIXED_KERNEL_CASES = ((2, 16), (4, 16))
"""The visible check's (cp, sequence length) for the ring."""


def check_fixed_kernel(kernel_cls: Any, cases: tuple[tuple[int, int], ...] = FIXED_KERNEL_CASES, batch: int = 2,
                       seed: int = 0) -> CheckResult:
    """cases: (cp, sequence length): ring attention with ``kernel_cls`` on cp ranks (zig-zag), ``batch`` sequences
    and a random upstream gradient: dQ, dK, dV against full attention; then the block backward alone, without a mask
    and with a row that sees nothing in a block, against autograd."""
    def body() -> str:
        if not (isinstance(kernel_cls, type) and issubclass(kernel_cls, ca.BlockAttention)):
            raise CheckFailed("FixedKernel must be a subclass of cp_attention.BlockAttention")
        for cp, seq in cases:
            worst = max(_launch(_grads_on_rank, cp, kernel_cls, seq, batch, seed, timeout=60))
            if not worst < 1e-5:
                raise CheckFailed(f"dQ, dK, dV differ from full attention by {worst:.3g} at cp={cp} ({seq} tokens, "
                                  f"{batch} sequences)")
        problem = _block_problem(kernel_cls, batch, seed)
        if problem:
            raise CheckFailed(problem)
        return (f"gradients equal full attention at cp={', '.join(str(c) for c, _ in cases)} ({batch} sequences, "
                "max |diff| < 1e-5), and the block backward with no mask and with an empty row")
    return run_check("fixed_kernel", body)


# ----------------------------------------------------------------------------------------------------------------
# 5. Ulysses


def _ulysses_inputs(b: int, seq: int, heads: int, kv_heads: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, seq, n, 4, generator=g) for n in (heads, kv_heads, kv_heads)]


def _ulysses_on_rank(rank: int, world_size: int, fn: Callable, b: int, seq: int, heads: int, kv_heads: int,
                     seed: int) -> dict[str, Any]:
    from course_lib import comm

    local = [t.chunk(world_size, 1)[rank].clone().requires_grad_(True)
             for t in _ulysses_inputs(b, seq, heads, kv_heads, seed)]
    upstream = torch.randn(b, seq, heads, 4, generator=torch.Generator().manual_seed(seed + 1))
    with comm.recording() as fwd:
        out = fn(*local)
    if not isinstance(out, torch.Tensor) or out.shape != local[0].shape:
        return {"type": f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}"}
    with comm.recording() as bwd:
        out.backward(upstream.chunk(world_size, 1)[rank])
    return {"type": "Tensor", "out": out.detach().clone(), "grads": [t.grad for t in local],
            "fwd": [(r.op, r.tensor_bytes) for r in fwd.records], "bwd": [(r.op, r.tensor_bytes) for r in bwd.records]}


def ulysses_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the whole sequence in the [b, s, H, d] layout (GQA: K/V heads repeated)."""
    rep = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


def _check_ulysses_case(fn: Callable, world_size: int, b: int, seq: int, heads: int, kv_heads: int,
                        seed: int) -> str:
    if heads % world_size or kv_heads % world_size or seq % world_size:
        raise ValueError(f"check_ulysses_attention: cp={world_size} must divide the heads ({heads}), the K/V "
                         f"heads ({kv_heads}) and the sequence ({seq})")
    where = f"cp={world_size}, b={b}, {seq} tokens, {heads} heads ({kv_heads} K/V)"
    results = _launch(_ulysses_on_rank, world_size, fn, b, seq, heads, kv_heads, seed, timeout=60)
    full = [t.clone().requires_grad_(True) for t in _ulysses_inputs(b, seq, heads, kv_heads, seed)]
    ref = ulysses_reference(*full)
    ref.backward(torch.randn(b, seq, heads, 4, generator=torch.Generator().manual_seed(seed + 1)))
    n = b * (seq // world_size) * 4 * 4  # bytes of one head of a sequence shard: b (s/cp) d fp32 values
    want_bytes = (2 * heads + 2 * kv_heads) * n
    tol = {"rtol": 1e-4, "atol": 1e-5}  # fp32 softmax and products over <= 16 keys, summed in another order
    for r, res in enumerate(results):
        if res["type"] != "Tensor":
            raise CheckFailed(f"{where}, rank {r}: ulysses_attention must return a tensor shaped like q "
                              f"[b, s/cp, H, d], got {res['type']}")
        expect_close(res["out"], ref.detach().chunk(world_size, 1)[r], f"{where}, rank {r}: output vs tokens "
                     f"[{r} s/cp, {r + 1} s/cp) of full causal attention", **tol)
        for name, got, t in zip("qkv", res["grads"], full, strict=True):
            if got is None:
                raise CheckFailed(f"{where}, rank {r}: {name}.grad is None: the exchange must stay inside autograd "
                                  "(an all-to-all's backward is the inverse all-to-all)")
            expect_close(got, t.grad.chunk(world_size, 1)[r], f"{where}, rank {r}: gradient of this rank's {name} "
                         "shard", **tol)
        for when in ("fwd", "bwd"):
            ops = res[when]
            if any(op != "all_to_all" for op, _ in ops) or sum(nb for _, nb in ops) != want_bytes:
                raise CheckFailed(f"{where}, rank {r}, {'forward' if when == 'fwd' else 'backward'}: expected only "
                                  f"all-to-alls through course_lib.comm, {want_bytes} B in all (q, k, v and the "
                                  f"output, {2 * heads + 2 * kv_heads} heads of a shard), got {ops}")
    return where


ULYSSES_CASES = ((2, 2, 8, 4, 4), (2, 1, 8, 8, 4), (4, 2, 8, 8, 4))
"""The visible check's (cp, b, s, H, H_kv): MHA; GQA with two K/V heads a rank; GQA on 4 ranks, one K/V head
a rank."""


def check_ulysses_attention(fn: Callable, cases: tuple[tuple[int, int, int, int, int], ...] = ULYSSES_CASES,
                            seed: int = 0) -> CheckResult:
    """cases: (cp, b, s, H, H_kv): the output shard and q, k, v's gradients against full causal attention, and
    only all-to-alls through ``course_lib.comm`` of (2H + 2H_kv) b (s/cp) d fp32 values each way."""
    def body() -> str:
        done = [_check_ulysses_case(fn, *case, seed) for case in cases]
        return f"{'; '.join(done)}: output and gradients equal full attention, all-to-alls only"
    return run_check("ulysses_attention", body)


EXERCISES = [
    Exercise("merge_partials", "Merge two partial attention results by log-sum-exp", 3, "merge_partials",
             check_merge_partials, hidden=[{"scales": (0.5, 300.0), "seed": 3, "split": 7, "heads": 3}]),
    Exercise("zigzag_positions", "Zig-zag chunk assignment and positions", 2, "zigzag_positions",
             check_zigzag_positions, hidden=[{"cases": ((40, 4), (12, 3), (16, 8), (6, 1))}]),
    Exercise("ring_step", "One ring-attention step on real ranks", 4, "ring_step", check_ring_step,
             hidden=[{"cases": ((4, 24, "zigzag", 1),), "seed": 2}, {"cases": ((3, 12, "contiguous", 1),), "seed": 5},
                     {"cases": ((4, 12, "contiguous", 2),), "seed": 6}],
             allowed=("course_lib.comm", "course_lib.parallel.cp_attention.BlockAttention.forward")),
    Exercise("fixed_kernel", "Find the bug: the ring backward's probabilities", 3, "FixedKernel", check_fixed_kernel,
             hidden=[{"cases": ((4, 24), (2, 12)), "batch": 3, "seed": 4}],
             allowed=tuple(f"course_lib.parallel.cp_attention.BlockAttention.{name}" for name in (
                 "forward", "merge", "mask", "kv_for_backward_step"))),
    Exercise("ulysses_attention", "Ulysses: re-split by heads with all-to-alls", 4, "ulysses_attention",
             check_ulysses_attention,
             hidden=[{"cases": ((4, 1, 8, 8, 4),), "seed": 3}, {"cases": ((2, 3, 6, 4, 2),), "seed": 5},
                     {"cases": ((2, 2, 4, 12, 6), (4, 1, 8, 4, 4)), "seed": 6}],
             allowed=("course_lib.comm",)),
]

def _ranks_of(sizes: list[int]) -> set[str]:
    return several(sizes, "world sizes").union(*(ranks(n) for n in sizes))


def _ulysses_classes(calls: list[dict]) -> set[str]:
    out = _ranks_of([c[0] for c in each(calls)])
    for cp, b, _, heads, kv in each(calls):
        out.add("MHA" if kv == heads else "GQA, several K/V heads a rank" if kv // cp > 1 else
                "GQA, one K/V head a rank")
        out |= {"several sequences a batch"} if b > 1 else set()
    return out


CASE_CLASSES = {
    "merge_partials": lambda calls: {"a row masked in one block", "both blocks masked"}
    | {"scores x 100 and more" if s >= 100 else "scores of order 1" for c in calls for s in c["scales"]},
    "zigzag_positions": lambda calls: _ranks_of([cp for _, cp in each(calls)]) | {"lengths refused"},
    "ring_step": lambda calls: _ranks_of([c[0] for c in each(calls)]) | {c[2] + " layout" for c in each(calls)}
    | {"rings on sub-groups" for c in each(calls) if c[3] > 1},
    "fixed_kernel": lambda calls: _ranks_of([cp for c in calls for cp, _ in c["cases"]])
    | {"several sequences a batch" for c in calls if c["batch"] > 1}
    | {"an upstream gradient that varies", "no mask", "a row that sees nothing in a block"},
    "ulysses_attention": _ulysses_classes,
}

guard_visible_checks(globals(), EXERCISES)
