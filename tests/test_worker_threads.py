"""R19 (many threads), R14 (interrupts anywhere in shutdown), R8, R4 after failures: deterministic interleavings.

Each race is reproduced exactly by pausing one thread at a chosen backend call (``tests/_interleave.Pause``), or by
raising an interrupt at one (``Inject``); a bounded ``join`` only keeps a broken test from hanging. Below them, one
randomized stress test per race (small switch interval, a few hundred iterations, bounded time).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from _interleave import Pause, run_in_thread
from _support import BPC, cspec, gspec, make_worker, patterned_gpu, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends.base import Tag
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.handler import DirectionHandler
from kvoffload_ref.reference import create_reference_worker

TIMEOUT = 1.0
SLACK = 0.05
#: How long a test lets a thread run on before it checks that the thread is (still) blocked. The verdicts never
#: depend on it: the fixed code passes whatever it is; the old code failed because the thread was not blocked.
BLOCKED = 0.3


@contextlib.contextmanager
def inject(be: Any, point: str, exc: Callable[[], BaseException], *, job_id: int | None = None,
           nth: int = 1, times: int = 1) -> Iterator[list[int]]:
    """Raise ``exc()`` at the start of the nth (.. nth+times-1) call at ``point`` (matching ``job_id``)."""
    seen: list[int] = []
    previous = be.on_call

    def hook(where: str, tag: Tag | None) -> None:
        if previous is not None:
            previous(where, tag)
        if where != point or (job_id is not None and (tag is None or tag[1] != job_id)):
            return
        seen.append(1)
        if nth <= len(seen) < nth + times:
            raise exc()

    be.on_call = hook
    try:
        yield seen
    finally:
        be.on_call = previous


def _assert_accounted(be: Any, report: kv.ShutdownReport) -> None:
    """R16: nothing live but what the report lists as quarantined or leaked."""
    live = dict(be.ledger.live())
    assert live == {}, (live, report)
    assert report.region in ("released", "quarantined")


# -- 1. a submission racing shutdown ---------------------------------------------------------------------------
@pytest.mark.rule("R19")
def test_threads_submission_racing_shutdown_is_queued_whole_or_refused() -> None:
    be, w, _ = make_worker(timeout=TIMEOUT)
    with Pause(be, "copy", job_id=3) as pause:
        submitter = run_in_thread(lambda: w.submit_store(3, gspec([3]), cspec([3])))
        assert pause.reached.wait(10)  # the submission sits at its copy, inside submit_store
        closer = run_in_thread(w.shutdown)
        assert not closer.join(BLOCKED)  # shutdown waits for the submission to be queued completely
        pause.release()
    assert submitter.join() and closer.join()
    assert submitter.result() is True
    report = closer.result()
    assert report.store.drained == 1 and report.region == "released"  # the queued copy was drained
    assert not be.violations
    _assert_accounted(be, report)


# -- 2. concurrent get_finished ---------------------------------------------------------------------------------
@pytest.mark.rule("R19")
@pytest.mark.rule("R5")
def test_threads_concurrent_get_finished_report_each_job_once() -> None:
    be, w, _ = make_worker(timeout=TIMEOUT)
    for job in (1, 2, 3):
        w.submit_store(job, gspec([job]), cspec([job]))
    be.clock_advance(1.0)
    with Pause(be, "event_query", job_id=1) as pause:
        first = run_in_thread(w.get_finished)
        assert pause.reached.wait(10)  # the first reaper is observing job 1
        second = run_in_thread(w.get_finished)
        assert not second.join(BLOCKED)  # the second waits for the first
        pause.release()
    assert first.join() and second.join()
    jobs = [r.job_id for r in [*first.result(), *second.result()]]
    assert sorted(jobs) == [1, 2, 3]
    w.shutdown()


# -- 3. a wait blocked while another thread shuts down ----------------------------------------------------------
@pytest.mark.rule("R19")
def test_threads_wait_blocked_on_a_hung_job_returns_when_another_thread_shuts_down() -> None:
    be, w, _ = make_worker(SimBackend(kv.FaultPlan([kv.Fault("copy", "hang", job_id=1)])), timeout=TIMEOUT)
    w.submit_store(1, gspec([1]), cspec([1]))
    with Pause(be, "sleep") as pause:
        waiter = run_in_thread(lambda: w.wait({1}, timeout=1000.0))
        assert pause.reached.wait(10)  # the waiter polled once and sleeps (holding no lock)
        started = be.monotonic()
        report = w.shutdown()
        assert be.monotonic() - started <= TIMEOUT + SLACK
        pause.release()
    assert waiter.join()
    assert waiter.result() is None  # it returned, reporting nothing
    assert report.region == "quarantined" and report.store.abandoned == 1
    assert w.get_finished() == []


@pytest.mark.rule("R19")
@pytest.mark.rule("R6")
@pytest.mark.parametrize("create", [kv.create_worker, create_reference_worker], ids=["engine", "reference"])
@pytest.mark.parametrize("timeout", [None, 0.5], ids=["no-timeout", "timeout"])
@pytest.mark.parametrize("clock_read", [2, 3])
def test_threads_wait_returns_empty_when_a_shutdown_completes_between_its_poll_and_its_clock_read(
        create: Callable[..., Any], timeout: float | None, clock_read: int) -> None:
    """The waiter is paused at its ``clock_read``-th clock read (its start time is the first) while another
    thread's whole shutdown runs and moves the clock past the wait's deadline (or the sim's hang horizon): the
    wait must return empty, never raise DeadlineExceeded or SimHang (the clock was read after the poll)."""
    be = SimBackend(kv.FaultPlan([kv.Fault("copy", "hang", job_id=1)]), hang_horizon=0.5)
    layout = small_layout()
    w = create(be, patterned_gpu(be, layout), layout, blocks_per_chunk=BPC, num_cpu_chunks=4,
               policy=kv.ShutdownPolicy(timeout=TIMEOUT))
    w.submit_store(1, gspec([1]), cspec([1]))
    with Pause(be, "monotonic", nth=clock_read) as pause:
        waiter = run_in_thread(lambda: w.wait({1}, timeout=timeout))
        assert pause.reached.wait(10)  # the waiter polled (or is about to) and holds no lock
        report = w.shutdown()  # the hung job is abandoned at the shutdown's deadline: past the wait's
        assert be.monotonic() >= 0.5
        pause.release()
    assert waiter.join()
    assert waiter.exception is None  # not DeadlineExceeded, not SimHang (R19)
    assert waiter.result() is None
    assert report.store.abandoned == 1


@pytest.mark.rule("R11")
@pytest.mark.rule("R9")
@pytest.mark.parametrize("create", [kv.create_worker, create_reference_worker], ids=["engine", "reference"])
@pytest.mark.parametrize("clock_read", [2, 3])
def test_threads_drain_polls_once_more_when_time_passed_between_its_poll_and_its_clock_read(
        create: Callable[..., Any], clock_read: int) -> None:
    """The shutdown's drain is paused at its ``clock_read``-th clock read (its start time is the first) while the
    clock moves past its deadline and the pending copy completes meanwhile (time that passed while its thread was
    descheduled): the drain must poll again and drain it, not abandon a job that completed before the deadline."""
    be = SimBackend()
    layout = small_layout()
    w = create(be, patterned_gpu(be, layout), layout, blocks_per_chunk=BPC, num_cpu_chunks=4,
               policy=kv.ShutdownPolicy(timeout=TIMEOUT))
    w.submit_store(1, gspec([1]), cspec([1]))  # pending: the sim completes it once its clock moves
    with Pause(be, "monotonic", nth=clock_read) as pause:
        closer = run_in_thread(w.shutdown)
        assert pause.reached.wait(10)
        be.clock_advance(2 * TIMEOUT)  # the copy completes; the shutdown's deadline passes
        pause.release()
    assert closer.join()
    report = closer.result()
    assert (report.store.drained, report.store.abandoned) == (1, 0)
    assert report.region == "released" and not report.errors


# -- 4. a second shutdown while the first runs --------------------------------------------------------------------
@pytest.mark.rule("R19")
@pytest.mark.rule("R8")
def test_threads_second_shutdown_waits_for_the_first_and_returns_its_report() -> None:
    be, w, _ = make_worker(SimBackend(kv.FaultPlan([kv.Fault("copy", "hang", job_id=1)])), timeout=TIMEOUT)
    w.submit_store(1, gspec([1]), cspec([1]))
    with Pause(be, "device_sync") as pause:  # the first shutdown reaches the device-level proof
        first = run_in_thread(w.shutdown)
        assert pause.reached.wait(10)
        second = run_in_thread(w.shutdown)
        assert not second.join(BLOCKED)  # it waits; it does not raise WorkerClosedError
        pause.release()
    assert first.join() and second.join()
    assert second.result() is first.result()
    assert w.shutdown() is first.result()


# -- 5. interrupts in the release ---------------------------------------------------------------------------------
def _completed_worker(**kwargs: Any) -> tuple[Any, kv.CPUOffloadingWorker]:
    be, w, _ = make_worker(timeout=TIMEOUT, **kwargs)
    w.submit_store(1, gspec([1]), cspec([1]))
    w.submit_load(2, cspec([1]), gspec([9]))
    be.clock_advance(1.0)
    return be, w


@pytest.mark.rule("R14")
@pytest.mark.parametrize("point", ["destroy_event", "destroy_stream", "free_descriptors", "host_unregister",
                                   "untrack_host"])
def test_threads_one_interrupt_in_the_release_is_finished_and_reported(point: str) -> None:
    be, w = _completed_worker()
    with inject(be, point, KeyboardInterrupt) as seen, pytest.raises(KeyboardInterrupt):
        w.shutdown()
    assert seen, f"no {point} call was made"
    report = w.shutdown()
    assert report.interrupted and report.region == "released"
    assert report.store.drained == 1 and report.load.drained == 1
    _assert_accounted(be, report)


@pytest.mark.rule("R14")
def test_threads_second_interrupt_while_the_first_is_handled_still_ends_released_or_quarantined() -> None:
    plan = kv.FaultPlan([kv.Fault("copy", "hang", job_id=3)])
    be, w, _ = make_worker(SimBackend(plan), timeout=TIMEOUT)
    w.submit_store(1, gspec([1]), cspec([1]))
    w.submit_store(3, gspec([3]), cspec([3]))  # never completes: the region must be quarantined
    be.clock_advance(1.0)
    with inject(be, "event_query", KeyboardInterrupt, job_id=3), \
            inject(be, "destroy_event", KeyboardInterrupt, times=2), \
            inject(be, "free_descriptors", KeyboardInterrupt), pytest.raises(KeyboardInterrupt):
        w.shutdown()  # Ctrl-C in the drain, then twice more while the release runs
    report = w.shutdown()
    assert report.interrupted and report.region == "quarantined" and report.device_sync == "skipped"
    assert report.store.drained == 1 and report.store.abandoned == 1
    assert any(item.kind == "region" for item in kv.quarantined())
    quarantined = dict(be.ledger.quarantined())
    assert quarantined.get("mapping") == 1 and quarantined == dict(report.quarantined)
    _assert_accounted(be, report)


# -- 6. an interrupted drain counts what it drained --------------------------------------------------------------
@pytest.mark.rule("R14")
def test_threads_interrupted_drain_reports_what_it_drained() -> None:
    be, w, _ = make_worker(SimBackend(kv.FaultPlan([kv.Fault("copy", "hang", job_id=3)])), timeout=TIMEOUT)
    for job in (1, 2, 3):
        w.submit_store(job, gspec([job]), cspec([job]))
    be.clock_advance(1.0)
    with inject(be, "event_query", KeyboardInterrupt, job_id=3), pytest.raises(KeyboardInterrupt):
        w.shutdown()
    report = w.shutdown()
    assert report.interrupted and report.store.drained == 2 and report.store.abandoned == 1


# -- 7. strict FIFO after a failure ----------------------------------------------------------------------------------
@pytest.mark.rule("R4")
@pytest.mark.rule("R27")
@pytest.mark.rule("R28")
def test_threads_transfer_after_a_failed_one_waits_for_its_end() -> None:
    plan = kv.FaultPlan([kv.Fault("event_query", "error", job_id=1, nth=1)])
    be, w, gpu = make_worker(SimBackend(plan), timeout=TIMEOUT)
    w.submit_store(1, gspec([1, 2, 3]), cspec([4]))  # fails when observed, while its copy is still pending
    (failed,) = w.get_finished()
    assert not failed.success
    # R27: its copy may still write chunk 4 (the direction goes on on a fresh stream, R28): the chunk is held
    assert w.held().cpu_chunks == (4,)
    with pytest.raises(kv.BlocksHeldError):
        w.submit_store(2, gspec([5, 6, 7]), cspec([4]))
    be.clock_advance(1.0)  # job 1's copy has run by now
    assert w.get_finished() == []  # a polling call observes its end event: the hold ends
    assert [(r.job_id, r.cpu_chunks) for r in w.take_released()] == [(1, (4,))]
    w.submit_store(2, gspec([5, 6, 7]), cspec([4]))  # same chunk: now after job 1's copy
    w.wait({2})
    (ok,) = w.get_finished()
    assert ok.success
    chunk = w.cpu_snapshot()[0][4]
    expected = np.concatenate([be.to_host(gpu[0])[b] for b in (5, 6, 7)])
    assert np.array_equal(chunk, expected)
    w.shutdown()
    assert be.violations == []


# -- 10. the two test holes -------------------------------------------------------------------------------------------
@pytest.mark.rule("R5")
def test_threads_reported_job_id_can_be_reused() -> None:
    _reuse_a_reported_job_id()


def _reuse_a_reported_job_id() -> None:
    be, w, _ = make_worker(timeout=TIMEOUT)
    for _ in range(3):
        w.submit_store(7, gspec([1]), cspec([1]))
        w.wait({7})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(7, True)]
    w.shutdown()


def _keeps_reported_ids(self: DirectionHandler) -> list[Any]:
    """A handler that forgets to drop a job id once it was reported."""
    results, self._resolved = self._resolved, []
    return results


def _ignores_failed_end_record(original: Callable[..., None]) -> Callable[..., None]:
    """A handler that queues a transfer whose end event could not be recorded as if nothing had happened."""
    def record_end(self: DirectionHandler, transfer: Any, shield: Any) -> None:
        original(self, transfer, shield)
        transfer.broken, self._broken = None, False
    return record_end


@pytest.mark.rule("R5")
@pytest.mark.rule("R16")
@pytest.mark.parametrize("mutant", ["keeps reported ids", "ignores a failed end record"])
def test_threads_the_two_hole_tests_catch_their_bug(mutant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two tests above fail on a handler with the bug each is written for (a deliberate mutant)."""
    if mutant == "keeps reported ids":
        monkeypatch.setattr(DirectionHandler, "take_results", _keeps_reported_ids)
        with pytest.raises(kv.InvalidTransferError, match="already in flight"):
            _reuse_a_reported_job_id()
    else:
        monkeypatch.setattr(DirectionHandler, "_record_end", _ignores_failed_end_record(DirectionHandler._record_end))
        with pytest.raises(AssertionError):
            _fail_after_the_copy_was_queued()


@pytest.mark.rule("R13")
@pytest.mark.rule("R14")
@pytest.mark.rule("R16")
def test_threads_submission_failing_after_its_copy_is_queued_and_never_reuses_its_descriptors() -> None:
    _fail_after_the_copy_was_queued()


def _fail_after_the_copy_was_queued() -> None:
    be, w, _ = make_worker(timeout=TIMEOUT)
    w.submit_store(1, gspec([1]), cspec([1]))
    w.wait({1})
    w.get_finished()  # job 1's descriptor buffer is idle in the pool now
    with inject(be, "record", lambda: kv.DeviceError("end record failed", 700), job_id=2, nth=3):
        # the copy was queued, then the end record failed: the job is queued all the same (R14), and since its
        # end event can never prove it, it is reported failed (R5)
        assert w.submit_store(2, gspec([2]), cspec([2]))
    assert w.stats().store.queued == 1 and w.stats().store.pooled_descriptors == 0
    allocated = be.ledger.acquired().get("descriptor", 0)
    w.submit_store(3, gspec([3]), cspec([3]))
    assert be.ledger.acquired().get("descriptor", 0) == allocated + 1  # a new buffer, not job 2's
    w.wait({3})
    results = w.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(2, False), (3, False)]  # 3 is behind the failure (R5)
    assert "end record failed" in str(results[0].error)
    assert w.stats().store.unproven == 2  # never reused: the device may still read their descriptors
    report = w.shutdown()
    assert report.device_sync == "ok" and report.region == "released"  # not the clean path: proven idle
    assert not be.violations
    _assert_accounted(be, report)


# -- R7 at wait() and create_worker -----------------------------------------------------------------------------------
@pytest.mark.rule("R7")
@pytest.mark.parametrize("call", [
    lambda w: w.wait(8), lambda w: w.wait("12"), lambda w: w.wait({True}), lambda w: w.wait({1.5}),
    lambda w: w.wait({1}, timeout=float("nan")), lambda w: w.wait({1}, timeout="1"),
    lambda w: w.wait({1}, timeout=-1.0), lambda w: w.wait({1}, timeout=True),
], ids=["int", "str", "bool id", "float id", "nan", "str timeout", "negative", "bool timeout"])
def test_threads_wait_refuses_bad_arguments(call: Callable[[kv.CPUOffloadingWorker], None]) -> None:
    be, w, _ = make_worker(timeout=TIMEOUT)
    w.submit_store(1, gspec([1]), cspec([1]))
    with pytest.raises(kv.InvalidTransferError):
        call(w)
    w.wait({1}, timeout=float("inf"))  # infinity: no bound
    assert [r.job_id for r in w.get_finished()] == [1]
    w.shutdown()


@pytest.mark.rule("R7")
def test_threads_region_of_another_backend_is_refused() -> None:

    be, other = SimBackend(), SimBackend()
    layout = small_layout()
    region = kv.HostRegion.allocate(other, layout, 3, 4)
    with pytest.raises(kv.InvalidTransferError, match="backend"):
        kv.create_worker(be, patterned_gpu(be, layout), layout, blocks_per_chunk=3, num_cpu_chunks=4, region=region)
    region.release()
    assert not other.ledger.live()


# -- randomized stress, one per race --------------------------------------------------------------------------------
@contextlib.contextmanager
def _fast_switching() -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def _race(*fns: Callable[[], object]) -> list[Any]:
    """Run the functions in threads released together; returns their results (exceptions re-raised)."""
    barrier = threading.Barrier(len(fns))

    def gated(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            barrier.wait(10)
            return fn()
        return run

    handles = [run_in_thread(gated(fn)) for fn in fns]
    assert all(h.join() for h in handles)
    return [h.exception if isinstance(h.exception, kv.WorkerClosedError) else h.result() for h in handles]


@pytest.mark.rule("R19")
def test_threads_stress_submit_racing_shutdown() -> None:
    def submit_until_closed(w: kv.CPUOffloadingWorker) -> int:
        for job in range(1, 400):
            try:
                w.submit_store(job, gspec([job % 60]), cspec([job % 16]))
            except kv.WorkerClosedError:
                return job
        return 0

    with _fast_switching():
        for i in range(200):
            be, w, _ = make_worker(timeout=TIMEOUT)
            submitter = run_in_thread(functools.partial(submit_until_closed, w))
            report = w.shutdown()  # while the submitter is busy submitting
            assert submitter.join()
            submitted = submitter.result()
            be.clock_advance(1.0)  # a copy queued after the release would run now, into unmapped memory
            assert not be.violations, (i, submitted, be.violations[:1])
            _assert_accounted(be, report)


@pytest.mark.rule("R19")
def test_threads_stress_concurrent_get_finished_and_wait() -> None:
    with _fast_switching():
        for i in range(150):
            be, w, _ = make_worker(timeout=TIMEOUT)
            for job in range(4):
                w.submit_store(job, gspec([job]), cspec([job]))
            be.clock_advance(1.0)
            results = _race(w.get_finished, w.get_finished, functools.partial(w.wait, range(4), timeout=1.0))
            jobs = sorted(r.job_id for batch in results[:2] for r in batch)
            assert jobs == [0, 1, 2, 3], (i, jobs)
            w.shutdown()


@pytest.mark.rule("R19")
def test_threads_stress_waits_and_shutdowns_racing() -> None:
    with _fast_switching():
        for i in range(100):
            be, w, _ = make_worker(SimBackend(kv.FaultPlan([kv.Fault("copy", "hang", job_id=1)])),
                                   timeout=TIMEOUT)
            w.submit_store(1, gspec([1]), cspec([1]))
            results = _race(functools.partial(w.wait, {1}, timeout=1000.0), w.shutdown, w.shutdown)
            assert results[0] is None and results[1] is results[2], i
            assert results[1].region == "quarantined"
