"""Bytes across nodes and model-state memory of composed runs on fake nodes (``node = rank // gpus_per_node``).

DP 2 x TP 2 on two nodes of two ranks, under Megatron's order "tp-cp-ep-dp-pp" (TP pairs inside a node, DP across)
and under "dp-tp-cp-ep-pp" (DP pairs inside, TP across), with the data-parallel sync on our own ring: the
cross-node bytes read from the comm log equal the prediction from the mesh arithmetic exactly -- measured for the
ring's isend/irecv, the ring model for TP's backend collectives -- and keeping TP inside a node sends fewer bytes
across. Mutations (an off-by-one node map, the log read with the wrong order, groups built in the wrong order)
fail. A pipeline of 4 and the 2 x 2 x 2 DP x TP x PP run: PP's measured sends across nodes equal the prediction.
On every rank of these runs, the estimator's model states (what the planner prunes by) equal the tracker's within
2 % -- parameters and gradients to the byte -- for the stage that rank trains.
"""

from __future__ import annotations

import dataclasses

import pytest

from course_lib import comm
from course_lib.estimates.layout import ParallelLayout, params_per_rank
from course_lib.measure.topology import (
    Flow,
    busiest_rank_bytes,
    bytes_kinds,
    cross_node_bytes,
    cross_node_table,
    flows_from_log,
    group_members,
    node_of,
    nodes,
    predicted_flows,
    record_flows,
    ring_data_parallel,
)
from course_lib.model import GPT
from course_lib.parallel import compose as C
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.runs import merge_composed
from course_lib.planner.memcheck import check_run, format_checks, model_state_check, train_tracked
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import Mesh, MeshShape
from course_lib.train import PARITY_MODEL, TrainConfig, compare, train_baseline

CFG = PARITY_MODEL.with_(seq_len=32, n_layer=2, d_model=32)  # fp32, no biases: parity at 1e-5
TC = TrainConfig(steps=2, global_batch=8, optimizer="adamw", lr=1e-3, seed=0)
GPN, DP, TP = 2, 2, 2  # two nodes of two "GPUs"
TP_FIRST, DP_FIRST = "tp-cp-ep-dp-pp", "dp-tp-cp-ep-pp"


RING_STEPS = C.with_step(C.STEPS, C.data_parallel, ring_data_parallel)  # the gradient sync on our own ring


def run(order: str, **kwargs) -> list:
    return launch(train_tracked, DP * TP, CFG, TC, ParallelConfig(MeshShape(dp=DP, tp=TP, order=order)),
                  steps=RING_STEPS, timeout=180, **kwargs)


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    return {TP_FIRST: run(TP_FIRST), DP_FIRST: run(DP_FIRST)}


def cross_from_log(results: list, shape: MeshShape, step: int, node=None, gpn: int = GPN) -> dict[str, int]:
    return cross_node_bytes(flows_from_log([r.step_comm[step] for r in results], shape), gpn, node)


def check_dp_tp(results: list, order: str, node=None, read_order: str | None = None) -> None:
    """Every check of one DP x TP run: log == prediction per group and step, kinds, and the totals by hand."""
    shape, read = MeshShape(dp=DP, tp=TP, order=order), MeshShape(dp=DP, tp=TP, order=read_order or order)
    predicted = cross_node_bytes(predicted_flows(CFG, shape, TC.global_batch), GPN)
    for step in range(TC.steps):
        assert cross_from_log(results, read, step, node) == predicted, f"step {step}"
    assert bytes_kinds(flows_from_log([r.step_comm[0] for r in results], read)) == {"dp": comm.MEASURED,
                                                                                  "tp": comm.MODELLED}
    # by hand: t = d = 2, so every ring all-reduce sends V per rank. TP: the embedding's, 2 per block forward
    # and 2 backward, the head's (4L + 2 all-reduces of b*s*h fp32) + the loss's 3 of b*s fp32; DP: Psi_t fp32.
    b = TC.global_batch // DP
    tp_rank = (4 * CFG.n_layer + 2) * b * CFG.seq_len * CFG.d_model * 4 + 3 * b * CFG.seq_len * 4
    dp_rank = 4 * int(sum(params_per_rank(CFG, ParallelLayout(tp=TP)).values()))
    world = DP * TP
    expected = {"tp": 0, "dp": world * dp_rank} if order == TP_FIRST else {"tp": world * tp_rank, "dp": 0}
    assert cross_from_log(results, read, 0, node) == expected


def assert_model_states(cfg, results: list, layout: ParallelLayout) -> None:
    n_tensors = {}
    for r in results:
        checks = check_run(cfg, r, layout)
        assert all(c.ok for c in checks), f"rank {r.rank}\n{format_checks(checks)}"
        by = {c.category: c for c in checks}
        assert by["parameters"].predicted == by["parameters"].measured  # to the byte
        assert by["gradients"].predicted == by["gradients"].measured
        # the only difference: PyTorch's AdamW keeps a 4-byte `step` counter per parameter tensor
        n_tensors[r.rank] = (by["optimizer_state"].measured - by["optimizer_state"].predicted) / 4
    assert all(0 < n <= len(list(GPT(cfg).parameters())) for n in n_tensors.values()), n_tensors


# ------------------------------------------------------------------------------------------------ no ranks


def test_node_of_is_torchrun_layout():
    assert nodes(8, 4) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [node_of(r, 2) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="gpus_per_node must be >= 1"):
        node_of(3, 0)
    with pytest.raises(ValueError, match="do not fill nodes of 4 GPUs"):
        nodes(6, 4)


def test_group_members_reads_every_label():
    shape = MeshShape(dp=2, tp=2, order=DP_FIRST)
    assert group_members("tp", 1, shape) == [1, 3]
    assert group_members("dp", 3, shape) == [2, 3]
    assert group_members("world", 2, shape) == [0, 1, 2, 3]
    assert group_members("self", 2, shape) == [2]
    assert group_members("ranks[0, 3]", 0, shape) == [0, 3]


def test_record_flows_ring_successor_and_all_to_all():
    shape = MeshShape(dp=4)
    ring = comm.CommRecord("all_reduce", "dp", 4, 64, 96, 96, None)
    assert record_flows(ring, 3, shape) == [Flow(3, 0, 96, "dp", comm.MODELLED)]  # the ring wraps around
    a2a = comm.CommRecord("all_to_all", "dp", 4, 64, 48, 48, None)
    assert [f.dst for f in record_flows(a2a, 1, shape)] == [0, 2, 3]
    assert {f.nbytes for f in record_flows(a2a, 1, shape)} == {16}
    send = comm.CommRecord("send", "pp", 2, 8, 8, 0, None, peer=2)
    assert record_flows(send, 0, shape) == [Flow(0, 2, 8, "pp", comm.MEASURED)]
    with pytest.raises(ValueError, match="not the one the run used"):
        record_flows(dataclasses.replace(ring, group="ranks[1, 2]"), 0, shape)
    with pytest.raises(ValueError, match="no flow model"):
        record_flows(dataclasses.replace(ring, op="scatter"), 0, shape)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="models DP x TP x PP runs"):
        predicted_flows(CFG, MeshShape(dp=2, cp=2), 8)
    with pytest.raises(ValueError, match="does not split into dp x microbatches = 2 x 3"):
        predicted_flows(CFG, MeshShape(dp=2, pp=2), 8, microbatches=3)
    with pytest.raises(ValueError, match="partial-gradient sync"):
        predicted_flows(CFG.with_(n_kv_head=1), MeshShape(tp=2, pp=2), 8, microbatches=2)
    with pytest.raises(ValueError, match="records of 2 ranks, the mesh has 4"):
        flows_from_log([[], []], MeshShape(dp=2, tp=2))
    with pytest.raises(ValueError, match="category_peaks"):
        model_state_check(CFG, ParallelLayout(), {"parameters": 1})
    with pytest.raises(ValueError, match="stage="):
        model_state_check(CFG, ParallelLayout(pp=2), dict.fromkeys(("parameters", "gradients",
                                                                    "optimizer_state"), 1))


def test_prediction_alone_megatron_order_keeps_tp_inside():
    """Arithmetic only, 2 nodes of 4, tp=4 x dp=2. TP fastest: only DP crosses; DP fastest: only TP."""
    for order, crossing in ((TP_FIRST, {"dp"}), (DP_FIRST, {"tp"})):
        got = cross_node_bytes(predicted_flows(CFG, MeshShape(dp=2, tp=4, order=order), 8), 4)
        assert {g for g, b in got.items() if b} == crossing, order


# ------------------------------------------------------------------------------------------------ DP x TP


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("order", [TP_FIRST, DP_FIRST])
def test_cross_node_bytes_from_log_equal_prediction(runs, order):
    results = runs[order]
    assert compare(train_baseline(CFG, TC), merge_composed(results)).ok  # a correct run (fp32, within the noise)
    check_dp_tp(results, order)


@pytest.mark.slow
def test_order_keeping_tp_inside_a_node_sends_fewer_bytes_across(runs):
    across = {o: sum(cross_from_log(runs[o], MeshShape(dp=DP, tp=TP, order=o), 0).values()) for o in runs}
    assert 0 < across[TP_FIRST] < across[DP_FIRST]
    table = cross_node_table(cross_from_log(runs[TP_FIRST], MeshShape(dp=DP, tp=TP), 0),
                             cross_node_bytes(predicted_flows(CFG, MeshShape(dp=DP, tp=TP), TC.global_batch), GPN),
                             {"dp": comm.MEASURED, "tp": comm.MODELLED})
    assert [(row["group"], row["equal"]) for row in table] == [("dp", True), ("tp", True)]


@pytest.mark.slow
def test_off_by_one_node_map_fails(runs):
    with pytest.raises(AssertionError):
        check_dp_tp(runs[TP_FIRST], TP_FIRST, node=lambda r: (r + 1) // GPN)


@pytest.mark.slow
def test_log_read_with_the_wrong_order_fails(runs):
    with pytest.raises(AssertionError):
        check_dp_tp(runs[TP_FIRST], TP_FIRST, read_order=DP_FIRST)


class DPFirstMesh(Mesh):
    """The bug: whatever order it is given, the groups (and the coordinates) are built with DP fastest, while
    the mesh reports the order it was given (so ``parallelize`` takes it for the config's)."""

    def __init__(self, **degrees) -> None:
        super().__init__(**{**degrees, "order": DP_FIRST})
        self.built, self.shape = self.shape, MeshShape(**degrees)

    def coord(self, axis: str) -> int:
        return self.built.coords(self.rank)[axis]


def dp_first_mesh(parallel: ParallelConfig) -> Mesh:
    return DPFirstMesh(**dataclasses.asdict(parallel.shape))


@pytest.mark.slow
def test_groups_built_in_the_wrong_order_fail():
    results = run(TP_FIRST, mesh_fn=dp_first_mesh)
    with pytest.raises(AssertionError):
        check_dp_tp(results, TP_FIRST)


@pytest.mark.slow
def test_planner_model_states_equal_the_tracker_dp_x_tp(runs):
    assert_model_states(CFG, runs[TP_FIRST], ParallelLayout(dp=DP, tp=TP))


@pytest.mark.slow
def test_model_state_check_catches_a_layout_that_does_not_split(runs):
    checks = model_state_check(CFG, ParallelLayout(dp=DP, tp=1), runs[TP_FIRST][0].memory)
    assert not any(c.ok for c in checks)
    assert "FAIL" in format_checks(checks)


# ------------------------------------------------------------------------------------------------ pipelines


@pytest.mark.slow
def test_pipeline_of_four_on_two_nodes():
    """PP 4 on two nodes of 2: only the stage 1 <-> 2 edge crosses, m activations forward and m gradients back,
    measured; each rank's model states are those of its stage (it holds the whole model)."""
    cfg, m = CFG.with_(n_layer=4), 4
    results = launch(train_tracked, 4, cfg, TC, ParallelConfig(MeshShape(pp=4), microbatches=m), timeout=180)
    shape = MeshShape(pp=4)
    got = cross_from_log(results, shape, 0)
    assert got == cross_node_bytes(predicted_flows(cfg, shape, TC.global_batch, microbatches=m), GPN)
    assert got == {"pp": 2 * m * (TC.global_batch // m) * cfg.seq_len * cfg.d_model * 4}
    assert bytes_kinds(flows_from_log([r.step_comm[0] for r in results], shape)) == {"pp": comm.MEASURED}
    assert_model_states(cfg, results, ParallelLayout(pp=4, microbatches=m))


@pytest.mark.slow
def test_dp_tp_pp_2x2x2_on_two_nodes_of_four():
    """The chapter's 8-rank run: with Megatron's order only PP's edge crosses the two nodes of 4 (measured), TP
    and DP stay inside; the ring model of TP and of the pipeline's DP all-reduce agrees with the arithmetic."""
    cfg, m = CFG.with_(n_layer=4), 2
    results = launch(train_tracked, 8, cfg, TC, ParallelConfig(MeshShape(dp=2, tp=2, pp=2), microbatches=m),
                     timeout=240)
    shape = MeshShape(dp=2, tp=2, pp=2)  # (its parity with one process: tests/test_compose.py)
    flows = flows_from_log([r.step_comm[0] for r in results], shape)
    predicted = predicted_flows(cfg, shape, TC.global_batch, microbatches=m, dp_kind=comm.MODELLED)
    got = cross_node_bytes(flows, 4)
    assert got == cross_node_bytes(predicted, 4)
    assert {g for g, b in got.items() if b} == {"pp"}
    on_two_per_node = cross_node_bytes(flows, 2)  # the same log on nodes of 2: DP's all-reduce leaves them too
    assert on_two_per_node == cross_node_bytes(predicted, 2) and on_two_per_node["dp"] > 0
    assert bytes_kinds(flows) == {"dp": comm.MODELLED, "pp": comm.MEASURED, "tp": comm.MODELLED}
    assert_model_states(cfg, results, ParallelLayout(dp=2, tp=2, pp=2, microbatches=m))


def test_busiest_rank_carries_a_ring_crossing_alone():
    """A TP ring of 8 over two nodes of 4 crosses twice: the total counts two ranks' bytes, the busiest one."""
    flows = predicted_flows(CFG, MeshShape(tp=4, dp=2, order=DP_FIRST), 8)  # tp groups [0,2,4,6], [1,3,5,7]
    total, busiest = cross_node_bytes(flows, 4), busiest_rank_bytes(flows, 4)
    assert total["tp"] == 4 * busiest["tp"] and busiest["dp"] == 0  # 2 crossings a ring, 2 rings
