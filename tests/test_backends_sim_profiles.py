"""The sim's named profiles against their source figures, each by running the sim under the profile on the
source's shape (the tolerance stated per figure), their provenance, and the path each variant forces."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.backends.sim_profiles import (
    GB200,
    H100,
    PROFILES,
    PROVENANCE,
    path_variant,
    paths_of,
    profile_named,
)
from kvoffload_ref.cost_table import CopyRig

ROOT = pathlib.Path(__file__).resolve().parents[1]
KiB, MiB, GB = 1024, 1024 * 1024, 1e9


def _time(profile: str, path: str, direction: str, size: int, count: int) -> float:
    """One copy of ``count`` scattered descriptors of ``size`` bytes, alone on an idle sim, on ``path``."""
    rig = CopyRig(profile_named(profile), path, size, count)   # type: ignore[arg-type]
    return rig.time(direction, count)   # type: ignore[arg-type]


def test_sim_profiles_provenance_names_every_profile_and_only_h200_is_measured_here() -> None:
    assert set(PROFILES) == {"simple", "h200", "h100", "mi300x", "mi355x", "gb200", "h20"}
    assert set(PROVENANCE) == set(PROFILES)
    assert {n for n, p in PROVENANCE.items() if p.kind == "measured here"} == {"h200"}
    for name in ("h100", "mi300x", "mi355x", "gb200", "h20"):
        prov = PROVENANCE[name]
        assert prov.kind == "from published figures" and prov.sources and prov.fitted_on and prov.assumed, name
    assert any("no public GB200 host<->GPU" in a for a in PROVENANCE["gb200"].assumed)
    with pytest.raises(ValueError, match="unknown sim profile 'a100'"):
        profile_named("a100")


def test_sim_profiles_the_docs_table_lists_every_profile_with_its_provenance() -> None:
    text = (ROOT / "docs" / "simulator.md").read_text(encoding="utf-8")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([^|]+?) \|", text, re.M)}
    assert {name: rows.get(name) for name in PROFILES} == {n: p.kind for n, p in PROVENANCE.items()}


def test_sim_profiles_path_variant_forces_each_path() -> None:
    for path in paths_of(H100):
        variant, copy_path = path_variant(H100, path)   # type: ignore[arg-type]
        be = SimBackend(profile=variant, copy_path=copy_path, trace=True)
        dev = be.array_info(be.empty_device((32, 4 * KiB))).ptr
        host = np.zeros(32 * 4 * KiB, np.uint8)
        hptr = int(host.ctypes.data)
        be.track_host(hptr, host.nbytes)
        be.host_register(hptr, host.nbytes)
        buf = be.alloc_descriptors(32)
        offsets = np.arange(32, dtype=np.int64) * 4 * KiB
        buf.fill(dev + offsets, hptr + offsets[::-1].copy(), np.full(32, 4 * KiB, np.int64))
        stream, end = be.create_stream(), be.create_event()
        be.copy_batch(stream, buf, 32)
        be.record(end, stream)
        be.synchronize(end)
        spans = [e for e in be.trace_document()["traceEvents"] if e.get("cat") == "copy"]
        assert spans[-1]["args"]["path"] == path
    assert paths_of(GB200) == ("memcpy", "dma")
    with pytest.raises(ValueError, match="no 'kernel' path"):
        path_variant(GB200, "kernel")


def test_sim_profiles_mi300x_per_entry_costs_of_vllm_40549() -> None:
    """vLLM #40549 on an MI300X: 4,096 entries of 4-8 KB take 22.4 ms by a per-op loop (~5.5 us per entry) and
    10.5 ms batched (~2.6 us); from 32 KB on batching gains nothing. Tolerance: +-5 % on each total, and the two
    paths within 5 % of each other from 32 KiB on."""
    loop = _time("mi300x", "memcpy", "d2h", 6 * KiB, 4096)
    batched = _time("mi300x", "dma", "d2h", 6 * KiB, 4096)
    assert loop == pytest.approx(22.4e-3, rel=0.05) and batched == pytest.approx(10.5e-3, rel=0.05)
    assert loop / 4096 == pytest.approx(5.5e-6, rel=0.05) and batched / 4096 == pytest.approx(2.6e-6, rel=0.05)
    for size in (32 * KiB, 64 * KiB, 256 * KiB, MiB):
        ratio = _time("mi300x", "dma", "d2h", size, 16) / _time("mi300x", "memcpy", "d2h", size, 16)
        assert ratio == pytest.approx(1.0, abs=0.05), (size, ratio)
    assert _time("mi300x", "dma", "h2d", 6 * KiB, 4096) == pytest.approx(batched), "one value for both directions"


#: ROCm/clr #273, MI355X (gfx950, ROCm 7.13), D2H: size -> (hipMemcpyBatchAsync GB/s, per-op hipMemcpyAsync GB/s).
MI355X_D2H = {4 * KiB: (1.7, 1.7), 16 * KiB: (6.7, 6.6), 64 * KiB: (4.1, 6.3), 256 * KiB: (30, 18), MiB: (52, 37)}
#: The same, H2D.
MI355X_H2D = {4 * KiB: (1.7, 1.6), 16 * KiB: (5.7, 6.1), 64 * KiB: (3.8, 5.7), 256 * KiB: (12.8, 17.8), MiB: (30, 37)}


def _mi355x_gbps(direction: str, figures: dict[int, tuple[float, float]]) -> dict[int, dict[str, float]]:
    """Each size on both paths against #273's GB/s in ``direction``, within +-5 % (a batch of up to 16 MiB, so
    that the 14 us call is under 1 % of it; the source does not state its counts); returns the GB/s measured."""
    measured = {}
    for size, (batched, per_op) in figures.items():
        count = min(4096, 16 * MiB // size)
        gbps = {path: count * size / _time("mi355x", path, direction, size, count) / GB for path in ("dma", "memcpy")}
        assert gbps["dma"] == pytest.approx(batched, rel=0.05), (direction, size, gbps)
        assert gbps["memcpy"] == pytest.approx(per_op, rel=0.05), (direction, size, gbps)
        measured[size] = gbps
    return measured


def test_sim_profiles_mi355x_d2h_bandwidths_of_rocm_clr_273() -> None:
    """Each of the five D2H sizes on both paths within +-5 % of #273's GB/s: batched slower at 64 KiB, faster at
    256 KiB and 1 MiB."""
    measured = _mi355x_gbps("d2h", MI355X_D2H)
    assert measured[64 * KiB]["dma"] < 0.7 * measured[64 * KiB]["memcpy"], "batched slower at 64 KiB"
    assert measured[MiB]["dma"] > 1.3 * measured[MiB]["memcpy"], "batched faster at 1 MiB"
    assert measured[256 * KiB]["dma"] > 1.5 * measured[256 * KiB]["memcpy"]


def test_sim_profiles_mi355x_h2d_bandwidths_of_rocm_clr_273() -> None:
    """Each of the five H2D sizes on both paths within +-5 % of #273's GB/s: unlike D2H, batched loads are slower
    than per-op from 16 KiB on (at 256 KiB and 1 MiB too)."""
    measured = _mi355x_gbps("h2d", MI355X_H2D)
    for size in (16 * KiB, 64 * KiB, 256 * KiB, MiB):
        assert measured[size]["dma"] < measured[size]["memcpy"], ("batched loads slower", size)


def _saving(profile: str, size: int, count: int = 256) -> float:
    """How much shorter one batched copy is than the per-op loop of the same descriptors."""
    return 1 - _time(profile, "dma", "d2h", size, count) / _time(profile, "memcpy", "d2h", size, count)


def test_sim_profiles_gb200_batching_saves_6_percent_against_35_on_h100() -> None:
    """torchcomms #2195: batching a multi-request put (1 B-64 KB) saves 6 % on GB200 (3.36 -> 3.15 us) and 35 %
    on an x86 H100 (3.55 -> 2.30 us). Tolerance: GB200's saving 6 % +-1 point at 1 and 4 KiB (256 copies: the
    14 us call shared by both paths dilutes it a little), at most 6 % at 64 KiB; h100's at least 35 % at 1 and
    4 KiB; GB200's loop costs 3.36 / 3.55 of h100's per copy (+-1 %)."""
    for size in (KiB, 4 * KiB):
        assert _saving("gb200", size) == pytest.approx(0.06, abs=0.01), size
        assert _saving("h100", size) >= 0.35, size
    assert 0 < _saving("gb200", 64 * KiB) <= 0.06
    per_copy = {p: _time(p, "memcpy", "d2h", KiB, 257) - _time(p, "memcpy", "d2h", KiB, 1) for p in ("gb200", "h100")}
    assert per_copy["gb200"] / per_copy["h100"] == pytest.approx(3.36 / 3.55, rel=0.01)


def test_sim_profiles_h20_large_contiguous_bandwidths_of_kvcached_450() -> None:
    """kvcached #450 / agentic-kvc pcie.json: large contiguous copies ~54 GB/s H2D, ~50 GB/s D2H on an H20. One
    128 MiB copy each way within +-5 % of its own direction's figure, and loads faster than stores by the source's
    ratio 54/50 (+-1 %: one value for both directions, e.g. their mean, fails it)."""
    rig = CopyRig(profile_named("h20"), "memcpy", 128 * MiB, 1)
    load, store = (128 * MiB / rig.time(d, 1) / GB for d in ("h2d", "d2h"))   # type: ignore[arg-type]
    assert load == pytest.approx(54, rel=0.05) and store == pytest.approx(50, rel=0.05), (load, store)
    assert load / store == pytest.approx(54 / 50, rel=0.01), (load, store)


#: vLLM #42212 on an H100: batched DMA of N >= 50k small pages, GB/s by page size.
H100_DMA = {4 * KiB: 3.8, 24 * KiB: 7.0, 28 * KiB: 42.0, 64 * KiB: 52.0}


def test_sim_profiles_h100_figures_of_vllm_42212_and_its_blog() -> None:
    """#42212's batched DMA GB/s at each page size within +-3 % (32 MiB batches: the 14 us call is under 2 % of
    each); the blog's ~50 GB/s for large pinned copies within +-5 % (2 MiB pages, DMA and kernel, the rate of
    16 more pages) and its 83.4 GB/s for a DMA store and load of 2 MB blocks together within +-2 %."""
    for size, gbps in H100_DMA.items():
        count = 32 * MiB // size
        assert count * size / _time("h100", "dma", "h2d", size, count) / GB == pytest.approx(gbps, rel=0.03), size
    for path in ("dma", "kernel"):   # steady state: 16 more pages of 2 MiB, the fixed cost paid once
        rig = CopyRig(H100, path, 2 * MiB, 32)   # type: ignore[arg-type]
        extra = rig.time("d2h", 32) - rig.time("d2h", 16)
        assert 16 * 2 * MiB / extra / GB == pytest.approx(50, rel=0.05), path
    store, load = CopyRig(H100, "dma", 2 * MiB, 32).duplex(16)
    assert 2 * 16 * 2 * MiB / max(store, load) / GB == pytest.approx(83.4, rel=0.02)
