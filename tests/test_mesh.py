"""The mesh: rank <-> coordinates, groups per axis, the axis order, EP carved out of dp x cp, and one clear error
per bad combination. Process groups are checked on real ranks at 1, 2, 4 and 8."""

import pytest
import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.model_config import GPTConfig
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import Mesh, MeshError, MeshShape


@pytest.mark.parametrize("degrees", [dict(), dict(tp=2), dict(dp=2, tp=2), dict(dp=2, tp=2, pp=2),
                                     dict(cp=2, dp=2), dict(tp=2, cp=2, dp=2), dict(dp=4, ep=2),
                                     dict(dp=2, cp=2, ep=4)])
def test_coords_round_trip_and_groups_partition(degrees):
    s = MeshShape(**degrees)
    seen = set()
    for r in range(s.world_size):
        c = s.coords(r)
        assert s.rank_of(**{a: c[a] for a in ("tp", "cp", "dp", "pp")}) == r
        seen.add(tuple(c[a] for a in ("tp", "cp", "dp", "pp")))
    assert len(seen) == s.world_size
    for axes in [("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp"), ("ep",), ("edp",), ("tp", "cp", "dp", "pp")]:
        groups = s.all_groups(*axes)
        assert sorted(r for g in groups for r in g) == list(range(s.world_size))
        assert {len(g) for g in groups} == {s.size(*axes)}


def test_default_order_puts_tp_fastest_and_pp_slowest():
    s = MeshShape(dp=2, tp=2, pp=2)
    assert s.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s.all_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert s.all_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert s.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1, "ep": 0, "edp": 0}


def test_order_is_configurable():
    s = MeshShape(dp=2, tp=2, pp=2, order="dp-tp-cp-ep-pp")
    assert s.all_groups("dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s.all_groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert s.rank_of(dp=1, tp=1, pp=1) == 7


def test_expert_groups_re_split_the_data_parallel_ranks():
    s = MeshShape(dp=4, tp=2, ep=2)  # 8 ranks; experts over 2 ranks, each expert replicated 2 times
    assert s.world_size == 8 and s.edp == 2
    assert s.all_groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert s.all_groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert s.all_groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="mix cp/dp with ep/edp"):
        s.group_ranks(0, "dp", "ep")


@pytest.mark.parametrize("kwargs, needle", [
    (dict(dp=0), "dp=0"), (dict(tp=-2), "tp=-2"), (dict(tp=True), "tp=True"), (dict(pp=1.5), "pp=1.5"),
    (dict(order="tp-dp-pp"), "order="), (dict(dp=2, ep=4), "ep=4 must divide dp x cp = 2"),
])
def test_bad_degrees_are_named(kwargs, needle):
    with pytest.raises(MeshError, match=needle.replace("+", r"\+").replace(".", r"\.")):
        MeshShape(**kwargs)


CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=4, n_kv_head=2, d_model=64, d_ff=192)


@pytest.mark.parametrize("shape, kwargs, needle", [
    (MeshShape(tp=2, dp=2), dict(world_size=8), "the job has 8 ranks"),
    (MeshShape(tp=8), dict(), "does not divide n_head=4"),
    (MeshShape(tp=4), dict(cfg=GPTConfig(n_head=6, n_kv_head=3, d_model=48, vocab_size=256)), "n_kv_head=3"),
    (MeshShape(tp=2), dict(cfg=CFG.with_(d_ff=191)), "does not divide d_ff=191"),
    (MeshShape(tp=2), dict(cfg=CFG.with_(vocab_size=255)), "vocab_size=255"),
    (MeshShape(pp=2), dict(v=3), r"pp x v = 2 x 3 does not divide n_layer=4"),
    (MeshShape(pp=3), dict(), "n_layer=4"),
    (MeshShape(cp=2), dict(cfg=CFG.with_(seq_len=30)), "2 x cp = 4"),
    (MeshShape(cp=2, tp=4), dict(sp=True, seq_len=20), "cp x tp = 8"),
    (MeshShape(dp=2, ep=2), dict(), "needs a mixture-of-experts model"),
    (MeshShape(dp=4, ep=4), dict(cfg=CFG.with_(n_expert=6)), "does not divide n_expert=6"),
    (MeshShape(dp=4), dict(global_batch=6), "global batch 6 is not divisible by dp x micro_batch = 4 x 1"),
    (MeshShape(dp=2), dict(global_batch=8, micro_batch=3), "micro_batch in"),
])
def test_validate_names_each_constraint_and_the_fix(shape, kwargs, needle):
    kwargs.setdefault("cfg", CFG)
    with pytest.raises(MeshError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        shape.validate(**kwargs)


def test_validate_lists_every_problem_at_once():
    with pytest.raises(MeshError) as e:
        MeshShape(tp=8, pp=3, dp=3).validate(CFG, global_batch=8)
    assert len(e.value.problems) == 3  # heads, layers, batch (kv heads replicate, d_ff and vocab divide by 8)
    assert "no micro-batch fits dp=3" in str(e.value)


def test_a_valid_mesh_passes():
    MeshShape(dp=2, tp=2, pp=2, cp=2).validate(CFG, global_batch=8, world_size=16, sp=True)
    MeshShape(dp=2, tp=4).validate(CFG, global_batch=4)  # kv heads (2) replicated over tp=4


def _groups_on_ranks(rank, world_size, degrees):
    mesh = Mesh(**degrees)
    out = {}
    for axes in [("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp"), ("ep",), ("edp",)]:
        g = mesh.group(*axes)
        t = torch.tensor([float(rank)])
        with comm.recording() as log:
            comm.all_reduce(t, group=g)
        out[axes] = (sorted(dist.get_process_group_ranks(g)), int(t.item()), log.records[0].group,
                     dist.get_rank(g) == mesh.ranks(*axes).index(rank), mesh.label(*axes))
    return out


@pytest.mark.parametrize("world, degrees", [(1, dict()), (2, dict(tp=2)), (4, dict(dp=2, tp=2)),
                                            (4, dict(dp=2, cp=2, ep=2)), (8, dict(dp=2, tp=2, pp=2))])
def test_process_groups_match_the_arithmetic(world, degrees):
    shape = MeshShape(**degrees)
    results = launch(_groups_on_ranks, world, degrees, timeout=60)
    for rank, out in enumerate(results):
        for axes, (ranks, total, logged, rank_order, label) in out.items():
            expected = shape.group_ranks(rank, *axes)
            assert ranks == sorted(expected), (rank, axes)
            assert total == sum(expected)
            assert rank_order
            assert logged == label == ("+".join(a for a in axes if shape.size(a) > 1) or "self")


def _mesh_outside_world(rank, world_size):
    Mesh(dp=2, tp=2)


def test_mesh_of_the_wrong_world_size_says_so():
    from course_lib.runtime.launch import RankError

    with pytest.raises(RankError, match="the job has 2 ranks"):
        launch(_mesh_outside_world, 2, timeout=60)


def test_mesh_outside_a_job_says_how():
    with pytest.raises(RuntimeError, match="inside a launched rank"):
        Mesh(tp=2)


def _device_mesh_ranks(rank, world_size):
    mesh = Mesh(dp=2, tp=2)
    full = mesh.device_mesh()
    return (full.mesh_dim_names, dist.get_process_group_ranks(mesh.device_mesh("tp").get_group()),
            dist.get_process_group_ranks(full.get_group("dp")), mesh.ranks("tp"), mesh.ranks("dp"))


def test_device_mesh_is_the_same_grid():
    for names, tp_ranks, dp_ranks, ours_tp, ours_dp in launch(_device_mesh_ranks, 4, timeout=60):
        assert names == ("pp", "dp", "cp", "tp")
        assert tp_ranks == ours_tp and dp_ranks == ours_dp
