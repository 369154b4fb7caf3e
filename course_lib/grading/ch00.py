"""Chapter 00 — memory budgets by hand: formulas and a search, checked against exact values.

1. ``param_state_bytes(precision, optimizer)``: bytes per parameter of weights, gradients and optimizer state,
   each a Python int; checked for the text's precisions and optimizers.
2. ``zero_bytes_per_device(psi, n_d, stage, k)``: model-state bytes per GPU under ZeRO stages 0-3; checked against
   the ZeRO paper's Figure 1 (Rajbhandari et al. 2020) and other sizes, K and N_d.
3. ``kv_cache_bytes(n_layer, n_kv_head, head_dim, tokens, batch, bytes_per_value)``: the serving KV cache, a Python
   int; checked on real models' shapes, GQA included.
4. ``fewest_gpus(model, gpu, seq_len)``: ``(n_gpus, layout)``; the layout must lie in the text's search space, use
   n_gpus GPUs and fit (the check recomputes its budget with the text's call), and no smaller cluster may fit.
5. ``model_states_per_gpu(psi, tp, pp, dp, zero, k)`` (find the bug): bytes per GPU by category, within 1e-6 of
   the expected ones, on layouts with and without tensor and pipeline parallelism.
"""

from __future__ import annotations

from collections.abc import Callable

from course_lib.estimates.hardware import GPUS
from course_lib.estimates.layout import ParallelLayout
from course_lib.estimates.memory import training_memory
from course_lib.estimates.memory_budget import GB, MemoryBudget
from course_lib.estimates.model_states import bytes_per_param, zero_memory_per_device
from course_lib.grading.cases import each, several
from course_lib.grading.core import (
    CheckFailed,
    CheckResult,
    Exercise,
    expect_int,
    expect_number,
    guard_visible_checks,
    run_check,
)

GRADER_PARAMETERS = {"seed": 1}


def check_param_state_bytes(fn: Callable, cases: tuple[tuple[str, str], ...] = (
        ("mixed", "adamw"), ("fp32", "sgd"), ("bf16", "sgd_momentum"))) -> CheckResult:
    def body() -> str:
        for precision, optimizer in cases:
            ref = bytes_per_param(precision, optimizer)
            got = fn(precision, optimizer)
            if not isinstance(got, tuple) or len(got) != 3:
                raise CheckFailed(f"param_state_bytes({precision!r}, {optimizer!r}) must return a tuple "
                                  f"(weights, gradients, optimizer_state), got {got!r}")
            for part, g, e in zip(("weights", "gradients", "optimizer state"), got,
                                  (ref.params, ref.grads, ref.optimizer), strict=True):
                expect_int(g, int(e), f"{part} bytes for precision={precision!r}, optimizer={optimizer!r}")
        return f"{len(cases)} precision/optimizer pairs correct"
    return run_check("param_state_bytes", body)


def check_zero_bytes_per_device(fn: Callable, cases: tuple[tuple[float, int, int, float], ...] = (
        (7.5e9, 64, 0, 12), (7.5e9, 64, 1, 12), (7.5e9, 64, 2, 12), (7.5e9, 64, 3, 12), (70e9, 1, 2, 16))
        ) -> CheckResult:
    def body() -> str:
        for psi, n_d, stage, k in cases:
            expect_number(fn(psi, n_d, stage, k), zero_memory_per_device(psi, k, n_d, stage),
                          f"zero_bytes_per_device(psi={psi:g}, n_d={n_d}, stage={stage}, k={k})", rel=1e-6)
        return f"{len(cases)} cases correct (ZeRO paper, Figure 1)"
    return run_check("zero_bytes_per_device", body)


def check_kv_cache_bytes(fn: Callable, cases: tuple[tuple[int, int, int, int, int, int], ...] = (
        (80, 8, 128, 4096, 1, 2), (16, 4, 64, 1000, 3, 1), (2, 1, 32, 10, 5, 4))) -> CheckResult:
    def body() -> str:
        for n_layer, n_kv, d_head, tokens, batch, nbytes in cases:
            expected = 2 * n_layer * n_kv * d_head * nbytes * tokens * batch
            expect_int(fn(n_layer, n_kv, d_head, tokens, batch, nbytes), expected,
                       f"kv_cache_bytes({n_layer}, {n_kv}, {d_head}, {tokens}, {batch}, {nbytes})")
        return f"{len(cases)} cases correct"
    return run_check("kv_cache_bytes", body)


TPS, PPS, DPS = (1, 2, 4, 8), (1, 2, 4, 8, 16), tuple(2 ** k for k in range(11))
"""The search space of ``fewest_gpus``: TP inside a node of 8, PP dividing 80 layers, DP a power of two <= 1024."""


def fewest_budget(model: str, layout: dict, seq_len: int) -> MemoryBudget:
    """The budget ``fewest_gpus`` must use for a layout ``{"tp": t, "pp": p, "dp": d}``."""
    return training_memory(model, micro_batch=1, seq_len=seq_len, recompute="full",
                           layout=ParallelLayout(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"],
                                                 zero_stage=3, sp=layout["tp"] > 1))


def reference_fewest(model: str, gpu: str, seq_len: int, cap: float | None = None) -> int:
    """The fewest GPUs over the search space (brute force); ``cap``: bytes per GPU (default the card's)."""
    cap = GPUS[gpu].gb * GB if cap is None else cap
    sizes = [t * p * d for t in TPS for p in PPS for d in DPS
             if fewest_budget(model, {"tp": t, "pp": p, "dp": d}, seq_len).total <= cap]
    if not sizes:
        raise ValueError(f"{model} at {seq_len} tokens fits no layout of the search space on {gpu}")
    return min(sizes)


def check_fewest_gpus(fn: Callable, cases: tuple[tuple[str, str, int], ...] = (
        ("llama3-70b", "H100 80GB", 8192), ("llama3-8b", "A100 40GB", 8192), ("llama3-8b", "H200 141GB", 4096))
        ) -> CheckResult:
    """``fn(model, gpu, seq_len)`` returns ``(n_gpus, {"tp": t, "pp": p, "dp": d})``: an int, a layout of the
    search space with t x p x d = n_gpus whose budget fits the GPU, and no smaller one fits."""
    def body() -> str:
        found = []
        for model, gpu, seq_len in cases:
            what = f"fewest_gpus({model!r}, {gpu!r}, {seq_len})"
            got = fn(model, gpu, seq_len)
            if (not isinstance(got, tuple) or len(got) != 2 or isinstance(got[0], bool) or not isinstance(got[0], int)
                    or not isinstance(got[1], dict) or set(got[1]) != {"tp", "pp", "dp"}):
                raise CheckFailed(f"{what} must return (n_gpus as an int, {{'tp': t, 'pp': p, 'dp': d}}), got {got!r}")
            n, layout = got
            t, p, d = layout["tp"], layout["pp"], layout["dp"]
            if t not in TPS or p not in PPS or d not in DPS:
                raise CheckFailed(f"{what}: layout {layout} is outside the search space (tp in {TPS}, pp in {PPS}, "
                                  "dp a power of two up to 1024)")
            if t * p * d != n:
                raise CheckFailed(f"{what}: returned {n} GPUs but the layout {layout} uses tp x pp x dp = {t * p * d}")
            need, cap = fewest_budget(model, layout, seq_len).total, GPUS[gpu].gb * GB
            if need > cap:
                raise CheckFailed(f"{what}: layout {layout} needs {need / GB:.2f} GB per GPU, more than the "
                                  f"{cap / GB:.2f} GB of a {gpu}")
            best = reference_fewest(model, gpu, seq_len)
            if n != best:
                raise CheckFailed(f"{what}: {n} GPUs fit, but a layout of {best} GPUs fits too: search every (tp, pp, "
                                  "dp) and keep the smallest product")
            found.append(f"{model} on {n} x {gpu}")
        return "; ".join(found)
    return run_check("fewest_gpus", body)


STATE_CATEGORIES = ("parameters", "gradients", "optimizer_state")


def reference_model_states(psi: float, tp: int, pp: int, dp: int, zero: int, k: float = 12) -> dict[str, float]:
    """Model-state bytes on one GPU of a TP x PP x DP layout: TP and PP give each GPU of a replica ``psi / (tp pp)``
    parameters (an even split); ZeRO stage ``zero`` shards them over the ``dp`` replicas only, with the ZeRO paper's
    per-category rule (weights 2, gradients 2, optimizer K bytes a parameter; Rajbhandari et al. 2020, Fig. 1)."""
    local = psi / (tp * pp)
    return {"parameters": 2 * local / (dp if zero >= 3 else 1),
            "gradients": 2 * local / (dp if zero >= 2 else 1),
            "optimizer_state": k * local / (dp if zero >= 1 else 1)}


def check_model_states_per_gpu(fn: Callable, cases: tuple[tuple[float, int, int, int, int, float], ...] = (
        (7.5e9, 1, 1, 64, 3, 12), (70e9, 8, 4, 2, 1, 12), (70e9, 4, 2, 8, 3, 12), (13e9, 2, 1, 4, 0, 16),
        (70e9, 8, 8, 1, 2, 12))) -> CheckResult:
    """``fn(psi, tp, pp, dp, zero, k)`` returns ``{"parameters", "gradients", "optimizer_state"}`` in bytes per GPU,
    each a plain number within 1e-6 of :func:`reference_model_states`."""
    def body() -> str:
        for psi, tp, pp, dp, zero, k in cases:
            what = f"model_states_per_gpu(psi={psi:g}, tp={tp}, pp={pp}, dp={dp}, zero={zero}, k={k})"
            got = fn(psi, tp, pp, dp, zero, k)
            if not isinstance(got, dict) or set(got) != set(STATE_CATEGORIES):
                raise CheckFailed(f"{what} must return a dict with exactly the keys {list(STATE_CATEGORIES)}, "
                                  f"got {got!r}")
            expected = reference_model_states(psi, tp, pp, dp, zero, k)
            for cat in STATE_CATEGORIES:
                expect_number(got[cat], expected[cat], f"{what}[{cat!r}]", rel=1e-6)
        return f"{len(cases)} layouts correct"
    return run_check("model_states_per_gpu", body)


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
    Exercise("fewest_gpus", "The fewest GPUs that train a model", 3, "fewest_gpus", check_fewest_gpus,
             hidden=[{"cases": (("llama2-7b", "RTX 4090 24GB", 4096), ("llama2-70b", "H200 141GB", 4096),
                                ("llama3-70b", "A100 40GB", 8192), ("llama3-8b", "H200 141GB", 2048))}],
             allowed=("course_lib.estimates.memory.training_memory", "course_lib.estimates.memory_budget.MemoryBudget",
                      "course_lib.estimates.memory_budget.GB", "course_lib.estimates.layout.ParallelLayout",
                      "course_lib.estimates.hardware.GPUS", "course_lib.estimates.hardware.GPU")),
    Exercise("model_states_per_gpu", "Find the bug: model states on a TP x PP x DP layout", 2,
             "model_states_per_gpu", check_model_states_per_gpu,
             hidden=[{"cases": tuple((1e9, 2, 1, 4, z, 12) for z in range(4))},
                     {"cases": tuple((70e9, 1, 8, 8, z, 16) for z in range(4))},
                     {"cases": ((13e9, 8, 1, 1, 3, 12), (405e9, 8, 16, 1, 0, 12), (175e9, 8, 8, 16, 2, 12))}]),
]

def _fewest_classes(calls: list[dict]) -> set[str]:
    out = several((c[2] for c in each(calls)), "sequence lengths") | several((c[1] for c in each(calls)), "GPUs")
    for model, gpu, seq in each(calls):
        best = reference_fewest(model, gpu, seq)
        out.add("one GPU is enough" if best == 1 else "several GPUs")
        if reference_fewest(model, gpu, seq, cap=GPUS[gpu].nominal_gib * GB) != best:
            out.add("the card's GiB, not 10^9 bytes, decide")
        if reference_fewest(model, gpu, 4096 if seq == 8192 else 8192) != best:
            out.add("the sequence length decides")
    return out


def _stages(calls: list[dict], stage: int, n_d: int, k: int) -> set[str]:
    """ZeRO's classes: each stage, one data-parallel rank, K other than 12."""
    cases = each(calls)
    return {f"ZeRO stage {c[stage]}" for c in cases} | {"one data-parallel rank" for c in cases if c[n_d] == 1} \
        | {"K other than 12" for c in cases if c[k] != 12}


CASE_CLASSES = {
    "param_state_bytes": lambda calls: {f"{what} {v}" for c in each(calls)
                                        for what, v in zip(("precision", "optimizer"), c, strict=True)},
    "zero_bytes_per_device": lambda calls: _stages(calls, 2, 1, 3),
    "kv_cache_bytes": lambda calls: {f"{c[5]}-byte values" for c in each(calls)}
    | {"a batch of several sequences" for c in each(calls) if c[4] > 1},
    "fewest_gpus": _fewest_classes,
    "model_states_per_gpu": lambda calls: _stages(calls, 4, 3, 5)
    | {f"{axis} > 1" for c in each(calls) for axis, v in (("tp", c[1]), ("pp", c[2])) if v > 1},
}

guard_visible_checks(globals(), EXERCISES)
