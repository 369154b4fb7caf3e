"""Nonsense input to the estimators and the model config is refused with the field's name and what is allowed
(before: seq_len=0 silently meant the default, micro_batch=-1 gave a negative total, tp=0 a ZeroDivisionError,
pos="alibi" a model with no positional information, mlp="relu" / norm="batchnorm" silently replaced)."""

from __future__ import annotations

import numpy as np
import pytest

from course_lib.estimates.activation_memory import (
    activation_bytes_paper,
    layer_activation_bytes,
    model_activation_bytes,
)
from course_lib.estimates.memory import inference_memory, kv_cache_bytes, training_memory
from course_lib.estimates.memory_budget import format_bytes
from course_lib.estimates.model_states import weight_bytes, zero_memory_per_device
from course_lib.model_config import GPTConfig


@pytest.mark.parametrize("call, message", [
    (lambda: training_memory("tiny", seq_len=0), "seq_len must be an int >= 1 (or None: the config's seq_len)"),
    (lambda: training_memory("tiny", micro_batch=-1), "micro_batch must be an int >= 1, got -1"),
    (lambda: training_memory("tiny", micro_batch=1.5), "micro_batch must be an int >= 1, got 1.5"),
    (lambda: training_memory("tiny", headroom=-0.1), "headroom must be a number >= 0, got -0.1"),
    (lambda: training_memory("tiny", bucket_bytes=float("nan")), "bucket_bytes must be a number >= 0, got nan"),
    (lambda: inference_memory("tiny", context_len=0), "context_len must be an int >= 1"),
    (lambda: inference_memory("tiny", prefill_chunk=0), "prefill_chunk must be an int >= 1 (or None: the whole"),
    (lambda: inference_memory("tiny", batch=0), "batch must be an int >= 1, got 0"),
    (lambda: inference_memory("tiny", kv_bytes=0), "kv_bytes must be a number > 0, got 0"),
    (lambda: kv_cache_bytes("tiny", 10, tp=0), "tp must be an int >= 1, got 0"),
    (lambda: kv_cache_bytes("tiny", -10), "tokens must be an int >= 0, got -10"),
    (lambda: layer_activation_bytes("tiny", 1, 32, tp=0), "tp must be an int >= 1, got 0"),
    (lambda: layer_activation_bytes("tiny", 1, 0), "seq_len must be an int >= 1, got 0"),
    (lambda: model_activation_bytes("tiny", 1, 0), "seq_len must be an int >= 1"),
    (lambda: model_activation_bytes("tiny", 0), "micro_batch must be an int >= 1, got 0"),
    (lambda: activation_bytes_paper(32, 1, 64, 4, t=0), "t must be an int >= 1, got 0"),
    (lambda: activation_bytes_paper(32, 1, 0, 4), "h must be an int >= 1, got 0"),
    (lambda: zero_memory_per_device(-1), "psi must be a number >= 0, got -1"),
    (lambda: weight_bytes(7e9, 0), "bytes_per_weight must be a number > 0, got 0"),
    (lambda: format_bytes(1, "XB"), "unit must be one of B, kB, MB, GB, TB, KiB, MiB, GiB"),
])
def test_estimators_refuse_nonsense_by_name(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)


def test_sensible_edge_values_and_numpy_ints_are_accepted():
    assert kv_cache_bytes("tiny", 0) == 0  # an empty cache
    assert kv_cache_bytes("tiny", np.int64(10), tp=np.int64(2)) == kv_cache_bytes("tiny", 10, tp=2)
    assert training_memory("tiny", headroom=0).total > 0
    assert training_memory("tiny", seq_len=None).total == training_memory("tiny", seq_len=32).total
    assert model_activation_bytes("tiny", 1, n_layers=0)["layers"] == 0


@pytest.mark.parametrize("field, value, allowed", [
    ("pos", "alibi", "'learned', 'rope'"),
    ("mlp", "relu", "'gelu', 'swiglu'"),
    ("norm", "batchnorm", "'layernorm', 'rmsnorm'"),
    ("router", "topk", "'softmax', 'sigmoid'"),
])
def test_config_choices_are_never_silently_replaced(field, value, allowed):
    with pytest.raises(ValueError, match=f"{field} must be one of {allowed}, got '{value}'"):
        GPTConfig(**{field: value})


@pytest.mark.parametrize("changes, message", [
    ({"n_layer": 2.5}, "n_layer must be a positive int, got 2.5"),
    ({"d_model": True}, "d_model must be a positive int, got True"),
    ({"seq_len": 0}, "seq_len must be a positive int, got 0"),
    ({"n_expert": -1}, r"n_expert must be an int >= 0 \(0: a dense MLP\), got -1"),
])
def test_config_sizes_must_be_ints_of_the_right_range(changes, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**changes)
