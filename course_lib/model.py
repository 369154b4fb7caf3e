"""A tiny decoder-only GPT you can read in one sitting: embeddings, pre-norm blocks, the LM head.

Its shape is a ``GPTConfig`` (``course_lib.model_config``, with the parameter-count formulas and the presets of
real models); its layers are in ``course_lib.layers`` (attention, MLP, norms) and ``course_lib.moe`` (the
mixture of experts a block uses instead of its MLP when ``n_expert`` > 0).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.layers import MLP, Attention, make_norm
from course_lib.model_config import GPTConfig
from course_lib.moe import MoE


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.norm1 = make_norm(c)
        self.attn = Attention(c)
        self.norm2 = make_norm(c)
        self.mlp = MoE(c) if c.n_expert else MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token (+ learned position) embedding -> L blocks -> final norm -> LM head.

    ``embed``, ``blocks`` and ``head`` are separate so that pipeline stages can run a slice of the model.
    Initialisation is deterministic from ``seed`` (its own generator; the global RNG is untouched):
    weights ~ N(0, 0.02), residual output projections ~ N(0, 0.02 / sqrt(2L)) (GPT-2), biases 0, norms 1.
    """

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        c = self.config = config
        with torch.random.fork_rng(devices=[]):  # torch's default inits draw from the global RNG: leave it as it was
            self.tok_emb = nn.Embedding(c.padded_vocab_size, c.d_model)
            self.pos_emb = nn.Embedding(c.seq_len, c.d_model) if c.pos == "learned" else None
            self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
            self.norm_f = make_norm(c)
            self.lm_head = nn.Linear(c.d_model, c.padded_vocab_size, bias=False)
        if c.padded_vocab_size != c.vocab_size:
            self.lm_head.vocab_size = c.vocab_size  # the real vocabulary: the rows beyond it are padding
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # norm gains
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith(("o_proj.weight", "fc2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head; the padded vocabulary's logits -inf. The LM head carries the real
        ``vocab_size`` when the vocabulary is padded (so a pipeline stage or a TP shard of it masks too; under TP
        the shard's first id is its ``output_start``). Reads only ``norm_f`` and ``lm_head``."""
        logits = self.lm_head(self.norm_f(x))
        vocab = getattr(self.lm_head, "vocab_size", None)
        if vocab is None:
            return logits
        start = getattr(self.lm_head, "output_start", 0)
        ids = torch.arange(start, start + logits.shape[-1], device=logits.device)
        return logits.masked_fill(ids >= vocab, float("-inf"))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx [B, T] token ids -> logits [B, T, vocab]."""
        if idx.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens exceeds seq_len={self.config.seq_len}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def num_params(model: nn.Module) -> int:
    """Real parameter count of a module (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
