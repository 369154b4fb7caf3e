"""Tensor x context parallelism with GQA sends the K/V heads around the ring, not the query heads.

The ring's K,V block of a TP rank holds the K/V heads its query heads read (``accounting.ring_kv_bytes_tp``,
what the planner prices): n_kv / t of them when t divides n_kv, one when K/V are replicated. Before the fix the
TP attention expanded K/V to its query heads before the ring and sent n_head / n_kv times the bytes. Measured
here from the comm log on 4 ranks (tp 2 x cp 2), every send of the ring, forward and backward, at both a
divisible and a replicated K/V split, and the run matches one process.
"""

from __future__ import annotations

import functools

import pytest

from course_lib.estimates.accounting import ring_kv_bytes_tp
from course_lib.model_config import GPTConfig
from course_lib.parallel import runs
from course_lib.parallel.config import ParallelConfig
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import MeshShape
from course_lib.train import TrainConfig, compare, train_baseline

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

S = 16
SGD = TrainConfig(steps=1, global_batch=4, optimizer="sgd", lr=0.05)
CASES = {"kv split over tp": GPTConfig(n_layer=2, d_model=64, n_head=8, n_kv_head=4, seq_len=S, bias=False),
         "kv replicated": GPTConfig(n_layer=2, d_model=64, n_head=8, n_kv_head=1, seq_len=S, bias=False)}


@functools.cache
def _run(name: str) -> list:
    return launch(runs.train_parallel, 4, CASES[name], SGD, ParallelConfig(MeshShape(tp=2, cp=2)), timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_the_ring_sends_the_kv_heads_of_each_tp_rank(name: str):
    cfg = CASES[name]
    block = ring_kv_bytes_tp(cfg, S, SGD.global_batch, tp=2, cp=2, element_size=4)
    query_heads = ring_kv_bytes_tp(cfg.with_(n_kv_head=cfg.n_head), S, SGD.global_batch, 2, 2, 4)
    assert block < query_heads  # GQA: the expanded heads would be n_head / n_kv times the bytes
    for result in _run(name):
        sends = [r for r in result.step_comm[0] if r.op == "send" and r.group == "cp"]
        assert sends, "no ring send on the cp group"
        assert {r.sent_bytes for r in sends} == {block}, (name, sorted({r.sent_bytes for r in sends}), block)


@pytest.mark.parity
@pytest.mark.parametrize("name", list(CASES))
def test_tp_x_cp_with_gqa_matches_one_process(name: str):
    report = compare(train_baseline(CASES[name], SGD), runs.merge_composed(_run(name)))
    assert report.ok, report
