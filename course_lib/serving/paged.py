"""A paged KV cache in the style of vLLM's PagedAttention (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention").

The memory budget is a number of fixed-size **blocks** of ``block_size`` positions. Each sequence has a **block
table** (its logical block i lives in physical block ``table[i]``); blocks come from a **free list** one at a time
as the sequence grows, and all go back when it ends or is preempted. Position p of a sequence lives at

    physical block table[p // block_size], offset p % block_size

so a sequence wastes at most ``block_size - 1`` positions (in its last block) instead of the unused tail of a
``max_len`` slot. ``blocks_for(n) = ceil(n / block_size)``.
"""

from __future__ import annotations

import math

import torch

from course_lib.model_config import GPTConfig
from course_lib.serving.kv_cache import CacheFull, KVCache


class BlockAllocator:
    """A free list of ``n_blocks`` block ids. ``allocate(n)`` is all or nothing."""

    def __init__(self, n_blocks: int) -> None:
        if n_blocks < 1:
            raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
        self.n_blocks = n_blocks
        self.free_list = list(range(n_blocks - 1, -1, -1))  # pop() hands out block 0 first

    @property
    def n_free(self) -> int:
        return len(self.free_list)

    def allocate(self, n: int) -> list[int]:
        """``n`` block ids taken from the free list; raises :class:`CacheFull` (taking none) if fewer are free."""
        if n > len(self.free_list):
            raise CacheFull(f"asked for {n} blocks, {len(self.free_list)} free of {self.n_blocks}")
        return [self.free_list.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        """Put blocks back on the free list (a block freed twice is a bug and raises)."""
        if set(blocks) & set(self.free_list) or len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks {blocks} released twice")
        self.free_list.extend(reversed(blocks))


class PagedKVCache(KVCache):
    """``n_blocks`` blocks of ``block_size`` positions: ``k``, ``v`` are ``[L, n_blocks, n_kv, block_size, d]``."""

    def __init__(self, config: GPTConfig, n_blocks: int, block_size: int = 16, **kw) -> None:
        super().__init__(config, **kw)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(n_blocks)
        shape = (self.n_layer, n_blocks, self.n_kv_heads, block_size, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.block_tables: dict[int, list[int]] = {}

    def blocks_for(self, n_tokens: int) -> int:
        """ceil(n_tokens / block_size): blocks that hold ``n_tokens`` positions."""
        return math.ceil(n_tokens / self.block_size)

    def reserve(self, seq: int, n_tokens: int) -> bool:
        table = self.block_tables.setdefault(seq, [])
        need = self.blocks_for(n_tokens) - len(table)
        if need > self.allocator.n_free:
            if not table:
                del self.block_tables[seq]
            return False
        if need > 0:
            table += self.allocator.allocate(need)
        return True

    def free(self, seq: int) -> None:
        self.allocator.release(self.block_tables.pop(seq))

    def truncate(self, seq: int, n_tokens: int) -> None:
        """Give back the blocks past the first ``blocks_for(n_tokens)`` of ``seq``."""
        table = self.block_tables[seq]
        keep = self.blocks_for(n_tokens)
        if keep < len(table):
            self.allocator.release(table[keep:])
            del table[keep:]

    def _where(self, seq: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n, device=self.device)
        table = self.block_tables[seq]
        if start + n > len(table) * self.block_size:
            raise CacheFull(f"sequence {seq}: position {start + n - 1} has no block (reserve first)")
        blocks = torch.tensor(table, device=self.device)[pos // self.block_size]
        return blocks, pos % self.block_size

    def write(self, layer: int, seq: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check(k, v)
        blocks, offsets = self._where(seq, start, k.shape[1])
        self.k[layer, blocks, :, offsets] = k.transpose(0, 1)  # advanced indices first: [n, n_kv, d]
        self.v[layer, blocks, :, offsets] = v.transpose(0, 1)

    def read(self, layer: int, seq: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.tensor(self.block_tables[seq][: self.blocks_for(end)], device=self.device)

        def gather(pool: torch.Tensor) -> torch.Tensor:  # [nb, n_kv, bs, d] -> [n_kv, nb * bs, d] -> first end
            return pool[layer, table].transpose(0, 1).reshape(self.n_kv_heads, -1, self.head_dim)[:, :end]

        return gather(self.k), gather(self.v)

    def allocated_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def reserved_for(self, seq: int) -> int:
        return len(self.block_tables.get(seq, ())) * self.block_size

    def sequences(self) -> list[int]:
        return list(self.block_tables)

    def positions_in_use(self) -> int:
        return len({b for t in self.block_tables.values() for b in t}) * self.block_size

    def check_no_leak(self) -> None:
        """Every block is either free or in exactly one live table; raises ``AssertionError`` naming the leak."""
        held = [b for t in self.block_tables.values() for b in t]
        owned = set(held) | set(self.allocator.free_list)
        lost = set(range(self.allocator.n_blocks)) - owned
        if lost or len(held) != len(set(held)) or len(owned) != len(held) + self.allocator.n_free:
            raise AssertionError(f"block accounting broken: lost {sorted(lost)}, held {len(held)}, "
                                 f"free {self.allocator.n_free}, of {self.allocator.n_blocks}")
