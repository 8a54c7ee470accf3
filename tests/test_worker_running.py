"""A running engine survives its own stuck transfers (R26-R28): deadlines, cancel, held blocks, fresh streams.

Every test runs on both workers (the engine and the normative reference) over the simulated device.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from tests._support import BPC, CPU_CHUNKS, WORKERS, at_call, cspec, gspec, make_worker

#: A link slow enough that a transfer's copy takes milliseconds of virtual time (3 blocks x 2 tensors x 512 B:
#: 3 KiB at 1 MB/s is about 3 ms), so a deadline can pass while the copy still runs.
SLOW = {"latency": 1e-5, "pinned_bandwidth": 1e6}


def build(kind: str, be: SimBackend | None = None, **kwargs: Any) -> tuple[SimBackend, Any, list[Any]]:
    return make_worker(be if be is not None else SimBackend(**SLOW), kind=kind, **kwargs)


def live_streams(be: SimBackend) -> int:
    return be.ledger.live().get("stream", 0)


def chunk_bytes(be: SimBackend, gpu: list[Any], blocks: list[int]) -> list[np.ndarray]:
    """What a store of ``blocks`` into one chunk writes, per tensor."""
    return [np.concatenate([be.to_host(g)[b] for b in blocks]) for g in gpu]


# -- R26: deadlines ------------------------------------------------------------------------------------------------
@pytest.mark.rule("R26")
@pytest.mark.rule("R28")
@pytest.mark.parametrize("kind", WORKERS)
def test_running_expired_head_and_the_job_behind_it_are_reported_once(kind: str) -> None:
    be, w, _ = build(kind)
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]), deadline=0.001, tag="a")
    w.submit_store(2, gspec([3, 4, 5]), cspec([1]), tag="b")
    assert w.get_finished() == []  # the first poll sees job 1 started: its deadline counts from here
    be.clock_advance(0.0015)  # past the deadline, before its copy (about 3 ms) is done
    first, second = w.get_finished()
    assert (first.job_id, first.success, second.job_id, second.success) == (1, False, 2, False)
    assert isinstance(first.error, kv.TransferExpired) and first.error.reason == "deadline"
    assert isinstance(second.error, kv.TransferExpired) and second.error.reason == "behind"
    assert second.error.ahead == 1 and isinstance(second.error, kv.DeviceError)
    assert (first.invalid_blocks, second.invalid_blocks) == ((0,), (1,))  # R22: the CPU chunks of the stores
    assert (first.tag, second.tag) == ("a", "b")
    assert w.get_finished() == []  # each reported exactly once
    w.shutdown()


@pytest.mark.rule("R26")
@pytest.mark.parametrize("kind", WORKERS)
def test_running_copy_proven_complete_is_a_success_past_its_deadline(kind: str) -> None:
    be, w, _ = build(kind)
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]), deadline=0.001)
    assert w.get_finished() == []
    be.clock_advance(1.0)  # far past the deadline, and the copy is done: the end event is asked first
    (result,) = w.get_finished()
    assert result.success
    w.shutdown()


@pytest.mark.rule("R26")
@pytest.mark.parametrize("kind", WORKERS)
def test_running_deadline_counts_from_the_device_start_not_from_submission(kind: str) -> None:
    be, w, _ = build(kind)
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]))  # about 3 ms of copy ahead of job 2
    w.submit_store(2, gspec([3, 4, 5]), cspec([1]), deadline=0.002)
    be.clock_advance(0.0029)  # job 2 queued 2.9 ms: longer than its deadline, but it has not started
    assert [r.job_id for r in w.get_finished()] == []
    be.clock_advance(0.0002)  # job 1 done, job 2 starts: this poll sees it
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    be.clock_advance(0.0035)  # job 2's own copy has finished within 2 ms of its start... plus polling slack
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, True)]
    w.shutdown()


@pytest.mark.rule("R26")
@pytest.mark.rule("R7")
@pytest.mark.parametrize("kind", WORKERS)
@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, -math.inf, True, "1", None.__class__])
def test_running_bad_deadline_is_refused_and_nothing_is_queued(kind: str, bad: object) -> None:
    be, w, _ = build(kind)
    with pytest.raises(kv.InvalidTransferError, match="deadline"):
        w.submit_load(1, cspec([0]), gspec([0, 1, 2]), deadline=bad)
    assert w.stats().load.submitted == 0
    w.submit_load(1, cspec([0]), gspec([0, 1, 2]), deadline=1.0)  # the id stays free
    w.shutdown()


# -- R26: cancel ---------------------------------------------------------------------------------------------------
@pytest.mark.rule("R26")
@pytest.mark.parametrize("kind", WORKERS)
def test_running_cancel_reports_a_done_job_as_done_and_ends_the_rest(kind: str) -> None:
    be, w, _ = build(kind)
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]))
    w.submit_store(2, gspec([3, 4, 5]), cspec([1]))
    w.submit_store(3, gspec([6, 7, 8]), cspec([2]))
    be.clock_advance(0.0035)  # job 1's copy is done (nobody polled it), job 2's runs
    w.cancel([1, 2, 99])  # 99: unknown, ignored
    done, cancelled, behind = w.get_finished()
    assert (done.job_id, done.success) == (1, True)  # R26: looked at first, reported as it is
    assert (cancelled.job_id, cancelled.error.reason) == (2, "cancel")
    assert (behind.job_id, behind.error.reason, behind.error.ahead) == (3, "behind", 2)
    w.cancel([1, 2, 3])  # all reported already: ignored
    assert w.get_finished() == []
    w.shutdown()
    w.cancel([4])  # after shutdown: a no-op, no error


@pytest.mark.rule("R26")
@pytest.mark.rule("R7")
@pytest.mark.parametrize("kind", WORKERS)
@pytest.mark.parametrize("bad", [[1.5], ["1"], 3, None, [True]])
def test_running_cancel_with_bad_ids_cancels_nothing(kind: str, bad: object) -> None:
    be, w, _ = build(kind)
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]))
    with pytest.raises(kv.InvalidTransferError):
        w.cancel(bad)  # type: ignore[arg-type]
    w.wait({1})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    w.shutdown()


@pytest.mark.rule("R26")
@pytest.mark.rule("R19")
@pytest.mark.parametrize("kind", WORKERS)
def test_running_cancel_from_a_signal_handler_inside_a_call_runs_as_the_call_returns(kind: str) -> None:
    be, w, _ = build(kind)
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]))
    # at the first query the worker's lock is held, as in a signal handler: the cancel must neither deadlock nor
    # raise (deferred)
    with at_call(be, "event_query", lambda: w.cancel([1])):
        assert w.get_finished() == []  # the cancel ran as this call returned
    (result,) = w.get_finished()
    assert (result.job_id, result.error.reason) == (1, "cancel")
    w.shutdown()


# -- R27: held blocks ----------------------------------------------------------------------------------------------
@pytest.mark.rule("R27")
@pytest.mark.rule("R20")
@pytest.mark.parametrize("kind", WORKERS)
def test_running_held_blocks_refused_until_the_late_copy_lands(kind: str) -> None:
    be, w, gpu = build(kind)
    w.submit_store(1, gspec([0, 1, 2]), cspec([5]), tag="t1")
    w.cancel([1])  # its copy is on the device: it may still read GPU 0-2 and write chunk 5
    (result,) = w.get_finished()
    assert result.error.reason == "cancel"
    held = w.held()
    assert (held.gpu_blocks, held.cpu_chunks) == ((0, 1, 2), (5,))
    assert (held.gpu_blocks_writes_only, held.cpu_chunks_writes_only) == ((0, 1, 2), ())
    with pytest.raises(kv.BlocksHeldError):  # a load would write GPU 0 while the late store reads it
        w.submit_load(2, cspec([6]), gspec([0, 9, 10]))
    with pytest.raises(kv.BlocksHeldError):  # a store would write chunk 5
        w.submit_store(2, gspec([9, 10, 11]), cspec([5]))
    with pytest.raises(kv.BlocksHeldError):  # a load would read chunk 5 while the late store writes it
        w.submit_load(2, cspec([5]), gspec([9, 10, 11]))
    w.submit_store(2, gspec([0, 1, 2]), cspec([6]))  # two reads of GPU 0-2 never conflict (R20)
    assert w.take_released() == []
    be.clock_advance(0.01)  # the late copy lands
    w.wait({2})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, True)]
    (released,) = w.take_released()
    assert (released.job_id, released.direction, released.gpu_blocks, released.cpu_chunks, released.tag) == (
        1, "store", (0, 1, 2), (5,), "t1")
    assert w.take_released() == [] and w.held() == kv.HeldBlocks()  # handed out once
    w.submit_store(3, gspec([9, 10, 11]), cspec([5]))  # chunk 5 is free again
    w.wait({3})
    assert w.get_finished()[0].success
    assert all(np.array_equal(a, b) for a, b in zip([s[5] for s in w.cpu_snapshot()],
                                                    chunk_bytes(be, gpu, [9, 10, 11]), strict=True))
    w.shutdown()
    assert be.violations == []  # a correct caller's schedule: no R20 violation


@pytest.mark.rule("R27")
@pytest.mark.parametrize("kind", WORKERS)
def test_running_refused_submission_changes_nothing_and_keeps_the_id_free(kind: str) -> None:
    be, w, _ = build(kind)
    w.submit_load(1, cspec([0]), gspec([0, 1, 2]))
    w.cancel([1])
    w.get_finished()
    before = w.stats()
    with pytest.raises(kv.BlocksHeldError) as caught:
        w.submit_load(7, cspec([1]), gspec([2, 3, 4]))
    assert isinstance(caught.value, kv.InvalidTransferError) and "[2]" in str(caught.value)
    assert w.stats() == before
    w.submit_load(7, cspec([1]), gspec([3, 4, 5]))  # the id is free
    w.shutdown()


# -- R28: fresh streams --------------------------------------------------------------------------------------------
@pytest.mark.rule("R28")
@pytest.mark.rule("R27")
@pytest.mark.parametrize("kind", WORKERS)
def test_running_hung_load_expires_and_the_direction_serves_new_loads_on_a_fresh_stream(kind: str) -> None:
    be, w, gpu = build(kind, SimBackend(kv.FaultPlan([kv.Fault("copy", "hang", direction="load", nth=2)])))
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]))
    w.submit_store(2, gspec([3, 4, 5]), cspec([1]))
    w.wait({1, 2})
    w.get_finished()
    w.submit_load(10, cspec([0]), gspec([20, 21, 22]))
    w.wait({10})
    w.submit_load(11, cspec([1]), gspec([30, 31, 32]), deadline=0.5)  # hangs on the device
    w.submit_load(12, cspec([0]), gspec([40, 41, 42]))  # behind it on the same stream
    assert [r.job_id for r in w.get_finished()] == [10]
    streams = live_streams(be)
    be.clock_advance(0.6)
    expired, behind = w.get_finished()
    assert (expired.error.reason, behind.error.reason) == ("deadline", "behind")
    assert w.held().gpu_blocks == (30, 31, 32, 40, 41, 42)
    w.submit_load(13, cspec([1]), gspec([50, 51, 52]))  # a fresh stream: not behind the hung one
    assert live_streams(be) == streams + 1
    w.wait({13}, timeout=1.0)
    (ok,) = w.get_finished()
    assert ok.success and ok.job_id == 13
    loaded = [be.to_host(g)[[50, 51, 52]].reshape(-1) for g in gpu]
    assert all(np.array_equal(a, b) for a, b in zip(loaded, chunk_bytes(be, gpu, [3, 4, 5]), strict=True))
    assert w.stats().load.unproven == 2  # the late copies: held, never freed while they may run
    report = w.shutdown()
    assert report.region == "quarantined"  # the hung copy may still run: what it touches is kept
    assert report.quarantined.get("stream") == 1  # the retired stream could not be proven idle (R28, R16)
    assert report.load.retired_streams == 1


# -- the whole story: R26-R29 together -----------------------------------------------------------------------------
@pytest.mark.rule("R26")
@pytest.mark.rule("R27")
@pytest.mark.rule("R28")
@pytest.mark.rule("R29")
@pytest.mark.parametrize("kind", WORKERS)
def test_running_engine_survives_a_hung_load_and_quarantines_only_what_a_stuck_copy_touches(kind: str) -> None:
    """A hung load expires; the direction serves new loads on a fresh stream with the right bytes; the held blocks
    are refused, then released once the late copy lands; a second load stuck at shutdown keeps only the
    registrations holding the chunk it reads."""
    plan = kv.FaultPlan([kv.Fault("copy", "hang", direction="load", job_id=11),
                         kv.Fault("copy", "hang", direction="load", job_id=20)])
    be, w, gpu = build(kind, SimBackend(plan), pin_chunk_bytes=4096)  # one registration per 4 KiB
    for job, chunk in enumerate(range(8)):
        w.submit_store(job, gspec([3 * chunk, 3 * chunk + 1, 3 * chunk + 2]), cspec([chunk]))
    w.wait(range(8))
    assert all(r.success for r in w.get_finished())
    w.submit_load(11, cspec([1]), gspec([40, 41, 42]), deadline=0.01)  # hangs on the device
    be.clock_advance(0.001)
    assert w.get_finished() == []  # this poll sees it started
    be.clock_advance(0.02)
    (expired,) = w.get_finished()
    assert (expired.job_id, expired.error.reason, expired.invalid_blocks) == (11, "deadline", (40, 41, 42))
    w.submit_load(12, cspec([2]), gspec([50, 51, 52]))  # a fresh stream: served while job 11 still hangs
    w.wait({12}, timeout=1.0)
    (ok,) = w.get_finished()
    assert ok.success
    assert all(np.array_equal(be.to_host(g)[[50, 51, 52]], be.to_host(g)[[6, 7, 8]]) for g in gpu)
    with pytest.raises(kv.BlocksHeldError):
        w.submit_load(13, cspec([3]), gspec([40, 60, 61]))  # GPU 40 may still be written by job 11
    assert be.end_hangs(direction="load", job_id=11) == 1  # the late copy runs now ...
    assert w.get_finished() == [] and w.take_released() == []  # ... and takes its time on the slow link
    be.clock_advance(0.01)  # it landed
    assert w.get_finished() == []
    assert [(r.job_id, r.gpu_blocks) for r in w.take_released()] == [(11, (40, 41, 42))]
    w.submit_load(13, cspec([3]), gspec([40, 60, 61]))  # the blocks are free again
    w.wait({13}, timeout=1.0)
    assert w.get_finished()[0].success
    assert all(np.array_equal(be.to_host(g)[[40, 60, 61]], be.to_host(g)[[9, 10, 11]]) for g in gpu)
    w.submit_load(20, cspec([5]), gspec([30, 31, 32]))  # stuck at shutdown
    report = w.shutdown()
    assert report.region == "quarantined" and report.kept  # only what job 20 may touch: chunk 5's rows
    assert len(report.kept) == 2 and w.stats().quarantined_bytes == sum(k.length for k in report.kept)  # R30
    assert 0 < w.stats().quarantined_bytes <= CPU_CHUNKS * 2 * BPC * 512 // 2  # 2 of 4 registrations: chunk 5s
    assert be.violations == []


@pytest.mark.rule("R26")
@pytest.mark.rule("R28")
@pytest.mark.parametrize("kind", WORKERS)
def test_running_a_live_job_left_on_a_retired_stream_still_expires_at_its_deadline(kind: str) -> None:
    be, w, _ = build(kind, SimBackend(kv.FaultPlan([kv.Fault("copy", "hang", direction="store", job_id=1)])))
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]), deadline=0.5)  # hangs
    w.submit_store(2, gspec([3, 4, 5]), cspec([1]))
    assert w.get_finished() == []  # job 1 seen started
    w.cancel([2])  # job 2 late; the stream retired with job 1 still live on it
    (cancelled,) = w.get_finished()
    assert (cancelled.job_id, cancelled.error.reason) == (2, "cancel")
    w.submit_store(3, gspec([6, 7, 8]), cspec([2]))  # a fresh stream
    be.clock_advance(0.6)
    results = {r.job_id: r for r in w.get_finished()}
    assert results[3].success
    assert results[1].error.reason == "deadline" and w.held().cpu_chunks == (0, 1)
    w.shutdown()


@pytest.mark.rule("R6")
@pytest.mark.rule("R28")
@pytest.mark.parametrize("kind", WORKERS)
def test_running_wait_for_a_live_job_on_a_retired_stream_with_nothing_queued_anew(kind: str) -> None:
    """R6 across R28: a wait for a job left live on a retired stream returns once that job is proven, also when
    nothing was queued on the fresh stream since (the direction's own queue is empty)."""
    be, w, _ = build(kind)
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]))  # about 3 ms of copy
    w.submit_store(2, gspec([3, 4, 5]), cspec([1]))
    assert w.get_finished() == []  # job 1 seen started
    w.cancel([2])  # the stream retired with job 1 still live on it
    (cancelled,) = w.get_finished()
    assert (cancelled.job_id, cancelled.error.reason) == (2, "cancel")
    w.wait([1])
    assert be.monotonic() > 0.003  # the wait advanced the clock to job 1's completion
    (done,) = w.get_finished()
    assert (done.job_id, done.success) == (1, True)
    w.shutdown()
