"""A small shipped corpus, a byte tokenizer and deterministic global batches sliced per rank.

The corpus (``data_files/corpus.txt``, ~10 KB) is public-domain English: Lincoln, Shakespeare's sonnets, the
Declaration of Independence, the openings of Austen and Dickens. Nothing is downloaded.

Tokenizer: UTF-8 bytes, vocabulary 256 (divisible by every TP degree the course uses).

Batches: ``global_batch(step, ...)`` depends only on (seed, step), never on the number of ranks, so a run on
any DP degree sees exactly the same examples as the single-process baseline; ``shard`` gives rank r its
contiguous slice of rows.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import torch

VOCAB_SIZE = 256


@cache
def corpus_text() -> str:
    return resources.files("course_lib").joinpath("data_files/corpus.txt").read_text(encoding="utf-8")


def encode(text: str) -> torch.Tensor:
    """Text -> int64 token ids (its UTF-8 bytes)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: torch.Tensor | list[int]) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@cache
def corpus_tokens() -> torch.Tensor:
    return encode(corpus_text())


def global_batch(step: int, batch_size: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets [batch_size, seq_len] for optimizer step ``step``: random windows of the
    corpus drawn from a generator seeded by (seed, step)."""
    tokens = corpus_tokens()
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=g)
    x = torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1:s + seq_len + 1] for s in starts.tolist()])
    return x, y


def shard(t: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of ``t`` along ``dim``; the size must divide evenly."""
    size = t.shape[dim]
    if size % world_size:
        raise ValueError(f"cannot split {size} rows (dim {dim}) evenly over {world_size} ranks: "
                         f"choose a size divisible by {world_size}")
    return t.chunk(world_size, dim=dim)[rank]


def micro_batches(x: torch.Tensor, y: torch.Tensor, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a batch into ``m`` equal micro-batches (gradient accumulation, pipelines)."""
    if m < 1:
        raise ValueError(f"the number of micro-batches must be >= 1, got {m}")
    if x.shape[0] % m:
        raise ValueError(f"batch of {x.shape[0]} does not split into {m} equal micro-batches")
    return list(zip(x.chunk(m), y.chunk(m), strict=True))
