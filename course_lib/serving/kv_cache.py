"""The KV cache: keep every layer's keys and values so a decode step computes only the new token.

Without a cache, generating token n+1 re-runs the whole prefix (n tokens through every layer); with one, a step
runs only the new tokens and attends over the stored K and V. What it costs (Pope et al. 2022, "Efficiently
Scaling Transformer Inference", Sec. 2):

    bytes per token = 2 (K and V) x L x n_kv_heads x d_head x bytes per element

times tokens times sequences (``course_lib.estimates.memory.kv_cache_bytes``). Under tensor parallelism a rank keeps
only its own K/V heads (``n_kv_heads`` here is the *local* count).

Two layouts share one interface (``reserve``/``free``/``write``/``read``), so the engine and the scheduler never
know which one they use:

* :class:`ContiguousKVCache` (this file): one slot of ``max_len`` positions per sequence, reserved whole when
  the sequence starts; simple, but a sequence that stops early wastes the rest of its slot;
* :class:`~course_lib.serving.paged.PagedKVCache`: fixed-size blocks handed out as a sequence grows (vLLM's
  PagedAttention, Kwon et al. 2023).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from course_lib.model_config import GPTConfig


class CacheFull(RuntimeError):  # noqa: N818 - reads better as `except CacheFull`
    """The cache has no room for what was asked (no free slot, too long a sequence, or no free blocks)."""


class KVCache(ABC):
    """Per-layer K and V of many sequences. Tensors are ``[n_kv_heads, T, d_head]`` per sequence and layer.

    ``reserve(seq, n_tokens)`` makes room for a sequence's first ``n_tokens`` positions (all or nothing: it returns
    False and changes nothing when there is not enough room); ``write`` stores new positions; ``read`` returns
    positions ``0 .. end-1``; ``free`` gives the sequence's memory back.
    """

    def __init__(self, config: GPTConfig, *, n_kv_heads: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.config = config
        self.n_layer, self.head_dim = config.n_layer, config.head_dim
        self.n_kv_heads = config.kv_heads if n_kv_heads is None else n_kv_heads
        self.dtype, self.device = dtype, torch.device(device)

    @property
    def bytes_per_token(self) -> int:
        """2 x L x n_kv_heads x d_head x element size: what one cached position costs."""
        return 2 * self.n_layer * self.n_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @abstractmethod
    def reserve(self, seq: int, n_tokens: int) -> bool:
        """Make room for positions ``0 .. n_tokens-1`` of ``seq``; False (and no change) if it does not fit."""

    @abstractmethod
    def free(self, seq: int) -> None:
        """Release everything ``seq`` holds."""

    @abstractmethod
    def write(self, layer: int, seq: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``[n_kv_heads, n, d_head]`` at positions ``start .. start+n-1`` of ``seq``."""

    @abstractmethod
    def read(self, layer: int, seq: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``0 .. end-1`` of ``seq``: two ``[n_kv_heads, end, d_head]`` tensors."""

    @abstractmethod
    def allocated_bytes(self) -> int:
        """Bytes of the tensors the cache allocated (measured with ``numel * element_size``)."""

    @abstractmethod
    def reserved_for(self, seq: int) -> int:
        """Positions set aside for ``seq`` (used or not); 0 for a sequence the cache does not hold."""

    @abstractmethod
    def sequences(self) -> list[int]:
        """The sequences that hold memory now."""

    def reserve_prefix(self, seq: int, tokens: list[int]) -> int | None:
        """Admit ``seq`` holding ``tokens``: the positions already cached (0 here; a prefix cache finds more), or
        None (and no change) if they do not fit."""
        return 0 if self.reserve(seq, len(tokens)) else None

    def commit(self, seq: int, tokens: list[int]) -> None:
        """``tokens`` (the first positions of ``seq``) are now cached: a prefix cache registers their blocks."""
        return None

    def positions_in_use(self) -> int:
        """Distinct positions of memory held by live sequences (shared blocks counted once)."""
        return self.reserved_tokens()

    def truncate(self, seq: int, n_tokens: int) -> None:
        """Forget positions ``n_tokens ..`` of ``seq`` (speculative decoding's rollback). Positions are addressed
        by index, so a layout that cannot give memory back (a contiguous slot) has nothing to do: the next write
        overwrites them, and no read goes past the positions it asks for."""
        return None

    def reserved_tokens(self) -> int:
        """Positions set aside for all live sequences."""
        return sum(self.reserved_for(s) for s in self.sequences())

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        want = (self.n_kv_heads, k.shape[1], self.head_dim)
        if k.shape != want or v.shape != want:
            raise ValueError(f"k and v must be [n_kv_heads={self.n_kv_heads}, n, d_head={self.head_dim}], "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")


class ContiguousKVCache(KVCache):
    """``max_seqs`` slots of ``max_len`` positions each: ``k``, ``v`` are ``[L, max_seqs, n_kv, max_len, d]``.

    A sequence gets a whole slot on its first ``reserve`` (a request for more than ``max_len`` positions fails).
    """

    def __init__(self, config: GPTConfig, max_seqs: int, max_len: int, **kw) -> None:
        super().__init__(config, **kw)
        if max_seqs < 1 or max_len < 1:
            raise ValueError(f"max_seqs and max_len must be >= 1, got {max_seqs}, {max_len}")
        self.max_seqs, self.max_len = max_seqs, max_len
        shape = (self.n_layer, max_seqs, self.n_kv_heads, max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.slots: dict[int, int] = {}  # seq id -> slot
        self._free_slots = list(range(max_seqs - 1, -1, -1))

    def reserve(self, seq: int, n_tokens: int) -> bool:
        if n_tokens > self.max_len:
            return False
        if seq not in self.slots:
            if not self._free_slots:
                return False
            self.slots[seq] = self._free_slots.pop()
        return True

    def free(self, seq: int) -> None:
        self._free_slots.append(self.slots.pop(seq))

    def write(self, layer: int, seq: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check(k, v)
        slot, end = self.slots[seq], start + k.shape[1]
        if end > self.max_len:
            raise CacheFull(f"sequence {seq}: position {end - 1} is past max_len={self.max_len}")
        self.k[layer, slot, :, start:end] = k
        self.v[layer, slot, :, start:end] = v

    def read(self, layer: int, seq: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self.slots[seq]
        return self.k[layer, slot, :, :end], self.v[layer, slot, :, :end]

    def allocated_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def reserved_for(self, seq: int) -> int:
        return self.max_len if seq in self.slots else 0

    def sequences(self) -> list[int]:
        return list(self.slots)
