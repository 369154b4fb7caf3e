"""course_lib.data: the shipped corpus, the byte tokenizer, deterministic global batches, shards and micro-batches."""

from __future__ import annotations

import pytest
import torch

from course_lib import data
from course_lib.model_config import GPTConfig

SECTIONS = ["THE GETTYSBURG ADDRESS", "SONNETS", "THE DECLARATION OF INDEPENDENCE", "PRIDE AND PREJUDICE",
            "A TALE OF TWO CITIES"]  # Lincoln, Shakespeare, the Declaration, Austen, Dickens: all public domain


@pytest.mark.parametrize("text", ["Four score and seven years ago", "", "a\nb\tc ~", "naïve café ✓ 日本"])
def test_encode_decode_round_trip(text):
    ids = data.encode(text)
    assert ids.dtype == torch.long and ids.dim() == 1
    assert ids.numel() == len(text.encode("utf-8"))  # bytes, not characters
    assert ids.numel() == 0 or (0 <= int(ids.min()) and int(ids.max()) < data.VOCAB_SIZE)
    assert data.decode(ids) == text
    assert data.decode(ids.tolist()) == text


def test_bytes_are_their_own_ids():
    assert data.encode("AZ a").tolist() == [65, 90, 32, 97]
    assert data.encode("é").tolist() == [0xC3, 0xA9]
    assert data.decode([0xFF]) == "\ufffd"  # an invalid byte does not raise
    assert data.VOCAB_SIZE == 256 == GPTConfig().vocab_size


def test_corpus_is_small_ascii_and_has_its_sections():
    text = data.corpus_text()
    raw = text.encode("utf-8")
    assert 5_000 < len(raw) < 1_000_000
    assert text.isascii()
    lines = text.splitlines()
    for title in SECTIONS:
        assert any(line.startswith(title) for line in lines), f"section header {title!r} missing"
    assert lines[0] == SECTIONS[0]  # the file opens with a header, not a fragment
    tokens = data.corpus_tokens()
    assert torch.equal(tokens, data.encode(text))
    assert data.decode(tokens) == text
    assert int(tokens.max()) < 128


def _windows(seq_len: int) -> torch.Tensor:
    return data.corpus_tokens().unfold(0, seq_len + 1, 1)  # every window of seq_len + 1 tokens


def test_global_batch_shapes_targets_and_provenance():
    x, y = data.global_batch(3, 8, 32, seed=1)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    windows = _windows(32)
    both = torch.cat([x, y[:, -1:]], dim=1)  # each row with its last target is one stretch of the corpus
    for row in both:
        assert (windows == row).all(dim=1).any(), "a row is not a contiguous window of the corpus"


def test_global_batch_is_a_function_of_seed_and_step_only():
    a = data.global_batch(5, 8, 16, seed=0)
    torch.manual_seed(123)  # the global RNG plays no part
    b = data.global_batch(5, 8, 16, seed=0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], data.global_batch(6, 8, 16, seed=0)[0])
    assert not torch.equal(a[0], data.global_batch(5, 8, 16, seed=1)[0])
    steps = [data.global_batch(s, 8, 16)[0] for s in range(10)]
    assert len({tuple(t.flatten().tolist()) for t in steps}) == 10


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shards_concatenate_to_the_global_batch(world_size):
    x, y = data.global_batch(0, 8, 16)
    xs = [data.shard(x, r, world_size) for r in range(world_size)]
    ys = [data.shard(y, r, world_size) for r in range(world_size)]
    assert all(s.shape == (8 // world_size, 16) for s in xs)
    assert torch.equal(torch.cat(xs), x) and torch.equal(torch.cat(ys), y)
    for r in range(world_size):  # rank r gets rows r*b .. (r+1)*b - 1, inputs and targets alike
        b = 8 // world_size
        assert torch.equal(xs[r], x[r * b:(r + 1) * b]) and torch.equal(ys[r], y[r * b:(r + 1) * b])
    cols = [data.shard(x, r, world_size, dim=1) for r in range(world_size)]  # e.g. context parallel
    assert torch.equal(torch.cat(cols, dim=1), x)


def test_shard_refuses_uneven_splits():
    x, _ = data.global_batch(0, 6, 16)
    with pytest.raises(ValueError, match="cannot split 6 rows \\(dim 0\\) evenly over 4 ranks"):
        data.shard(x, 0, 4)
    with pytest.raises(ValueError, match="divisible by 3"):
        data.shard(x, 0, 3, dim=1)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_micro_batches_split_in_order(m):
    x, y = data.global_batch(1, 8, 16)
    mbs = data.micro_batches(x, y, m)
    assert len(mbs) == m
    assert all(mx.shape == my.shape == (8 // m, 16) for mx, my in mbs)
    assert torch.equal(torch.cat([mx for mx, _ in mbs]), x)
    assert torch.equal(torch.cat([my for _, my in mbs]), y)
    for mx, my in mbs:
        assert torch.equal(mx[:, 1:], my[:, :-1])


def test_micro_batches_refuse_uneven_splits():
    x, y = data.global_batch(1, 8, 16)
    with pytest.raises(ValueError, match="batch of 8 does not split into 3 equal micro-batches"):
        data.micro_batches(x, y, 3)
