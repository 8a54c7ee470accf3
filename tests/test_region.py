"""HostRegion: geometry, chunked pinning with reverse rollback, R3's release order, quarantine."""

from __future__ import annotations

import gc
import logging
import mmap
from typing import Any

import numpy as np
import pytest
from _support import cspec, gspec, make_worker, messages, patterned_gpu, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.region import PAGE


class RecordingSim(SimBackend):
    """Records the region-related calls in order."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[str, int]] = []

    def host_register(self, ptr: int, nbytes: int) -> None:
        super().host_register(ptr, nbytes)
        self.calls.append(("register", ptr))

    def host_unregister(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr))
        super().host_unregister(ptr)

    def untrack_host(self, ptr: int) -> None:
        self.calls.append(("untrack", ptr))
        super().untrack_host(ptr)


def test_region_geometry_one_page_aligned_segment_per_tensor() -> None:
    be = SimBackend()
    layout = kv.KVCacheLayout(tensor_page_bytes=(512, 640), groups=((kv.LayerRef(0, 512), kv.LayerRef(1, 600)),))
    region = kv.HostRegion.allocate(be, layout, 3, 10)
    g0, g1 = region.geometries()
    assert (g0.rows, g0.row_bytes, g0.row_stride) == (10, 1536, 1536)
    assert (g1.rows, g1.row_bytes, g1.row_stride) == (10, 1920, 1920)
    assert g0.ptr == region.ptr and (g1.ptr - region.ptr) % PAGE == 0 and g1.ptr - g0.ptr >= 15360
    snap = region.snapshot()
    assert [s.shape for s in snap] == [(10, 1536), (10, 1920)] and not any(s.any() for s in snap)
    region.release()


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("bpc", "chunks"), [(0, 4), (1, 0), (-1, 4), (1.5, 4)])
def test_region_rejects_bad_sizes(bpc: Any, chunks: Any) -> None:
    with pytest.raises(kv.InvalidTransferError):
        kv.HostRegion.allocate(SimBackend(), small_layout(), bpc, chunks)


@pytest.mark.rule("R2")
def test_region_pin_failure_rolls_back_in_reverse_order() -> None:
    be = RecordingSim(faults=kv.FaultPlan([kv.Fault("host_register", "error", nth=4)]))
    region = kv.HostRegion.allocate(be, small_layout(), 3, 64)  # 2 x 64 x 1536 bytes = 48 pages
    with pytest.raises(kv.DeviceError):
        region.pin(chunk_bytes=4 * PAGE)
    registered = [p for c, p in be.calls if c == "register"]
    unregistered = [p for c, p in be.calls if c == "unregister"]
    assert len(registered) == 3 and unregistered == registered[::-1]
    assert not region.pinned and "pinned" not in be.ledger.live()
    region.release()
    assert be.ledger.live() == {}


@pytest.mark.rule("R3")
def test_region_release_order_unregister_reverse_then_unmap(caplog: Any) -> None:
    be = RecordingSim()
    region = kv.HostRegion.allocate(be, small_layout(), 3, 64)
    region.pin(chunk_bytes=8 * PAGE)
    be.calls.clear()
    assert region.release() == []
    unregs = [p for c, p in be.calls if c == "unregister"]
    assert unregs == sorted(unregs, reverse=True) and len(unregs) == len(region.registration_chunks(8 * PAGE))
    assert be.calls[-1] == ("untrack", region.ptr), "unmapped only after every range was unregistered"
    assert region.release() == [] and be.calls.count(("untrack", region.ptr)) == 1, "released at most once"
    assert be.ledger.live() == {}
    with pytest.raises(kv.OwnershipError):
        region.snapshot()


@pytest.mark.rule("R3")
def test_region_failed_unregister_is_logged_and_release_goes_on(caplog: Any) -> None:
    be = RecordingSim(faults=kv.FaultPlan([kv.Fault("host_unregister", "error", nth=2, status=713)]))
    region = kv.HostRegion.allocate(be, small_layout(), 3, 64)
    region.pin(chunk_bytes=16 * PAGE)
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        failures = region.release()
    assert failures == ["host_unregister failed (status 713)"]
    assert "cudaHostUnregister failed for rank=0 (code=713)" in messages(caplog)
    assert ("untrack", region.ptr) in be.calls, "the next steps still ran"
    assert be.ledger.leaked() == {"pinned": 1} and be.ledger.live() == {}


@pytest.mark.rule("R3")
def test_region_refuses_to_unmap_under_a_live_view(caplog: Any) -> None:
    be = SimBackend()
    region = kv.HostRegion.allocate(be, small_layout(), 1, 4)
    leaked_view = region._views[0]
    with caplog.at_level(logging.ERROR, logger="kvoffload_ref"):
        failures = region.release()
    assert failures and failures[0].startswith("mmap close failed")
    assert "Failed to close mmap_obj" in messages(caplog)
    assert leaked_view[0, 0] == 0, "the view still points at mapped memory (no segfault)"
    assert be.ledger.leaked() == {"mapping": 1}
    assert any(item.obj is not None and item.reason == "a view is still exported" for item in kv.quarantined())


@pytest.mark.rule("R12")
def test_region_quarantine_keeps_memory_mapped_and_listed() -> None:
    be = SimBackend()
    region = kv.HostRegion.allocate(be, small_layout(), 1, 4)
    region.pin()
    region.adopt()
    region.quarantine_by_owner("test")
    assert region.state.value == "quarantined"
    assert be.ledger.quarantined() == {"mapping": 1, "pinned": 1} and be.ledger.live() == {}
    assert any(item.obj is region and item.kind == "region" for item in kv.quarantined())
    assert np.frombuffer(region._mmap, np.uint8)[0] == 0, "still mapped"  # type: ignore[arg-type]
    assert region.release_by_owner() == [], "a quarantined region is never released later"


# ------------------------------------------------------------------------------------ one integer validator


@pytest.mark.rule("R7")
@pytest.mark.parametrize("as_int", [int, np.int64, np.int32, np.uint16], ids=["int", "int64", "int32", "uint16"])
def test_region_accepts_numpy_integer_sizes_like_the_planner(as_int: Any) -> None:
    """One validator everywhere: a numpy integer is an int for the region, the planner and create_worker."""
    be = SimBackend()
    region = kv.HostRegion.allocate(be, small_layout(), as_int(3), as_int(4))
    assert type(region.num_cpu_chunks) is int and region.geometries()[0].row_bytes == 3 * 512
    region.release()
    gpu = patterned_gpu(be, small_layout())
    worker = kv.create_worker(be, gpu, small_layout(), blocks_per_chunk=as_int(2), num_cpu_chunks=as_int(4))
    worker.submit_store(1, gspec([5, 9, 1]), cspec([2, 0]))
    worker.wait({1})
    assert [r.success for r in worker.get_finished()] == [True]
    report = worker.shutdown()
    assert report.region == "released" and be.ledger.live() == {}


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("bpc", "chunks", "name"), [
    (True, 4, "blocks_per_chunk"), (2, np.True_, "num_cpu_chunks"), (2.0, 4, "blocks_per_chunk"),
    (np.float32(2), 4, "blocks_per_chunk"), (2, "4", "num_cpu_chunks"),
])
def test_region_and_create_worker_refuse_bools_and_non_ints_by_name(bpc: Any, chunks: Any, name: str) -> None:
    be = SimBackend()
    with pytest.raises(kv.InvalidTransferError, match=rf"^{name} must be an int, got "):
        kv.HostRegion.allocate(be, small_layout(), bpc, chunks)
    with pytest.raises(kv.InvalidTransferError, match=rf"^{name} must be an int, got "):
        kv.create_worker(be, patterned_gpu(be, small_layout()), small_layout(), blocks_per_chunk=bpc,
                         num_cpu_chunks=chunks)
    assert be.ledger.live().get("mapping", 0) == 0


@pytest.mark.rule("R7")
@pytest.mark.parametrize("create", ["allocate", "create_worker", "create_reference_worker"])
def test_region_too_big_to_map_names_the_field_the_size_and_a_value_that_fits(create: str) -> None:
    """``num_cpu_chunks=2**40`` (3 PiB: more than an x86-64 or arm64 address space) once gave a bare
    ``[Errno 12] Cannot allocate memory``: the OSError now names the field, its value, the size and an example."""
    be = SimBackend()
    with pytest.raises(OSError, match=r"num_cpu_chunks=1099511627776 with blocks_per_chunk=3 ") as info:
        if create == "allocate":
            kv.HostRegion.allocate(be, small_layout(), 3, 2**40)
        else:
            getattr(kv, create)(be, patterned_gpu(be, small_layout()), small_layout(), blocks_per_chunk=3,
                                num_cpu_chunks=2**40)
    text = str(info.value)
    assert info.value.errno is not None and "GiB" in text and str(3 * 1024 * 2**40) in text
    example = int(text.split("e.g. num_cpu_chunks=")[1].split(",", maxsplit=1)[0])
    kv.HostRegion.allocate(be, small_layout(), 3, example).release()  # the example maps
    assert be.ledger.live().get("mapping", 0) == 0


# ---------------------------------------------------------------------------------- the backend it was built on


@pytest.mark.rule("R7")
def test_region_knows_its_backend_and_refuses_another() -> None:
    be, other = SimBackend(), SimBackend()
    region = kv.HostRegion.allocate(be, small_layout(), 1, 4)
    try:
        assert region.backend is be
        region.check_backend(be)
        region.check_backend(kv.FaultyBackend(be, kv.FaultPlan()))  # the same device through a wrapper
        with pytest.raises(kv.InvalidTransferError,
                           match=r"^backend: the region was built on backend 'sim', not on the worker's backend 'sim': "
                                 r"expected the worker's backend \(e\.g\. HostRegion\.allocate\(backend, \.\.\.\)"):
            region.check_backend(other)
    finally:
        region.release()


@pytest.mark.rule("R7")
def test_region_built_on_a_wrapper_accepts_the_wrapped_backend() -> None:
    inner = SimBackend()
    region = kv.HostRegion.allocate(kv.FaultyBackend(inner, kv.FaultPlan()), small_layout(), 1, 4)
    region.check_backend(inner)
    with pytest.raises(kv.InvalidTransferError):
        region.check_backend(SimBackend())
    region.release()


# --------------------------------------------------------------------------- a caller-owned region dropped


@pytest.mark.rule("R3")
def test_region_dropped_by_its_caller_is_released_by_its_finalizer(caplog: Any) -> None:
    be = RecordingSim()
    region = kv.HostRegion.allocate(be, small_layout(), 3, 64)
    region.pin(chunk_bytes=8 * PAGE)
    ptr, ranges = region.ptr, region.pinned_ranges
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        del region
        gc.collect()
    assert any(m.startswith("HostRegion of ") and "dropped without release(); releasing it now" in m
               for m in messages(caplog))
    assert [c for c, _ in be.calls].count("unregister") == ranges and be.calls[-1] == ("untrack", ptr)
    assert be.ledger.live() == {} and be.ledger.leaked() == {}
    # The backend no longer tracks the memory: a new worker on it is built (no "overlaps live memory").
    _, worker, _ = make_worker(be)
    worker.shutdown()
    assert be.ledger.live() == {}


@pytest.mark.rule("R1")
def test_region_dropped_while_worker_owned_stays_the_workers() -> None:
    be = SimBackend()
    gpu = patterned_gpu(be, small_layout())
    region = kv.HostRegion.allocate(be, small_layout(), 3, 16)
    worker = kv.create_worker(be, gpu, small_layout(), blocks_per_chunk=3, num_cpu_chunks=16, region=region)
    del region
    gc.collect()
    assert be.ledger.live().get("mapping") == 1, "the worker's region is not released behind its back"
    worker.submit_store(1, gspec([1, 2, 3]), cspec([0]))
    worker.wait({1})
    assert [r.success for r in worker.get_finished()] == [True]
    assert worker.shutdown().region == "released" and be.ledger.live() == {}


@pytest.mark.rule("R12")
def test_region_dropped_after_quarantine_stays_mapped_and_pinned() -> None:
    be = SimBackend()
    region = kv.HostRegion.allocate(be, small_layout(), 1, 4)
    region.pin()
    region.adopt()
    region.quarantine_by_owner("test")
    ptr = region.ptr
    del region
    gc.collect()
    assert be.ledger.quarantined() == {"mapping": 1, "pinned": 1} and be.ledger.released() == {}
    (kept,) = [item.obj for item in kv.quarantined() if isinstance(item.obj, kv.HostRegion) and item.obj.ptr == ptr]
    assert np.frombuffer(kept._mmap, np.uint8)[0] == 0, "still mapped"  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------- R7: every number

BAD_INTS = [10**400, -10**400, float("nan"), float("inf"), True, "1", -1]
BAD_INT_IDS = ["10**400", "-10**400", "nan", "inf", "True", "str", "-1"]


@pytest.mark.rule("R7")
@pytest.mark.parametrize("value", BAD_INTS, ids=BAD_INT_IDS)
@pytest.mark.parametrize("name", ["blocks_per_chunk", "num_cpu_chunks"])
def test_region_allocate_refuses_bad_numbers_and_maps_nothing(name: str, value: Any) -> None:
    be = SimBackend()
    sizes: dict[str, Any] = {"blocks_per_chunk": 2, "num_cpu_chunks": 4, name: value}
    with pytest.raises(kv.InvalidTransferError, match=rf"^{name} "):
        kv.HostRegion.allocate(be, small_layout(), sizes["blocks_per_chunk"], sizes["num_cpu_chunks"])
    assert be.ledger.live() == {}


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("bpc", "chunks"), [(2**62, 4), (2**40, 2**40), (2**63 - 1, 2**63 - 1)])
def test_region_allocate_refuses_a_region_larger_than_an_address_spans(bpc: int, chunks: int) -> None:
    be = SimBackend()
    with pytest.raises(kv.InvalidTransferError, match=r"bytes: expected at most 9223372036854775807$"):
        kv.HostRegion.allocate(be, small_layout(), bpc, chunks)
    assert be.ledger.live() == {}


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(num_cpu_chunks=3), r"^tensor 0 ends at byte 12288, beyond the mapping of 8192 bytes$"),
    (dict(offsets=[4096]), r"^tensor 0 ends at byte 12288, beyond the mapping of 8192 bytes$"),
    (dict(row_strides=[2048]), r"^row_strides\[0\] = 2048 is smaller than its row"),
    (dict(row_strides=[8192]), r"^tensor 0 ends at byte 12288, beyond the mapping"),
    (dict(row_bytes=[4096, 4096]), r"^offsets, row_bytes and row_strides must be as long as one another"),
    (dict(offsets=[0.0]), r"^offsets\[0\] must be an int"),
    (dict(row_bytes=[True]), r"^row_bytes\[0\] must be an int"),
    (dict(num_cpu_chunks=10**400), r"^num_cpu_chunks must be an int in \[1, "),
    (dict(num_cpu_chunks=float("nan")), r"^num_cpu_chunks must be an int"),
    (dict(offsets=[-1]), r"^offsets\[0\] must be an int in \[0, "),
    (dict(row_strides="4096"), r"^row_strides must be a sequence of ints"),
])
def test_region_constructor_refuses_views_outside_its_mapping(kwargs: dict[str, Any], message: str) -> None:
    """A view past the mapping would be a window onto memory the region does not own: refused before any view
    is made or anything is announced to the backend."""
    import mmap

    be = SimBackend()
    mapping = mmap.mmap(-1, 2 * PAGE)
    args: dict[str, Any] = {"offsets": [0], "row_bytes": [4096], "num_cpu_chunks": 2, **kwargs}
    with pytest.raises(kv.InvalidTransferError, match=message):
        kv.HostRegion(be, mapping, args["offsets"], args["row_bytes"], args["num_cpu_chunks"],
                      row_strides=args.get("row_strides"))
    assert be.ledger.live() == {}
    mapping.close()   # no view was exported: the caller's mapping closes


@pytest.mark.rule("R7")
@pytest.mark.parametrize("value", [*BAD_INTS[1:], 0, 1.5], ids=[*BAD_INT_IDS[1:], "0", "1.5"])
def test_region_pin_refuses_bad_chunk_sizes_and_pins_nothing(value: Any) -> None:
    """(A huge int is a valid chunk size: one registration for the whole region; no float is computed from it.)"""
    be = SimBackend()
    region = kv.HostRegion.allocate(be, small_layout(), 2, 4)
    with pytest.raises(kv.InvalidTransferError, match=r"^pin_chunk_bytes "):
        region.pin(value)
    assert not region.pinned and "pinned" not in be.ledger.live()
    region.release()


# -- R29: quarantine by registration, on the region itself ----------------------------------------------------------
def _adopted(be: Any, *, pin: bool = True) -> kv.HostRegion:
    """A worker-owned region of 2 tensors x 32 rows of 512 bytes: with pin(4096), four registrations per tensor."""
    region = kv.HostRegion.allocate(be, small_layout(), 1, 32)
    if pin:
        region.pin(4096)
    region.adopt()
    return region


def _pages_of_row(region: kv.HostRegion, row: int) -> list[tuple[int, int]]:
    """(offset, length) of the page holding row ``row`` of each tensor (a row of 512 bytes lies in one page)."""
    page = 4096
    return [((g.ptr - region.ptr + row * g.row_stride) // page * page, page) for g in region.geometries()]


@pytest.mark.rule("R29")
def test_region_quarantine_without_chunks_keeps_the_whole_region() -> None:
    be = SimBackend()
    region = _adopted(be)
    region.quarantine_by_owner("test")
    assert region.kept_ranges == (kv.KeptRange(0, region.nbytes, "test"),)
    assert region.quarantined_bytes == region.nbytes and len(be.registrations()) == 8
    assert be.ledger.quarantined() == {"pinned": 8, "mapping": 1} and be.ledger.live() == {}


@pytest.mark.rule("R29")
@pytest.mark.rule("R3")
def test_region_quarantine_of_no_chunks_releases_the_region() -> None:
    be = RecordingSim()
    region = _adopted(be)
    be.calls.clear()
    assert region.quarantine_by_owner("test", chunks=[]) == []
    assert region.state is kv.lifecycle.RegionState.RELEASED and region.kept_ranges == ()
    assert [c for c, _ in be.calls] == ["unregister"] * 8 + ["untrack"], "R3's release, whole"
    assert be.ledger.live() == {} and be.ledger.quarantined() == {}


@pytest.mark.rule("R29")
@pytest.mark.rule("R3")
def test_region_quarantine_by_registration_unregisters_newest_first_then_unmaps_the_rest() -> None:
    be = RecordingSim()
    region = _adopted(be)
    pieces: list[tuple[int, int]] = []
    real = be.untrack_host_pages
    be.untrack_host_pages = lambda p, n: pieces.append((p, n)) or real(p, n)  # type: ignore[method-assign]
    be.calls.clear()
    assert region.quarantine_by_owner("test", chunks={3, 9}) == []
    kept = [(a - region.ptr, n) for a, n in region.registration_chunks(4096)][:2]
    kept += [(a - region.ptr, n) for a, n in region.registration_chunks(4096)][4:6]
    assert [(k.offset, k.length) for k in region.kept_ranges] == [(0, 8192), (16384, 8192)] == [
        (kept[0][0], 8192), (kept[2][0], 8192)], "rows 3 and 9 of each tensor: the first two of its four"
    unregs = [p for c, p in be.calls if c == "unregister"]
    assert unregs == sorted(unregs, reverse=True) and len(unregs) == 4, "R3: newest first, the unkept only"
    assert pieces == [(region.ptr + 8192, 8192), (region.ptr + 24576, 8192)], "then the rest, unmapped"
    assert ("untrack", region.ptr) not in be.calls, "the mapping itself stays (kept in part)"


@pytest.mark.rule("R29")
def test_region_quarantine_of_an_unpinned_region_keeps_the_pages_of_the_rows() -> None:
    be = SimBackend()
    region = _adopted(be, pin=False)
    region.quarantine_by_owner("test", chunks=[9])
    assert [(k.offset, k.length) for k in region.kept_ranges] == _pages_of_row(region, 9)
    assert region.quarantined_resources == {"mapping": 1} and be.ledger.quarantined() == {"mapping": 1}


@pytest.mark.rule("R29")
@pytest.mark.parametrize("chunks", [[32], [-1], ["x"], [True]], ids=["past-the-end", "negative", "str", "bool"])
def test_region_quarantine_with_chunk_ids_naming_no_row_keeps_everything(chunks: list[Any], caplog: Any) -> None:
    be = SimBackend()
    region = _adopted(be)
    with caplog.at_level(logging.ERROR, logger="kvoffload_ref.region"):
        assert region.quarantine_by_owner("test", chunks=chunks) == []
    assert region.kept_ranges == (kv.KeptRange(0, region.nbytes, "test"),) and len(be.registrations()) == 8
    assert any("keeping the whole region" in m for m in messages(caplog))


@pytest.mark.rule("R29")
@pytest.mark.rule("R14")
def test_region_quarantine_by_registration_interrupted_keeps_what_it_did_not_give_back() -> None:
    be = SimBackend()
    region = _adopted(be)
    seen: list[str] = []

    def interrupt(point: str, tag: Any) -> None:
        seen.append(point)
        if point == "host_unregister" and seen.count(point) > 1:  # the second unregister on, every try
            raise KeyboardInterrupt

    be.on_call = interrupt
    with pytest.raises(KeyboardInterrupt):
        region.quarantine_by_owner("test", chunks=[9])
    be.on_call = None
    assert region.state is kv.lifecycle.RegionState.QUARANTINED
    assert len(be.registrations()) == 7, "one given back; the rest stays, kept"
    assert region.quarantined_resources == be.ledger.quarantined() == {"pinned": 7, "mapping": 1}
    assert be.ledger.live() == {} and not be.violations
    assert region.kept_ranges == (kv.KeptRange(0, region.nbytes, "test"),), "nothing unmapped: all of it kept"


class _NoPartialUnmapSim(SimBackend):
    """A device that models no page-granular unmap (as the CuPy backend): the mapping stays announced whole."""

    untrack_host_pages = None


@pytest.mark.rule("R29")
def test_region_quarantine_on_a_backend_without_partial_unmap_still_gives_the_pages_back() -> None:
    be = _NoPartialUnmapSim()
    region = _adopted(be)
    region._views[0][20] = 7  # rows written straight through the region's own view
    region._views[0][9] = 5
    region.quarantine_by_owner("test", chunks=[9])
    assert [(k.offset, k.length) for k in region.kept_ranges] == _pages_of_row(region, 9)
    assert len(be.registrations()) == 2 and be.ledger.quarantined() == {"pinned": 2, "mapping": 1}
    assert (region._views[0][9] == 5).all(), "the kept rows are untouched"
    if hasattr(mmap, "MADV_DONTNEED"):
        assert not region._views[0][20].any(), "the pages given back were released, the device told nothing"
    assert not be.violations
