"""Chapter 05 — pipeline parallelism.

1. ``gpipe_bubble_fraction(p, m)``: idle fraction of a GPipe / 1F1B pipeline, (p-1)/(m+p-1) (Huang et al. 2019).
2. ``one_f_one_b_order(p, m, rank)``: the compute actions of one rank under 1F1B (PipeDream-flush, Narayanan et al.
   2021), as strings "F3" / "B3", checked against ``course_lib.schedules.one_f_one_b``.
3. ``microbatch_gradients(model, x, y, m)``: gradients of the full-batch mean loss computed by accumulating over m
   micro-batches — each micro-batch loss scaled by 1/m (a common bug: gradients m x too large).
"""

from __future__ import annotations

from collections.abc import Callable

from course_lib import cost, schedules
from course_lib.data import global_batch
from course_lib.grading.core import CheckFailed, CheckResult, Exercise, expect_close, expect_number, run_check
from course_lib.model import GPT, GPTConfig, lm_loss

GRADER_PARAMETERS = {"seed": 1}


def check_gpipe_bubble_fraction(fn: Callable, cases: tuple[tuple[int, int], ...] = ((4, 8), (2, 1))) -> CheckResult:
    def body() -> str:
        for p, m in cases:
            expect_number(fn(p, m), cost.bubble_fraction("gpipe", p, m), f"gpipe_bubble_fraction(p={p}, m={m})")
        return f"{len(cases)} cases correct"
    return run_check("gpipe_bubble_fraction", body)


def check_one_f_one_b_order(fn: Callable, p: int = 4, m: int = 8) -> CheckResult:
    def body() -> str:
        for rank in range(p):
            expected = [f"{a.kind.value}{a.microbatch}" for a in schedules.one_f_one_b(p, m)[rank] if a.is_compute]
            got = fn(p, m, rank)
            if not isinstance(got, list) or not all(isinstance(a, str) for a in got):
                raise CheckFailed(f"one_f_one_b_order({p}, {m}, {rank}) must return a list of strings, got {got!r}")
            if got != expected:
                i = next((i for i, (g, e) in enumerate(zip(got, expected, strict=False)) if g != e),
                         min(len(got), len(expected)))
                raise CheckFailed(f"rank {rank} of p={p}, m={m}: first difference at position {i}: expected "
                                  f"{expected[i:i + 3]}..., got {got[i:i + 3]}... (expected {len(expected)} actions, "
                                  f"got {len(got)})")
        return f"all {p} ranks correct for p={p}, m={m}"
    return run_check("one_f_one_b_order", body)


def check_microbatch_gradients(fn: Callable, m: int = 4, batch: int = 8, seed: int = 0) -> CheckResult:
    def body() -> str:
        cfg = GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16)
        x, y = global_batch(seed, batch, cfg.seq_len, seed)
        reference = GPT(cfg, seed=seed)
        lm_loss(reference(x), y).backward()
        model = GPT(cfg, seed=seed)
        fn(model, x, y, m)
        for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            if p.grad is None:
                raise CheckFailed(f"{name}.grad is None after microbatch_gradients")
            expect_close(p.grad, ref.grad, f"gradient of {name} (m={m}, batch={batch})", rtol=1e-4, atol=1e-6)
        return f"gradients equal the full-batch gradients (m={m}, batch={batch})"
    return run_check("microbatch_gradients", body)


EXERCISES = [
    Exercise("gpipe_bubble_fraction", "Bubble fraction of GPipe / 1F1B", 2, "gpipe_bubble_fraction",
             check_gpipe_bubble_fraction,
             hidden=[{"cases": tuple((p, m) for p in (1, 2, 3, 8) for m in (1, 3, 4, 32))}]),
    Exercise("one_f_one_b_order", "1F1B action list for one rank", 4, "one_f_one_b_order", check_one_f_one_b_order,
             hidden=[{"p": 2, "m": 2}, {"p": 3, "m": 7}, {"p": 4, "m": 4}, {"p": 5, "m": 3}]),
    Exercise("microbatch_gradients", "Gradient accumulation over micro-batches", 3, "microbatch_gradients",
             check_microbatch_gradients,
             hidden=[{"m": 2, "batch": 6, "seed": 1}, {"m": 1, "batch": 4, "seed": 2},
                     {"m": 8, "batch": 8, "seed": 3}]),
]
