"""The conformance machine's concurrent-shutdown rule (R19, R8): ``shutdown()`` from a second thread while the
machine's thread is inside a submission or a wait, interleaved deterministically at a chosen backend call.

Three interleavings are drawn; each pauses one thread at a backend call through the sim's ``on_call`` hook
(:class:`~kvoffload_ref.testing.threads.CallPause`) and lets the other act meanwhile, with no sleep:

* ``submit, then shutdown``: the machine's thread is paused at its submission's copy (a copy once queued cannot
  be taken back, so the submission is under way); a second thread calls ``shutdown()``; the pause is released.
  R19: the submission was queued whole before shutdown began (it returns, and is drained like any other) or
  was refused with WorkerClosedError.
* ``shutdown, then submit``: the second thread's shutdown is paused at its first backend call (shutdown has
  begun); the machine's thread submits: R19 allows only WorkerClosedError (nothing queued).
* ``wait, then shutdown``: the machine's thread waits for pending jobs and is paused at its first sleep (R19: no
  library lock is held there); the second thread's shutdown must finish meanwhile; then the wait must return,
  reporting nothing, without raising.

Afterwards the machine's thread calls ``shutdown()`` itself: it must return the same report (R8/R19). The
report, the ledger and the quarantine are checked as after any shutdown (R9-R16), except for the model's
predictions of the region's fate (which need the clock at shutdown's start, and a wait paused mid-poll moves
it): the policy's consistency, the drain counts, the ledger and the job list (R22: every accepted job once, the
concurrent submission included when it was queued) are checked.

The reproduction runs the threads' calls one after the other (its comments say where each thread paused): the
checks that hold in that order too close it as assertions (the report and the ledger, a submission after the
shutdown refused, R28's stream); those that only the pause can break (a call that never returned, a submission
refused although its copy was queued, a wait that raised while another thread shut down) have no Python form
there: it ends in ``raise AssertionError`` and the kit's run confirms a fix.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvoffload_ref.errors import BlocksHeldError, DeviceError, SimHang, WorkerClosedError
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload_ref.testing.adapter import ReportLike
from kvoffload_ref.testing.machine_base import ConformanceError, MachineBase
from kvoffload_ref.testing.model import plan_moves
from kvoffload_ref.testing.outcomes import settled_jobs
from kvoffload_ref.testing.shutdown import Expectations, report_problems
from kvoffload_ref.testing.threads import CallPause, Runner, paused_or_done

__all__ = ["INTERLEAVINGS", "ConcurrentRules"]

#: The interleavings the rule draws (see the module docstring).
INTERLEAVINGS = ("submit, then shutdown", "shutdown, then submit", "wait, then shutdown")
SHUTDOWN_THREAD = "kit-shutdown"
#: No prediction of the region's fate (see the module docstring).
_NO_PREDICTION = Expectations(must_release=False, must_quarantine=False, clean=False, unclean=False)


class ConcurrentRules(MachineBase):
    """Rule: concurrent_shutdown.

    A mixin over :class:`~kvoffload_ref.testing.machine_base.MachineBase`, composed with the others in
    :class:`~kvoffload_ref.testing.machine.OffloadingMachine`; it shuts down through
    :class:`~kvoffload_ref.testing.shutdown_rules.ShutdownRules` and checks through
    :class:`~kvoffload_ref.testing.invariants.Checks` (declared below for the type checker only).
    """

    if TYPE_CHECKING:  # from ShutdownRules, Checks and TransferRules
        def _call_shutdown(self) -> ReportLike: ...
        def _held_conflict(self, direction: str, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec) -> str | None: ...
        def _check_outcomes(self, report: ReportLike, settled: frozenset[int], *, proven_in_time: bool) -> None: ...

    @precondition(lambda self: self.phase == "open" and self.age >= self.lifetime and self.capabilities.threads)
    @rule(data=st.data(), interleaving=st.sampled_from(INTERLEAVINGS))
    def concurrent_shutdown(self, data: st.DataObject, interleaving: str) -> None:
        """R19/R8: shutdown() from a second thread while this thread submits or waits (see the module
        docstring)."""
        with self._step():
            if interleaving != "wait, then shutdown" and self.current_setup.schedule == "ordered":
                interleaving = "wait, then shutdown"  # a submission here is not ordered against pending work
            start = self.current_device.clock()
            settled = settled_jobs(self.current_model)
            self.current_race  # noqa: B018  # take the observations made so far
            if interleaving == "wait, then shutdown":
                report = self._wait_then_shutdown()
            else:
                report = self._submit_and_shutdown(data, interleaving)
            if report is None:
                return
            self._absorb(self._new_firings())
            self._say("assert w.shutdown() == report  # R8/R19: the same report")
            again = self._call_shutdown()
            self._check(again == report, "R8/R19", "shutdown() after a concurrent shutdown returned another report",
                        "w.shutdown() == report")
            self.report, self.phase = report, "closed"
            type(self).counters.shutdowns += 1
            type(self).counters.concurrent_shutdowns += 1
            problems = report_problems(report, model=self.current_model, device=self.current_device,
                                       policy=self.current_setup.policy, elapsed=self.current_device.clock() - start,
                                       expect=_NO_PREDICTION)
            # R11 is not checked here: a wait paused mid-poll moves the clock too
            self._problems(problem for problem in problems if not problem[0].startswith("R11"))
            self._check_outcomes(report, settled, proven_in_time=False)

    # -- the interleavings ------------------------------------------------------------------------------------
    def _shutdown_thread(self) -> Runner[ReportLike]:
        return Runner(self.current_worker.shutdown, SHUTDOWN_THREAD)

    def _joined(self, runner: Runner[ReportLike]) -> ReportLike | None:
        self._check(runner.join(), "R19", "the concurrent shutdown() did not return (deadlock?)")
        if runner.exception is not None:
            self._fail()
            rules = "R11/R19" if isinstance(runner.exception, SimHang) else "R9/R19"  # SimHang: an unbounded wait
            raise ConformanceError(f"{rules}: the concurrent shutdown() raised {runner.exception!r}") \
                from runner.exception
        return runner.result

    def _submit_and_shutdown(self, data: st.DataObject, interleaving: str) -> ReportLike | None:
        direction = data.draw(st.sampled_from(("store", "load")), label="direction")
        gpu, cpu = data.draw(self.specs, label="specs")
        job = self._fresh_job()
        src, dst = (gpu, cpu) if direction == "store" else (cpu, gpu)
        worker, sim = self.current_worker, self.current_device.sim
        submit = worker.submit_store if direction == "store" else worker.submit_load
        call = f"w.submit_{direction}({job}, {src!r}, {dst!r})"
        outcome: list[BaseException | None] = []

        refused = self._held_conflict(direction, gpu, cpu)  # R27: before shutdown began, as the submission sees it

        def submitting() -> None:
            try:
                submit(job, src, dst)  # type: ignore[arg-type]
                outcome.append(None)
            except (WorkerClosedError, DeviceError, BlocksHeldError) as exc:
                outcome.append(exc)

        if interleaving == "submit, then shutdown":
            self._say(f"# thread A: the submission, paused at its copy; thread B: shutdown(); A goes on\n{call}")
            self._raised("(WorkerClosedError, DeviceError, BlocksHeldError)")
            self._say("report = w.shutdown()")
            signal = threading.Event()
            at_copy = lambda point, tag: point == "copy" and tag == (direction, job)  # noqa: E731
            with CallPause(sim, at_copy, signal=signal) as pause:
                runner = Runner(submitting, "kit-submit", signal=signal)
                self._check(paused_or_done(signal), "R19", "a submission neither reached its copy nor returned")
                if not pause.reached.is_set():  # no copy (no bytes, or it failed first): nothing to race with
                    note("# (the submission made no copy: no pause)")
                shutdown = self._shutdown_thread()
                pause.release()
                self._check(runner.join(), "R19", "a submission paused at its copy never returned")
                report = self._joined(shutdown)
            copied = self.current_device.copied((direction, job))
            self._check(not (copied and isinstance(outcome[0], WorkerClosedError)), "R19",
                        "a submission was refused with WorkerClosedError although its copy was queued")
            held_error = isinstance(outcome[0], BlocksHeldError)
            self._check(held_error == (refused is not None and not isinstance(outcome[0], WorkerClosedError))
                        or (held_error and not self.running),
                        "R27", f"the submission ended {outcome[0]!r}; the holds say {refused or 'nothing'}")
        else:
            self._say(f"# thread B: shutdown(), paused at its first device call; thread A: the submission\n"
                      f"report = w.shutdown()\n{call}")
            self._outcome("WorkerClosedError")
            is_b = lambda point, tag: threading.current_thread().name == SHUTDOWN_THREAD  # noqa: E731
            signal = threading.Event()
            with CallPause(sim, is_b, signal=signal) as pause:
                shutdown = Runner(self.current_worker.shutdown, SHUTDOWN_THREAD, signal=signal)
                self._check(paused_or_done(signal), "R19", "the shutdown thread neither made a device call nor "
                                                           "returned")
                submitting()
                pause.release()
                report = self._joined(shutdown)
            self._check(isinstance(outcome[0], WorkerClosedError), "R8/R19",
                        f"a submission after shutdown began was not refused with WorkerClosedError: {outcome[0]!r}",
                        "isinstance(raised, WorkerClosedError)")  # run after the shutdown, it must be refused too
        self._settle_submission(direction, job, gpu, cpu, outcome[0])
        return report

    def _settle_submission(self, direction: str, job: int, gpu: object, cpu: object,
                           error: BaseException | None) -> None:
        """Tell the models what the concurrent submission did."""
        setup, dev = self.current_setup, self.current_device
        moves = plan_moves(setup.layout, setup.blocks_per_chunk, gpu, cpu)  # type: ignore[arg-type]
        note(f"# -> {error!r}")
        copied = dev.copied((direction, job))
        queued = copied or error is None
        lane = dev.streams.get((direction, job))
        if error is None:
            firings = dev.plan.firings[self.seen_firings:]
            hung = any(f.fault.kind == "hang" and f.tag == (direction, job) for f in firings)
            self._check_fresh_lane(direction, job, lane)
            self.current_model.submit(direction, job, gpu, cpu, hung=hung, lane=lane)  # type: ignore[arg-type]
            type(self).counters.submitted += 1
        elif queued:
            self.current_model.ghost(moves, direction)  # type: ignore[arg-type]
        if queued:
            assert self.race is not None
            index = dev.op_labels.index((direction, job)) if copied else None
            taken = dev.take_observations(before=index)
            for label in taken:
                self.race.observe(label)
            self.race.transfer(direction, job, moves, lane)
            if index is None:  # no copy: where it was queued among the observations is unknown; its own count
                for label in taken:
                    if label == (direction, job):
                        self.race.observe(label)

    def _wait_then_shutdown(self) -> ReportLike | None:
        ids = [t.job_id for t in self.current_model.pending()][:4]
        self._say(f"# thread A: the wait, paused at its first sleep; thread B: shutdown() runs to its end; A goes on\n"
                  f"w.wait({ids!r}, timeout=10.0)")
        self._raised("DeadlineExceeded")
        self._say("report = w.shutdown()")
        worker, sim = self.current_worker, self.current_device.sim
        outcome: list[BaseException | None] = []

        def waiting() -> None:
            try:
                worker.wait(ids, 10.0)
                outcome.append(None)
            except BaseException as exc:  # any exception is the finding
                outcome.append(exc)

        waiter_name = "kit-wait"
        in_a = lambda point, tag: point == "sleep" and threading.current_thread().name == waiter_name  # noqa: E731
        signal = threading.Event()
        with CallPause(sim, in_a, signal=signal) as pause:
            waiter = Runner(waiting, waiter_name, signal=signal)
            self._check(paused_or_done(signal), "R6", "a wait() neither slept nor returned")
            if not pause.reached.is_set():  # the wait returned without sleeping: shut down after it
                self._check(waiter.join(), "R6", "wait() did not return")
                note("# (the wait never slept: no pause)")
            report = self._joined(self._shutdown_thread())
            pause.release()
            self._check(waiter.join(), "R19", "a wait() blocked while another thread shut down never returned")
        self._check(outcome[0] is None, "R19", f"a wait() blocked while another thread shut down raised "
                                               f"{outcome[0]!r}; it must return, reporting nothing")
        return report
