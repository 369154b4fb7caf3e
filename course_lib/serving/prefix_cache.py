"""Automatic prefix caching on the paged KV cache (vLLM's automatic prefix caching; SGLang's RadixAttention
keeps the same blocks in a radix tree).

A **full** block of ``block_size`` positions is identified by the hash of its tokens *and of every block before
it* (a hash chain): ``h_i = hash(h_{i-1}, tokens of block i)``. Two sequences whose first i blocks hold the same
tokens have the same h_i, so the K and V of those positions are the same (causal attention: a position's K/V
depends only on the tokens up to it) and one physical block serves both. A block's own tokens alone would not
do: block 2 of "A B" and of "C B" hold the same tokens but different K/V.

* a new sequence looks its blocks' hashes up, longest prefix first, and takes the hits (reference count + 1);
  only its uncached suffix is prefilled (at least its last token, whose logits it needs);
* a finished or preempted sequence drops its references; a block at zero references stays cached, in LRU
  order, and is evicted (its hash forgotten) only when a fresh block is needed and the free list is empty;
* **copy-on-write**: a write into a block that is shared (reference count > 1) or registered under a hash
  (immutable: others may hit it later) first copies it to a fresh block of the writer's own.

:meth:`PrefixCachingKVCache.check_no_leak` checks that every block is free, evictable, or referenced by exactly
the tables that hold it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from course_lib.model_config import GPTConfig
from course_lib.serving.kv_cache import CacheFull
from course_lib.serving.paged import PagedKVCache


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The hash chain of the full blocks of ``tokens``: h_i = hash((h_{i-1}, tokens of block i)), h_{-1} = None."""
    out: list[int] = []
    for i in range(len(tokens) // block_size):
        out.append(hash((out[-1] if out else None, tuple(tokens[i * block_size:(i + 1) * block_size]))))
    return out


class PrefixCachingKVCache(PagedKVCache):
    """A :class:`PagedKVCache` whose full blocks are shared between sequences with the same prefix.

    ``reserve_prefix(seq, tokens)`` (what the scheduler calls to admit a sequence) returns how many leading
    positions are already cached; ``commit(seq, tokens)`` registers the blocks that ``tokens`` fill. Counters:
    ``hit_tokens`` / ``query_tokens`` (the hit rate), ``evictions``, ``copies`` (copy-on-write).
    """

    def __init__(self, config: GPTConfig, n_blocks: int, block_size: int = 16, **kw) -> None:
        super().__init__(config, n_blocks, block_size, **kw)
        self.ref = [0] * n_blocks
        self.hash_of: dict[int, int] = {}  # block -> hash (registered, immutable blocks)
        self.by_hash: dict[int, int] = {}  # hash -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # zero-reference cached blocks, oldest first
        self.hit_tokens = self.query_tokens = self.evictions = self.copies = 0

    # -- blocks ---------------------------------------------------------------------------------------------------

    @property
    def n_available(self) -> int:
        """Blocks a new allocation can get: free ones, and cached ones no sequence references (evictable)."""
        return self.allocator.n_free + len(self.evictable)

    def _take(self, n: int) -> list[int]:
        """``n`` fresh blocks (reference count 1): the free list first, then the least recently used cached ones."""
        if n > self.n_available:
            raise CacheFull(f"asked for {n} blocks, {self.n_available} available of {self.allocator.n_blocks}")
        out = self.allocator.allocate(min(n, self.allocator.n_free))
        while len(out) < n:
            b, _ = self.evictable.popitem(last=False)
            del self.by_hash[self.hash_of.pop(b)]
            self.evictions += 1
            out.append(b)
        for b in out:
            self.ref[b] = 1
        return out

    def _drop(self, blocks: Sequence[int]) -> None:
        """One reference fewer on each block; at zero a cached block becomes evictable, another one free."""
        for b in blocks:
            if self.ref[b] < 1:
                raise ValueError(f"block {b} released with no reference left")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self.evictable[b] = None
                else:
                    self.allocator.release([b])

    # -- the KVCache interface ------------------------------------------------------------------------------------

    def reserve(self, seq: int, n_tokens: int) -> bool:
        table = self.block_tables.setdefault(seq, [])
        need = self.blocks_for(n_tokens) - len(table)
        if need > self.n_available:
            if not table:
                del self.block_tables[seq]
            return False
        if need > 0:
            table += self._take(need)
        return True

    def reserve_prefix(self, seq: int, tokens: Sequence[int]) -> int | None:
        """Admit ``seq`` with ``tokens``: share the cached blocks of its longest cached prefix, allocate the rest.
        Returns the positions already cached (at most ``len(tokens) - 1``), or None (and no change) if the blocks
        do not fit."""
        hits = []
        for h in block_hashes(tokens, self.block_size):
            if h not in self.by_hash:
                break
            hits.append(self.by_hash[h])
        need = self.blocks_for(len(tokens)) - len(hits)
        full_hit = len(hits) * self.block_size >= len(tokens)  # the last token is recomputed into a shared block
        if need + full_hit > self.n_available - sum(1 for b in hits if b in self.evictable):
            return None
        for b in hits:
            self.evictable.pop(b, None)
            self.ref[b] += 1
        table = self.block_tables[seq] = hits + self._take(need)
        if full_hit:
            self._copy_on_write(table, len(hits) - 1)
        cached = min(len(hits) * self.block_size, len(tokens) - 1)
        self.hit_tokens += cached
        self.query_tokens += len(tokens)
        return cached

    def commit(self, seq: int, tokens: Sequence[int]) -> None:
        """Register the full blocks that ``tokens`` (the positions of ``seq`` now cached) fill, so later sequences
        can hit them. A block whose hash another block already holds stays private (no duplicate entry)."""
        table = self.block_tables[seq]
        for b, h in zip(table, block_hashes(tokens, self.block_size), strict=False):
            if b not in self.hash_of and h not in self.by_hash:
                self.hash_of[b], self.by_hash[h] = h, b

    def free(self, seq: int) -> None:
        self._drop(self.block_tables.pop(seq))

    def truncate(self, seq: int, n_tokens: int) -> None:
        table = self.block_tables[seq]
        keep = self.blocks_for(n_tokens)
        self._drop(table[keep:])
        del table[keep:]

    def write(self, layer: int, seq: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        table = self.block_tables[seq]
        for i in range(start // self.block_size, min(self.blocks_for(start + k.shape[1]), len(table))):
            if self.ref[table[i]] > 1 or table[i] in self.hash_of:
                self._copy_on_write(table, i)
        super().write(layer, seq, start, k, v)

    def _copy_on_write(self, table: list[int], i: int) -> None:
        """Give ``table`` a private copy (every layer) of its block i and drop its reference to the shared one."""
        (new,) = self._take(1)
        old = table[i]
        self.k[:, new], self.v[:, new] = self.k[:, old], self.v[:, old]
        table[i] = new
        self._drop([old])
        self.copies += 1

    @property
    def hit_rate(self) -> float:
        """Prompt positions served from the cache / prompt positions asked for."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def check_no_leak(self) -> None:
        """Every block is free, evictable (cached, unreferenced) or referenced exactly as often as tables hold it."""
        held: dict[int, int] = {}
        for t in self.block_tables.values():
            for b in t:
                held[b] = held.get(b, 0) + 1
        free, evict = set(self.allocator.free_list), set(self.evictable)
        bad = [b for b in range(self.allocator.n_blocks)
               if self.ref[b] != held.get(b, 0) or (b in free) + (b in evict) + (b in held) != 1
               or (b in evict and b not in self.hash_of)]
        if bad or len(free) != self.allocator.n_free:
            raise AssertionError(f"block accounting broken at blocks {bad[:8]}: references "
                                 f"{[self.ref[b] for b in bad[:8]]}, held {[held.get(b, 0) for b in bad[:8]]}")
