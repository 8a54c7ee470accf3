"""R23: ``order_after`` makes a caller's stream wait on the device for queued transfers -- an ordering edge the race
detector counts (R20) -- on both workers (the engine and the reference)."""

from __future__ import annotations

from typing import Any

import pytest
from _support import BPC, CPU_CHUNKS, CREATE, cspec, gspec, patterned_gpu, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend

ROWS = [6, 7, 8]


def _worker(kind: str, be: SimBackend | None = None, **kwargs: Any) -> tuple[SimBackend, Any, list[Any]]:
    be = be or SimBackend()
    layout = small_layout()
    gpu = patterned_gpu(be, layout)
    worker = CREATE[kind](be, gpu, layout, blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS,
                          compute_stream="model", **kwargs)
    return be, worker, gpu


def _stored(kind: str) -> tuple[SimBackend, Any, list[Any]]:
    be, w, gpu = _worker(kind)
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]))
    w.wait([1])
    w.get_finished()
    return be, w, gpu


@pytest.mark.rule("R23")
@pytest.mark.rule("R20")
@pytest.mark.parametrize("kind", list(CREATE))
@pytest.mark.parametrize("ordered", [True, False])
def test_worker_order_after_orders_compute_after_a_load(kind: str, ordered: bool) -> None:
    """Compute writing the blocks a load writes races it, unless order_after came first; with it the compute's
    bytes land last and nothing blocked the host."""
    be, w, gpu = _stored(kind)
    w.submit_load(2, cspec([0]), gspec(ROWS))
    before = be.monotonic()
    if ordered:
        assert w.order_after([2]) is None
    assert be.monotonic() == before  # no host wait
    be.enqueue_compute_write(gpu[0], ROWS, value=0xAB, delay=1e-6, stream="model")
    w.wait([2])
    be.sleep(1e-3)  # the compute write, if ordered after the load, runs now
    races = [v for v in be.violations if v.kind == "dma_race"]
    if ordered:
        assert races == []
        assert (be.to_host(gpu[0])[ROWS] == 0xAB).all()  # the compute ran after the load's bytes
    else:
        assert races, "an unordered compute write over a load's blocks must be flagged (R20)"
    assert [r.success for r in w.get_finished()] == [True]
    w.shutdown()


@pytest.mark.rule("R23")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_order_after_ignores_reported_and_unknown_jobs_and_checks_its_input(kind: str) -> None:
    be, w, _ = _stored(kind)
    w.order_after([1, 99])  # 1 was reported, 99 never existed: nothing to order, no error
    w.order_after([], stream="other")
    with pytest.raises(kv.InvalidTransferError):
        w.order_after(["x"])  # type: ignore[list-item]
    with pytest.raises(kv.InvalidTransferError):
        w.order_after([1], stream=object())
    w.shutdown()
    w.order_after([1])  # after shutdown: orders nothing


@pytest.mark.rule("R23")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_order_after_waits_for_the_record_it_saw_not_a_later_reuse(kind: str) -> None:
    """Events are pooled (the engine) and re-recorded for later jobs: a wait captures the record current at the
    call, as CUDA's cudaStreamWaitEvent does. Here the wait is still queued behind long compute when job 2's end
    event is re-recorded for slow later loads; the compute after it must not wait for them."""
    be, w, gpu = _worker(kind, SimBackend(pinned_bandwidth=1e7))  # 10 MB/s: a 9 KiB load takes about 0.9 ms
    be.enqueue_compute_write(gpu[1], [60], value=1, delay=2e-3, stream="side")  # long compute on "side"
    w.submit_load(2, cspec([0]), gspec(ROWS))  # about 0.3 ms
    w.order_after([2], stream="side")  # queued behind the long compute
    w.wait([2])
    assert [r.job_id for r in w.get_finished()] == [2]  # job 2's events go back to the pool (engine)
    for job in range(3, 9):  # later loads reuse them; together they run about 5 ms
        w.submit_load(job, cspec([0, 1, 2]), gspec(list(range(30, 39))))
    be.enqueue_compute_write(gpu[1], [50], value=0x5C, delay=1e-6, stream="side")
    be.sleep(2.5e-3 - be.monotonic())  # past the long compute, long before the later loads end
    assert w.stats().load.queued > 0  # the later loads still run
    assert be.to_host(gpu[1])[50, 0] == 0x5C  # the compute waited only for job 2's record
    w.wait(range(3, 9))
    assert not [v for v in be.violations if v.kind == "dma_race"]
    w.shutdown()
