"""The inference engine: the tiny GPT's own submodules run on a flat batch of token segments with a KV cache.

A step takes **segments**: (sequence, the tokens to feed, the position of the first one). A prefill segment is
a prompt (or a chunk of it); a decode segment is one token. Every token of every segment is concatenated into one
``[N, d_model]`` matrix, so each weight matrix is read once per step for the whole batch (what makes batched
decode cheap); only attention is per sequence, because each one attends over its own cached K and V:

    q_i attends to keys 0 .. start + i of its own sequence (causal, over cache + new positions)

The engine never changes the model (``course_lib.model.GPT``): it calls ``tok_emb``, ``pos_emb``, each block's
norms, projections and MLP, then the model's own ``head`` (``norm_f``, ``lm_head``, and -inf on a padded
vocabulary's extra ids, so no serving path can emit one). A variant changes one step by overriding a public method:
:meth:`Engine.qkv`, :meth:`Engine.attn_out`, :meth:`Engine.mlp` (tensor-parallel decode shards these three).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from course_lib.layers import apply_rope, rope_cos_sin
from course_lib.model import GPT, Block
from course_lib.serving.kv_cache import ContiguousKVCache, KVCache


@dataclass(frozen=True)
class Segment:
    """Feed ``tokens`` (``[n]`` ids) of sequence ``seq`` at positions ``start .. start+n-1``."""

    seq: int
    tokens: torch.Tensor
    start: int

    @property
    def end(self) -> int:
        return self.start + self.tokens.numel()


class Engine:
    """Runs ``model`` on segments, writing their K/V into ``cache`` and attending over it.

    ``forward(segments)`` returns the logits of each segment's **last** token, ``[len(segments), vocab]``.
    """

    def __init__(self, model: GPT, cache: KVCache) -> None:
        self.model, self.cache, self.config = model, cache, model.config
        self.head_dim = self.config.head_dim

    # -- the three seams a variant overrides ------------------------------------------------------------------

    def qkv(self, block: Block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[N, h]`` -> q ``[H, N, d]``, k and v ``[H_kv, N, d]`` (the heads this engine computes)."""
        attn, N, d = block.attn, x.shape[0], self.head_dim
        return tuple(p(x).view(N, -1, d).transpose(0, 1) for p in (attn.q_proj, attn.k_proj, attn.v_proj))

    def attn_out(self, block: Block, y: torch.Tensor) -> torch.Tensor:
        """Attention output ``[N, H*d]`` -> ``[N, h]`` (the o projection)."""
        return block.attn.o_proj(y)

    def mlp(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        return block.mlp(x)

    # -- the step ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, segments: Sequence[Segment], every_token: bool = False) -> torch.Tensor:
        """Logits of each segment's last token ``[len(segments), vocab]``, or of every token fed ``[N, vocab]``
        with ``every_token=True`` (what speculative decoding's verification step needs)."""
        if not segments:
            raise ValueError("a step needs at least one segment")
        m = self.model
        tokens = torch.cat([s.tokens for s in segments])
        positions = torch.cat([torch.arange(s.start, s.end, device=tokens.device) for s in segments])
        if int(positions.max()) >= self.config.seq_len and m.pos_emb is not None:
            raise ValueError(f"position {int(positions.max())} is past seq_len={self.config.seq_len}")
        x = m.tok_emb(tokens)
        if m.pos_emb is not None:
            x = x + m.pos_emb(positions)
        for layer, block in enumerate(m.blocks):
            x = x + self.attn_out(block, self.attention(layer, block, block.norm1(x), segments, positions))
            x = x + self.mlp(block, block.norm2(x))
        if every_token:
            return m.head(x)
        last = torch.cumsum(torch.tensor([s.tokens.numel() for s in segments], device=x.device), 0) - 1
        return m.head(x[last])

    def attention(self, layer: int, block: Block, x: torch.Tensor, segments: Sequence[Segment],
                  positions: torch.Tensor) -> torch.Tensor:
        """Write each segment's new K/V into the cache, then attend over the sequence's cache: ``[N, H*d]``."""
        q, k, v = self.qkv(block, x)
        if block.attn.rope:
            cos, sin = rope_cos_sin(0, self.head_dim, positions=positions)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, i = [], 0
        for s in segments:
            n = s.tokens.numel()
            self.cache.write(layer, s.seq, s.start, k[:, i:i + n], v[:, i:i + n])
            out.append(attend(q[:, i:i + n], *self.cache.read(layer, s.seq, s.end), start=s.start))
            i += n
        return torch.cat(out, dim=1).transpose(0, 1).reshape(x.shape[0], -1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of new queries over cached keys: q ``[H, n, d]`` at positions ``start..start+n-1``,
    k and v ``[H_kv, start+n, d]``. Query i sees keys ``0 .. start+i``. GQA: each K/V head serves H/H_kv queries."""
    if k.shape[0] != q.shape[0]:
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    n, T = q.shape[1], k.shape[1]
    mask = torch.arange(T, device=q.device)[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sample(logits: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens ``[S]`` from logits ``[S, vocab]``: argmax when ``temperature == 0`` (greedy), otherwise a draw
    from softmax(logits / temperature) with ``generator`` (seeded: the same draws every run)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_uncached(model: GPT, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                      generator: torch.Generator | None = None) -> list[int]:
    """The reference: every step re-runs the whole sequence through ``model`` (no cache), ``O(n^2)`` work."""
    seq = prompt.clone()
    out = []
    for _ in range(max_new_tokens):
        nxt = sample(model(seq[None])[:, -1], temperature, generator)
        out.append(int(nxt))
        seq = torch.cat([seq, nxt])
    return out


@torch.no_grad()
def generate(model: GPT, prompts: Sequence[torch.Tensor], max_new_tokens: int, temperature: float = 0.0,
             generator: torch.Generator | None = None, cache: KVCache | None = None,
             engine: Engine | None = None) -> list[list[int]]:
    """Batched generation with a KV cache: one prefill step for every prompt (of any lengths), then one decode
    step per new token for all sequences at once (on ``engine``, default ``Engine(model, cache)``). Returns the
    new tokens of each prompt.

    A prompt whose length + ``max_new_tokens`` exceeds the model's ``seq_len`` is refused before any work, for
    every position type (learned positions have no embedding past it; RoPE would run, outside the context the
    model was trained for)."""
    limit = model.config.seq_len
    for i, p in enumerate(prompts):
        if p.numel() + max_new_tokens > limit:
            raise ValueError(f"prompt {i}: {p.numel()} tokens + max_new_tokens={max_new_tokens} = "
                             f"{p.numel() + max_new_tokens} exceed the model's seq_len={limit} "
                             f"({model.config.pos} positions); shorten the prompt or ask for fewer tokens")
    n_max = max(p.numel() for p in prompts) + max_new_tokens
    if engine is None:
        cache = cache or ContiguousKVCache(model.config, len(prompts), n_max, device=prompts[0].device)
        engine = Engine(model, cache)
    cache = engine.cache
    for i, p in enumerate(prompts):
        if not cache.reserve(i, p.numel() + max_new_tokens):
            raise ValueError(f"prompt {i} ({p.numel()} tokens + {max_new_tokens}) does not fit in the cache")
    logits = engine.forward([Segment(i, p, 0) for i, p in enumerate(prompts)])
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        nxt = sample(logits, temperature, generator)
        for i, t in enumerate(nxt.tolist()):
            out[i].append(t)
        if step + 1 < max_new_tokens:
            logits = engine.forward([Segment(i, nxt[i:i + 1], p.numel() + step) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        cache.free(i)
    return out
