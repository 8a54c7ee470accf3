"""Shutdown on the simulated device: every fault point x {error, hang}, ownership, construction failure, R8-R16."""

from __future__ import annotations

import gc
import logging
import math
import time
import weakref
from typing import Any

import pytest
from _support import (
    BPC,
    CPU_CHUNKS,
    CREATE,
    GPU_BLOCKS,
    PAGE,
    assert_accounted,
    cspec,
    gspec,
    make_worker,
    messages,
    patterned_gpu,
    small_layout,
)

import kvoffload_ref as kv
from kvoffload_ref.backends.base import POLL_FIRST_SLEEP, POLL_MAX_SLEEP
from kvoffload_ref.backends.sim import SimBackend, SimHang

TIMEOUT = 1.0
SLACK = 0.01  # virtual seconds a shutdown may run past its timeout (poll granularity)
STORE_FAIL = "Failed to shut down store offloading handler"
LOAD_FAIL = "Failed to shut down load offloading handler"
SKIPPING = "Failed to synchronize transfer end event; skipping %d remaining transfers"
SYNC_FAIL = "Device sync before mmap cleanup failed; proceeding with cleanup anyway"


def _busy_worker(plan: kv.FaultPlan, on_unproven: str = "quarantine", *, create: Any = kv.create_worker,
                 **kwargs: Any) -> tuple[Any, Any]:
    """A worker (``create``: either worker's factory) with two stores and two loads queued and not yet complete."""
    be = SimBackend(plan)
    layout = small_layout()
    policy = kv.ShutdownPolicy(timeout=TIMEOUT, on_unproven=on_unproven)
    w = create(be, patterned_gpu(be, layout), layout, blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS, policy=policy,
               **kwargs)
    w.submit_store(1, gspec([1, 2]), cspec([1]))
    w.submit_store(2, gspec([3]), cspec([2]))
    w.submit_load(3, cspec([5]), gspec([30]))
    w.submit_load(4, cspec([6]), gspec([31]))
    return be, w


@pytest.mark.rule("R9")
@pytest.mark.rule("R13")
@pytest.mark.rule("R16")
def test_shutdown_clean_path_releases_without_device_proof(caplog: Any) -> None:
    be, w = _busy_worker(kv.FaultPlan())
    calls = []
    real = be.prove_idle
    be.prove_idle = lambda *a: calls.append(a) or real(*a)  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        report = w.shutdown()
    assert (report.store.drained, report.load.drained, report.store.abandoned) == (2, 2, 0)
    assert (report.device_sync, report.region, report.errors, report.interrupted) == (
        "not_needed", "released", (), False)
    assert calls == [], "R13: no device-level proof on the clean path"
    assert not caplog.records
    assert_accounted(be, report)
    assert not be.violations


# Each row: fault, what the report must say. "clock" = the drain waits for the deadline.
MATRIX: list[tuple[str, list[kv.Fault], dict[str, Any]]] = [
    ("event_query error", [kv.Fault("event_query", "error", direction="store", job_id=1)],
     dict(store=(0, 2), load=(2, 0), device_sync="ok", region="released", logs=[STORE_FAIL, SKIPPING % 1])),
    ("event_query error on load", [kv.Fault("event_query", "error", direction="load", job_id=4)],
     dict(store=(2, 0), load=(1, 1), device_sync="ok", region="released", logs=[LOAD_FAIL, SKIPPING % 0])),
    ("event_query sticky error", [kv.Fault("event_query", "error", job_id=2, sticky=True)],
     dict(store=(1, 1), load=(0, 2), device_sync="failed", region="quarantined", logs=[STORE_FAIL, LOAD_FAIL])),
    ("event_query hang", [kv.Fault("event_query", "hang", direction="store", job_id=1)],
     dict(store=(0, 2), load=(2, 0), device_sync="timeout", region="quarantined", clock=True, logs=[STORE_FAIL])),
    ("event_sync hang", [kv.Fault("event_sync", "hang", direction="load", job_id=3)],
     dict(store=(2, 0), load=(0, 2), device_sync="timeout", region="quarantined", clock=True, logs=[LOAD_FAIL])),
    ("copy hang", [kv.Fault("copy", "hang", direction="load", job_id=4)],
     dict(store=(2, 0), load=(1, 1), device_sync="timeout", region="quarantined", clock=True, logs=[LOAD_FAIL])),
    ("device_sync error", [kv.Fault("event_query", "error", job_id=1), kv.Fault("device_sync", "error")],
     dict(store=(0, 2), load=(2, 0), device_sync="failed", region="quarantined", logs=[STORE_FAIL])),
    ("device_sync hang", [kv.Fault("event_query", "error", job_id=3), kv.Fault("device_sync", "hang")],
     dict(store=(2, 0), load=(0, 2), device_sync="timeout", region="quarantined", clock=True, logs=[LOAD_FAIL])),
    ("host_unregister error", [kv.Fault("host_unregister", "error")],
     dict(store=(2, 0), load=(2, 0), device_sync="not_needed", region="released", leaked={"pinned": 1})),
    ("event_sync error (not on the shutdown path)", [kv.Fault("event_sync", "error")],
     dict(store=(2, 0), load=(2, 0), device_sync="not_needed", region="released")),
]


def _no_real_sleep(seconds: float) -> None:
    raise AssertionError(f"a real sleep of {seconds!r} s during a shutdown on the simulated device")


@pytest.mark.rule("R9")
@pytest.mark.rule("R10")
@pytest.mark.rule("R11")
@pytest.mark.rule("R12")
@pytest.mark.rule("R16")
@pytest.mark.parametrize(("name", "faults", "want"), MATRIX, ids=[m[0] for m in MATRIX])
def test_shutdown_fault_matrix_quarantine_policy(name: str, faults: list[kv.Fault], want: dict[str, Any],
                                                 caplog: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = kv.FaultPlan(faults)
    be, w = _busy_worker(plan)
    monkeypatch.setattr(time, "sleep", _no_real_sleep)  # R11 on the sim: every wait is on its virtual clock
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        report = w.shutdown()
    assert report.elapsed <= TIMEOUT + SLACK, "R11: bounded by the timeout"
    if want.get("clock"):
        assert report.elapsed >= TIMEOUT - SLACK
    assert (report.store.drained, report.store.abandoned) == want["store"]
    assert (report.load.drained, report.load.abandoned) == want["load"]
    assert (report.device_sync, report.region) == (want["device_sync"], want["region"])
    assert dict(report.leaked) == want.get("leaked", {})
    if report.region == "quarantined":
        assert report.quarantined.get("mapping") == 1 and report.quarantined.get("pinned", 0) >= 1
    logged = messages(caplog)
    for text in want.get("logs", []):
        assert text in logged, (text, logged)
    assert bool(plan.fired) == ("not on the shutdown path" not in name), "the scenario really happened"
    assert_accounted(be, report)
    assert not be.violations, "R12: nothing released while it may be under DMA"


# The release steps' fault points: what each may leave unreleased (its ledger kinds) and the error it lists.
RELEASE_STEPS: dict[str, tuple[set[str], str]] = {
    "destroy": ({"stream", "event"}, "injected destroy failure"),
    "free": ({"descriptor"}, "injected free failure"),
    "host_unregister": ({"pinned"}, "host_unregister failed"),
    "unmap": ({"mapping"}, "unmap failed"),
}


@pytest.mark.rule("R3")
@pytest.mark.rule("R9")
@pytest.mark.rule("R10")
@pytest.mark.rule("R16")
@pytest.mark.parametrize("hung", [False, True], ids=["clean", "hung"])
@pytest.mark.parametrize("on_unproven", ["quarantine", "release"])
@pytest.mark.parametrize("worker", list(CREATE))
@pytest.mark.parametrize("every", [False, True], ids=["first", "every"])
@pytest.mark.parametrize("point", list(RELEASE_STEPS))
def test_shutdown_fault_matrix_release_steps(point: str, every: bool, worker: str, on_unproven: str, hung: bool,
                                             caplog: Any) -> None:
    """A release step that fails (the first call at its point, or every one) is logged, listed in the report's
    errors and leaked -- and every other release step still runs: nothing else stays live (R3, R10, R16). A
    quarantined region gives back what no late copy may touch through the same steps (R29): a failed unregister
    there is leaked too, a failed unmap leaves its pages kept (nothing leaked); under the release policy a hung
    load makes the sim see the hazard vLLM #51622 has (R12), whatever fails."""
    kinds, text = RELEASE_STEPS[point]
    plan = kv.FaultPlan([kv.Fault("copy", "hang", direction="load", job_id=4)] if hung else [])
    be, w = _busy_worker(plan, on_unproven, create=CREATE[worker], pin_chunk_bytes=16 << 10)
    live = be.ledger.live()
    plan.add(kv.Fault(point, "error", nth=None if every else 1))  # armed now: the shutdown's calls only
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        report = w.shutdown()
    quarantined = hung and on_unproven == "quarantine"
    assert report.region == ("quarantined" if quarantined else "released")
    assert report.device_sync == ("timeout" if hung else "not_needed")
    assert_accounted(be, report)  # R16: nothing else live; leaked and quarantined exactly as reported
    assert not be.violations or (hung and on_unproven == "release"), "R12: nothing released under DMA"
    assert any(f.point == point for f in plan.fired), "the release step failed"
    leaked = dict(report.leaked)
    if quarantined and point == "unmap":  # R29: pages that could not be given back stay kept; nothing leaked
        pinned = sum(end - start for start, end in be.registrations())  # the registrations kept
        assert not leaked and sum(k.length for k in report.kept) > pinned, "the pages not given back are kept"
        assert any("unmap of" in e for e in report.errors), report.errors
        return
    assert leaked and set(leaked) <= kinds, f"only what failed is leaked: {leaked}"
    if not every:
        assert sum(leaked.values()) == 1, f"one call failed, one resource leaked: {leaked}"
    else:  # every call at the point failed: all of its kinds the worker held is leaked (or quarantined)
        kept = dict(report.quarantined)
        assert all(leaked.get(k, 0) + kept.get(k, 0) == live.get(k, 0) for k in kinds), (live, leaked, kept)
    assert any(text in e for e in report.errors), report.errors
    assert any(text in m or "Failed to" in m or "failed" in m for m in messages(caplog)), "and logged"


@pytest.mark.rule("R12")
@pytest.mark.parametrize("point", ["event_query", "copy", "device_sync"])
def test_shutdown_release_policy_reproduces_vllm_and_the_sim_sees_the_hazard(point: str, caplog: Any) -> None:
    faults = [kv.Fault(point, "hang", direction="load", job_id=3)] if point != "device_sync" else [
        kv.Fault("event_query", "error", job_id=3), kv.Fault("device_sync", "hang")]
    be, w = _busy_worker(kv.FaultPlan(faults), on_unproven="release")
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        report = w.shutdown()
    assert report.region == "released" and report.device_sync == "timeout"
    assert SYNC_FAIL in messages(caplog)
    if point != "device_sync":
        assert be.violations, "the hung load still references the released region"
    assert_accounted(be, report)


@pytest.mark.rule("R16")
def test_shutdown_lost_device_under_release_policy_reports_leaked_pins() -> None:
    be, w = _busy_worker(kv.FaultPlan([kv.Fault("event_query", "error", job_id=1, sticky=True)]),
                         on_unproven="release", pin_chunk_bytes=16 << 10)
    report = w.shutdown()
    assert report.region == "released" and report.device_sync == "failed"
    assert report.leaked.get("pinned", 0) >= 2, "every unregister failed on the lost device"
    assert any("host_unregister failed" in e for e in report.errors)
    assert_accounted(be, report)


@pytest.mark.rule("R10")
def test_shutdown_drain_stops_waiting_after_the_first_failure() -> None:
    plan = kv.FaultPlan([kv.Fault("event_query", "error", direction="store", job_id=1)])
    be, w = _busy_worker(plan)
    queried: list[Any] = []
    real = be.query
    be.query = lambda e: queried.append(e) or real(e)  # type: ignore[method-assign]
    report = w.shutdown()
    assert report.store.abandoned == 2 and isinstance(report.store.error, kv.DeviceError)
    # Only the load handler's events (and the proof's) were queried after the store head failed.
    assert len(queried) <= 2 + 4 + 2 * 8


@pytest.mark.rule("R9")
def test_shutdown_both_handlers_attempted_when_one_raises_unexpectedly(caplog: Any) -> None:
    class Broken(SimBackend):
        def query(self, event: Any) -> bool:
            if getattr(event, "tag", None) and event.tag[0] == "store":
                raise RuntimeError("transfer did not drain")
            return super().query(event)

    be, w = _busy_worker(kv.FaultPlan())
    w2_be = Broken()
    _, w2, _ = make_worker(w2_be, timeout=TIMEOUT)
    w2.submit_store(1, gspec([1]), cspec([1]))
    w2.submit_load(2, cspec([2]), gspec([2]))
    with caplog.at_level(logging.ERROR, logger="kvoffload_ref"):
        report = w2.shutdown()
    assert STORE_FAIL in messages(caplog)
    assert report.load.drained == 1, "the load handler was still shut down"
    assert report.store.abandoned == 1 and isinstance(report.store.error, RuntimeError)
    assert report.region == "released" and report.device_sync == "ok"
    assert_accounted(w2_be, report)
    w.shutdown()


# -- R8, R14, R15 ------------------------------------------------------------------------------------------------
@pytest.mark.rule("R8")
def test_shutdown_then_every_call_behaves_as_closed() -> None:
    be, w, _ = make_worker()
    w.submit_store(1, gspec([1]), cspec([1]))
    report = w.shutdown()
    assert w.shutdown() is report
    with pytest.raises(kv.WorkerClosedError):
        w.submit_store(2, gspec([1]), cspec([1]))
    with pytest.raises(kv.WorkerClosedError):
        w.submit_load(3, cspec([1]), gspec([1]))
    with pytest.raises(kv.WorkerClosedError):
        w.cpu_snapshot()
    assert w.get_finished() == []
    w.wait({1, 2}, timeout=0.0)
    assert w.stats().state == "closed" and w.stats().region == "released"


@pytest.mark.rule("R15")
def test_shutdown_context_manager_shuts_down() -> None:
    be = SimBackend()
    layout = small_layout()
    gpu = [be.empty_device((GPU_BLOCKS, PAGE)) for _ in range(2)]
    with kv.create_worker(be, gpu, layout, blocks_per_chunk=1, num_cpu_chunks=4) as w:
        w.submit_store(1, gspec([1]), cspec([1]))
    assert w.stats().state == "closed"
    assert not be.ledger.live()


class _InterruptingSim(SimBackend):
    """Raises KeyboardInterrupt from inside the n-th event query (a Ctrl-C during a wait)."""

    def __init__(self, at_query: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.countdown = at_query
        self.armed = False

    def query(self, event: Any) -> bool:
        if self.armed:
            self.countdown -= 1
            if self.countdown == 0:
                raise KeyboardInterrupt
        return super().query(event)


@pytest.mark.rule("R14")
def test_shutdown_keyboard_interrupt_abandons_quarantines_and_propagates() -> None:
    plan = kv.FaultPlan([kv.Fault("copy", "hang", direction="store", job_id=1)])
    be = _InterruptingSim(at_query=3, faults=plan)
    _, w, _ = make_worker(be, timeout=TIMEOUT)
    w.submit_store(1, gspec([1]), cspec([1]))
    w.submit_load(2, cspec([2]), gspec([2]))
    be.armed = True
    with pytest.raises(KeyboardInterrupt):
        w.shutdown()
    report = w.shutdown()
    assert report.interrupted and report.device_sync == "skipped" and report.region == "quarantined"
    assert report.store.abandoned == 1 and report.load.abandoned == 1, "the load was abandoned without a wait"
    assert_accounted(be, report)
    with pytest.raises(kv.WorkerClosedError):
        w.submit_store(3, gspec([1]), cspec([1]))


@pytest.mark.rule("R15")
def test_shutdown_dropped_worker_is_shut_down_by_its_finalizer(caplog: Any) -> None:
    be, w, _ = make_worker()
    w.submit_store(1, gspec([1]), cspec([1]))
    ref = weakref.ref(w)
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        del w
        gc.collect()
    assert ref() is None, "the finalizer holds no reference to the worker"
    assert any("not shut down" in m for m in messages(caplog))
    assert not be.ledger.live() and not be.violations


@pytest.mark.rule("R11")
def test_shutdown_unbounded_wait_on_hung_work_is_a_sim_hang_not_a_hidden_error() -> None:
    plan = kv.FaultPlan([kv.Fault("copy", "hang", job_id=1)])
    be, w, _ = make_worker(SimBackend(plan))
    w.submit_store(1, gspec([1]), cspec([1]))
    with pytest.raises(SimHang):
        w.wait({1})  # no timeout: a blocking synchronize, as upstream
    assert not issubclass(SimHang, Exception)
    report = w.shutdown()  # the shutdown path never blocks
    assert report.elapsed <= TIMEOUT + SLACK and report.region == "quarantined"


@pytest.mark.rule("R11")
def test_shutdown_with_zero_timeout_still_proves_completed_work() -> None:
    be, w, _ = make_worker(timeout=0.0)
    w.submit_store(1, gspec([1]), cspec([1]))
    be.clock_advance(1.0)
    report = w.shutdown()
    assert report.store.drained == 1 and report.region == "released" and report.device_sync == "not_needed"


class _CountingSim(SimBackend):
    """A sim that counts its poll pauses (``poll_sleep``: the pauses between polls of bounded waits)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sleeps = 0

    def poll_sleep(self, seconds: float, *, to_tail: bool = False) -> None:
        super().poll_sleep(seconds, to_tail=to_tail)
        self.sleeps += 1


@pytest.mark.rule("R10")
@pytest.mark.rule("R11")
@pytest.mark.parametrize("factory", [kv.create_worker, kv.create_reference_worker], ids=["engine", "reference"])
def test_shutdown_drain_of_many_pending_transfers_keeps_its_backoff_and_ends_at_the_last(factory: Any) -> None:
    """200 stores still queued on the device when shutdown begins, 10 virtual us each: the drain's pause carries
    over from head to head and runs on to the stream's last record (``to_tail``), so it pauses about once per
    POLL_MAX_SLEEP of device work after a short ramp -- not once or more per transfer -- and ends exactly at the last
    completion."""
    count, each = 200, 1e-5
    be = _CountingSim(latency=each, pinned_bandwidth=1e18, pageable_bandwidth=1e18)
    layout = small_layout()
    w = factory(be, patterned_gpu(be, layout), layout, blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS,
                policy=kv.ShutdownPolicy(timeout=TIMEOUT))
    for job in range(count):
        w.submit_store(job, gspec([job % GPU_BLOCKS]), cspec([job % CPU_CHUNKS]))
    start, before = be.monotonic(), be.sleeps
    report = w.shutdown()
    busy = count * each  # the device's work, all of it still queued at the start
    ramp = math.ceil(math.log2(POLL_MAX_SLEEP / POLL_FIRST_SLEEP))  # pauses until the pause reaches its cap
    assert report.store.drained == count and report.region == "released"
    assert be.sleeps - before <= ramp + math.ceil(busy / POLL_MAX_SLEEP) + 1, "one pause per head: backoff reset"
    assert be.monotonic() - start == pytest.approx(busy, rel=1e-9)


# -- submission failures leave no trace --------------------------------------------------------------------------
@pytest.mark.rule("R16")
# (one stream per handler: no stream is created per submission)
@pytest.mark.parametrize("point", ["copy", "event_create", "descriptor_alloc"])
def test_shutdown_failed_submission_leaves_no_trace(point: str) -> None:
    plan = kv.FaultPlan([kv.Fault(point, "error", job_id=2, nth=1)])  # job 1 holds the pooled objects
    be, w, _ = make_worker(SimBackend(plan))
    w.submit_store(1, gspec([1]), cspec([1]))
    live, stats = be.ledger.live(), w.stats()
    with pytest.raises(kv.DeviceError):
        w.submit_store(2, gspec([2]), cspec([2]))
    assert be.ledger.live() == live and w.stats() == stats
    w.submit_store(2, gspec([2]), cspec([2]))  # the id is free again
    w.wait({1, 2})
    assert [r.success for r in w.get_finished()] == [True, True]
    report = w.shutdown()
    assert report.region == "released" and report.device_sync == "not_needed"
    assert_accounted(be, report)


# -- R1, R2: ownership and construction failure -----------------------------------------------------------------
CONSTRUCTION_FAULTS = [
    kv.Fault("host_register", "error", nth=1),
    kv.Fault("host_register", "error", nth=3),
    kv.Fault("stream_create", "error", nth=1),
    kv.Fault("stream_create", "error", nth=2),
    kv.Fault("event_create", "error", nth=1),
    kv.Fault("event_create", "error", nth=5),
]


@pytest.mark.rule("R2")
@pytest.mark.parametrize("fault", CONSTRUCTION_FAULTS, ids=repr)
def test_shutdown_construction_failure_releases_everything(fault: kv.Fault) -> None:
    plan = kv.FaultPlan([fault])
    be = SimBackend(plan)
    layout = small_layout()
    gpu = [be.empty_device((GPU_BLOCKS, PAGE)) for _ in range(2)]
    with pytest.raises(kv.DeviceError) as info:
        kv.create_worker(be, gpu, layout, blocks_per_chunk=3, num_cpu_chunks=CPU_CHUNKS, require_pinned=True,
                         pin_chunk_bytes=16 << 10)
    assert info.value.status == fault.status and "injected" in str(info.value), "the original exception"
    assert plan.fired == [fault]
    assert be.ledger.live() == {}, "create_worker released the region it built"


@pytest.mark.rule("R1")
@pytest.mark.rule("R2")
@pytest.mark.parametrize("fault", CONSTRUCTION_FAULTS, ids=repr)
def test_shutdown_construction_failure_leaves_callers_region_untouched(fault: kv.Fault) -> None:
    be = SimBackend(kv.FaultPlan([fault]))
    layout = small_layout()
    gpu = [be.empty_device((GPU_BLOCKS, PAGE)) for _ in range(2)]
    region = kv.HostRegion.allocate(be, layout, 3, CPU_CHUNKS)
    live = be.ledger.live()
    with pytest.raises(kv.DeviceError):
        kv.create_worker(be, gpu, layout, blocks_per_chunk=3, num_cpu_chunks=CPU_CHUNKS, region=region,
                         require_pinned=True, pin_chunk_bytes=16 << 10)
    assert region.state.value == "caller_owned" and not region.pinned
    assert be.ledger.live() == live == {"mapping": 1}
    region.release()
    assert be.ledger.live() == {}


@pytest.mark.rule("R2")
def test_shutdown_failed_pinning_runs_unpinned_unless_required(caplog: Any) -> None:
    be = SimBackend(kv.FaultPlan([kv.Fault("host_register", "error", nth=2)]))
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        _, w, _ = make_worker(be, pin_chunk_bytes=16 << 10)
    assert not w.stats().pinned and any("Failed to pin" in m for m in messages(caplog))
    assert "pinned" not in be.ledger.live(), "the registered chunks were rolled back"
    w.submit_store(1, gspec([1]), cspec([1]))
    w.wait({1})
    assert w.get_finished()[0].success
    w.shutdown()


class _BlockingPageableSim(SimBackend):
    """A device whose copies to or from pageable host memory block the host, as CUDA's cudaMemcpyAsync does."""

    pageable_copies_block = True


@pytest.mark.rule("R11")
@pytest.mark.rule("R2")
@pytest.mark.parametrize("create", [kv.create_worker, kv.create_reference_worker], ids=["engine", "reference"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "faulty-wrapper"])
def test_shutdown_no_pageable_fallback_where_pageable_copies_block_the_host(create: Any, wrapped: bool) -> None:
    """R11's bound holds only if no device call made under the worker's lock blocks the host: on a backend whose
    pageable copies do (the CuPy backend), a failed registration fails construction even with require_pinned=False,
    instead of leaving every later copy a blocking one. Nothing is left live (R2)."""
    plan = kv.FaultPlan([kv.Fault("host_register", "error", nth=2)])
    be: Any = _BlockingPageableSim(None if wrapped else plan)
    be = kv.FaultyBackend(be, plan) if wrapped else be
    layout = small_layout()
    gpu = [be.empty_device((GPU_BLOCKS, PAGE)) for _ in range(2)]
    with pytest.raises(kv.DeviceError, match="injected host_register failure"):
        create(be, gpu, layout, blocks_per_chunk=3, num_cpu_chunks=CPU_CHUNKS, pin_chunk_bytes=16 << 10)
    assert be.ledger.live() == {}


@pytest.mark.rule("R1")
def test_shutdown_worker_owns_the_region_and_handlers_never_see_it() -> None:
    be = SimBackend()
    layout = small_layout()
    gpu = [be.empty_device((GPU_BLOCKS, PAGE)) for _ in range(2)]
    region = kv.HostRegion.allocate(be, layout, 3, CPU_CHUNKS)
    w = kv.create_worker(be, gpu, layout, blocks_per_chunk=3, num_cpu_chunks=CPU_CHUNKS, region=region)
    with pytest.raises(kv.OwnershipError):
        region.release()
    handlers = [w._core.store, w._core.load]
    for handler in handlers:
        referents = gc.get_referents(vars(handler))
        assert region not in referents and all(getattr(r, "__self__", None) is not region for r in referents)
    with pytest.raises(kv.OwnershipError):
        kv.create_worker(be, gpu, layout, blocks_per_chunk=3, num_cpu_chunks=CPU_CHUNKS, region=region)
    w.shutdown()
    assert region.state.value == "released"
    assert region.release() == [], "R3: release is idempotent"


@pytest.mark.rule("R15")
def test_shutdown_worker_alive_at_interpreter_exit_is_shut_down(tmp_path: Any) -> None:
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
        import kvoffload_ref as kv
        import atexit
        be = kv.get_backend("sim")
        # atexit runs handlers last-in first-out: this one, registered before the worker's finalizer, runs after it
        atexit.register(lambda: print("ledger live at exit:", dict(be.ledger.live()), w.stats().state))
        layout = kv.KVCacheLayout(tensor_page_bytes=(512,), groups=((kv.LayerRef(0, 512),),))
        w = kv.create_worker(be, [be.empty_device((8, 512))], layout, blocks_per_chunk=1, num_cpu_chunks=4)
        w.submit_store(1, kv.GPULoadStoreSpec([1], (1,), (0,)), kv.CPULoadStoreSpec([1]))
    """)
    root = str(__import__("pathlib").Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=root, check=True).stdout
    assert "CPUOffloadingWorker was not shut down; shutting it down from its finalizer" in out
    assert "ledger live at exit: {} closed" in out
