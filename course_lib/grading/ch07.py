"""Chapter 07 — mixture of experts and expert parallelism.

1. ``batch_priority_routing(logits, k, capacity_factor)``: the chosen experts and the kept assignments under
   batch-priority routing (Riquelme et al. 2021), exact: top-1 and top-k, capacities that drop and that do not,
   fractional ones, equal priorities.
2. ``dispatch(x, expert, n_expert)`` on real ranks: the rows each rank receives, in order, and the counts, exact;
   ranks with no rows, experts with none, one and several experts per rank.
3. ``combine(y, counts, expert, token, weight, n_tokens)`` on real ranks: every rank's output against the
   single-process ``MoE`` layer's for its tokens (capacity drops and no capacity, top-1 and top-2), with exactly
   one ``all_to_all_single`` a case and every other collective and send/recv refused.
4. ``load_balancing_loss(probs, chosen, alpha)``: the Switch / GShard auxiliary loss, its value and its gradient.
5. ``kept_counts(counts, capacity)`` (find the bug): the kept assignments of every (rank, expert), exact, with and
   without a capacity.
6. ``update_expert_bias(bias, chosen, rate)`` on real ranks: DeepSeek-V3's auxiliary-loss-free bias update,
   against the single-process one, identical on every rank, ranks with no tokens included.

The launched checks run several cases in one launch (``cases``), on 4 ranks for the notebook's self-check.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from course_lib.grading import core
from course_lib.grading.cases import each
from course_lib.grading.core import CheckFailed, CheckResult, Exercise, expect_close, guard_visible_checks, run_check
from course_lib.model_config import GPTConfig
from course_lib.moe import MoE, expert_capacity, expert_positions
from course_lib.parallel.ep import kept_counts

GRADER_PARAMETERS = {"seed": 1}
LAUNCH_TIMEOUT_S = 30.0
_A2A = ("alltoall_base", "all_to_all_single")  # the ProcessGroup method dist.all_to_all_single ends in (by version)


class RefusedCollective(RuntimeError):  # noqa: N818 - reads as what happened
    """Raised on a rank when the learner's combine communicates by anything but dist.all_to_all_single."""


def _tensor(got: Any, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{what} must be a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) != shape:
        raise CheckFailed(f"{what} must have shape {shape}, got {tuple(got.shape)}")
    if got.dtype != dtype:
        raise CheckFailed(f"{what} must have dtype {dtype}, got {got.dtype}")
    return got


def _count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 routing', '3 routings'."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _expect_same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Exact equality of integer tensors (same shape already checked), naming the first difference."""
    if not torch.equal(got, expected):
        idx = tuple((got != expected).nonzero()[0].tolist())
        raise CheckFailed(f"{what}: first difference at index {idx}: expected {expected[idx].item()}, got "
                          f"{got[idx].item()} (expected {expected.tolist()})")


# ----------------------------------------------------------------------------------------------------------------
# 1. batch-priority routing under capacity


def _queues(logits: torch.Tensor, k: int, capacity_factor: float, *, by_priority: bool = True,
            rounds: bool = True, priority: str = "probability") -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, keep) with the queues filled in the order the keywords say; the defaults are the specification
    (the others name a learner's mistake)."""
    T, E = logits.shape
    chosen = logits.topk(k, dim=-1).indices
    score = logits.softmax(-1).amax(-1) if priority == "probability" else logits.amax(-1)
    tokens = sorted(range(T), key=lambda t: (-float(score[t]), t)) if by_priority else list(range(T))
    order = [(t, j) for j in range(k) for t in tokens] if rounds else [(t, j) for t in tokens for j in range(k)]
    cap = expert_capacity(capacity_factor, T, k, E)
    fill, keep = [0] * E, torch.zeros(T, k, dtype=torch.bool)
    for t, j in order:
        e = int(chosen[t, j])
        if fill[e] < cap:
            keep[t, j], fill[e] = True, fill[e] + 1
    return chosen, keep


def reference_batch_priority_routing(logits: torch.Tensor, k: int,
                                     capacity_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-priority routing (Riquelme et al. 2021, "Scaling Vision with Sparse Mixture of Experts", V-MoE): the
    queues of the experts fill round by round (every token's first choice, then every second choice, ...), within
    a round by decreasing priority max_e softmax(logits_t)_e (ties: the earlier token); keep when position < C."""
    return _queues(logits, k, capacity_factor)


_MISTAKES = (
    ({"by_priority": False, "rounds": False}, "the queues filled token after token (the chapter's rule): batch "
                                              "priority fills them round by round, by decreasing priority"),
    ({"by_priority": False}, "each round's queue filled in token order: batch priority fills it by decreasing "
                             "priority"),
    ({"rounds": False}, "a token's second choice went before other tokens' first choices: every first choice is "
                        "queued before any second choice"),
    ({"priority": "logit"}, "the priority was the largest logit: it is the largest router probability (the softmax "
                            "over all E logits), which a token with close competitors has lower"),
)


def _diagnosis(keep: torch.Tensor, logits: torch.Tensor, k: int, capacity_factor: float) -> str:
    for kw, why in _MISTAKES:
        if torch.equal(keep, _queues(logits, k, capacity_factor, **kw)[1]):
            return f"; your keep is what you get when {why}"
    T, E = logits.shape
    chosen, cap = logits.topk(k, dim=-1).indices, expert_capacity(capacity_factor, T, k, E)
    kept = torch.bincount(chosen[keep], minlength=E)
    if int(kept.max()) < cap <= int(torch.bincount(chosen.reshape(-1), minlength=E).max()):
        return f"; no expert kept more than {int(kept.max())} of its C = ceil(cf T k / E) = {cap} slots"
    return ""


def _router_logits(T: int, E: int, repeat: int, seed: int) -> torch.Tensor:
    """A skewed router (drops happen), each distinct row used ``repeat`` times (equal priorities)."""
    g = torch.Generator().manual_seed(seed * 7 + T)
    base = torch.randn(math.ceil(T / repeat), E, generator=g) * 1.5 + torch.linspace(1.5, 0, E)
    return base[torch.arange(T) % base.shape[0]].contiguous()


ROUTING_CASES = ((16, 4, 2, 0.75), (11, 4, 1, 0.5), (6, 4, 2, 2.0), (8, 4, 2, 0.75))
"""The visible check's (T, E, k, capacity factor): top-2 that drops, top-1 under a fractional capacity (C = ceil
1.375 = 2), top-2 where every assignment fits, top-2 where two tokens of equal priority fall either side of the
capacity; each distinct router row twice (equal priorities)."""


def check_batch_priority_routing(fn: Callable, cases: tuple[tuple[int, int, int, float], ...] = ROUTING_CASES,
                                 repeat: int = 2, seed: int = 0) -> CheckResult:
    """``fn(logits, k, capacity_factor)`` must return (chosen [T, k] int64, keep [T, k] bool), the
    reference's."""
    def body() -> str:
        for T, E, k, cf in cases:
            logits = _router_logits(T, E, repeat, seed)
            got = fn(logits.clone(), k, cf)
            if not isinstance(got, tuple) or len(got) != 2:
                raise CheckFailed("batch_priority_routing must return a tuple (chosen, keep)")
            chosen, want = reference_batch_priority_routing(logits, k, cf)
            what = f"(T={T}, E={E}, k={k}, cf={cf}, C={expert_capacity(cf, T, k, E)})"
            _expect_same(_tensor(got[0], f"chosen {what}", (T, k), torch.long), chosen, f"chosen {what}")
            keep = _tensor(got[1], f"keep {what}", (T, k), torch.bool)
            if not torch.equal(keep, want):
                t, j = (keep != want).nonzero()[0].tolist()
                p = logits.softmax(-1).amax(-1)
                ties = " (a tie: the earlier token goes first)" if int((p == p[t]).sum()) > 1 else ""
                raise CheckFailed(f"keep {what}: token {t} (priority {float(p[t]):.4f}{ties}), choice {j} (expert "
                                  f"{int(chosen[t, j])}) should be {'kept' if want[t, j] else 'dropped'}"
                                  f"{_diagnosis(keep, logits, k, cf)}")
        return f"{_count(len(cases), 'routing')} correct, the queues filled by priority"
    return run_check("batch_priority_routing", body)


# ----------------------------------------------------------------------------------------------------------------
# 2. dispatch on ranks


def _dispatch_inputs(rank: int, rows: tuple[int, ...], n_expert: int, h: int, seed: int,
                     case: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + 100 * case + rank)
    n = rows[rank]
    expert = torch.randint(0, max(n_expert - 1, 1), (n,), generator=g)  # the last expert never gets a row
    return torch.randn(n, h, generator=g), expert


def _dispatch_on_rank(rank: int, world_size: int, fn: Callable, cases: tuple[tuple[tuple[int, ...], int], ...],
                      h: int, seed: int) -> list[Any]:
    return [fn(*_dispatch_inputs(rank, rows, n_expert, h, seed, i), n_expert)
            for i, (rows, n_expert) in enumerate(cases)]


def _expect_cases(world_size: int, rows_experts: list[tuple[tuple[int, ...], int]]) -> None:
    for rows, n_expert in rows_experts:
        if len(rows) != world_size or n_expert % world_size:
            raise ValueError(f"a case needs one row count per rank and E divisible by {world_size}: {rows}, "
                             f"E={n_expert}")


DISPATCH_CASES = (((5, 0, 7, 3), 8), ((2, 6, 1, 4), 4))
"""The visible check's (rows per rank, E) on 4 ranks: a rank without rows and two experts per rank, then one."""


def check_dispatch(fn: Callable, world_size: int = 4,
                   cases: tuple[tuple[tuple[int, ...], int], ...] = DISPATCH_CASES, h: int = 3, seed: int = 0,
                   timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """cases: (rows per rank, E), all run in one launch of ``world_size`` ranks."""
    def body() -> str:
        n = world_size
        _expect_cases(n, list(cases))
        results = core.launch_check(_dispatch_on_rank, n, fn, cases, h, seed, timeout=timeout,
                                    hang_hint=" (did every rank call the same collectives in the same order, with "
                                              "receive splits that match what the others send?)",
                                    course_files=("course_lib/grading/ch07.py",))
        for i, (rows, n_expert) in enumerate(cases):
            n_local = n_expert // n
            inputs = [_dispatch_inputs(r, rows, n_expert, h, seed, i) for r in range(n)]
            for r, per_case in enumerate(results):
                got = per_case[i]
                if not isinstance(got, tuple) or len(got) != 2:
                    raise CheckFailed(f"rank {r}: dispatch must return (received rows, counts), got "
                                      f"{type(got).__name__}")
                mine = range(r * n_local, (r + 1) * n_local)
                counts = torch.tensor([[int((e == j).sum()) for j in mine] for _, e in inputs])
                expected = torch.cat([x[e == j] for x, e in inputs for j in mine]).reshape(-1, h)
                what = f"rank {r} of {n} (rows per rank {rows}, E={n_expert})"
                _expect_same(_tensor(got[1], f"counts on {what}", (n, n_local), torch.long), counts,
                             f"counts on {what}")
                expect_close(_tensor(got[0], f"received rows on {what}", tuple(expected.shape), torch.float32),
                             expected, f"received rows on {what} (by source rank, then by expert, in row order)",
                             rtol=0, atol=0)
        said = "; ".join(f"rows {rows}, E={n_expert}" for rows, n_expert in cases)
        return f"{n} ranks, {said}: every row at its expert's rank, in order"
    return run_check("dispatch", body)


# ----------------------------------------------------------------------------------------------------------------
# 3. combine on ranks


def _dispatch(x: torch.Tensor, expert: torch.Tensor, n_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatch of exercise 2 (count exchange, then one uneven all-to-all of the rows sorted by expert)."""
    world = dist.get_world_size()
    send = torch.bincount(expert, minlength=n_expert)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    counts = recv.view(world, n_expert // world)
    received = x.new_empty(int(counts.sum()), x.shape[1])
    dist.all_to_all_single(received, x[torch.argsort(expert, stable=True)].contiguous(), counts.sum(1).tolist(),
                           send.view(world, -1).sum(1).tolist())
    return received, counts


def _only_all_to_all(log: list[tuple[int, int, str]]) -> contextlib.AbstractContextManager[None]:
    """Record (input rows, output rows, dtype) of every all_to_all_single; refuse every other communication."""
    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        if name not in _A2A:
            return core.refusal(RefusedCollective, "the combine is one dist.all_to_all_single of the expert outputs "
                                "back to their tokens' ranks; it called another collective or a send/recv")

        def logged(self: Any, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            log.append((input.shape[0] if input.dim() else 1, output.shape[0] if output.dim() else 1,
                        str(input.dtype).removeprefix("torch.")))
            return original(self, output, input, *args, **kwargs)
        return logged
    return core.patch_process_group((*core.PG_POINT_TO_POINT, *core.PG_COLLECTIVES), wrap)


def _combine_on_rank(rank: int, world_size: int, fn: Callable,
                     cases: list[tuple[MoE, list[tuple[torch.Tensor, ...]]]]) -> list[dict[str, Any]]:
    return [_combine_case_on_rank(rank, world_size, fn, moe, shards) for moe, shards in cases]


def _combine_case_on_rank(rank: int, world_size: int, fn: Callable, moe: MoE,
                          shards: list[tuple[torch.Tensor, ...]]) -> dict[str, Any]:
    """Dispatch this rank's kept assignments, run the local experts on what arrived, then the learner's combine."""
    x, chosen, weights, keep = shards[rank]
    token, slot = keep.nonzero(as_tuple=True)  # token order, a token's first choice before its second
    expert, weight = chosen[token, slot], weights[token, slot]
    with torch.no_grad():
        received, counts = _dispatch(x[token], expert, moe.n_expert)
        n_local = moe.n_expert // world_size
        chunks = received.split(counts.reshape(-1).tolist())  # by source rank, then by local expert
        y = torch.cat([moe.experts[rank * n_local + j](c)
                       for (_, j), c in zip(itertools.product(range(world_size), range(n_local)), chunks,
                                            strict=True)])
        log: list[tuple[int, int, str]] = []
        with _only_all_to_all(log):
            out = fn(y.clone(), counts.clone(), expert.clone(), token.clone(), weight.clone(), x.shape[0])
    return {"out": out, "log": log, "rows": (y.shape[0], expert.numel())}


class _Layer:
    """A combine case's single-process MoE layer, its tokens, their routing and what the capacity keeps."""

    def __init__(self, n_tokens: int, n_expert: int, top_k: int, capacity_factor: float | None, h: int,
                 seed: int) -> None:
        cfg = GPTConfig(n_layer=1, d_model=h, n_head=2, seq_len=8, n_expert=n_expert, top_k=top_k,
                        capacity_factor=capacity_factor, bias=False)
        torch.manual_seed(seed)
        self.moe = MoE(cfg)
        self.x = torch.randn(n_tokens, h, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            self.routing = self.moe.route(self.x)
            self.cap = self.moe.capacity(n_tokens)
            self.keep = torch.ones_like(self.routing.chosen, dtype=torch.bool) if self.cap is None else (
                expert_positions(self.routing.chosen, n_expert) < self.cap)
            self.out = self.moe(self.x)

    def shards(self, rows: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
        bounds = [sum(rows[:i]) for i in range(len(rows) + 1)]
        return [tuple(t[bounds[i]:bounds[i + 1]] for t in (self.x, self.routing.chosen, self.routing.weights,
                                                           self.keep)) for i in range(len(rows))]


COMBINE_CASES = (((5, 0, 7, 4), 8, 2, 0.75), ((3, 4, 2, 6), 4, 1, None))
"""The visible check's (tokens per rank, E, k, capacity factor) on 4 ranks: top-2 whose capacity drops
assignments (some tokens keep none), a rank without tokens; top-1 without a capacity, one expert per rank."""


def check_combine(fn: Callable, world_size: int = 4,
                  cases: tuple[tuple[tuple[int, ...], int, int, float | None], ...] = COMBINE_CASES, h: int = 8,
                  seed: int = 0, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """Each rank's ``fn(y, counts, expert, token, weight, n_tokens)`` must return the single-process MoE's output
    for its tokens, [rows[r], h] float32, with exactly one all_to_all_single (M rows in, N rows out), for every
    (tokens per rank, E, k, capacity factor) of ``cases``, all in one launch."""
    def body() -> str:
        _expect_cases(world_size, [(rows, n_expert) for rows, n_expert, _, _ in cases])
        layers = [_Layer(sum(rows), n_expert, k, cf, h, seed) for rows, n_expert, k, cf in cases]
        results = core.launch_check(_combine_on_rank, world_size, fn,
                                    [(layer.moe, layer.shards(rows)) for layer, (rows, *_) in zip(layers, cases,
                                                                                                  strict=True)],
                                    timeout=timeout,
                                    hang_hint=" (did every rank call one all_to_all_single, with the dispatch's "
                                              "splits swapped: input splits = what it received from each rank?)",
                                    course_files=("course_lib/grading/ch07.py",), guard_errors=("RefusedCollective",))
        said = [_combine_case(world_size, case, layer, [res[i] for res in results])
                for i, (case, layer) in enumerate(zip(cases, layers, strict=True))]
        return f"{world_size} ranks, " + "; ".join(said)
    return run_check("combine", body)


def _combine_case(world_size: int, case: tuple[tuple[int, ...], int, int, float | None], layer: _Layer,
                  results: list[dict[str, Any]]) -> str:
    rows, n_expert, top_k, capacity_factor = case
    bounds = [sum(rows[:i]) for i in range(world_size + 1)]
    what = (f"of {world_size} (tokens per rank {rows}, E={n_expert}, k={top_k}, cf={capacity_factor}, "
            f"C={layer.cap})")
    for i, res in enumerate(results):
        expect_close(res["out"], layer.out[bounds[i]:bounds[i + 1]], f"rank {i} {what}: the combined output of "
                     "its tokens vs the single-process MoE layer", rtol=1e-5, atol=1e-6)
        m_rows, n_rows = res["rows"]
        if len(res["log"]) != 1:
            raise CheckFailed(f"rank {i} {what} called all_to_all_single {len(res['log'])} times; the combine is "
                              "one (the splits are known: counts for the rows that came, expert for those sent)")
        if res["log"][0] != (m_rows, n_rows, "float32"):
            raise CheckFailed(f"rank {i} {what}: its all_to_all_single took {res['log'][0][0]} rows "
                              f"({res['log'][0][2]}) and gave {res['log'][0][1]}; the way back sends the {m_rows} "
                              f"float32 expert outputs it holds and receives its own {n_rows} assignments")
    dropped = int((~layer.keep).sum())
    return f"tokens {rows}, E={n_expert}, k={top_k}: the MoE's output ({dropped} dropped)"


# ----------------------------------------------------------------------------------------------------------------
# 4. load-balancing loss


def check_load_balancing_loss(fn: Callable, cases: tuple[tuple[int, int, int, float], ...] = (
        (16, 4, 2, 0.01), (10, 6, 1, 0.1)), seed: int = 0) -> CheckResult:
    """cases: (T, E, k, alpha)."""
    def body() -> str:
        for T, E, k, alpha in cases:
            uniform = torch.full((T * E, E), 1 / E)
            chosen = torch.stack([(torch.arange(T * E) + j) % E for j in range(k)], dim=1)
            got = fn(uniform, chosen, alpha)
            _tensor(got, f"the loss (T={T * E}, E={E}, k={k})", (), torch.float32)
            if abs(float(got) - alpha) > 1e-6 * max(alpha, 1):
                raise CheckFailed(f"uniform routing (T={T * E}, E={E}, k={k}) must give exactly alpha = {alpha}, got "
                                  f"{float(got):.6g}: are the fractions f_i over all T*k assignments?")
            g = torch.Generator().manual_seed(seed + T)
            logits = torch.randn(T, E, generator=g, requires_grad=True)
            probs = logits.softmax(-1)
            chosen = logits.detach().topk(k, -1).indices
            f = torch.bincount(chosen.reshape(-1), minlength=E).float() / (T * k)
            want = alpha * E * (f * probs.mean(0)).sum()
            got = fn(probs, chosen, alpha)
            expect_close(got.detach(), want.detach(), f"the loss (T={T}, E={E}, k={k})", rtol=1e-5, atol=1e-8)
            if not got.requires_grad:
                raise CheckFailed("the loss must stay differentiable through probs (the router learns from P_i)")
            got.backward()
            want_grad = torch.autograd.grad(alpha * E * (f * logits.softmax(-1).mean(0)).sum(), logits)[0]
            expect_close(logits.grad, want_grad, f"d loss / d logits (T={T}, E={E}, k={k}; f_i carries no gradient)",
                         rtol=1e-4, atol=1e-9)
        return f"{_count(len(cases), 'case')} correct, uniform routing gives alpha"
    return run_check("load_balancing_loss", body)


# ----------------------------------------------------------------------------------------------------------------
# 5. find the bug: kept counts over ranks


def _count_matrix(W: int, E: int, seed: int) -> torch.Tensor:
    """counts [W, E]: what each rank routes to each expert, (rank 0, expert 0) empty."""
    counts = torch.randint(0, 6, (W, E), generator=torch.Generator().manual_seed(seed * 13 + W * E))
    counts[0, 0] = 0
    return counts


def check_kept_counts(fn: Callable, cases: tuple[tuple[int, int, int | None], ...] = (
        (3, 4, 4), (2, 3, None), (4, 3, 40)), seed: int = 0) -> CheckResult:
    """cases: (ranks W, experts E, capacity)."""
    def body() -> str:
        for W, E, cap in cases:
            counts = _count_matrix(W, E, seed)
            got = fn(counts.clone(), cap)
            want = kept_counts(counts, cap)
            what = f"kept_counts (counts {counts.tolist()}, capacity {cap})"
            _expect_same(_tensor(got, what, (W, E), torch.long), want, what)
            if cap is not None and int(got.sum(0).max()) > cap:
                raise CheckFailed(f"{what}: an expert keeps more than the capacity")
        return f"{_count(len(cases), 'count matrix', 'count matrices')} correct"
    return run_check("kept_counts", body)


# ----------------------------------------------------------------------------------------------------------------
# 6. the auxiliary-loss-free bias update on ranks


def _bias_inputs(rank: int, rows: tuple[int, ...], n_expert: int, top_k: int, seed: int,
                 case: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's choices [rows[rank], k]: rank r prefers expert r mod E, so a rank's own loads disagree with the
    batch's (an expert busy on one rank is idle on another); a token's k experts listed by decreasing id (a load
    counts every choice, whatever its column); the starting bias, the same on every rank."""
    g = torch.Generator().manual_seed(100 * seed + 1000 * case + rank)
    pref = torch.full((n_expert,), 1.0)
    pref[rank % n_expert] = 4.0 * n_expert
    chosen = torch.stack([torch.multinomial(pref, top_k, generator=g).sort(descending=True).values
                          for _ in range(rows[rank])]) if rows[rank] else torch.zeros(0, top_k, dtype=torch.long)
    bias = torch.randn(n_expert, generator=torch.Generator().manual_seed(seed)) * 1e-2
    return bias, chosen


def _bias_on_rank(rank: int, world_size: int, fn: Callable,
                  cases: tuple[tuple[tuple[int, ...], int, int, float], ...], seed: int) -> list[Any]:
    out = []
    for i, (rows, n_expert, top_k, rate) in enumerate(cases):
        bias, chosen = _bias_inputs(rank, rows, n_expert, top_k, seed, i)
        out.append(fn(bias.clone(), chosen.clone(), rate))
    return out


BIAS_CASES = (((12, 0, 8, 5), 4, 2, 1e-3), ((3, 7, 1, 2), 8, 1, 5e-3))
"""The visible check's (tokens per rank, E, k, rate) on 4 ranks: top-2 with a rank without tokens, then top-1 at
another rate."""


def check_expert_bias(fn: Callable, world_size: int = 4,
                      cases: tuple[tuple[tuple[int, ...], int, int, float], ...] = BIAS_CASES, seed: int = 0,
                      timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """Each rank's ``fn(bias, chosen, rate)`` must return the single-process bias after one update from the
    whole batch's routed counts, [E] float32, identical on every rank, for every (tokens per rank, E, k, rate) of
    ``cases``, all in one launch."""
    def body() -> str:
        if any(len(rows) != world_size for rows, *_ in cases):
            raise ValueError(f"every case needs one token count per rank ({world_size})")
        results = core.launch_check(_bias_on_rank, world_size, fn, cases, seed,
                                    timeout=timeout, hang_hint=" (did every rank call the same collectives?)",
                                    course_files=("course_lib/grading/ch07.py",))
        said = []
        for i, (rows, n_expert, top_k, rate) in enumerate(cases):
            inputs = [_bias_inputs(r, rows, n_expert, top_k, seed, i) for r in range(world_size)]
            load = torch.bincount(torch.cat([c for _, c in inputs]).reshape(-1), minlength=n_expert)
            moe = MoE(GPTConfig(n_layer=1, d_model=8, n_head=2, seq_len=8, n_expert=n_expert, top_k=top_k,
                                router="sigmoid", bias=False))
            moe.expert_bias.copy_(inputs[0][0])
            moe.balance_bias_(load, rate)
            local = [torch.bincount(c.reshape(-1), minlength=n_expert).tolist() for _, c in inputs]
            for r, per_case in enumerate(results):
                what = (f"rank {r} of {world_size} (its routed counts {local[r]}, the batch's {load.tolist()}, "
                        f"rate {rate})")
                expect_close(_tensor(per_case[i], f"the bias on {what}", (n_expert,), torch.float32),
                             moe.expert_bias, f"the bias on {what}: b_i + rate * sign(mean load - load_i), loads "
                             "over every rank's tokens", rtol=0, atol=1e-9)
            said.append(f"counts {local}")
        return f"{world_size} ranks, {'; '.join(said)}: every rank's bias moved by the batch's loads"
    return run_check("update_expert_bias", body)


EXERCISES = [
    Exercise("batch_priority_routing", "Batch-priority routing under capacity", 3, "batch_priority_routing",
             check_batch_priority_routing,
             hidden=[{"cases": ((32, 8, 2, 1.25), (10, 4, 1, 0.5), (9, 3, 3, 1.0), (7, 5, 2, 0.1)), "seed": 1},
                     {"cases": ((12, 4, 2, 0.75), (16, 8, 2, 1.0)), "repeat": 3, "seed": 2}]),
    Exercise("dispatch", "Count exchange and uneven all-to-all dispatch", 4, "dispatch", check_dispatch,
             hidden=[{"world_size": 4, "cases": (((6, 0, 3, 9), 8),), "seed": 1},
                     {"world_size": 2, "cases": (((0, 4), 2),), "seed": 2}],
             allowed=("course_lib.comm",)),
    Exercise("combine", "The combine: the reverse all-to-all and the weighted sum", 4, "combine", check_combine,
             hidden=[{"world_size": 4, "cases": (((6, 0, 3, 9), 8, 2, 0.5),), "seed": 1},
                     {"world_size": 2, "cases": (((0, 4), 2, 1, None),), "seed": 2}],
             allowed=("course_lib.comm",)),
    Exercise("load_balancing_loss", "The load-balancing loss", 3, "load_balancing_loss", check_load_balancing_loss,
             hidden=[{"cases": ((20, 8, 1, 0.1), (12, 4, 3, 0.1)), "seed": 1}]),
    Exercise("kept_counts", "Find the bug: capacity over ranks", 2, "kept_counts", check_kept_counts,
             hidden=[{"cases": ((4, 8, 3), (2, 2, None), (1, 3, 1), (5, 2, 12)), "seed": 1}]),
    Exercise("update_expert_bias", "Auxiliary-loss-free balancing on ranks", 3, "update_expert_bias",
             check_expert_bias,
             hidden=[{"world_size": 4, "cases": (((6, 0, 3, 9), 8, 2, 1e-2),), "seed": 1},
                     {"world_size": 2, "cases": (((0, 5), 2, 1, 1e-3),), "seed": 2}],
             allowed=("course_lib.comm",)),
]



# ----------------------------------------------------------------------------------------------------------------
# Case classes. The world size comes from the process group: what a hard-coded one (2, the chapter's) breaks, more
# than two ranks shows, and an all-to-all has no ring whose neighbours coincide on two ranks, so two ranks are no
# class of their own; what a count matrix [W, E/W] of one column breaks (a squeeze), one expert per rank shows.


def _experts_per_rank(world: int, n_expert: int) -> str:
    return "one expert per rank" if n_expert == world else "several experts per rank"


def _routing_classes(calls: list[dict]) -> set[str]:
    out = set()
    for call in calls:
        for T, E, k, cf in call["cases"]:
            logits = _router_logits(T, E, call["repeat"], call["seed"])
            _, keep = reference_batch_priority_routing(logits, k, cf)
            out |= {"top-1" if k == 1 else "top-k, k > 1",
                    "every assignment kept" if bool(keep.all()) else "assignments dropped at capacity"}
            out |= {"a fractional capacity cf T k / E (rounded up)"} if (cf * T * k / E) % 1 else set()
            twins = [(a, b) for a in range(T) for b in range(a + 1, T) if torch.equal(logits[a], logits[b])]
            if any(not torch.equal(keep[a], keep[b]) for a, b in twins):  # the tie decides who is dropped
                out.add("equal priorities at the capacity's edge (the earlier token first)")
    return out


def _dispatch_classes(calls: list[dict]) -> set[str]:
    out = {"an expert without rows"}  # by construction: the last expert is never chosen
    for call in calls:
        w = call["world_size"]
        out |= {"more than two ranks"} if w > 2 else set()
        for rows, n_expert in call["cases"]:
            out |= {_experts_per_rank(w, n_expert)} | ({"a rank without rows"} if 0 in rows else set())
    return out


def _combine_classes(calls: list[dict]) -> set[str]:
    out = set()
    for call in calls:
        w = call["world_size"]
        out |= {"more than two ranks"} if w > 2 else set()
        for rows, n_expert, k, cf in call["cases"]:
            keep = _Layer(sum(rows), n_expert, k, cf, call["h"], call["seed"]).keep
            out |= {_experts_per_rank(w, n_expert), "top-1" if k == 1 else "top-k, k > 1",
                    "every assignment kept" if bool(keep.all()) else "assignments dropped at capacity"}
            out |= {"a token none of whose assignments is kept"} if bool((~keep).all(1).any()) else set()
            out |= {"a rank without tokens"} if 0 in rows else set()
    return out


def _kept_classes(calls: list[dict]) -> set[str]:
    out = set()
    for call in calls:
        for W, E, cap in call["cases"]:
            counts = _count_matrix(W, E, call["seed"])
            kept = kept_counts(counts, cap)
            if cap is None:
                out.add("no capacity")
                continue
            out |= {"a capacity that keeps everything"} if torch.equal(kept, counts) else set()
            out |= {"a queue cut inside a rank's share"} if bool(((kept > 0) & (kept < counts)).any()) else set()
            out |= {"a rank whose share comes after the capacity"} if bool(((kept == 0) & (counts > 0)).any()) \
                else set()
    return out


def _bias_classes(calls: list[dict]) -> set[str]:
    out = set()
    for call in calls:
        out |= {"more than two ranks"} if call["world_size"] > 2 else set()
        for rows, _, k, _ in call["cases"]:
            out |= ({"a rank without tokens"} if 0 in rows else set()) | ({"top-k, k > 1"} if k > 1 else set())
    # a rate the answer hard-codes (DeepSeek-V3's 0.001) passes a check at that rate alone
    return out | ({"several rates"} if len({c[3] for c in each(calls)}) > 1 else set())


CASE_CLASSES = {
    "batch_priority_routing": _routing_classes,
    "dispatch": _dispatch_classes,
    "combine": _combine_classes,
    "load_balancing_loss": lambda calls: {"top-1" if k == 1 else "top-k, k > 1" for _, _, k, _ in each(calls)}
    | ({"several expert counts"} if len({E for _, E, _, _ in each(calls)}) > 1 else set())
    | ({"several alphas"} if len({a for *_, a in each(calls)}) > 1 else set()),
    "kept_counts": _kept_classes,
    "update_expert_bias": _bias_classes,
}

guard_visible_checks(globals(), EXERCISES)
