"""The quarantine registry (quarantine.py): what a shutdown could not prove idle stays alive, listed, until exit."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
from _support import cspec, gspec, patterned_gpu, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends.base import DescriptorBuffer
from kvoffload_ref.backends.sim import SimBackend

CREATE = {"engine": kv.create_worker, "reference": kv.create_reference_worker}


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

