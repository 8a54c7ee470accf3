"""The workers' ``pinning`` where the platform refuses host registration (vLLM #55428), through the public API on
the simulated device (``SimBackend(host_register="refuse")``), for both workers: construction ("auto" falls back to
a pinned allocation, "register" fails cleanly or runs pageable, "alloc"), byte-exact transfers, both shutdown fates
and a construction failure after the allocation (R1-R3, R12, R16, R29)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from _support import (
    BPC,
    CPU_CHUNKS,
    CREATE,
    assert_accounted,
    cspec,
    gspec,
    make_worker,
    messages,
    patterned_gpu,
    small_layout,
)

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.errors import CUDA_ERROR_NOT_SUPPORTED, RegistrationRefused
from kvoffload_ref.facade import FALLBACK_WARNING
from kvoffload_ref.lifecycle import RegionState

WORKERS = list(CREATE)
TIMEOUT = 1.0
FALLBACK = FALLBACK_WARNING % CUDA_ERROR_NOT_SUPPORTED


def _refusing(*, said: bool = True, plan: kv.FaultPlan | None = None) -> SimBackend:
    """A platform that refuses registration; ``said=False``: it does not say so in advance (found by trying)."""
    be = SimBackend(plan, host_register="refuse")
    be.refuses_registration = said
    return be


def _build(worker: str, backend: Any, **kwargs: Any) -> tuple[Any, list[Any]]:
    _, kv_worker, gpu = make_worker(backend, kind=worker, timeout=TIMEOUT, **kwargs)
    return kv_worker, gpu


@pytest.mark.rule("R2")
@pytest.mark.rule("R3")
@pytest.mark.rule("R16")
@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("said", [True, False], ids=["said-in-advance", "found-by-trying"])
def test_auto_falls_back_to_a_pinned_allocation_transfers_exactly_and_frees_it_on_a_clean_shutdown(
        worker: str, said: bool, caplog: Any) -> None:
    be = _refusing(said=said)
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        w, gpu = _build(worker, be)  # pinning="auto" is the default
    assert messages(caplog).count(FALLBACK) == 1
    stats = w.stats()
    assert (stats.pinning, stats.pinned, stats.ledger_live.get("pinned_alloc")) == ("allocated", True, 1)
    assert "mapping" not in stats.ledger_live and be.registrations() == []
    tried = {"mapping": 1} if not said else {}
    assert {k: v for k, v in be.ledger.released().items() if k == "mapping"} == tried, \
        "R2: a mapped region tried first (only when the platform did not say) was released"
    w.submit_store(1, gspec([3, 4, 5]), cspec([2]))
    w.wait([1], timeout=TIMEOUT)
    w.submit_load(2, cspec([2]), gspec([40, 41, 42]))
    w.wait([2], timeout=TIMEOUT)
    assert [r.success for r in w.get_finished()] == [True, True]
    host = w.cpu_snapshot()
    for t, g in enumerate(gpu):
        rows = be.to_host(g)
        assert np.array_equal(host[t][2], rows[3:6].reshape(-1)), "store: byte-exact"
        assert np.array_equal(rows[40:43], rows[3:6]), "load: byte-exact"
    report = w.shutdown()
    assert (report.region, report.pinning, report.kept) == ("released", "allocated", ())
    assert_accounted(be, report)
    assert be.ledger.acquired()["pinned_alloc"] == be.ledger.released()["pinned_alloc"] == 1
    assert not be.violations


def test_the_fallback_warning_is_logged_once_per_backend(caplog: Any) -> None:
    be = SimBackend(host_register="refuse")
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        first, _ = _build("engine", be)
        second, _ = _build("reference", be)
    assert messages(caplog).count(FALLBACK) == 1
    assert first.stats().pinning == second.stats().pinning == "allocated"
    first.shutdown()
    second.shutdown()


@pytest.mark.rule("R2")
@pytest.mark.parametrize("worker", WORKERS)
def test_register_with_require_pinned_fails_cleanly_with_nothing_leaked(worker: str) -> None:
    be = SimBackend(host_register="refuse")
    with pytest.raises(RegistrationRefused, match="pinning='alloc'"):
        _build(worker, be, pinning="register", require_pinned=True)
    assert be.ledger.live() == {} and be.ledger.acquired() == {"mapping": 1}
    assert "pinned_alloc" not in be.ledger.acquired(), "no fallback under pinning='register'"


@pytest.mark.rule("R16")
@pytest.mark.parametrize("worker", WORKERS)
def test_register_without_require_pinned_runs_from_pageable_memory_as_before(worker: str, caplog: Any) -> None:
    be = SimBackend(host_register="refuse")
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        w, _ = _build(worker, be, pinning="register")
    assert w.stats().pinning == "pageable" and not w.stats().pinned
    assert any("transfers run from pageable memory" in m for m in messages(caplog))
    assert FALLBACK not in messages(caplog)
    report = w.shutdown()
    assert report.pinning == "pageable"
    assert_accounted(be, report)


@pytest.mark.rule("R16")
@pytest.mark.parametrize("worker", WORKERS)
def test_alloc_allocates_even_where_registration_is_allowed(worker: str) -> None:
    be = SimBackend()
    w, _ = _build(worker, be, pinning="alloc")
    assert w.stats().pinning == "allocated" and be.registrations() == []
    assert be.ledger.acquired() == {"pinned_alloc": 1, **{k: v for k, v in be.ledger.acquired().items()
                                                           if k in ("stream", "event")}}
    assert_accounted(be, w.shutdown())


@pytest.mark.rule("R2")
@pytest.mark.parametrize("worker", WORKERS)
def test_a_caller_region_that_the_platform_refuses_to_register_stays_the_callers(worker: str) -> None:
    be = SimBackend(host_register="refuse")
    layout = small_layout()
    region = kv.HostRegion.allocate(be, layout, BPC, CPU_CHUNKS)
    with pytest.raises(RegistrationRefused, match=r"HostRegion\.allocate"):
        CREATE[worker](be, patterned_gpu(be, layout), layout, blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS,
                       region=region)
    assert region.state is RegionState.CALLER_OWNED and region.pinning == "pageable"
    assert be.ledger.live() == {"mapping": 1}, "R2: the caller's region untouched, nothing else live"
    region.release()
    assert be.ledger.live() == {}


@pytest.mark.rule("R7")
def test_pinning_is_validated_and_alloc_needs_an_allocated_region() -> None:
    be = SimBackend()
    with pytest.raises(kv.InvalidTransferError, match="pinning must be one of"):
        _build("engine", be, pinning="pinned")
    layout = small_layout()
    region = kv.HostRegion.allocate(be, layout, BPC, CPU_CHUNKS)
    with pytest.raises(kv.InvalidTransferError, match="pinning='alloc' needs a region of pinned allocated memory"):
        kv.CPUOffloadingWorker(be, patterned_gpu(be, layout), layout, blocks_per_chunk=BPC, region=region,
                               pinning="alloc")
    assert region.state is RegionState.CALLER_OWNED
    region.release()


@pytest.mark.rule("R12")
@pytest.mark.rule("R16")
@pytest.mark.rule("R29")
@pytest.mark.parametrize("worker", WORKERS)
def test_a_hung_copy_quarantines_the_allocation_whole_and_never_frees_it(worker: str, caplog: Any) -> None:
    plan = kv.FaultPlan([kv.Fault("copy", "hang", direction="store", job_id=1)])
    be = SimBackend(plan, host_register="refuse")
    w, _ = _build(worker, be)
    w.submit_store(1, gspec([1]), cspec([0]))
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        report = w.shutdown()
    assert (report.region, report.pinning, report.device_sync) == ("quarantined", "allocated", "timeout")
    assert report.quarantined.get("pinned_alloc") == 1 and "mapping" not in report.quarantined
    assert_accounted(be, report)
    assert be.ledger.released().get("pinned_alloc") is None, "R12: never freed"
    assert len(report.kept) == 1 and report.kept[0].offset == 0, "R29: one allocation is one unit, kept whole"
    item = kv.quarantined()[-1]
    assert item.kind == "region" and "allocated: one pinned allocation, kept whole" in item.description
    assert item.ranges == ((0, report.kept[0].length),)
    assert w.stats().quarantined_bytes == report.kept[0].length
    be.end_hangs()
    be.sleep(1.0)
    assert not be.violations, "the late copy lands in memory that was kept"


@pytest.mark.rule("R2")
@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("pinning", ["auto", "auto-found-by-trying", "alloc"])
def test_construction_failing_after_the_allocation_frees_it_and_the_original_error_propagates(
        worker: str, pinning: str) -> None:
    plan = kv.FaultPlan([kv.Fault("stream_create", "error", nth=2)])
    be = _refusing(said=pinning != "auto-found-by-trying", plan=plan)
    pinning = pinning.split("-", maxsplit=1)[0]
    with pytest.raises(kv.DeviceError, match="injected stream_create failure"):
        _build(worker, be, pinning=pinning)
    assert be.ledger.live() == {}
    assert be.ledger.acquired()["pinned_alloc"] == be.ledger.released()["pinned_alloc"] == 1
    assert not be.violations


class _NoAllocation(SimBackend):
    """A refusing platform whose backend cannot allocate pinned memory either (a third-party backend)."""

    alloc_pinned = None  # type: ignore[assignment]


@pytest.mark.rule("R2")
@pytest.mark.parametrize("said", [True, False], ids=["said-in-advance", "found-by-trying"])
def test_auto_on_a_backend_that_cannot_allocate_pinned_memory_fails_cleanly(said: bool) -> None:
    be = _NoAllocation(host_register="refuse")
    be.refuses_registration = said
    with pytest.raises(kv.DeviceError, match="cannot allocate pinned host memory"):
        _build("engine", be)
    assert be.ledger.live() == {} and be.ledger.acquired() == ({} if said else {"mapping": 1})


@pytest.mark.rule("R16")
@pytest.mark.parametrize("worker", WORKERS)
def test_a_failed_release_of_the_refused_mapping_is_reported_by_the_worker_that_replaced_it(worker: str) -> None:
    """Found by the kit: the refused mapped region's unmap fails; the worker built over the allocation reports that
    leak (R16: the ledger's leaked equals the report's)."""
    be = _refusing(said=False, plan=kv.FaultPlan([kv.Fault("unmap", "error", nth=1)]))
    w, _ = _build(worker, be)
    assert be.ledger.leaked() == {"mapping": 1}
    report = w.shutdown()
    assert dict(report.leaked) == {"mapping": 1} and report.pinning == "allocated"
    assert_accounted(be, report)
