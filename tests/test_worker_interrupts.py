"""The worker's behaviour under interrupts and signal handlers, one documented case each (R8, R14, R19).

The call-point explorer (tests/test_testing_explorer.py) runs every one of these at every backend call; these
name the behaviour a user reads in the docs, each at the call point that showed the bug.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

import kvoffload_ref as kv
from tests._support import at_call, cspec, gspec, make_worker, raise_interrupt


@contextmanager
def handler_calling_shutdown(worker: kv.CPUOffloadingWorker) -> Iterator[list[object]]:
    """A SIGUSR1 handler that calls ``worker.shutdown()`` and records what it returned or raised."""
    seen: list[object] = []

    def handler(signum: int, frame: object) -> None:
        try:
            seen.append(worker.shutdown())
        except kv.ShutdownDeferred as exc:
            seen.append(exc)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.rule("R14")
def test_interrupt_before_the_drain_began_still_finishes_the_shutdown() -> None:
    """A Ctrl-C at shutdown's first clock read (before the drain): the queue is abandoned, the region is
    quarantined (not proven idle), the worker is closed, and a later shutdown() returns that report."""
    be, w, _ = make_worker(timeout=0.5)
    w.submit_store(1, gspec([1, 2]), cspec([0]))
    with at_call(be, "monotonic", raise_interrupt), pytest.raises(KeyboardInterrupt):
        w.shutdown()
    report = w.shutdown()
    assert report.interrupted and report.region == "quarantined" and report.device_sync == "skipped"
    assert report.store.abandoned == 1 and [o.result.job_id for o in report.unreported] == [1]
    assert not be.ledger.live() and w.stats().state == "closed"


@pytest.mark.rule("R14")
def test_real_sigint_held_back_during_the_release_marks_the_report_interrupted() -> None:
    """A real SIGINT landing in the release is held back until the release is done, then propagates -- and the
    report says the shutdown was interrupted."""
    be, w, _ = make_worker(timeout=0.5)
    w.submit_store(1, gspec([1]), cspec([0]))
    w.wait({1})
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with at_call(be, "destroy_stream", lambda: signal.raise_signal(signal.SIGINT)), \
                pytest.raises(KeyboardInterrupt):
            w.shutdown()
    finally:
        signal.signal(signal.SIGINT, previous)
    report = w.shutdown()
    assert report.interrupted and report.region == "released"  # everything was proven idle before it came
    assert not be.ledger.live()


@pytest.mark.rule("R14")
def test_submission_interrupted_after_the_device_took_its_copy_is_queued_whole() -> None:
    """An interrupt at the end event's record: the copy already runs, so the job is queued (and reported) and
    the interrupt propagates afterwards; its bytes arrive."""
    be, w, gpu = make_worker(timeout=0.5)
    with at_call(be, "record", raise_interrupt, nth=3), pytest.raises(KeyboardInterrupt):  # marker, start, end
        w.submit_store(5, gspec([4]), cspec([1]))
    w.wait({5})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(5, True)]
    cpu = w.cpu_snapshot()[0]
    assert np.array_equal(cpu[1, :512], be.to_host(gpu[0])[4])
    assert w.shutdown().region == "released" and not be.ledger.live()


@pytest.mark.rule("R14")
def test_submission_interrupted_before_the_copy_leaves_no_trace_and_frees_its_id() -> None:
    be, w, _ = make_worker(timeout=0.5)
    with at_call(be, "copy", raise_interrupt), pytest.raises(KeyboardInterrupt):
        w.submit_store(5, gspec([4]), cspec([1]))
    assert w.stats().store.queued == 0
    assert w.submit_store(5, gspec([4]), cspec([1]))  # the id is free
    w.wait({5})
    assert [r.job_id for r in w.get_finished()] == [5]
    w.shutdown()
    assert not be.ledger.live()


@pytest.mark.rule("R14")
def test_get_finished_interrupted_at_a_timing_read_loses_no_result() -> None:
    be, w, _ = make_worker(timeout=0.5)
    w.submit_store(1, gspec([1]), cspec([0]))
    w.submit_load(2, cspec([3]), gspec([9]))
    be.clock_advance(0.01)
    with at_call(be, "elapsed", raise_interrupt, nth=2), pytest.raises(KeyboardInterrupt):  # the load's timing
        w.get_finished()
    assert [r.job_id for r in w.get_finished()] == [1, 2]  # the store's result was not handed over and lost
    w.shutdown()


@pytest.mark.rule("R8")
@pytest.mark.rule("R14")
def test_jobs_proven_but_never_reaped_are_listed_in_the_report() -> None:
    be, w, _ = make_worker(timeout=0.5)
    w.submit_store(1, gspec([1]), cspec([0]))
    w.submit_store(2, gspec([2]), cspec([1]))
    w.wait({1, 2})  # proven, never reaped
    report = w.shutdown()
    assert w.get_finished() == []
    assert [(o.result.job_id, o.result.success, o.ended) for o in report.unreported] == [
        (1, True, "unreaped"), (2, True, "unreaped")]


@pytest.mark.rule("R19")
def test_signal_handler_shutdown_inside_a_submission_is_deferred_to_its_return() -> None:
    """A signal handler's shutdown() on the thread inside submit_store: ShutdownDeferred for the handler, the
    submission is queued whole, and the worker is shut down by the time submit_store returns."""
    be, w, _ = make_worker(timeout=0.5)
    with handler_calling_shutdown(w) as seen, at_call(be, "copy", lambda: signal.raise_signal(signal.SIGUSR1)):
        assert w.submit_store(3, gspec([1]), cspec([0]))
    assert len(seen) == 1 and isinstance(seen[0], kv.ShutdownDeferred)
    assert w.stats().state == "closed"
    report = w.shutdown()
    assert [(o.result.job_id, o.ended) for o in report.unreported] == [(3, "drained")]
    assert report.region == "released" and not report.interrupted
    with pytest.raises(kv.WorkerClosedError):
        w.submit_store(4, gspec([2]), cspec([1]))


@pytest.mark.rule("R19")
def test_signal_handler_shutdown_during_a_wait_sleep_runs_at_once() -> None:
    """While wait() sleeps the lock is free: the handler's shutdown() runs there and then, and wait() returns."""
    be, w, _ = make_worker(timeout=0.5)
    w.submit_load(1, cspec([0]), gspec([1]))
    with handler_calling_shutdown(w) as seen, at_call(be, "sleep", lambda: signal.raise_signal(signal.SIGUSR1)):
        w.wait({1}, timeout=0.5)
    assert len(seen) == 1 and isinstance(seen[0], kv.ShutdownReport)
    assert w.shutdown() is seen[0]


@pytest.mark.rule("R19")
def test_other_methods_from_a_signal_handler_inside_a_call_are_refused() -> None:
    be, w, _ = make_worker(timeout=0.5)
    seen: list[BaseException] = []

    def handler(signum: int, frame: object) -> None:
        try:
            w.get_finished()
        except kv.LifecycleError as exc:
            seen.append(exc)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        with at_call(be, "copy", lambda: signal.raise_signal(signal.SIGUSR1)):
            w.submit_store(1, gspec([1]), cspec([0]))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert len(seen) == 1 and "signal handler" in str(seen[0])
    w.shutdown()
