"""The kit checks another implementation: a tiny, independent worker, plugged in through a worker factory.

``TinyWorker`` is written from scratch against the Backend protocol (it reuses only the library's planner for
spec validation and ``HostRegion`` for the CPU memory): no pools (a fresh stream, events and descriptor buffer
per transfer), one FIFO per direction, bounded polling, the device-level proof, quarantine. ``tiny_factory`` is
the whole adapter: docs/conformance.md walks through it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvoffload_ref import errors
from kvoffload_ref.backends.base import Backend, DescriptorBuffer, Event, Stream, poll_until
from kvoffload_ref.layout import plan_copies
from kvoffload_ref.region import HostRegion
from kvoffload_ref.testing import Capabilities, Setup, make_machine
from kvoffload_ref.testing.campaign import quiet_logs

_KEPT: list[object] = []  # descriptor buffers quarantined by a TinyWorker: alive until process exit


class Result(NamedTuple):
    job_id: int
    success: bool
    transfer_size: int | None


@dataclasses.dataclass(frozen=True)
class Drain:
    drained: int = 0
    abandoned: int = 0


@dataclasses.dataclass(frozen=True)
class Report:
    store: Drain
    load: Drain
    device_sync: str
    region: str
    quarantined: dict[str, int]
    leaked: dict[str, int]
    elapsed: float
    interrupted: bool = False


@dataclasses.dataclass
class _Transfer:
    job_id: int
    stream: Stream
    events: list[Event]
    buf: DescriptorBuffer | None
    nbytes: int


@dataclasses.dataclass
class _Direction:
    name: str
    queue: collections.deque[_Transfer] = dataclasses.field(default_factory=collections.deque)
    done: list[Result] = dataclasses.field(default_factory=list)
    unproven: list[_Transfer] = dataclasses.field(default_factory=list)
    jobs: set[int] = dataclasses.field(default_factory=set)
    # Invariant: the last transfer queued (R4: the next waits for it unless it was proven, even if it failed).
    last: _Transfer | None = None


class _State:
    """Everything a TinyWorker holds; its finalizer holds this, never the worker."""

    def __init__(self, backend: Backend, gpu: Sequence[object], setup: Setup, region: HostRegion) -> None:
        self.backend, self.setup, self.region = backend, setup, region
        self.gpu = [backend.array_info(t) for t in gpu]
        self.dirs = {"store": _Direction("store"), "load": _Direction("load")}
        self.report: Report | None = None

    def release(self, transfer: _Transfer) -> None:
        self.backend.destroy_stream(transfer.stream)
        for event in transfer.events:
            self.backend.destroy_event(event)
        if transfer.buf is not None:
            self.backend.free_descriptors(transfer.buf)

    def observe(self, d: _Direction, done: Callable[[Event], bool]) -> bool:
        """Observe d's head once: prove it, fail it and all behind it, or (False) leave it pending."""
        head = d.queue[0]
        try:
            ok = done(head.events[-1])
        except errors.DeviceError:
            failed = list(d.queue)
            d.queue.clear()
            d.unproven.extend(failed)
            d.done.extend(Result(t.job_id, False, None) for t in failed)
            return True
        if ok:
            d.queue.popleft()
            d.done.append(Result(head.job_id, True, head.nbytes))
            self.release(head)
        return ok

    def poller(self, deadline: float | None) -> Callable[[Event], bool]:
        be = self.backend
        if deadline is None:
            return lambda event: be.synchronize(event) is None
        return lambda event: poll_until(be, lambda: be.query(event), deadline)

    def shutdown(self) -> Report:
        if self.report is not None:
            return self.report
        be, policy = self.backend, self.setup.policy
        start = be.monotonic()
        deadline = start + policy.timeout
        self.report = Report(Drain(), Drain(), "skipped", "quarantined", {}, {}, 0.0, True)  # closed from now on
        drains = {name: self.drain(d, deadline) for name, d in self.dirs.items()}
        unproven = [t for d in self.dirs.values() for t in d.unproven]
        sync = "not_needed"
        if unproven:
            try:
                sync = "ok" if be.prove_idle([t.stream for t in unproven], deadline) else "timeout"
            except errors.DeviceError:
                sync = "failed"
        release = sync in ("not_needed", "ok") or policy.on_unproven == "release"
        for transfer in unproven:
            buf, transfer.buf = transfer.buf, None
            self.release(transfer)
            if buf is not None and release:
                be.free_descriptors(buf)
            elif buf is not None:
                be.ledger.quarantine("descriptor", id(buf))
                _KEPT.append(buf)
        if release:
            self.region.release_by_owner()
        else:
            self.region.quarantine_by_owner(f"device_sync={sync}")
        self.report = Report(drains["store"], drains["load"], sync, "released" if release else "quarantined",
                             be.ledger.quarantined(), be.ledger.leaked(), be.monotonic() - start)
        return self.report

    def drain(self, d: _Direction, deadline: float) -> Drain:
        d.done.clear()
        drained = 0
        try:
            while d.queue:
                if not self.observe(d, self.poller(deadline)):
                    break
                drained += bool(d.done and d.done[-1].success)
        except Exception:
            pass
        abandoned = len(d.queue)
        d.unproven.extend(d.queue)
        d.queue.clear()
        return Drain(drained, abandoned)


def _finalize(state: _State) -> None:
    state.shutdown()


class TinyWorker:
    """A minimal worker satisfying the kit's WorkerLike protocol."""

    def __init__(self, backend: Backend, gpu: Sequence[object], setup: Setup) -> None:
        region = HostRegion.allocate(backend, setup.layout, setup.blocks_per_chunk, setup.num_cpu_chunks)
        with contextlib.suppress(errors.DeviceError):  # a failed pin: run from pageable memory
            region.pin(setup.pin_chunk_bytes)
        region.adopt()
        self._s = _State(backend, gpu, setup, region)
        weakref.finalize(self, _finalize, self._s)

    def _open(self) -> _State:
        if self._s.report is not None:
            raise errors.WorkerClosedError("shut down")
        return self._s

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit("store", job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit("load", job_id, src_spec, dst_spec)

    def _submit(self, direction: str, job_id: int, src: Any, dst: Any) -> bool:
        s = self._open()
        if isinstance(job_id, bool) or not isinstance(job_id, int):
            raise errors.InvalidTransferError("job_id must be an int")
        if any(job_id in d.jobs for d in s.dirs.values()):
            raise errors.InvalidTransferError("job_id in flight")
        plan = plan_copies(s.setup.layout, direction, src, dst, s.gpu, s.region.geometries(),  # type: ignore[arg-type]
                           s.setup.blocks_per_chunk)
        d, be, tag = s.dirs[direction], s.backend, (direction, job_id)
        made: list[tuple[Callable[[Any], None], Any]] = []
        queued = False
        try:
            buf = None
            if plan.num_ops:
                buf = be.alloc_descriptors(plan.num_ops, tag=tag)
                made.append((be.free_descriptors, buf))
                buf.fill(plan.src, plan.dst, plan.sizes)
            stream = be.create_stream(tag=tag)
            made.append((be.destroy_stream, stream))
            events = []
            for _ in range(3):
                events.append(be.create_event(tag=tag))
                made.append((be.destroy_event, events[-1]))
            marker, start, end = events
            be.record(marker, be.current_stream(), tag=tag)
            be.wait_event(stream, marker)  # R4: after the compute work queued so far
            if d.last is not None and (d.last in d.queue or d.last in d.unproven):
                be.wait_event(stream, d.last.events[-1])  # R4: after the previous transfer, failed or not
            be.record(start, stream, tag=tag)
            if buf is not None:
                be.copy_batch(stream, buf, plan.num_ops, tag=tag)
                queued = True
            be.record(end, stream, tag=tag)
        except BaseException:
            if queued:  # the device may read the descriptors: keep everything for the proof
                d.unproven.append(_Transfer(job_id, stream, events, buf, 0))
            else:
                for release, item in reversed(made):
                    release(item)
            raise
        d.last = _Transfer(job_id, stream, events, buf, plan.nbytes)
        d.queue.append(d.last)
        d.jobs.add(job_id)
        return True

    def get_finished(self) -> list[Result]:
        s = self._s
        if s.report is not None:
            return []
        results: list[Result] = []
        for d in s.dirs.values():
            while d.queue and s.observe(d, s.backend.query):
                pass
            results += d.done
            d.jobs.difference_update(r.job_id for r in d.done)
            d.done = []
        return results

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        s = self._s
        if s.report is not None:
            return
        ids = set(job_ids)
        deadline = None if timeout is None else s.backend.monotonic() + timeout
        for d in s.dirs.values():
            targets = ids & {t.job_id for t in d.queue}
            while targets and d.queue:
                if not s.observe(d, s.poller(deadline)):
                    raise errors.DeadlineExceeded("timeout")
                targets &= {t.job_id for t in d.queue}

    def cpu_snapshot(self) -> list[npt.NDArray[np.uint8]]:
        return self._open().region.snapshot()

    def stats(self) -> object:
        s = self._s
        return ([(len(d.queue), len(d.done), len(d.unproven), sorted(d.jobs)) for d in s.dirs.values()],
                s.backend.ledger.live())

    def shutdown(self) -> Report:
        return self._s.shutdown()


def tiny_factory(backend: Backend, gpu: Sequence[object], setup: Setup) -> TinyWorker:
    """The adapter: how the kit builds the implementation under test."""
    return TinyWorker(backend, gpu, setup)


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


@pytest.mark.rule("R4")
@pytest.mark.rule("R5")
@pytest.mark.rule("R6")
@pytest.mark.rule("R8")
@pytest.mark.rule("R11")
@pytest.mark.rule("R12")
@pytest.mark.rule("R16")
def test_testing_adapter_tiny_worker_conforms() -> None:
    # TinyWorker leaves R14 (an interrupted shutdown) and R19 (threads) out: the machine does not draw those rules.
    machine = make_machine(tiny_factory, name="TinyWorkerMachine",
                           capabilities=Capabilities(interrupts=False, threads=False))
    budget = settings(settings(), stateful_step_count=50, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    run_state_machine_as_test(machine, settings=budget)
    print(f"\ntiny worker: {machine.counters.line()}")
    assert machine.counters.succeeded and machine.counters.shutdowns and machine.counters.violations == 0
