"""The fast handler's booking of proven heads (handler.py's ``_book_proven``): pool order, and what the shutdown
drain reports for the transfers it proves."""

from __future__ import annotations

from typing import Any

import pytest

import kvoffload_ref as kv
from kvoffload_ref.handler import PREFIX_WINDOW
from tests._support import CPU_CHUNKS, GPU_BLOCKS, PAGE, cspec, gspec, make_worker


def _submit(w: Any, count: int) -> None:
    """``count`` stores of one or two GPU blocks (their byte counts differ), ids decreasing."""
    for n in range(count):
        job, block = 1000 + count - n, n % (GPU_BLOCKS - 1)
        w.submit_store(job, gspec([block, block + 1][:1 + n % 2]), cspec([n % CPU_CHUNKS]))


@pytest.mark.rule("R8")
@pytest.mark.rule("R10")
def test_handler_drain_reports_the_proven_jobs_as_the_reference_does_across_prefix_windows() -> None:
    """The drain books each window of proven heads at once (ids, byte counts): the report lists every job in
    submission order with its own byte count, exactly as the reference worker's."""
    count = PREFIX_WINDOW + 5
    reports = []
    for kind in ("engine", "reference"):
        be, w, _ = make_worker(kind=kind)
        _submit(w, count)
        be.sleep(1.0)  # every copy ran; nothing observed yet
        report = w.shutdown()
        assert report.store.drained == count and not be.violations and not be.ledger.live()
        reports.append([(o.result.job_id, o.result.transfer_size, o.ended) for o in report.store.jobs])
    engine, reference = reports
    assert engine == reference
    assert len({size for _, size, _ in engine}) == 2, "the byte counts differ from job to job"


def test_handler_proven_heads_return_their_events_to_the_pool_start_then_end_in_queue_order() -> None:
    """The event pool is LIFO: proven heads append (start, end) per transfer, in queue order, so the next
    submission reuses the last proven transfer's end as its marker (the order every reuse -- and so every event
    label a trace shows -- depends on)."""
    be, w, _ = make_worker()
    _submit(w, 3)
    core: Any = w._core
    handler = core.store  # the pool is the handler's own
    before = list(handler._events)
    queued = [(t.start, t.end) for t in handler._queue]
    be.sleep(1.0)
    assert len(w.get_finished()) == 3
    assert handler._events == [*before, *(e for pair in queued for e in pair)]
    w.shutdown()


@pytest.mark.rule("R10")
def test_handler_a_proven_zero_op_transfer_pools_no_descriptor_buffer() -> None:
    """A transfer with nothing to copy holds no descriptor buffer: reported or drained, it returns its events to
    the pool and nothing else (the release then frees only real buffers: no failed release step)."""
    layout = kv.KVCacheLayout(tensor_page_bytes=(PAGE,), groups=((kv.LayerRef(0, PAGE),), (kv.LayerRef(0, PAGE),)))
    be, w, _ = make_worker(layout=layout)
    empty = kv.GPULoadStoreSpec([], group_sizes=(0, 0), block_indices=(0, 0))
    w.submit_store(7, empty, cspec([]))
    w.wait({7})
    assert [r.job_id for r in w.get_finished()] == [7]  # reported: booked by the REPORT branch
    w.submit_store(8, empty, cspec([]))
    be.sleep(1.0)
    report = w.shutdown()
    assert report.store.drained == 1  # drained: booked by the COUNT_DRAINED branch
    assert (report.errors, dict(report.leaked)) == ((), {}) and not be.violations and not be.ledger.live()
