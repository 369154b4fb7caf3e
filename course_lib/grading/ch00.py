"""Chapter 00 — memory budgets by hand.

1. ``param_state_bytes(precision, optimizer)``: bytes per parameter of weights, gradients and optimizer state.
2. ``zero_bytes_per_device(psi, n_d, stage, k)``: model-state bytes per GPU under ZeRO (Rajbhandari et al. 2020).
3. ``kv_cache_bytes(n_layer, n_kv_head, head_dim, tokens, batch, bytes_per_value)``: the serving KV cache.
"""

from __future__ import annotations

from collections.abc import Callable

from course_lib import memory
from course_lib.grading.core import CheckFailed, CheckResult, Exercise, expect_equal, expect_number, run_check

GRADER_PARAMETERS = {"seed": 1}


def check_param_state_bytes(fn: Callable, cases: tuple[tuple[str, str], ...] = (("mixed", "adamw"),
                                                                               ("fp32", "sgd"))) -> CheckResult:
    def body() -> str:
        for precision, optimizer in cases:
            ref = memory.bytes_per_param(precision, optimizer)
            got = fn(precision, optimizer)
            if not isinstance(got, tuple) or len(got) != 3:
                raise CheckFailed(f"param_state_bytes({precision!r}, {optimizer!r}) must return a tuple "
                                  f"(weights, gradients, optimizer_state), got {got!r}")
            for part, g, e in zip(("weights", "gradients", "optimizer state"), got,
                                  (ref.params, ref.grads, ref.optimizer), strict=True):
                expect_equal(g, e, f"{part} bytes for precision={precision!r}, optimizer={optimizer!r}")
        return f"{len(cases)} precision/optimizer pairs correct"
    return run_check("param_state_bytes", body)


def check_zero_bytes_per_device(fn: Callable, cases: tuple[tuple[float, int, int, float], ...] = (
        (7.5e9, 64, 0, 12), (7.5e9, 64, 1, 12), (7.5e9, 64, 2, 12), (7.5e9, 64, 3, 12))) -> CheckResult:
    def body() -> str:
        for psi, n_d, stage, k in cases:
            expect_number(fn(psi, n_d, stage, k), memory.zero_memory_per_device(psi, k, n_d, stage),
                          f"zero_bytes_per_device(psi={psi:g}, n_d={n_d}, stage={stage}, k={k})", rel=1e-6)
        return f"{len(cases)} cases correct (ZeRO paper, Figure 1)"
    return run_check("zero_bytes_per_device", body)


def check_kv_cache_bytes(fn: Callable, cases: tuple[tuple[int, int, int, int, int, int], ...] = (
        (80, 8, 128, 4096, 1, 2),)) -> CheckResult:
    def body() -> str:
        for n_layer, n_kv, d_head, tokens, batch, nbytes in cases:
            expected = 2 * n_layer * n_kv * d_head * nbytes * tokens * batch
            expect_number(fn(n_layer, n_kv, d_head, tokens, batch, nbytes), expected,
                          f"kv_cache_bytes({n_layer}, {n_kv}, {d_head}, {tokens}, {batch}, {nbytes})")
        return f"{len(cases)} cases correct"
    return run_check("kv_cache_bytes", body)


EXERCISES = [
    Exercise("param_state_bytes", "Bytes per parameter by precision and optimizer", 2, "param_state_bytes",
             check_param_state_bytes,
             hidden=[{"cases": tuple((p, o) for p in ("fp32", "bf16", "mixed")
                                     for o in ("sgd", "sgd_momentum", "adamw"))}]),
    Exercise("zero_bytes_per_device", "ZeRO model states per device", 3, "zero_bytes_per_device",
             check_zero_bytes_per_device,
             hidden=[{"cases": tuple((1e9, 8, s, 12) for s in range(4))},
                     {"cases": tuple((70e9, n, s, k) for n in (1, 3, 1024) for s in range(4) for k in (12, 16))}]),
    Exercise("kv_cache_bytes", "KV cache of a served model", 2, "kv_cache_bytes", check_kv_cache_bytes,
             hidden=[{"cases": ((32, 32, 128, 2048, 8, 2), (32, 8, 128, 32768, 3, 1), (1, 1, 1, 1, 1, 4))}]),
]
