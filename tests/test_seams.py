"""R25: a region is registered in chunks of at most ``max_register_bytes`` whose seams fall on row boundaries; the
sim flags a copy whose host span lies in two registrations (``crosses_registration``).

Small caps (a few KiB) stand in for upstream's 64 GiB. The CuPy backend's side (the memcpy path never merges a run
across a seam) is tested in test_backends_cupy.py, on the fake runtime and on a GPU.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from _support import cspec, gspec, make_worker
from hypothesis import given
from hypothesis import strategies as st

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.region import PAGE
from kvoffload_ref.seams import DEFAULT_MAX_REGISTER_BYTES, gaps, register_chunks, row_pages, touched
from kvoffload_ref.shared_region import SharedRegion
from kvoffload_ref.specs import TensorGeometry


def _straddlers(chunks: list[tuple[int, int]], tensors: list[TensorGeometry]) -> list[tuple[int, int]]:
    """(tensor, row) of every row holding a seam strictly inside it (brute force)."""
    seams = [ptr for ptr, _ in chunks[1:]]
    return [(t, i) for t, g in enumerate(tensors) for i in range(g.rows)
            for s in seams if g.ptr + i * g.row_stride < s < g.ptr + i * g.row_stride + g.row_bytes]


def _check_chunks(ptr: int, nbytes: int, tensors: list[TensorGeometry], cap: int) -> list[tuple[int, int]]:
    chunks = register_chunks(ptr, nbytes, tensors, cap, PAGE)
    assert chunks[0][0] == ptr and sum(n for _, n in chunks) == nbytes
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(chunks)), "contiguous, in order"
    assert all(a % PAGE == 0 for a, _ in chunks), "every seam is page-aligned"
    assert _straddlers(chunks, tensors) == []
    for a, n in chunks:
        if n > cap:  # only where no seam lies within the cap
            assert register_chunks(a, n, tensors, cap, PAGE)[0][1] == n
            assert not any(_straddlers([(a, 0), (s, 0)], tensors) == [] for s in range(a + PAGE, a + cap + 1, PAGE))
    return chunks


def _layout(*page_bytes: int) -> kv.KVCacheLayout:
    return kv.KVCacheLayout(tensor_page_bytes=page_bytes, groups=(tuple(kv.LayerRef(t, p)
                                                                         for t, p in enumerate(page_bytes)),))


@pytest.mark.rule("R25")
def test_seams_default_cap_is_64_gib_and_registers_a_small_region_whole() -> None:
    assert DEFAULT_MAX_REGISTER_BYTES == 64 << 30
    be = SimBackend()
    region = kv.HostRegion.allocate(be, _layout(1024), 3, 8)
    assert region.max_register_bytes == DEFAULT_MAX_REGISTER_BYTES
    region.pin()
    assert be.registrations() == [(region.ptr, region.ptr + region.nbytes)]
    region.release()


@pytest.mark.rule("R25")
@pytest.mark.parametrize(("pages", "bpc", "cap"), [
    ((1024, 2048), 1, 3 * PAGE),      # rows dividing the page: seams every few rows
    ((512,), 3, 2 * PAGE),            # 1536-byte rows: a row boundary meets a page boundary every 8 rows
    ((3 * PAGE,), 1, PAGE),           # a row larger than the cap: each row is registered whole
    ((PAGE, PAGE + 512), 2, 5 * PAGE),
])
def test_seams_of_a_host_region_fall_on_row_boundaries(pages: tuple[int, ...], bpc: int, cap: int) -> None:
    be = SimBackend()
    region = kv.HostRegion.allocate(be, _layout(*pages), bpc, 24, max_register_bytes=cap)
    chunks = _check_chunks(region.ptr, region.nbytes, list(region.geometries()), cap)
    assert len(chunks) > 2
    region.pin()
    assert be.registrations() == [(a, a + n) for a, n in chunks], "one host_register per chunk"
    assert region.pinned_ranges == len(chunks)
    if pages == (3 * PAGE,):
        assert all(n == 3 * PAGE for _, n in chunks), "registered whole, never split"
    region.release()
    assert be.ledger.live() == {}


@pytest.mark.rule("R25")
def test_seams_the_smaller_of_the_region_cap_and_pin_chunk_bytes_applies() -> None:
    be = SimBackend()
    region = kv.HostRegion.allocate(be, _layout(PAGE), 1, 16, max_register_bytes=4 * PAGE)
    assert len(region.registration_chunks()) == 4
    assert len(region.registration_chunks(2 * PAGE)) == 8
    assert len(region.registration_chunks(64 << 30)) == 4  # the workers' default pin_chunk_bytes changes nothing
    region.release()
    with pytest.raises(kv.InvalidTransferError, match=r"^max_register_bytes "):
        kv.HostRegion.allocate(be, _layout(PAGE), 1, 16, max_register_bytes=0)


@pytest.mark.rule("R25")
@given(rows=st.lists(st.tuples(st.integers(1, 3 * PAGE), st.integers(0, 600)), min_size=1, max_size=3),
       count=st.integers(1, 12), cap=st.integers(1, 8 * PAGE))
def test_seams_never_fall_inside_a_row_for_any_geometry(rows: list[tuple[int, int]], count: int, cap: int) -> None:
    base, tensors, offset = 1 << 30, [], 0
    for row_bytes, pad in rows:  # tensors one after another, page-aligned, rows strided by row + pad
        tensors.append(TensorGeometry(base + offset, count, row_bytes, row_bytes + pad))
        offset = -(-(offset + (count - 1) * (row_bytes + pad) + row_bytes) // PAGE) * PAGE
    _check_chunks(base, offset, tensors, cap)


@pytest.mark.rule("R25")
def test_seams_of_a_shared_region_fall_on_this_ranks_rows(tmp_path: Any) -> None:
    be = SimBackend()
    region = SharedRegion.open("engine-seams", backend=be, layout=_layout(1536), blocks_per_chunk=1,
                               num_cpu_chunks=12, rank=1, world_size=3, directory=str(tmp_path), timeout=1.0,
                               max_register_bytes=3 * PAGE)
    try:
        chunks = _check_chunks(region.ptr, region.nbytes, list(region.geometries()), 3 * PAGE)
        assert len(chunks) > 2
        region.pin()
        assert be.registrations() == [(a, a + n) for a, n in chunks]
    finally:
        region.release()
    assert be.ledger.live() == {}


@pytest.mark.rule("R25")
@pytest.mark.rule("R2")
def test_seams_a_failed_chunk_rolls_back_the_registered_ones_in_reverse_order() -> None:
    calls: list[tuple[str, int]] = []

    class Recording(SimBackend):
        def host_register(self, ptr: int, nbytes: int) -> None:
            super().host_register(ptr, nbytes)
            calls.append(("register", ptr))

        def host_unregister(self, ptr: int) -> None:
            calls.append(("unregister", ptr))
            super().host_unregister(ptr)

    be = Recording(faults=kv.FaultPlan([kv.Fault("host_register", "error", nth=4)]))
    region = kv.HostRegion.allocate(be, _layout(1024), 3, 16, max_register_bytes=3 * PAGE)  # 3 KiB rows
    chunks = region.registration_chunks()
    with pytest.raises(kv.DeviceError):
        region.pin()
    registered = [p for c, p in calls if c == "register"]
    assert registered == [a for a, _ in chunks[:3]]
    assert [p for c, p in calls if c == "unregister"] == registered[::-1]
    assert not region.pinned and be.registrations() == [] and "pinned" not in be.ledger.live()
    region.release()
    assert be.ledger.live() == {}


def _rig(be: SimBackend, rows: int, row_bytes: int) -> tuple[np.ndarray[Any, Any], Any, int]:
    host = np.zeros(rows * row_bytes + PAGE, np.uint8)
    ptr = -(-int(host.ctypes.data) // PAGE) * PAGE
    be.track_host(ptr, rows * row_bytes)
    dev = be.from_host(np.arange(rows * row_bytes, dtype=np.uint8).reshape(rows, row_bytes))
    return host, dev, ptr


@pytest.mark.rule("R25")
def test_seams_the_sim_flags_a_descriptor_spanning_two_registrations() -> None:
    be = SimBackend()
    host, dev, ptr = _rig(be, 4, PAGE)
    be.host_register(ptr, 2 * PAGE)
    be.host_register(ptr + 2 * PAGE, 2 * PAGE)
    assert be.registrations() == [(ptr, ptr + 2 * PAGE), (ptr + 2 * PAGE, ptr + 4 * PAGE)]
    g = be.array_info(dev)
    stream, end = be.create_stream(), be.create_event()
    good, bad = be.alloc_descriptors(2), be.alloc_descriptors(1)
    # A good plan: two adjacent descriptors, one per registration (the sim merges nothing).
    count = good.fill(np.array([g.ptr, g.ptr + 2 * PAGE], np.int64), np.array([ptr, ptr + 2 * PAGE], np.int64),
                      np.array([2 * PAGE, 2 * PAGE], np.int64))
    be.copy_batch(stream, good, count, tag=("store", 1))
    assert be.violations == []
    # A deliberately bad plan: one descriptor over the seam, submitted straight to the backend.
    count = bad.fill(np.array([g.ptr + PAGE], np.int64), np.array([ptr + PAGE], np.int64),
                     np.array([2 * PAGE], np.int64))
    be.copy_batch(stream, bad, count, tag=("store", 2))
    be.record(end, stream)
    be.synchronize(end)
    (v,) = be.violations
    assert (v.kind, v.tag) == ("crosses_registration", ("store", 2))
    assert f"{ptr:#x}" in v.detail and f"{ptr + 2 * PAGE:#x}" in v.detail and "destination" in v.detail
    for buf in (good, bad):
        be.free_descriptors(buf)
    be.destroy_event(end)
    be.destroy_stream(stream)
    be.host_unregister(ptr + 2 * PAGE)
    be.host_unregister(ptr)
    be.untrack_host(ptr)
    assert be.ledger.live() == {} and len(be.violations) == 1
    del host


@pytest.mark.rule("R25")
def test_seams_a_worker_over_a_finely_chunked_region_never_crosses_a_registration() -> None:
    """1536-byte pages, 4608-byte CPU rows and a 4 KiB cap: page-rounded chunks would cut pages (the sim would
    flag the descriptors); row-aligned seams cut none."""
    be = SimBackend()
    region = kv.HostRegion.allocate(be, _layout(1536, 1536), 3, 32, max_register_bytes=PAGE)
    be, w, gpu = make_worker(be, layout=_layout(1536, 1536), region=region, num_cpu_chunks=32)
    assert region.pinned_ranges > 4
    expected = [be.to_host(a)[:39].copy() for a in gpu]
    chunks = list(range(0, 26, 2))  # 13 chunks of 3 blocks: 39 blocks
    w.submit_store(1, gspec(range(39)), cspec(chunks))
    w.wait({1})
    w.submit_load(2, cspec(chunks), gspec(range(20, 59)))
    w.wait({2})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True), (2, True)]
    assert be.violations == []
    for before, after in zip(expected, gpu, strict=True):
        assert np.array_equal(be.to_host(after)[20:59], before)
    w.shutdown()
    assert be.ledger.live() == {}


# -- R29: which registrations a quarantine keeps ---------------------------------------------------------------------
_TENSORS = st.lists(st.tuples(st.integers(1, 300), st.integers(0, 200), st.integers(1, 12)), min_size=1, max_size=3)


def _laid_out(shapes: list[tuple[int, int, int]]) -> list[TensorGeometry]:
    """Tensors of (row_bytes, padding, rows) one after another, each on a page boundary, from address PAGE on."""
    tensors, at = [], PAGE
    for row_bytes, pad, rows in shapes:
        tensors.append(TensorGeometry(ptr=at, rows=rows, row_bytes=row_bytes, row_stride=row_bytes + pad))
        at = -(-(at + rows * (row_bytes + pad)) // PAGE) * PAGE
    return tensors


@pytest.mark.rule("R29")
@given(shapes=_TENSORS, cap=st.integers(1, 3 * PAGE), data=st.data())
def test_touched_keeps_exactly_the_registrations_meeting_a_kept_row(shapes: list[tuple[int, int, int]], cap: int,
                                                                    data: st.DataObject) -> None:
    tensors = _laid_out(shapes)
    end = -(-(tensors[-1].ptr + tensors[-1].rows * tensors[-1].row_stride) // PAGE) * PAGE
    chunks = register_chunks(PAGE, end - PAGE, tensors, cap, PAGE)
    rows = sorted(data.draw(st.sets(st.integers(0, min(g.rows for g in tensors) - 1))))
    spans = [(g.ptr + r * g.row_stride, g.ptr + r * g.row_stride + g.row_bytes) for g in tensors for r in rows]
    want = [any(a < hi and lo < a + n for lo, hi in spans) for a, n in chunks]  # brute force
    assert touched(chunks, tensors, np.array(rows, dtype=np.int64)) == want
    pages = row_pages(tensors, np.array(rows, dtype=np.int64), PAGE)
    assert all(any(a <= lo and hi <= b for a, b in pages) for lo, hi in spans), "every kept row's pages kept"
    assert all(a % PAGE == 0 and b % PAGE == 0 and a < b for a, b in pages)
    assert all(b < c for (_, b), (c, _) in itertools.pairwise(pages)), "merged, in order"
    assert all(any(a < hi and lo < b for lo, hi in spans) for a, b in pages), "no page kept for nothing"


@pytest.mark.rule("R29")
def test_gaps_is_the_rest_of_the_region() -> None:
    assert gaps(0, 100, [(10, 20), (15, 30), (50, 60)]) == [(0, 10), (30, 50), (60, 100)]
    assert gaps(0, 100, []) == [(0, 100)] and gaps(0, 100, [(0, 100)]) == []
    assert gaps(0, 100, [(90, 120), (0, 5)]) == [(5, 90)]
