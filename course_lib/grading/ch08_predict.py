"""Chapter 08, exercise 4 — a mesh's memory and step time, predicted.

``predict_mesh(cfg, degrees, gpu, global_batch, seq_len, micro_batch, zero_stage, efficiency)``: the model-state
bytes per GPU and the step time, checked against the library's planner (``planner.predict``, its time model on
links that cost nothing) within ``MEMORY_RTOL`` and ``TIME_RTOL``, on meshes with pp > 1, cp > 1 and ZeRO-1/2/3.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

from course_lib.estimates import hardware
from course_lib.estimates.memory_budget import GiB
from course_lib.grading.core import (
    CheckFailed,
    CheckResult,
    run_check,
)
from course_lib.model_config import PRESETS, GPTConfig, param_count
from course_lib.planner import search as planner

MEMORY_RTOL = 0.05
"""How far ``model_state_bytes`` may be from the library's estimator: the stated formula spreads every parameter
evenly over tp x pp, the estimator counts the worst pipeline stage exactly (its embedding or head, the norms TP
replicates); on the check's meshes the two differ by at most 3.3 %."""
TIME_RTOL = 0.10
"""How far ``step_s`` may be from the planner's time model on free links: 6 N D leaves out attention's own
FLOPs (12 L h s per token) and counts the embedding, which costs none; the planner times the slowest (last)
stage, head included; on the check's meshes the two differ by at most 7 %."""

IDEAL_LINK = hardware.Link("free", 0.0, float("inf"), "no latency, no bandwidth limit: an idealisation")
"""A link whose messages cost nothing: on it the planner's step time is its compute and its pipeline bubble."""


def _axes(degrees: dict[str, int]) -> tuple[int, int, int, int]:
    return tuple(degrees.get(a, 1) for a in ("tp", "cp", "dp", "pp"))  # type: ignore[return-value]


def predict_mesh_spec(cfg: GPTConfig, degrees: dict[str, int], gpu: planner.GPU, global_batch: int, seq_len: int,
                      micro_batch: int, zero_stage: int, efficiency: float) -> dict[str, float]:
    """The exercise's formulas, as the notebook states them (the grader's statement of the spec, not its judge).

    * Model states per GPU, mixed-precision AdamW (2 bytes bf16 weight + 2 bytes bf16 gradient + 12 bytes fp32
      master weight, m and v per parameter): N = ``param_count(cfg)`` parameters spread evenly over the
      tp x pp ranks of one replica, N / (tp pp) per GPU; ZeRO-k shards over the N_d = dp x cp ranks that hold
      the same shard: the optimizer states from k >= 1, the gradients from k >= 2, the weights at k = 3
      (Rajbhandari et al. 2020, Sec. 5).
    * Step time: 6 N D FLOPs for D = global_batch x seq_len tokens (Kaplan et al. 2020), over G = tp cp dp pp
      GPUs at ``efficiency`` x ``gpu.peak_flops`` each; with m = global_batch / (dp x micro_batch) micro-batches
      per pipeline, 1F1B idles (pp-1)/(m+pp-1) of the step (Narayanan et al. 2021), so
      step = 6 N D / (G peak efficiency) x (m + pp - 1) / m.
    """
    tp, cp, dp, pp = _axes(degrees)
    n, n_d = param_count(cfg), dp * cp
    per_gpu = n / (tp * pp)
    shard = [n_d if zero_stage >= k else 1 for k in (3, 2, 1)]  # weights, gradients, optimizer states
    state = per_gpu * (2 / shard[0] + 2 / shard[1] + 12 / shard[2])
    m = global_batch // (dp * micro_batch)
    ideal = 6 * n * global_batch * seq_len / (tp * cp * dp * pp * gpu.peak_flops * efficiency)
    return {"model_state_bytes": state, "step_s": ideal * (m + pp - 1) / m}


def library_prediction(cfg: GPTConfig, degrees: dict[str, int], gpu: planner.GPU, global_batch: int, seq_len: int,
                       micro_batch: int, zero_stage: int, efficiency: float) -> dict[str, float]:
    """What the library predicts for the same mesh: ``planner.predict`` of the candidate (no recomputation) on a
    cluster of ``IDEAL_LINK`` s, matrix multiplies and attention at ``efficiency`` whatever their size or length, no
    memory-bound kernels; model states are the
    parameters + gradients + optimizer state of its ``memory.training_memory`` budget (worst stage), the step
    is its ``step_s`` (compute and the 1F1B bubble: nothing else costs time on free links)."""
    tp, cp, dp, pp = _axes(degrees)
    cand = planner.Candidate(dp=dp, tp=tp, pp=pp, cp=cp, zero_stage=zero_stage, micro_batch=micro_batch,
                             recompute="none")
    cl = planner.Cluster("free links", 1, tp * cp * dp * pp, gpu, IDEAL_LINK, IDEAL_LINK)
    assume = planner.Assumptions(efficiency=efficiency, gemm_rows_half=0.0, gemm_cols_half=0.0,
                                 attention_efficiency=efficiency, attention_by_length=False, elementwise_passes=0.0)
    pred = planner.predict(cfg, cl, global_batch, seq_len, cand, assume)
    states = pred.memory["parameters"] + pred.memory["gradients"] + pred.memory["optimizer_state"]
    return {"model_state_bytes": states, "step_s": pred.step_s}


PREDICT_KEYS = ("model_state_bytes", "step_s")
# (preset, degrees, gpu, global batch, sequence, micro-batch, ZeRO stage, efficiency)
PREDICT_CASES = (
    ("llama2-70b", {"dp": 8, "tp": 8}, planner.H100, 512, 2048, 1, 1, 0.5),           # no pipeline
    ("llama2-70b", {"dp": 2, "tp": 8, "pp": 4}, planner.H100, 16, 2048, 1, 1, 0.5),   # m = 8: bubble 3/11
    ("llama2-7b", {"dp": 16}, planner.H100, 64, 1024, 1, 3, 0.5),                     # ZeRO-3 divides all by 16
    ("llama2-70b", {"dp": 4, "cp": 2, "tp": 8}, planner.H100, 64, 2048, 1, 1, 0.5),   # ZeRO over dp x cp = 8
    ("gpt3-175b", {"dp": 4, "tp": 8, "pp": 8}, planner.H100, 64, 2048, 2, 2, 0.5),    # m = 8, pp = 8: bubble 7/15
    ("llama3-70b", {"dp": 8, "tp": 8, "pp": 2}, planner.A100, 64, 4096, 1, 1, 0.35),  # another GPU, efficiency
)


def _describe_case(name: str, degrees: dict[str, int], gpu: planner.GPU, gb: int, s: int, mb: int, zero: int,
                   eff: float) -> str:
    mesh = " ".join(f"{a}={v}" for a, v in degrees.items())
    return (f"{name}, {mesh}, ZeRO-{zero}, {gpu.name} at {eff:.0%}, global batch {gb} x {s} tokens, "
            f"micro-batch {mb}")


def check_predict_mesh(fn: Callable, cases: tuple = PREDICT_CASES) -> CheckResult:
    def body() -> str:
        worst = dict.fromkeys(PREDICT_KEYS, 0.0)
        for name, degrees, gpu, gb, s, mb, zero, eff in cases:
            cfg, what = PRESETS[name], _describe_case(name, degrees, gpu, gb, s, mb, zero, eff)
            got = fn(cfg, dict(degrees), gpu, gb, s, mb, zero, eff)
            if not isinstance(got, dict) or set(got) != set(PREDICT_KEYS):
                raise CheckFailed(f"{what}: predict_mesh must return a dict with exactly the keys "
                                  f"{list(PREDICT_KEYS)}, got {got!r}")
            want = library_prediction(cfg, degrees, gpu, gb, s, mb, zero, eff)
            for key, rtol in (("model_state_bytes", MEMORY_RTOL), ("step_s", TIME_RTOL)):
                value = got[key]
                if isinstance(value, bool) or not isinstance(value, numbers.Real) or value <= 0:
                    raise CheckFailed(f"{what}: {key} must be a positive Python number, got {value!r}")
                ratio = value / want[key]
                if abs(ratio - 1) > rtol:
                    unit = (lambda v: f"{v / GiB:.3g} GiB") if key == "model_state_bytes" else (lambda v: f"{v:.3g} s")
                    raise CheckFailed(f"{what}: {key} expected about {unit(want[key])} (the library's estimate, "
                                      f"within {rtol:.0%}), got {unit(value)}, {ratio:.3g} x that")
                worst[key] = max(worst[key], abs(ratio - 1))
        return (f"{len(cases)} meshes: memory within {worst['model_state_bytes']:.1%}, step time within "
                f"{worst['step_s']:.1%} of the library's estimate")
    return run_check("predict_mesh", body)
