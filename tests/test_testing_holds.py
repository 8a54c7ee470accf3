"""What the kit knows of a running engine (kvoffload_ref.testing.holds, .expiry): which submissions a hold refuses,
what held() and take_released() may say, which expiries a failure may carry -- and the machine catching workers
that get them wrong."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pytest
from _support import CATCH_BUDGET, catch_budget
from hypothesis.stateful import run_state_machine_as_test

import kvoffload_ref as kv
from kvoffload_ref.backends.base import Backend
from kvoffload_ref.testing import Model
from kvoffload_ref.testing.adapter import Setup, WorkerLike, reference_factory, reference_worker_factory
from kvoffload_ref.testing.expiry import failure_problems
from kvoffload_ref.testing.holds import conflict, held_problems, held_sets, release_problems
from kvoffload_ref.testing.machine import ConformanceError, make_machine
from kvoffload_ref.testing.mutants import _Wrapper

PAGE, BPC = 8, 2


def _model() -> Model:
    layout = kv.KVCacheLayout((PAGE,), ((kv.LayerRef(0, PAGE),),))
    gpu = np.arange(6 * PAGE, dtype=np.uint8).reshape(6, PAGE)
    return Model(layout, BPC, 6, 3, [gpu], [np.zeros((3, PAGE * BPC), np.uint8)])


def _g(*ids: int) -> kv.GPULoadStoreSpec:
    return kv.GPULoadStoreSpec(list(ids), group_sizes=(len(ids),), block_indices=(0,))


def _c(*ids: int) -> kv.CPULoadStoreSpec:
    return kv.CPULoadStoreSpec(list(ids))


def _held(gpu: Sequence[int] = (), cpu: Sequence[int] = (), gpu_reads: Sequence[int] = (),
          cpu_reads: Sequence[int] = ()) -> kv.HeldBlocks:
    return kv.HeldBlocks(tuple(gpu), tuple(cpu), tuple(gpu_reads), tuple(cpu_reads))


@pytest.mark.rule("R27")
def test_testing_holds_conflict_refuses_writes_of_held_ids_and_reads_of_ids_held_for_any_access() -> None:
    late_store = held_sets(_held(gpu=[1], cpu=[2], gpu_reads=[1]))  # a late store reads GPU 1, writes chunk 2
    assert conflict("store", [1], [0], late_store) is None, "two reads never conflict (R20)"
    assert "writes gpu ids [1]" in str(conflict("load", [1], [0], late_store))
    assert "reads cpu ids [2]" in str(conflict("load", [3], [2], late_store))
    assert "writes cpu ids [2]" in str(conflict("store", [3], [2], late_store))
    assert conflict("load", [4], [1], late_store) is None


@pytest.mark.rule("R27")
def test_testing_holds_held_must_cover_late_jobs_the_way_they_touch_each_id() -> None:
    m = _model()
    load = m.submit("load", 1, _g(2), _c(0), hung=False, lane="s1")
    m.error_fired("load", 1)
    m.resolve(load, False)  # late: it may still write GPU 2 and read chunk 0
    assert list(held_problems(held_sets(_held(gpu=[2], cpu=[0], cpu_reads=[0])), m)) == []
    missing = list(held_problems(held_sets(_held()), m))
    assert any(rules == "R27" and "gpu ids [2] are not held" in text for rules, text, _ in missing), missing
    assert any("cpu ids [0] are not held" in text for _, text, _ in missing), missing
    reads_only = list(held_problems(held_sets(_held(gpu=[2], cpu=[0], gpu_reads=[2], cpu_reads=[0])), m))
    assert any("held for writes only although a late copy may still write" in text for _, text, _ in reads_only)
    extra = list(held_problems(held_sets(_held(gpu=[2, 5], cpu=[0], cpu_reads=[0])), m))
    assert any("[5] are held although no late" in text for _, text, _ in extra)
    m.release(load)
    assert list(held_problems(held_sets(_held()), m)) == []


@pytest.mark.rule("R27")
def test_testing_holds_a_release_names_a_late_job_once_with_its_ids_after_its_copy_was_observed() -> None:
    m = _model()
    ok = m.submit("store", 1, _g(3), _c(1), hung=False, lane="s1")
    done = m.submit("store", 2, _g(4), _c(2), hung=False, lane="s2")
    m.resolve(ok, False)
    m.resolve(done, True)
    record = kv.ReleasedHold(1, "store", (3,), (1,))
    assert list(release_problems(record, m, observed=True)) == []
    assert any("never saw its copy observed" in t for _, t, _ in release_problems(record, m, observed=False))
    assert any("with blocks" in t for _, t, _ in release_problems(dataclasses.replace(record, cpu_chunks=(2,)), m,
                                                                True))
    assert any("a success" in t for _, t, _ in release_problems(kv.ReleasedHold(2, "store", (4,), (2,)), m, True))
    assert any("never accepted" in t for _, t, _ in release_problems(kv.ReleasedHold(9, "load", (), ()), m, True))
    m.release(ok)
    assert any("a second time" in t for _, t, _ in release_problems(record, m, observed=True))


def _expired(reason: str, job: int, ahead: int | None = None) -> kv.TransferExpired:
    return kv.TransferExpired("expired", reason, job, ahead)


@pytest.mark.rule("R26")
def test_testing_expiry_allows_only_the_expiries_the_rule_allows() -> None:
    m = _model()
    first = m.submit("load", 1, _g(1), _c(0), hung=False, lane="s1", deadline=0.01, now=1.0)
    behind = m.submit("load", 2, _g(2), _c(1), hung=False, lane="s1")
    other = m.submit("load", 3, _g(3), _c(2), hung=False, lane="s2")

    def problems(transfer: object, error: object, now: float = 2.0) -> list[str]:
        found = failure_problems(m, transfer, error, now, unreliable=False, running=True)  # type: ignore[arg-type]
        return [text for _, text, _ in found]

    assert problems(first, _expired("deadline", 1)) == []
    assert problems(first, _expired("deadline", 1), now=1.005), "before its deadline passed"
    assert problems(other, _expired("deadline", 3)), "no deadline"
    assert problems(first, _expired("cancel", 1)), "never cancelled"
    assert problems(first, _expired("deadline", 2)), "names another job"
    assert problems(behind, _expired("behind", 2, 1)), "job 1 was not reported expired yet"
    first.expired = "deadline"
    assert problems(behind, _expired("behind", 2, 1)) == []
    assert problems(other, _expired("behind", 3, 1)), "job 1 is on another stream"
    other.cancelled = True
    assert problems(other, _expired("cancel", 3)) == []
    other.proven_first = True
    assert problems(other, _expired("cancel", 3)), "its copy had completed before the cancel"
    assert problems(other, kv.DeviceError("lost")), "a failure without a cause"
    assert problems(other, _expired("sideways", 3))


class _HeldHidden(_Wrapper):
    """kvoffload_ref's worker, except that ``held()`` lists nothing (the holds still refuse)."""

    def held(self) -> kv.HeldBlocks:
        return kv.HeldBlocks()


class _BlindCancel(_Wrapper):
    """The reference worker, except that ``cancel`` does not look first: a listed job still queued is expired even
    when its copy has completed on the device."""

    def cancel(self, job_ids: Iterable[int]) -> None:
        ids = list(job_ids)
        if not all(type(j) is int for j in ids):
            self._running.cancel(ids)  # R7: the real one refuses it
            return
        core: Any = self._inner._core  # type: ignore[attr-defined]
        with core.call:
            for handler in (core.store, core.load):
                index = next((i for i, t in enumerate(handler.queue) if t.job_id in ids), None)
                if index is not None:
                    handler._expire(index, "cancel", set(ids))


def _hidden(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    return _HeldHidden(reference_factory(backend, gpu, setup))


def _blind_cancel(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    return _BlindCancel(reference_worker_factory(backend, gpu, setup))


def _caught(factory: object, name: str) -> str:
    machine = make_machine(factory, name=name)  # type: ignore[arg-type]
    with pytest.raises(ConformanceError) as info:
        run_state_machine_as_test(machine, settings=catch_budget(CATCH_BUDGET))
    return str(info.value)


@pytest.mark.rule("R27")
def test_testing_holds_a_worker_hiding_its_holds_is_caught() -> None:
    message = _caught(_hidden, "HeldHidden")
    assert message.startswith("R27"), message


@pytest.mark.rule("R26")
def test_testing_expiry_a_cancel_that_does_not_look_first_is_caught() -> None:
    message = _caught(_blind_cancel, "BlindCancel")
    assert message.startswith("R26") and "had completed before the cancel" in message, message


class _Plain:
    """kvoffload_ref's engine seen through the calls of the kit before R26 only (no cancel, held, take_released,
    deadline=): another implementation the kit must still run."""

    def __init__(self, inner: WorkerLike) -> None:
        self._inner = inner

    def submit_store(self, job_id: int, src: kv.GPULoadStoreSpec, dst: kv.CPULoadStoreSpec) -> object:
        return self._inner.submit_store(job_id, src, dst)

    def submit_load(self, job_id: int, src: kv.CPULoadStoreSpec, dst: kv.GPULoadStoreSpec) -> object:
        return self._inner.submit_load(job_id, src, dst)

    def __getattr__(self, name: str) -> object:
        if name in ("cancel", "held", "take_released"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def _plain(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    return _Plain(reference_factory(backend, gpu, setup))  # type: ignore[return-value]


@pytest.mark.rule("R26")
@pytest.mark.rule("R27")
def test_testing_holds_a_worker_without_a_running_engine_is_run_without_it_and_told_once(
        caplog: pytest.LogCaptureFixture) -> None:
    machine = make_machine(_plain, name="Plain")
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref.testing"):
        run_state_machine_as_test(machine, settings=catch_budget(40))
    said = [r for r in caplog.records if r.name == "kvoffload_ref.testing"]
    assert len(said) == 1 and "skips the running-engine checks" in said[0].getMessage()
    counters = machine.counters
    assert counters.runs >= 40 and counters.submitted and not (counters.cancels or counters.deadlines)


def _stream_per_transfer(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """The reference worker, except that every submission retires its direction's stream (its live transfers stay
    queued there) and so goes to a fresh one: R4's FIFO per direction is gone although nothing became late."""
    worker = reference_worker_factory(backend, gpu, setup)
    core: Any = worker._core  # type: ignore[attr-defined]
    for handler in (core.store, core.load):
        submit = handler.submit

        def fresh(*args: Any, handler: Any = handler, submit: Any = submit, **kwargs: Any) -> None:
            submit(*args, **kwargs)
            if handler.stream is not None and handler.queue:  # queued: the next one goes to a fresh stream
                handler.retired.retire(handler.stream, list(handler.queue), [], backend.monotonic())
                handler.queue.clear()
                handler.stream = None

        handler.submit = fresh
    return worker


@pytest.mark.rule("R4")
@pytest.mark.rule("R28")
def test_testing_holds_a_fresh_stream_without_a_late_job_is_caught() -> None:
    message = _caught(_stream_per_transfer, "StreamPerTransfer")
    assert message.startswith(("R4/R28", "R4/R5", "R4/R20")), message
