"""The simulated device's late copies (R26, R27): slow faults (a stall that ends by itself, exact on the virtual
clock) and ``end_hangs`` (a hang ended on demand, after which the late copy lands)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from _interleave import Pause, run_in_thread
from _support import BPC, CPU_CHUNKS, cspec, gspec, make_worker, patterned_gpu, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends.base import Event, Stream, Tag
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.faults import Fault, FaultPlan, FaultyBackend

PAGE = 4096
LATENCY = 5e-6
BW = 25e9
COPY = LATENCY + PAGE / BW   # one page's copy on the "simple" profile


class Rig:
    """A sim with one device array (row r holds byte r + 1) and one pinned host buffer of 8 pages."""

    def __init__(self, *faults: Fault, trace: bool = False) -> None:
        self.plan = FaultPlan(faults)
        self.be = SimBackend(self.plan, latency=LATENCY, pinned_bandwidth=BW, trace=trace)
        dev = self.be.empty_device((8, PAGE))
        assert isinstance(dev, np.ndarray)
        dev[...] = np.arange(8, dtype=np.uint8)[:, None] + 1
        self.dev: npt.NDArray[np.uint8] = dev
        self.host = np.zeros(8 * PAGE, dtype=np.uint8)
        self.be.track_host(self.host.ctypes.data, self.host.nbytes)
        self.be.host_register(self.host.ctypes.data, self.host.nbytes)

    def store(self, stream: Stream, tag: Tag, rows: Sequence[int], pages: Sequence[int]) -> tuple[Event, Event]:
        """A transfer as a worker queues it: start record, one copy (device rows -> host pages), end record."""
        start, end = self.be.create_event(tag=tag), self.be.create_event(tag=tag)
        self.be.record(start, stream, tag=tag)
        buf = self.be.alloc_descriptors(len(rows), tag=tag)
        src = np.array([self.dev.ctypes.data + r * PAGE for r in rows], dtype=np.int64)
        dst = np.array([self.host.ctypes.data + p * PAGE for p in pages], dtype=np.int64)
        buf.fill(src, dst, np.full(len(rows), PAGE, dtype=np.int64))
        self.be.copy_batch(stream, buf, len(rows), tag=tag)
        self.be.record(end, stream, tag=tag)
        return start, end

    def page(self, p: int) -> int:
        """The byte host page ``p`` holds (asserting it is uniform)."""
        data = self.host[p * PAGE:(p + 1) * PAGE]
        assert (data == data[0]).all()
        return int(data[0])


def done_at(be: SimBackend, event: Event) -> float | None:
    """The virtual time the event's latest record completed (None: not yet)."""
    latest = event.latest  # type: ignore[attr-defined]  # a SimEvent's
    return None if latest is None else latest.done_at


# -- slow faults --------------------------------------------------------------------------------------------------


@pytest.mark.rule("R26")
@pytest.mark.parametrize("point", ["copy", "event_query", "event_sync"])
def test_sim_slow_fault_delays_the_copy_by_exactly_its_duration(point: str) -> None:
    rig = Rig(Fault(point, "slow", direction="store", job_id=1, duration=0.25))   # type: ignore[arg-type]
    be, s = rig.be, rig.be.create_stream()
    be.sleep(1.0)
    t0 = be.monotonic()
    start, end = rig.store(s, ("store", 1), [2], [0])
    be.sleep(0.25 + COPY / 2)      # the stall is over, the copy is not yet
    assert be.query(start) and done_at(be, start) == t0
    assert not be.query(end) and rig.page(0) == 0
    be.synchronize(end)
    assert done_at(be, end) == pytest.approx(t0 + 0.25 + COPY, abs=1e-12)
    assert rig.page(0) == 3
    assert [f.kind for f in rig.plan.fired] == ["slow"]
    assert be.violations == []


@pytest.mark.rule("R26")
def test_sim_slow_fault_selects_like_a_hang_and_delays_the_work_behind_it() -> None:
    # nth counts matching submissions (a reused job id counts again), exactly as for a hang
    rig = Rig(Fault("copy", "slow", job_id=7, nth=2, duration=2.0))
    be, s = rig.be, rig.be.create_stream()
    _, first = rig.store(s, ("store", 7), [0], [0])       # the 1st submission of job 7: not selected
    be.synchronize(first)
    assert done_at(be, first) == pytest.approx(COPY)
    t0 = be.monotonic()
    _, second = rig.store(s, ("store", 7), [1], [1])      # the 2nd: selected
    _, behind = rig.store(s, ("store", 8), [2], [2])      # queued behind it on the same stream
    be.synchronize(behind)
    assert done_at(be, second) == pytest.approx(t0 + 2.0 + COPY)
    assert done_at(be, behind) == pytest.approx(t0 + 2.0 + 2 * COPY)
    assert [rig.page(p) for p in range(3)] == [1, 2, 3]
    assert rig.plan.fired == [Fault("copy", "slow", job_id=7, nth=2, duration=2.0)]


@pytest.mark.rule("R26")
def test_sim_slow_fault_is_drawn_on_the_trace() -> None:
    rig = Rig(Fault("copy", "slow", job_id=1, duration=0.5), trace=True)
    _, end = rig.store(rig.be.create_stream(), ("load", 1), [0], [0])
    rig.be.synchronize(end)
    events = rig.be.trace_document()["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and e["name"] == "slow: load job 1"]
    assert len(spans) == 1 and spans[0]["cat"] == "fault" and spans[0]["dur"] == pytest.approx(0.5e6)
    assert any(e.get("ph") == "i" and e["name"] == "fault: slow after load job 1" for e in events)


@pytest.mark.rule("R26")
def test_fault_slow_repr_and_fields() -> None:
    fault = Fault("copy", "slow", direction="load", duration=3)
    assert fault.duration == 3.0 and isinstance(fault.duration, float)
    assert repr(fault) == "Fault('copy', 'slow', direction='load', duration=3.0)"
    assert Fault("copy", "hang").duration is None and "duration" not in repr(Fault("copy", "hang"))


@pytest.mark.rule("R26")
@pytest.mark.parametrize("kwargs", [
    {"kind": "slow"},                                     # duration required
    {"kind": "slow", "duration": 0},
    {"kind": "slow", "duration": -1.0},
    {"kind": "slow", "duration": math.nan},
    {"kind": "slow", "duration": math.inf},
    {"kind": "slow", "duration": True},
    {"kind": "slow", "duration": "1"},
    {"kind": "slow", "duration": 1.0, "sticky": True},
    {"kind": "hang", "duration": 1.0},                    # duration refused for other kinds
    {"kind": "error", "duration": 1.0},
    {"kind": "error", "duration": 0},
], ids=repr)
def test_fault_slow_duration_bad_input(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidTransferError):
        Fault("copy", **kwargs)  # type: ignore[arg-type]


@pytest.mark.rule("R26")
@pytest.mark.parametrize("point", ["device_sync", "host_register", "destroy"])
def test_fault_slow_only_at_transfer_points(point: str) -> None:
    with pytest.raises(InvalidTransferError, match="slow"):
        Fault(point, "slow", duration=1.0)  # type: ignore[arg-type]


def test_faulty_backend_refuses_slow_faults() -> None:
    with pytest.raises(InvalidTransferError, match="slow"):
        FaultyBackend(SimBackend(), FaultPlan([Fault("copy", "slow", duration=1.0)]))
    plan = FaultPlan()
    be = FaultyBackend(SimBackend(), plan)
    plan.add(Fault("copy", "slow", duration=1.0))      # armed later: never fires there, never counts
    s, e = be.create_stream(), be.create_event()
    be.record(e, s, tag=("store", 1))
    assert plan.fired == [] and not hasattr(be, "end_hangs")


# -- end_hangs ----------------------------------------------------------------------------------------------------


@pytest.mark.rule("R27")
def test_sim_end_hangs_lets_the_late_copy_land_only_after_it() -> None:
    rig = Rig(Fault("copy", "hang", direction="load", job_id=2))
    be, s = rig.be, rig.be.create_stream()
    start, end = rig.store(s, ("load", 2), [4], [0])
    be.sleep(100.0)
    assert be.query(start) and not be.query(end) and rig.page(0) == 0   # hung: nothing lands
    t1 = be.monotonic()
    assert be.end_hangs() == 1
    assert not be.query(end) and rig.page(0) == 0                      # the copy still takes its time
    be.synchronize(end)
    assert done_at(be, end) == pytest.approx(t1 + COPY) and rig.page(0) == 5
    assert be.end_hangs() == 0                                         # nothing left to end
    assert be.violations == []


@pytest.mark.rule("R27")
@pytest.mark.parametrize(("selector", "ended"), [
    ({}, {("store", 1), ("load", 1), ("load", 2)}),
    ({"direction": "load"}, {("load", 1), ("load", 2)}),
    ({"job_id": 1}, {("store", 1), ("load", 1)}),
    ({"direction": "load", "job_id": 2}, {("load", 2)}),
    ({"direction": "store", "job_id": 2}, set()),
], ids=repr)
def test_sim_end_hangs_selects_by_tag(selector: dict[str, object], ended: set[Tag]) -> None:
    tags: list[Tag] = [("store", 1), ("load", 1), ("load", 2)]
    rig = Rig(Fault("copy", "hang"))
    be = rig.be
    ends = {tag: rig.store(be.create_stream(), tag, [k], [k])[1] for k, tag in enumerate(tags)}
    assert be.end_hangs(**selector) == len(ended)  # type: ignore[arg-type]
    be.sleep(1.0)
    assert {tag for tag, end in ends.items() if be.query(end)} == ended
    assert [rig.page(k) for k in range(3)] == [k + 1 if tag in ended else 0 for k, tag in enumerate(tags)]
    assert be.end_hangs() == 3 - len(ended)


@pytest.mark.rule("R27")
def test_sim_end_hangs_ends_a_hang_queued_behind_another_when_it_is_reached() -> None:
    rig = Rig(Fault("copy", "hang"))
    be, s = rig.be, rig.be.create_stream()
    _, first = rig.store(s, ("store", 1), [0], [0])
    _, second = rig.store(s, ("store", 2), [1], [1])    # its hang sits behind job 1's hang
    assert be.end_hangs(job_id=2) == 1
    be.sleep(10.0)
    assert not be.query(second) and rig.page(1) == 0     # still behind job 1's hang
    t1 = be.monotonic()
    assert be.end_hangs(job_id=1) == 1 and be.end_hangs(job_id=2) == 0
    be.synchronize(second)
    assert done_at(be, first) == pytest.approx(t1 + COPY)
    assert done_at(be, second) == pytest.approx(t1 + 2 * COPY)
    assert (rig.page(0), rig.page(1)) == (1, 2)


@pytest.mark.rule("R27")
def test_sim_end_hangs_on_a_destroyed_stream_and_a_waiting_stream() -> None:
    rig = Rig(Fault("copy", "hang", job_id=1))
    be, s, t = rig.be, rig.be.create_stream(), rig.be.create_stream()
    _, end = rig.store(s, ("store", 1), [0], [0])
    be.destroy_stream(s)                                 # queued work on a destroyed stream still runs
    be.wait_event(t, end)
    _, after = rig.store(t, ("store", 2), [1], [0])      # ordered after job 1 by the wait: overwrites page 0
    be.sleep(5.0)
    assert not be.query(after)
    assert be.end_hangs() == 1
    be.synchronize(after)
    assert rig.page(0) == 2 and be.violations == []


def test_sim_end_hangs_is_drawn_on_the_trace() -> None:
    rig = Rig(Fault("copy", "hang", job_id=1), trace=True)
    be = rig.be
    _, end = rig.store(be.create_stream(), ("store", 1), [0], [0])
    be.sleep(3.0)
    be.end_hangs()
    be.synchronize(end)
    events = be.trace_document()["traceEvents"]
    hang = [e for e in events if e.get("ph") == "X" and e["name"] == "hang: store job 1"]
    assert len(hang) == 1 and hang[0]["dur"] == pytest.approx(3.0e6)
    assert any(e.get("ph") == "i" and e["name"] == "hang ended: store job 1" for e in events)


@pytest.mark.parametrize("kwargs", [{"direction": "both"}, {"direction": 1}, {"job_id": True}, {"job_id": 1.0},
                                    {"job_id": "1"}], ids=repr)
def test_sim_end_hangs_bad_input(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidTransferError):
        SimBackend().end_hangs(**kwargs)  # type: ignore[arg-type]


@pytest.mark.rule("R27")
def test_sim_end_hangs_runs_nothing_on_a_lost_device() -> None:
    rig = Rig(Fault("copy", "hang", job_id=1), Fault("stream_create", "error", nth=2, sticky=True))
    be = rig.be
    _, end = rig.store(be.create_stream(), ("store", 1), [0], [0])
    with pytest.raises(kv.DeviceError):
        be.create_stream()
    assert be.end_hangs() == 1
    be.sleep(1.0)
    assert rig.page(0) == 0


@pytest.mark.rule("R27")
@pytest.mark.rule("R19")
def test_sim_end_hangs_from_another_thread_lets_a_waiting_worker_finish() -> None:
    be = SimBackend(FaultPlan([Fault("copy", "hang", direction="store", job_id=1)]))
    _, w, _ = make_worker(be)
    w.submit_store(1, gspec([1, 2]), cspec([0]))
    with Pause(be, "sleep") as pause:                  # the waiting thread, between two polls
        waiter = run_in_thread(lambda: w.wait({1}, timeout=60.0))
        assert pause.reached.wait(timeout=10)
        assert be.end_hangs(direction="store") == 1    # from this thread, while the other waits
        pause.release()
        assert waiter.join(10)
    assert be.end_hangs() == 0
    finished = w.get_finished()
    assert [(r.job_id, r.success) for r in finished] == [(1, True)]
    w.shutdown()
    assert be.violations == []


# -- with a worker: the late copy of an expired job lands, its hold ends, the blocks are used again --------------

WORKERS = pytest.mark.parametrize("create", [kv.create_worker, kv.create_reference_worker],
                                  ids=["engine", "reference"])


def _stored(be: SimBackend, w: Any) -> None:
    """Chunks 0 and 1 hold GPU blocks 0-2 and 3-5 (jobs 1, 2)."""
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]))
    w.submit_store(2, gspec([3, 4, 5]), cspec([1]))
    w.wait({1, 2})
    assert [r.success for r in w.get_finished()] == [True, True]


def _blocks(be: SimBackend, gpu: list[Any], blocks: list[int]) -> list[npt.NDArray[np.uint8]]:
    return [be.to_host(g)[blocks].copy() for g in gpu]


@pytest.mark.rule("R27")
@pytest.mark.rule("R28")
@pytest.mark.rule("R20")
@WORKERS
@pytest.mark.parametrize("late", ["hang", "slow"])
def test_sim_late_load_lands_after_expiry_and_its_blocks_are_released_for_reuse(create: Any, late: str) -> None:
    stall = (Fault("copy", "hang", direction="load", job_id=11) if late == "hang"
             else Fault("copy", "slow", direction="load", job_id=11, duration=5.0))
    be = SimBackend(FaultPlan([stall]))
    _, w, gpu = make_worker(be) if create is kv.create_worker else (be, *_reference(be))
    _stored(be, w)
    expected = _blocks(be, gpu, [3, 4, 5])
    w.submit_load(11, cspec([1]), gspec([30, 31, 32]), deadline=0.5)   # stalls on the device
    assert w.get_finished() == []
    be.sleep(1.0)
    (expired,) = w.get_finished()
    assert (expired.job_id, expired.success) == (11, False)
    assert isinstance(expired.error, kv.TransferExpired) and expired.error.reason == "deadline"
    assert w.held().gpu_blocks == (30, 31, 32)
    with pytest.raises(kv.BlocksHeldError):
        w.submit_load(12, cspec([0]), gspec([31]))
    w.submit_load(13, cspec([0]), gspec([40, 41, 42]))                # a fresh stream serves the direction
    w.wait({13})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(13, True)]
    assert w.take_released() == []
    landed = _blocks(be, gpu, [30, 31, 32])
    assert not any(np.array_equal(a, b) for a, b in zip(landed, expected, strict=True))   # not landed yet
    if late == "hang":
        assert be.end_hangs(direction="load", job_id=11) == 1
    be.sleep(5.0)
    w.get_finished()                                                  # a poll observes the late copy's end
    (released,) = w.take_released()
    assert (released.job_id, released.direction, released.gpu_blocks) == (11, "load", (30, 31, 32))
    assert w.held() == kv.HeldBlocks()
    assert all(np.array_equal(a, b) for a, b in zip(_blocks(be, gpu, [30, 31, 32]), expected, strict=True))
    w.submit_load(14, cspec([0]), gspec([30, 31, 32]))                # the blocks are free again
    w.wait({14})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(14, True)]
    be.enqueue_compute_write(gpu[0], [30], 7, 0.0)                    # ordered after the observed load 14
    report = w.shutdown()
    assert report.region == "released"                                # nothing unproven is left
    assert be.violations == []                                        # a correct caller's schedule (R20)


def _reference(be: SimBackend) -> tuple[Any, list[Any]]:
    """A reference worker as make_worker builds an engine."""
    layout = small_layout()
    gpu = patterned_gpu(be, layout)
    w = kv.create_reference_worker(be, gpu, layout, blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS,
                                   policy=kv.ShutdownPolicy(timeout=1.0))
    return w, gpu
