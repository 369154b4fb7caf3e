"""course_lib.comm: every wrapped op against torch.distributed's semantics, and its log against exact byte counts.

One launch per world size (2, 3, 4) runs a fixed list of calls (``_specs``) on real gloo ranks and returns the
outputs and the log; the tests below check that list from several sides. Expected values are computed here, in
the parent, from the same inputs: results from torch semantics written out by hand, ring bytes from a ring that
is actually played on data (``_play_ring``), the rest from the ring byte formulas.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.comm import CommLog, CommRecord, chunk_numels, ring_bytes
from course_lib.runtime.launch import launch
from tests.conftest import _rank_processes

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")


# ------------------------------------------------------------------------------------------ a ring, played


@functools.cache
def _play_ring(numel: int, n: int) -> dict[str, list[tuple[int, int]]]:
    """Run a unidirectional ring (rank r -> r+1) reduce-scatter then all-gather on random data, chunked as the
    module docstring says (the first numel % n chunks one element longer), rank r ending with chunk r. Checks
    the data really comes out reduced and gathered, and returns the (sent, received) *elements* per rank."""
    sizes = [numel // n + (i < numel % n) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]

    def sl(c: int) -> slice:
        return slice(starts[c], starts[c] + sizes[c])

    g = torch.Generator().manual_seed(numel * 31 + n)
    data = [torch.randn(numel, dtype=torch.float64, generator=g) for _ in range(n)]
    total = torch.stack(data).sum(0) if n else None
    rs = [[0, 0] for _ in range(n)]
    ag = [[0, 0] for _ in range(n)]
    bufs = [d.clone() for d in data]
    for k in range(n - 1):  # reduce-scatter: step k, rank r passes its partial sum of chunk r-k-1 to r+1
        msgs = [((r + 1) % n, (r - k - 1) % n, bufs[r][sl((r - k - 1) % n)].clone()) for r in range(n)]
        for r, (dst, c, payload) in enumerate(msgs):
            bufs[dst][sl(c)] += payload
            rs[r][0] += sizes[c]
            rs[dst][1] += sizes[c]
    for r in range(n):
        torch.testing.assert_close(bufs[r][sl(r)], total[sl(r)], rtol=0, atol=1e-12)
    out = [torch.full((numel,), float("nan"), dtype=torch.float64) for _ in range(n)]
    for r in range(n):
        out[r][sl(r)] = bufs[r][sl(r)]
    for k in range(n - 1):  # all-gather: step k, rank r passes chunk r-k to r+1
        msgs = [((r + 1) % n, (r - k) % n, out[r][sl((r - k) % n)].clone()) for r in range(n)]
        for r, (dst, c, payload) in enumerate(msgs):
            out[dst][sl(c)] = payload
            ag[r][0] += sizes[c]
            ag[dst][1] += sizes[c]
    for r in range(n):
        torch.testing.assert_close(out[r], total, rtol=0, atol=1e-12)
    return {"reduce_scatter": [tuple(x) for x in rs], "all_gather": [tuple(x) for x in ag],
            "all_reduce": [(a[0] + b[0], a[1] + b[1]) for a, b in zip(rs, ag, strict=True)]}


RING_CASES = [(numel, n) for n in range(1, 7) for numel in sorted({0, 1, n - 1, n, n + 1, 3 * n, 3 * n + 2, 37})]


@pytest.mark.parametrize("op", RING_OPS)
def test_ring_bytes_equal_a_ring_played_on_data(op):
    checked = 0
    for numel, n in RING_CASES:
        played = _play_ring(numel, n)[op]
        for rank in range(n):
            for es in (2, 4):
                sent, recv = played[rank]
                assert ring_bytes(op, numel, es, n, rank) == (sent * es, recv * es), (op, numel, n, rank)
                checked += 1
    assert checked > 300


def test_ring_bytes_closed_forms():
    for n in (2, 3, 4, 8):
        for numel in (n, 6 * n, 1024 * n):
            v = numel * 4
            for rank in range(n):
                assert ring_bytes("all_gather", numel, 4, n, rank) == ((n - 1) * v // n,) * 2
                assert ring_bytes("reduce_scatter", numel, 4, n, rank) == ((n - 1) * v // n,) * 2
                assert ring_bytes("all_reduce", numel, 4, n, rank) == (2 * (n - 1) * v // n,) * 2
        for numel in (1, 5, 6 * n + 1, 1001):  # not divisible (or tiny): the totals still follow the formula
            for op, k in (("all_gather", 1), ("reduce_scatter", 1), ("all_reduce", 2)):
                per_rank = [ring_bytes(op, numel, 4, n, r) for r in range(n)]
                assert sum(s for s, _ in per_rank) == sum(r for _, r in per_rank) == k * (n - 1) * numel * 4
    assert ring_bytes("all_reduce", 1000, 4, 1, 0) == (0, 0)


def test_ring_bytes_refuses_other_ops():
    with pytest.raises(ValueError, match="no ring byte count for 'broadcast'"):
        ring_bytes("broadcast", 8, 4, 2, 0)


def test_chunk_numels():
    for n in range(1, 6):
        for numel in range(0, 3 * n + 2):
            c = chunk_numels(numel, n)
            assert len(c) == n and sum(c) == numel
            assert c == sorted(c, reverse=True) and max(c) - min(c) <= 1
    assert chunk_numels(10, 4) == [3, 3, 2, 2]


# ------------------------------------------------------------------------------------------ CommLog in-process


def _sample_log() -> CommLog:
    return CommLog([
        CommRecord("all_reduce", "dp", 2, 100, 100, 100, 0.5),
        CommRecord("send", "world", 4, 8, 8, 0, 0.25, peer=1),
        CommRecord("all_reduce", "tp", 4, 40, 60, 60, 0.125),
        CommRecord("all_reduce", "dp", 2, 50, 50, 50, None),  # an async call never waited on
        CommRecord("recv", "world", 4, 8, 0, 8, 1.0, peer=3),
    ])


def test_log_helpers_filter_by_op_and_group():
    lg = _sample_log()
    assert lg.count() == 5
    assert lg.count("all_reduce") == 3 and lg.count("all_reduce", "dp") == 2 and lg.count(group="world") == 2
    assert lg.count("barrier") == 0 and lg.select("barrier") == []
    assert lg.sent_bytes() == 218 and lg.recv_bytes() == 218
    assert lg.sent_bytes("all_reduce", "dp") == 150 and lg.recv_bytes("recv") == 8 and lg.sent_bytes("recv") == 0
    assert lg.seconds("all_reduce", "dp") == 0.5  # None counts as 0
    assert lg.seconds() == pytest.approx(1.875)
    assert [r.peer for r in lg.select(group="world")] == [1, 3]
    lg.clear()
    assert lg.count() == 0 and lg.sent_bytes() == 0


def test_bytes_kind_follows_the_op_unless_given():
    lg = _sample_log()
    assert [r.bytes_kind for r in lg.records] == ["modelled", "measured", "modelled", "modelled", "measured"]
    assert lg.sent_bytes(kind=comm.MEASURED) == 8 and lg.recv_bytes(kind=comm.MEASURED) == 8
    assert lg.sent_bytes(kind=comm.MODELLED) == 210 and lg.count("all_reduce", kind=comm.MEASURED) == 0
    assert CommRecord("all_reduce", "dp", 2, 8, 8, 8, None, bytes_kind=comm.MEASURED).bytes_kind == "measured"
    with pytest.raises(ValueError, match="bytes_kind must be 'measured' or 'modelled'"):
        CommRecord("send", "world", 2, 8, 8, 0, None, bytes_kind="exact")


def test_summary_one_row_per_op_and_group_in_first_seen_order():
    rows = _sample_log().summary()
    assert rows == [
        {"op": "all_reduce", "group": "dp", "calls": 2, "tensor_bytes": 150, "sent_bytes": 150, "recv_bytes": 150,
         "bytes_kind": "modelled", "seconds": 0.5},
        {"op": "send", "group": "world", "calls": 1, "tensor_bytes": 8, "sent_bytes": 8, "recv_bytes": 0,
         "bytes_kind": "measured", "seconds": 0.25},
        {"op": "all_reduce", "group": "tp", "calls": 1, "tensor_bytes": 40, "sent_bytes": 60, "recv_bytes": 60,
         "bytes_kind": "modelled", "seconds": 0.125},
        {"op": "recv", "group": "world", "calls": 1, "tensor_bytes": 8, "sent_bytes": 0, "recv_bytes": 8,
         "bytes_kind": "measured", "seconds": 1.0},
    ]
    assert CommLog().summary() == []


def _columns(line: str, starts: list[int]) -> list[str]:
    return [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]


def test_table_is_aligned_and_hides_seconds_unless_asked():
    lg = _sample_log()
    lines = lg.table().splitlines()
    header = lines[0].split()
    assert header == ["op", "group", "calls", "tensor_bytes", "sent_bytes", "recv_bytes", "bytes_kind"]
    starts = [lines[0].index(h) for h in header]
    body = [_columns(line, starts) for line in lines[1:]]
    assert body == [[str(row[c]) for c in header] for row in lg.summary()]
    assert body[0] == ["all_reduce", "dp", "2", "150", "150", "150", "modelled"]
    assert "0.5" not in lg.table()

    timed = lg.table(timings=True).splitlines()
    assert timed[0].split()[-1] == "seconds"
    starts = [timed[0].index(h) for h in timed[0].split()]
    assert [_columns(line, starts)[-1] for line in timed[1:]] == ["0.5000", "0.2500", "0.1250", "1.0000"]
    assert CommLog().table().split() == header  # empty log: the header alone


# ------------------------------------------------------------------------------------------ the launched calls


def _input(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank-specific, exactly representable values (sums stay exact in fp32)."""
    numel = math.prod(shape)
    return (torch.arange(numel, dtype=torch.float64) * (rank + 1) + 100 * rank).reshape(shape).to(dtype)


def _a2a_rows(src: int, dst: int, uneven: bool) -> int:
    """Rows rank src sends rank dst in an all-to-all (uneven: asymmetric, never equal to the even split)."""
    return src + 2 * dst + 1 if uneven else 2


def _a2a_block(src: int, dst: int, uneven: bool) -> torch.Tensor:
    rows = _a2a_rows(src, dst, uneven)
    return torch.tensor([[src, dst, i] for i in range(rows)], dtype=torch.float32)


def _specs(n: int) -> list[dict]:
    """The calls every rank makes, in order (pure data: the ranks execute it, the parent predicts it)."""
    f32, f64 = torch.float32, torch.float64
    specs = [
        {"op": "all_reduce", "numel": 6 * n, "dtype": f32},
        {"op": "all_reduce", "numel": 6 * n + 1, "dtype": f64, "async_op": True},  # not divisible by n
        {"op": "all_reduce", "numel": 5, "dtype": torch.int64, "reduce": "max"},
        {"op": "all_gather", "shape": (3, 2), "dtype": f32},
        {"op": "all_gather", "shape": (5,), "dtype": f64, "async_op": True},
        {"op": "reduce_scatter", "numel": 4, "dtype": f32},
        {"op": "reduce_scatter", "numel": 3, "dtype": torch.int32, "async_op": True},
        {"op": "all_to_all", "uneven": False},
        {"op": "all_to_all", "uneven": True},
        {"op": "all_to_all", "uneven": True, "async_op": True},
        {"op": "broadcast", "numel": 7, "dtype": f32, "src": n - 1},
        {"op": "broadcast", "numel": 3, "dtype": f64, "src": 0, "async_op": True},
        {"op": "send_recv", "numel": 3, "dtype": f32},
        {"op": "isend_irecv", "numel": 4, "dtype": f64},
        {"op": "barrier"},
        {"op": "all_reduce", "numel": 4, "dtype": f32, "group": "WORLD"},
    ]
    if n == 4:  # strided subgroups {0, 2} (named "dp") and {1, 3} (unnamed), like data-parallel groups
        specs += [
            {"op": "all_reduce", "numel": 6, "dtype": f32, "group": "pair"},
            {"op": "all_reduce", "numel": 5, "dtype": f32, "group": "pair", "async_op": True},
            {"op": "all_gather", "shape": (3,), "dtype": f32, "group": "pair"},
            {"op": "reduce_scatter", "numel": 2, "dtype": f32, "group": "pair"},
            {"op": "broadcast", "numel": 5, "dtype": f32, "src": "second", "group": "pair"},
            {"op": "barrier", "group": "pair"},
        ]
    return specs


def _members(spec: dict, rank: int, n: int) -> list[int]:
    if spec.get("group") == "pair":
        return [0, 2] if rank in (0, 2) else [1, 3]
    return list(range(n))


def _src(spec: dict, rank: int, n: int) -> int:
    return _members(spec, rank, n)[1] if spec["src"] == "second" else spec["src"]


def _execute(spec: dict, rank: int, n: int, group: dist.ProcessGroup | None) -> tuple[torch.Tensor | None, list]:
    """Make the call(s) of one spec through course_lib.comm; return the result and the async handles."""
    op, a = spec["op"], spec.get("async_op", False)
    if op == "all_reduce":
        t = _input(rank, (spec["numel"],), spec["dtype"])
        red = comm.ReduceOp.MAX if spec.get("reduce") == "max" else comm.ReduceOp.SUM
        return t, [comm.all_reduce(t, op=red, group=group, async_op=a)]
    if op == "all_gather":
        inp = _input(rank, spec["shape"], spec["dtype"])
        out = torch.empty((len(_members(spec, rank, n)) * spec["shape"][0], *spec["shape"][1:]), dtype=spec["dtype"])
        return out, [comm.all_gather(out, inp, group=group, async_op=a)]
    if op == "reduce_scatter":
        m = len(_members(spec, rank, n))
        inp = _input(rank, (m * spec["numel"],), spec["dtype"])
        out = torch.empty(spec["numel"], dtype=spec["dtype"])
        return out, [comm.reduce_scatter(out, inp, group=group, async_op=a)]
    if op == "all_to_all":
        u = spec["uneven"]
        inp = torch.cat([_a2a_block(rank, j, u) for j in range(n)])
        out = torch.empty(sum(_a2a_rows(j, rank, u) for j in range(n)), 3)
        in_splits = [_a2a_rows(rank, j, u) for j in range(n)] if u else None
        out_splits = [_a2a_rows(j, rank, u) for j in range(n)] if u else None
        return out, [comm.all_to_all(out, inp, out_splits, in_splits, group=group, async_op=a)]
    if op == "broadcast":
        src = _src(spec, rank, n)
        t = _input(src, (spec["numel"],), spec["dtype"]) if rank == src else torch.zeros(spec["numel"],
                                                                                         dtype=spec["dtype"])
        return t, [comm.broadcast(t, src, group=group, async_op=a)]
    if op == "send_recv":  # shift right around the ring; even ranks send first so blocking calls cannot deadlock
        mine, got = _input(rank, (spec["numel"],), spec["dtype"]), torch.zeros(spec["numel"], dtype=spec["dtype"])
        if rank % 2 == 0:
            comm.send(mine, (rank + 1) % n)
            comm.recv(got, (rank - 1) % n)
        else:
            comm.recv(got, (rank - 1) % n)
            comm.send(mine, (rank + 1) % n)
        return got, []
    if op == "isend_irecv":  # shift left, asynchronously
        mine, got = _input(rank, (spec["numel"],), spec["dtype"]), torch.zeros(spec["numel"], dtype=spec["dtype"])
        return got, [comm.isend(mine, (rank - 1) % n), comm.irecv(got, (rank + 1) % n)]
    if op == "barrier":
        comm.barrier(group=group)
        return None, []
    raise AssertionError(op)


def _run_specs(rank: int, n: int) -> dict:
    groups = {"WORLD": dist.group.WORLD}
    names_returned_group = None
    if n == 4:
        g02, g13 = dist.new_group([0, 2]), dist.new_group([1, 3])
        groups["pair"] = g02 if rank in (0, 2) else g13
        if rank in (0, 2):
            names_returned_group = comm.name_group(g02, "dp") is g02
    comm.log().clear()
    results, per_spec, asyncs = [], [], []
    for spec in _specs(n):
        before = len(comm.log().records)
        result, handles = _execute(spec, rank, n, groups.get(spec.get("group")))
        records = comm.log().records[before:]
        issued = [(h, rec, rec.seconds) for h, rec in zip(handles, records, strict=False) if h is not None]
        for h, rec, seconds_at_issue in issued:
            ok = h.wait()
            asyncs.append({"op": rec.op, "at_issue": seconds_at_issue, "after_wait": rec.seconds, "wait": ok,
                           "completed": h.is_completed()})
        if not spec.get("async_op") and spec["op"] != "isend_irecv":
            assert all(h is None for h in handles), f"{spec}: a blocking call returned a handle"
        results.append(result)
        per_spec.append(list(records))
    return {"results": results, "records": per_spec, "asyncs": asyncs, "log": comm.log(),
            "named": names_returned_group}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"world{n}")
def ranks(request):
    n = request.param
    out = launch(_run_specs, n, timeout=60)
    assert not _rank_processes()
    return n, _specs(n), out


def _expected_result(spec: dict, rank: int, n: int) -> torch.Tensor | None:
    op, members = spec["op"], _members(spec, rank, n)
    if op == "all_reduce":
        stacked = torch.stack([_input(r, (spec["numel"],), spec["dtype"]) for r in members])
        return (stacked.amax(0) if spec.get("reduce") == "max" else stacked.sum(0)).to(spec["dtype"])
    if op == "all_gather":
        return torch.cat([_input(r, spec["shape"], spec["dtype"]) for r in members])
    if op == "reduce_scatter":
        m = len(members)
        total = torch.stack([_input(r, (m * spec["numel"],), spec["dtype"]) for r in members]).sum(0)
        return total.to(spec["dtype"]).chunk(m)[members.index(rank)]
    if op == "all_to_all":
        return torch.cat([_a2a_block(j, rank, spec["uneven"]) for j in range(n)])
    if op == "broadcast":
        return _input(_src(spec, rank, n), (spec["numel"],), spec["dtype"])
    if op == "send_recv":
        return _input((rank - 1) % n, (spec["numel"],), spec["dtype"])
    if op == "isend_irecv":
        return _input((rank + 1) % n, (spec["numel"],), spec["dtype"])
    return None


def _label(spec: dict, rank: int) -> str:
    if spec.get("group") == "pair":
        return "dp" if rank in (0, 2) else "ranks[1, 3]"
    return "world"


def _expected_records(spec: dict, rank: int, n: int) -> list[tuple]:
    """(op, group, group_size, tensor_bytes, sent, recv, peer) of each call, from torch semantics, the played
    ring, exact all-to-all bookkeeping and the broadcast chain."""
    op, members = spec["op"], _members(spec, rank, n)
    m, pos, label = len(members), members.index(rank), _label(spec, rank)
    es = torch.empty(0, dtype=spec.get("dtype", torch.float32)).element_size()
    if op in RING_OPS:
        if op == "all_reduce":
            numel = spec["numel"]
        elif op == "all_gather":
            numel = m * math.prod(spec["shape"])
        else:
            numel = m * spec["numel"]
        sent, recv = _play_ring(numel, m)[op][pos]
        return [(op, label, m, numel * es, sent * es, recv * es, None)]
    if op == "all_to_all":
        row = 3 * 4
        u = spec["uneven"]
        v = sum(_a2a_rows(rank, j, u) for j in range(n)) * row
        sent = sum(_a2a_rows(rank, j, u) for j in range(n) if j != rank) * row
        recv = sum(_a2a_rows(j, rank, u) for j in range(n) if j != rank) * row
        return [("all_to_all", label, m, v, sent, recv, None)]
    if op == "broadcast":
        v = spec["numel"] * es
        chain = (pos - members.index(_src(spec, rank, n))) % m  # 0 at the source, m-1 at the end of the chain
        return [("broadcast", label, m, v, v if chain < m - 1 else 0, v if chain > 0 else 0, None)]
    if op in ("send_recv", "isend_irecv"):
        v = spec["numel"] * es
        right, left = (rank + 1) % n, (rank - 1) % n
        if op == "send_recv":
            snd, rcv = ("send", label, n, v, v, 0, right), ("recv", label, n, v, 0, v, left)
            return [snd, rcv] if rank % 2 == 0 else [rcv, snd]
        return [("send", label, n, v, v, 0, left), ("recv", label, n, v, 0, v, right)]
    if op == "barrier":
        return [("barrier", label, m, 0, 0, 0, None)]
    raise AssertionError(op)


def _key(r: CommRecord) -> tuple:
    return (r.op, r.group, r.group_size, r.tensor_bytes, r.sent_bytes, r.recv_bytes, r.peer)


def test_results_equal_torch_semantics(ranks):
    n, specs, out = ranks
    checked = 0
    for rank, got in enumerate(out):
        assert len(got["results"]) == len(specs)
        for spec, result in zip(specs, got["results"], strict=True):
            expected = _expected_result(spec, rank, n)
            if expected is None:
                assert result is None
                continue
            assert result.dtype == expected.dtype, spec
            assert torch.equal(result, expected), f"rank {rank}, {spec}: {result} != {expected}"
            checked += 1
    assert checked == n * sum(s["op"] != "barrier" for s in specs)


def test_exactly_one_record_per_call_with_op_group_and_bytes(ranks):
    n, specs, out = ranks
    for rank, got in enumerate(out):
        for spec, records in zip(specs, got["records"], strict=True):
            assert [_key(r) for r in records] == _expected_records(spec, rank, n), f"rank {rank}, {spec}"
        flat = [r for records in got["records"] for r in records]
        assert got["log"].records == flat  # nothing else was logged, nothing twice
        assert len(flat) == len(specs) + 2  # each p2p spec makes two calls


def _ring_numel(spec: dict, m: int) -> int:
    """The V (in elements) of a ring op: the all-reduce buffer, the gathered output, the reduce-scatter input."""
    if spec["op"] == "all_reduce":
        return spec["numel"]
    if spec["op"] == "all_gather":
        return m * math.prod(spec["shape"])
    return m * spec["numel"]


def test_bytes_follow_the_closed_forms(ranks):
    """Per rank: (N-1)/N*V for all-gather / reduce-scatter / even all-to-all, 2(N-1)/N*V for a divisible
    all-reduce. Not divisible, or uneven splits: over all ranks sent == received (== (N-1)*V, x2 for all-reduce)."""
    n, specs, out = ranks
    factor = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
    seen = set()
    for i, spec in enumerate(specs):
        if spec.get("group") == "pair" or spec["op"] not in (*RING_OPS, "all_to_all", "broadcast"):
            continue
        recs = [got["records"][i][0] for got in out]
        v = recs[0].tensor_bytes
        assert all(r.group_size == n for r in recs)
        assert all(r.tensor_bytes == v for r in recs) or spec.get("uneven")  # uneven all-to-all inputs differ
        total_sent, total_recv = sum(r.sent_bytes for r in recs), sum(r.recv_bytes for r in recs)
        assert total_sent == total_recv, spec
        if spec["op"] == "broadcast":
            assert total_sent == (n - 1) * v
        elif spec["op"] == "all_to_all" and spec["uneven"]:
            seen.add("uneven")
        elif spec["op"] == "all_to_all" or _ring_numel(spec, n) % n == 0:
            k = factor.get(spec["op"], 1)
            for r in recs:
                assert r.sent_bytes == r.recv_bytes == k * (n - 1) * v // n, spec
            seen.add("per-rank")
        else:
            assert total_sent == factor[spec["op"]] * (n - 1) * v, spec
            seen.add("total")
    assert seen == {"per-rank", "total", "uneven"}


def test_sync_calls_are_timed_and_async_calls_once_waited(ranks):
    _, specs, out = ranks
    n_async = sum(bool(s.get("async_op")) for s in specs) + 2  # + isend and irecv
    for got in out:
        assert len(got["asyncs"]) == n_async
        for a in got["asyncs"]:
            assert a["at_issue"] is None, a  # not timed before wait()
            assert isinstance(a["after_wait"], float) and a["after_wait"] >= 0, a
            assert a["wait"], a
            # gloo's async reduce_scatter work reports is_completed() False even after wait() (torch 2.13): the
            # wrapper passes it through, so only the other ops are held to it
            assert a["completed"] or a["op"] == "reduce_scatter", a
        for spec, records in zip(specs, got["records"], strict=True):
            if not spec.get("async_op") and spec["op"] != "isend_irecv":
                assert all(isinstance(r.seconds, float) and r.seconds >= 0 for r in records), spec
        assert got["log"].seconds() > 0


def test_summary_of_a_rank_log(ranks):
    n, specs, out = ranks
    rows = {(row["op"], row["group"]): row for row in out[0]["log"].summary()}
    world = [s for s in specs if s.get("group") != "pair"]
    assert rows["all_reduce", "world"]["calls"] == sum(s["op"] == "all_reduce" for s in world)
    assert rows["send", "world"]["calls"] == rows["recv", "world"]["calls"] == 2
    assert rows["barrier", "world"]["sent_bytes"] == 0
    assert rows["all_to_all", "world"]["sent_bytes"] == sum(r.sent_bytes for rs in out[0]["records"] for r in rs
                                                            if r.op == "all_to_all")
    ops = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv", "barrier"}
    assert {op for op, group in rows if group == "world"} == ops
    assert {group for _, group in rows} == ({"world", "dp"} if n == 4 else {"world"})


def test_backend_collectives_are_modelled_and_point_to_point_measured(ranks):
    _, _, out = ranks
    for got in out:
        kinds = {(r.op, r.bytes_kind) for rs in got["records"] for r in rs}
        assert kinds == {(op, comm.MEASURED if op in ("send", "recv") else comm.MODELLED) for op, _ in kinds}
        assert {op for op, _ in kinds} >= {"send", "recv", "all_reduce", "all_to_all"}


def test_named_and_unnamed_subgroups(ranks):
    n, _, out = ranks
    if n != 4:
        pytest.skip("subgroups are exercised at world size 4")
    for rank, got in enumerate(out):
        labels = {r.group for rs in got["records"] for r in rs if r.group != "world"}
        assert labels == {"dp" if rank in (0, 2) else "ranks[1, 3]"}
        assert got["named"] is (True if rank in (0, 2) else None)  # name_group returns the group itself


# ------------------------------------------------------------------------------------------ recording()


def _recording_observations(rank: int, world_size: int) -> dict:
    t = torch.ones(4)
    process_log = comm.log()
    obs = {}
    # 1. A block in a fresh process (the process log is still empty when it starts).
    with comm.recording() as first:
        comm.all_reduce(t)
    comm.barrier()
    obs["log_is_still_the_process_log"] = comm.log() is process_log
    obs["first"] = [r.op for r in first.records]
    obs["process"] = [r.op for r in process_log.records]
    # 2. Nested blocks, the inner one opened before any call of the outer one.
    comm.log().clear()
    try:
        with comm.recording() as outer:
            with comm.recording() as inner:
                comm.all_reduce(t)
            comm.broadcast(t, 0)
        comm.barrier()
        obs["outer"], obs["inner"] = [r.op for r in outer.records], [r.op for r in inner.records]
    except Exception as exc:  # the report says what broke instead of a bare RankError
        obs["nested_error"] = repr(exc)
    obs["process_after_nested"] = [r.op for r in comm.log().records]
    # 3. A block left by an exception stops recording too.
    try:
        with comm.recording() as interrupted:
            comm.barrier()
            raise KeyError("boom")
    except KeyError:
        pass
    comm.barrier()
    obs["interrupted"] = [r.op for r in interrupted.records]
    return obs


def test_recording_blocks_nest_and_stop_at_exit():
    obs = launch(_recording_observations, 2)
    for o in obs:
        assert o["log_is_still_the_process_log"], "log() no longer returns the process-wide log after recording()"
        assert o["first"] == ["all_reduce"], "a recording() block kept recording after it was left"
        assert o["process"] == ["all_reduce", "barrier"]
        assert "nested_error" not in o, o.get("nested_error")
        assert o["outer"] == ["all_reduce", "broadcast"]
        assert o["inner"] == ["all_reduce"]
        assert o["process_after_nested"] == ["all_reduce", "broadcast", "barrier"]
        assert o["interrupted"] == ["barrier"]


# ------------------------------------------------------------------------------------------ one rank, errors


def _single_rank(rank: int, world_size: int) -> dict:
    before = len(comm.log().records)
    errors = []
    for call in (lambda: comm.all_gather(torch.empty(5), torch.empty(4)),
                 lambda: comm.reduce_scatter(torch.empty(3), torch.empty(4))):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    logged_by_errors = len(comm.log().records) - before
    t = torch.arange(6.0)
    comm.all_reduce(t)
    comm.broadcast(t, 0)
    return {"errors": errors, "logged_by_errors": logged_by_errors, "t": t,
            "last": [_key(r) for r in comm.log().records[-2:]]}


def test_one_rank_moves_nothing_and_size_errors_are_explained():
    (got,) = launch(_single_rank, 1)
    assert got["errors"] == ["all_gather: output has 5 elements, expected 1 x 4",
                             "reduce_scatter: input has 4 elements, expected 1 x 3"]
    assert got["logged_by_errors"] == 0
    assert torch.equal(got["t"], torch.arange(6.0))
    assert got["last"] == [("all_reduce", "world", 1, 24, 0, 0, None), ("broadcast", "world", 1, 24, 0, 0, None)]
