"""Chapter 09 — serving.

1. ``attend_over_cache(q, k_cache, v_cache, k_new, v_new)``: the grown caches and the new queries' attention;
   empty caches, several new tokens and GQA included.
2. ``reserve_blocks(table, free, n_tokens, block_size)``: the block table and free list after a reservation, and
   the verdict; refusals must change nothing.
3. ``request_metrics(arrival_s, token_times)``: TTFT, inter-token gaps, TPOT and end-to-end latency as floats; a
   request without tokens must raise ``ValueError``.
4. ``tp_kv_heads(rank, t, n_head, n_kv)``: the KV heads a TP rank holds; tensor-parallel decode run on real ranks
   with them must give one rank's tokens.
5. ``paged_decode(q, k_pool, v_pool, block_tables, seq_lens)`` (find the bug): batched decode over a paged KV
   cache (Kwon et al. 2023), each sequence's output against attention over its own positions, on sequences
   shorter and longer than a block, GQA and MHA.
6. ``schedule_step(running, waiting, token_budget, max_batch, free_blocks, block_size)``: one continuous-batching
   scheduler step, the plan and the preempted ids, exact, over cases of decodes, prefills, admissions and
   preemptions.
7. ``verify_sampled(p, q, drafts, generator)``: speculative sampling's verification (Leviathan et al. / Chen et
   al.); fixed cases, then chi-square tests of the emitted tokens against the target's distribution.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from course_lib.grading.cases import each, ranks, several
from course_lib.grading.core import (
    CheckFailed,
    CheckResult,
    Exercise,
    expect_close,
    expect_equal,
    guard_visible_checks,
    launch_check,
    run_check,
)
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.serving.engine import generate
from course_lib.serving.tp_decode import TPDecodeEngine, kv_heads_of, tp_generate

GRADER_PARAMETERS = {"seed": 1}


def _full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference: causal attention of the last n positions over all T + n keys (GQA by repetition)."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    n, total = q.shape[1], k.shape[1]
    mask = torch.ones(total, total, dtype=torch.bool).tril()[total - n:]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


ATTEND_CASES = ((4, 4, 5, 3), (4, 2, 0, 4), (6, 3, 7, 1), (2, 1, 3, 2))
"""(H, H_kv, T cached, n new) of the visible check: MHA, GQA from an empty cache and in decode, MQA."""


def check_attend_over_cache(fn: Callable, cases: tuple[tuple[int, int, int, int], ...] = ATTEND_CASES,
                            seed: int = 0) -> CheckResult:
    """cases: (H, H_kv, T cached, n new)."""
    def body() -> str:
        g = torch.Generator().manual_seed(seed)
        d = 8
        for H, Hkv, T, n in cases:
            q = torch.randn(H, n, d, generator=g)
            kc, vc = torch.randn(Hkv, T, d, generator=g), torch.randn(Hkv, T, d, generator=g)
            kn, vn = torch.randn(Hkv, n, d, generator=g), torch.randn(Hkv, n, d, generator=g)
            got = fn(q, kc, vc, kn, vn)
            if not isinstance(got, tuple) or len(got) != 3:
                raise CheckFailed(f"attend_over_cache must return (k_all, v_all, out), got {type(got).__name__}")
            what = f"(H={H}, H_kv={Hkv}, T={T}, n={n})"
            expect_close(got[0], torch.cat([kc, kn], 1), f"k_all {what}")
            expect_close(got[1], torch.cat([vc, vn], 1), f"v_all {what}")
            expect_close(got[2], _full_attention(q, got[0], got[1]), f"out {what}", rtol=1e-4, atol=1e-5)
        return f"{len(cases)} cases correct (cache lengths {[c[2] for c in cases]})"
    return run_check("attend_over_cache", body)


def _reserve_reference(table: list[int], free: list[int], n_tokens: int, block_size: int) -> bool:
    need = math.ceil(n_tokens / block_size) - len(table)
    if need > len(free):
        return False
    for _ in range(max(need, 0)):
        table.append(free.pop())
    return True


def check_reserve_blocks(fn: Callable, cases: tuple[tuple[list[int], list[int], int, int], ...] = (
        ([], [5, 4, 3, 2, 1, 0], 9, 4), ([0], [3, 2, 1], 4, 4), ([0, 1], [3, 2], 13, 4), ([7], [2], 12, 4),
        ([], [1, 0], 0, 4))) -> CheckResult:
    """cases: (table, free list, n_tokens, block_size); the check works on copies."""
    def body() -> str:
        for table, free, n, bs in cases:
            t_got, f_got, t_ref, f_ref = list(table), list(free), list(table), list(free)
            ok = fn(t_got, f_got, n, bs)
            ok_ref = _reserve_reference(t_ref, f_ref, n, bs)
            what = f"reserve_blocks(table={table}, free={free}, n_tokens={n}, block_size={bs})"
            expect_equal(ok, ok_ref, f"{what} return value")
            expect_equal(t_got, t_ref, f"{what}: table afterwards")
            expect_equal(f_got, f_ref, f"{what}: free list afterwards")
        return f"{len(cases)} cases correct, including a refusal that must change nothing"
    return run_check("reserve_blocks", body)


def check_request_metrics(fn: Callable, cases: tuple[tuple[float, list[float]], ...] = (
        (1.0, [1.5, 1.6, 1.8, 1.9]), (0.0, [0.25]), (2.0, [2.0, 2.5, 2.5]))) -> CheckResult:
    def body() -> str:
        for arrival, times in cases:
            got = fn(arrival, list(times))
            what = f"request_metrics({arrival}, {times})"
            if not isinstance(got, dict) or set(got) != {"ttft", "itl", "tpot", "e2e"}:
                raise CheckFailed(f"{what} must return a dict with keys ttft, itl, tpot, e2e, got {got!r}")
            gaps = [b - a for a, b in itertools.pairwise(times)]
            expect = {"ttft": times[0] - arrival, "e2e": times[-1] - arrival,
                      "tpot": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None}
            for k, v in expect.items():
                if v is None:
                    if got[k] is not None:
                        raise CheckFailed(f"{what}['{k}']: one token has no time per output token: expected None, "
                                          f"got {got[k]!r}")
                elif not isinstance(got[k], float) or abs(got[k] - v) > 1e-9:
                    raise CheckFailed(f"{what}['{k}']: expected {v!r} (a float), got {got[k]!r}")
            if not isinstance(got["itl"], list) or len(got["itl"]) != len(gaps) or \
                    any(abs(a - b) > 1e-9 for a, b in zip(got["itl"], gaps, strict=True)):
                raise CheckFailed(f"{what}['itl']: expected the {len(gaps)} gaps {gaps}, got {got['itl']!r}")
        try:
            fn(0.0, [])
        except ValueError:
            pass
        else:
            raise CheckFailed("request_metrics(0.0, []) must raise ValueError: a request without tokens has no TTFT")
        return f"{len(cases)} requests correct, and an empty one refused"
    return run_check("request_metrics", body)


def _tp_with(rank: int, world_size: int, fn: Callable, cfg: GPTConfig, prompts: list[torch.Tensor]) -> list:
    class Learner(TPDecodeEngine):
        def kv_heads(self) -> list[int]:
            return list(fn(self.rank, self.t, self.config.n_head, self.config.kv_heads))

    return tp_generate(rank, world_size, cfg, prompts, 5, engine_cls=Learner)["tokens"]


TP_CASES = ((2, 4, 2), (4, 8, 2), (2, 8, 4), (2, 2, 1))
"""(t, n_head, n_kv) of the visible check: one K/V head a rank, a head replicated over 2 of 4 ranks, two heads a
rank, one head on every rank (MQA)."""


def check_tp_kv_heads(fn: Callable, cases: tuple[tuple[int, int, int], ...] = TP_CASES,
                      seed: int = 0) -> CheckResult:
    """cases: (t, n_head, n_kv): every rank's list against the placement, then greedy TP decode on t real ranks with
    the learner's placement against one rank's tokens."""
    def body() -> str:
        for t, n_head, n_kv in cases:
            for rank in range(t):
                expect_equal(fn(rank, t, n_head, n_kv), kv_heads_of(rank, t, n_head, n_kv),
                             f"tp_kv_heads(rank={rank}, t={t}, n_head={n_head}, n_kv={n_kv})")
        torch.set_num_threads(1)
        for t, n_head, n_kv in cases:
            cfg = GPTConfig(seq_len=32, n_head=n_head, n_kv_head=n_kv, d_model=8 * n_head)
            g = torch.Generator().manual_seed(seed)
            prompts = [torch.randint(0, 256, (n,), generator=g) for n in (3, 8)]
            ref = generate(GPT(cfg, seed=0).eval(), prompts, 5)
            got = launch_check(_tp_with, t, fn, cfg, prompts, timeout=90,
                               hang_hint=": a rank waited in an all-reduce")
            for rank, tokens in enumerate(got):
                expect_equal(tokens, ref, f"greedy tokens of TP decode on rank {rank} of {t} (n_head={n_head}, "
                             f"n_kv={n_kv})")
        return (f"(t, n_head, n_kv) in {list(cases)}: every rank's K/V heads right, and TP decode on real ranks "
                "gives one rank's tokens")
    return run_check("tp_kv_heads", body)


def _paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, *, sorted_table: bool = False, tail: bool = False,
                     tiled: bool = False, before_new: bool = False) -> torch.Tensor:
    """Decode attention of each sequence's query over its cached positions, gathered one by one from the pool
    (position p of sequence b at block block_tables[b, p // bs], offset p % bs, Kwon et al. 2023). The keywords
    are a learner's mistakes: blocks in id order, the whole last block attended, GQA heads tiled, the new token's
    own position left out."""
    bs, rep = k_pool.shape[2], q.shape[1] // k_pool.shape[1]
    out = []
    for b, n in enumerate(seq_lens.tolist()):
        n_blocks = math.ceil(n / bs)
        table = block_tables[b, :n_blocks].sort().values if sorted_table else block_tables[b, :n_blocks]
        pos = torch.arange(n_blocks * bs if tail else n - before_new)
        k, v = (pool[table[pos // bs], :, pos % bs].transpose(0, 1) for pool in (k_pool, v_pool))
        k, v = (k.repeat(rep, 1, 1), v.repeat(rep, 1, 1)) if tiled else (k, v)
        out.append(_full_attention(q[b][:, None], k, v)[:, 0])
    return torch.stack(out)


_PAGED_MISTAKES = (
    ({"sorted_table": True}, "what you get reading its blocks in the order of their ids: the table's order is the "
                             "sequence's order (blocks come from the free list in any order)"),
    ({"tail": True}, "what you get attending to every slot of its last block: the slots past seq_len hold what an "
                     "earlier sequence left there (blocks are reused, never cleared)"),
    ({"tiled": True}, "what you get giving query head h the K/V head h % H_kv: a K/V head serves H / H_kv "
                      "consecutive query heads"),
    ({"before_new": True}, "what you get leaving out the new token's own position: seq_lens counts it"),
)


def _paged_inputs(lens: tuple[int, ...], n_head: int, n_kv: int, block_size: int, n_free: int,
                  seed: int) -> tuple[torch.Tensor, ...]:
    """A pool of random blocks (every slot holds something, as after earlier sequences); each sequence's blocks
    drawn from a shuffled free list and never in increasing id order (as once the free list has churned); the
    tables padded with the pool's last block."""
    g = torch.Generator().manual_seed(seed)
    d, need = 8, [math.ceil(n / block_size) for n in lens]
    n_blocks = sum(need) + n_free
    free = torch.randperm(n_blocks, generator=g).tolist()
    tables = torch.full((len(lens), max(need)), n_blocks - 1)
    for b, m in enumerate(need):
        mine = sorted(free.pop() for _ in range(m))
        tables[b, :m] = torch.tensor(mine[1:2] + mine[:1] + mine[2:])  # the first two out of order
    pools = [torch.randn(n_blocks, n_kv, block_size, d, generator=g) for _ in range(2)]
    return torch.randn(len(lens), n_head, d, generator=g), *pools, tables, torch.tensor(lens)


def check_paged_decode(fn: Callable, lens: tuple[int, ...] = (6, 1, 12, 3),
                       heads: tuple[tuple[int, int], ...] = ((4, 2), (4, 4), (4, 1)), block_size: int = 4,
                       seed: int = 0) -> CheckResult:
    """``fn(q [B, H, d], k_pool, v_pool [n_blocks, H_kv, bs, d], block_tables [B, max_blocks], seq_lens [B])``
    must return [B, H, d]: each sequence's decode attention over its first seq_lens[b] cached positions; for each
    (H, H_kv) of ``heads`` (GQA, MHA, MQA by default)."""
    def body() -> str:
        for n_head, n_kv in heads:
            q, kp, vp, tables, seq_lens = _paged_inputs(lens, n_head, n_kv, block_size, 3, seed)
            got = fn(q.clone(), kp.clone(), vp.clone(), tables.clone(), seq_lens.clone())
            want = _paged_attention(q, kp, vp, tables, seq_lens)
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                raise CheckFailed(f"paged_decode must return [B, H, d] = {list(want.shape)}, got "
                                  f"{list(getattr(got, 'shape', [])) or type(got).__name__}")
            bad = [b for b in range(len(lens)) if not torch.allclose(got[b], want[b], rtol=1e-4, atol=1e-5)]
            if bad:
                b = bad[0]
                right = [f"{lens[i]} ({math.ceil(lens[i] / block_size)} block{'s' * (lens[i] > block_size)})"
                         for i in range(len(lens)) if i not in bad]
                why = next((w for kw, w in _PAGED_MISTAKES
                            if torch.allclose(got[b], _paged_attention(q, kp, vp, tables, seq_lens, **kw)[b],
                                              rtol=1e-4, atol=1e-5)), "")
                blocks = tables[b, :math.ceil(lens[b] / block_size)].tolist()
                raise CheckFailed(f"sequence {b} (seq_len {lens[b]}, its blocks {blocks} of {block_size} slots; "
                                  f"H={n_head}, H_kv={n_kv}): wrong output"
                                  f"{f', {why}' if why else ''}; right for seq_lens {', '.join(right) or 'none'}, "
                                  f"wrong for {', '.join(str(lens[i]) for i in bad)}")
        return (f"{len(lens)} sequences right (seq_lens {list(lens)}, blocks of {block_size}) for (H, H_kv) in "
                f"{list(heads)}")
    return run_check("paged_decode", body)


def _schedule_step_reference(running: list[tuple[int, int, int, int]], waiting: list[tuple[int, int]],
                             token_budget: int, max_batch: int, free_blocks: int, block_size: int,
                             seen: set[str] | None = None) -> tuple[list[tuple[int, int]], list[int]]:
    """The step the specification describes; ``seen`` collects the case classes the step exercises."""
    seen = set() if seen is None else seen
    budget, free = token_budget, free_blocks
    alive = [[*s, 0] for s in running]  # [id, n_tokens, n_cached, n_blocks, blocks reserved this step]
    plan: dict[int, int] = {}
    preempted: list[int] = []
    decodes = [s for s in alive if s[2] == s[1] - 1]
    prefills = [s for s in alive if s[2] < s[1] - 1]
    if decodes and prefills and alive.index(prefills[0]) < alive.index(decodes[-1]):
        seen.add("a decode admitted after a prefill")
    if len(decodes) > token_budget:
        seen.add("more decodes than the token budget")
    given_back = freed = 0
    for s in decodes + prefills:
        n = min(s[1] - s[2], budget)
        if s[0] in preempted or n <= 0:
            continue
        if n < s[1] - s[2]:
            seen.add("a prefill cut to the budget left")
        need = math.ceil((s[2] + n) / block_size) - s[3]
        if max(need, 0) != math.ceil(n / block_size):
            seen.add("blocks for the whole sequence, not the chunk")
        while need > free:
            victim = [v for v in alive if v[0] not in preempted][-1]
            preempted.append(victim[0])
            seen.add("a sequence preempts itself" if victim is s else "a preemption")
            if victim[4]:
                seen.add("a victim's blocks reserved this step")
            free += victim[3]
            freed += victim[3]
            if victim[0] in plan:
                seen.add("a planned sequence preempted")
                given_back += plan[victim[0]]
            budget += plan.pop(victim[0], 0)
            if victim is s:
                break
        if s[0] in preempted:
            continue
        free -= max(need, 0)
        s[3] += max(need, 0)
        s[4] += max(need, 0)
        plan[s[0]] = n
        budget -= n
    in_batch, admitted, blocks_before = len(alive) - len(preempted), 0, free
    for i, (wid, n_tokens) in enumerate(waiting):
        n = min(n_tokens, budget)
        if in_batch >= max_batch:
            seen.add("admission stopped by the batch limit")
            break
        if n <= 0:
            seen.add("admission stopped by the budget")
            break
        if math.ceil(n / block_size) > free:
            seen.add("admission stopped by the blocks" + (", someone behind" if waiting[i + 1:] else ""))
            break
        if n < n_tokens:
            seen.add("a prompt cut to the budget left")
        free -= math.ceil(n / block_size)
        plan[wid] = n
        budget -= n
        in_batch += 1
        admitted += 1
    if admitted and preempted and admitted > max_batch - len(running):
        seen.add("an admission in a preempted sequence's place")
    if admitted and freed and blocks_before - free > blocks_before - freed:
        seen.add("an admission into blocks a preemption freed")
    if given_back and sum(plan.values()) > token_budget - given_back:
        seen.add("tokens given back used again")
    return list(plan.items()), preempted


SCHEDULE_CASES = (
    # (running [(id, n_tokens, n_cached, n_blocks)], waiting [(id, n_tokens)], budget, max_batch, free, block_size)
    ([(0, 10, 4, 2), (1, 6, 5, 2)], [(2, 5)], 6, 4, 10, 4),  # the decode before the earlier prefill
    ([(0, 9, 8, 3)], [(1, 20), (2, 3)], 8, 3, 10, 4),  # a newcomer's prompt chunked to the budget left
    ([(0, 5, 4, 2), (1, 7, 6, 2)], [(2, 3)], 16, 2, 10, 4),  # the batch is full
    ([(0, 5, 4, 2)], [(1, 16), (2, 2)], 32, 4, 3, 4),  # the head of the queue does not fit: nobody jumps it
    ([(0, 9, 8, 2), (1, 5, 4, 1), (2, 13, 12, 3)], [(3, 4)], 16, 4, 1, 4),  # preempt the newest, reuse its blocks
    ([(0, 5, 4, 2), (1, 20, 4, 1)], [], 8, 4, 0, 4),  # the sequence that does not fit is the newest: itself
    ([(0, 30, 4, 1), (1, 5, 4, 1)], [(2, 3)], 8, 4, 1, 4),  # a planned decode preempted: its token comes back
    ([(0, 8, 1, 1), (1, 6, 5, 2)], [(2, 4)], 7, 2, 0, 4),  # ... and a newcomer takes its token, place and blocks
    ([(0, 5, 4, 2), (1, 9, 8, 3), (2, 3, 2, 1)], [(3, 4)], 2, 8, 4, 4),  # more decodes than budget: one waits
)


def _expect_a_possible_plan(plan: list[tuple], preempted: list, running: list, waiting: list, budget: int,
                            what: str) -> None:
    """Whatever the rules, a plan feeds each known sequence at most once, at least one token, within the budget,
    and never a preempted one."""
    known = [s[0] for s in running] + [w[0] for w in waiting]
    for entry in plan:
        if len(entry) != 2 or entry[0] not in known or type(entry[1]) is not int:
            raise CheckFailed(f"{what}: plan entry {entry!r} is not (a running or waiting id, an int)")
        if entry[1] < 1:
            raise CheckFailed(f"{what}: sequence {entry[0]} is planned {entry[1]} tokens; a planned sequence feeds at "
                              "least one (one with nothing to feed, or no budget left, is not planned)")
    ids = [sid for sid, _ in plan]
    if len(set(ids)) != len(ids) or set(ids) & set(preempted):
        raise CheckFailed(f"{what}: plan {plan} with preempted {preempted}: an id planned twice, or planned and "
                          "preempted")
    if sum(n for _, n in plan) > budget:
        raise CheckFailed(f"{what}: the plan {plan} feeds {sum(n for _, n in plan)} tokens, over the token budget "
                          f"of {budget} (decodes count against it too)")


def check_schedule_step(fn: Callable, cases: tuple = SCHEDULE_CASES) -> CheckResult:
    def body() -> str:
        for running, waiting, budget, max_batch, free, bs in cases:
            what = (f"schedule_step(running={running}, waiting={waiting}, token_budget={budget}, "
                    f"max_batch={max_batch}, free_blocks={free}, block_size={bs})")
            got = fn(list(running), list(waiting), budget, max_batch, free, bs)
            if not isinstance(got, tuple) or len(got) != 2:
                raise CheckFailed(f"{what} must return (plan, preempted), got {got!r}")
            plan, preempted = [tuple(x) for x in got[0]], list(got[1])
            _expect_a_possible_plan(plan, preempted, running, waiting, budget, what)
            ref_plan, ref_preempted = _schedule_step_reference(running, waiting, budget, max_batch, free, bs)
            expect_equal(plan, ref_plan, f"{what}: plan [(id, tokens to feed)]")
            expect_equal(preempted, ref_preempted, f"{what}: preempted ids")
        return f"{len(cases)} steps planned right: decodes first, budget, batch limit, FIFO admission, preemption"
    return run_check("schedule_step", body)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit of ``counts`` to ``probs``; the p-value is the regularised upper
    incomplete gamma function Q(df / 2, x / 2), df = cells - 1."""
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(counts) - 1) / 2), stat / 2))


FALSE_ALARM = 1e-3
"""Each chi-square test fails a right rule with probability 1e-3 on fresh draws (the draws are seeded here, so a
given check always gives the same verdict)."""


def target_and_draft(vocab: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distributions of the target p [k + 1, vocab] and the draft q [k, vocab] (float64), far apart enough
    that proposals are rejected often."""
    p = torch.softmax(1.5 * torch.randn(k + 1, vocab, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(1.5 * torch.randn(k, vocab, generator=g, dtype=torch.float64), -1)
    return p, q


def emitted_counts(rule: Callable, p: torch.Tensor, q: torch.Tensor, n: int, g: torch.Generator) -> list[torch.Tensor]:
    """Draw k proposals from q and apply ``rule(p, q, drafts, g)``, n times: for each position i = 0 .. k, how often
    each token came out there (position i is emitted only when proposals 0 .. i-1 were kept; position k is the
    bonus token), to test against p[i]."""
    counts = [torch.zeros(p.shape[1], dtype=torch.float64) for _ in range(p.shape[0])]
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(q.shape[0])]
        for i, token in enumerate(rule(p, q, drafts, g)[:len(counts)]):
            counts[i][token] += 1
    return counts


def chi2_threshold(cells: int, alpha: float = FALSE_ALARM) -> float:
    """The chi-square statistic above which a fit to ``cells`` probabilities is rejected at false-alarm rate
    ``alpha`` (df = cells - 1): the root of Q(df / 2, x / 2) = alpha, by bisection."""
    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(torch.special.gammaincc(torch.tensor((cells - 1) / 2), torch.tensor(mid / 2))) \
            > alpha else (lo, mid)
    return hi


def pooled(counts: torch.Tensor, expected: torch.Tensor, least: float = 5.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cells whose expected count is below ``least`` merged into one (then with the next smallest cell while still
    below): Pearson's statistic is chi-square distributed only when every cell expects a few counts."""
    order = torch.argsort(expected)
    counts, expected = counts[order], expected[order]
    cut = 1
    while cut < len(expected) - 1 and expected[:cut].sum() < least:
        cut += 1
    if cut == 1:
        return counts, expected
    return torch.cat([counts[:cut].sum()[None], counts[cut:]]), torch.cat([expected[:cut].sum()[None], expected[cut:]])


def _fixed_cases(fn: Callable, p: torch.Tensor, q: torch.Tensor, k: int, seed: int) -> None:
    same = fn(p, p[:k].clone(), list(range(k)), torch.Generator().manual_seed(seed))
    if not isinstance(same, list) or len(same) != k + 1 or same[:k] != list(range(k)):
        raise CheckFailed(f"with q equal to p every proposal must be kept and a bonus token drawn from p[k]: "
                          f"expected {list(range(k))} + [one token], got {same!r}")
    zero = p.clone()
    zero[0, 0] = 0.0
    zero[0] /= zero[0].sum()
    out = fn(zero, q, [0] * k, torch.Generator().manual_seed(seed))
    if not isinstance(out, list) or len(out) != 1 or out[0] == 0:
        raise CheckFailed(f"a proposal the target gives probability 0 must be rejected and replaced by a draw from "
                          f"norm(max(0, p - q)) (never that token): got {out!r} for proposals {[0] * k}")


def check_verify_sampled(fn: Callable, n: int = 4000, vocab: int = 4, k: int = 2, seed: int = 0) -> CheckResult:
    """Fixed cases, then ``n`` verifications of k proposals over ``vocab`` tokens, rows of p all different: the
    tokens emitted at each position i = 0 .. k (k: the bonus token) tested against p[i] by Pearson's chi-square,
    rejected above the statistic whose false-alarm rate is ``FALSE_ALARM`` (seeded: a check gives one verdict)."""
    def body() -> str:
        g = torch.Generator().manual_seed(seed)
        p, q = target_and_draft(vocab, k, g)
        _fixed_cases(fn, p, q, k, seed)
        for i, counts in enumerate(emitted_counts(fn, p, q, n, g)):
            cells, expected = pooled(counts, p[i] * counts.sum())
            stat, threshold = float(((cells - expected) ** 2 / expected).sum()), chi2_threshold(len(cells))
            if stat > threshold:
                which = "the bonus token (all proposals kept)" if i == k else f"position {i}"
                freq = " ".join(f"{x:.3f}" for x in (counts / counts.sum()).tolist())
                raise CheckFailed(f"{which} is not distributed as the target's p[{i}]: frequencies {freq} against "
                                  f"p[{i}] {' '.join(f'{x:.3f}' for x in p[i].tolist())} over {int(counts.sum())} "
                                  f"draws: chi-square {stat:.1f} > {threshold:.1f}, the threshold of false-alarm rate "
                                  f"{FALSE_ALARM} for {len(cells) - 1} degrees of freedom")
        return (f"{n} verifications of {k} proposals: the tokens at every position, the bonus one included, follow "
                f"the target's p (chi-square tests, false-alarm rate {FALSE_ALARM} each), and the fixed cases are "
                "right")
    return run_check("verify_sampled", body)


EXERCISES = [
    Exercise("attend_over_cache", "KV cache: append and attend over the cache", 3, "attend_over_cache",
             check_attend_over_cache,
             hidden=[{"cases": ((8, 2, 6, 2), (2, 1, 0, 5), (6, 3, 11, 1)), "seed": 1}]),
    Exercise("reserve_blocks", "Paged KV cache: reserve blocks from the free list", 3, "reserve_blocks",
             check_reserve_blocks,
             hidden=[{"cases": (([], [9, 8], 1, 16), ([3], [], 16, 16), ([3], [], 17, 16), ([0], [4, 2, 1], 33, 8),
                                ([], [2, 1, 0], 7, 1), ([5], [9, 8, 7, 6], 20, 8))}]),
    Exercise("request_metrics", "TTFT, ITL, TPOT and end-to-end latency of a request", 2, "request_metrics",
             check_request_metrics,
             hidden=[{"cases": ((0.5, [0.75, 1.0, 2.0]), (3.0, [3.125]), (0.0, [0.5, 0.5, 0.75]))}]),
    Exercise("tp_kv_heads", "Tensor-parallel decode: which KV heads a rank holds", 4, "tp_kv_heads",
             check_tp_kv_heads,
             hidden=[{"cases": ((4, 4, 2), (2, 4, 1), (4, 8, 8)), "seed": 1}]),
    Exercise("paged_decode", "Find the bug: batched decode over a paged KV cache", 3, "paged_decode",
             check_paged_decode,
             hidden=[{"lens": (9, 16, 2, 17, 1), "heads": ((8, 2),), "block_size": 8, "seed": 1},
                     {"lens": (5, 3), "heads": ((4, 1),), "block_size": 2, "seed": 2},
                     {"lens": (33,), "heads": ((6, 6),), "block_size": 16, "seed": 3}]),
    Exercise("schedule_step", "A continuous-batching scheduler step: chunked prefill and preemption", 5,
             "schedule_step", check_schedule_step,
             hidden=[{"cases": (
                 ([(0, 17, 16, 4), (1, 3, 2, 1), (2, 40, 8, 1)], [(3, 9), (4, 1)], 12, 5, 2, 8),
                 ([(0, 33, 32, 2), (1, 33, 32, 2)], [(2, 50)], 64, 3, 0, 16),
                 ([], [(0, 7), (1, 7), (2, 7)], 16, 8, 2, 4),
                 ([(0, 6, 5, 1), (1, 9, 8, 2), (2, 4, 0, 0)], [(3, 2)], 3, 4, 1, 4),
                 ([(0, 17, 5, 5), (1, 8, 7, 7)], [(2, 7), (3, 3)], 8, 2, 1, 1),
                 ([(0, 3, 2, 2), (1, 5, 4, 4), (2, 12, 11, 3)], [(3, 6)], 1, 6, 1, 4),
                 ([(0, 9, 8, 8)], [(1, 5), (2, 2)], 8, 3, 3, 1))}]),
    Exercise("verify_sampled", "Speculative sampling: the verification step's rejection rule", 4, "verify_sampled",
             check_verify_sampled, hidden=[{"vocab": 6, "k": 3, "seed": 1}]),
]


def _heads(n_head: int, n_kv: int) -> str:
    return "MHA" if n_kv == n_head else "MQA (one K/V head)" if n_kv == 1 else "GQA, several K/V heads"


def _attend_classes(calls: list[dict]) -> set[str]:
    return {c for H, Hkv, T, n in each(calls) for c in (_heads(H, Hkv), "an empty cache" if T == 0 else
            "one new token over a cache" if n == 1 else "several new tokens over a cache")}


def _reserve_classes(calls: list[dict]) -> set[str]:
    out = set()
    for table, free, n, bs in each(calls):
        need = math.ceil(n / bs) - len(table)
        out.add("nothing to reserve" if need <= 0 else "too few free blocks" if need > len(free) else
                "an empty table grows" if not table else "a table holding blocks grows")
        out |= {"a partly filled last block"} if n % bs else set()
        out |= {"several blocks taken at once"} if 1 < need <= len(free) else set()
    return out


def _metrics_classes(calls: list[dict]) -> set[str]:
    out = {"a request without tokens"}
    for arrival, times in each(calls):
        out.add("one token" if len(times) == 1 else "several tokens")
        out |= {"the first token at the arrival"} if times[0] == arrival else set()
        out |= {"two tokens at once"} if any(a == b for a, b in itertools.pairwise(times)) else set()
    return out


def _tp_classes(calls: list[dict]) -> set[str]:
    out = several((t for t, _, _ in each(calls)), "world sizes")
    for t, _, n_kv in each(calls):
        out |= ranks(t) | {"one K/V head a rank" if t == n_kv else "several K/V heads a rank" if t < n_kv else
                           "MQA: one K/V head on every rank" if n_kv == 1 else "a K/V head on a sub-group of ranks"}
    return out


def _paged_classes(calls: list[dict]) -> set[str]:
    out = set()
    for call in calls:
        bs, lens = call["block_size"], call["lens"]
        out |= {_heads(h, kv) for h, kv in call["heads"]}
        out |= {"a sequence over several blocks"} if max(lens) > bs else set()
        out |= {"a sequence of whole blocks"} if any(n % bs == 0 for n in lens) else set()
        out |= {"a batch of several sequences"} if len(lens) > 1 else set()
    return out


def _schedule_classes(calls: list[dict]) -> set[str]:
    seen: set[str] = set()
    for case in each(calls):
        _schedule_step_reference(*case, seen=seen)
    return seen


CASE_CLASSES = {
    "attend_over_cache": _attend_classes, "reserve_blocks": _reserve_classes, "request_metrics": _metrics_classes,
    "tp_kv_heads": _tp_classes, "paged_decode": _paged_classes, "schedule_step": _schedule_classes,
    "verify_sampled": lambda calls: {"q equal to p", "a proposal the target never draws",
                                     "every position's distribution, the bonus token's included"}
    | {"several proposals" for c in calls if c["k"] > 1},
}

guard_visible_checks(globals(), EXERCISES)
