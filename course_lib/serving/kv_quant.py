"""An int8 KV cache: the paged cache with K and V stored as int8 and one scale per (position, KV head).

Symmetric absmax quantisation of each head's d_head-vector x (the scheme of KIVI-style per-token caches and of
vLLM's ``kv_cache_dtype="int8"`` family; FP8 would replace the rounding by a cast):

    scale = max|x| / 127,   q = round(x / scale) in [-127, 127],   x ~ q x scale,   |x - q x scale| <= scale / 2

Bytes per cached position: 2 (K and V) x L x n_kv x (d_head x 1 + 4) (int8 values + an fp32 scale per head), a
little over a quarter of fp32 and half of bf16 when d_head >> 4. Decode reads the cache every step, so this halves
the KV term of a decode step's bytes (``roofline.decode_bytes_per_token``) next to a bf16 cache. Reads dequantise
to the compute dtype; the attention math is unchanged.
"""

from __future__ import annotations

import torch

from course_lib.model_config import GPTConfig
from course_lib.serving.paged import PagedKVCache

SCALE_BYTES = 4  # one fp32 scale per (position, KV head)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[..., d]`` -> (int8 ``[..., d]``, fp32 scale ``[..., 1]``), absmax over the last axis (a zero vector gets
    scale 1, so it stays zero)."""
    scale = x.abs().amax(-1, keepdim=True).float() / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


class Int8PagedKVCache(PagedKVCache):
    """:class:`PagedKVCache` whose pools are int8 with fp32 scales ``[L, n_blocks, n_kv, block_size, 1]``;
    ``write`` quantises, ``read`` dequantises to ``compute_dtype``."""

    def __init__(self, config: GPTConfig, n_blocks: int, block_size: int = 16,
                 compute_dtype: torch.dtype = torch.float32, **kw) -> None:
        super().__init__(config, n_blocks, block_size, dtype=torch.int8, **kw)
        self.compute_dtype = compute_dtype
        shape = (self.n_layer, n_blocks, self.n_kv_heads, block_size, 1)
        self.k_scale = torch.ones(shape, dtype=torch.float32, device=self.device)
        self.v_scale = torch.ones(shape, dtype=torch.float32, device=self.device)

    @property
    def bytes_per_token(self) -> int:
        """2 x L x n_kv x (d_head x 1 + SCALE_BYTES)."""
        return 2 * self.n_layer * self.n_kv_heads * (self.head_dim + SCALE_BYTES)

    def write(self, layer: int, seq: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check(k, v)
        blocks, offsets = self._where(seq, start, k.shape[1])
        for pool, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = quantize(x.transpose(0, 1))  # [n, n_kv, d]
            pool[layer, blocks, :, offsets] = q
            scales[layer, blocks, :, offsets] = s

    def read(self, layer: int, seq: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.tensor(self.block_tables[seq][: self.blocks_for(end)], device=self.device)

        def gather(pool: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
            x = dequantize(pool[layer, table], scales[layer, table], self.compute_dtype)  # [nb, n_kv, bs, d]
            return x.transpose(0, 1).reshape(self.n_kv_heads, -1, self.head_dim)[:, :end]

        return gather(self.k, self.k_scale), gather(self.v, self.v_scale)

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale))
