"""The dense layers of the course's GPT (``course_lib.model``): norms, rotary positions, attention and the MLP.

Each takes its sizes from a ``GPTConfig`` (``course_lib.model_config``); the mixture of experts
(``course_lib.moe``) is made of these MLPs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.model_config import GPTConfig


class RMSNorm(nn.Module):
    """x / rms(x) * g (Zhang & Sennrich 2019); no bias, no mean subtraction."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(c: GPTConfig) -> nn.Module:
    return nn.LayerNorm(c.d_model) if c.norm == "layernorm" else RMSNorm(c.d_model)


def rope_cos_sin(seq_len: int, head_dim: int, base: float = 10000.0,
                 positions: torch.Tensor | None = None,
                 device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables (Su et al. 2021): angle(pos, i) = pos / base^(2i/d). Shapes [T, d/2], on ``device`` (or
    that of ``positions``)."""
    if positions is not None:
        device = positions.device
    pos = torch.arange(seq_len, dtype=torch.float32, device=device) if positions is None else positions.float()
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    ang = torch.outer(pos, inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [B, H, T, d] by the angles in cos/sin [T, d/2]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    """Causal multi-head attention with optional grouped-query K/V heads (Ainslie et al. 2023)."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.kv_heads, c.head_dim
        kv_dim = c.kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.d_model, c.d_model, bias=c.bias)
        self.k_proj = nn.Linear(c.d_model, kv_dim, bias=c.bias)
        self.v_proj = nn.Linear(c.d_model, kv_dim, bias=c.bias)
        self.o_proj = nn.Linear(c.d_model, c.d_model, bias=c.bias)
        self.rope = c.pos == "rope"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, H, T, d]
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, H_kv, T, d]
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            cos, sin = rope_cos_sin(T, self.head_dim, device=x.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if k.shape[1] != q.shape[1]:  # GQA: each K/V head serves n_head / n_kv_head query heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """GELU MLP h -> f -> h, or SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, c: GPTConfig, d_ff: int | None = None) -> None:
        super().__init__()
        self.swiglu, f = c.mlp == "swiglu", d_ff or c.ffn_dim
        self.fc1 = nn.Linear(c.d_model, f, bias=c.bias)  # "up"
        self.gate = nn.Linear(c.d_model, f, bias=c.bias) if self.swiglu else None
        self.fc2 = nn.Linear(f, c.d_model, bias=c.bias)  # "down"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.fc2(F.silu(self.gate(x)) * self.fc1(x))
        return self.fc2(F.gelu(self.fc1(x)))
