"""OffloadingMachine: a Hypothesis rule-based state machine that drives a worker and a pure model side by side.

Theory of operation
-------------------
``initialize`` draws a :class:`~kvoffload_ref.testing.adapter.Setup`, builds the kit's device (a simulated GPU
with a recording fault plan) and the implementation under test through the machine's worker factory, and starts
a :class:`~kvoffload_ref.testing.model.Model`. Each rule does one thing to the worker or the device, tells the
model what happened, and checks what the rules R1-R16 say must be observable right then; the invariants run
after every step. The model predicts *constraints* (which jobs may never succeed, which bytes are settled, when
release must or must not happen), never timing.

Every rule ``note()``-s the Python line that repeats it on a real worker (``w`` is the worker, ``dev`` the
device) and appends it to a script that starts with the lines rebuilding the setup; when a run fails, the whole
script is noted as one block, so a failing example prints a runnable reproduction.

The release policy: ``on_unproven="release"`` reproduces vLLM #51622 and *accepts* use-after-free when memory
could not be proven idle. The machine therefore accepts sim violations under that policy only once shutdown
(or the finalizer) ran, and only when the report admits that the device-level proof did not succeed
(``device_sync`` "timeout" or "failed"; for a dropped worker: when the model could not predict a release).
Those are counted as ``hazards``. Any violation under "quarantine", or before shutdown, fails.

Use :func:`make_machine` to check another implementation; ``OffloadingMachine`` checks kvoffload_ref itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar, Final

import numpy as np
import numpy.typing as npt
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvoffload_ref.backends.base import RESOURCE_KINDS
from kvoffload_ref.backends.sim import SimHang
from kvoffload_ref.errors import DeadlineExceeded, DeviceError, InvalidTransferError, WorkerClosedError
from kvoffload_ref.faults import TRANSFER_HANG_POINTS
from kvoffload_ref.layout import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload_ref.testing.adapter import (
    Capabilities,
    Firing,
    ReportLike,
    ResultLike,
    Setup,
    SimDevice,
    WorkerFactory,
    WorkerLike,
    initial_gpu_bytes,
    reference_factory,
)
from kvoffload_ref.testing.model import Model, ModelTransfer
from kvoffload_ref.testing.shutdown import (
    MARGIN,
    SLACK,
    Expectations,
    expectations,
    interrupted_problems,
    report_problems,
)
from kvoffload_ref.testing.strategies import (
    INVALID_CASES,
    InvalidTransfer,
    faults,
    invalid_transfers,
    setups,
    transfer_specs,
)

__all__ = ["MARGIN", "SLACK", "ConformanceError", "Counters", "OffloadingMachine", "make_machine"]

CLOCK_STEPS: Final = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0)
COMPUTE_DELAYS: Final = (0.0, 1e-6, 1e-4, 1e-3, 0.02, 0.3)
WAIT_TIMEOUTS: Final = (0.0, 1e-4, 1e-3, 0.05, 0.5)
#: Faults whose job_id, if any, is a slot (0-7) the machine maps to one of the next or pending jobs.
FAULT_SLOTS: Final = faults(range(8))


@dataclasses.dataclass
class Counters:
    """What a machine class has done, over all its runs (the CI summary and the campaign's progress line)."""

    runs: int = 0
    workers: int = 0
    steps: int = 0
    open_steps: int = 0
    submitted: int = 0
    succeeded: int = 0
    failed: int = 0
    faults_injected: int = 0
    faults_fired: int = 0
    data_checks: int = 0
    shutdowns: int = 0
    drops: int = 0
    interrupts: int = 0
    quarantined: int = 0
    hazards: int = 0
    violations: int = 0
    first_failure_step: int = 0

    def line(self) -> str:
        """A one-line summary."""
        return " ".join(f"{field.name}={getattr(self, field.name)}" for field in dataclasses.fields(self))


class ConformanceError(AssertionError):
    """An observation contradicts a rule; the message names the rule ids."""


class OffloadingMachine(RuleBasedStateMachine):
    """Drives one worker (built by ``worker_factory``) on the kit's simulated device; see the module docstring.

    Class attributes (set by :func:`make_machine`):
        worker_factory: builds the implementation under test.
        factory_name: how the reproduction header names the factory.
        setup_strategy: what setups are drawn.
        capabilities: optional behaviours of the implementation.
        counters: totals over every run of this class.
    """

    worker_factory: ClassVar[tuple[WorkerFactory]] = (reference_factory,)
    factory_name: ClassVar[str] = "reference_factory"
    setup_strategy: ClassVar[st.SearchStrategy[Setup]] = setups()
    capabilities: ClassVar[Capabilities] = Capabilities()
    counters: ClassVar[Counters] = Counters()

    def __init__(self) -> None:
        super().__init__()
        self.setup: Setup | None = None
        self.dev: SimDevice | None = None
        self.worker: WorkerLike | None = None
        self.model: Model | None = None
        self.report: ReportLike | None = None
        # Invariant: "new" -> "open" -> "closed" (shutdown) | "dropped" (finalizer); "refused" (construction failed).
        self.phase = "new"
        # Invariant: True once a check or a call failed; teardown then only cleans up.
        self.failed = False
        self.lifetime = 0
        self.age = 0
        self.next_job = 1
        self.seen_firings = 0
        self.hazard_counted = False
        self.specs: st.SearchStrategy[tuple[GPULoadStoreSpec, CPULoadStoreSpec]] = st.nothing()
        self.invalid: dict[bool, st.SearchStrategy[InvalidTransfer]] = {}
        # Invariant: the reproduction so far, one Python line per entry; noted once, when the run fails.
        self.script: list[str] = []
        self.script_noted = False
        type(self).counters.runs += 1

    # -- helpers ------------------------------------------------------------------------------------------------
    @property
    def w(self) -> WorkerLike:
        assert self.worker is not None
        return self.worker

    @property
    def d(self) -> SimDevice:
        assert self.dev is not None
        return self.dev

    @property
    def m(self) -> Model:
        assert self.model is not None
        return self.model

    @property
    def s(self) -> Setup:
        assert self.setup is not None
        return self.setup

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        """Count one step; an exception marks the run failed (so teardown does not pile errors on it)."""
        counters = type(self).counters
        counters.steps += 1
        counters.open_steps += self.phase == "open"
        self.age += 1
        try:
            yield
        except (Exception, SimHang):
            self._fail()
            raise
        except BaseException:  # Hypothesis' own control flow (an example cut short): not a failure
            self.failed = True
            raise

    def _say(self, line: str) -> None:
        """Note a line and append it to the reproduction script."""
        note(line)
        self.script.append(line)

    def _raised(self, error: str) -> None:
        """The call the script's last line makes raised ``error`` as allowed: wrap it so the script runs on."""
        last = self.script[-1].replace("\n", "\n    ")
        self.script[-1] = f"try:\n    {last}\nexcept {error}:\n    pass"
        note(f"# -> {error}")

    def _fail(self) -> None:
        """Mark the run failed and note the reproduction script (once)."""
        self.failed = True
        counters = type(self).counters
        counters.first_failure_step = counters.first_failure_step or counters.steps
        if not self.script_noted:
            self.script_noted = True
            note("# Reproduction (runnable Python):\n" + "\n".join(self.script))

    def _check(self, ok: bool, rules: str, message: str) -> None:
        if not ok:
            self._fail()
            raise ConformanceError(f"{rules}: {message}")

    def _fresh_job(self) -> int:
        job, self.next_job = self.next_job, self.next_job + 1
        return job

    def _new_firings(self) -> list[Firing]:
        firings = self.d.plan.firings[self.seen_firings:]
        self.seen_firings += len(firings)
        type(self).counters.faults_fired += len(firings)
        return firings

    def _absorb(self, firings: Sequence[Firing]) -> None:
        """Tell the model about errors that fired on transfers' end events (R5: they and those behind fail)."""
        for firing in firings:
            if firing.fault.kind == "error" and firing.point in ("event_query", "event_sync") and firing.tag:
                direction, job_id = firing.tag
                self.m.error_fired(direction, job_id)

    def _stats(self) -> object:
        return self.w.stats() if self.capabilities.stats else None

    def _open(self) -> bool:
        return self.phase == "open"

    # -- initialize ---------------------------------------------------------------------------------------------
    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        """Draw a setup, build the device and the worker (R1/R2 when construction fails)."""
        with self._step():
            self.next_job = data.draw(st.sampled_from((1, 1, 1000)), label="first job id")
            self._say("import gc\nfrom kvoffload_ref import *\nfrom kvoffload_ref.testing import *")
            self._start(data)

    @precondition(lambda self: self.phase in ("closed", "dropped", "refused"))
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        """The worker is gone (shut down, dropped or never built): build a new one on a new device."""
        with self._step():
            self._start(data)

    def _start(self, data: st.DataObject) -> None:
        setup = self.setup = data.draw(self.setup_strategy, label="setup")
        self.lifetime = data.draw(st.one_of(st.integers(0, 8), st.integers(0, 60)), label="lifetime")
        self.age, self.seen_firings, self.hazard_counted = 0, 0, False
        self.worker, self.model, self.report = None, None, None
        type(self).counters.workers += 1
        self._say(f"setup = {setup!r}")
        self._say(f"dev = SimDevice(setup)\nw = {self.factory_name}(dev.backend, dev.gpu, setup)")
        self.specs = transfer_specs(setup.layout, setup.blocks_per_chunk, setup.num_gpu_blocks,
                                    setup.num_cpu_chunks)
        self.invalid = {
            flight: invalid_transfers(setup.layout, setup.blocks_per_chunk, setup.num_gpu_blocks,
                                      setup.num_cpu_chunks,
                                      cases=[c for c in INVALID_CASES if flight or c != "job id in flight"])
            for flight in (False, True)}
        self.dev = SimDevice(setup)
        try:
            self.worker = self.worker_factory[0](self.d.backend, self.d.gpu, setup)
        except DeviceError:
            self._raised("DeviceError")
            self._new_firings()
            self.phase = "refused"
            self._check(self.d.ledger.live() == {}, "R2", f"construction failed but left {self.d.ledger.live()} live")
            return
        self._new_firings()
        self.phase = "open"
        pages = setup.layout.tensor_page_bytes
        self.model = Model(setup.layout, setup.blocks_per_chunk, setup.num_gpu_blocks, setup.num_cpu_chunks,
                           [initial_gpu_bytes(setup, t)[:, :p] for t, p in enumerate(pages)],
                           [np.asarray(a) for a in self.w.cpu_snapshot()])

    # -- transfers ----------------------------------------------------------------------------------------------
    @precondition(_open)
    @rule(data=st.data())
    def submit_store(self, data: st.DataObject) -> None:
        """Submit a valid store (R4: ordered after the compute work and the previous store)."""
        with self._step():
            self._submit("store", data)

    @precondition(_open)
    @rule(data=st.data())
    def submit_load(self, data: st.DataObject) -> None:
        """Submit a valid load (R4: ordered after the compute work and the previous load, not the stores)."""
        with self._step():
            self._submit("load", data)

    def _submit(self, direction: str, data: st.DataObject) -> None:
        gpu, cpu = data.draw(self.specs, label="specs")
        job = self._fresh_job()
        src, dst = (gpu, cpu) if direction == "store" else (cpu, gpu)
        self._say(f"w.submit_{direction}({job}, {src!r}, {dst!r})")
        live = self.d.ledger.live()
        submit = self.w.submit_store if direction == "store" else self.w.submit_load
        try:
            submit(job, src, dst)  # type: ignore[arg-type]
        except DeviceError:
            self._raised("DeviceError")
            firings = self._new_firings()
            if any(f.fault.kind == "hang" and f.tag == (direction, job) for f in firings):
                self.m.tainted.add(direction)
            after = self.d.ledger.live()
            self._check(all(n <= live.get(kind, 0) for kind, n in after.items()), "R16",
                        f"a failed submission left resources live: {live} -> {after}")
            self._absorb(firings)
            return
        firings = self._new_firings()
        hung = any(f.fault.kind == "hang" and f.point in TRANSFER_HANG_POINTS and f.tag == (direction, job)
                   for f in firings)
        self.m.submit(direction, job, gpu, cpu, hung=hung)  # type: ignore[arg-type]
        self._absorb(firings)
        type(self).counters.submitted += 1

    @precondition(_open)
    @rule(data=st.data())
    def submit_invalid(self, data: st.DataObject) -> None:
        """R7: an invalid submission raises InvalidTransferError before any device work and changes nothing."""
        with self._step():
            bad = data.draw(self.invalid[bool(self.m.pending())], label="invalid")
            job: object = bad.job
            if job == "fresh":
                job = self.next_job
            elif job == "in_flight":
                job = data.draw(st.sampled_from([t.job_id for t in self.m.pending()]), label="job in flight")
            src_text, dst_text = bad.specs_text()
            self._say(f"w.submit_{bad.direction}({job!r}, {src_text}, {dst_text})  # R7: {bad.case}")
            self._raised("InvalidTransferError")
            stats, live, clock, fired = self._stats(), self.d.ledger.live(), self.d.clock(), len(self.d.plan.fired)
            try:
                src, dst = bad.build()
                submit = self.w.submit_store if bad.direction == "store" else self.w.submit_load
                submit(job, src, dst)  # type: ignore[arg-type]
            except InvalidTransferError as exc:
                self._check(isinstance(exc, ValueError), "R7", "InvalidTransferError must be a ValueError")
            else:
                self._check(False, "R7", f"accepted an invalid submission ({bad.case})")
            self._check(self._stats() == stats and self.d.ledger.live() == live and self.d.clock() == clock,
                        "R7", f"a refused submission ({bad.case}) changed the worker or the device")
            self._check(len(self.d.plan.fired) == fired, "R7",
                        f"a refused submission ({bad.case}) made device calls (a fault fired)")

    @precondition(_open)
    @rule()
    def get_finished(self) -> None:
        """R5: each job once, per direction in submission order, success only if proven; never blocks."""
        with self._step():
            self._say("print(w.get_finished())")
            clock = self.d.clock()
            results = list(self.w.get_finished())
            self._check(self.d.clock() == clock, "R5", "get_finished() blocked (the virtual clock moved)")
            self._absorb(self._new_firings())
            for result in results:
                self._check_result(result)
            reported = {r.job_id for r in results}
            missing = {j for j in self.m.awaited if self.m.transfers[j].status == "pending"} - reported
            self._check(not missing, "R6", f"wait() returned for jobs {sorted(missing)} but get_finished() did "
                                           "not report them")
            self.m.awaited.clear()
            self._check_memory()

    def _check_result(self, result: ResultLike) -> None:
        m = self.m
        job = result.job_id
        self._say(f"# -> ({job}, success={result.success})")
        transfer = m.transfers.get(job)
        self._check(transfer is not None, "R5", f"reported job {job}, which was never (successfully) submitted")
        assert transfer is not None
        self._check(transfer.status == "pending", "R5", f"job {job} reported twice")
        self._check(transfer.index > m.last_reported[transfer.direction], "R5",
                    f"{transfer.direction} job {job} reported out of submission order")
        if result.success:
            self._check_success(transfer, result)
        else:
            cause = transfer.must_fail or self.d.lost() or bool(self.d.violations())
            self._check(cause, "R5", f"job {job} reported failed although nothing failed")
        counters = type(self).counters
        counters.succeeded += result.success
        counters.failed += not result.success
        m.resolve(transfer, result.success)

    def _check_success(self, transfer: ModelTransfer, result: ResultLike) -> None:
        job = transfer.job_id
        self._check(not transfer.hung, "R5", f"job {job} reported success although a hang selected it: its "
                                             "completion can never be proven")
        self._check(not transfer.blocked, "R4/R5", f"job {job} reported success although it is queued behind a "
                                                   "hung transfer of its direction")
        self._check(not transfer.must_fail, "R5", f"job {job} reported success although an injected error fired "
                                                  "on its end event (or on the one it was queued behind)")
        self._check(result.transfer_size == transfer.nbytes, "R5",
                    f"job {job} reported {result.transfer_size} bytes, expected {transfer.nbytes}")

    def _check_memory(self) -> None:
        """R4/R5: every settled byte (GPU, and the CPU region) holds what the model says it holds."""
        type(self).counters.data_checks += 1
        if not self.d.lost():
            try:
                gpu = self.d.read_gpu()
            except DeviceError:
                gpu = []
            for t, actual in enumerate(gpu):
                self._compare("gpu", t, actual)
        for t, actual in enumerate(self.w.cpu_snapshot()):
            self._compare("cpu", t, np.asarray(actual))

    def _compare(self, side_name: str, tensor: int, actual: npt.NDArray[np.uint8]) -> None:
        side = self.m.sides[side_name]
        where = side.mismatch(tensor, actual)
        if where is not None:
            row, col = where
            self._check(False, "R4/R5", f"{side_name} tensor {tensor} row {row} byte {col} holds "
                                        f"{int(actual[row, col])}, expected {int(side.value[tensor][row, col])} "
                                        f"(last written by {self.m.writer(side_name, tensor, row, col)})")

    @precondition(_open)
    @rule(data=st.data())
    def wait(self, data: st.DataObject) -> None:
        """R6: wait blocks until the listed jobs are proven or failed; DeadlineExceeded when the time is up."""
        with self._step():
            m = self.m
            pending = [t.job_id for t in m.pending()]
            others = [*(j for j, t in m.transfers.items() if t.status != "pending"), self.next_job + 50]
            ids = data.draw(st.lists(st.sampled_from(pending + others), max_size=4, unique=True), label="ids")
            listed = [m.transfers[j] for j in ids if j in m.transfers and m.transfers[j].status == "pending"]
            unbounded_ok = all(m.can_finish(t) for t in listed)
            timeout = data.draw(st.sampled_from(((None,) if unbounded_ok else ()) + WAIT_TIMEOUTS), label="timeout")
            self._wait(ids, listed, timeout)

    def _wait(self, ids: list[int], listed: list[ModelTransfer], timeout: float | None) -> None:
        m = self.m
        self._say(f"w.wait({ids!r}, timeout={timeout!r})")
        start = self.d.clock()
        busy = m.compute_busy_until
        try:
            self.w.wait(ids, timeout)
            expired = False
        except DeadlineExceeded:
            self._raised("DeadlineExceeded")
            expired = True
        except SimHang:
            self._check(False, "R6", f"wait({ids}) without a timeout hung on jobs the model says can finish")
        elapsed = self.d.clock() - start
        self._absorb(self._new_firings())
        if timeout is not None:
            self._check(elapsed <= timeout + SLACK, "R6/R11", f"wait(timeout={timeout}) took {elapsed} s")
        if expired:
            self._check(timeout is not None and self.d.clock() >= start + timeout, "R6",
                        f"DeadlineExceeded after {elapsed} s with timeout={timeout}")
            can = all(m.can_finish(t) for t in listed)
            enough = timeout is not None and timeout >= max(busy - start, 0.0) + MARGIN
            self._check(not (can and enough), "R6", f"DeadlineExceeded although jobs {ids} could all finish "
                                                    f"within timeout={timeout}")
            return
        resolvable = self.d.lost() or bool(self.d.violations())  # every query fails now: jobs resolve as failed
        for t in listed:
            if t.status == "pending" and not t.must_fail and not resolvable:
                self._check(not t.stuck, "R6", f"wait() returned although job {t.job_id} can never be proven")
        m.awaited.update(t.job_id for t in listed if t.status == "pending")

    # -- the device ---------------------------------------------------------------------------------------------
    @rule(seconds=st.sampled_from(CLOCK_STEPS))
    def advance_clock(self, seconds: float) -> None:
        """Let virtual time pass: queued work runs (never a rule violation by itself)."""
        with self._step():
            if self.dev is None:
                return
            self._say(f"dev.advance({seconds!r})")
            self.d.advance(seconds)

    @precondition(lambda self: self.phase == "open" and not self.d.lost())
    @rule(data=st.data())
    def compute_write(self, data: st.DataObject) -> None:
        """Queue a compute-stream kernel writing whole GPU rows (R4: later transfers wait for it)."""
        with self._step():
            s = self.s
            tensor = data.draw(st.integers(0, s.layout.num_tensors - 1), label="tensor")
            rows = data.draw(st.lists(st.integers(0, s.num_gpu_blocks - 1), min_size=1, max_size=3, unique=True),
                             label="rows")
            value = data.draw(st.integers(0, 255), label="value")
            delay = data.draw(st.sampled_from(COMPUTE_DELAYS), label="delay")
            self._say(f"dev.compute_write({tensor}, {rows!r}, {value}, {delay!r})")
            self.m.compute_write(tensor, rows, value, delay, self.d.clock())
            self.d.compute_write(tensor, rows, value, delay)

    @precondition(_open)
    @rule(data=st.data())
    def inject_fault(self, data: st.DataObject) -> None:
        """Arm one more fault mid-run (aimed at the next jobs or at pending ones)."""
        with self._step():
            targets = [self.next_job + k for k in range(4)] + [t.job_id for t in self.m.pending()][-4:]
            fault = data.draw(FAULT_SLOTS, label="fault")
            if fault.job_id is not None:  # a slot: aim it at one of the next or pending jobs
                fault = dataclasses.replace(fault, job_id=targets[fault.job_id % len(targets)])
            self._say(f"dev.plan.add({fault!r})")
            self.d.plan.add(fault)
            type(self).counters.faults_injected += 1

    # -- shutdown -----------------------------------------------------------------------------------------------
    @precondition(lambda self: self.phase == "open" and self.age >= self.lifetime)
    @rule()
    def shutdown(self) -> None:
        """R8-R16: a bounded shutdown whose report and ledger agree with what the model knows."""
        with self._step():
            self._say("report = w.shutdown()")
            self._shutdown()

    def _shutdown(self) -> None:
        """Shut the worker down and check the report (the rule, and teardown)."""
        expect = expectations(self.m, self.d, self.s.policy)
        start = self.d.clock()
        report = self._call_shutdown()
        self._absorb(self._new_firings())
        self.report, self.phase = report, "closed"
        note(f"# -> region={report.region!r}, device_sync={report.device_sync!r}")
        self._check_report(report, start, expect)

    @precondition(lambda self: self.phase == "open" and self.age >= self.lifetime
                  and self.capabilities.interrupts)
    @rule(queries=st.integers(1, 4))
    def interrupt_shutdown(self, queries: int) -> None:
        """R14: a KeyboardInterrupt during shutdown stops all waiting, quarantines what was not proven idle, and
        propagates; a later shutdown() returns that report, marked interrupted."""
        with self._step():
            self._say(f"dev.interrupt_after({queries})\nreport = w.shutdown()")
            expect = expectations(self.m, self.d, self.s.policy)
            start = self.d.clock()
            self.d.interrupt_after(queries)
            try:
                report = self._call_shutdown()
            except KeyboardInterrupt:
                self._raised("KeyboardInterrupt")
                self._say("report = w.shutdown()")
                elapsed = self.d.clock() - start
                report = self._call_shutdown()
                self._absorb(self._new_firings())
                self.report, self.phase = report, "closed"
                type(self).counters.interrupts += 1
                for rules, message in interrupted_problems(report, device=self.d, policy=self.s.policy,
                                                           elapsed=elapsed):
                    self._check(False, rules, message)
                return
            finally:
                self.d.disarm()
            self._check(not self.d.interrupted, "R14", "shutdown() swallowed a KeyboardInterrupt")
            self._absorb(self._new_firings())  # the interrupt never came: nothing was waited for
            self.report, self.phase = report, "closed"
            self._check_report(report, start, expect)

    def _call_shutdown(self) -> ReportLike:
        try:
            return self.w.shutdown()
        except SimHang as exc:
            self._fail()
            raise ConformanceError("R11: shutdown() made an unbounded blocking wait (SimHang)") from exc
        except Exception as exc:
            self._fail()
            raise ConformanceError(f"R9: shutdown() raised {exc!r}: teardown must not stop on an "
                                   "Exception") from exc

    def _check_report(self, report: ReportLike, start: float, expect: Expectations) -> None:
        counters = type(self).counters
        counters.shutdowns += 1
        counters.quarantined += report.region == "quarantined"
        for rules, message in report_problems(report, model=self.m, device=self.d, policy=self.s.policy,
                                              elapsed=self.d.clock() - start, expect=expect):
            self._check(False, rules, message)

    @precondition(lambda self: self.phase == "closed")
    @rule()
    def shutdown_again(self) -> None:
        """R8: a second shutdown does nothing and returns the first call's report."""
        with self._step():
            self._say("w.shutdown()  # again")
            clock = self.d.clock()
            again = self.w.shutdown()
            self._check(again == self.report and self.d.clock() == clock, "R8",
                        "a second shutdown() did something or returned another report")

    @precondition(lambda self: self.phase == "closed")
    @rule(data=st.data())
    def use_after_shutdown(self, data: st.DataObject) -> None:
        """R8: after shutdown submissions raise WorkerClosedError, get_finished is [], wait returns at once."""
        with self._step():
            gpu, cpu = data.draw(self.specs, label="specs")
            job = self._fresh_job()
            clock, fired = self.d.clock(), len(self.d.plan.fired)
            for direction, src, dst in (("store", gpu, cpu), ("load", cpu, gpu)):
                self._say(f"w.submit_{direction}({job}, {src!r}, {dst!r})  # R8")
                self._raised("WorkerClosedError")
                submit = self.w.submit_store if direction == "store" else self.w.submit_load
                try:
                    submit(job, src, dst)  # type: ignore[arg-type]
                except WorkerClosedError:
                    pass
                else:
                    self._check(False, "R8", f"submit_{direction} accepted after shutdown")
            ids = [*[t.job_id for t in self.m.pending()][:3], job]
            self._say(f"assert w.get_finished() == []; w.wait({ids!r})  # R8")
            self._say("w.cpu_snapshot()")
            self._raised("WorkerClosedError")
            self._check(list(self.w.get_finished()) == [], "R8", "get_finished() after shutdown is not []")
            self.w.wait(ids, None)
            with contextlib.suppress(WorkerClosedError):
                self.w.cpu_snapshot()
                self._check(False, "R8", "cpu_snapshot() after shutdown did not raise WorkerClosedError")
            self._check(self.d.clock() == clock and len(self.d.plan.fired) == fired, "R8",
                        "a call after shutdown touched the device")

    @precondition(lambda self: self.phase == "open" and self.age >= self.lifetime
                  and self.capabilities.finalizer)
    @rule()
    def drop_worker(self) -> None:
        """R15: a worker dropped without shutdown() is shut down by its finalizer under the same rules.

        A worker held by a reference cycle is collected here, explicitly: left to the cyclic garbage collector,
        its finalizer could run at any allocation -- inside a ledger method holding the ledger's lock, which the
        finalizer's shutdown needs (test_testing_found_bugs.py has that deadlock).
        """
        with self._step():
            self._say("del w; gc.collect()")
            expect = expectations(self.m, self.d, self.s.policy)
            start = self.d.clock()
            try:
                alive: Callable[[], object] = weakref.ref(self.w)
            except TypeError:  # no weak references to it: assume a cycle may hold it
                alive = bool
            self.worker = None
            if alive() is not None:  # a reference cycle holds it: collect it now, at a safe point (see below)
                gc.collect()
            self._absorb(self._new_firings())
            self.phase = "dropped"
            type(self).counters.drops += 1
            ledger = self.d.ledger
            self._check(ledger.live() == {}, "R15/R16", f"live after the worker was dropped: {ledger.live()}")
            elapsed = self.d.clock() - start
            self._check(elapsed <= self.s.policy.timeout + SLACK, "R11/R15", f"the finalizer took {elapsed} s")
            kept = "mapping" in ledger.quarantined()
            if self.s.policy.on_unproven == "quarantine" and expect.must_quarantine:
                self._check(kept, "R12/R15", "the finalizer released a region a hung transfer may touch")
            if expect.must_release:
                self._check(not kept, "R12/R15", "the finalizer quarantined a region that could be proven idle")

    # -- invariants and teardown --------------------------------------------------------------------------------
    @invariant()
    def no_violation(self) -> None:
        """R3/R10/R12: no copy ever touched released memory (the sim's log is empty); see the module docstring
        for the release policy's accepted hazards."""
        if self.dev is None or not self.dev.violations():
            return
        if self._hazard_accepted():
            return
        type(self).counters.violations += 1
        self._check(False, "R3/R10/R12", f"the simulated device saw misuse: {self.d.violations()}")

    def _hazard_accepted(self) -> bool:
        if self.s.policy.on_unproven != "release" or self.phase not in ("closed", "dropped"):
            return False
        if self.report is not None and self.report.device_sync not in ("timeout", "failed"):
            return False
        if not self.hazard_counted:
            self.hazard_counted = True
            type(self).counters.hazards += 1
        return True

    @invariant()
    def ledger_balances(self) -> None:
        """R16: per kind, acquired == released + live + quarantined + leaked; after shutdown nothing is live."""
        if self.dev is None:
            return
        ledger = self.d.ledger
        acquired, released = ledger.acquired(), ledger.released()
        live, kept, leaked = ledger.live(), ledger.quarantined(), ledger.leaked()
        for kind in RESOURCE_KINDS:
            total = released.get(kind, 0) + live.get(kind, 0) + kept.get(kind, 0) + leaked.get(kind, 0)
            self._check(acquired.get(kind, 0) == total, "R16", f"ledger does not balance for {kind}")
        if self.phase in ("closed", "dropped", "refused"):
            self._check(live == {}, "R16", f"live after shutdown: {live}")

    def teardown(self) -> None:
        """Always shut down (checked like the rule unless the run already failed) and check the ledger (R16)."""
        if self.phase == "open" and self.worker is not None:
            if self.failed:  # only clean up: the run already reported its failure
                with contextlib.suppress(Exception, SimHang):
                    self.worker.shutdown()
                return
            self._say("report = w.shutdown()  # teardown")
            self._shutdown()
        if not self.failed and self.dev is not None:
            self.no_violation()
            self.ledger_balances()


def make_machine(worker_factory: WorkerFactory = reference_factory, *, name: str = "OffloadingMachine",
                 factory_name: str | None = None, setup_strategy: st.SearchStrategy[Setup] | None = None,
                 capabilities: Capabilities | None = None) -> type[OffloadingMachine]:
    """A machine class checking the implementation ``worker_factory`` builds.

    Args:
        worker_factory: (backend, GPU tensors, setup) -> a worker (see ``adapter.WorkerLike``).
        name: the class name (shown in failures).
        factory_name: how the reproduction names the factory (default: its ``__name__``).
        setup_strategy: setups to draw (default: ``strategies.setups()``).
        capabilities: optional behaviours the implementation has.

    Returns:
        A new subclass of :class:`OffloadingMachine` with its own ``counters``; ``.TestCase`` runs it in pytest.
    """
    attrs = {
        "worker_factory": (worker_factory,),
        "factory_name": factory_name or getattr(worker_factory, "__name__", "factory"),
        "setup_strategy": setup_strategy if setup_strategy is not None else setups(),
        "capabilities": capabilities or Capabilities(),
        "counters": Counters(),
    }
    return type(name, (OffloadingMachine,), attrs)
