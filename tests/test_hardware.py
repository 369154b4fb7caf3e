"""The hardware catalogue: one key and one set of numbers per GPU and link, each with its source, and every
consumer (planner, widgets, serving budget and roofline) holding the catalogue's own objects, not copies.
Also the floors the catalogue's move restored: no runtime module imports ``viz``, ``memory`` no ``parallel``."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import course_lib
from course_lib.estimates import hardware
from course_lib.estimates.hardware import GPU, GPUS, LINKS, Link, gpu, link
from course_lib.planner import search as planner

GB = 1e9
ROOT = Path(course_lib.__file__).parent


def _modules() -> list:
    """Every module of course_lib, imported (``__main__`` modules left out: importing them runs a CLI)."""
    names = [m.name for m in pkgutil.walk_packages(course_lib.__path__, "course_lib.")
             if not m.name.endswith("__main__")]
    return [importlib.import_module(n) for n in names]


# ------------------------------------------------------------------------------------------------ the entries


def test_one_key_per_entry_and_the_key_is_the_name() -> None:
    assert all(key == g.name for key, g in GPUS.items())
    assert all(key == lk.name for key, lk in LINKS.items())
    # one entry per GPU model: no two entries share the same numbers under two keys
    # (the H800 is the H100 with a slower NVLink: its link tells them apart)
    numbers = [(g.nominal_gib, g.peak_flops, g.mem_bandwidth, g.intra_link) for g in GPUS.values()]
    assert len(set(numbers)) == len(numbers)
    assert {"A100 40GB", "A100 80GB", "H100 80GB", "H800 80GB", "H200 141GB", "B200 180GB"} <= set(GPUS)


def test_every_entry_has_a_source() -> None:
    for g in GPUS.values():
        assert "NVIDIA" in g.source and len(g.source) > 40, g.name
    for lk in LINKS.values():
        assert any(v in lk.source for v in ("datasheet", "specifications", "PCI-SIG", "IEEE", "ConnectX")), lk.name
        assert "NCCL src/graph/tuning.cc hwLat" in lk.source, lk.name  # where alpha comes from


def test_entries_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        GPUS["H100 80GB"].peak_flops = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        LINKS["NVLink 4 (H100)"].alpha = 0.0  # type: ignore[misc]


def test_gpu_numbers_follow_the_datasheets_dense_convention() -> None:
    h100, h200, a100 = gpu("H100 80GB"), gpu("H200 141GB"), gpu("A100 80GB")
    assert h100.peak_flops == 989e12 and a100.peak_flops == 312e12  # half the "with sparsity" figures
    assert h200.peak_flops == h100.peak_flops and h200.mem_bandwidth > h100.mem_bandwidth  # same die, HBM3e
    assert a100.fp8_flops is None and gpu("A100 40GB").fp8_flops is None  # Ampere has no fp8 tensor cores
    for g in GPUS.values():
        if g.fp8_flops is not None:
            assert g.fp8_flops == pytest.approx(2 * g.peak_flops, rel=1e-3), g.name
    assert h100.bytes == 80 * 2**30 and h100.gb == pytest.approx(85.9, abs=0.05)
    assert gpu("A100 40GB").mem_bandwidth < a100.mem_bandwidth  # HBM2 vs HBM2e
    # ridge point of the H100 (the roofline chapter's 295 FLOP/byte)
    assert h100.peak_flops / h100.mem_bandwidth == pytest.approx(295, abs=1)


def test_link_bandwidths_are_per_direction() -> None:
    assert link("NVLink 5 (B200)").beta == 900 * GB
    assert link("NVLink 4 (H100)").beta == 450 * GB
    assert link("NVLink 3 (A100)").beta == 300 * GB
    assert link("PCIe 5.0 x16").beta == pytest.approx(63.0 * GB, rel=1e-3)
    assert link("PCIe 4.0 x16").beta == pytest.approx(31.5 * GB, rel=1e-3)
    assert link("InfiniBand NDR 400G").beta == 50 * GB
    assert link("InfiniBand HDR 200G").beta == 25 * GB
    assert link("Ethernet 100G").beta == 12.5 * GB and link("Ethernet 10G").beta == 1.25 * GB


def test_one_nvlink_latency_nccls_ring_step() -> None:
    """alpha is NCCL's per-step latency of a ring (hwLat, Simple): one value for every NVLink generation."""
    assert {lk.alpha for k, lk in LINKS.items() if k.startswith("NVLink")} == {hardware.NVLINK_ALPHA} == {3.4e-6}
    assert {lk.alpha for k, lk in LINKS.items() if k.startswith("PCIe")} == {hardware.PCIE_ALPHA} == {5.7e-6}
    assert {lk.alpha for k, lk in LINKS.items() if k.startswith(("InfiniBand", "Ethernet"))} == {14e-6}
    assert hardware.NETWORK_ALPHA == 14e-6


def test_nccls_latency_table_per_protocol_is_tuning_cc() -> None:
    """NCCL 2.30.7 src/graph/tuning.cc: hwLat's ring row (LL, LL128, Simple) per link kind, baseLat's ring row, and
    the share of the bus bandwidth each protocol carries; each catalogue link reads its own row."""
    assert hardware.NCCL_RING_LATENCY == {"nvlink": {"LL": 0.6e-6, "LL128": 1.9e-6, "Simple": 3.4e-6},
                                          "pci": {"LL": 1.0e-6, "LL128": 2.5e-6, "Simple": 5.7e-6},
                                          "net": {"LL": 2.7e-6, "LL128": 4.0e-6, "Simple": 14e-6}}
    assert hardware.NCCL_RING_BASE_LATENCY == {"LL": 6.6e-6, "LL128": 14e-6, "Simple": 8.4e-6}
    assert hardware.NCCL_PROTOCOL_BANDWIDTH == {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}
    kinds = {"NVLink": "nvlink", "PCIe": "pci", "InfiniBand": "net", "Ethernet": "net"}
    for key, lk in LINKS.items():
        kind = next(v for k, v in kinds.items() if key.startswith(k))
        assert lk.nccl_link == kind and lk.protocol_alpha("Simple") == lk.alpha, key
        assert lk.protocol_alpha("LL") == hardware.NCCL_RING_LATENCY[kind]["LL"] < lk.alpha, key
        assert " LL" in lk.source, key  # both latencies are named with their source
    assert link("NVLink 4 (H100)").shared_by(2).protocol_alpha("LL") == 0.6e-6
    free = hardware.Link("free", 0.0, 1e12, "an idealisation")
    assert free.protocol_alpha("LL") == 0.0
    with pytest.raises(ValueError, match="unknown NCCL protocol 'LL64'"):
        free.protocol_alpha("LL64")


def test_intra_links_are_catalogue_keys() -> None:
    assert {g.intra_link for g in GPUS.values()} <= set(LINKS)
    assert gpu("H100 80GB").intra_link == "NVLink 4 (H100)" and gpu("A100 40GB").intra_link == "NVLink 3 (A100)"


def test_lookups_name_the_valid_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown GPU 'H100_SXM'.*'H100 80GB'"):
        gpu("H100_SXM")
    with pytest.raises(ValueError, match=r"unknown link 'nvlink4_h100'.*'NVLink 4 \(H100\)'"):
        link("nvlink4_h100")
    assert gpu(GPUS["H200 141GB"]) is GPUS["H200 141GB"] and link(LINKS["PCIe 4.0 x16"]) is LINKS["PCIe 4.0 x16"]


def test_a_shared_link_divides_its_bandwidth_only() -> None:
    eth = link("Ethernet 100G")
    shared = eth.shared_by(8)
    assert (shared.alpha, shared.beta, shared.source) == (eth.alpha, eth.beta / 8, eth.source)
    assert "shared by 8" in shared.name and eth.beta == 12.5 * GB  # the catalogue's entry is unchanged
    with pytest.raises(ValueError, match="whole number >= 1"):
        eth.shared_by(0)


# ------------------------------------------------------------------------------------------------ the consumers


def test_planner_clusters_hold_the_catalogues_objects() -> None:
    dgx, pcie = planner.CLUSTERS["dgx-h100"], planner.CLUSTERS["pcie-h100-ethernet"]
    assert planner.H100 is GPUS["H100 80GB"] and planner.A100 is GPUS["A100 80GB"]
    assert dgx.gpu is GPUS["H100 80GB"] and pcie.gpu is GPUS["H100 80GB"]
    assert dgx.intra is LINKS["NVLink 4 (H100)"] and dgx.inter is LINKS["InfiniBand NDR 400G"]
    assert pcie.intra is LINKS["PCIe 5.0 x16"] and pcie.inter == LINKS["Ethernet 100G"].shared_by(8)
    assert planner.GPU is GPU and planner.Link is Link


def test_widgets_offer_the_catalogues_keys() -> None:
    from course_lib.viz import comm, memory, serving, tp, zero

    assert comm.LINKS is LINKS and memory.GPUS is GPUS and serving.GPUS is GPUS
    tpw = tp.TPCostWidget(draw=False)
    assert list(tpw.controls["gpu"].options) == list(GPUS) and list(tpw.controls["link"].options) == list(LINKS)
    assert list(memory.MemoryBudgetWidget(draw=False).controls["gpu"].options) == list(GPUS)
    assert list(zero.ZeroMemoryWidget(draw=False).controls["gpu"].options) == list(GPUS)
    assert list(serving.ServingBudgetPanel(draw=False).controls["gpu"].options) == list(GPUS)
    assert comm.CollectiveCostWidget(draw=False).links == LINKS


def test_serving_reads_the_catalogue() -> None:
    from course_lib.model_config import PRESETS
    from course_lib.serving.budget import predict
    from course_lib.serving.roofline import StepCost

    for key in ("A100 80GB", "H200 141GB", "B200 180GB"):
        g = GPUS[key]
        cost = StepCost.for_model("llama3-8b", key)
        assert (cost.peak_flops, cost.mem_bandwidth) == (g.peak_flops, g.mem_bandwidth)
        p = predict("llama3-8b", key, batch=4, context=1024)
        assert p.capacity_bytes == g.bytes
        assert p.memory_s == pytest.approx((p.budget["weights"] + p.budget["kv_cache"]) / g.mem_bandwidth)
    # TP's all-reduces ride the GPU's own link unless told otherwise
    c = PRESETS["llama3-70b"]
    a100, own, pcie = (predict(c, "A100 80GB", batch=8, tp=4, link=lk) for lk in (None, "NVLink 3 (A100)",
                                                                                    "PCIe 4.0 x16"))
    assert a100.comm_s == own.comm_s < pcie.comm_s
    with pytest.raises(ValueError, match="unknown GPU"):
        predict(c, "H100_SXM")


def test_no_module_keeps_its_own_gpu_or_link_table() -> None:
    """Every GPU or Link object reachable from a module's globals (tables, presets) is the catalogue's own, or
    derived from it (a link shared by a node's GPUs); no module defines another GPU or Link class."""
    catalogue = set(map(id, GPUS.values())) | set(map(id, LINKS.values()))
    for mod in _modules():
        if mod is hardware:
            continue
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and obj.__name__ in ("GPU", "Link"):
                assert obj is GPU or obj is Link, f"{mod.__name__}.{name} is another {obj.__name__} class"
            values = list(obj.values()) if isinstance(obj, dict) else [obj]
            for v in values:
                if isinstance(v, GPU):
                    assert id(v) in catalogue, f"{mod.__name__}.{name} holds a GPU that is not the catalogue's"
                for lk in (v.intra, v.inter) if isinstance(v, planner.Cluster) else (v,):
                    if isinstance(lk, Link) and id(lk) not in catalogue:
                        base = lk.name.split(", shared by")[0]
                        assert (base in LINKS and lk.alpha == LINKS[base].alpha) or lk.name == "free", \
                            f"{mod.__name__}.{name} holds a link that is not the catalogue's: {lk}"


# ------------------------------------------------------------------------------------------------ the floors


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_import_runs_back_up_a_floor() -> None:
    """Figures sit on top: nothing outside viz/ (but the grader and course/) imports it; the memory
    estimator imports no runtime (of parallel/ only pp_layers, the stage rule it shares with the pipeline,
    which imports nothing of the course); the catalogue imports nothing of the course."""
    top = {"viz", "grading", "course"}  # course/: the site, the handout, the learner's copy
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in top:
            continue
        bad = {m for m in _imports(path) if m.startswith("course_lib.viz")}
        assert not bad, f"{rel} imports {sorted(bad)}: figures depend on the library, never the other way"
    runtime = {m for m in _imports(ROOT / "estimates" / "memory.py")
               if m.startswith(("course_lib.parallel", "course_lib.runtime"))}
    assert runtime <= {"course_lib.parallel.pp_layers", "course_lib.parallel.pp_layers.layer_split"}, runtime
    assert not {m for m in _imports(ROOT / "parallel" / "pp_layers.py") if m.startswith("course_lib")}
    assert not {m for m in _imports(ROOT / "estimates" / "hardware.py") if m.startswith("course_lib")}
