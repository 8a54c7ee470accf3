"""The simulated device's clock moves for waits (exact poll pauses: ``poll_sleep``, ``polling.poll_pause``) and the
device-side length of a schedule (``schedule_length``, ``mark_schedule``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from _support import CREATE, cspec, gspec, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends import polling
from kvoffload_ref.backends.sim import ScheduleLength, SimBackend
from kvoffload_ref.backends.sim_profiles import PROFILES
from kvoffload_ref.faults import FaultyBackend

#: (page bytes, blocks) of a store and a load of two tensors: under h200 about 19 us, 126 us and 1.36 ms each.
SHAPES = [(4096, 1), (65536, 32), (1 << 20, 32)]


def worker(be: SimBackend, page: int, blocks: int, factory: Any = kv.create_worker) -> Any:
    layout = small_layout(2, page)
    gpu = [be.empty_device((blocks, page)) for _ in range(2)]
    return factory(be, gpu, layout, blocks_per_chunk=1, num_cpu_chunks=blocks)


def pauses(be: Any) -> list[float]:
    """Install an ``on_call`` hook counting the ``"sleep"`` points (a wait's pauses); returns the list it fills with
    the clock at each."""
    seen: list[float] = []
    be.on_call = lambda point, tag: seen.append(0.0) if point == "sleep" else None
    return seen


def end_of_last_record(doc: dict[str, Any]) -> float:
    """The completion (us) of the latest record span on any stream track of a trace document."""
    return max(e["ts"] for e in doc["traceEvents"] if e.get("name") == "record")


def polling_spans(doc: dict[str, Any]) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in doc["traceEvents"] if e.get("name") == "host: polling"]


# -- exact waits through both workers --------------------------------------------------------------------------------
@pytest.mark.rule("R6")
@pytest.mark.parametrize("factory", list(CREATE.values()), ids=list(CREATE))
@pytest.mark.parametrize(("page", "blocks"), SHAPES, ids=["short", "medium", "long"])
@pytest.mark.parametrize("profile", list(PROFILES))
def test_clock_wait_returns_exactly_at_the_transfers_end(profile: str, page: int, blocks: int, factory: Any) -> None:
    """A store then a load: each ``wait()`` returns with the clock at the completion of the transfer's end record
    (the device ops' finish, the trace's last record), and the host's polling span ends there."""
    be = SimBackend(profile=profile, trace=True)
    w = worker(be, page, blocks, factory)
    w.submit_store(1, gspec(range(blocks)), cspec(range(blocks)))
    w.wait({1})
    span = be.schedule_length()
    assert span.pending == 0 and be.monotonic() == span.end
    doc = be.trace_document()
    assert be.monotonic() * 1e6 == end_of_last_record(doc)
    assert polling_spans(doc)[-1][1] == pytest.approx(be.monotonic() * 1e6, abs=1e-6)
    be.mark_schedule()
    started = be.monotonic()
    w.submit_load(2, cspec(range(blocks)), gspec(range(blocks)))
    w.wait({2})
    span = be.schedule_length()
    assert span.pending == 0 and be.monotonic() == span.end and span.start == started
    doc = be.trace_document()
    assert be.monotonic() * 1e6 == end_of_last_record(doc)
    assert polling_spans(doc)[-1][1] == pytest.approx(be.monotonic() * 1e6, abs=1e-6)
    assert [r.success for r in w.get_finished()] == [True, True]
    w.shutdown()


@pytest.mark.rule("R6")
@pytest.mark.parametrize("factory", list(CREATE.values()), ids=list(CREATE))
def test_clock_two_step_schedule_differs_between_profiles_by_its_copies(factory: Any) -> None:
    """Step 0 loads 4 blocks, step 1 stores them and loads 4 others; each step ends with a ``wait()``. The clock a
    step takes is its device span, on every profile, so h200 and h100 differ by what their copies differ."""
    steps: dict[str, list[float]] = {}
    copies: dict[str, list[float]] = {}
    for profile in ("h200", "h100"):
        be = SimBackend(profile=profile)
        w = worker(be, 65536, 8, factory)
        w.submit_store(0, gspec(range(8)), cspec(range(8)))
        w.wait({0})
        steps[profile], copies[profile] = [], []
        for jobs in ([("load", 1, range(4))], [("store", 2, range(4)), ("load", 3, range(4, 8))]):
            be.mark_schedule()
            started = be.monotonic()
            for direction, job, ids in jobs:
                if direction == "load":
                    w.submit_load(job, cspec(ids), gspec(ids))
                else:
                    w.submit_store(job, gspec(ids), cspec(ids))
            w.wait({job for _, job, _ in jobs})
            steps[profile].append(be.monotonic() - started)
            copies[profile].append(be.schedule_length().seconds)
        w.shutdown()
        assert steps[profile] == pytest.approx(copies[profile], rel=1e-12, abs=0)
    for step in range(2):
        assert steps["h200"][step] - steps["h100"][step] == pytest.approx(
            copies["h200"][step] - copies["h100"][step], rel=1e-9, abs=1e-15)


@pytest.mark.rule("R6")
@pytest.mark.rule("R11")
def test_clock_wait_with_a_deadline_still_gives_up_at_it() -> None:
    """Exact pauses never pass a wait's deadline: a store longer than the timeout raises at the deadline; one
    shorter returns at its completion."""
    be = SimBackend(profile="h200")
    w = worker(be, 1 << 20, 32)
    started = be.monotonic()
    w.submit_store(1, gspec(range(32)), cspec(range(32)))
    with pytest.raises(kv.DeadlineExceeded):
        w.wait({1}, timeout=1e-3)
    assert be.monotonic() == pytest.approx(started + 1e-3, rel=1e-12)
    w.wait({1}, timeout=1.0)
    assert be.monotonic() == be.schedule_length().end
    w.shutdown()


@pytest.mark.rule("R6")
def test_clock_unbounded_wait_on_hung_work_reaches_the_horizon_in_few_polls() -> None:
    """No completion is due on hung work: each pause applies in full and the horizon is reached (SimHang)."""
    be = SimBackend(kv.FaultPlan([kv.Fault("copy", "hang", direction="store")]), hang_horizon=10.0)
    w = worker(be, 4096, 1)
    w.submit_store(1, gspec([0]), cspec([0]))
    seen = pauses(be)
    with pytest.raises(kv.SimHang):
        w.wait({1})
    assert be.monotonic() >= 10.0 and len(seen) <= 64 + math.ceil(math.log2(10.0 / polling.POLL_FIRST_SLEEP))
    be.on_call = None
    be.end_hangs()
    w.shutdown()


@pytest.mark.rule("R10")
@pytest.mark.rule("R13")
@pytest.mark.parametrize("factory", list(CREATE.values()), ids=list(CREATE))
def test_clock_shutdown_drain_ends_at_the_last_completion(factory: Any) -> None:
    """Pending stores when shutdown begins: the drain proves them head first and the clock stops exactly at the
    last one's completion, on the host's polling track too."""
    be = SimBackend(profile="h200", trace=True)
    w = worker(be, 65536, 8, factory)
    for job in range(8):
        w.submit_store(job, gspec([job]), cspec([job]))
    report = w.shutdown()
    assert report.store.drained == 8
    span = be.schedule_length()
    assert span.pending == 0 and be.monotonic() == span.end
    assert polling_spans(be.trace_document())[-1][1] == pytest.approx(span.end * 1e6, abs=1e-6)


# -- poll_sleep itself ---------------------------------------------------------------------------------------------
def one_copy(be: SimBackend, rows: int = 4, page: int = 4096) -> tuple[Any, Any]:
    """A store of ``rows`` pages on a fresh stream between two events (the host side pinned)."""
    dev = be.empty_device((rows, page))
    host = np.zeros(rows * page, np.uint8)
    ptr = int(host.ctypes.data)
    be.track_host(ptr, host.nbytes)
    be.host_register(ptr, host.nbytes)
    ids = np.arange(rows, dtype=np.int64)
    buf = be.alloc_descriptors(rows)
    buf.fill(be.array_info(dev).ptr + ids * page, ptr + ids * page, np.full(rows, page, np.int64))
    stream, start, end = be.create_stream(), be.create_event(), be.create_event()
    be.record(start, stream)
    be.copy_batch(stream, buf, rows)
    be.record(end, stream)
    be._keep = (dev, host)  # type: ignore[attr-defined]  # the memory outlives the copy
    return start, end


def test_clock_poll_sleep_stops_at_a_record_a_query_found_pending() -> None:
    be = SimBackend()
    _, end = one_copy(be)
    assert not be.query(end)
    be.poll_sleep(1.0)
    assert be.query(end) and be.monotonic() == be.schedule_length().end < 1.0


def test_clock_poll_sleep_without_a_pending_query_is_the_whole_pause() -> None:
    be = SimBackend()
    one_copy(be)
    be.poll_sleep(1.0)
    assert be.monotonic() == 1.0


def test_clock_sleep_advances_by_exactly_its_seconds_whatever_was_queried() -> None:
    """The user-facing ``sleep``/``clock_advance`` are not poll pauses; they also end the thread's watch."""
    be = SimBackend()
    _, end = one_copy(be)
    assert not be.query(end)
    be.sleep(0.5)
    be.clock_advance(0.25)
    assert be.monotonic() == 0.75
    _, late = one_copy(be)
    be.poll_sleep(0.25)   # nothing queried since the clock last moved: the whole pause
    assert be.monotonic() == 1.0 and be.query(late)


def test_clock_poll_sleep_after_the_watched_record_completed_does_not_move() -> None:
    be = SimBackend()
    _, end = one_copy(be)
    assert not be.query(end)
    be.synchronize(end)   # as another thread's call would: the watched record completes before the pause
    now = be.monotonic()
    be.poll_sleep(1.0)
    assert be.monotonic() == now


def test_clock_poll_sleep_is_the_sleep_point_for_on_call() -> None:
    be = SimBackend()
    seen: list[str] = []
    be.on_call = lambda point, tag: seen.append(point)
    be.poll_sleep(1e-3)
    assert seen == ["sleep"]
    with pytest.raises(kv.InvalidTransferError):
        be.poll_sleep(-1.0)


def test_clock_poll_pause_sleeps_the_backoff_on_a_backend_without_poll_sleep() -> None:
    """A real clock (no ``poll_sleep``) keeps its back-off: 20 us, doubling, capped at POLL_MAX_SLEEP."""

    class Clock:
        def __init__(self) -> None:
            self.now, self.slept = 0.0, []   # type: ignore[var-annotated]

        def monotonic(self) -> float:
            return self.now

        def sleep(self, seconds: float) -> None:
            self.slept.append(seconds)
            self.now += seconds

    clock = Clock()
    assert not polling.poll_until(clock, lambda: False, 5e-3)
    assert clock.slept[:4] == [20e-6, 40e-6, 80e-6, 160e-6]
    assert max(clock.slept) == polling.POLL_MAX_SLEEP


def test_clock_faulty_backend_passes_the_exact_pause_through() -> None:
    inner = SimBackend()
    be = FaultyBackend(inner, kv.FaultPlan([]))
    _, end = one_copy(inner)
    assert polling.poll_until(be, lambda: be.query(end), 1.0)
    assert inner.monotonic() == inner.schedule_length().end


# -- schedule_length -----------------------------------------------------------------------------------------------
def test_clock_schedule_length_of_a_store_then_a_load_under_h200() -> None:
    be = SimBackend(profile="h200")
    w = worker(be, 65536, 16)
    assert be.schedule_length() == ScheduleLength(0.0, None, None, 0, 0)
    w.submit_store(1, gspec(range(16)), cspec(range(16)))
    w.wait({1})
    w.submit_load(2, cspec(range(16)), gspec(range(16)))
    w.wait({2})
    times = {r.job_id: r.transfer_time for r in w.get_finished()}
    span = be.schedule_length()
    assert span.start == 0.0 and span.ops == 2 and span.complete
    assert span.seconds == pytest.approx(times[1] + times[2], rel=1e-12)
    w.shutdown()


def test_clock_schedule_length_reports_pending_work_and_never_moves_the_clock() -> None:
    be = SimBackend(kv.FaultPlan([kv.Fault("copy", "hang", direction="store")]))
    w = worker(be, 4096, 2)
    w.submit_store(1, gspec([0]), cspec([0]))
    now = be.monotonic()
    span = be.schedule_length()
    assert be.monotonic() == now and span.pending == 2 and span.ops == 0 and not span.complete  # the hang, the copy
    assert span.seconds == 0.0 and span.end is None
    be.end_hangs()
    be.sleep(1.0)
    span = be.schedule_length()
    assert span.complete and span.ops == 2 and span.end is not None and span.end < 1.0
    w.shutdown()


def test_clock_mark_schedule_counts_only_what_follows() -> None:
    be = SimBackend()
    one_copy(be)
    be.sleep(1.0)
    be.mark_schedule()
    assert be.schedule_length().ops == 0
    be.enqueue_compute_write(be.empty_device((1, 8)), [0], 1, 2e-3)
    _, end = one_copy(be)
    be.synchronize(end)
    assert be.schedule_length().pending == 1   # the compute work is still running
    be.sleep(1.0)
    span = be.schedule_length()
    assert span.start == 1.0 and span.ops == 2 and span.complete
    assert span.seconds == pytest.approx(2e-3, rel=1e-12)   # the compute and the copy ran side by side


def test_clock_poll_sleep_to_tail_runs_on_to_the_streams_last_record() -> None:
    """A drain's pause (``to_tail``) ends at the last record queued on the watched record's stream; a wait's pause
    at the watched record itself."""
    for to_tail in (False, True):
        be = SimBackend()
        src, dst = (be.array_info(be.empty_device((2, 4096))).ptr for _ in range(2))
        stream = be.create_stream()
        ends = []
        for row in range(2):   # two device-to-device copies, one after the other on one stream
            buf = be.alloc_descriptors(1)
            buf.fill(np.array([src + row * 4096]), np.array([dst + row * 4096]), np.array([4096]))
            be.copy_batch(stream, buf, 1)
            ends.append(be.create_event())
            be.record(ends[-1], stream)
        assert not be.query(ends[0])
        be.poll_sleep(1.0, to_tail=to_tail)
        span = be.schedule_length()
        assert be.monotonic() == span.end < 1.0 and span.ops == (2 if to_tail else 1)


@pytest.mark.rule("R6")
@pytest.mark.parametrize("factory", list(CREATE.values()), ids=list(CREATE))
def test_clock_wait_for_a_job_with_work_queued_behind_it_returns_at_its_own_end(factory: Any) -> None:
    be = SimBackend(profile="h200")
    w = worker(be, 65536, 8, factory)
    w.submit_store(1, gspec(range(4)), cspec(range(4)))
    w.submit_store(2, gspec(range(4, 8)), cspec(range(4, 8)))
    w.wait({1})
    span = be.schedule_length()
    assert span.ops == 1 and span.pending == 1 and be.monotonic() == span.end
    w.shutdown()


def test_clock_schedule_length_counts_work_due_by_now() -> None:
    """Work due by the current time is run first (as any call that looks at the device), the clock untouched."""
    be = SimBackend()
    be.sleep(1.0)
    be.enqueue_compute_write(be.empty_device((1, 8)), [0], 1, 0.0)
    span = be.schedule_length()
    assert span == ScheduleLength(0.0, 1.0, 1.0, 1, 0) and be.monotonic() == 1.0
