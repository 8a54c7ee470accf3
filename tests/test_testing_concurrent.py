"""The conformance machine's concurrent-shutdown rule (testing/concurrent_rules.py, testing/threads.py): shutdown()
from a second thread while the machine's thread submits or waits, interleaved at a backend call (R19, R8)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from _support import catch_budget
from hypothesis.stateful import run_state_machine_as_test

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.errors import WorkerClosedError
from kvoffload_ref.lifecycle import WorkerState
from kvoffload_ref.testing import ConformanceError, Setup, make_machine, reference_factory
from kvoffload_ref.testing.adapter import WorkerLike
from kvoffload_ref.testing.campaign import quiet_logs
from kvoffload_ref.testing.threads import CallPause, Runner, paused_or_done
from kvoffload_ref.worker import CPUOffloadingWorker


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


@pytest.mark.rule("R19")
@pytest.mark.rule("R8")
def test_testing_concurrent_shutdown_rule_runs_clean_on_the_library() -> None:
    machine = make_machine(name="Concurrent")
    run_state_machine_as_test(machine, settings=catch_budget(80))
    counters = machine.counters
    print(counters.line())
    assert counters.violations == 0 and counters.concurrent_shutdowns >= 5


def wait_raises_once_closed(backend: Backend, gpu: Any, setup: Setup) -> WorkerLike:
    """Issue 10 item 3: a wait() blocked while another thread shuts down raises instead of returning."""
    worker = reference_factory(backend, gpu, setup)
    assert isinstance(worker, CPUOffloadingWorker)
    wait = worker.wait

    def broken_wait(job_ids: Any, timeout: float | None = None) -> None:
        open_before = worker._core.state is WorkerState.OPEN
        wait(job_ids, timeout)
        if open_before and worker._core.state is not WorkerState.OPEN:
            raise WorkerClosedError("the worker was shut down while waiting")
    worker.wait = broken_wait  # type: ignore[method-assign]
    return worker


@pytest.mark.rule("R19")
def test_testing_concurrent_wait_raising_on_shutdown_is_caught() -> None:
    machine = make_machine(wait_raises_once_closed, name="WaitRaises")
    with pytest.raises(ConformanceError, match="R19: a wait"):
        run_state_machine_as_test(machine, settings=catch_budget())
    print(f"wait raising: caught after {machine.counters.steps} steps")


@pytest.mark.rule("R19")
def test_testing_threads_pause_at_a_backend_call_and_signal() -> None:
    sim = SimBackend()
    signal = threading.Event()
    with CallPause(sim, lambda point, tag: point == "monotonic", signal=signal) as pause:
        runner = Runner(sim.monotonic, "t", signal=signal)
        assert paused_or_done(signal) and pause.reached.is_set() and not runner.done.is_set()
        pause.release()
        assert runner.join() and runner.result == 0.0
    assert sim.on_call is None
    signal = threading.Event()
    failing = Runner(lambda: 1 // 0, "f", signal=signal)
    assert paused_or_done(signal) and failing.join() and isinstance(failing.exception, ZeroDivisionError)
