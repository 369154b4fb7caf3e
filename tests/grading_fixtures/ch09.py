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


def _attend(q, k_cache, v_cache, k_new, v_new, *, offset=True, strict=False, scale=True, new_first=False):
    """Append and attend, with one rule switchable: the mask's offset, <= vs <, the 1/sqrt(d), the order of the
    concatenation."""
    k, v = (torch.cat([n, c] if new_first else [c, n], 1) for c, n in ((k_cache, k_new), (v_cache, v_new)))
    rep, (n, total) = q.shape[0] // k.shape[0], (q.shape[1], k.shape[1])
    qpos = torch.arange(total - n, total) if offset else torch.arange(n)
    mask = torch.arange(total)[None, :] < qpos[:, None] if strict else torch.arange(total)[None, :] <= qpos[:, None]
    ke, ve = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = q @ ke.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale else 1.0)
    s = s.masked_fill(~mask, float("-inf"))
    return k, v, torch.softmax(s, -1).nan_to_num() @ ve


def attend_softmax_over_the_queries(q, k_cache, v_cache, k_new, v_new):
    """The softmax taken over the queries (dim -2) instead of over the keys."""
    k, v = torch.cat([k_cache, k_new], 1), torch.cat([v_cache, v_new], 1)
    rep, (n, total) = q.shape[0] // k.shape[0], (q.shape[1], k.shape[1])
    mask = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
    s = (q @ k.repeat_interleave(rep, 0).transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
    return k, v, torch.softmax(s, -2).nan_to_num() @ v.repeat_interleave(rep, 0)


def attend_mask_from_position_zero(q, k_cache, v_cache, k_new, v_new):
    """The new queries' mask built as if they sat at positions 0 .. n-1: query i sees keys 0 .. i only."""
    return _attend(q, k_cache, v_cache, k_new, v_new, offset=False)


def attend_without_the_own_key(q, k_cache, v_cache, k_new, v_new):
    """A strict mask (<): a new query does not see its own key."""
    return _attend(q, k_cache, v_cache, k_new, v_new, strict=True)


def attend_without_the_scale(q, k_cache, v_cache, k_new, v_new):
    """Scores q k^T without the 1/sqrt(d)."""
    return _attend(q, k_cache, v_cache, k_new, v_new, scale=False)


def attend_new_keys_in_front(q, k_cache, v_cache, k_new, v_new):
    """The new K/V concatenated in front of the cache: the positions no longer match."""
    return _attend(q, k_cache, v_cache, k_new, v_new, new_first=True)


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


def reserve_from_the_front(table, free, n_tokens, block_size):
    """Takes the blocks from the front of the free list (free.pop(0)) instead of the end."""
    need = math.ceil(n_tokens / block_size) - len(table)
    if need > len(free):
        return False
    for _ in range(max(need, 0)):
        table.append(free.pop(0))
    return True


def reserve_ignores_the_table(table, free, n_tokens, block_size):
    """Reserves blocks for all n_tokens as if the table held none."""
    need = math.ceil(n_tokens / block_size)
    if need > len(free):
        return False
    for _ in range(need):
        table.append(free.pop())
    return True


def reserve_one_block_a_token(table, free, n_tokens, block_size):
    """Counts tokens, not blocks: one block per position still missing."""
    need = n_tokens - len(table) * block_size
    if need > len(free):
        return False
    for _ in range(max(need, 0)):
        table.append(free.pop())
    return True


def _metrics(arrival_s, token_times, *, refuse_empty=True, one_token_tpot=None, first_gap_from_arrival=False,
             e2e_from_first=False):
    if not token_times:
        if refuse_empty:
            raise ValueError("empty")
        return {"ttft": 0.0, "itl": [], "tpot": None, "e2e": 0.0}
    n = len(token_times)
    times = [arrival_s, *token_times] if first_gap_from_arrival else token_times
    return {"ttft": float(token_times[0] - arrival_s), "itl": [float(b - a) for a, b in itertools.pairwise(times)],
            "tpot": float((token_times[-1] - token_times[0]) / (n - 1)) if n > 1 else one_token_tpot,
            "e2e": float(token_times[-1] - (token_times[0] if e2e_from_first else arrival_s))}


def metrics_first_gap_from_the_arrival(arrival_s, token_times):
    """The inter-token gaps start at the arrival: the TTFT counted as a gap."""
    return _metrics(arrival_s, token_times, first_gap_from_arrival=True)


def metrics_tpot_zero_for_one_token(arrival_s, token_times):
    """One token gets a TPOT of 0.0 instead of None."""
    return _metrics(arrival_s, token_times, one_token_tpot=0.0)


def metrics_empty_request_all_zero(arrival_s, token_times):
    """A request without tokens gets zeros instead of a ValueError."""
    return _metrics(arrival_s, token_times, refuse_empty=False)


def metrics_e2e_from_the_first_token(arrival_s, token_times):
    """End-to-end latency counted from the first token, not the arrival."""
    return _metrics(arrival_s, token_times, e2e_from_first=True)


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


def kv_heads_tiled(rank, t, n_head, n_kv):
    """Maps query head j to K/V head j % n_kv (repeat's order, not repeat_interleave's)."""
    per = n_head // t
    return sorted({j % n_kv for j in range(rank * per, (rank + 1) * per)})


def kv_heads_one_each(rank, t, n_head, n_kv):
    """One K/V head a rank, head rank // (t / n_kv) or rank: right until a rank needs several."""
    return [rank // (t // n_kv)] if t >= n_kv else [rank]


def kv_heads_the_query_heads(rank, t, n_head, n_kv):
    """Returns the rank's query heads, not the K/V heads they read."""
    per = n_head // t
    return list(range(rank * per, (rank + 1) * per))


def kv_heads_ceil_split(rank, t, n_head, n_kv):
    """ceil(n_kv / t) heads a rank, in order, cut at n_kv: replicated heads land on the wrong ranks."""
    per = -(-n_kv // t)
    return [h for h in range(rank * per, (rank + 1) * per) if h < n_kv] or [n_kv - 1]


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


def paged_blocks_in_id_order(q, k_pool, v_pool, block_tables, seq_lens):
    """Each sequence's blocks read in the order of their ids (sorted), not the table's order."""
    bs, rep = k_pool.shape[2], q.shape[1] // k_pool.shape[1]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        table = block_tables[b, :math.ceil(n / bs)].sort().values
        pos = torch.arange(n)
        k, v = (pool[table[pos // bs], :, pos % bs].transpose(0, 1).repeat_interleave(rep, 0)
                for pool in (k_pool, v_pool))
        out[b] = F.scaled_dot_product_attention(q[b][:, None], k, v)[:, 0]
    return out


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
              fifo=True, newest=True, return_blocks=True, return_tokens=True, preempted_in_batch=False,
              chunk_blocks=False, decodes_ignore_budget=False, held_blocks_only=False, spare_planned=False,
              spare_itself=False, rechunk=False):
    """A scheduler step with one of its rules switched off or changed (the wrong answers below)."""
    budget, free = token_budget, free_blocks
    alive = [[*s, 0] for s in running]  # [id, n_tokens, n_cached, n_blocks, blocks reserved this step]
    plan, preempted = {}, []
    order = ([s for s in alive if s[2] == s[1] - 1] + [s for s in alive if s[2] < s[1] - 1]) if decodes_first \
        else alive
    for s in order:
        decode = s[2] == s[1] - 1
        n = 1 if decode and decodes_ignore_budget else min(s[1] - s[2], budget)
        if s[0] in preempted or n <= 0:
            continue
        need = math.ceil(n / block_size) if chunk_blocks else math.ceil((s[2] + n) / block_size) - s[3]
        while need > free:
            left = [v for v in alive if v[0] not in preempted and not (spare_planned and v[0] in plan)
                    and not (spare_itself and v is s)]
            if not left:
                break
            victim = left[-1] if newest else left[0]
            preempted.append(victim[0])
            free += (victim[3] - victim[4] if held_blocks_only else victim[3]) if return_blocks else 0
            budget += plan.pop(victim[0], 0) if return_tokens else 0
            if victim[0] in plan:
                del plan[victim[0]]
            if victim is s:
                break
            if rechunk:
                n = min(s[1] - s[2], budget)
                need = math.ceil((s[2] + n) / block_size) - s[3]
        if s[0] in preempted or need > free:
            continue
        free -= max(need, 0)
        s[3] += max(need, 0)
        s[4] += max(need, 0)
        plan[s[0]] = n
        budget -= n
    in_batch = len(alive) - (0 if preempted_in_batch else len(preempted))
    for wid, n_tokens in waiting:
        n = min(n_tokens, budget)
        if in_batch >= max_batch or (n == 0 if decodes_ignore_budget else n <= 0):
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


def schedule_decodes_ignore_the_budget(running, waiting, token_budget, max_batch, free_blocks, block_size):
    """Every decode feeds its token whatever the budget (decodes are cheap): with more decodes than budget the plan
    overruns it, and the first waiting request is then planned -1 tokens."""
    return _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, decodes_ignore_budget=True)


def schedule_keeps_the_preempted_tokens(running, waiting, token_budget, max_batch, free_blocks, block_size):
    """A preempted sequence's planned tokens are not given back to the budget: those behind it get fewer."""
    return _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, return_tokens=False)


def schedule_keeps_the_preempted_blocks(running, waiting, token_budget, max_batch, free_blocks, block_size):
    """Preemption frees nothing: the victim's blocks never go back to the free list."""
    return _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, return_blocks=False)


def schedule_counts_the_preempted_in_the_batch(running, waiting, token_budget, max_batch, free_blocks, block_size):
    """The batch limit counts every running sequence, the preempted ones too: fewer admissions."""
    return _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, preempted_in_batch=True)


def schedule_blocks_for_the_chunk(running, waiting, token_budget, max_batch, free_blocks, block_size):
    """A running sequence's blocks counted for the new chunk alone, ceil(n / block_size), as if it held nothing."""
    return _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, chunk_blocks=True)


def schedule_returns_only_the_held_blocks(running, waiting, token_budget, max_batch, free_blocks, block_size):
    """A victim planned this step gives back the blocks it held before the step, not those just reserved for it."""
    return _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, held_blocks_only=True)


def schedule_spares_the_planned(running, waiting, token_budget, max_batch, free_blocks, block_size):
    """Never preempts a sequence already planned this step: the victim is the newest one not yet planned."""
    return _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, spare_planned=True)


def schedule_never_preempts_itself(running, waiting, token_budget, max_batch, free_blocks, block_size):
    """The sequence that does not fit never preempts itself: it evicts the newest of the others instead."""
    return _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, spare_itself=True)


def schedule_rechunks_after_preemption(running, waiting, token_budget, max_batch, free_blocks, block_size):
    """After a preemption gives tokens back, the sequence's chunk grows to use them (the spec keeps it)."""
    return _schedule(running, waiting, token_budget, max_batch, free_blocks, block_size, rechunk=True)


def _verify(p, q, drafts, g, accept, residual, bonus=True, bonus_row=0, stop=True):
    out = []
    for i, x in enumerate(drafts):
        if float(torch.rand((), generator=g)) < accept(float(p[i, x]), float(q[i, x])):
            out.append(x)
            continue
        r = residual(p[i], q[i]).clamp(min=0)
        out.append(int(torch.multinomial(r / r.sum(), 1, generator=g)))
        if stop:
            return out
    if bonus:
        out.append(int(torch.multinomial(p[len(drafts) + bonus_row], 1, generator=g)))
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


def verify_bonus_from_the_last_proposals_row(p, q, drafts, generator):
    """The bonus token drawn from p[k-1], the row the last proposal was verified against, instead of p[k]."""
    return _verify(p, q, drafts, generator, lambda pi, qi: min(1.0, pi / qi), lambda pi, qi: pi - qi, bonus_row=-1)


def verify_residual_the_other_way(p, q, drafts, generator):
    """After a rejection, draws from norm(max(0, q - p)): where the draft under-proposed, not where it over-did."""
    return _verify(p, q, drafts, generator, lambda pi, qi: min(1.0, pi / qi), lambda pi, qi: qi - pi)


def verify_goes_on_after_a_rejection(p, q, drafts, generator):
    """Replaces a rejected proposal and goes on verifying the next ones (they were drafted after the rejected
    token: their rows no longer apply), then draws the bonus."""
    return _verify(p, q, drafts, generator, lambda pi, qi: min(1.0, pi / qi), lambda pi, qi: pi - qi, stop=False)


def verify_keeps_when_the_target_agrees(p, q, drafts, generator):
    """Keeps a proposal when the target would have drawn it too (a second draw from p[i] equals it), else emits
    that draw: greedy thinking with sampling, not the rejection rule."""
    out = []
    for i, x in enumerate(drafts):
        mine = int(torch.multinomial(p[i], 1, generator=generator))
        out.append(x if mine == x else mine)
        if mine != x:
            return out
    return [*out, int(torch.multinomial(p[len(drafts)], 1, generator=generator))]


WRONG = {
    "attend_over_cache": [attend_is_causal, attend_without_mask, attend_gqa_repeat_wrong,
                          attend_softmax_over_the_queries, attend_mask_from_position_zero, attend_without_the_own_key,
                          attend_without_the_scale, attend_new_keys_in_front],
    "reserve_blocks": [reserve_partial, reserve_floor, reserve_from_the_front, reserve_ignores_the_table,
                       reserve_one_block_a_token],
    "request_metrics": [metrics_ttft_from_first_gap, metrics_tpot_over_n, metrics_first_gap_from_the_arrival,
                        metrics_tpot_zero_for_one_token, metrics_empty_request_all_zero,
                        metrics_e2e_from_the_first_token],
    "tp_kv_heads": [kv_heads_like_queries, kv_heads_round_robin, kv_heads_tiled, kv_heads_one_each,
                    kv_heads_the_query_heads, kv_heads_ceil_split],
    "paged_decode": [paged_blocks_reshaped_as_heads, paged_without_the_new_token, paged_whole_last_block,
                     paged_gqa_tiled, paged_blocks_in_id_order],
    "schedule_step": [schedule_running_order, schedule_skips_the_head, schedule_preempts_the_oldest,
                      schedule_decodes_ignore_the_budget, schedule_keeps_the_preempted_tokens,
                      schedule_keeps_the_preempted_blocks, schedule_counts_the_preempted_in_the_batch,
                      schedule_blocks_for_the_chunk, schedule_returns_only_the_held_blocks, schedule_spares_the_planned,
                      schedule_never_preempts_itself, schedule_rechunks_after_preemption],
    "verify_sampled": [verify_ratio_upside_down, verify_residual_from_p, verify_no_bonus,
                       verify_bonus_from_the_last_proposals_row, verify_residual_the_other_way,
                       verify_goes_on_after_a_rejection, verify_keeps_when_the_target_agrees],
}
RIGHT = {"paged_decode": [paged_by_positions]}
