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


def step_causal_only_at_start(model, cache, tokens, start):
    """is_causal only for the first chunk, no mask afterwards: decode is right, a later chunk of several tokens
    sees its own future."""
    n, d = tokens.numel(), model.config.head_dim
    pos = torch.arange(start, start + n)
    x = model.tok_emb(tokens) + model.pos_emb(pos)
    for layer, blk in enumerate(model.blocks):
        a, h = blk.attn, blk.norm1(x)
        q, k, v = (p(h).view(n, -1, d).transpose(0, 1) for p in (a.q_proj, a.k_proj, a.v_proj))
        cache.write(layer, 0, start, k, v)
        k, v = cache.read(layer, 0, start + n)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0)
        x = x + a.o_proj(y.transpose(0, 1).reshape(n, -1))
        x = x + blk.mlp(blk.norm2(x))
    return model.lm_head(model.norm_f(x[-1]))


def step_position_from_zero(model, cache, tokens, start):
    """Positions counted from 0 in every step (the cache offset forgotten for the position embedding)."""
    n, d = tokens.numel(), model.config.head_dim
    pos = torch.arange(start, start + n)
    x = model.tok_emb(tokens) + model.pos_emb(torch.arange(n))
    for layer, blk in enumerate(model.blocks):
        a, h = blk.attn, blk.norm1(x)
        q, k, v = (p(h).view(n, -1, d).transpose(0, 1) for p in (a.q_proj, a.k_proj, a.v_proj))
        cache.write(layer, 0, start, k, v)
        k, v = cache.read(layer, 0, start + n)
        mask = torch.arange(start + n)[None, :] <= pos[:, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + a.o_proj(y.transpose(0, 1).reshape(n, -1))
        x = x + blk.mlp(blk.norm2(x))
    return model.lm_head(model.norm_f(x[-1]))


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
    "step_logits": [step_causal_only_at_start, step_position_from_zero],
    "schedule_step": [schedule_running_order, schedule_skips_the_head, schedule_preempts_the_oldest],
    "verify_sampled": [verify_ratio_upside_down, verify_residual_from_p, verify_no_bonus],
}
