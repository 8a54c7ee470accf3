"""The simulated device's cost profiles: names and overrides, the copy-path rule shared with the CuPy backend, the
shared link (half each in one direction, full duplex up to a cap), compute slowed by kernel copies, pageable
memory, and the h200 profile's calibration against the figures recorded on an H200 (docs/gpu-check.json)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

import kvoffload_ref as kv
from kvoffload_ref.backends import _cupy_copy, copy_paths
from kvoffload_ref.backends import cupy as cupy_backend
from kvoffload_ref.backends._simcost import CostProfile, PathCost
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.backends.sim_profiles import H200, PROFILES, SIMPLE
from kvoffload_ref.bench.calibration import PATHS, RECORDED_H200, SCHEDULES, calibration_ratios
from kvoffload_ref.errors import InvalidTransferError

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = 64 * 1024
GB = 1e9

#: A profile with round numbers: no fixed cost, every path at the link's 10 GB/s, duplex cap 15 GB/s.
FLAT = CostProfile("flat", 0.0, PathCost(0.0, 0.0, ((1, 10 * GB),)), PathCost(0.0, 0.0, ((1, 10 * GB),)), None,
                   link_bandwidth=10 * GB, bidirectional_bandwidth=15 * GB, pageable_bandwidth=1 * GB,
                   compute_slowdown=1.5)


class Rig:
    """A device array and a host array of ``rows`` pages, the host side pinned unless ``pinned=False``."""

    def __init__(self, be: SimBackend, rows: int = 64, pinned: bool = True) -> None:
        self.be = be
        self.dev = be.empty_device((rows, PAGE))
        self.g = be.array_info(self.dev)
        self.host = np.zeros(rows * PAGE, np.uint8)
        self.hptr = int(self.host.ctypes.data)
        be.track_host(self.hptr, self.host.nbytes)
        if pinned:
            be.host_register(self.hptr, self.host.nbytes)

    def copy(self, direction: str, rows: range, job: int) -> tuple[object, object]:
        """Submit one copy of ``rows`` on a fresh stream between two events; returns them."""
        be = self.be
        ids = np.array(rows, np.int64)
        dev, host = self.g.ptr + ids * PAGE, self.hptr + ids * PAGE
        src, dst = (dev, host) if direction == "store" else (host, dev)
        buf = be.alloc_descriptors(len(ids))
        buf.fill(src, dst, np.full(len(ids), PAGE, np.int64))
        stream, start, end = be.create_stream(), be.create_event(), be.create_event()
        be.record(start, stream)
        be.copy_batch(stream, buf, len(ids), tag=(direction, job))
        be.record(end, stream)
        return start, end

    def took(self, events: tuple[object, object]) -> float:
        self.be.synchronize(events[1])
        return self.be.elapsed(*events)  # type: ignore[arg-type]


def test_sim_cost_profiles_by_name_with_overrides() -> None:
    assert {"simple", "h200", "h100"} <= set(PROFILES)
    assert kv.get_backend("sim").profile == SIMPLE, "the default stays the historical model"
    be = kv.get_backend("sim", profile="h200")
    assert be.profile == H200
    tuned = kv.get_backend("sim", profile="h200", latency=1e-6, pinned_bandwidth=40e9, pageable_bandwidth=2e9)
    assert (tuned.profile.call_cost, tuned.profile.link_bandwidth, tuned.profile.pageable_bandwidth) == \
        (1e-6, 40e9, 2e9)
    assert kv.get_backend("sim", profile=FLAT).profile.name == "flat"
    with pytest.raises(InvalidTransferError, match="unknown sim profile"):
        kv.get_backend("sim", profile="a100")
    with pytest.raises(InvalidTransferError, match="copy_path"):
        SimBackend(copy_path="fast")  # type: ignore[arg-type]


def test_sim_cost_simple_profile_is_the_historical_model() -> None:
    rig = Rig(SimBackend())
    a, b = rig.copy("store", range(0, 8), 1), rig.copy("store", range(8, 16), 2)
    expected = 5e-6 + 8 * PAGE / 25e9
    assert rig.took(a) == pytest.approx(expected) and rig.took(b) == pytest.approx(expected), "no sharing"


def test_sim_cost_two_copies_in_one_direction_share_the_link() -> None:
    rig = Rig(SimBackend(profile=FLAT))
    alone = rig.took(rig.copy("store", range(0, 16), 1))
    assert alone == pytest.approx(16 * PAGE / (10 * GB))
    a, b = rig.copy("store", range(16, 32), 2), rig.copy("store", range(32, 48), 3)
    assert rig.took(a) == pytest.approx(2 * alone) and rig.took(b) == pytest.approx(2 * alone), "half each"
    # on the h200 profile too: two concurrent kernel-path stores each get about half the link
    h200 = Rig(SimBackend(profile="h200"))
    solo = h200.took(h200.copy("store", range(0, 16), 1)) - 43e-6
    c, d = h200.copy("store", range(16, 32), 2), h200.copy("store", range(32, 48), 3)
    shared = h200.took(c) - 43e-6
    assert h200.took(d) == pytest.approx(h200.took(c))
    assert shared == pytest.approx(16 * PAGE / (H200.link_bandwidth / 2), rel=1e-6) and shared > 1.8 * solo


def test_sim_cost_a_copy_that_ends_gives_its_share_back() -> None:
    rig = Rig(SimBackend(profile=FLAT))
    short, long = rig.copy("load", range(0, 8), 1), rig.copy("load", range(8, 24), 2)
    unit = 8 * PAGE / (10 * GB)   # 8 pages alone
    assert rig.took(short) == pytest.approx(2 * unit)          # shared the whole time
    assert rig.took(long) == pytest.approx(2 * unit + unit)    # then 8 pages left, alone


def test_sim_cost_opposite_directions_run_full_duplex_up_to_the_cap() -> None:
    roomy = dataclasses.replace(FLAT, bidirectional_bandwidth=20 * GB)
    for profile, rate in ((roomy, 10 * GB), (FLAT, 7.5 * GB)):
        rig = Rig(SimBackend(profile=profile))
        store, load = rig.copy("store", range(0, 16), 1), rig.copy("load", range(16, 32), 2)
        assert rig.took(store) == pytest.approx(16 * PAGE / rate), profile
        assert rig.took(load) == pytest.approx(16 * PAGE / rate), profile


#: FLAT with loads apart: the path moves loads at 16 GB/s (stores 10), the load link carries 12 GB/s (stores 10).
DIRS = dataclasses.replace(FLAT, name="dirs",
                           memcpy=PathCost(0.0, 0.0, ((1, 10 * GB),), load_bandwidth=((1, 16 * GB),)),
                           kernel=PathCost(0.0, 0.0, ((1, 10 * GB),), load_bandwidth=((1, 16 * GB),)),
                           load_link_bandwidth=12 * GB, bidirectional_bandwidth=100 * GB)


def test_sim_cost_each_direction_reads_its_own_bandwidth_and_link() -> None:
    """A load reads the path's ``load_bandwidth`` under the ``load_link_bandwidth`` (16 capped at 12 GB/s); a store
    reads ``bandwidth`` under ``link_bandwidth`` (10); two loads share the load link, two stores the store link;
    without the load fields both directions read the store's values (FLAT: every existing profile)."""
    rig = Rig(SimBackend(profile=DIRS))
    assert rig.took(rig.copy("load", range(0, 16), 1)) == pytest.approx(16 * PAGE / (12 * GB))
    assert rig.took(rig.copy("store", range(0, 16), 2)) == pytest.approx(16 * PAGE / (10 * GB))
    pair = [rig.copy("load", range(0, 16), 3), rig.copy("load", range(16, 32), 4)]
    assert [rig.took(e) for e in pair] == pytest.approx([16 * PAGE / (6 * GB)] * 2), "half the load link each"
    pair = [rig.copy("store", range(0, 16), 5), rig.copy("store", range(16, 32), 6)]
    assert [rig.took(e) for e in pair] == pytest.approx([16 * PAGE / (5 * GB)] * 2), "half the store link each"
    roomy = Rig(SimBackend(profile=dataclasses.replace(DIRS, load_link_bandwidth=20 * GB)))
    assert roomy.took(roomy.copy("load", range(0, 16), 1)) == pytest.approx(16 * PAGE / (16 * GB)), "the path's"
    same = Rig(SimBackend(profile=FLAT))
    assert same.took(same.copy("load", range(0, 16), 1)) == same.took(same.copy("store", range(0, 16), 2))
    assert (DIRS.link("h2d"), DIRS.link("d2h"), DIRS.link("local"), FLAT.link("h2d")) == \
        (12 * GB, 10 * GB, 10 * GB, 10 * GB)
    assert (DIRS.memcpy.rate(PAGE, "h2d"), DIRS.memcpy.rate(PAGE, "d2h"), DIRS.memcpy.rate(PAGE, "local")) == \
        (16 * GB, 10 * GB, 10 * GB), "a local copy reads the store's points"


def test_sim_cost_duplex_cap_scales_each_directions_own_rate() -> None:
    """A store at 10 GB/s and a load at 12 together under a 15 GB/s cap: both scaled by 15/22 until the load ends;
    the store's last sixth (it moved 10/12 of its bytes by then) then runs alone at 10 GB/s."""
    rig = Rig(SimBackend(profile=dataclasses.replace(DIRS, bidirectional_bandwidth=15 * GB)))
    store, load = rig.copy("store", range(0, 16), 1), rig.copy("load", range(16, 32), 2)
    both = 16 * PAGE / (12 * GB * 15 / 22)
    assert rig.took(load) == pytest.approx(both)
    assert rig.took(store) == pytest.approx(both + 16 * PAGE * (1 - 10 / 12) / (10 * GB))


def test_sim_cost_an_explicit_pinned_bandwidth_is_both_directions_link() -> None:
    be = SimBackend(profile=DIRS, pinned_bandwidth=5 * GB)
    assert (be.profile.link_bandwidth, be.profile.load_link_bandwidth) == (5 * GB, None)
    rig = Rig(be)
    assert rig.took(rig.copy("load", range(0, 16), 1)) == pytest.approx(16 * PAGE / (5 * GB))
    assert SimBackend(profile=DIRS).profile.load_link_bandwidth == 12 * GB, "the profile's, unless overridden"


@pytest.mark.rule("R7")
def test_sim_cost_per_direction_fields_are_validated() -> None:
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(InvalidTransferError, match="load_link_bandwidth"):
            dataclasses.replace(FLAT, load_link_bandwidth=bad)
    for points in ((), ((1, 0.0),), ((4096, GB), (1024, GB)), ((0, GB),), ((1.5, GB),), ((1, "fast"),), [(1, GB)]):
        with pytest.raises(InvalidTransferError, match="PathCost load_bandwidth"):
            PathCost(0.0, 0.0, ((1, GB),), load_bandwidth=points)  # type: ignore[arg-type]
        with pytest.raises(InvalidTransferError, match="PathCost bandwidth"):
            PathCost(0.0, 0.0, points)  # type: ignore[arg-type]


def test_sim_cost_links_are_shared_across_workers_on_one_device() -> None:
    be = SimBackend(profile=FLAT)
    rig_a, rig_b = Rig(be), Rig(be)   # two owners of memory (e.g. two workers), one device
    a, b = rig_a.copy("store", range(0, 16), 1), rig_b.copy("store", range(0, 16), 1)
    assert rig_a.took(a) == pytest.approx(2 * 16 * PAGE / (10 * GB)) == rig_b.took(b)


def test_sim_cost_path_choice_is_the_cupy_backends_rule() -> None:
    assert _cupy_copy.choose_path is copy_paths.choose_path, "one function, not two copies"
    assert cupy_backend.DEFAULT_KERNEL_MIN_COUNT is copy_paths.DEFAULT_KERNEL_MIN_COUNT
    assert cupy_backend.DEFAULT_KERNEL_MAX_MEAN_BYTES is copy_paths.DEFAULT_KERNEL_MAX_MEAN_BYTES
    assert (H200.kernel_min_count, H200.kernel_max_mean_bytes) == (copy_paths.DEFAULT_KERNEL_MIN_COUNT,
                                                                   copy_paths.DEFAULT_KERNEL_MAX_MEAN_BYTES)
    for pinned in (True, False):
        for mode in ("auto", "kernel", "memcpy"):
            for count in (1, 15, 16, 40):
                be = SimBackend(profile="h200", copy_path=mode, trace=True)  # type: ignore[arg-type]
                rig = Rig(be, pinned=pinned)
                rig.took(rig.copy("store", range(count), 1))
                spans = [e for e in be.trace_document()["traceEvents"] if e.get("cat") == "copy"]
                want = copy_paths.choose_path(mode, count=count, total_bytes=count * PAGE,  # type: ignore[arg-type]
                                              legal=pinned)
                assert spans[-1]["args"]["path"] == want, (pinned, mode, count)
    h100 = SimBackend(profile="h100", trace=True)
    rig = Rig(h100)
    rig.took(rig.copy("load", range(4), 1))
    copies = [e for e in h100.trace_document()["traceEvents"] if e.get("cat") == "copy"]
    assert copies[-1]["args"]["path"] == "dma", "batched DMA where memcpy would be"


@pytest.mark.rule("R25")
def test_sim_cost_memcpy_runs_break_at_registration_seams_as_on_the_cupy_backend() -> None:
    """The memcpy path pays per contiguous run, and a run never crosses a registration seam (R25) -- the count the
    CuPy backend's ``coalesce`` issues, from the one rule both call (``copy_paths.run_starts``)."""
    per_run = 1e-6
    profile = dataclasses.replace(FLAT, memcpy=PathCost(0.0, per_run, ((1, 10 * GB),)))
    took = {}
    for halves in (False, True):
        be = SimBackend(profile=profile, copy_path="memcpy")
        rig = Rig(be, pinned=False)
        half = 32 * PAGE
        for start, size in ((rig.hptr, half), (rig.hptr + half, half)) if halves else ((rig.hptr, 2 * half),):
            be.host_register(start, size)
        took[halves] = rig.took(rig.copy("store", range(16, 48), 1))   # 32 rows, contiguous on both sides
        assert not be.violations, "each descriptor lies in one registration"
    assert took[True] - took[False] == pytest.approx(per_run), "the seam at row 32 starts a second run"
    assert _cupy_copy.coalesce is not None and _cupy_copy.run_starts is copy_paths.run_starts
    src = np.arange(16, 48, dtype=np.int64) * PAGE
    seams = copy_paths.registration_seams([(0, 32 * PAGE), (32 * PAGE, 64 * PAGE)])
    runs = _cupy_copy.coalesce(src, src + 10**9, np.full(32, PAGE, np.int64), seams)
    assert runs[2].tolist() == [16 * PAGE, 16 * PAGE], "the CuPy backend issues the same two runs"


def test_sim_cost_compute_is_slowed_while_a_kernel_copy_runs() -> None:
    be = SimBackend(profile=FLAT, copy_path="kernel")
    rig = Rig(be)
    rig.copy("store", range(0, 32), 1)   # 32 pages at 10 GB/s: about 210 us
    be.clock_advance(1e-6)               # the copy has started
    be.enqueue_compute_write(be.empty_device((4, 64)), [0], 1, 50e-6, stream="other")
    marker = be.create_event()
    be.record(marker, be.compute_stream("other"))
    be.synchronize(marker)
    assert be.monotonic() == pytest.approx(1e-6 + 75e-6), "1.5 x 50 us: the kernel copy occupies SMs"
    plain = SimBackend(profile=FLAT, copy_path="memcpy")
    Rig(plain).copy("store", range(0, 32), 1)
    plain.clock_advance(1e-6)
    plain.enqueue_compute_write(plain.empty_device((4, 64)), [0], 1, 50e-6, stream="other")
    marker = plain.create_event()
    plain.record(marker, plain.compute_stream("other"))
    plain.synchronize(marker)
    assert plain.monotonic() == pytest.approx(1e-6 + 50e-6), "a memcpy-path copy does not slow compute"


def test_sim_cost_pageable_host_memory_keeps_its_own_bandwidth() -> None:
    rig = Rig(SimBackend(profile=FLAT), pinned=False)
    assert rig.took(rig.copy("store", range(0, 16), 1)) == pytest.approx(16 * PAGE / (1 * GB))


def test_sim_cost_recorded_figures_are_docs_gpu_check_json() -> None:
    doc = json.loads((ROOT / "docs" / "gpu-check.json").read_text())
    assert [(r["page"], r["count"]) for r in doc["main"][::2]] == list(SCHEDULES)
    for row in doc["main"]:
        recorded = RECORDED_H200[(row["page"], row["direction"])]
        for path in PATHS:
            assert recorded[path] == pytest.approx(row["gbps"][path], abs=1e-3), (row["page"], path)


@pytest.mark.parametrize("link_model", ["fair", "fifo"])
def test_sim_cost_h200_profile_reproduces_the_recorded_h200_figures(link_model: str) -> None:
    """Every path of the six schedules within +-15 % of the H200's figures, under either link model (gpu_bench runs
    one copy at a time: the models order copies differently but price one alike)."""
    ratios = calibration_ratios("h200", link_model=link_model)  # type: ignore[arg-type]
    assert set(ratios) == set(RECORDED_H200)
    bad = {(page, d, p): round(r, 3) for (page, d), row in ratios.items() for p, r in row.items()
           if not 0.85 <= r <= 1.15}
    assert not bad, f"modelled/recorded outside 0.85..1.15 ({link_model}): {bad}"


def _scattered_4k_copy(profile: str, copy_path: str, count: int = 128) -> tuple[float, str]:
    """One store of ``count`` scattered 4 KiB descriptors (every other page on both sides) on a pinned host;
    returns (the copy's duration, its path)."""
    page = 4 * 1024
    be = SimBackend(profile=profile, copy_path=copy_path, trace=True)  # type: ignore[arg-type]
    dev = be.array_info(be.empty_device((2 * count, page)))
    host = np.zeros(2 * count * page, np.uint8)
    hptr = int(host.ctypes.data)
    be.track_host(hptr, host.nbytes)
    be.host_register(hptr, host.nbytes)
    rows = np.arange(count, dtype=np.int64) * 2 * page
    buf = be.alloc_descriptors(count)
    buf.fill(dev.ptr + rows, hptr + rows, np.full(count, page, np.int64))
    stream, start, end = be.create_stream(), be.create_event(), be.create_event()
    be.record(start, stream)
    be.copy_batch(stream, buf, count, tag=("store", 1))
    be.record(end, stream)
    be.synchronize(end)
    spans = [e for e in be.trace_document()["traceEvents"] if e.get("cat") == "copy"]
    return be.elapsed(start, end), str(spans[-1]["args"]["path"])


def test_sim_cost_a_batch_is_priced_by_its_descriptors_size_not_its_total() -> None:
    """vLLM #42212 measured batched DMA at 3.8 GB/s for 4 KiB descriptors (the h100 profile's first ``dma`` point,
    docs/simulator.md's table): a batch of 128 x 4 KiB (512 KiB in all) must move at that rate, not at the
    52 GB/s its total size would read off the same curve."""
    count, nbytes = 128, 128 * 4 * 1024
    took, path = _scattered_4k_copy("h100", "memcpy")
    assert path == "dma", "batched DMA where memcpy would be"
    link_rate = nbytes / (took - PROFILES["h100"].call_cost)   # the DMA path has no other fixed term
    assert link_rate == pytest.approx(3.8 * GB, rel=0.01)
    assert nbytes / took == pytest.approx(3.45 * GB, rel=0.02), "end to end, the 14 us call cost included"
    # The kernel path reads its curve the same way: 35 GB/s at 4 KiB descriptors (nvbandwidth #24), not ~47 GB/s.
    took, path = _scattered_4k_copy("h100", "auto", count)
    assert path == "kernel"
    fixed = PROFILES["h100"].call_cost + (PROFILES["h100"].kernel.launch if PROFILES["h100"].kernel else 0.0)
    assert nbytes / (took - fixed) == pytest.approx(35 * GB, rel=0.01)
