"""R7/R22: a job id is any int -- only compared, hashed and printed, never converted to a fixed-width integer -- so
ids at and beyond the int64 edges (and uuid4-sized ones) go through a whole lifecycle on both workers (the engine and
the reference): submit, order_after, wait, get_finished, and a shutdown that drains a pending transfer and abandons a
hung one."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from _support import BPC, CPU_CHUNKS, CREATE, cspec, gspec, patterned_gpu, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.testing.campaign import quiet_logs

#: A uuid4().int, fixed so the test is deterministic (128 bits: what a real-world request id looks like).
UUID4 = uuid.UUID("5c1f8e0a-93d2-4b7e-a1c4-2f6d8b9e0a13").int
EDGE_IDS = [-2**63 - 1, -1, 0, 2**63 - 1, 2**63, UUID4]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


def _worker(kind: str, hung: int) -> tuple[SimBackend, Any]:
    """A worker whose load ``hung`` never completes (its copy hangs on the device)."""
    be = SimBackend(faults=kv.FaultPlan([kv.Fault("copy", "hang", direction="load", job_id=hung)]))
    layout = small_layout()
    worker = CREATE[kind](be, patterned_gpu(be, layout), layout, blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS,
                          policy=kv.ShutdownPolicy(timeout=0.01))
    return be, worker


@pytest.mark.rule("R7")
@pytest.mark.rule("R22")
@pytest.mark.parametrize("job", EDGE_IDS, ids=["below-int64", "-1", "0", "int64-max", "2**63", "uuid4"])
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_job_ids_at_the_int64_edges_round_trip_through_a_whole_lifecycle(kind: str, job: int) -> None:
    hung, unreaped = job + 1, job - 1  # the neighbours: 2**63 - 1 + 1 crosses the edge too
    be, w = _worker(kind, hung)
    w.submit_store(job, gspec([0, 1, 2]), cspec([0]))
    w.order_after([job])
    w.wait({job})
    assert [(r.job_id, r.success, r.transfer_size) for r in w.get_finished()] == [(job, True, 3 * 2 * 512)]
    with pytest.raises(kv.InvalidTransferError, match=str(job)):  # R7: reusable once reported, not while in flight
        w.submit_load(job, cspec([0]), gspec([9, 10, 11]))
        w.submit_load(job, cspec([0]), gspec([12, 13, 14]))
    w.wait([job], timeout=1.0)
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(job, True)]
    w.submit_store(unreaped, gspec([3]), cspec([2]))
    w.wait([unreaped])  # completed, never reaped: the report lists it
    w.submit_load(hung, cspec([0]), gspec([20, 21, 22]))  # never completes
    w.submit_store(job, gspec([4, 5]), cspec([1]))  # still pending when shutdown begins: the drain proves it
    w.order_after([job, hung])
    report = w.shutdown()
    store = [(o.result.job_id, o.ended, o.result.success, o.result.transfer_size) for o in report.store.jobs]
    assert store == [(unreaped, "unreaped", True, 2 * 512), (job, "drained", True, 2 * 2 * 512)]
    assert report.store.error is None and (report.store.drained, report.store.abandoned) == (1, 0)
    (load,) = report.load.jobs
    assert (load.result.job_id, load.ended, load.result.success) == (hung, "abandoned", False)
    assert load.result.invalid_blocks == (20, 21, 22)  # R22: only the hung load's blocks are poisoned
    assert kv.poisoned_cpu_chunks(report) == () and kv.poisoned_gpu_blocks(report) == (20, 21, 22)
    assert all(str(hung) in e or "load" in e for e in report.errors), report.errors
    assert not be.violations, be.violations  # no release twice, nothing freed under DMA
    assert set(be.ledger.live()) <= {"descriptor"} and report.quarantined  # the hung load's buffer, on purpose
