"""Wrong answers for chapter 09 (serving)."""

import itertools
import math

import torch
import torch.nn.functional as F


def attend_is_causal(q, k_cache, v_cache, k_new, v_new):
    """is_causal=True: the mask is aligned top-left, so a decode query sees only key 0."""
    k, v = torch.cat([k_cache, k_new], 1), torch.cat([v_cache, v_new], 1)
    rep = q.shape[0] // k.shape[0]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), is_causal=True)
    return k, v, out


def attend_without_mask(q, k_cache, v_cache, k_new, v_new):
    """No mask at all: new queries see the new keys after them."""
    k, v = torch.cat([k_cache, k_new], 1), torch.cat([v_cache, v_new], 1)
    rep = q.shape[0] // k.shape[0]
    return k, v, F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0))


def attend_gqa_repeat_wrong(q, k_cache, v_cache, k_new, v_new):
    """GQA heads tiled (repeat) instead of interleaved: query head j gets K/V head j % H_kv."""
    k, v = torch.cat([k_cache, k_new], 1), torch.cat([v_cache, v_new], 1)
    rep = q.shape[0] // k.shape[0]
    n, total = q.shape[1], k.shape[1]
    mask = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
    return k, v, F.scaled_dot_product_attention(q, k.repeat(rep, 1, 1), v.repeat(rep, 1, 1), attn_mask=mask)


def reserve_partial(table, free, n_tokens, block_size):
    """Takes what blocks there are before finding out there are not enough (not all or nothing)."""
    need = math.ceil(n_tokens / block_size) - len(table)
    while need > 0 and free:
        table.append(free.pop())
        need -= 1
    return need <= 0


def reserve_floor(table, free, n_tokens, block_size):
    """floor instead of ceil: the last partial block is missing."""
    need = n_tokens // block_size - len(table)
    if need > len(free):
        return False
    for _ in range(max(need, 0)):
        table.append(free.pop())
    return True


def metrics_ttft_from_first_gap(arrival_s, token_times):
    """TTFT measured from the first token to the second (forgets the queue and the prefill)."""
    if not token_times:
        raise ValueError("empty")
    n = len(token_times)
    return {"ttft": float(token_times[1] - token_times[0]) if n > 1 else 0.0,
            "itl": [float(b - a) for a, b in itertools.pairwise(token_times)],
            "tpot": float((token_times[-1] - token_times[0]) / (n - 1)) if n > 1 else None,
            "e2e": float(token_times[-1] - arrival_s)}


def metrics_tpot_over_n(arrival_s, token_times):
    """TPOT divided by n instead of n - 1 (and 0 for one token)."""
    if not token_times:
        raise ValueError("empty")
    n = len(token_times)
    return {"ttft": float(token_times[0] - arrival_s),
            "itl": [float(b - a) for a, b in itertools.pairwise(token_times)],
            "tpot": float((token_times[-1] - token_times[0]) / n),
            "e2e": float(token_times[-1] - arrival_s)}


def kv_heads_like_queries(rank, t, n_head, n_kv):
    """Splits the KV heads like the query heads: nothing left for a rank when t > n_kv."""
    per = n_kv // t
    return list(range(rank * per, (rank + 1) * per))


def kv_heads_round_robin(rank, t, n_head, n_kv):
    """Deals the KV heads out round-robin: rank 1 gets head 1 though its query heads use head 0."""
    return [rank % n_kv] if t >= n_kv else list(range(rank * (n_kv // t), (rank + 1) * (n_kv // t)))


def _paged(q, k_pool, v_pool, block_tables, seq_lens, *, transpose=True, newest=True):
    B, H, d = q.shape
    n_kv = k_pool.shape[1]
    k, v = (p[block_tables].transpose(1, 2) if transpose else p[block_tables] for p in (k_pool, v_pool))
    k, v = (t.reshape(B, n_kv, -1, d).repeat_interleave(H // n_kv, 1) for t in (k, v))
    mask = torch.arange(k.shape[2]) < (seq_lens if newest else seq_lens - 1)[:, None]
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None])[:, :, 0]


def paged_blocks_reshaped_as_heads(q, k_pool, v_pool, block_tables, seq_lens):
    """The colleague's: [B, max_blocks, H_kv, bs, d] reshaped to [B, H_kv, max_blocks * bs, d] without moving the
    heads first: right only while max_blocks is 1."""
    return _paged(q, k_pool, v_pool, block_tables, seq_lens, transpose=False)


def paged_without_the_new_token(q, k_pool, v_pool, block_tables, seq_lens):
    """Mask off by one: the query does not see its own key (seq_lens taken as the positions before it)."""
    return _paged(q, k_pool, v_pool, block_tables, seq_lens, newest=False)


def paged_whole_last_block(q, k_pool, v_pool, block_tables, seq_lens):
    """No mask past seq_len: attends to the stale slots of the last block (and to the padding's blocks)."""
    n = (seq_lens + k_pool.shape[2] - 1) // k_pool.shape[2] * k_pool.shape[2]  # whole blocks
    return _paged(q, k_pool, v_pool, block_tables, n)


def paged_gqa_tiled(q, k_pool, v_pool, block_tables, seq_lens):
    """K/V heads tiled (query head h gets K/V head h % H_kv) instead of each serving consecutive query heads."""
    B, H, d = q.shape
    n_kv = k_pool.shape[1]
    k, v = (p[block_tables].transpose(1, 2).reshape(B, n_kv, -1, d).repeat(1, H // n_kv, 1, 1)
            for p in (k_pool, v_pool))
    mask = torch.arange(k.shape[2]) < seq_lens[:, None]
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None])[:, :, 0]


def paged_by_positions(q, k_pool, v_pool, block_tables, seq_lens):
    """Right: sequence by sequence, each position looked up in the table, the softmax written out."""
    bs, rep = k_pool.shape[2], q.shape[1] // k_pool.shape[1]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        pos = torch.arange(int(seq_lens[b]))
        blocks, slots = block_tables[b, pos // bs], pos % bs
        k = k_pool[blocks, :, slots].repeat_interleave(rep, 1)  # [n, H, d]
        v = v_pool[blocks, :, slots].repeat_interleave(rep, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) / q.shape[-1] ** 0.5, -1)
        out[b] = torch.einsum("hn,nhd->hd", w, v)
    return out


def _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, *, decodes_first=True,
              fifo=True, newest=True, return_blocks=True):
    """A scheduler step with one of its rules switchable off (the wrong answers below)."""
    budget, free = token_budget, free_blocks
    alive = [list(s) for s in running]
    plan, preempted = {}, []
    order = ([s for s in alive if s[2] == s[1] - 1] + [s for s in alive if s[2] < s[1] - 1]) if decodes_first \
        else alive
    for s in order:
        n = min(s[1] - s[2], budget)
        if s[0] in preempted or n <= 0:
            continue
        need = math.ceil((s[2] + n) / block_size) - s[3]
        while need > free:
            left = [v for v in alive if v[0] not in preempted]
            victim = left[-1] if newest else left[0]
            preempted.append(victim[0])
            free += victim[3] if return_blocks else 0
            budget += plan.pop(victim[0], 0)
            if victim is s or not left[1:]:
                break
        if s[0] in preempted or need > free:
            continue
        free -= max(need, 0)
        s[3] += max(need, 0)
        plan[s[0]] = n
        budget -= n
    in_batch = len(alive) - len(preempted)
    for wid, n_tokens in waiting:
        n = min(n_tokens, budget)
        if in_batch >= max_batch or n <= 0:
            break
        if math.ceil(n / block_size) > free:
            if fifo:
                break
            continue
        free -= math.ceil(n / block_size)
        plan[wid] = n
        budget -= n
        in_batch += 1
    return list(plan.items()), preempted


def schedule_running_order(running, waiting, token_budget, max_batch, free_blocks, block_size):
    """Plans the running sequences in their order, prefills and decodes mixed: a prefill can eat the budget of
    a decode behind it."""
    return _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, decodes_first=False)


def schedule_skips_the_head(running, waiting, token_budget, max_batch, free_blocks, block_size):
    """Admits a later request when the first waiting one does not fit (not first come first served)."""
    return _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, fifo=False)


def schedule_preempts_the_oldest(running, waiting, token_budget, max_batch, free_blocks, block_size):
    """Preempts the first admitted sequence instead of the most recent one."""
    return _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, newest=False)


def _verify(p, q, drafts, g, accept, residual, bonus=True):
    out = []
    for i, x in enumerate(drafts):
        if float(torch.rand((), generator=g)) < accept(float(p[i, x]), float(q[i, x])):
            out.append(x)
            continue
        r = residual(p[i], q[i]).clamp(min=0)
        out.append(int(torch.multinomial(r / r.sum(), 1, generator=g)))
        return out
    if bonus:
        out.append(int(torch.multinomial(p[len(drafts)], 1, generator=g)))
    return out


def verify_ratio_upside_down(p, q, drafts, generator):
    """Keeps a proposal with probability min(1, q/p) instead of min(1, p/q)."""
    return _verify(p, q, drafts, generator, lambda pi, qi: min(1.0, qi / pi if pi else 1.0), lambda pi, qi: pi - qi)


def verify_residual_from_p(p, q, drafts, generator):
    """After a rejection, draws from the target's p instead of norm(max(0, p - q))."""
    return _verify(p, q, drafts, generator, lambda pi, qi: min(1.0, pi / qi), lambda pi, qi: pi)


def verify_no_bonus(p, q, drafts, generator):
    """Forgets the bonus token when every proposal is kept."""
    return _verify(p, q, drafts, generator, lambda pi, qi: min(1.0, pi / qi), lambda pi, qi: pi - qi, bonus=False)


WRONG = {
    "attend_over_cache": [attend_is_causal, attend_without_mask, attend_gqa_repeat_wrong],
    "reserve_blocks": [reserve_partial, reserve_floor],
    "request_metrics": [metrics_ttft_from_first_gap, metrics_tpot_over_n],
    "tp_kv_heads": [kv_heads_like_queries, kv_heads_round_robin],
    "paged_decode": [paged_blocks_reshaped_as_heads, paged_without_the_new_token, paged_whole_last_block,
                     paged_gqa_tiled],
    "schedule_step": [schedule_running_order, schedule_skips_the_head, schedule_preempts_the_oldest],
    "verify_sampled": [verify_ratio_upside_down, verify_residual_from_p, verify_no_bonus],
}
RIGHT = {"paged_decode": [paged_by_positions]}
