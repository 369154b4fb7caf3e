"""Chapter 07 — mixture of experts and expert parallelism.

1. ``batch_priority_routing(logits, k, capacity_factor)``: the chosen experts and the kept assignments under
   batch-priority routing (Riquelme et al. 2021), exact, over several sizes, k and capacity factors.
2. ``dispatch(x, expert, n_expert)`` on real ranks: the rows each rank receives, in order, and the counts, exact;
   ranks with no rows and experts with none included.
3. ``combine(y, counts, expert, token, weight, n_tokens)`` on real ranks: every rank's output against the
   single-process ``MoE`` layer's for its tokens (capacity drops included, top-1 and top-2), with exactly one
   ``all_to_all_single`` and every other collective and send/recv refused.
4. ``load_balancing_loss(probs, chosen, alpha)``: the Switch / GShard auxiliary loss, its value and its gradient.
5. ``kept_counts(counts, capacity)`` (find the bug): the kept assignments of every (rank, expert), exact, with and
   without a capacity.
6. ``update_expert_bias(bias, chosen, rate)`` on real ranks: DeepSeek-V3's auxiliary-loss-free bias update,
   against the single-process one, identical on every rank, ranks with no tokens included.
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


def check_batch_priority_routing(fn: Callable, cases: tuple[tuple[int, int, int, float], ...] = ((16, 4, 2, 0.75),),
                                 repeat: int = 1, seed: int = 0) -> CheckResult:
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


def _dispatch_inputs(rank: int, world: int, rows: tuple[int, ...], n_expert: int, h: int,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    n = rows[rank]
    expert = torch.randint(0, max(n_expert - 1, 1), (n,), generator=g)  # the last expert never gets a row
    return torch.randn(n, h, generator=g), expert


def _dispatch_on_rank(rank: int, world_size: int, fn: Callable, rows: tuple[int, ...], n_expert: int, h: int,
                      seed: int) -> Any:
    x, expert = _dispatch_inputs(rank, world_size, rows, n_expert, h, seed)
    return fn(x, expert, n_expert)


def check_dispatch(fn: Callable, world_size: int = 2, rows: tuple[int, ...] = (5, 7), n_expert: int = 4, h: int = 3,
                   seed: int = 0, timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    def body() -> str:
        n, n_local = world_size, n_expert // world_size
        inputs = [_dispatch_inputs(r, n, rows, n_expert, h, seed) for r in range(n)]
        results = core.launch_check(_dispatch_on_rank, n, fn, rows, n_expert, h, seed, timeout=timeout,
                                    hang_hint=" (did every rank call the same collectives in the same order, with "
                                              "receive splits that match what the others send?)",
                                    course_files=("course_lib/grading/ch07.py",))
        for r, got in enumerate(results):
            if not isinstance(got, tuple) or len(got) != 2:
                raise CheckFailed(f"rank {r}: dispatch must return (received rows, counts), got {type(got).__name__}")
            mine = range(r * n_local, (r + 1) * n_local)
            counts = torch.tensor([[int((e == j).sum()) for j in mine] for _, e in inputs])
            expected = torch.cat([x[e == j] for x, e in inputs for j in mine]).reshape(-1, h)
            what = f"rank {r} of {n} (rows per rank {rows}, E={n_expert})"
            _expect_same(_tensor(got[1], f"counts on {what}", (n, n_local), torch.long), counts, f"counts on {what}")
            expect_close(_tensor(got[0], f"received rows on {what}", tuple(expected.shape), torch.float32), expected,
                         f"received rows on {what} (by source rank, then by expert, in row order)", rtol=0, atol=0)
        return f"{n} ranks, rows {rows}, E={n_expert}: every row at its expert's rank, in order"
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


def _combine_on_rank(rank: int, world_size: int, fn: Callable, moe: MoE,
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


def check_combine(fn: Callable, world_size: int = 2, rows: tuple[int, ...] = (5, 7), n_expert: int = 4,
                  top_k: int = 2, capacity_factor: float | None = 1.0, h: int = 8, seed: int = 0,
                  timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """Each rank's ``fn(y, counts, expert, token, weight, n_tokens)`` must return the single-process MoE's output
    for its tokens, [rows[r], h] float32, with exactly one all_to_all_single (M rows in, N rows out)."""
    def body() -> str:
        cfg = GPTConfig(n_layer=1, d_model=h, n_head=2, seq_len=8, n_expert=n_expert, top_k=top_k,
                        capacity_factor=capacity_factor, bias=False)
        torch.manual_seed(seed)
        moe = MoE(cfg)
        x = torch.randn(sum(rows), h, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            r = moe.route(x)
            cap = moe.capacity(x.shape[0])
            keep = torch.ones_like(r.chosen, dtype=torch.bool) if cap is None else (
                expert_positions(r.chosen, n_expert) < cap)
            ref = moe(x)
        bounds = [sum(rows[:i]) for i in range(world_size + 1)]
        shards = [tuple(t[bounds[i]:bounds[i + 1]] for t in (x, r.chosen, r.weights, keep))
                  for i in range(world_size)]
        results = core.launch_check(_combine_on_rank, world_size, fn, moe, shards, timeout=timeout,
                                    hang_hint=" (did every rank call one all_to_all_single, with the dispatch's "
                                              "splits swapped: input splits = what it received from each rank?)",
                                    course_files=("course_lib/grading/ch07.py",), guard_errors=("RefusedCollective",))
        what = f"of {world_size} (tokens per rank {rows}, E={n_expert}, k={top_k}, cf={capacity_factor}, C={cap})"
        for i, res in enumerate(results):
            expect_close(res["out"], ref[bounds[i]:bounds[i + 1]], f"rank {i} {what}: the combined output of its "
                         "tokens vs the single-process MoE layer", rtol=1e-5, atol=1e-6)
            m_rows, n_rows = res["rows"]
            if len(res["log"]) != 1:
                raise CheckFailed(f"rank {i} {what} called all_to_all_single {len(res['log'])} times; the combine is "
                                  "one (the splits are known: counts for the rows that came, expert for those sent)")
            if res["log"][0] != (m_rows, n_rows, "float32"):
                raise CheckFailed(f"rank {i} {what}: its all_to_all_single took {res['log'][0][0]} rows "
                                  f"({res['log'][0][2]}) and gave {res['log'][0][1]}; the way back sends the {m_rows} "
                                  f"float32 expert outputs it holds and receives its own {n_rows} assignments")
        dropped = int((~keep).sum())
        return f"{world_size} ranks, tokens {rows}, E={n_expert}, k={top_k}: the MoE's output ({dropped} dropped)"
    return run_check("combine", body)


# ----------------------------------------------------------------------------------------------------------------
# 4. load-balancing loss


def check_load_balancing_loss(fn: Callable, cases: tuple[tuple[int, int, int], ...] = ((16, 4, 2),),
                              alpha: float = 0.01, seed: int = 0) -> CheckResult:
    def body() -> str:
        for T, E, k in cases:
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


def check_kept_counts(fn: Callable, cases: tuple[tuple[int, int, int | None], ...] = ((3, 4, 5),),
                      seed: int = 0) -> CheckResult:
    def body() -> str:
        for W, E, cap in cases:
            g = torch.Generator().manual_seed(seed * 13 + W * E)
            counts = torch.randint(0, 6, (W, E), generator=g)
            counts[0, 0] = 0  # an empty (rank, expert)
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


def _bias_inputs(rank: int, rows: tuple[int, ...], n_expert: int, top_k: int,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's choices [rows[rank], k]: rank r prefers expert r mod E, so a rank's own loads disagree with the
    batch's (an expert busy on one rank is idle on another); a token's k experts listed by decreasing id (a load
    counts every choice, whatever its column); the starting bias, the same on every rank."""
    g = torch.Generator().manual_seed(100 * seed + rank)
    pref = torch.full((n_expert,), 1.0)
    pref[rank % n_expert] = 4.0 * n_expert
    chosen = torch.stack([torch.multinomial(pref, top_k, generator=g).sort(descending=True).values
                          for _ in range(rows[rank])]) if rows[rank] else torch.zeros(0, top_k, dtype=torch.long)
    bias = torch.randn(n_expert, generator=torch.Generator().manual_seed(seed)) * 1e-2
    return bias, chosen


def _bias_on_rank(rank: int, world_size: int, fn: Callable, rows: tuple[int, ...], n_expert: int, top_k: int,
                  rate: float, seed: int) -> Any:
    bias, chosen = _bias_inputs(rank, rows, n_expert, top_k, seed)
    return fn(bias.clone(), chosen.clone(), rate)


def check_expert_bias(fn: Callable, world_size: int = 2, rows: tuple[int, ...] = (12, 8), n_expert: int = 4,
                      top_k: int = 2, rate: float = 1e-3, seed: int = 0,
                      timeout: float = LAUNCH_TIMEOUT_S) -> CheckResult:
    """Each rank's ``fn(bias, chosen, rate)`` must return the single-process bias after one update from the
    whole batch's routed counts, [E] float32, identical on every rank."""
    def body() -> str:
        inputs = [_bias_inputs(r, rows, n_expert, top_k, seed) for r in range(world_size)]
        load = torch.bincount(torch.cat([c for _, c in inputs]).reshape(-1), minlength=n_expert)
        moe = MoE(GPTConfig(n_layer=1, d_model=8, n_head=2, seq_len=8, n_expert=n_expert, top_k=top_k,
                            router="sigmoid", bias=False))
        moe.expert_bias.copy_(inputs[0][0])
        moe.balance_bias_(load, rate)
        results = core.launch_check(_bias_on_rank, world_size, fn, rows, n_expert, top_k, rate, seed,
                                    timeout=timeout, hang_hint=" (did every rank call the same collectives?)",
                                    course_files=("course_lib/grading/ch07.py",))
        local = [torch.bincount(c.reshape(-1), minlength=n_expert).tolist() for _, c in inputs]
        for r, got in enumerate(results):
            what = (f"rank {r} of {world_size} (its routed counts {local[r]}, the batch's {load.tolist()}, "
                    f"rate {rate})")
            expect_close(_tensor(got, f"the bias on {what}", (n_expert,), torch.float32), moe.expert_bias,
                         f"the bias on {what}: b_i + rate * sign(mean load - load_i), loads over every rank's tokens",
                         rtol=0, atol=1e-9)
        return f"{world_size} ranks, counts {local}: every rank's bias moved by the batch's loads"
    return run_check("update_expert_bias", body)


EXERCISES = [
    Exercise("batch_priority_routing", "Batch-priority routing under capacity", 3, "batch_priority_routing",
             check_batch_priority_routing,
             hidden=[{"cases": ((32, 8, 2, 1.25), (10, 4, 1, 0.5), (9, 3, 3, 1.0), (7, 5, 2, 0.1)), "seed": 1},
                     {"cases": ((12, 4, 2, 0.75), (16, 8, 2, 1.0)), "repeat": 3, "seed": 2}]),
    Exercise("dispatch", "Count exchange and uneven all-to-all dispatch", 4, "dispatch", check_dispatch,
             hidden=[{"world_size": 4, "rows": (6, 0, 3, 9), "n_expert": 8, "seed": 1},
                     {"world_size": 2, "rows": (0, 4), "n_expert": 2, "seed": 2}],
             allowed=("course_lib.comm",)),
    Exercise("combine", "The combine: the reverse all-to-all and the weighted sum", 4, "combine", check_combine,
             hidden=[{"world_size": 4, "rows": (6, 0, 3, 9), "n_expert": 8, "capacity_factor": 0.5, "seed": 1},
                     {"world_size": 2, "rows": (0, 4), "n_expert": 2, "top_k": 1, "capacity_factor": None,
                      "seed": 2}],
             allowed=("course_lib.comm",)),
    Exercise("load_balancing_loss", "The load-balancing loss", 3, "load_balancing_loss", check_load_balancing_loss,
             hidden=[{"cases": ((20, 8, 1), (12, 4, 3)), "alpha": 0.1, "seed": 1}]),
    Exercise("kept_counts", "Find the bug: capacity over ranks", 2, "kept_counts", check_kept_counts,
             hidden=[{"cases": ((4, 8, 3), (2, 2, None), (1, 3, 1), (5, 2, 12)), "seed": 1}]),
    Exercise("update_expert_bias", "Auxiliary-loss-free balancing on ranks", 3, "update_expert_bias",
             check_expert_bias,
             hidden=[{"world_size": 4, "rows": (6, 0, 3, 9), "n_expert": 8, "rate": 1e-2, "seed": 1},
                     {"world_size": 2, "rows": (0, 5), "n_expert": 2, "top_k": 1, "seed": 2}],
             allowed=("course_lib.comm",)),
]


guard_visible_checks(globals(), EXERCISES)
