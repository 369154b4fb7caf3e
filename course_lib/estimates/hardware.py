"""The hardware catalogue: every GPU and every link the course prices, one key each, each number with its source.

Every module that needs a GPU's memory, peak or bandwidth, or a link's latency and bandwidth, reads it here: the
memory budgets' verdicts (``viz.memory``, ``viz.zero``), the collective-cost and TP widgets (``viz.comm``,
``viz.tp``), the planner (``planner``), the serving budget and roofline (``serving.budget``,
``serving.roofline``). A key is the name the widgets show ("H100 80GB", "NVLink 4 (H100)"); :func:`gpu` and
:func:`link` look one up and name every valid key when it is not there.

What the numbers mean (the conventions every entry follows):

* ``peak_flops``: the **dense** bf16 tensor-core peak, FP32 accumulate, FLOP/s. NVIDIA's tables print twice
  these "with sparsity" (2:4 structured sparsity, which training does not use): the dense value is half.
  ``fp8_flops``: the same for fp8 (None where the GPU has no fp8 tensor cores).
* ``nominal_gib``: the memory as the vendor writes it, "80GB" of HBM being 80 GiB (nvidia-smi shows an
  A100 80GB as 81920 MiB); ``bytes`` is that x 2^30, ``gb`` the same in decimal GB (80 GiB = 85.9 GB). A program
  can allocate a little less (the CUDA context, NCCL's buffers): the budgets' headroom stands for it.
* ``mem_bandwidth``: HBM (or GDDR) bandwidth, bytes/s, the vendor's peak.
* A link's ``beta``: bytes/s in **one** direction. Vendors quote NVLink as the sum of both directions
  ("900 GB/s bidirectional"): halved here. Network ports are quoted in bits per direction: divided by 8.
* A link's ``alpha``: the latency of **one ring step**, in seconds, as NCCL's own cost model prices it
  (NVIDIA/nccl ``src/graph/tuning.cc``, NCCL 2.30, table ``hwLat``, ring algorithm, Simple protocol -- the one
  NCCL picks for the large messages that gradients and activations are): 3.4 us over NVLink (NCCL uses one value
  for every NVLink generation), 5.7 us over PCIe, 14 us over the network (InfiniBand and Ethernet/RoCE alike). A
  collective of ``steps`` ring steps then costs ``steps * alpha + bytes_per_step * steps / beta``
  (``cost.collective_time``), without NCCL's fixed cost per call (``baseLat``). For small messages NCCL's tuner
  picks another protocol: ``NCCL_RING_LATENCY`` keeps the same table for all three (LL: 0.6 us a step over
  NVLink, LL128, Simple), with ``NCCL_RING_BASE_LATENCY`` and ``NCCL_PROTOCOL_BANDWIDTH``; a link's
  ``nccl_link`` names its row and :meth:`Link.protocol_alpha` reads it (``serving.budget.nccl_all_reduce``
  prices an all-reduce the way NCCL picks its protocol).
* ``FLASH_ATTENTION_BY_LENGTH``: a kernel's measured speed by sequence length (FlashAttention-2 on an H100), the
  shape of the curve the planner applies to its attention efficiency (``attention_length_factor``).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, replace
from typing import TypeVar

__all__ = ["FLASH_ATTENTION_BY_LENGTH", "GPU", "GPUS", "LINKS", "NCCL_PROTOCOLS", "NCCL_PROTOCOL_BANDWIDTH",
           "NCCL_RING_BASE_LATENCY", "NCCL_RING_LATENCY", "NETWORK_ALPHA", "NVLINK_ALPHA", "PCIE_ALPHA", "Link",
           "attention_length_factor", "gpu", "link"]

_GIB = 2**30
_GB = 10**9


@dataclass(frozen=True)
class GPU:
    """One GPU model: memory, dense peaks and memory bandwidth, where those numbers come from, and
    ``intra_link``: the key of the link between two such GPUs of one server (its NVLink in a DGX/HGX board)."""

    name: str
    nominal_gib: int
    peak_flops: float
    fp8_flops: float | None
    mem_bandwidth: float
    intra_link: str
    source: str

    @property
    def bytes(self) -> float:
        """Memory in bytes: the nominal GiB x 2^30."""
        return self.nominal_gib * _GIB

    @property
    def gb(self) -> float:
        """Memory in decimal GB (80 GiB -> 85.9 GB)."""
        return self.bytes / _GB


@dataclass(frozen=True)
class Link:
    """A link of the alpha-beta model: ``alpha`` seconds per ring step, ``beta`` bytes/s in one direction;
    ``nccl_link``: its row of NCCL's latency tables ("nvlink", "pci", "net"), None for a link NCCL does not price
    (a fitted or idealised one, whose ``alpha`` then stands for every protocol)."""

    name: str
    alpha: float
    beta: float
    source: str
    nccl_link: str | None = None

    def protocol_alpha(self, protocol: str) -> float:
        """Seconds per ring step under NCCL's ``protocol`` ("LL", "LL128", "Simple"): ``NCCL_RING_LATENCY``."""
        if protocol not in NCCL_PROTOCOLS:
            raise ValueError(f"unknown NCCL protocol {protocol!r}; choose one of {list(NCCL_PROTOCOLS)}")
        return self.alpha if self.nccl_link is None else NCCL_RING_LATENCY[self.nccl_link][protocol]

    def shared_by(self, n: int) -> Link:
        """The same link when ``n`` GPUs share it (one NIC per node of ``n`` GPUs): each gets beta / n."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"a link is shared by a whole number >= 1 of GPUs, got {n!r}")
        return replace(self, name=f"{self.name}, shared by {n} GPUs", beta=self.beta / n)


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("RTX 4090 24GB", 24, 165.2e12, 330.3e12, 1008e9, "PCIe 4.0 x16",
        "NVIDIA Ada Lovelace architecture whitepaper (v2.1), appendix table for the GeForce RTX 4090: BF16 tensor "
        "165.2 TFLOPS with FP32 accumulate (330.4 sparse), FP8 330.3 with FP32 accumulate; 24 GB GDDR6X, "
        "1,008 GB/s"),
    GPU("A100 40GB", 40, 312e12, None, 1555e9, "NVLink 3 (A100)",
        "NVIDIA A100 Tensor Core GPU datasheet, column A100 40GB SXM: BF16 312 TFLOPS (624 sparse), HBM2 "
        "1,555 GB/s; no FP8 tensor cores (Ampere)"),
    GPU("A100 80GB", 80, 312e12, None, 2039e9, "NVLink 3 (A100)",
        "NVIDIA A100 Tensor Core GPU datasheet, column A100 80GB SXM: BF16 312 TFLOPS (624 sparse), HBM2e "
        "2,039 GB/s; no FP8 tensor cores (Ampere)"),
    GPU("H100 80GB", 80, 989e12, 1979e12, 3.35e12, "NVLink 4 (H100)",
        "NVIDIA H100 Tensor Core GPU datasheet, column H100 SXM (the DGX/HGX H100 part; the PCIe card is slower): "
        "BF16 1,979 TFLOPS and FP8 3,958 TFLOPS with sparsity, HBM3 3.35 TB/s"),
    GPU("H800 80GB", 80, 989e12, 1979e12, 3.35e12, "NVLink 4 (H800)",
        "NVIDIA H800 SXM5 (the export part of the H100 SXM5): the H100's compute and HBM3 (BF16 1,979, FP8 3,958 "
        "TFLOPS with sparsity; 3.35 TB/s) with NVLink cut to 400 GB/s both directions; DeepSeek-AI's DeepSeek-V3 "
        "technical report (Sec. 3.2.2) measures 160 GB/s of it per GPU in practice"),
    GPU("H200 141GB", 141, 989e12, 1979e12, 4.8e12, "NVLink 4 (H100)",
        "NVIDIA H200 Tensor Core GPU datasheet, column H200 SXM: the H100's compute (BF16 1,979, FP8 3,958 TFLOPS "
        "with sparsity), 141 GB HBM3e at 4.8 TB/s"),
    GPU("B200 180GB", 180, 2.25e15, 4.5e15, 8e12, "NVLink 5 (B200)",
        "NVIDIA HGX B200 and DGX B200 specifications (8 GPUs at 1,000 W): FP16/BF16 36 PFLOPS and FP8 72 PFLOPS "
        "with sparsity, 1,440 GB HBM3e and 64 TB/s for the 8 GPUs -- per GPU 2.25 / 4.5 PFLOPS dense, 180 GB, 8 TB/s"),
)}
"""Every GPU of the course by its one key, smallest memory first: a consumer card and the data-centre parts."""


NCCL_PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_RING_LATENCY: dict[str, dict[str, float]] = {
    "nvlink": {"LL": 0.6e-6, "LL128": 1.9e-6, "Simple": 3.4e-6},
    "pci": {"LL": 1.0e-6, "LL128": 2.5e-6, "Simple": 5.7e-6},
    "net": {"LL": 2.7e-6, "LL128": 4.0e-6, "Simple": 14e-6},
}
"""Seconds per ring step by link and NCCL protocol: ``hwLat``, ring row (NVIDIA/nccl src/graph/tuning.cc, NCCL
2.30.7). LL stores 8 bytes (4 of data, 4 of flag) and polls the flag: the lowest latency, half the bandwidth;
Simple moves large chunks behind a fence: the full bandwidth, the highest latency; LL128 sits between."""
NCCL_RING_BASE_LATENCY: dict[str, float] = {"LL": 6.6e-6, "LL128": 14e-6, "Simple": 8.4e-6}
"""Fixed seconds a ring collective costs whatever its size, by protocol: ``baseLat``, ring row (same file)."""
NCCL_PROTOCOL_BANDWIDTH: dict[str, float] = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}
"""Share of a link's bandwidth each protocol carries as data, as tuning.cc scales a ring's bus bandwidth (LL x .5,
LL128 x .92; NCCL also caps both per GPU architecture, which the course leaves out)."""
NVLINK_ALPHA, PCIE_ALPHA, NETWORK_ALPHA = (NCCL_RING_LATENCY[k]["Simple"] for k in ("nvlink", "pci", "net"))
"""Seconds per ring step: NCCL's ``hwLat`` (src/graph/tuning.cc), ring algorithm, Simple protocol."""
_NCCL_LAT = "per-step latency: NCCL src/graph/tuning.cc hwLat (ring; Simple, LL in NCCL_RING_LATENCY)"


def _nvlink(key: str, both_directions: float, document: str) -> Link:
    """Vendors quote NVLink as the sum of both directions: beta is half of it."""
    return Link(key, NVLINK_ALPHA, both_directions / 2,
                f"{document}: {both_directions / 1e9:.0f} GB/s both directions = {both_directions / 2e9:.0f} GB/s "
                f"each way; {_NCCL_LAT}, NVLink 3.4 us Simple, 0.6 us LL", "nvlink")


def _pcie(key: str, gigatransfers: float) -> Link:
    """PCIe x16: GT/s per lane x 16 lanes x 128b/130b encoding, in bytes per direction."""
    beta = gigatransfers * 1e9 * 16 * 128 / 130 / 8
    return Link(key, PCIE_ALPHA, beta, f"PCI-SIG: {gigatransfers:.0f} GT/s x 16 lanes, 128b/130b = {beta / 1e9:.3g} "
                                       f"GB/s each way; {_NCCL_LAT}, PCI 5.7 us Simple, 1.0 us LL", "pci")


def _network(key: str, gigabits: float, port: str) -> Link:
    """A network port is quoted in bits per second and direction: beta is that / 8."""
    return Link(key, NETWORK_ALPHA, gigabits * 1e9 / 8,
                f"{port}: {gigabits:.0f} Gb/s per port and direction = {gigabits / 8:.3g} GB/s; {_NCCL_LAT}, "
                f"network 14 us Simple, 2.7 us LL", "net")


LINKS: dict[str, Link] = {lk.name: lk for lk in (
    _nvlink("NVLink 5 (B200)", 1800e9, "HGX B200 specifications (NVLink 5, 18 links x 100 GB/s)"),
    _nvlink("NVLink 4 (H100)", 900e9, "H100 datasheet"),
    _nvlink("NVLink 4 (H800)", 400e9, "NVIDIA H800 SXM5 specifications (NVLink reduced from the H100's 900 GB/s)"),
    _nvlink("NVLink 3 (A100)", 600e9, "A100 datasheet"),
    _pcie("PCIe 5.0 x16", 32),
    _pcie("PCIe 4.0 x16", 16),
    _network("InfiniBand NDR 400G", 400, "ConnectX-7"),
    _network("InfiniBand HDR 200G", 200, "ConnectX-6"),
    _network("Ethernet 100G", 100, "IEEE 802.3 100GBASE Ethernet (RoCE or TCP; NCCL prices every network alike)"),
    _network("Ethernet 10G", 10, "IEEE 802.3 10GBASE Ethernet"),
)}
"""Every link of the course by its one key: NVLink generations inside a node, PCIe, and networks between nodes."""


_Entry = TypeVar("_Entry", GPU, Link)


def _lookup(table: dict[str, _Entry], key: str | _Entry, what: str) -> _Entry:
    if not isinstance(key, str):
        return key
    if key not in table:
        raise ValueError(f"unknown {what} {key!r}; the catalogue has {list(table)}")
    return table[key]


def gpu(key: str | GPU) -> GPU:
    """The catalogue's GPU ``key`` (a :class:`GPU` is returned as it is)."""
    return _lookup(GPUS, key, "GPU")


def link(key: str | Link) -> Link:
    """The catalogue's link ``key`` (a :class:`Link` is returned as it is)."""
    return _lookup(LINKS, key, "link")


FLASH_ATTENTION_BY_LENGTH: dict[str, tuple[tuple[int, float], ...]] = {
    "causal": ((512, 191), (1024, 260), (2048, 298), (4096, 319), (8192, 333), (16384, 335)),
    "full": ((512, 309), (1024, 350), (2048, 362), (4096, 368), (8192, 370), (16384, 370)),
}
"""FlashAttention-2's forward speed (TFLOP/s) by sequence length on an H100 SXM5, head dim 128, with and without
the causal mask, as the FlashAttention-3 paper plots it (Shah et al. 2024, Figure 5; 16K tokens per batch): a
short block leaves the GPU's SMs idle and pays the softmax and the causal diagonal more often."""


@functools.lru_cache(maxsize=1_000)
def attention_length_factor(seq_len: int, cp: int = 1) -> float:
    """The attention kernel's speed at this rank's blocks over its speed at 16K tokens (1 at 16K and beyond),
    each kind against its own 16K speed, interpolated in log2 of the length (clamped at 512). Without CP one
    causal block of s; with ring CP (Liu et al. 2023) each rank computes cp blocks of s/cp: its diagonal one
    causal, 1/cp of the work, the other cp - 1 unmasked (the work-weighted harmonic mean of the two)."""
    def relative(kind: str, n: float) -> float:
        pts = FLASH_ATTENTION_BY_LENGTH[kind]
        x = min(max(math.log2(n), math.log2(pts[0][0])), math.log2(pts[-1][0]))
        for (n0, v0), (n1, v1) in itertools.pairwise(pts):
            if x <= math.log2(n1):
                return (v0 + (v1 - v0) * (x - math.log2(n0)) / (math.log2(n1) - math.log2(n0))) / pts[-1][1]
        return 1.0

    n = seq_len / cp
    return 1 / (1 / cp / relative("causal", n) + (1 - 1 / cp) / relative("full", n))
