"""The quarantine registry (quarantine.py): what a shutdown could not prove idle stays alive, listed, until exit."""

from __future__ import annotations

import ctypes
import gc
import mmap
import weakref
from typing import Any

import numpy as np
import pytest
from _support import CREATE, cspec, gspec, patterned_gpu, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends.base import DescriptorBuffer
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.region_keep import NOT_GIVEN_BACK


def _hung_shutdown(create: Any) -> tuple[SimBackend, kv.FaultPlan, kv.ShutdownReport, list[kv.QuarantinedItem]]:
    """A worker whose second load hangs on the sim, shut down under the quarantine policy; returns the sim, its
    plan, the report and what the shutdown added to the registry (the worker and its handlers are gone by then)."""
    plan = kv.FaultPlan([kv.Fault("copy", "hang", direction="load", job_id=4)])
    be = SimBackend(plan)
    layout = small_layout()
    worker = create(be, patterned_gpu(be, layout), layout, blocks_per_chunk=3, num_cpu_chunks=16,
                    policy=kv.ShutdownPolicy(timeout=0.5, on_unproven="quarantine"))
    worker.submit_store(1, gspec([1, 2]), cspec([1]))
    worker.submit_load(3, cspec([5]), gspec([30]))
    worker.submit_load(4, cspec([6]), gspec([31]))
    before = len(kv.quarantined())
    report = worker.shutdown()
    added = kv.quarantined()[before:]
    del worker
    gc.collect()
    return be, plan, report, added


@pytest.mark.rule("R10")
@pytest.mark.rule("R12")
@pytest.mark.rule("R16")
@pytest.mark.parametrize("worker", list(CREATE))
def test_quarantine_registry_keeps_unproven_descriptor_buffers_and_the_region(worker: str) -> None:
    be, plan, report, added = _hung_shutdown(CREATE[worker])
    assert plan.fired, "the load really hung"
    assert report.region == "quarantined" and report.device_sync == "timeout"
    ledger = be.ledger
    kept = set(ledger.keys("descriptor", "quarantined"))
    assert kept and report.quarantined.get("descriptor") == len(kept), "the hung load's descriptors are kept"
    # R12: the registry holds the very buffers the ledger calls quarantined (their ids are theirs while held),
    # each with its reason, and the region with its own.
    held = [item for item in added if item.kind == "descriptor"]
    assert {id(item.obj) for item in held} == kept, "a quarantined descriptor buffer missing from the registry"
    assert all(isinstance(item.obj, DescriptorBuffer) for item in held)
    assert all("not proven idle" in item.reason and "timeout" in item.reason for item in held), held
    (region,) = [item for item in added if item.kind == "region"]
    assert isinstance(region.obj, kv.HostRegion) and "not proven idle" in region.reason
    # Nothing but the registry holds the region now (the sim holds its own descriptor buffers): dropping the report
    # and collecting frees nothing -- a region let go of would be unmapped under the hung load.
    mapping = weakref.ref(region.obj)
    del report, added, held, region
    gc.collect()
    assert mapping() is not None, "the registry let go of the quarantined region"
    kept_now = {id(item.obj) for item in kv.quarantined() if item.kind == "descriptor"}
    assert kept <= kept_now, "the registry let go of a quarantined descriptor buffer"
    assert set(ledger.keys("descriptor", "quarantined")) == kept, "and the ledger still says quarantined"
    assert ledger.live() == {} and not be.violations



# -- R29: quarantine by registration ---------------------------------------------------------------------------------
# One page of 512-byte rows (blocks_per_chunk=1) per 4 KiB: with pin_chunk_bytes=4096 each tensor's 32 rows are four
# registrations of eight rows, eight registrations in all; chunk 9 lies in the second of each tensor.
HUNG_CHUNK, FREE_CHUNK = 9, 20


def _hung_store(create: Any, on_unproven: str = "quarantine",
                faults: list[kv.Fault] | None = None) -> tuple[SimBackend, Any, list[Any]]:
    """A worker whose store of job 2 into chunk ``HUNG_CHUNK`` hangs; stores 1 (into the same chunk) and 3 (into
    ``FREE_CHUNK``) were proven first. ``faults`` are armed only after that (the shutdown's calls)."""
    plan = kv.FaultPlan([kv.Fault("copy", "hang", direction="store", job_id=2)])
    be = SimBackend(plan)
    layout = small_layout()
    gpu = patterned_gpu(be, layout)
    worker = create(be, gpu, layout, blocks_per_chunk=1, num_cpu_chunks=32, pin_chunk_bytes=4096,
                    policy=kv.ShutdownPolicy(timeout=0.5, on_unproven=on_unproven))
    worker.submit_store(1, gspec([1]), cspec([HUNG_CHUNK]))
    worker.submit_store(3, gspec([3]), cspec([FREE_CHUNK]))
    worker.wait([1, 3])
    assert [r.success for r in worker.get_finished()] == [True, True]
    worker.submit_store(2, gspec([2]), cspec([HUNG_CHUNK]))
    for fault in faults or []:
        plan.add(fault)
    return be, worker, gpu


def _row(region: kv.HostRegion, tensor: int, chunk: int) -> np.ndarray:
    """Row ``chunk`` of CPU tensor ``tensor``, read straight from memory (the region refuses snapshots now)."""
    g = region.geometries()[tensor]
    return np.ctypeslib.as_array((ctypes.c_uint8 * g.row_bytes).from_address(g.ptr + chunk * g.row_stride)).copy()


def _holding(region: kv.HostRegion, chunk: int) -> list[tuple[int, int]]:
    """The (address, size) of each registration ``pin(4096)`` makes that holds row ``chunk`` of some tensor."""
    rows = [(g.ptr + chunk * g.row_stride, g.ptr + chunk * g.row_stride + g.row_bytes) for g in region.geometries()]
    return [(a, n) for a, n in region.registration_chunks(4096) if any(a <= lo and hi <= a + n for lo, hi in rows)]


@pytest.mark.rule("R29")
@pytest.mark.rule("R16")
@pytest.mark.parametrize("worker", list(CREATE))
def test_quarantine_keeps_only_the_registrations_an_unproven_copy_may_touch(worker: str) -> None:
    be, w, gpu = _hung_store(CREATE[worker])
    before = len(kv.quarantined())
    report = w.shutdown()
    assert report.region == "quarantined" and report.device_sync == "timeout"
    (item,) = [i for i in kv.quarantined()[before:] if i.kind == "region"]
    region = item.obj
    assert isinstance(region, kv.HostRegion)
    holding = _holding(region, HUNG_CHUNK)
    assert len(holding) == 2 and len(region.registration_chunks(4096)) == 8, "one registration per tensor"
    # Only those stay registered, and the report, the registry and the stats list exactly them.
    assert be.registrations() == [(a, a + n) for a, n in holding]
    want = tuple(kv.KeptRange(a - region.ptr, n, item.reason) for a, n in holding)
    assert report.kept == want and "not proven idle" in item.reason
    assert item.ranges == tuple((k.offset, k.length) for k in want)
    assert w.stats().quarantined_bytes == sum(n for _, n in holding) == region.quarantined_bytes
    # R16: the ledger says what the report says: two pins and the mapping kept, the rest released.
    assert dict(report.quarantined) == be.ledger.quarantined() == {"pinned": 2, "mapping": 1, "descriptor": 1}
    assert be.ledger.live() == {} and not report.leaked
    assert not be.violations, "nothing given back is under DMA"
    # The kept rows are still memory the late copy may write: readable, holding what store 1 put there.
    for t, array in enumerate(gpu):
        assert np.array_equal(_row(region, t, HUNG_CHUNK), be.to_host(array)[1])
    if hasattr(mmap, "MADV_DONTNEED"):  # the pages given back were released: they read as zeros now
        assert not _row(region, 0, FREE_CHUNK).any() and be.to_host(gpu[0])[3].any()


@pytest.mark.rule("R29")
@pytest.mark.parametrize("worker", list(CREATE))
def test_quarantine_by_registration_release_policy_keeps_nothing(worker: str) -> None:
    be, w, _ = _hung_store(CREATE[worker], on_unproven="release")
    report = w.shutdown()
    assert (report.region, report.kept, dict(report.quarantined)) == ("released", (), {})
    assert w.stats().quarantined_bytes == 0 and be.registrations() == []


@pytest.mark.rule("R29")
@pytest.mark.rule("R16")
@pytest.mark.parametrize("worker", list(CREATE))
def test_quarantine_by_registration_failed_unregister_is_leaked_and_the_rest_runs(worker: str) -> None:
    be, w, _ = _hung_store(CREATE[worker], faults=[kv.Fault("host_unregister", "error", nth=1)])
    before = len(kv.quarantined())
    report = w.shutdown()
    (item,) = [i for i in kv.quarantined()[before:] if i.kind == "region"]
    region = item.obj
    assert isinstance(region, kv.HostRegion)
    holding = _holding(region, HUNG_CHUNK)
    newest = region.registration_chunks(4096)[-1]  # unregistered first (newest first, R3): the call that failed
    assert newest not in holding
    assert report.region == "quarantined" and dict(report.leaked) == be.ledger.leaked() == {"pinned": 1}
    assert any("host_unregister failed" in e for e in report.errors), report.errors
    # The other five were unregistered; the leaked one stays registered, its pages mapped (never under the driver).
    assert be.registrations() == sorted([(a, a + n) for a, n in [*holding, newest]])
    kept = sorted([*((a, n, item.reason) for a, n in holding), (*newest, NOT_GIVEN_BACK)])
    assert report.kept == tuple(kv.KeptRange(a - region.ptr, n, why) for a, n, why in kept)
    assert dict(report.quarantined) == be.ledger.quarantined() == {"pinned": 2, "mapping": 1, "descriptor": 1}
    assert be.ledger.live() == {} and not be.violations


@pytest.mark.rule("R29")
@pytest.mark.rule("R14")
@pytest.mark.parametrize("worker", list(CREATE))
def test_quarantine_by_registration_interrupted_at_any_backend_call_of_the_shutdown(worker: str) -> None:
    """R14 wherever the interrupt lands, also among the calls that give back what no late copy may touch: the region
    ends quarantined with the hung store's registrations kept, nothing stays live, the ledger says what the report
    says, and nothing given back was under DMA."""
    be, w, _ = _hung_store(CREATE[worker])
    calls: list[str] = []
    be.on_call = lambda point, tag: calls.append(point)
    w.shutdown()
    assert "host_unregister" in calls and "untrack_host" in calls, "the give-back is on the shutdown's path"
    release = next(i for i, point in enumerate(calls) if point == "device_sync")
    # Every call but the drain's polls (a thousand clock reads, queries and sleeps, each like the one before it;
    # R14's own tests cover them): the first calls of the shutdown, then the proof and the whole release.
    for n in [*range(1, 20), *range(release, len(calls) + 1)]:
        be, w, _ = _hung_store(CREATE[worker])
        seen = iter(range(1, 10 ** 6))

        def interrupt(point: str, tag: Any, n: int = n, seen: Any = seen) -> None:
            if next(seen) == n:
                raise KeyboardInterrupt

        be.on_call = interrupt
        with pytest.raises(KeyboardInterrupt):
            w.shutdown()
        be.on_call = None
        report = w.shutdown()
        assert report.interrupted and report.region == "quarantined", n
        region = next(i.obj for i in reversed(kv.quarantined()) if i.kind == "region")
        assert isinstance(region, kv.HostRegion)
        kept = [(region.ptr + k.offset, region.ptr + k.offset + k.length) for k in report.kept]
        assert all(any(a <= p and p + size <= b for a, b in kept) for p, size in _holding(region, HUNG_CHUNK)), n
        assert be.ledger.live() == {}, n
        assert be.ledger.quarantined() == dict(report.quarantined) and be.ledger.leaked() == dict(report.leaked), n
        assert not be.violations, (n, be.violations)
