"""A region over a pinned allocation (``HostRegion.allocate(..., pinning="alloc")``, R3's steps in
``region_held.py``): release frees it (nothing to unregister or unmap), a quarantine keeps it whole, a failed free is
leaked, a dropped one is freed by its finalizer."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
from _support import messages, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.lifecycle import RegionState


def _calls(be: SimBackend) -> list[str]:
    calls: list[str] = []
    be.on_call = lambda point, tag: calls.append(point)
    return calls


def _allocated(be: SimBackend, chunks: int = 4) -> kv.HostRegion:
    return kv.HostRegion.allocate(be, small_layout(), 3, chunks, pinning="alloc")


@pytest.mark.rule("R3")
@pytest.mark.rule("R16")
@pytest.mark.rule("R25")
def test_an_allocated_region_is_pinned_whole_and_its_release_frees_it_and_nothing_else() -> None:
    be = SimBackend(host_register="refuse")
    region = _allocated(be)
    assert (region.pinning, region.allocated, region.pinned, region.pinned_ranges) == ("allocated", True, True, 0)
    assert be.ledger.live() == {"pinned_alloc": 1} and be.registrations() == []
    calls = _calls(be)
    assert region.pin(chunk_bytes=4096) is True and calls == [], "R25: one allocation, nothing to register"
    assert [s.shape for s in region.snapshot()] == [(4, 1536), (4, 1536)]
    assert region.release() == [] and calls == ["free_pinned"], "R3: drop the views -> free; no unregister, unmap"
    assert be.ledger.live() == {} and be.ledger.released() == {"pinned_alloc": 1}
    assert region.state is RegionState.RELEASED and not region.pinned and region.pinning == "allocated"
    assert region.release() == [] and calls == ["free_pinned"], "R3: at most once"


@pytest.mark.rule("R7")
def test_allocate_refuses_an_unknown_pinning_before_anything_is_allocated() -> None:
    be = SimBackend()
    with pytest.raises(kv.InvalidTransferError, match="pinning must be 'register' or 'alloc'"):
        kv.HostRegion.allocate(be, small_layout(), 3, 4, pinning="auto")  # type: ignore[arg-type]
    assert be.ledger.acquired() == {}


@pytest.mark.rule("R3")
@pytest.mark.rule("R16")
def test_a_failed_free_is_logged_reported_and_leaked(caplog: Any) -> None:
    be = SimBackend(kv.FaultPlan([kv.Fault("unmap", "error")]))
    region = _allocated(be)
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        errors = region.release()
    assert len(errors) == 1 and errors[0].startswith("free_pinned failed (status")
    assert {kind: n for kind, n in region.leaked.items() if n} == {"pinned_alloc": 1}
    assert be.ledger.leaked() == {"pinned_alloc": 1} and be.ledger.live() == {}
    assert any("cudaFreeHost failed" in m for m in messages(caplog))


@pytest.mark.rule("R3")
def test_a_dropped_caller_owned_allocated_region_is_freed_by_its_finalizer(caplog: Any) -> None:
    be = SimBackend()
    region = _allocated(be)
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        del region
        gc.collect()
    assert be.ledger.live() == {} and be.ledger.released() == {"pinned_alloc": 1}
    assert any("dropped without release()" in m for m in messages(caplog))


@pytest.mark.rule("R12")
@pytest.mark.rule("R29")
def test_a_quarantine_keeps_the_allocation_whole_whatever_rows_it_is_asked_to_keep() -> None:
    be = SimBackend()
    mapped = kv.HostRegion.allocate(be, small_layout(), 3, 16)
    mapped.pin(chunk_bytes=12288)  # two registrations per tensor: rows 0-7 and 8-15
    allocated = _allocated(be)
    for region in (mapped, allocated):
        region.adopt()
        region.quarantine_by_owner("a late copy", chunks=[0])
    assert sum(k.length for k in mapped.kept_ranges) < mapped.nbytes, "a mapping is kept in part (R29)"
    assert [(k.offset, k.length) for k in allocated.kept_ranges] == [(0, allocated.nbytes)]
    assert allocated.quarantined_resources == {"pinned_alloc": 1}
    assert be.ledger.state_of("pinned_alloc", allocated.ptr) == "quarantined"
    assert allocated.quarantined_bytes == allocated.nbytes
    assert allocated.pinned and allocated.state is RegionState.QUARANTINED
