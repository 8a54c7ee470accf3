"""Backends under several threads: the on_call hook, the Pause helper, atomic calls, compute streams and the
proof's streams."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from _interleave import Pause, run_in_thread
from _support import cspec, gspec, make_worker

import kvoffload_ref as kv
from kvoffload_ref.backends.base import CALL_POINTS
from kvoffload_ref.backends.sim import SimBackend

BACKENDS = pytest.mark.parametrize("make", [SimBackend, lambda: kv.FaultyBackend(SimBackend(), kv.FaultPlan())],
                                   ids=["sim", "faulty-sim"])


# -- the hook ---------------------------------------------------------------------------------------------------


@pytest.mark.rule("R19")
@BACKENDS
def test_backend_on_call_sees_every_call_of_a_submission_with_its_tag(make: Any) -> None:
    be = make()
    seen: list[tuple[str, Any]] = []
    _, w, _ = make_worker(be)
    be.on_call = lambda point, tag: seen.append((point, tag))
    w.submit_store(7, gspec([1, 2, 3]), cspec([0]))
    w.wait({7})
    be.on_call = None
    w.shutdown()
    points = [p for p, _ in seen]
    assert ("copy", ("store", 7)) in seen and ("record", ("store", 7)) in seen
    # the compute stream was captured at construction; streams and events are pooled
    assert {"descriptor_alloc", "wait_event"} <= set(points)
    assert ("event_query", ("store", 7)) in seen or ("event_sync", ("store", 7)) in seen
    assert set(points) <= set(CALL_POINTS.values())


@pytest.mark.rule("R19")
@BACKENDS
def test_backend_thread_paused_in_the_hook_holds_no_backend_lock(make: Any) -> None:
    be = make()
    _, w, _ = make_worker(be)
    with Pause(be, "copy_batch", direction="store", job_id=1) as pause:
        submitter = run_in_thread(lambda: w.submit_store(1, gspec([1]), cspec([0])))
        assert pause.reached.wait(timeout=10)
        # the paused thread is inside copy_batch's hook: every backend call still goes through here
        event = be.create_event()
        be.record(event, be.current_stream())
        be.sleep(0.5)
        assert be.query(event) and be.monotonic() >= 0.5
        be.destroy_event(event)
        assert not submitter.done
        pause.release()
        assert submitter.join(10)
    submitter.result()
    w.wait({1})
    w.shutdown()


@pytest.mark.rule("R19")
@BACKENDS
def test_backend_calls_from_many_threads_keep_the_ledger_exact(make: Any) -> None:
    be = make()
    stream = be.create_stream()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(200):
                event = be.create_event()
                be.record(event, stream)
                be.sleep(1e-6)
                be.query(event)
                be.destroy_event(event)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    be.destroy_stream(stream)
    assert errors == [] and be.ledger.live() == {}
    assert be.ledger.acquired()["event"] == be.ledger.released()["event"] == 800


# -- the Pause helper itself --------------------------------------------------------------------------------------


def test_interleave_pause_selects_the_nth_matching_call_and_restores_the_hook() -> None:
    be = SimBackend()
    outer: list[str] = []
    be.on_call = lambda point, tag: outer.append(point)
    with Pause(be, "record", direction="load", nth=2) as pause:
        event, stream = be.create_event(), be.create_stream()
        be.record(event, stream, tag=("store", 1))           # wrong direction: passes
        be.record(event, stream, tag=("load", 1))            # first match: passes
        worker = run_in_thread(lambda: be.record(event, stream, tag=("load", 2)))   # second: pauses
        assert pause.reached.wait(timeout=10) and pause.paused_thread is not threading.current_thread()
        assert pause.calls == 2 and not worker.done
        pause.release()
        assert worker.join(10)
    assert worker.result() is None
    assert be.on_call is not None and outer.count("record") == 3   # the previous hook kept being called
    be.on_call = None


def test_interleave_run_in_thread_hands_back_the_result_or_the_exception() -> None:
    ok = run_in_thread(lambda: 42)
    assert ok.join(10) and ok.result() == 42 and ok.exception is None
    bad = run_in_thread(lambda: 1 // 0)
    assert bad.join(10) and isinstance(bad.exception, ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
        bad.result()
    with pytest.raises(ValueError, match="1-based"):
        Pause(SimBackend(), "copy", nth=0)


# -- compute streams and the proof's streams ---------------------------------------------------------------------


@pytest.mark.rule("R4")
def test_sim_compute_stream_resolves_none_names_and_own_streams() -> None:
    be = SimBackend()
    assert be.compute_stream() is be.current_stream() is be.compute_stream(None)
    named = be.compute_stream("attention")
    assert named is be.compute_stream("attention") and named is not be.compute_stream("mlp")
    own = be.create_stream()
    assert be.compute_stream(own) is own
    for bad in (3, SimBackend().create_stream(), object()):
        with pytest.raises(kv.InvalidTransferError, match="a str naming a compute stream"):
            be.compute_stream(bad)
    assert be.ledger.live() == {"stream": 1}   # named compute streams are not in the ledger
    be.destroy_stream(own)


@pytest.mark.rule("R4")
def test_sim_compute_write_on_a_named_stream_runs_there() -> None:
    be = SimBackend()
    dev = be.empty_device((4, 8))
    be.enqueue_compute_write(dev, [1], 9, delay=2.0, stream="attention")
    marker = be.create_event()
    be.record(marker, be.compute_stream("attention"))
    default = be.create_event()
    be.record(default, be.current_stream())
    be.sleep(1.0)
    assert be.query(default) and not be.query(marker)   # the default compute stream is not behind it
    be.sleep(1.5)
    assert be.query(marker) and (np.asarray(dev)[1] == 9).all()
    with pytest.raises(kv.InvalidTransferError):
        be.enqueue_compute_write(dev, [1], 9, delay=0.0, stream=1.5)


@pytest.mark.rule("R13")
@BACKENDS
def test_backend_prove_idle_records_only_on_the_given_streams(make: Any) -> None:
    be = make()
    sim = be if isinstance(be, SimBackend) else be.inner
    dev = sim.empty_device((2, 8))
    sim.enqueue_compute_write(dev, [0], 1, delay=100.0)   # the compute stream is busy for a long time
    stream = be.create_stream()
    assert be.prove_idle([stream], be.monotonic() + 1.0), "the busy compute stream was not asked for"
    assert not be.prove_idle([stream, be.current_stream()], be.monotonic() + 1.0)
    be.destroy_stream(stream)
    assert be.ledger.live() == {}
