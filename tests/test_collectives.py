"""course_lib.runtime.collectives: parity with torch.distributed's own collectives, and bytes against the formulas.

Each launched function runs many checks (shapes, data, options) on its ranks and returns the failures it found as
text, with the number of checks made, so a failure names the collective, shape and rank. Configurations: the
world at 2, 3 and 4 ranks, and sub-groups of a 4-rank world: {0,2} and {1,3} side by side, and {1,2,3} (rank 0
stays out), where group ranks differ from global ranks.

Data is fp32. Integer-valued data sums exactly in any order, so results must equal torch's bit for bit. Random
normal data: ours must equal, bit for bit, a single-process sum in the ring's own order (chunk c accumulated from
rank c+1 round to rank c; naive: rank order), and torch's result within rtol 1e-5, atol 1e-6 (gloo adds in
another order). Data movement (all-gather, all-to-all, broadcast) must be exact. Bytes come from the comm log.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.comm import chunk_numels, ring_bytes
from course_lib.estimates.cost import collective_steps
from course_lib.runtime import collectives as C
from course_lib.runtime.launch import RankError, launch

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CONFIGS = {  # name: (world size, sub-groups or None for the world)
    "world2": (2, None),
    "world3": (3, None),
    "world4": (4, None),
    "pairs_of_4": (4, [[0, 2], [1, 3]]),
    "three_of_4": (4, [[1, 2, 3]]),
}
RTOL, ATOL = 1e-5, 1e-6
KINDS = ("int", "normal")


# ----------------------------------------------------------------------------------------------------------------
# Helpers that run on the ranks


class _Checks:
    """Collects failures as text; counts checks so that a run that checked nothing is caught."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.count = 0

    def equal(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.count += 1
        if got.shape != want.shape or got.dtype != want.dtype:
            self.failures.append(f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
        elif not torch.equal(got, want):
            self.failures.append(f"{what}: max |diff| {(got - want).abs().max().item():.3g} (want exact)")

    def close(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.count += 1
        if got.shape != want.shape or not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
            diff = (got - want).abs().max().item() if got.shape == want.shape else "shape"
            self.failures.append(f"{what}: max |diff| {diff} beyond rtol {RTOL}, atol {ATOL}")

    def same(self, what: str, got: object, want: object) -> None:
        self.count += 1
        if got != want:
            self.failures.append(f"{what}: got {got}, want {want}")

    def result(self) -> dict:
        return {"failures": self.failures, "checks": self.count}

    def p2p_log(self, what: str, rec: comm.CommLog, sent: int, recv: int, sends: int, recvs: int) -> None:
        """Only point-to-point ops, with these bytes and message counts."""
        self.same(f"{what}: ops logged", {r.op for r in rec.records} - {"send", "recv"}, set())
        self.same(f"{what}: bytes sent", rec.sent_bytes("send"), sent)
        self.same(f"{what}: bytes received", rec.recv_bytes("recv"), recv)
        self.same(f"{what}: send messages", rec.count("send"), sends)
        self.same(f"{what}: recv messages", rec.count("recv"), recvs)


def _my_group(rank: int, spec: list[list[int]] | None) -> tuple[bool, dist.ProcessGroup | None, list[int]]:
    """(member?, group, its global ranks in group order). Every rank creates every group, as torch requires."""
    if spec is None:
        return True, None, list(range(dist.get_world_size()))
    mine: tuple[bool, dist.ProcessGroup | None, list[int]] = (False, None, [])
    for ranks in spec:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = (True, group, sorted(ranks))
    return mine


def _shapes(n: int) -> list[tuple[int, ...]]:
    """Divisible by n: (4n,), (3n, 5). Not: remainder 1; fewer elements than ranks (empty chunks); (5, 7), 35
    elements, remainder n-1 for n = 2, 3, 4."""
    return [(4 * n,), (4 * n + 1,), (n - 1,), (3 * n, 5), (5, 7)]


def _averages(shape: tuple[int, ...], kind: str) -> tuple[bool, ...]:
    """Sum always; the mean too on one uneven shape with normal data (fewer launches' worth of messages)."""
    return (False, True) if (shape, kind) == ((5, 7), "normal") else (False,)


def _data(shape: tuple[int, ...], count: int, kind: str, salt: int) -> list[torch.Tensor]:
    """One deterministic fp32 tensor per group rank (every rank can build everyone's)."""
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(1009 * salt + i)
        if kind == "int":
            out.append(torch.randint(-50, 51, shape, generator=g).float())
        else:
            out.append(torch.randn(shape, generator=g))
    return out


def _ring_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """Flat sum over ranks in the ring's order: chunk c starts at rank c+1 and ends at rank c."""
    n = len(xs)
    sizes = chunk_numels(xs[0].numel(), n)
    pieces = [x.reshape(-1).split(sizes) for x in xs]
    out = []
    for c in range(n):
        acc = pieces[(c + 1) % n][c].clone()
        for j in range(2, n + 1):
            acc += pieces[(c + j) % n][c]
        out.append(acc)
    return torch.cat(out)


def _apply_wrong(wrong: str | None) -> None:
    """Break the ring on purpose, consistently on every rank (so it does not hang, it just computes garbage)."""
    if wrong == "reduce_scatter_off_by_one":  # sends chunk r-k instead of r-k-1 (and receives the matching one)
        C.ring_reduce_scatter_chunks = lambda r, k, n: ((r - k) % n, (r - k - 1) % n)
    elif wrong == "all_gather_off_by_one":  # starts with chunk r-1 instead of its own chunk r
        C.ring_all_gather_chunks = lambda r, k, n: ((r - k - 1) % n, (r - k - 2) % n)


# ----------------------------------------------------------------------------------------------------------------
# Per-collective checks (run on every rank)


def _check_reduce_scatter(rank: int, world_size: int, spec, wrong: str | None = None) -> dict | None:
    member, group, members = _my_group(rank, spec)
    if not member:
        return None
    _apply_wrong(wrong)
    n, r = len(members), members.index(rank)
    ck = _Checks()
    for salt, shape in enumerate(_shapes(n)):
        numel = math.prod(shape)
        sizes = chunk_numels(numel, n)
        for kind in KINDS:
            xs = _data(shape, n, kind, salt)
            for average in _averages(shape, kind):
                what = f"reduce_scatter {shape} {kind} average={average}"
                x = xs[r].clone()
                with comm.recording() as rec:
                    got = C.ring_reduce_scatter(x, group, average=average)
                ck.equal(f"{what}: input untouched", x, xs[r])
                ref = torch.empty(sizes[r])
                dist.reduce_scatter(ref, list(xs[r].reshape(-1).split(sizes)), group=group)
                if average:
                    ref /= n
                ring = _ring_order_sum(xs).split(sizes)[r] / (n if average else 1)
                ck.equal(f"{what}: vs the ring-order sum", got, ring)
                (ck.equal if kind == "int" else ck.close)(f"{what}: vs torch reduce_scatter", got, ref)
                if shape[0] % n == 0:  # torch's single-tensor form splits dim 0
                    ref2 = torch.empty((shape[0] // n, *shape[1:]))
                    dist.reduce_scatter_single(ref2, xs[r], group=group)
                    if average:
                        ref2 /= n
                    (ck.equal if kind == "int" else ck.close)(f"{what}: vs torch reduce_scatter_single", got,
                                                              ref2.reshape(-1))
                sent, recv = ring_bytes("reduce_scatter", numel, 4, n, r)
                steps = collective_steps("reduce_scatter", numel * 4, n)[0]  # n - 1
                ck.p2p_log(what, rec, sent, recv, steps, steps)
                ck.same(f"{what}: sends go right", {m.peer for m in rec.select("send")}, {members[(r + 1) % n]})
                if numel % n == 0:
                    ck.same(f"{what}: (n-1)/n V", sent, (n - 1) * numel * 4 // n)
    return ck.result()


def _check_all_gather(rank: int, world_size: int, spec, wrong: str | None = None) -> dict | None:
    member, group, members = _my_group(rank, spec)
    if not member:
        return None
    _apply_wrong(wrong)
    n, r = len(members), members.index(rank)
    ck = _Checks()
    for salt, shape in enumerate([*_shapes(n), ()]):
        numel = math.prod(shape)
        for kind in KINDS:
            # Equal chunks: each rank brings a tensor of `shape`, the result stacks them along dim 0.
            what = f"all_gather {shape} {kind} equal chunks"
            xs = _data(shape, n, kind, salt)
            with comm.recording() as rec:
                got = C.ring_all_gather(xs[r], group)
            ck.equal(f"{what}: vs all chunks", got, torch.cat([x.reshape(-1, *shape[1:]) for x in xs]))
            if shape:
                ref = torch.empty((n * shape[0], *shape[1:]))
                dist.all_gather_single(ref, xs[r], group=group)
                ck.equal(f"{what}: vs torch all_gather_single", got, ref)
            sent, recv = ring_bytes("all_gather", n * numel, 4, n, r)
            steps = collective_steps("all_gather", n * numel * 4, n)[0]  # n - 1
            ck.p2p_log(what, rec, sent, recv, steps, steps)
            ck.same(f"{what}: (n-1)/n V", sent, (n - 1) * numel * 4)
            if not shape:
                continue
            # Uneven chunks (comm.chunk_numels) gathered into `out`: the inverse of ring_reduce_scatter.
            what = f"all_gather {shape} {kind} into out"
            full = _data(shape, 1, kind, salt + 100)[0]
            sizes = chunk_numels(numel, n)
            mine = full.reshape(-1).split(sizes)[r].clone()
            out = torch.full(shape, float("nan"))
            with comm.recording() as rec:
                got = C.ring_all_gather(mine, group, out=out)
            ck.same(f"{what}: returns out", got is out, True)
            ck.equal(f"{what}: vs the full tensor", out, full)
            padded = torch.zeros(max(sizes))
            padded[: sizes[r]] = mine
            gathered = [torch.empty(max(sizes)) for _ in range(n)]
            dist.all_gather(gathered, padded, group=group)  # gloo needs equal sizes: pad, then trim
            ck.equal(f"{what}: vs torch all_gather", out.reshape(-1),
                     torch.cat([g[:s] for g, s in zip(gathered, sizes, strict=True)]))
            sent, recv = ring_bytes("all_gather", numel, 4, n, r)
            ck.p2p_log(what, rec, sent, recv, n - 1, n - 1)
    return ck.result()


def _check_all_reduce(rank: int, world_size: int, spec, wrong: str | None = None) -> dict | None:
    member, group, members = _my_group(rank, spec)
    if not member:
        return None
    _apply_wrong(wrong)
    n, r = len(members), members.index(rank)
    ck = _Checks()
    for salt, shape in enumerate(_shapes(n)):
        numel = math.prod(shape)
        for kind in KINDS:
            xs = _data(shape, n, kind, salt)
            for average in _averages(shape, kind):
                what = f"all_reduce {shape} {kind} average={average}"
                got = xs[r].clone()
                with comm.recording() as rec:
                    returned = C.ring_all_reduce(got, group, average=average)
                ck.same(f"{what}: in place", returned is got, True)
                ref = xs[r].clone()
                dist.all_reduce(ref, group=group)
                if average:
                    ref /= n
                ck.equal(f"{what}: vs the ring-order sum", got, _ring_order_sum(xs).view(shape) / (n if average else 1))
                (ck.equal if kind == "int" else ck.close)(f"{what}: vs torch all_reduce", got, ref)
                sent, recv = ring_bytes("all_reduce", numel, 4, n, r)
                ck.p2p_log(what, rec, sent, recv, 2 * (n - 1), 2 * (n - 1))
                ck.same(f"{what}: steps = cost.collective_steps", rec.count("send"),
                        collective_steps("all_reduce", numel * 4, n)[0])
                if numel % n == 0:
                    ck.same(f"{what}: 2(n-1)/n V", sent, 2 * (n - 1) * numel * 4 // n)
            # reduce-scatter then all-gather by hand is the same all-reduce
            what = f"all_reduce {shape} {kind} composed"
            out = torch.empty(shape)
            C.ring_all_gather(C.ring_reduce_scatter(xs[r], group), group, out=out)
            ck.equal(what, out, _ring_order_sum(xs).view(shape))
    # a non-contiguous tensor (a transpose) is reduced in place too
    xs = _data((5, 7), n, "int", 99)
    got = xs[r].clone().t()
    C.ring_all_reduce(got, group)
    ref = xs[r].clone()
    dist.all_reduce(ref, group=group)
    ck.equal("all_reduce of a transposed tensor", got, ref.t())
    return ck.result()


def _check_all_to_all(rank: int, world_size: int, spec, wrong: str | None = None) -> dict | None:
    member, group, members = _my_group(rank, spec)
    if not member:
        return None
    n, r = len(members), members.index(rank)
    ck = _Checks()

    def rows(src: int, dst: int) -> int:  # uneven, some blocks empty
        return (src + 2 * dst) % 3

    for kind in KINDS:
        # list form, uneven blocks: rank i's block for rank j is data (i, j)
        blocks = {(i, j): _data((rows(i, j), 3), 1, kind, 10 * i + j)[0] for i in range(n) for j in range(n)}
        inputs = [blocks[r, j] for j in range(n)]
        outputs = [torch.empty(rows(j, r), 3) for j in range(n)]
        with comm.recording() as rec:
            got = C.all_to_all(inputs, group, outputs=outputs)
        out_sizes = [rows(j, r) for j in range(n)]
        ref = torch.empty(sum(out_sizes), 3)  # gloo's list all_to_all wants equal blocks: use the single form
        dist.all_to_all_single(ref, torch.cat(inputs), out_sizes, [rows(r, j) for j in range(n)], group=group)
        for j, ref_j in enumerate(ref.split(out_sizes)):
            ck.equal(f"all_to_all list {kind}: block from {j}", got[j], blocks[j, r])
            ck.equal(f"all_to_all list {kind}: block from {j} vs torch all_to_all_single", got[j], ref_j)
        v = sum(t.numel() for t in inputs) * 4
        ck.p2p_log(f"all_to_all list {kind}", rec, v - inputs[r].numel() * 4,
                   sum(t.numel() for t in outputs) * 4 - outputs[r].numel() * 4, n - 1, n - 1)
        ck.same(f"all_to_all list {kind}: step k sends to r+k", [m.peer for m in rec.select("send")],
                [members[(r + k) % n] for k in range(1, n)])
        ck.same(f"all_to_all list {kind}: step k receives from r-k", [m.peer for m in rec.select("recv")],
                [members[(r - k) % n] for k in range(1, n)])

        # single tensor, equal splits, 1-D and 2-D; then uneven splits
        for shape in [(4 * n,), (2 * n, 5)]:
            what = f"all_to_all_single {shape} {kind}"
            x = _data(shape, n, kind, 50 + len(shape))[r]
            with comm.recording() as rec:
                got = C.all_to_all_single(x, group=group)
            ref = torch.empty_like(x)
            dist.all_to_all_single(ref, x, group=group)
            ck.equal(f"{what}: vs torch all_to_all_single", got, ref)
            v = x.numel() * 4
            ck.p2p_log(what, rec, (n - 1) * v // n, (n - 1) * v // n, n - 1, n - 1)
            sent = rec.sent_bytes()
            with comm.recording() as rec_comm:
                comm.all_to_all(ref, x, group=group)
            ck.same(f"{what}: bytes = comm.all_to_all's", sent, rec_comm.sent_bytes())
        what = f"all_to_all_single uneven {kind}"
        in_sizes = [rows(r, j) for j in range(n)]
        out_sizes = [rows(j, r) for j in range(n)]
        x = torch.cat(inputs)
        got = C.all_to_all_single(x, out_sizes, in_sizes, group=group)
        ref = torch.empty(sum(out_sizes), 3)
        dist.all_to_all_single(ref, x, out_sizes, in_sizes, group=group)
        ck.equal(f"{what}: vs torch all_to_all_single", got, ref)
    # equal blocks, default outputs (shaped like the blocks sent), against torch's list form
    inputs = [torch.full((2, 3), 10.0 * r + j) for j in range(n)]
    got = C.all_to_all(inputs, group)
    ref = [torch.empty(2, 3) for _ in range(n)]
    dist.all_to_all(ref, inputs, group=group)
    ck.equal("all_to_all default outputs vs torch all_to_all", torch.stack(got), torch.stack(ref))
    ck.equal("all_to_all default outputs", torch.stack(got), torch.stack([torch.full((2, 3), 10.0 * j + r)
                                                                          for j in range(n)]))
    return ck.result()


def _tree_children(v: int, n: int) -> int:
    """In a binomial tree rooted at 0, node c's parent is c with its lowest set bit cleared."""
    return sum(1 for c in range(1, n) if c & (c - 1) == v)


def _check_broadcast(rank: int, world_size: int, spec, wrong: str | None = None) -> dict | None:
    member, group, members = _my_group(rank, spec)
    if not member:
        return None
    n, r = len(members), members.index(rank)
    ck = _Checks()
    for salt, shape in enumerate(_shapes(n)):
        numel = math.prod(shape)
        v = numel * 4
        xs = _data(shape, n, "normal", salt)
        for src_pos, src in enumerate(members):  # src is a global rank
            ref = xs[r].clone()
            dist.broadcast(ref, src, group=group)
            with comm.recording() as rec_comm:
                comm.broadcast(xs[r].clone(), src, group=group)
            comm_bytes = (rec_comm.sent_bytes(), rec_comm.recv_bytes())  # read now: see _check_naive
            pos = (r - src_pos) % n
            for pieces in (None, 1):
                what = f"broadcast {shape} from {src} pieces={pieces}"
                got = xs[r].clone()
                with comm.recording() as rec:
                    C.broadcast(got, src, group, pieces=pieces)
                ck.equal(f"{what}: vs torch broadcast", got, ref)
                ck.equal(f"{what}: vs the source's tensor", got, xs[src_pos])
                count = max(1, min(n if pieces is None else pieces, numel))
                ck.p2p_log(what, rec, v if pos < n - 1 else 0, v if pos > 0 else 0,
                           count if pos < n - 1 else 0, count if pos > 0 else 0)
                ck.same(f"{what}: bytes = comm.broadcast's", (rec.sent_bytes(), rec.recv_bytes()), comm_bytes)
            what = f"tree_broadcast {shape} from {src}"
            got = xs[r].clone()
            with comm.recording() as rec:
                C.tree_broadcast(got, src, group)
            ck.equal(f"{what}: vs torch broadcast", got, ref)
            children = _tree_children(pos, n)
            ck.p2p_log(what, rec, children * v, v if pos > 0 else 0, children, int(pos > 0))
            if pos == 0:
                ck.same(f"{what}: the root sends ceil(log2 n) times", children, collective_steps("broadcast", v, n)[0])
    got = xs[r].clone().t()  # non-contiguous, in place
    C.broadcast(got, members[-1], group)
    ck.equal("broadcast of a transposed tensor", got, xs[n - 1].t())
    got = xs[r].clone().t()
    C.tree_broadcast(got, members[-1], group)
    ck.equal("tree_broadcast of a transposed tensor", got, xs[n - 1].t())
    return ck.result()


def _check_naive(rank: int, world_size: int, spec, wrong: str | None = None) -> dict | None:
    member, group, members = _my_group(rank, spec)
    if not member:
        return None
    n, r = len(members), members.index(rank)
    ck = _Checks()
    for salt, shape in enumerate(_shapes(n)):
        numel = math.prod(shape)
        for kind in KINDS:
            xs = _data(shape, n, kind, salt)
            for average in _averages(shape, kind):
                what = f"naive_all_reduce {shape} {kind} average={average}"
                got = xs[r].clone()
                with comm.recording() as rec:
                    C.naive_all_reduce(got, group, average=average)
                ref = xs[r].clone()
                dist.all_reduce(ref, group=group)
                if average:
                    ref /= n
                in_rank_order = xs[0].clone()
                for x in xs[1:]:
                    in_rank_order += x
                ck.equal(f"{what}: vs the rank-order sum", got, in_rank_order / (n if average else 1))
                (ck.equal if kind == "int" else ck.close)(f"{what}: vs torch all_reduce", got, ref)
                sent, recv = C.naive_all_reduce_bytes(numel, 4, n, r)
                ck.same(f"{what}: formula", (sent, recv), ((n - 1) * numel * 4,) * 2 if r == 0 else (numel * 4,) * 2)
                ck.p2p_log(what, rec, sent, recv, n - 1 if r == 0 else 1, n - 1 if r == 0 else 1)
    return ck.result()


def _naive_and_ring_bytes(rank: int, world_size: int) -> dict:
    """Bytes this rank moves in the ring and in the naive all-reduce of one tensor (1200 elements: n | 1200)."""
    x = torch.ones(1200)
    # Each log is read as soon as its block ends (comm.recording() drops its log from the active list by
    # equality, so a finished log that equals the process log goes on collecting).
    with comm.recording() as rec:
        C.ring_all_reduce(x.clone())
    stats = {"V": x.numel() * 4, "ring_sent": rec.sent_bytes(), "ring_recv": rec.recv_bytes(),
             "ring_modelled": rec.count(kind=comm.MODELLED)}
    with comm.recording() as rec:
        C.naive_all_reduce(x.clone())
    return stats | {"naive_sent": rec.sent_bytes(), "naive_recv": rec.recv_bytes()}


def _check_trivial(rank: int, world_size: int) -> dict:
    """One rank: every collective hands the data back and sends nothing."""
    ck = _Checks()
    x = torch.arange(6.0).view(2, 3)
    with comm.recording() as rec:
        ck.equal("reduce_scatter", C.ring_reduce_scatter(x), x.reshape(-1))
        ck.equal("all_gather", C.ring_all_gather(x), x)
        ck.equal("all_gather out", C.ring_all_gather(x, out=torch.empty(3, 2)), x.view(3, 2))
        ck.equal("all_reduce", C.ring_all_reduce(x.clone(), average=True), x)
        ck.equal("all_to_all", C.all_to_all([x])[0], x)
        ck.equal("all_to_all_single", C.all_to_all_single(x), x)
        ck.equal("broadcast", C.broadcast(x.clone(), 0), x)
        ck.equal("tree_broadcast", C.tree_broadcast(x.clone(), 0), x)
        ck.equal("naive_all_reduce", C.naive_all_reduce(x.clone()), x)
    ck.same("messages", len(rec.records), 0)
    ck.same("naive bytes", C.naive_all_reduce_bytes(6, 4, 1, 0), (0, 0))
    return ck.result()


# ----------------------------------------------------------------------------------------------------------------
# Tests (parent side)


def _run(check, config: str, wrong: str | None = None) -> list[dict | None]:
    n, spec = CONFIGS[config]
    return launch(check, n, spec, wrong)


def _failures(results: list[dict | None]) -> list[str]:
    members = [res for res in results if res is not None]
    assert members, "no rank ran the checks"
    assert all(res["checks"] >= 20 for res in members), [res["checks"] for res in members]
    return [f"rank {r}: {f}" for r, res in enumerate(results) if res for f in res["failures"]]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("check", [_check_reduce_scatter, _check_all_gather, _check_all_reduce, _check_all_to_all,
                                   _check_broadcast, _check_naive],
                         ids=["reduce_scatter", "all_gather", "all_reduce", "all_to_all", "broadcast", "naive"])
def test_matches_torch_and_sends_the_formula_bytes(check, config):
    assert _failures(_run(check, config)) == []


@pytest.mark.parametrize("n", [2, 3, 4])
def test_naive_all_reduce_loads_the_root_more_than_the_ring_loads_anyone(n):
    stats = launch(_naive_and_ring_bytes, n)
    v = stats[0]["V"]
    assert all(s["ring_sent"] == s["ring_recv"] == 2 * (n - 1) * v // n for s in stats)
    assert all(s["ring_modelled"] == 0 for s in stats)  # our send/recv: every byte measured, none modelled
    assert stats[0]["naive_sent"] == stats[0]["naive_recv"] == (n - 1) * v  # the root
    assert all(s["naive_sent"] == s["naive_recv"] == v for s in stats[1:])
    assert sum(s["naive_sent"] for s in stats) == sum(s["ring_sent"] for s in stats)  # same total traffic...
    busiest_naive, busiest_ring = max(s["naive_sent"] for s in stats), max(s["ring_sent"] for s in stats)
    assert busiest_naive * 2 == busiest_ring * n  # ...but the root carries n/2 times the ring's per-rank load
    if n > 2:
        assert busiest_naive > busiest_ring


@pytest.mark.parametrize("wrong, check", [("reduce_scatter_off_by_one", _check_reduce_scatter),
                                          ("reduce_scatter_off_by_one", _check_all_reduce),
                                          ("all_gather_off_by_one", _check_all_gather),
                                          ("all_gather_off_by_one", _check_all_reduce)])
def test_a_ring_with_an_off_by_one_chunk_fails_the_parity_checks(wrong, check):
    results = _run(check, "world3", wrong)
    failures = _failures(results)
    for r in range(3):
        assert any(f.startswith(f"rank {r}:") and "vs torch" in f for f in failures), (r, failures[:5])


def test_one_rank_sends_nothing():
    (result,) = launch(_check_trivial, 1)
    assert result["failures"] == [] and result["checks"] == 11


def _bad_calls(rank: int, world_size: int, call: str) -> None:
    x = torch.ones(8)
    if call == "all_gather_wrong_chunk":
        C.ring_all_gather(torch.ones(3), out=x)  # chunk_numels(8, 2) = [4, 4]
    elif call == "all_gather_out_dtype":
        C.ring_all_gather(torch.ones(4), out=x.double())
    elif call == "all_gather_out_not_contiguous":
        C.ring_all_gather(torch.ones(4), out=torch.ones(2, 4).t())
    elif call == "all_to_all_count":
        C.all_to_all([x])
    elif call == "all_to_all_single_indivisible":
        C.all_to_all_single(torch.ones(3))


@pytest.mark.parametrize("call, message", [("all_gather_wrong_chunk", "must bring 4 elements"),
                                           ("all_gather_out_dtype", "float64"),
                                           ("all_gather_out_not_contiguous", "contiguous"),
                                           ("all_to_all_count", "one input tensor per rank"),
                                           ("all_to_all_single_indivisible", "do not split equally")])
def test_bad_arguments_are_explained_before_any_message(call, message):
    with pytest.raises(RankError, match=message) as info:
        launch(_bad_calls, 2, call)
    assert info.value.exc_type == "ValueError"
