"""Replica checksums: an exact fingerprint of each tensor, compared across the ranks that must hold the same one.

Data-parallel replicas, and the copies of a weight that tensor parallelism replicates (a norm, a bias of a
row-parallel layer), take the same step from the same gradient: their bits stay *equal*, not close (every rank gets
the same all-reduced sum). So a 64-bit fingerprint of each parameter's bits (``fingerprint``: integer arithmetic on
the device, 8 bytes per tensor exchanged) is compared every ``every`` steps across the ranks whose copies must be
equal -- same name, same shard on every axis that shards it (``placement``) -- and the first parameter (in model
order) whose copies differ is named, with the ranks that hold the odd copy (the minority; on a tie, every rank that
differs from the group's lowest). Megatron-LM does this across data-parallel replicas
(``--check-weight-hash-across-dp-replicas-interval``). The same fingerprints of each rank's *batch* must differ
across data-parallel ranks: equal batches mean every rank trains on the same data (``BatchFingerprints``).

A checksum says the copies disagree, never that they are right: a wrong reduction that every rank does alike
keeps them equal (``drift`` finds that). The exchange uses ``all_gather_object`` outside the comm log, so it does
not change what the recorder and the byte counts see; it is a collective, so it runs on every rank or none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.loop import Batch, LoopObserver
from course_lib.parallel.placement import Shard, placements_of
from course_lib.runtime.mesh import MeshShape

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
BEFORE_TRAINING = -1
"""The ``step`` of the check made before the first step (the replicas as training starts)."""


def fingerprint(t: torch.Tensor) -> int:
    """A 64-bit fingerprint of ``t``'s bits and shape (any dtype): equal tensors give equal numbers, a single
    flipped bit almost surely another. Each element's bits, split in 16-bit halves, are weighted by two
    pseudo-random 20-bit weights of its position and summed: exact in int64 for up to 2^20 elements per chunk."""
    flat = t.detach().contiguous().reshape(-1)
    bits = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64) if flat.numel() else flat.long()
    if flat.element_size() == 8:
        bits = torch.stack([bits & 0xFFFFFFFF, (bits >> 32) & 0xFFFFFFFF], dim=1).reshape(-1)
    bits = bits & 0xFFFFFFFF
    pos = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64)
    w1 = (pos * 2654435761 + 97) % 1048573
    w2 = (pos * 40503 + 12345) % 1048571
    total = 0
    for lo, hi in ((0, 1 << 20),) if bits.numel() <= 1 << 20 else _chunks(bits.numel()):
        b = bits[lo:hi]
        total = (total * 1000003 + int(((b & 0xFFFF) * w1[lo:hi] + (b >> 16) * w2[lo:hi]).sum())) % (1 << 61)
    return (total * 6364136223846793005 + hash(tuple(t.shape))) % (1 << 61)


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(i, min(i + (1 << 20), n)) for i in range(0, n, 1 << 20)]


@dataclass(frozen=True)
class Mismatch:
    """Copies of ``name`` that must be equal and are not: ``odd`` the ranks holding the odd copy, ``copies``
    every rank of that copy set."""

    name: str
    odd: tuple[int, ...]
    copies: tuple[int, ...]


@dataclass
class ChecksumReport:
    """One check at ``step`` (``BEFORE_TRAINING`` for the start): how many copy sets were compared and each that
    disagreed, in model order."""

    step: int
    compared: int
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def alarm(self) -> bool:
        return bool(self.mismatches)

    def describe(self) -> str:
        when = "before training" if self.step == BEFORE_TRAINING else f"after step {self.step}"
        if not self.mismatches:
            return f"{when}: {self.compared} replicated tensors, all copies equal"
        m = self.mismatches[0]
        return (f"{when}: {len(self.mismatches)} of {self.compared} replicated tensors differ; first {m.name}: "
                f"rank(s) {list(m.odd)} hold another copy than the rest of {list(m.copies)}")


def copy_key(p: torch.Tensor, coords: dict[str, int]) -> tuple:
    """Which copy of its tensor ``p`` is on a rank at ``coords``: its coordinate on every axis that shards it."""
    return tuple((axis, tuple(coords.get(a, 0) for a in axis.split("+")))
                 for axis, where in placements_of(p).items() if isinstance(where, Shard))


def compare(rows: Sequence[tuple[int, list[tuple[str, tuple, int]]]], step: int = 0) -> ChecksumReport:
    """``rows``: per rank (rank, [(name, copy key, fingerprint)]); the copy sets are (name, key)."""
    sets: dict[tuple[str, tuple], dict[int, int]] = {}
    order: list[tuple[str, tuple]] = []
    for rank, entries in sorted(rows):
        for name, key, fp in entries:
            if (name, key) not in sets:
                order.append((name, key))
            sets.setdefault((name, key), {})[rank] = fp
    report = ChecksumReport(step, sum(len(sets[k]) > 1 for k in order))
    for k in order:
        copies = sets[k]
        votes = Counter(copies.values())
        if len(votes) < 2:
            continue
        (top, n), (_, second) = votes.most_common(2)
        right = top if n > second else copies[min(copies)]
        report.mismatches.append(Mismatch(k[0], tuple(sorted(r for r, f in copies.items() if f != right)),
                                          tuple(sorted(copies))))
    return report


def named_trained(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters that ``optimizer`` steps (all of them without one), by name, in model order."""
    mine = None if optimizer is None else {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [(n, p) for n, p in model.named_parameters() if mine is None or id(p) in mine]


def replica_checksums(model: nn.Module, shape: MeshShape, step: int = 0,
                      optimizer: torch.optim.Optimizer | None = None) -> ChecksumReport:
    """Compare every trained parameter's copies over all ranks of ``shape`` (a collective: every rank calls it)."""
    rank = dist.get_rank()
    coords = shape.coords(rank)
    mine = [(n, copy_key(p, coords), fingerprint(p)) for n, p in named_trained(model, optimizer)]
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (rank, mine))
    return compare(rows, step)


class ReplicaChecksums(LoopObserver):
    """``replica_checksums`` before training and after every ``every``-th step (a ``LoopObserver``); the reports
    in ``reports``."""

    def __init__(self, shape: MeshShape, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.shape, self.every, self.reports = shape, every, []
        self._model, self._optimizer = None, None

    def start(self, wrapper: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._model, self._optimizer = wrapper.module, optimizer
        self.reports.append(replica_checksums(self._model, self.shape, BEFORE_TRAINING, optimizer))

    def step_end(self, step: int) -> None:
        if (step + 1) % self.every == 0:
            self.reports.append(replica_checksums(self._model, self.shape, step, self._optimizer))


class BatchFingerprints(LoopObserver):
    """This rank's batch of every step, fingerprinted (``fingerprints[i]``: the i-th step seen)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.fingerprints: list[int] = []

    def batch(self, step: int, micro: Batch) -> None:
        self.steps.append(step)
        self.fingerprints.append(fingerprint(torch.cat([x for x, _ in micro])))


def same_batches(per_rank: Sequence[Sequence[int]], data_ranks: Sequence[Sequence[int]]) -> list[tuple[int, list]]:
    """(step index, ranks) wherever ranks that should see different data (one list of ``data_ranks``: the ranks of
    one model replica's different data shards, e.g. a dp group) saw the same batch."""
    out = []
    for group in data_ranks:
        for i in range(min(len(per_rank[r]) for r in group)):
            seen = Counter(per_rank[r][i] for r in group)
            dup = sorted(r for r in group if seen[per_rank[r][i]] > 1)
            if dup:
                out.append((i, dup))
    return out
