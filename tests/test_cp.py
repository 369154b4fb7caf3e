"""course_lib.parallel.cp / cp_attention: ring and all-gather attention against full attention on one process,
the whole tiny GPT against the single-process baseline (CP alone and DP x CP), the comm log against the formula,
the causal work per rank against the load-balance formulas, mutations that must fail, and bad inputs.

Second oracle: torch 2.13's internal templated ring attention with the CPU flash kernel (a private API, pinned
to this version; the public ``context_parallel`` needs CUDA), causal with its head-tail load balancing (= our
zig-zag) and not, rotating K,V by all-to-all and by all-gather.

Launches are few and batched (each costs seconds of rank start-up on 2 cores): one suite at cp = 2 and one at
cp = 4 run every configuration in turn; the tests read their cached results.

Tolerances (fp32). Attention: max |diff| of the output and of dQ, dK, dV <= 1e-5 against PyTorch's SDPA on the
full sequence (measured ~1e-6: only the order of the sums differs). Whole model: ``course_lib.train.compare``'s
rule (a multiple of the baseline's own fp32 noise, measured against float64), with SGD (lr 1e-2, momentum 0.9) --
the optimizer that exposes a wrong gradient scale -- and with AdamW for RoPE + GQA. (AdamW with learned positions
amplifies rounding noise in the near-zero first-step gradient of q_proj; train.py explains the conditioning.)
Sequence length 24: not a power of two, 3 tokens per chunk under zig-zag at cp = 4.
"""

from __future__ import annotations

import functools

import pytest
import torch

from course_lib.data import global_batch
from course_lib.estimates.accounting import activation_bytes_per_rank, ring_kv_bytes, ring_sends_per_layer
from course_lib.estimates.activation_memory import model_activation_bytes
from course_lib.measure.memtrack import MemoryTracker
from course_lib.model import GPT, lm_loss
from course_lib.parallel import cp_attention as ca
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.cp import CPAttention, apply_cp
from course_lib.parallel.cp_ulysses import AllToAll, UlyssesExchange, ulysses_attention, ulysses_bytes_per_rank
from course_lib.parallel.dp import DataParallel
from course_lib.parallel.runs import train_cp
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import Mesh, MeshShape
from course_lib.train import PARITY_MODEL, TrainConfig, compare, train_baseline

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

S, B, H, D = 24, 2, 4, 8
TOL = 1e-5
CFG = PARITY_MODEL.with_(seq_len=S, n_layer=2, d_model=32)
ROPE_GQA = CFG.with_(pos="rope", n_kv_head=2)
SGD = TrainConfig(steps=2, global_batch=4, optimizer="sgd", lr=1e-2)
ADAMW = TrainConfig(steps=2, global_batch=4)
MEM_CFG = PARITY_MODEL.with_(seq_len=48)
LAUNCH_TIMEOUT = 240


# ----------------------------------------------------------------------------------------------------------------
# Mutations, each through a public seam


class StaleKVBackward(ca.BlockAttention):
    """Backward recomputes every step with the first step's (its own) K,V instead of the block it received."""

    def kv_for_backward_step(self, step: int, received: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        return own


class UnshiftedMerge(ca.BlockAttention):
    """The textbook merge without the max shift: exp(lse) overflows fp32 once scores pass ~88."""

    def merge(self, out, lse, block_out, block_lse):
        w_old, w_new = torch.exp(lse), torch.exp(block_lse)
        total = w_old + w_new
        return (w_old[..., None] * out + w_new[..., None] * block_out) / total[..., None], torch.log(total)


class ChunkLocalMask(ca.BlockAttention):
    """The causal mask built from positions inside each block (0..T-1) instead of the global positions."""

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        q_local = torch.arange(q_pos.numel(), device=q_pos.device)
        k_local = torch.arange(k_pos.numel(), device=k_pos.device)
        return k_local[None, :] <= q_local[:, None]


class LocalRoPE(CPAttention):
    """RoPE at the local token index (0..s/cp - 1), not at the tokens' global (zig-zag) positions."""

    def rotary(self, q, k, positions):
        return super().rotary(q, k, torch.arange(positions.numel(), device=positions.device))


class HeadDimResplit(UlyssesExchange):
    """Ulysses re-split along the wrong dim: chunks of head_dim instead of whole heads go to each rank (the shapes
    still fit, so nothing complains; every rank attends over slices of every head)."""

    def to_heads(self, x, group):
        return AllToAll.apply(x, 3, 2, group)

    def to_sequence(self, x, group):
        return AllToAll.apply(x, 2, 3, group)


DOC_STARTS = [0, 7, 15]  # three packed documents in the 24 tokens (not aligned with any chunk)
KERNELS = {"ok": ca.BlockAttention, "stale_kv": StaleKVBackward, "unshifted": UnshiftedMerge,
           "local_mask": ChunkLocalMask, "doc": lambda: ca.DocumentMaskAttention(DOC_STARTS),
           "head_dim_resplit": ca.BlockAttention}
ALGORITHM_FNS = {"ring": ca.ring_attention, "allgather": ca.allgather_attention, "ulysses": ulysses_attention}


# ----------------------------------------------------------------------------------------------------------------
# The rank-side suites


def _inputs(h_kv: int, scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=g) * scale
    k, v = torch.randn(B, h_kv, S, D, generator=g), torch.randn(B, h_kv, S, D, generator=g)
    return q, k, v, torch.randn(B, H, S, D, generator=g)


def _attention_case(rank: int, cp: int, layout: str, causal: bool, h_kv: int, algorithm: str, kernel: str,
                    scale: float = 1.0) -> dict[str, float]:
    q, k, v, d_out = _inputs(h_kv, scale)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    if kernel == "doc":  # the block-diagonal causal mask, on the whole sequence
        doc_mask = KERNELS["doc"]().mask(torch.arange(S), torch.arange(S))
        ref = torch.nn.functional.scaled_dot_product_attention(full[0], *(ca.expand_kv(t, H) for t in full[1:]),
                                                               attn_mask=doc_mask)
    else:
        ref = ca.reference_attention(*full, causal=causal)
    ref.backward(d_out)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return ca.shard_sequence(t, rank, cp, layout, dim=2)

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    fn = ALGORITHM_FNS[algorithm]
    if kernel == "head_dim_resplit":
        fn = functools.partial(ulysses_attention, exchange=HeadDimResplit())
    stats = ca.AttentionStats()
    try:
        out = fn(*local, ca.all_positions(S, cp, layout), ca.chunks_per_rank(layout), causal, None,
                 KERNELS[kernel](), stats)
    except ValueError as e:  # Ulysses with more ranks than K/V heads: refused before any communication
        return {"error": str(e)}
    out.backward(mine(d_out))
    got = [out, *(t.grad for t in local)]
    want = [ref, *(t.grad for t in full)]
    diffs = {name: float((a.detach() - mine(b)).abs().max()) for name, a, b in zip(("out", "dq", "dk", "dv"), got,
                                                                                  want, strict=True)}
    diffs["finite"] = float(all(bool(torch.isfinite(t).all()) for t in got))
    diffs["pairs"] = stats.pairs
    diffs["skipped"] = stats.skipped
    return diffs


ATTENTION_CASES = [(layout, causal, h_kv, algorithm, "ok") for layout in ca.LAYOUTS for causal in (True, False)
                   for h_kv in (H, 2) for algorithm in ("ring", "allgather")]
ATTENTION_CASES += [(layout, causal, h_kv, "ulysses", "ok") for layout in ca.LAYOUTS for causal in (True, False)
                    for h_kv in (H, 2)]
ATTENTION_CASES += [(layout, True, h_kv, algorithm, "doc") for layout in ca.LAYOUTS for h_kv in (H, 2)
                    for algorithm in ("ring", "allgather", "ulysses")]
ATTENTION_CASES += [("zigzag", True, 2, "ring", "stale_kv"), ("contiguous", True, H, "ring", "local_mask"),
                    ("zigzag", True, H, "ring", "local_mask"), ("zigzag", True, H, "ulysses", "head_dim_resplit")]


def _suite(rank: int, cp: int) -> dict:
    out: dict = {"attention": {c: _attention_case(rank, cp, *c) for c in ATTENTION_CASES}}
    out["large"] = {name: _attention_case(rank, cp, "zigzag", True, H, "ring", name, scale=60.0)
                    for name in ("ok", "unshifted")}
    train = {}
    runs = [("sgd_zigzag", CFG, SGD, {"layout": "zigzag"}),
            ("sgd_contiguous", CFG, SGD, {"layout": "contiguous"}),
            ("adamw_rope_gqa", ROPE_GQA, ADAMW, {"layout": "zigzag"}),
            ("sgd_allgather", ROPE_GQA, SGD, {"layout": "zigzag", "algorithm": "allgather"}),
            ("local_rope", ROPE_GQA, SGD, {"layout": "zigzag", "attention": LocalRoPE}),
            ("sgd_ulysses", CFG, SGD, {"layout": "zigzag", "algorithm": "ulysses"}),
            ("sgd_ulysses_contiguous", CFG, SGD, {"layout": "contiguous", "algorithm": "ulysses"})]
    if cp <= ROPE_GQA.kv_heads:
        runs.append(("adamw_rope_gqa_ulysses", ROPE_GQA, ADAMW, {"layout": "zigzag", "algorithm": "ulysses"}))
    for key, cfg, tc, kw in runs:
        train[key] = train_cp(rank, cp, cfg, tc, **kw)
    if cp == 4:
        train["dp2_cp2"] = train_cp(rank, cp, ROPE_GQA, SGD, mesh=Mesh(dp=2, cp=2), layout="zigzag")
        for stage in (1, 3):
            train[f"dp2_cp2_zero{stage}"] = train_cp(rank, cp, ROPE_GQA, SGD, mesh=Mesh(dp=2, cp=2), zero_stage=stage)
    out["train"] = train
    out["memory"] = {cfg.pos: _activation_peak(rank, cp, cfg) for cfg in (MEM_CFG, MEM_CFG.with_(pos="rope",
                                                                                                  n_kv_head=2))}
    return out


def _activation_peak(rank: int, cp: int, cfg) -> int:
    model = GPT(cfg)
    ctx = apply_cp(model, None, layout="zigzag")
    x, y = (ca.shard_sequence(t, ctx.rank, ctx.size, ctx.layout) for t in global_batch(0, 2, cfg.seq_len))
    with MemoryTracker(model) as mt:
        lm_loss(model(x), y).backward()
    return int(mt.category_peaks["activations"])


@functools.cache
def suite(cp: int) -> list[dict]:
    return launch(_suite, cp, timeout=LAUNCH_TIMEOUT)


@functools.cache
def baseline(cfg, tc):
    return train_baseline(cfg, tc)


# ----------------------------------------------------------------------------------------------------------------
# Layouts and work counts (no ranks)


def test_zigzag_chunks_and_positions():
    assert [ca.chunk_ids(r, 4, "zigzag") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert ca.positions(24, 1, 4, "zigzag").tolist() == [3, 4, 5, 18, 19, 20]
    assert ca.positions(24, 1, 4, "contiguous").tolist() == list(range(6, 12))
    every = torch.cat([ca.positions(24, r, 4, "zigzag") for r in range(4)])
    assert sorted(every.tolist()) == list(range(24))


@pytest.mark.parametrize("layout", ca.LAYOUTS)
def test_shard_unshard_roundtrip(layout):
    t = torch.arange(3 * 24).view(3, 24)
    parts = [ca.shard_sequence(t, r, 4, layout) for r in range(4)]
    assert torch.equal(ca.unshard_sequence(parts, layout), t)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_work_matches_formulas(cp):
    c = 64
    contiguous = ca.causal_pairs(cp * c, cp, "contiguous")
    assert contiguous == [c * c * r + c * (c + 1) // 2 for r in range(cp)]
    assert sum(contiguous) == cp * c * (cp * c + 1) // 2  # the whole causal triangle, nothing lost
    assert ca.imbalance(contiguous) == pytest.approx((2 * cp - 1) / cp, rel=1 / c)
    zigzag = ca.causal_pairs(cp * c, cp, "zigzag")
    assert len(set(zigzag)) == 1 and ca.imbalance(zigzag) == 1.0


@pytest.mark.parametrize("seq, cp, layout", [(20, 3, "contiguous"), (12, 4, "zigzag"), (2, 2, "zigzag")])
def test_bad_sequence_lengths_raise(seq, cp, layout):
    with pytest.raises(ValueError, match="equal chunks"):
        ca.positions(seq, 0, cp, layout)


def test_unknown_layout_raises():
    with pytest.raises(ValueError, match="unknown layout"):
        ca.chunks_per_rank("striped")


# ----------------------------------------------------------------------------------------------------------------
# One block and the merge (no ranks)


def _split_and_merge(kernel: ca.BlockAttention, q, k, v, mask=None):
    scale = D ** -0.5
    halves = [slice(0, S // 2), slice(S // 2, S)]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"))
    for ks in halves:
        block_mask = None if mask is None else mask[:, ks]
        o, s = kernel.forward(q, k[:, :, ks], v[:, :, ks], scale, block_mask)
        out, lse = kernel.merge(out, lse, o, s)
    return out, lse


def test_merge_of_two_blocks_equals_full_softmax():
    q, k, v, _ = _inputs(2)
    out, lse = _split_and_merge(ca.BlockAttention(), q, k, v)
    assert (out - ca.reference_attention(q, k, v, causal=False)).abs().max() < TOL
    full_lse = torch.logsumexp(D ** -0.5 * q @ ca.expand_kv(k, H).transpose(-1, -2), dim=-1)
    assert (lse - full_lse).abs().max() < TOL


def test_merge_is_stable_for_large_scores_and_the_unshifted_one_is_not():
    q, k, v, _ = _inputs(H, scale=60.0)  # scores ~ 100s: exp overflows fp32 at ~88
    ref = ca.reference_attention(q, k, v, causal=False)
    out, _ = _split_and_merge(ca.BlockAttention(), q, k, v)
    assert torch.isfinite(out).all() and (out - ref).abs().max() < 1e-4
    bad, _ = _split_and_merge(UnshiftedMerge(), q, k, v)
    assert not torch.isfinite(bad).all()


def test_fully_masked_rows_give_zero_not_nan():
    q, k, v, d_out = _inputs(H)
    mask = torch.ones(S, S, dtype=torch.bool)
    mask[3] = False  # row 3 sees no key at all
    mask[5, : S // 2] = False  # row 5 sees nothing in the first block
    kernel = ca.BlockAttention()
    out, lse = _split_and_merge(kernel, q, k, v, mask)
    assert torch.isfinite(out).all() and (out[:, :, 3] == 0).all() and torch.isinf(lse[:, :, 3]).all()
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, 5:6], k[:, :, S // 2:], v[:, :, S // 2:])
    assert (out[:, :, 5:6] - ref).abs().max() < TOL
    delta = (d_out * out).sum(-1)
    grads = kernel.backward(q, k, v, D ** -0.5, mask, d_out, lse, delta)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("d_scale", [1.0, 1e3])
def test_fully_masked_rows_have_finite_gradients_in_every_form(d_scale):
    """Autograd through the block forward (the all-gather form), the merge of two blocks, and the ring's explicit
    block backward: a row that sees no key gets zero gradients, never NaN, also for |dO| = 1e3; the other rows'
    gradients equal SDPA's with the same mask."""
    q, k, v, d_out = _inputs(H)
    d_out = d_out * d_scale
    mask = ca.BlockAttention().mask(torch.arange(S), torch.arange(S))
    mask[3] = False  # row 3 sees no key at all
    kernel = ca.BlockAttention()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = kernel.forward(*leaves, D ** -0.5, mask)
    out.backward(d_out)
    assert all(bool(torch.isfinite(t.grad).all()) for t in leaves)
    assert bool((leaves[0].grad[:, :, 3] == 0).all())
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, attn_mask=mask)
    keep = torch.ones(S, dtype=torch.bool)
    keep[3] = False
    (ref[:, :, keep] * d_out[:, :, keep]).sum().backward()  # SDPA gives NaN on the empty row: leave it out
    scale = max(float(t.grad.abs().max()) for t in ref_leaves)
    assert float((leaves[0].grad[:, :, keep] - ref_leaves[0].grad[:, :, keep]).abs().max()) <= TOL * scale
    for mine, theirs in zip(leaves[1:], ref_leaves[1:], strict=True):
        assert float((mine.grad - theirs.grad).abs().max()) <= TOL * scale
    merged = [t.clone().requires_grad_() for t in (q, k, v)]
    m_out, _ = _split_and_merge(kernel, *merged, mask)
    m_out.backward(d_out)
    assert all(bool(torch.isfinite(t.grad).all()) for t in merged)
    grads = kernel.backward(q, k, v, D ** -0.5, mask, d_out, lse.detach(), (d_out * out.detach()).sum(-1))
    assert all(bool(torch.isfinite(g).all()) for g in grads)


def test_block_backward_equals_autograd():
    q, k, v, d_out = _inputs(2)
    mask = ca.BlockAttention().mask(torch.arange(S), torch.arange(S))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ca.BlockAttention().forward(*leaves, D ** -0.5, mask)
    out.backward(d_out)
    delta = (d_out * out.detach()).sum(-1)
    mine = ca.BlockAttention().backward(q, k, v, D ** -0.5, mask, d_out, lse.detach(), delta)
    for got, leaf in zip(mine, leaves, strict=True):
        assert (got - leaf.grad).abs().max() < TOL


# ----------------------------------------------------------------------------------------------------------------
# Ring / all-gather attention on ranks


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", [c for c in ATTENTION_CASES if c[-1] in ("ok", "doc")], ids=str)
def test_attention_equals_full_attention(cp, case):
    """Ring, all-gather and Ulysses (MHA and GQA, causal or not, both layouts), and the document (block-diagonal
    causal) mask in all three: output and dQ, dK, dV equal SDPA's on the whole sequence. Ulysses with more
    ranks than K/V heads (2 K/V heads at cp = 4) is refused instead, with the fix in the message."""
    _layout, _causal, h_kv, algorithm, _kernel = case
    for rank, res in enumerate(suite(cp)):
        d = res["attention"][case]
        if algorithm == "ulysses" and cp > h_kv:
            assert all(w in d["error"] for w in (f"cp={cp}", f"{h_kv} K/V heads", "algorithm='ring'")), d
            continue
        assert max(d["out"], d["dq"], d["dk"], d["dv"]) < TOL, (rank, d)
        assert d["finite"]


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_document_mask_skips_cross_document_blocks_in_the_ring(cp):
    """Packed documents cut the ring's work: only same-document causal pairs are computed."""
    doc = ca.DocumentMaskAttention(DOC_STARTS)
    for layout in ca.LAYOUTS:
        got = [r["attention"][(layout, True, H, "ring", "doc")]["pairs"] for r in suite(cp)]
        want = [int(doc.mask(ca.positions(S, r, cp, layout), torch.arange(S)).sum()) for r in range(cp)]
        assert got == want and sum(got) < sum(ca.causal_pairs(S, cp, layout))


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_mutation_ulysses_resplit_along_head_dim_fails(cp):
    res = [r["attention"][("zigzag", True, H, "ulysses", "head_dim_resplit")] for r in suite(cp)]
    assert any(d["out"] > 1e-3 for d in res), res


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_balances_causal_work_in_any_layout(cp):
    """Every rank attends over the whole sequence for H/cp heads: the same visible pairs on every rank."""
    for layout in ca.LAYOUTS:
        pairs = [r["attention"][(layout, True, H, "ulysses", "ok")]["pairs"] for r in suite(cp)]
        assert pairs == [S * (S + 1) // 2] * cp


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_comm_equals_formula(cp):
    """Measured (our own send/recv): per layer and rank, forward and backward each (cp-1)/cp x B (s/cp) d e x
    (2H + 2H_kv); one send per peer per all-to-all (4 all-to-alls each way)."""
    want = ulysses_bytes_per_rank(S, SGD.global_batch, CFG.n_head, CFG.kv_heads, CFG.head_dim, cp, 4)
    for result in suite(cp):
        for step in result["train"]["sgd_ulysses"].step_comm:
            sent = [r for r in step if r.op == "send"]
            assert len(sent) == CFG.n_layer * 8 * (cp - 1)
            assert sum(r.sent_bytes for r in sent) == CFG.n_layer * (want["forward"] + want["backward"])
            assert sum(r.recv_bytes for r in step if r.op == "recv") == sum(r.sent_bytes for r in sent)


def test_ulysses_moves_fewer_bytes_than_the_ring_past_1_plus_h_over_hkv():
    """Per layer forward: Ulysses (cp-1)/cp (2H + 2H_kv) n against the ring's (cp-1) 2 H_kv n (n = B s/cp d e):
    Ulysses wins once cp > 1 + H/H_kv (MHA: cp > 2)."""
    for h, hkv in ((32, 32), (32, 8)):
        for cp in (2, 4, 8):
            if hkv % cp:
                continue
            ulysses = ulysses_bytes_per_rank(4096, 1, h, hkv, 128, cp, 2)["forward"]
            ring = (cp - 1) * ring_kv_bytes(4096, 1, hkv, 128, cp, 2)
            assert (ulysses < ring) == (cp > 1 + h // hkv), (h, hkv, cp)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_causal_blocks_are_skipped_and_work_matches_the_formula(cp):
    res = suite(cp)
    for layout in ca.LAYOUTS:
        pairs = [r["attention"][(layout, True, H, "ring", "ok")]["pairs"] for r in res]
        assert pairs == ca.causal_pairs(S, cp, layout)
    contiguous = [r["attention"][("contiguous", True, H, "ring", "ok")]["skipped"] for r in res]
    assert contiguous == [cp - 1 - r for r in range(cp)]  # rank r skips the blocks of every later rank


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_large_scores_stay_finite_and_an_unshifted_merge_fails(cp):
    res = suite(cp)
    assert all(r["large"]["ok"]["finite"] and r["large"]["ok"]["out"] < 1e-4 for r in res)
    assert not all(r["large"]["unshifted"]["finite"] for r in res)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_mutation_stale_kv_in_backward_fails(cp):
    res = suite(cp)
    d = [r["attention"][("zigzag", True, 2, "ring", "stale_kv")] for r in res]
    assert max(x["out"] for x in d) < TOL  # forward untouched ...
    assert max(max(x["dq"], x["dk"], x["dv"]) for x in d) > 1e-2  # ... the gradients are wrong


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", ca.LAYOUTS)
def test_mutation_chunk_local_mask_fails(cp, layout):
    d = [r["attention"][(layout, True, H, "ring", "local_mask")] for r in suite(cp)]
    assert max(x["out"] for x in d) > 1e-2


# ----------------------------------------------------------------------------------------------------------------
# The whole model


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("key, cfg, tc", [("sgd_zigzag", CFG, SGD), ("sgd_contiguous", CFG, SGD),
                                          ("adamw_rope_gqa", ROPE_GQA, ADAMW), ("sgd_allgather", ROPE_GQA, SGD),
                                          ("sgd_ulysses", CFG, SGD), ("sgd_ulysses_contiguous", CFG, SGD),
                                          ("adamw_rope_gqa_ulysses", ROPE_GQA, ADAMW)])
def test_whole_model_parity(cp, key, cfg, tc):
    if key == "adamw_rope_gqa_ulysses" and cp > ROPE_GQA.kv_heads:
        pytest.skip("Ulysses needs cp <= n_kv_head (the refusal is tested on the attention)")
    ref = baseline(cfg, tc)
    for result in suite(cp):
        report = compare(ref, result["train"][key])
        assert report.ok, str(report)


@pytest.mark.parity
@pytest.mark.slow
def test_dp_x_cp_parity_and_gradient_group():
    ref = baseline(ROPE_GQA, SGD)
    for result in suite(4):
        run = result["train"]["dp2_cp2"]
        assert compare(ref, run).ok, str(compare(ref, run))
        groups = {(r.op, r.group) for step in run.step_comm for r in step}
        assert ("all_reduce", "dp+cp") in groups and ("send", "cp") in groups


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_dp_x_cp_with_zero_shards_over_dp_x_cp(stage):
    ref = baseline(ROPE_GQA, SGD)
    for result in suite(4):
        run = result["train"][f"dp2_cp2_zero{stage}"]
        assert compare(ref, run).ok, str(compare(ref, run))
        groups = {(r.op, r.group) for step in run.step_comm for r in step}
        if stage == 1:  # ZeRO-1 behind data parallelism: all-reduce, then each parameter from its owner
            assert {("all_reduce", "dp+cp"), ("broadcast", "dp+cp"), ("send", "cp")} <= groups, groups
        else:
            assert {("reduce_scatter", "dp+cp"), ("all_gather", "dp+cp"), ("send", "cp")} <= groups, groups
            assert ("all_reduce", "dp+cp") not in groups


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_mutation_zigzag_without_matching_rope_fails(cp):
    ref = baseline(ROPE_GQA, SGD)
    assert not compare(ref, suite(cp)[0]["train"]["local_rope"]).ok


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_comm_equals_formula(cp):
    cfg = CFG
    rows = SGD.global_batch
    block = ring_kv_bytes(S, rows, cfg.kv_heads, cfg.head_dim, cp, 4)
    sends = ring_sends_per_layer(cp)
    for result in suite(cp):
        for step in result["train"]["sgd_zigzag"].step_comm:
            sent = [r for r in step if r.op == "send"]
            assert len(sent) == cfg.n_layer * sum(sends.values())
            assert all(r.sent_bytes == block for r in sent)  # fp32 K,V and fp32 dK,dV blocks alike
            assert sum(r.recv_bytes for r in step if r.op == "recv") == len(sent) * block
    gqa = ring_kv_bytes(S, rows, ROPE_GQA.kv_heads, ROPE_GQA.head_dim, cp, 4)
    assert gqa * ROPE_GQA.n_head // ROPE_GQA.kv_heads == block  # GQA circulates n_kv heads: n_head/n_kv fewer bytes
    first = suite(cp)[0]["train"]["adamw_rope_gqa"].step_comm[0]
    assert {r.sent_bytes for r in first if r.op == "send"} == {gqa}


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_comm_is_modelled_ring_bytes(cp):
    gqa = ring_kv_bytes(S, SGD.global_batch, ROPE_GQA.kv_heads, ROPE_GQA.head_dim, cp, 4)
    step = suite(cp)[0]["train"]["sgd_allgather"].step_comm[0]
    gathers = [r for r in step if r.op == "all_gather"]
    scatters = [r for r in step if r.op == "reduce_scatter"]
    assert len(gathers) == len(scatters) == ROPE_GQA.n_layer
    assert all(r.tensor_bytes == cp * gqa and r.sent_bytes == (cp - 1) * gqa for r in gathers + scatters)
    assert not [r for r in step if r.op == "send"]


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_training_work_per_rank(cp):
    for layout, key in (("zigzag", "sgd_zigzag"), ("contiguous", "sgd_contiguous")):
        per_rank = [r["train"][key].pairs for r in suite(cp)]
        # per step: forward of every layer on this rank's queries (backward reuses the plan)
        expected = [CFG.n_layer * p for p in ca.causal_pairs(S, cp, layout)]
        assert [p[0] for p in per_rank] == expected


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_activation_memory_per_rank_measured_equals_predicted(cp, pos):
    cfg = MEM_CFG if pos == "learned" else MEM_CFG.with_(pos="rope", n_kv_head=2)
    measured = {r["memory"][pos] for r in suite(cp)}
    assert measured == {activation_bytes_per_rank(cfg, 2, cfg.seq_len, cp)}  # exact, every rank
    one = sum(model_activation_bytes(cfg, 2, cfg.seq_len, formula="adapted", element_bytes=4).values())
    assert abs(measured.pop() * cp / one - 1) < 0.1  # within 10 % of 1/cp of the plain GPT on one process


# ----------------------------------------------------------------------------------------------------------------
# Bad inputs on ranks


def _cp_model(cfg, **options) -> GPT:
    model = GPT(cfg)
    apply_cp(model, None, layout="zigzag", **options)
    return model


def _bad_inputs(rank: int, world_size: int) -> list[str]:
    errors = []
    pos = ca.all_positions(8, world_size, "zigzag")
    q, kv = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 4, 8)
    for call in (lambda: ca.ring_attention(q, torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8), pos, 2),
                 lambda: ca.ring_attention(q, kv, kv, pos[:, :2], 2),
                 lambda: ca.ring_attention(q[0], kv, kv, pos, 2),
                 lambda: ParallelConfig(MeshShape(cp=world_size), cp_algorithm="striped"),
                 lambda: _cp_model(CFG)(torch.zeros(1, 5, dtype=torch.long)),
                 lambda: _cp_model(CFG.with_(n_kv_head=1), attend=ulysses_attention)(
                     torch.zeros(1, S // world_size, dtype=torch.long))):
        try:
            call()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_inputs_raise_clear_errors():
    errors = launch(_bad_inputs, 2, timeout=LAUNCH_TIMEOUT)[0]
    assert "share" in errors[0] and "positions must be" in errors[1] and "expected q" in errors[2]
    assert "unknown cp_algorithm" in errors[3] and "equal chunks" in errors[4]
    assert "1 K/V heads do not both divide by 2" in errors[5] and "algorithm='ring'" in errors[5]


def test_mesh_and_group_together_raise():
    """apply_cp takes the cp group only; the data-parallel form that reduces CP's gradients (over dp x cp) refuses
    an ambiguous mesh= with group=."""
    with pytest.raises(ValueError, match="not both"):
        DataParallel(GPT(CFG), mesh=object(), group=object())


# ----------------------------------------------------------------------------------------------------------------
# PyTorch's own ring as a second oracle (private API of torch 2.13: the public ``context_parallel`` needs CUDA)


def _torch_ring(rank: int, world_size: int) -> dict[tuple[bool, str], float]:
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    # the CPU flash kernel, which returns (out, lse); looked up by name: ``torch.ops`` in a function's code makes
    # cloudpickle (which ships this function to the ranks) try to pickle the torch.ops namespace itself
    op = getattr(torch, "ops").aten._scaled_dot_product_flash_attention_for_cpu  # noqa: B009
    q, k, v, _ = _inputs(H)
    diffs = {}
    for causal in (True, False):
        # torch's causal load balancing is head-tail: rank r holds chunks r and 2cp-1-r, our zig-zag
        layout = "zigzag" if causal else "contiguous"
        torch_cp._cp_options.enable_load_balance = causal
        for rotate in ("alltoall", "allgather"):
            torch_cp._cp_options.rotate_method = (torch_cp._RotateMethod.ALL_TO_ALL if rotate == "alltoall"
                                                  else torch_cp._RotateMethod.ALL_GATHER)
            local = [ca.shard_sequence(t, rank, world_size, layout, dim=2) for t in (q, k, v)]
            theirs = torch_cp._templated_ring_attention(torch.distributed.group.WORLD, 2, op, *local,
                                                        is_causal=causal)[0]
            ours = ca.ring_attention(*local, ca.all_positions(S, world_size, layout), ca.chunks_per_rank(layout),
                                     causal)
            diffs[causal, rotate] = float((ours - theirs).abs().max())
    return diffs


@pytest.mark.slow
@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="private API, pinned to torch 2.13")
@pytest.mark.parametrize("cp", [2, 4])
def test_equals_torch_templated_ring_attention(cp):
    for rank_diffs in launch(_torch_ring, cp, timeout=LAUNCH_TIMEOUT):
        assert len(rank_diffs) == 4 and max(rank_diffs.values()) < TOL, rank_diffs
