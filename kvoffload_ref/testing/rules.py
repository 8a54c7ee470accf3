"""The conformance machine's rules for a live worker: build it, submit valid and invalid transfers, reap, wait,
and act on the device (the clock, compute writes, faults injected mid-run)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import numpy as np
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvoffload_ref.errors import BlocksHeldError, DeadlineExceeded, DeviceError, InvalidTransferError, SimHang
from kvoffload_ref.fault_plan import TRANSFER_HANG_POINTS
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload_ref.testing.adapter import (
    RunningLike,
    initial_gpu_bytes,
)
from kvoffload_ref.testing.holds import conflict, held_sets
from kvoffload_ref.testing.machine_base import MachineBase, worker_open
from kvoffload_ref.testing.model import Model, ModelTransfer, plan_moves
from kvoffload_ref.testing.races import Label, RaceModel
from kvoffload_ref.testing.shutdown import (
    MARGIN,
    SLACK,
)
from kvoffload_ref.testing.strategies import (
    INVALID_CASES,
    completion_faults,
    faults,
    first_job_ids,
    invalid_for,
    specs_for,
)

if TYPE_CHECKING:
    from kvoffload_ref.testing.adapter import ResultLike

__all__ = ["CLOCK_STEPS", "COMPLETION_SLOTS", "COMPUTE_DELAYS", "DEADLINES", "FAULT_SLOTS", "WAIT_TIMEOUTS",
           "TransferRules"]


CLOCK_STEPS: Final = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0)
COMPUTE_DELAYS: Final = (0.0, 1e-6, 1e-4, 1e-3, 0.02, 0.3)
WAIT_TIMEOUTS: Final = (0.0, 1e-4, 1e-3, 0.05, 0.5)
#: R26: a submission's deadline (seconds from its start on the device): mostly none; else about a copy's time on
#: the kit's device (a few microseconds) or more, against clock steps that pass it.
DEADLINES: Final = (None,) * 12 + (1e-5, 1e-4, 1e-3, 0.05)
#: Any fault; its job_id, if any, is a slot (0-7) the machine maps to one of the next or pending jobs.
FAULT_SLOTS: Final = faults(range(8))
#: An error at a transfer's completion (its end event's query or sync); its job_id, if any, is a slot (0-7) the
#: machine maps to a pending job first (to one of the next jobs when none is pending).
COMPLETION_SLOTS: Final = completion_faults(range(8))
#: A worker's drawn lifetime (steps before the machine may shut it down): mostly short, sometimes long.
LIFETIMES: Final = st.one_of(st.integers(0, 8), st.integers(0, 60))
#: The R7 cases drawn without (False) and with (True) a pending job to reuse the id of.
_INVALID_CASES: Final = {flight: tuple(c for c in INVALID_CASES if flight or c != "job id in flight")
                         for flight in (False, True)}


class TransferRules(MachineBase):
    """Rules: build/restart, submissions, get_finished, wait, the device.

    A mixin over :class:`~kvoffload_ref.testing.machine_base.MachineBase`, composed with the others in
    :class:`~kvoffload_ref.testing.machine.OffloadingMachine`; it uses the checks of
    :class:`~kvoffload_ref.testing.invariants.Checks` (declared below for the type checker only).
    """

    if TYPE_CHECKING:  # from Checks
        def _check_result(self, result: ResultLike) -> None: ...
        def _check_memory(self) -> None: ...

    # -- initialize ---------------------------------------------------------------------------------------------
    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        """Draw a setup, build the device and the worker (R1/R2 when construction fails)."""
        with self._step():
            self.next_job = data.draw(first_job_ids(), label="first job id")  # R7: at the int64 edges too
            header = "import gc\nfrom kvoffload_ref import *\nfrom kvoffload_ref.testing import *"
            self._say(header + (f"\n{self.factory_import}" if self.factory_import else ""))
            self._start(data)

    @precondition(lambda self: self.phase in ("closed", "dropped", "refused"))
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        """The worker is gone (shut down, dropped or never built): build a new one on a new device."""
        with self._step():
            self._start(data)

    def _start(self, data: st.DataObject) -> None:
        setup = self.setup = data.draw(self.setup_strategy, label="setup")
        self.lifetime = data.draw(LIFETIMES, label="lifetime")
        self.age, self.seen_firings, self.hazard_counted = 0, 0, False
        self.worker, self.model, self.report = None, None, None
        self.handed.clear()
        type(self).counters.workers += 1
        self._say(f"setup = {setup!r}")
        self._say(f"dev = SimDevice(setup)\nw = {self.factory_name}(dev.backend, dev.gpu, setup)\nhanded = []")
        self.specs = specs_for(setup.layout, setup.blocks_per_chunk, setup.num_gpu_blocks, setup.num_cpu_chunks)
        self.invalid = {flight: invalid_for(setup.layout, setup.blocks_per_chunk, setup.num_gpu_blocks,
                                            setup.num_cpu_chunks, cases)
                        for flight, cases in _INVALID_CASES.items()}
        self.dev = self._make_device(setup)
        self.race, self.races_seen = RaceModel(), 0
        try:
            self.worker = self.worker_factory[0](self.current_device.backend, self.current_device.gpu, setup)
        except DeviceError:
            self._raised("DeviceError")
            self._new_firings()
            self.phase = "refused"
            live = self.current_device.ledger.live()
            self._check(live == {}, "R2", f"construction failed but left {live} live", "dev.ledger.live() == {}")
            return
        self._new_firings()
        self.phase = "open"
        self._check_running()
        pages = setup.layout.tensor_page_bytes
        self.model = Model(setup.layout, setup.blocks_per_chunk, setup.num_gpu_blocks, setup.num_cpu_chunks,
                           [initial_gpu_bytes(setup, t)[:, :p] for t, p in enumerate(pages)],
                           [np.asarray(a) for a in self.current_worker.cpu_snapshot()])

    # -- transfers ----------------------------------------------------------------------------------------------
    @precondition(worker_open)
    @rule(data=st.data())
    def submit_store(self, data: st.DataObject) -> None:
        """Submit a valid store (R4: ordered after the compute work and the previous store)."""
        with self._step():
            self._submit("store", data)

    @precondition(worker_open)
    @rule(data=st.data())
    def submit_load(self, data: st.DataObject) -> None:
        """Submit a valid load (R4: ordered after the compute work and the previous load, not the stores)."""
        with self._step():
            self._submit("load", data)

    def _submit(self, direction: str, data: st.DataObject) -> None:
        gpu, cpu = data.draw(self.specs, label="specs")
        setup = self.current_setup
        moves = plan_moves(setup.layout, setup.blocks_per_chunk, gpu, cpu)
        lane = self.current_model.next_lane(direction)  # type: ignore[arg-type]
        if not self._ordered(lambda: self.current_race.partners_of_transfer(direction, moves, lane)):
            return
        job = self._fresh_job()
        src, dst = (gpu, cpu) if direction == "store" else (cpu, gpu)
        refused = self._held_conflict(direction, gpu, cpu)
        deadline = data.draw(st.sampled_from(DEADLINES), label="deadline") if self.running else None
        options = {} if deadline is None else {"deadline": deadline}
        given = "" if deadline is None else f", deadline={deadline!r}"
        self._say(f"w.submit_{direction}({job}, {src!r}, {dst!r}{given})" + (f"  # R27: {refused}" if refused else ""))
        live = self.current_device.ledger.live()
        submit = self.current_worker.submit_store if direction == "store" else self.current_worker.submit_load
        now = self.current_device.clock()
        before = (self._stats(), live, now, len(self.current_device.plan.fired))
        try:
            submit(job, src, dst, **options)  # type: ignore[arg-type]
        except BlocksHeldError as exc:
            self._outcome("BlocksHeldError")
            self._refused_held(refused, exc, before)
            return
        except DeviceError:
            self._raised("DeviceError")
            firings = self._new_firings()
            if self.current_device.copied((direction, job)):  # failed after its copy was queued: it still runs
                self.current_race.transfer(direction, job, moves, self.current_device.streams.get((direction, job)))
                self.current_model.ghost(moves, direction)  # type: ignore[arg-type]
            if any(f.fault.kind == "hang" and f.tag == (direction, job) for f in firings):
                self.current_model.tainted.add(direction)
                self.current_model.tainted_lanes.add(self.current_device.streams.get((direction, job), direction))
            after = self.current_device.ledger.live()
            # R28: the fresh stream a direction goes on after a retirement is its own (made at its next submission,
            # kept for the one after a failed one), not the failed submission's
            fresh = {"stream": 1} if self.running else {}
            bound: dict[str, int] = {**fresh, **{kind: n + fresh.get(kind, 0) for kind, n in live.items()}}
            self._check(all(n <= bound.get(kind, 0) for kind, n in after.items()), "R16",
                        f"a failed submission left resources live: {live} -> {after}",
                        f"all(n <= {bound!r}.get(kind, 0) for kind, n in dev.ledger.live().items())")
            self._absorb(firings)
            return
        self._check(refused is None, "R27", f"{direction} job {job} was accepted although {refused} (R27 refuses it)",
                    lambda: f"{self._outcome('BlocksHeldError')} is not None")
        firings = self._new_firings()
        hung = any(f.fault.kind == "hang" and f.point in TRANSFER_HANG_POINTS and f.tag == (direction, job)
                   for f in firings)
        lane = self.current_device.streams.get((direction, job))
        self._check_fresh_lane(direction, job, lane)
        self.current_model.submit(direction, job, gpu, cpu, hung=hung, lane=lane,  # type: ignore[arg-type]
                                  deadline=deadline, now=now)
        self.current_race.transfer(direction, job, moves, lane)
        self._absorb(firings)
        type(self).counters.submitted += 1
        type(self).counters.deadlines += deadline is not None

    def _held_conflict(self, direction: str, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec) -> str | None:
        """R27: why the holds the worker lists now refuse this submission (None: they do not, or no holds)."""
        if not self.running:
            return None
        worker: RunningLike = self.current_worker  # type: ignore[assignment]
        return conflict(direction, [int(i) for i in gpu.block_ids], [int(i) for i in cpu.block_ids],
                        held_sets(worker.held()))

    def _refused_held(self, refused: str | None, exc: BlocksHeldError, before: tuple[object, ...]) -> None:
        """R27: a submission refused for holds must conflict with them (when the worker lists them: without
        ``held()`` the kit cannot say), and change nothing (R7)."""
        self._check(refused is not None or not self.running, "R27",
                    f"a submission was refused with {exc!r} although it touches no held block the wrong way",
                    "raised is None")
        dev = self.current_device
        after = (self._stats(), dev.ledger.live(), dev.clock(), len(dev.plan.fired))
        self._check(after == before, "R7/R27", "a submission refused for held blocks changed the worker or the device",
                    self._before)
        type(self).counters.refused_held += 1

    @precondition(worker_open)
    @rule(data=st.data())
    def submit_invalid(self, data: st.DataObject) -> None:
        """R7: an invalid submission raises InvalidTransferError before any device work and changes nothing."""
        with self._step():
            bad = data.draw(self.invalid[bool(self.current_model.pending())], label="invalid")
            job: object = bad.job
            if job == "fresh":
                job = self.next_job
            elif job == "in_flight":
                in_flight = [t.job_id for t in self.current_model.pending()]
                job = data.draw(st.sampled_from(in_flight), label="job in flight")
            src_text, dst_text = bad.specs_text()
            self._say(f"w.submit_{bad.direction}({job!r}, {src_text}, {dst_text})  # R7: {bad.case}")
            self._outcome("InvalidTransferError")
            dev, worker = self.current_device, self.current_worker
            stats, live, clock, fired = self._stats(), dev.ledger.live(), dev.clock(), len(dev.plan.fired)
            try:
                src, dst = bad.build()
                submit = worker.submit_store if bad.direction == "store" else worker.submit_load
                submit(job, src, dst)  # type: ignore[arg-type]
            except InvalidTransferError as exc:
                self._check(isinstance(exc, ValueError), "R7", "InvalidTransferError must be a ValueError",
                            "isinstance(raised, ValueError)")
            else:
                self._check(False, "R7", f"accepted an invalid submission ({bad.case})", "raised is not None")
            self._check(self._stats() == stats and dev.ledger.live() == live and dev.clock() == clock,
                        "R7", f"a refused submission ({bad.case}) changed the worker or the device", self._before)
            self._check(len(self.current_device.plan.fired) == fired, "R7",
                        f"a refused submission ({bad.case}) made device calls (a fault fired)",
                        f"len(dev.plan.fired) == {fired}")

    @precondition(worker_open)
    @rule()
    def get_finished(self) -> None:
        """R5: each job once, per direction in submission order, success only if proven; never blocks."""
        with self._step():
            self._say("results = w.get_finished()\nprint(results)\nhanded += [r.job_id for r in results]")
            clock = self.current_device.clock()
            results = list(self.current_worker.get_finished())
            self._check(self.current_device.clock() == clock, "R5", "get_finished() blocked (the virtual clock moved)",
                        f"dev.clock() == {clock!r}")
            self._absorb(self._new_firings())
            for result in results:
                self._check_result(result)
            reported = {r.job_id for r in results}
            model = self.current_model
            missing = {j for j in model.awaited if model.transfers[j].status == "pending"} - reported
            self._check(not missing, "R6", f"wait() returned for jobs {sorted(missing)} but get_finished() did "
                                           "not report them",
                        f"set({sorted(missing)!r}) <= {{r.job_id for r in results}}")
            self.current_model.awaited.clear()
            self._check_memory()

    @precondition(worker_open)
    @rule(data=st.data())
    def wait(self, data: st.DataObject) -> None:
        """R6: wait blocks until the listed jobs are proven or failed; DeadlineExceeded when the time is up."""
        with self._step():
            model = self.current_model
            pending = [t.job_id for t in model.pending()]
            others = [*(j for j, t in model.transfers.items() if t.status != "pending"), self.next_job + 50]
            ids = data.draw(st.lists(st.sampled_from(pending + others), max_size=4, unique=True), label="ids")
            known = model.transfers
            listed = [known[j] for j in ids if j in known and known[j].status == "pending"]
            unbounded_ok = all(model.can_finish(t) for t in listed)
            timeout = data.draw(st.sampled_from(((None,) if unbounded_ok else ()) + WAIT_TIMEOUTS), label="timeout")
            self._wait(ids, listed, timeout)

    def _wait(self, ids: list[int], listed: list[ModelTransfer], timeout: float | None) -> None:
        model = self.current_model
        self._say(f"start = dev.clock()\nw.wait({ids!r}, timeout={timeout!r})")
        self._outcome("DeadlineExceeded")
        start = self.current_device.clock()
        busy = model.compute_busy_until
        try:
            self.current_worker.wait(ids, timeout)
            expired = False
        except DeadlineExceeded:
            note("# -> DeadlineExceeded")
            expired = True
        except SimHang:  # the script's wait hangs too: the sim raises SimHang there (and returns once fixed)
            self._check(False, "R6", f"wait({ids}) without a timeout hung on jobs the model says can finish", "True")
        elapsed = self.current_device.clock() - start
        self._absorb(self._new_firings())
        if timeout is not None:
            self._check(elapsed <= timeout + SLACK, "R6/R11", f"wait(timeout={timeout}) took {elapsed} s",
                        f"dev.clock() - start <= {timeout + SLACK!r}")
        if expired:
            self._check(timeout is not None and self.current_device.clock() >= start + timeout, "R6",
                        f"DeadlineExceeded after {elapsed} s with timeout={timeout}",
                        "raised is None" + ("" if timeout is None else f" or dev.clock() >= start + {timeout!r}"))
            can = all(model.can_finish(t) for t in listed)
            enough = timeout is not None and timeout >= max(busy - start, 0.0) + MARGIN
            self._check(not (can and enough), "R6", f"DeadlineExceeded although jobs {ids} could all finish "
                                                    f"within timeout={timeout}", "raised is None")
            return
        # Every query fails now: jobs resolve as failed.
        resolvable = self._unreliable()
        for t in listed:
            if t.status == "pending" and not t.must_fail and not resolvable and not model.may_be_late(t):
                self._check(not t.stuck, "R6", f"wait() returned although job {t.job_id} can never be proven",
                            "raised is not None")
        model.awaited.update(t.job_id for t in listed if t.status == "pending")

    def _ordered(self, partners: Callable[[], list[Label]]) -> bool:
        """R20, the caller's duty: under an "ordered" schedule, before work that would race with unobserved jobs,
        wait for them (when they can all be proven) and go on only if nothing races any more. Returns whether
        the work may be queued (always, under a "racy" schedule)."""
        if self.current_setup.schedule != "ordered":
            return True
        racing = partners()
        if not racing:
            return True
        model = self.current_model
        # Compute work on a named stream is never observed: nothing the host can wait for orders it.
        listed = [None if kind == "compute" else model.transfers.get(job) for kind, job in racing]
        if all(t is not None and t.status == "pending" and model.can_finish(t) and not t.must_fail
               and not model.may_be_late(t) for t in listed):
            type(self).counters.ordered_waits += 1
            self._wait(sorted({job for _, job in racing}), [t for t in listed if t is not None], None)
            racing = partners()
        if racing:
            note(f"# skipped: would race with {racing} (schedule 'ordered')")
        return not racing

    # -- the device ---------------------------------------------------------------------------------------------
    @rule(seconds=st.sampled_from(CLOCK_STEPS))
    def advance_clock(self, seconds: float) -> None:
        """Let virtual time pass: queued work runs (never a rule violation by itself)."""
        with self._step():
            if self.dev is None:
                return
            self._say(f"dev.advance({seconds!r})")
            self.current_device.advance(seconds)

    @precondition(lambda self: self.phase == "open" and not self.current_device.lost())
    @rule(data=st.data())
    def compute_write(self, data: st.DataObject) -> None:
        """Queue a compute-stream kernel writing whole GPU rows (R4: later transfers wait for it)."""
        with self._step():
            setup = self.current_setup
            tensor = data.draw(st.integers(0, setup.layout.num_tensors - 1), label="tensor")
            aimed = sorted({m.gpu_row for t in self.current_model.pending() for m in t.moves if m.tensor == tensor})
            aim = setup.schedule == "racy" and aimed and data.draw(st.booleans(), label="aim at pending")
            self._write_rows(data, tensor, aimed if aim else [])

    def _write_rows(self, data: st.DataObject, tensor: int, aimed: list[int], stream: str | None = None) -> None:
        """Draw 1-3 GPU rows of ``tensor`` (among ``aimed`` if any, else any row), a value and a delay, and queue
        that compute write on ``stream``."""
        if aimed:
            rows = data.draw(st.lists(st.sampled_from(aimed), min_size=1, max_size=3, unique=True), label="rows")
        else:
            rows = data.draw(st.lists(st.integers(0, self.current_setup.num_gpu_blocks - 1), min_size=1, max_size=3,
                                      unique=True), label="rows")
        value = data.draw(st.integers(0, 255), label="value")
        delay = data.draw(st.sampled_from(COMPUTE_DELAYS), label="delay")
        self._compute(tensor, rows, value, delay, stream)

    def _compute(self, tensor: int, rows: list[int], value: int, delay: float, stream: str | None = None) -> None:
        """Queue a compute write on ``stream`` (None: the worker's compute stream) under the schedule's duty (R20),
        and tell both models."""
        page = self.current_setup.layout.tensor_page_bytes[tensor]
        if not self._ordered(lambda: self.current_race.partners_of_compute(tensor, rows, page, stream)):
            return
        if self.current_device.lost():  # the wait that ordered it met a sticky fault (e.g. at a release call)
            return
        named = "" if stream is None else f", stream={stream!r}"
        self._say(f"dev.compute_write({tensor}, {rows!r}, {value}, {delay!r}{named})")
        self.current_model.compute_write(tensor, rows, value, delay, self.current_device.clock(), stream)
        self.current_device.compute_write(tensor, rows, value, delay, stream)
        self.current_race.compute(tensor, rows, page, stream)

    @precondition(worker_open)
    @rule(data=st.data())
    def inject_fault(self, data: st.DataObject) -> None:
        """Arm one more fault mid-run (aimed at the next jobs or at pending ones): half the time any fault
        (:data:`FAULT_SLOTS`), half the time an error at a transfer's completion (:data:`COMPLETION_SLOTS`), the
        path on which a worker must report ``success=False``, which uniform faults rarely reach."""
        with self._step():
            pending = [t.job_id for t in self.current_model.pending()]
            upcoming = [self.next_job + k for k in range(4)]
            completion = data.draw(st.booleans(), label="at a completion")
            fault = data.draw(COMPLETION_SLOTS if completion else FAULT_SLOTS, label="fault")
            if fault.job_id is not None:  # a slot: aim it at one of the next or pending jobs
                targets = (pending or upcoming) if completion else upcoming + pending[-4:]
                fault = dataclasses.replace(fault, job_id=targets[fault.job_id % len(targets)])
            self._say(f"dev.plan.add({fault!r})")
            self.current_device.plan.add(fault)
            type(self).counters.faults_injected += 1
