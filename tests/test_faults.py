"""Fault injection: FaultPlan selection, and the same fault scenarios on the sim and on FaultyBackend(sim)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import kvoffload_ref as kv
from kvoffload_ref.backends import batched
from kvoffload_ref.backends.base import Backend, DescriptorBuffer, Event, Stream, Tag
from kvoffload_ref.backends.sim import SimBackend, SimHang
from kvoffload_ref.errors import DeviceError
from kvoffload_ref.faults import POINTS, RELEASE_POINTS, Fault, FaultPlan, FaultPoint, FaultyBackend

PAGE = 4096
STATUS = 999
HORIZON = 3600.0

Factory = Callable[[FaultPlan], Backend]


def sim_factory(plan: FaultPlan) -> Backend:
    return SimBackend(plan)


def faulty_factory(plan: FaultPlan) -> Backend:
    return FaultyBackend(SimBackend(), plan)


FACTORIES = pytest.mark.parametrize("factory", [sim_factory, faulty_factory], ids=["sim", "faulty-sim"])


@dataclasses.dataclass
class Transfer:
    stream: Stream
    start: Event
    end: Event


@dataclasses.dataclass
class Rig:
    """A backend with a device array and a tracked host buffer whose first page is pinned."""

    be: Backend
    dev: npt.NDArray[np.uint8]
    host: npt.NDArray[np.uint8]

    @property
    def host_ptr(self) -> int:
        return int(self.host.ctypes.data)

    def submit(self, job: int, previous: Transfer | None = None, direction: str = "store") -> Transfer:
        """A transfer as the handler makes one: dev row ``job`` -> host page ``job``, after ``previous``."""
        be, tag = self.be, (direction, job)
        stream, start, end = be.create_stream(tag=tag), be.create_event(tag=tag), be.create_event(tag=tag)
        be.record(start, stream, tag=tag)
        marker = be.create_event()
        be.record(marker, be.current_stream())
        be.wait_event(stream, marker)
        if previous is not None:
            be.wait_event(stream, previous.end)
        buf = be.alloc_descriptors(1, tag=tag)
        buf.fill(np.array([int(self.dev.ctypes.data) + job * PAGE]), np.array([self.host_ptr + job * PAGE]),
                 np.array([PAGE]))
        be.copy_batch(stream, buf, 1, tag=tag)
        be.record(end, stream, tag=tag)
        return Transfer(stream, start, end)


def make_rig(factory: Factory, plan: FaultPlan) -> Rig:
    be = factory(plan)
    dev = be.empty_device((8, PAGE))
    assert isinstance(dev, np.ndarray)
    dev[...] = np.arange(1, 9, dtype=np.uint8)[:, None]
    host = np.zeros(8 * PAGE, dtype=np.uint8)
    be.track_host(int(host.ctypes.data), host.nbytes)
    be.host_register(int(host.ctypes.data), PAGE)
    return Rig(be, dev, host)


# -- Fault and FaultPlan ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(point="nowhere"), "unknown fault point"),
    (dict(point="copy", kind="explode"), "unknown fault kind"),
    (dict(point="host_register", kind="hang"), "cannot be injected"),
    (dict(point="copy", kind="hang", sticky=True), "sticky applies to errors only"),
    (dict(point="copy", nth=0), "1-based"),
])
def test_faults_reject_impossible_faults(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fault(**kwargs)  # type: ignore[arg-type]


def test_faults_plan_selects_by_tag_and_nth_and_records_what_fired() -> None:
    second_store_2 = Fault("copy", direction="store", job_id=2, nth=2, status=STATUS)
    every_load = Fault("copy", direction="load")
    plan = FaultPlan([second_store_2, every_load])
    plan.check("copy", ("store", 2))
    plan.check("copy", ("store", 1))
    plan.check("copy", None)
    with pytest.raises(DeviceError) as info:
        plan.check("copy", ("store", 2))
    assert info.value.status == STATUS
    plan.check("copy", ("store", 2))
    for _ in range(2):
        with pytest.raises(DeviceError):
            plan.check("copy", ("load", 9))
    assert plan.fired == [second_store_2, every_load, every_load] and plan.lost() is None
    assert repr(plan).startswith("FaultPlan([Fault('copy', 'error', direction='store'")


def test_faults_plan_add_arms_a_fault_mid_run_counting_from_then_on() -> None:
    plan = FaultPlan([Fault("copy", job_id=1)])
    plan.check("copy", ("store", 2))
    plan.check("copy", ("store", 2))
    added = Fault("copy", direction="store", nth=2, status=STATUS)
    plan.add(added)
    assert plan.faults[-1] is added and repr(plan).endswith(f"{added!r}])")
    plan.check("copy", ("store", 2))  # the first match counted from now on
    with pytest.raises(DeviceError) as info:
        plan.check("copy", ("store", 2))
    assert info.value.status == STATUS and plan.fired == [added]
    hang = Fault("copy", "hang", job_id=5)
    plan.add(hang)
    assert plan.select_hang(("load", 5)) is hang
    with pytest.raises(TypeError, match="expected a Fault"):
        plan.add("copy")  # type: ignore[arg-type]


def test_faults_plan_add_is_thread_safe() -> None:
    plan = FaultPlan()
    faults = [Fault("copy", job_id=i) for i in range(400)]

    def arm(chunk: list[Fault]) -> None:
        for fault in chunk:
            plan.add(fault)
            plan.check("event_query", ("store", -1))

    threads = [threading.Thread(target=arm, args=(faults[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(f.job_id or 0 for f in plan.faults) == list(range(400))
    for i in range(400):
        with pytest.raises(DeviceError):
            plan.check("copy", ("store", i))


def test_faults_sticky_error_loses_the_device_for_every_point() -> None:
    sticky = Fault("event_create", sticky=True, status=STATUS)
    plan = FaultPlan([sticky])
    with pytest.raises(DeviceError, match="device lost"):
        plan.check("event_create")
    assert plan.lost() is sticky
    for point in POINTS:
        with pytest.raises(DeviceError) as info:
            plan.check(point, ("load", 1))
        assert info.value.status == STATUS
    with pytest.raises(DeviceError):
        plan.check_hang("device_sync")
    assert plan.fired == [sticky]


# -- errors at every fault point -------------------------------------------------------------------------------

# Calls each point receives while make_rig and the scenario set up (the fault is placed on the next one).
SETUP_CALLS = {"host_register": 1, "stream_create": 1, "event_create": 1, "descriptor_alloc": 1}
TAG: Tag = ("store", 5)


@dataclasses.dataclass
class PointScenario:
    """A rig plus a stream, an event recorded on it with TAG and a filled descriptor buffer."""

    rig: Rig
    stream: Stream
    event: Event
    buffer: DescriptorBuffer

    def call(self, point: str) -> object:
        """Make one call at ``point``."""
        be, rig, buf = self.rig.be, self.rig, self.buffer
        calls: dict[str, Callable[[], object]] = {
            "event_query": lambda: be.query(self.event),
            "event_sync": lambda: be.synchronize(self.event),
            "copy": lambda: be.copy_batch(self.stream, buf, 1, tag=TAG),
            "device_sync": lambda: be.prove_idle([self.stream], be.monotonic() + 1.0),
            "host_register": lambda: be.host_register(rig.host_ptr + PAGE, PAGE),
            "host_unregister": lambda: be.host_unregister(rig.host_ptr),
            "stream_create": lambda: be.create_stream(tag=TAG),
            "event_create": lambda: be.create_event(tag=TAG),
            "descriptor_alloc": lambda: be.alloc_descriptors(1, tag=TAG),
            "destroy": lambda: be.destroy_event(self.event),
            "free": lambda: be.free_descriptors(buf),
            "unmap": lambda: be.untrack_host(rig.host_ptr),
        }
        return calls[point]()


def point_scenario(factory: Factory, fault: Fault) -> PointScenario:
    rig = make_rig(factory, FaultPlan([fault]))
    be = rig.be
    stream, event = be.create_stream(tag=TAG), be.create_event(tag=TAG)
    be.record(event, stream, tag=TAG)
    buf = be.alloc_descriptors(1, tag=TAG)
    buf.fill(np.array([int(rig.dev.ctypes.data)]), np.array([rig.host_ptr]), np.array([PAGE]))
    return PointScenario(rig, stream, event, buf)


@pytest.mark.rule("R16")
@FACTORIES
@pytest.mark.parametrize("sticky", [False, True], ids=["error", "sticky"])
@pytest.mark.parametrize("point", POINTS)
def test_faults_error_at_each_point_raises_and_leaves_no_trace(factory: Factory, point: FaultPoint,
                                                               sticky: bool) -> None:
    fault = Fault(point, nth=SETUP_CALLS.get(point, 0) + 1, sticky=sticky, status=STATUS)
    scenario = point_scenario(factory, fault)
    be = scenario.rig.be
    live, acquired, clock = be.ledger.live(), be.ledger.acquired(), be.monotonic()
    with pytest.raises(DeviceError) as info:
        scenario.call(point)
    assert info.value.status == STATUS
    assert be.ledger.live() == live and be.ledger.acquired() == acquired, "a failed call acquires nothing"
    assert be.monotonic() == clock and not scenario.rig.host.any(), "nothing was queued or run"
    assert scenario.rig.be.ledger.state_of("pinned", scenario.rig.host_ptr) == "live"
    assert scenario_plan(be).fired == [fault]
    if sticky:
        for other in POINTS:
            if other in RELEASE_POINTS:
                continue
            with pytest.raises(DeviceError) as again:
                scenario.call(other)
            assert again.value.status == STATUS
        with pytest.raises(DeviceError):
            be.record(scenario.event, scenario.stream)
        be.destroy_stream(scenario.stream)                   # a lost device fails no release call
        be.destroy_event(scenario.event)
        be.free_descriptors(scenario.buffer)
        be.untrack_host(scenario.rig.host_ptr)
    else:
        scenario.call(point)                                 # nth matched once: the next call succeeds


@pytest.mark.rule("R16")
@FACTORIES
@pytest.mark.parametrize("point", ["destroy", "free"])
def test_faults_batched_release_is_one_call_per_item_and_releases_the_others(factory: Factory,
                                                                             point: FaultPoint) -> None:
    """``destroy_events``/``free_descriptors_many`` count one release-point call per item: the selected item stays
    live, every other one is released, then the error is raised -- the caller leaks exactly what is still live."""
    be = factory(FaultPlan([Fault(point, nth=2, status=STATUS)]))
    kind = "event" if point == "destroy" else "descriptor"
    items: list[Any] = ([be.create_event() for _ in range(3)] if kind == "event"
                        else [be.alloc_descriptors(1) for _ in range(3)])
    with pytest.raises(DeviceError) as info:
        if kind == "event":
            batched.destroy_events(be, items)
        else:
            batched.free_descriptors_many(be, items)
    assert info.value.status == STATUS
    assert [be.ledger.state_of(kind, id(item)) for item in items] == ["released", "live", "released"]
    assert [f.point for f in scenario_plan(be).fired] == [point]


def scenario_plan(be: Backend) -> FaultPlan:
    plan = be.plan if isinstance(be, FaultyBackend) else be.faults if isinstance(be, SimBackend) else None
    assert plan is not None
    return plan


def test_faults_lost_device_runs_nothing_queued_on_the_sim() -> None:
    rig = make_rig(sim_factory, FaultPlan([Fault("stream_create", nth=2, sticky=True)]))
    first = rig.submit(0)
    with pytest.raises(DeviceError):
        rig.be.create_stream()
    rig.be.sleep(10.0)
    assert not rig.host.any(), "queued work never runs on a lost device"
    with pytest.raises(DeviceError):
        rig.be.query(first.end)


# -- hangs -------------------------------------------------------------------------------------------------------


@pytest.mark.rule("R11")
@pytest.mark.rule("R13")
@FACTORIES
@pytest.mark.parametrize("selector", ["job_id", "nth"])
@pytest.mark.parametrize("point", ["event_query", "event_sync", "copy"])
def test_faults_hang_blocks_the_transfer_and_what_waits_on_it(factory: Factory, point: FaultPoint,
                                                              selector: str) -> None:
    fault = Fault(point, "hang", direction="store", job_id=2 if selector == "job_id" else None,
                  nth=2 if selector == "nth" else None)
    rig = make_rig(factory, FaultPlan([fault]))
    be = rig.be
    first = rig.submit(1)
    hung = rig.submit(2, first)
    behind = rig.submit(3, hung)
    aside = rig.submit(4, direction="load")          # not chained: unaffected
    be.sleep(10.0)
    assert be.query(first.end) and be.query(aside.end)
    assert be.query(hung.start), "the hang starts right after the transfer's first record"
    assert not be.query(hung.end) and not be.query(behind.end)
    assert (rig.host[PAGE:2 * PAGE] == 2).all() and not rig.host[2 * PAGE:4 * PAGE].any()
    assert scenario_plan(be).fired == [fault]

    before = be.monotonic()
    with pytest.raises(SimHang):
        be.synchronize(behind.end)
    assert be.monotonic() == pytest.approx(before + HORIZON)

    deadline = be.monotonic() + 0.5
    assert not be.prove_idle([first.stream, hung.stream], deadline)
    assert be.monotonic() == pytest.approx(deadline), "the proof polls until its deadline"
    assert be.prove_idle([first.stream, aside.stream], be.monotonic() + 0.5)


def test_faults_sim_hang_escapes_except_exception() -> None:
    rig = make_rig(sim_factory, FaultPlan([Fault("copy", "hang", job_id=1)]))
    transfer = rig.submit(1)
    caught = []
    with pytest.raises(SimHang):
        try:
            rig.be.synchronize(transfer.end)
        except Exception as exc:  # the point: SimHang is not caught here
            caught.append(exc)
    assert not caught


@pytest.mark.rule("R13")
@FACTORIES
def test_faults_device_sync_error_and_hang(factory: Factory) -> None:
    error, hang = Fault("device_sync", status=STATUS, nth=1), Fault("device_sync", "hang", nth=2)
    rig = make_rig(factory, FaultPlan([error, hang]))
    be = rig.be
    transfer = rig.submit(1)
    with pytest.raises(DeviceError) as info:
        be.prove_idle([transfer.stream], be.monotonic() + 1.0)
    assert info.value.status == STATUS
    deadline = be.monotonic() + 2.0
    assert not be.prove_idle([transfer.stream], deadline) and be.monotonic() == pytest.approx(deadline)
    assert be.query(transfer.end), "a device_sync hang hangs the proof, not the transfers"
    assert be.prove_idle([transfer.stream], be.monotonic() + 1.0)
    assert scenario_plan(be).fired == [error, hang]
    assert be.ledger.live().get("event", 0) == 3, "the proof's events were released"


# -- the same outcomes through FaultyBackend ---------------------------------------------------------------------


def trace(factory: Factory, faults: list[Fault]) -> Iterator[object]:
    """Drive one scripted scenario and yield everything observable."""
    rig = make_rig(factory, FaultPlan(faults))
    be, transfers = rig.be, []
    previous = None
    for job in range(1, 5):
        try:
            previous = rig.submit(job, previous)
            transfers.append(previous)
        except DeviceError as exc:
            yield ("submit failed", job, exc.status)
    for _ in range(3):
        be.sleep(1e-4)
        for t in transfers:
            try:
                yield ("query", be.query(t.end), round(be.monotonic(), 9))
            except DeviceError as exc:
                yield ("query failed", exc.status)
    try:
        yield ("proof", be.prove_idle([t.stream for t in transfers], be.monotonic() + 0.01))
    except DeviceError as exc:
        yield ("proof failed", exc.status)
    if scenario_plan(be).lost() is None:   # after a loss the wrapper cannot stop work already on the inner device
        yield ("host", rig.host.reshape(8, PAGE)[:, 0].tolist())
    yield ("live", be.ledger.live(), "fired", list(scenario_plan(be).fired))


@pytest.mark.parametrize("faults", [
    [],
    [Fault("copy", "hang", job_id=2)],
    [Fault("event_query", "hang", nth=3)],
    [Fault("event_query", job_id=3, nth=2, status=STATUS)],
    [Fault("copy", job_id=2, status=STATUS)],
    [Fault("event_create", nth=6, sticky=True, status=STATUS)],
    [Fault("device_sync", "hang"), Fault("event_sync", "hang", job_id=1)],
], ids=repr)
def test_faults_faulty_backend_matches_the_sim(faults: list[Fault]) -> None:
    assert list(trace(faulty_factory, faults)) == list(trace(sim_factory, faults))


def test_faults_faulty_backend_is_a_transparent_backend() -> None:
    inner = SimBackend()
    be = FaultyBackend(inner, FaultPlan())
    assert isinstance(be, Backend) and be.name == "faulty(sim)"
    assert be.ledger is inner.ledger and be.current_stream() is inner.current_stream()
    stream = be.create_stream()
    assert inner.ledger.state_of("stream", id(stream)) == "live", "handles are the inner backend's own"
    be.destroy_stream(stream)
    assert inner.ledger.live() == {}


@pytest.mark.rule("R5")
@pytest.mark.parametrize("point", ["copy", "event_query", "event_sync"])
@pytest.mark.parametrize("wrap", [False, True], ids=["sim", "faulty-sim"])
def test_faults_nth_counts_a_reused_job_id_again(point: FaultPoint, wrap: bool) -> None:
    fault = Fault(point, "hang", direction="store", job_id=5, nth=2)
    plan = FaultPlan([fault])
    be: Backend = FaultyBackend(SimBackend(), plan) if wrap else SimBackend(plan)
    layout = kv.KVCacheLayout((64,), ((kv.LayerRef(0, 64),),))
    gpu = [be.empty_device((8, 64))]
    w = kv.create_worker(be, gpu, layout, blocks_per_chunk=1, num_cpu_chunks=4,
                         policy=kv.ShutdownPolicy(timeout=0.5))
    spec = kv.GPULoadStoreSpec([1], (1,), (0,))
    w.submit_store(5, spec, kv.CPULoadStoreSpec([0]))
    w.wait({5}, timeout=1.0)
    assert [r.success for r in w.get_finished()] == [True] and plan.fired == []
    w.submit_store(5, spec, kv.CPULoadStoreSpec([1]))   # the same job id again: the second matching submission
    with pytest.raises(kv.DeadlineExceeded):
        w.wait({5}, timeout=1.0)
    assert plan.fired == [fault]
    assert w.shutdown().device_sync != "ok"


@pytest.mark.rule("R5")
def test_faults_error_nth_counts_calls_of_a_reused_job_id() -> None:
    fault = Fault("copy", "error", job_id=5, nth=2)
    be = SimBackend(FaultPlan([fault]))
    layout = kv.KVCacheLayout((64,), ((kv.LayerRef(0, 64),),))
    w = kv.create_worker(be, [be.empty_device((8, 64))], layout, blocks_per_chunk=1, num_cpu_chunks=4)
    spec = kv.GPULoadStoreSpec([1], (1,), (0,))
    w.submit_store(5, spec, kv.CPULoadStoreSpec([0]))
    w.wait({5})
    w.get_finished()
    with pytest.raises(kv.DeviceError, match="injected copy failure"):
        w.submit_store(5, spec, kv.CPULoadStoreSpec([1]))
    w.shutdown()


# -- R7: a fault's numbers, the wrapper's horizon, and job ids beyond int64 -----------------------------------------

#: The bad numbers of R7's audit for an int field (a float, a bool, a string, NaN, infinities, huge ints).
BAD_INTS = [1.5, float("nan"), float("inf"), True, np.True_, "1"]


@pytest.mark.rule("R7")
@pytest.mark.parametrize("value", [*BAD_INTS, 0, -1, -10**400], ids=repr)
def test_faults_nth_must_be_a_1_based_int(value: object) -> None:
    with pytest.raises(kv.InvalidTransferError, match=r"^Fault\.nth "):
        Fault("copy", nth=value)  # type: ignore[arg-type]


@pytest.mark.rule("R7")
@pytest.mark.parametrize("value", BAD_INTS, ids=repr)
def test_faults_job_id_must_be_an_int(value: object) -> None:
    # job_id=True would otherwise select job 1 (True == 1), and job_id=1.5 would never fire.
    with pytest.raises(kv.InvalidTransferError, match=r"^Fault\.job_id must be an int, got "):
        Fault("copy", job_id=value)  # type: ignore[arg-type]


@pytest.mark.rule("R7")
@pytest.mark.parametrize("value", [*BAD_INTS, -1, -10**400], ids=repr)
def test_faults_status_must_be_an_int_ge_0(value: object) -> None:
    with pytest.raises(kv.InvalidTransferError, match=r"^Fault\.status "):
        Fault("copy", status=value)  # type: ignore[arg-type]


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(sticky=1), "sticky must be a bool"),
    (dict(direction="stor"), "direction must be None, 'store' or 'load'"),
    (dict(direction=1), "direction must be None"),
])
def test_faults_sticky_and_direction_are_checked(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(kv.InvalidTransferError, match=message):
        Fault("copy", **kwargs)  # type: ignore[arg-type]


@pytest.mark.rule("R7")
def test_faults_numpy_ints_are_stored_as_python_ints() -> None:
    fault = Fault("copy", job_id=np.int64(3), nth=np.int32(2), status=np.uint16(713))  # type: ignore[arg-type]
    assert (fault.job_id, fault.nth, fault.status) == (3, 2, 713)
    assert all(type(v) is int for v in (fault.job_id, fault.nth, fault.status))
    assert repr(fault) == "Fault('copy', 'error', job_id=3, nth=2, status=713)"


@pytest.mark.rule("R7")
@pytest.mark.parametrize("value", [10**400, -10**400, float("nan"), float("inf"), True, "1", -1, 0],
                         ids=["10**400", "-10**400", "nan", "inf", "True", "str", "-1", "0"])
def test_faults_faulty_backend_hang_horizon_must_be_a_finite_number_gt_0(value: object) -> None:
    inner = SimBackend()
    with pytest.raises(kv.InvalidTransferError, match=r"^hang_horizon "):
        FaultyBackend(inner, FaultPlan(), hang_horizon=value)  # type: ignore[arg-type]
    assert inner.ledger.live() == {} and inner.monotonic() == 0.0


@pytest.mark.rule("R7")
@pytest.mark.parametrize("job", [2**63, 2**70, -2**70], ids=["2**63", "2**70", "-2**70"])
@FACTORIES
def test_faults_select_job_ids_beyond_int64_like_any_other(factory: Factory, job: int) -> None:
    """A job id is only compared, hashed and printed (tags, sets, messages), never made an int64: ids beyond
    int64 need no bound, and a fault selects them exactly."""
    fail, hang = Fault("event_query", job_id=job), Fault("copy", "hang", job_id=job + 1)
    plan = FaultPlan([fail, hang])
    be = factory(plan)
    layout = kv.KVCacheLayout((64,), ((kv.LayerRef(0, 64),),))
    w = kv.create_worker(be, [be.empty_device((8, 64))], layout, blocks_per_chunk=1, num_cpu_chunks=4,
                         policy=kv.ShutdownPolicy(timeout=0.5))
    w.submit_store(job - 1, kv.GPULoadStoreSpec([0], (1,), (0,)), kv.CPULoadStoreSpec([0]))
    w.submit_store(job, kv.GPULoadStoreSpec([1], (1,), (0,)), kv.CPULoadStoreSpec([1]))
    w.wait({job - 1, job}, timeout=1.0)
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(job - 1, True), (job, False)]
    w.submit_store(job + 1, kv.GPULoadStoreSpec([2], (1,), (0,)), kv.CPULoadStoreSpec([2]))
    with pytest.raises(kv.DeadlineExceeded, match=f"store job {job + 1} "):
        w.wait({job + 1}, timeout=1.0)
    assert plan.fired[0] == fail and hang in plan.fired  # job's failed copy is asked again while held (R27)
    assert set(plan.fired) == {fail, hang}
    assert w.shutdown().device_sync == "timeout"
