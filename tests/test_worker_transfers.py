"""The worker's transfer path on the simulated device: byte-exact round trips, ordering, results, input errors."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from _support import BPC, CPU_CHUNKS, GPU_BLOCKS, PAGE, WORKERS, at_call, cspec, gspec, make_worker, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends import base
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.handler import PREFIX_WINDOW


def _expected_cpu_placement(ids: list[int], chunks: list[int], skip: int, bpc: int) -> list[tuple[int, int, int]]:
    """(gpu block, cpu chunk, sub-block) for one group, by the reference's naive rule."""
    return [(b, chunks[(skip + i) // bpc], (skip + i) % bpc) for i, b in enumerate(ids)]


def _round_trip(be: Any, w: kv.CPUOffloadingWorker, gpu: list[Any], layout: kv.KVCacheLayout, store_src: Any,
                cpu_ids: list[int], load_dst: Any) -> list[Any]:
    w.submit_store(1, store_src, cspec(cpu_ids))
    w.wait({1})
    w.submit_load(2, cspec(cpu_ids), load_dst)
    w.wait({2})
    results = w.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True)]
    return [be.to_host(a) for a in gpu]


@pytest.mark.rule("R4")
@pytest.mark.parametrize(("bpc", "index", "src", "cpu"), [
    (1, 0, [5, 9, 1, 3], [10, 7, 2, 0]),  # one block per chunk
    (3, 0, [5, 9, 1, 3], [10, 7]),  # last chunk partly used
    (3, 2, [5, 9, 1, 3], [10, 7]),  # skip at the first chunk, last chunk full
    (3, 1, [5, 9, 1, 3, 4, 6], [4, 0, 15]),  # skip at the first chunk and a partial last chunk
    (4, 3, [8], [3]),  # a single sub-block at the very end of a chunk
])
def test_worker_round_trip_is_byte_exact(bpc: int, index: int, src: list[int], cpu: list[int]) -> None:
    layout = small_layout()
    be, w, gpu = make_worker(layout=layout, bpc=bpc)
    before = [be.to_host(a) for a in gpu]
    dst = [40 + i for i in range(len(src))]
    after = _round_trip(be, w, gpu, layout, gspec(src, index), cpu, gspec(dst, index))
    snapshot = w.cpu_snapshot()
    for t in range(2):
        np.testing.assert_array_equal(after[t][dst], before[t][src])
        untouched = np.setdiff1d(np.arange(GPU_BLOCKS), dst)
        np.testing.assert_array_equal(after[t][untouched], before[t][untouched])
        for block, chunk, sub in _expected_cpu_placement(src, cpu, index % bpc, bpc):
            np.testing.assert_array_equal(snapshot[t][chunk, sub * PAGE:(sub + 1) * PAGE], before[t][block])
    assert w.shutdown().region == "released"
    assert not be.violations and not be.ledger.live()


def test_worker_round_trip_three_groups_with_an_empty_middle_one() -> None:
    layout = kv.KVCacheLayout(tensor_page_bytes=(256, 512, 128),
                              groups=((kv.LayerRef(0, 256),), (kv.LayerRef(1, 512),), (kv.LayerRef(2, 128),)))
    be, w, gpu = make_worker(layout=layout, bpc=2)
    before = [be.to_host(a) for a in gpu]
    src = kv.GPULoadStoreSpec([3, 4, 10, 11, 12], group_sizes=(2, 0, 3), block_indices=(0, 0, 1))
    dst = kv.GPULoadStoreSpec([30, 31, 50, 51, 52], group_sizes=(2, 0, 3), block_indices=(0, 0, 1))
    after = _round_trip(be, w, gpu, layout, src, [6, 1, 9], dst)
    np.testing.assert_array_equal(after[0][[30, 31]], before[0][[3, 4]])
    np.testing.assert_array_equal(after[1], before[1])  # the empty group's tensor is untouched
    np.testing.assert_array_equal(after[2][[50, 51, 52]], before[2][[10, 11, 12]])
    snapshot = w.cpu_snapshot()
    np.testing.assert_array_equal(snapshot[2][1, 128:256], before[2][10])  # group 2 skips sub-block 0 of chunk 1
    np.testing.assert_array_equal(snapshot[2][9, 0:128], before[2][11])
    np.testing.assert_array_equal(snapshot[2][9, 128:256], before[2][12])
    w.shutdown()
    assert not be.violations


def test_worker_round_trip_copies_only_unpadded_bytes() -> None:
    layout = kv.KVCacheLayout(tensor_page_bytes=(640, 640), groups=((kv.LayerRef(0, 512), kv.LayerRef(1, 600)),))
    be, w, gpu = make_worker(layout=layout, bpc=2)
    before = [be.to_host(a) for a in gpu]
    after = _round_trip(be, w, gpu, layout, gspec([1, 2, 3]), [5, 6], gspec([20, 21, 22]))
    for t, copied in ((0, 512), (1, 600)):
        np.testing.assert_array_equal(after[t][[20, 21, 22], :copied], before[t][[1, 2, 3], :copied])
        np.testing.assert_array_equal(after[t][[20, 21, 22], copied:], before[t][[20, 21, 22], copied:])
        snapshot = w.cpu_snapshot()[t]
        assert not snapshot[5, copied:640].any(), "padding bytes are never copied"
    w.shutdown()


@pytest.mark.rule("R5")
def test_worker_zero_op_transfer_succeeds_with_zero_bytes() -> None:
    layout = kv.KVCacheLayout(tensor_page_bytes=(PAGE,), groups=((kv.LayerRef(0, PAGE),), (kv.LayerRef(0, PAGE),)))
    be, w, _ = make_worker(layout=layout)
    empty = kv.GPULoadStoreSpec([], group_sizes=(0, 0), block_indices=(0, 0))
    assert w.submit_store(7, empty, cspec([])) is True
    w.wait({7})
    (result,) = w.get_finished()
    assert (result.job_id, result.success, result.transfer_size) == (7, True, 0)
    w.shutdown()
    assert not be.ledger.live()


@pytest.mark.rule("R4")
def test_worker_store_waits_for_pending_compute_write() -> None:
    be, w, gpu = make_worker()
    be.enqueue_compute_write(gpu[0], [5], 0xAB, delay=0.5)
    w.submit_store(1, gspec([5]), cspec([2]))
    w.wait({1})
    assert (w.cpu_snapshot()[0][2, :PAGE] == 0xAB).all(), "the store copied the data written before it"
    w.shutdown()


@pytest.mark.rule("R4")
def test_worker_load_waits_for_pending_compute_write() -> None:
    be, w, gpu = make_worker()
    w.submit_store(1, gspec([5]), cspec([2]))
    w.wait({1})
    expected = be.to_host(gpu[0])[5]
    be.enqueue_compute_write(gpu[0], [9], 0x11, delay=0.5)  # e.g. zeroing a freshly allocated block
    w.submit_load(2, cspec([2]), gspec([9]))
    w.wait({2})
    np.testing.assert_array_equal(be.to_host(gpu[0])[9], expected)
    w.shutdown()


@pytest.mark.rule("R4")
def test_worker_transfers_of_one_direction_run_in_submission_order() -> None:
    be, w, gpu = make_worker(bpc=1)
    host = [be.to_host(a) for a in gpu]
    for job in range(1, 9):  # every store writes the same chunk; the last submitted must win
        w.submit_store(job, gspec([job]), cspec([0]))
    w.wait(range(1, 9))
    np.testing.assert_array_equal(w.cpu_snapshot()[0][0], host[0][8])
    assert [r.job_id for r in w.get_finished()] == list(range(1, 9))
    w.shutdown()


@pytest.mark.rule("R5")
def test_worker_get_finished_reports_each_job_once_in_order_with_bytes_and_time() -> None:
    be, w, _ = make_worker()
    for job in (3, 1, 2):
        w.submit_store(job, gspec([job, job + 10]), cspec([job]))
    w.submit_load(4, cspec([3]), gspec([30, 31]))
    assert w.get_finished() == [], "nothing is complete before the clock advances"
    be.clock_advance(1.0)
    results = w.get_finished()
    assert [r.job_id for r in results] == [3, 1, 2, 4]
    assert all(r.success and r.error is None for r in results)
    assert all(r.transfer_size == 2 * 2 * PAGE for r in results)
    assert all(r.transfer_time is not None and 0 < r.transfer_time < 1.0 for r in results)
    assert w.get_finished() == []
    w.shutdown()


@pytest.mark.rule("R5")
def test_worker_failed_head_fails_everything_queued_behind_it() -> None:
    plan = kv.FaultPlan([kv.Fault("event_query", "error", direction="store", job_id=2, status=719)])
    be, w, _ = make_worker(SimBackend(plan))
    for job in (1, 2, 3):
        w.submit_store(job, gspec([job]), cspec([job]))
    w.submit_load(4, cspec([9]), gspec([40]))
    be.clock_advance(1.0)
    results = {r.job_id: r for r in w.get_finished()}
    assert results[1].success and results[4].success
    assert not results[2].success and isinstance(results[2].error, kv.DeviceError)
    assert results[2].error.status == 719
    assert not results[3].success and results[3].error.__cause__ is results[2].error
    assert plan.fired == [plan.faults[0]]
    # A later store chains only on the queue as it is now: it is not held back by the failed ones.
    w.submit_store(5, gspec([5]), cspec([5]))
    be.clock_advance(1.0)
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(5, True)]
    report = w.shutdown()
    assert report.device_sync == "ok", "the failed transfers need the device-level proof"
    assert report.region == "released"
    assert not be.violations and not be.ledger.live()


@pytest.mark.rule("R6")
def test_worker_wait_removes_nothing_and_ignores_unknown_ids() -> None:
    be, w, _ = make_worker()
    w.submit_store(1, gspec([1]), cspec([1]))
    w.submit_load(2, cspec([3]), gspec([3]))
    w.wait({1, 2, 999})
    w.wait({1})  # already resolved: returns at once
    assert [r.job_id for r in w.get_finished()] == [1, 2]
    w.wait({1, 2})  # already reported: ignored
    w.shutdown()


@pytest.mark.rule("R6")
def test_worker_wait_proves_the_queue_up_to_its_job_only_across_prefix_windows() -> None:
    be, w, _ = make_worker()
    count = 2 * PREFIX_WINDOW + 3
    for job in range(count):
        w.submit_store(job, gspec([job % GPU_BLOCKS]), cspec([job % CPU_CHUNKS]))
    be.sleep(1.0)  # every copy has run; nothing is observed yet
    deep = PREFIX_WINDOW + 1  # the second window stops at it
    w.wait({deep})
    assert (w.stats().store.queued, w.stats().store.unreported) == (count - deep - 1, deep + 1)
    w.wait({deep})  # resolved: returns at once, proves nothing more
    assert w.stats().store.queued == count - deep - 1
    w.wait({count - 1})
    assert [r.job_id for r in w.get_finished()] == list(range(count))
    assert w.shutdown().store.drained == 0 and not be.violations and not be.ledger.live()


@pytest.mark.rule("R5")
@pytest.mark.rule("R6")
def test_worker_wait_on_a_job_behind_a_failed_head_returns_with_the_queue_failed() -> None:
    plan = kv.FaultPlan([kv.Fault("event_query", "error", job_id=1)])
    be, w, _ = make_worker(SimBackend(plan))
    for job in range(4):
        w.submit_store(job, gspec([job]), cspec([job]))
    w.wait({3})  # job 1's failure fails it and everything behind it: job 3 leaves the queue unproven
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(0, True), (1, False), (2, False), (3, False)]
    assert w.stats().store.queued == 0
    w.shutdown()


@pytest.mark.rule("R6")
def test_worker_wait_with_timeout_raises_deadline_exceeded() -> None:
    plan = kv.FaultPlan([kv.Fault("copy", "hang", direction="load", job_id=2)])
    be, w, _ = make_worker(SimBackend(plan))
    w.submit_store(1, gspec([1]), cspec([1]))
    w.submit_load(2, cspec([3]), gspec([3]))
    start = be.monotonic()
    with pytest.raises(kv.DeadlineExceeded, match=r"^load job 2 not proven complete by the deadline$"):
        w.wait({1, 2}, timeout=0.25)
    assert 0.25 <= be.monotonic() - start <= 0.25 + 0.002
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    assert w.shutdown().region == "quarantined"


@pytest.mark.rule("R6")
def test_worker_wait_without_timeout_reports_a_failed_sync() -> None:
    # wait() polls (query) so that a shutdown from another thread can end it (R19): the query is where it fails
    plan = kv.FaultPlan([kv.Fault("event_query", "error", job_id=1)])
    be, w, _ = make_worker(SimBackend(plan))
    w.submit_store(1, gspec([1]), cspec([1]))
    w.wait({1})
    (result,) = w.get_finished()
    assert not result.success and isinstance(result.error, kv.DeviceError)
    w.shutdown()


# -- R7: invalid input changes nothing --------------------------------------------------------------------------
def _bad_submissions() -> list[tuple[str, Any]]:
    return [
        ("swapped spec types", lambda w: w.submit_store(9, cspec([1]), gspec([1]))),
        ("load with swapped specs", lambda w: w.submit_load(9, gspec([1]), cspec([1]))),
        ("job id in flight (same direction)", lambda w: w.submit_store(1, gspec([2]), cspec([2]))),
        ("job id in flight (other direction)", lambda w: w.submit_load(1, cspec([2]), gspec([2]))),
        ("job id not an int", lambda w: w.submit_store("9", gspec([2]), cspec([2]))),
        ("job id a bool", lambda w: w.submit_store(True, gspec([2]), cspec([2]))),
        ("gpu id out of range", lambda w: w.submit_store(9, gspec([GPU_BLOCKS]), cspec([2]))),
        ("cpu id out of range", lambda w: w.submit_store(9, gspec([1]), cspec([CPU_CHUNKS]))),
        ("too many cpu ids", lambda w: w.submit_store(9, gspec([1]), cspec([2, 3]))),
        ("too few cpu ids", lambda w: w.submit_store(9, gspec([1, 2, 3, 4]), cspec([2]))),
        ("wrong number of groups", lambda w: w.submit_store(
            9, kv.GPULoadStoreSpec([1, 2], group_sizes=(1, 1), block_indices=(0, 0)), cspec([2]))),
        ("not a spec", lambda w: w.submit_store(9, [1, 2], cspec([2]))),
    ]


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("case", "submit"), _bad_submissions(), ids=[c for c, _ in _bad_submissions()])
def test_worker_invalid_input_raises_and_changes_nothing(case: str, submit: Any) -> None:
    be, w, _ = make_worker()
    w.submit_store(1, gspec([1]), cspec([1]))
    before, clock = w.stats(), be.monotonic()
    with pytest.raises(kv.InvalidTransferError) as info:
        submit(w)
    assert isinstance(info.value, ValueError)
    assert w.stats() == before and be.monotonic() == clock
    w.wait({1})
    assert [r.job_id for r in w.get_finished()] == [1]
    w.shutdown()


@pytest.mark.rule("R7")
@pytest.mark.parametrize("bad", ["wrong count", "wrong row bytes", "host array"])
def test_worker_rejects_wrongly_shaped_tensors(bad: str) -> None:
    be = SimBackend()
    layout = small_layout()
    gpu = [be.empty_device((GPU_BLOCKS, PAGE)) for _ in range(2)]
    if bad == "wrong count":
        gpu = gpu[:1]
    elif bad == "wrong row bytes":
        gpu[1] = be.empty_device((GPU_BLOCKS, PAGE * 2))
    else:
        gpu[0] = np.zeros((GPU_BLOCKS, PAGE), np.uint8)
    with pytest.raises(kv.InvalidTransferError):
        kv.create_worker(be, gpu, layout, blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS)
    assert not be.ledger.live()


@pytest.mark.rule("R5")
def test_worker_stats_snapshot_counts_per_direction() -> None:
    be, w, _ = make_worker()
    w.submit_store(1, gspec([1]), cspec([1]))
    w.submit_load(2, cspec([3]), gspec([3]))
    stats = w.stats()
    assert (stats.store.queued, stats.load.queued, stats.state) == (1, 1, "open")
    be.clock_advance(1.0)
    w.get_finished()
    stats = w.stats()
    assert (stats.store.completed, stats.load.completed, stats.store.queued) == (1, 1, 0)
    assert stats.store.pooled_streams >= 1 and stats.region == "worker_owned"
    with pytest.raises(AttributeError):
        stats.state = "x"  # type: ignore[misc]
    w.shutdown()


_POLL_CALLS = ("monotonic", "query", "query_prefix", "poll_sleep", "sleep", "elapsed", "check_unbounded_wait")


def _record_polls(be: SimBackend, calls: list[str]) -> None:
    """Log each clock, query, pause and timing call of ``be`` (its name) into ``calls``."""
    for name in _POLL_CALLS:
        method = getattr(be, name)
        setattr(be, name, lambda *a, _m=method, _n=name, **k: (calls.append(_n), _m(*a, **k))[1])


@pytest.mark.rule("R6", "R19")
@pytest.mark.parametrize("kind", WORKERS)
def test_worker_wait_polls_once_per_pause_from_its_first_reading(kind: str) -> None:
    """A wait's first poll is made under the same hold of the lock as its search for the awaited job, on the
    clock reading made just before: one query, then the pause, a new reading and the query that proves the job --
    no poll twice in a row, no reading skipped; a job already done is proven by that first poll alone."""
    be, w, _ = make_worker(kind=kind)
    w.submit_store(1, gspec([0]), cspec([0]))
    calls: list[str] = []
    _record_polls(be, calls)
    w.wait([1])
    assert calls == ["monotonic", "query", "check_unbounded_wait", "poll_sleep", "monotonic", "query", "elapsed"]
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    w.submit_load(2, cspec([0]), gspec([4]))
    be.clock_advance(1.0)  # done before the wait begins
    calls.clear()
    w.wait([2], timeout=1.0)
    assert calls == ["monotonic", "query", "elapsed"]
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, True)]
    w.shutdown()


def _timing_lost() -> None:
    """An ``at_call`` action: the timing read fails."""
    raise kv.DeviceError("the timing is lost")


@pytest.mark.rule("R5")
@pytest.mark.parametrize("kind", WORKERS)
def test_worker_a_proven_job_whose_timing_is_lost_succeeds_without_one(kind: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A job proven complete whose timing cannot be read (``elapsed`` fails) is reported a success without a
    transfer_time; the timing is read once per job, and the job proven with it keeps its own (the engine logs the
    lost one)."""
    be, w, _ = make_worker(kind=kind)
    w.submit_store(1, gspec([0]), cspec([0]))
    w.submit_store(2, gspec([1]), cspec([1]))
    be.clock_advance(1.0)  # both done: one get_finished proves them together
    calls: list[str] = []
    _record_polls(be, calls)
    with at_call(be, "elapsed", _timing_lost), caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        results = w.get_finished()
    assert [(r.job_id, r.success, r.transfer_time is None) for r in results] == [(1, True, True), (2, True, False)]
    assert calls.count("elapsed") == 2
    assert ("Could not read the timing of store job 1" in caplog.text) == (kind == "engine")
    w.shutdown()


@pytest.mark.rule("R6")
@pytest.mark.parametrize("kind", WORKERS)
def test_worker_wait_over_both_directions_never_sleeps_past_its_deadline(kind: str) -> None:
    """A wait for a store and a load: the store is proven just before the deadline, the load would end long after.
    The load's first poll reads the clock anew, so no pause runs past the deadline (a reading from before the
    store's wait would allow a whole first pause past it)."""
    def rig() -> tuple[SimBackend, Any]:
        be, w, _ = make_worker(SimBackend(latency=1e-5, pinned_bandwidth=1e6), kind=kind)
        w.submit_store(1, gspec([0, 1, 2]), cspec([0]))  # 3 KiB at 1 MB/s: about 3 ms
        w.submit_load(2, cspec([1, 2, 3]), gspec([3, 4, 5, 6, 7, 8, 9, 10, 11]))  # three times as long
        return be, w

    be, w = rig()
    w.wait({1})
    store_done = be.monotonic()  # when the store alone is proven (the load runs on its own stream meanwhile)
    w.shutdown()
    be, w = rig()
    limit = store_done + base.POLL_FIRST_SLEEP / 4  # the store is proven before it; the load is not
    with pytest.raises(kv.DeadlineExceeded, match=r"^load job 2 not proven complete by the deadline$"):
        w.wait({1, 2}, timeout=limit)
    assert be.monotonic() == pytest.approx(limit, abs=1e-12)  # at the deadline exactly: no pause past it
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    w.shutdown()
