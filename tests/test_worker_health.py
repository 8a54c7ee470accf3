"""R30: a running worker's health in ``stats()`` (per direction: the oldest unproven transfer's device age, the
holds and the oldest hold's age, the retired streams) and the stall warning -- on both workers."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from _support import CREATE, cspec, gspec, make_worker

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.results import HandlerStats


def _worker(kind: str, faults: list[kv.Fault] = (), **kwargs: Any) -> tuple[SimBackend, Any]:  # type: ignore[assignment]
    be = SimBackend(faults=kv.FaultPlan(list(faults)), latency=kwargs.pop("latency", 5e-6))
    _, worker, _ = make_worker(be, kind=kind, timeout=0.01, **kwargs)
    return be, worker


def _hang(direction: str, job: int) -> kv.Fault:
    return kv.Fault("copy", "hang", direction=direction, job_id=job)


def _stalls(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "stall_warning" in
            r.getMessage()]


@pytest.mark.rule("R30")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_stats_health_is_empty_on_an_idle_worker(kind: str) -> None:
    be, w = _worker(kind)
    for stats in (w.stats().store, w.stats().load):
        assert (stats.oldest_unproven_age, stats.held_gpu_blocks, stats.held_cpu_chunks, stats.oldest_hold_age,
                stats.retired_streams) == (None, 0, 0, None, 0)
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]))
    be.clock_advance(1.0)
    w.get_finished()
    assert w.stats().store.oldest_unproven_age is None  # proven: nothing unproven is queued
    w.shutdown()


@pytest.mark.rule("R30")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_stats_age_of_a_stuck_load_grows_on_the_backend_clock(kind: str) -> None:
    be, w = _worker(kind, [_hang("load", 2)], stall_warning=100.0)  # polls (and stats) watch the head's start
    w.submit_load(2, cspec([0]), gspec([5, 6, 7]))
    assert w.stats().load.oldest_unproven_age is None  # stats asks the device nothing: no poll saw it start yet
    w.get_finished()  # this poll sees it started (the stall warning watches the head)
    assert w.stats().load.oldest_unproven_age == 0.0
    be.clock_advance(2.5)
    stats = w.stats()
    assert stats.load.oldest_unproven_age == pytest.approx(2.5)
    assert stats.store.oldest_unproven_age is None and stats.load.queued == 1
    w.shutdown()


@pytest.mark.rule("R30")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_stats_age_counts_from_the_device_start_not_the_submission(kind: str) -> None:
    """Job 2 waits behind job 1's copy (latency 1 s) before it starts: its age starts at the poll that first sees it
    started (a backend sees a start only at a poll, R26), not at its submission."""
    be, w = _worker(kind, [_hang("load", 2)], latency=1.0, stall_warning=100.0)
    w.submit_load(1, cspec([0]), gspec([1]))
    w.submit_load(2, cspec([1]), gspec([2]))
    w.get_finished()
    assert w.stats().load.oldest_unproven_age == 0.0  # job 1, the head, started at once
    be.clock_advance(1.5)
    assert [r.job_id for r in w.get_finished()] == [1]
    assert w.stats().load.oldest_unproven_age == 0.0  # job 2 started at 1.0, first seen started now (R26's start)
    be.clock_advance(0.5)
    assert w.stats().load.oldest_unproven_age == pytest.approx(0.5)  # from its start, not from its submission
    w.shutdown()


@pytest.mark.rule("R30")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_stats_counts_holds_and_retired_streams_per_direction(kind: str) -> None:
    be, w = _worker(kind, [_hang("load", 2)])
    w.submit_load(2, cspec([0]), gspec([5, 6, 7]), deadline=1.0)
    w.submit_load(3, cspec([1]), gspec([7, 8]))  # behind it: late too ("behind"), GPU block 7 counted once
    w.get_finished()  # the first poll sees job 2 start
    be.clock_advance(1.0)
    assert [type(r.error).__name__ for r in w.get_finished()] == ["TransferExpired"] * 2
    be.clock_advance(0.75)
    stats = w.stats()
    assert (stats.load.held_gpu_blocks, stats.load.held_cpu_chunks, stats.load.retired_streams) == (4, 2, 1)
    assert stats.load.oldest_hold_age == pytest.approx(0.75)
    assert stats.load.oldest_unproven_age is None  # nothing live is queued; the late copies are holds
    assert (stats.store.held_gpu_blocks, stats.store.held_cpu_chunks, stats.store.oldest_hold_age,
            stats.store.retired_streams) == (0, 0, None, 0)  # the other direction holds nothing
    w.submit_load(4, cspec([2]), gspec([9]))  # a fresh stream serves new loads (R28)
    be.clock_advance(0.25)
    assert [r.job_id for r in w.get_finished() if r.success] == [4]
    assert w.stats().load.retired_streams == 1 and w.stats().load.oldest_hold_age == pytest.approx(1.0)
    w.shutdown()


@pytest.mark.rule("R30")
def test_handler_stats_positional_construction_keeps_working() -> None:
    stats = HandlerStats("store", "accepting", 0, 0, 0, 0, 0, 0, 0, 1, 0, 0)
    assert (stats.oldest_unproven_age, stats.held_gpu_blocks, stats.retired_streams) == (None, 0, 0)


# -- the stall warning --------------------------------------------------------------------------------------------
@pytest.mark.rule("R30")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_stall_warning_names_job_direction_and_age_once(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    be, w = _worker(kind, [_hang("load", 2)], stall_warning=0.5)
    w.submit_load(2, cspec([0]), gspec([5, 6, 7]))
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        w.get_finished()  # sees it start
        be.clock_advance(0.25)
        w.get_finished()
        assert _stalls(caplog) == []  # not stalled yet
        be.clock_advance(0.5)
        w.get_finished()
        be.clock_advance(1.0)
        w.get_finished()
        w.stats()
    (message,) = _stalls(caplog)
    assert "load job 2" in message and "0.750 s" in message
    w.shutdown()


@pytest.mark.rule("R30")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_stall_warning_is_off_by_default(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    be, w = _worker(kind, [_hang("store", 1)])
    w.submit_store(1, gspec([0]), cspec([0]))
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        for _ in range(3):
            w.get_finished()
            be.clock_advance(100.0)
    assert _stalls(caplog) == []
    w.shutdown()


@pytest.mark.rule("R30")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_stall_warning_spares_a_job_that_completes_in_time(kind: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    be, w = _worker(kind, [_hang("store", 2)], stall_warning=0.5, latency=0.4)
    w.submit_store(1, gspec([0]), cspec([0]))  # takes 0.4 s: under the threshold
    w.submit_store(2, gspec([1]), cspec([1]))  # stuck behind it, then on its own
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        for _ in range(12):  # job 1 is proven at 0.5 (0.5 s after it was seen started); job 2 stalls
            w.get_finished()
            be.clock_advance(0.125)
    (message,) = _stalls(caplog)
    assert "store job 2" in message and "job 1 " not in message
    w.shutdown()


@pytest.mark.rule("R30")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_stats_start_query_failure_is_found_by_the_next_poll_not_by_stats(kind: str) -> None:
    """stats() asks the device nothing, with a deadline on the head too: a start event whose query fails is found by
    the next poll, which fails the job (R5: reported failed, with what it poisoned)."""
    be, w = _worker(kind, [kv.Fault("event_query", "error", direction="load", job_id=2, nth=1)])
    w.submit_load(2, cspec([0]), gspec([5, 6]), deadline=10.0)  # a deadline: polls ask its start
    stats = w.stats().load
    assert (stats.queued, stats.unreported, stats.oldest_unproven_age, stats.retired_streams) == (1, 0, None, 0)
    (result,) = w.get_finished()
    assert not result.success and result.invalid_blocks == (5, 6)
    w.shutdown()


@pytest.mark.rule("R30")
@pytest.mark.parametrize("kind", list(CREATE))
@pytest.mark.parametrize("deadline", [None, 10.0])
def test_worker_stats_makes_no_device_call(kind: str, deadline: float | None) -> None:
    """stats() stays a snapshot without device calls (it observes nothing the caller did not, consumes no fault);
    without a deadline or the stall warning no poll asks a start event either: no age."""
    be, w = _worker(kind, [_hang("load", 2)])
    w.submit_load(2, cspec([0]), gspec([5, 6, 7]), deadline=deadline)
    w.get_finished()
    be.clock_advance(2.0)
    calls: list[str] = []
    be.on_call = lambda point, tag: calls.append(point)
    stats = w.stats()
    be.on_call = None
    assert stats.load.queued == 1 and stats.load.oldest_unproven_age == (None if deadline is None else 2.0)
    assert [c for c in calls if c != "monotonic"] == []
    w.shutdown()


@pytest.mark.rule("R30")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_stats_reports_the_start_a_poll_saw_of_a_head_with_a_deadline(kind: str) -> None:
    be, w = _worker(kind, [_hang("load", 2)])  # no stall warning: the deadline makes polls ask the start
    w.submit_load(2, cspec([0]), gspec([5, 6, 7]), deadline=10.0)
    assert w.stats().load.oldest_unproven_age is None
    w.get_finished()
    assert w.stats().load.oldest_unproven_age == 0.0
    be.clock_advance(2.0)
    assert w.stats().load.oldest_unproven_age == pytest.approx(2.0)
    w.shutdown()


@pytest.mark.rule("R30")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_stats_age_counts_a_live_job_left_on_a_retired_stream(kind: str) -> None:
    """Cancelling job 3 retires the stream with job 2, still live, ahead of it (R28): job 2 is still the oldest
    unproven transfer, aged from the start a poll saw."""
    be, w = _worker(kind, [_hang("load", 2)], stall_warning=100.0)
    w.submit_load(2, cspec([0]), gspec([5]))
    w.submit_load(3, cspec([1]), gspec([6]))
    w.get_finished()  # sees job 2 start
    w.cancel([3])
    be.clock_advance(2.0)
    stats = w.stats().load
    assert (stats.queued, stats.retired_streams, stats.held_gpu_blocks) == (0, 1, 1)
    assert stats.oldest_unproven_age == pytest.approx(2.0) and stats.oldest_hold_age == pytest.approx(2.0)
    w.shutdown()
