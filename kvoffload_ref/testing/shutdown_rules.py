"""The conformance machine's rules for the end of a worker: shutdown (also interrupted), a second shutdown,
calls after shutdown, and a worker dropped without shutdown (its finalizer)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvoffload_ref.errors import SimHang, WorkerClosedError
from kvoffload_ref.testing.adapter import (
    ReportLike,
)
from kvoffload_ref.testing.machine_base import ConformanceError, MachineBase
from kvoffload_ref.testing.outcomes import settled_jobs
from kvoffload_ref.testing.reproduction import set_literal
from kvoffload_ref.testing.shutdown import (
    REGION_MEMORY,
    SLACK,
    Expectations,
    expectations,
    interrupted_problems,
    region_kept,
)

__all__ = ["ShutdownRules"]


class ShutdownRules(MachineBase):
    """Rules: shutdown, interrupt_shutdown, shutdown_again, use_after_shutdown, drop_worker.

    A mixin over :class:`~kvoffload_ref.testing.machine_base.MachineBase`, composed with the others in
    :class:`~kvoffload_ref.testing.machine.OffloadingMachine`; it uses the report check of
    :class:`~kvoffload_ref.testing.invariants.Checks` (declared below for the type checker only).
    """

    if TYPE_CHECKING:  # from Checks
        def _check_report(self, report: ReportLike, start: float, expect: Expectations,
                          settled: frozenset[int]) -> None: ...
        def _check_outcomes(self, report: ReportLike, settled: frozenset[int], *, proven_in_time: bool) -> None: ...
        def _absorb_releases(self) -> None: ...

    # -- shutdown -----------------------------------------------------------------------------------------------
    @precondition(lambda self: self.phase == "open" and self.age >= self.lifetime)
    @rule()
    def shutdown(self) -> None:
        """R8-R16: a bounded shutdown whose report and ledger agree with what the model knows."""
        with self._step():
            self._say("start = dev.clock()\nreport = w.shutdown()")
            self._shutdown()

    def _shutdown(self) -> None:
        """Shut the worker down and check the report (the rule, and teardown)."""
        expect = expectations(self.current_model, self.current_device, self.current_setup.policy)
        settled = settled_jobs(self.current_model)
        start = self.current_device.clock()
        report = self._call_shutdown()
        self._absorb(self._new_firings())
        self.report, self.phase = report, "closed"
        note(f"# -> region={report.region!r}, device_sync={report.device_sync!r}")
        self._check_report(report, start, expect, settled)

    @precondition(lambda self: self.phase == "open" and self.age >= self.lifetime
                  and self.capabilities.interrupts)
    @rule(queries=st.integers(1, 4))
    def interrupt_shutdown(self, queries: int) -> None:
        """R14: a KeyboardInterrupt during shutdown stops all waiting, quarantines what was not proven idle, and
        propagates; a later shutdown() returns that report, marked interrupted."""
        with self._step():
            self._say(f"start = dev.clock()\ndev.interrupt_after({queries})\nreport = w.shutdown()")
            self._outcome("KeyboardInterrupt")
            expect = expectations(self.current_model, self.current_device, self.current_setup.policy)
            settled = settled_jobs(self.current_model)
            start = self.current_device.clock()
            self.current_device.interrupt_after(queries)
            try:
                report = self._call_shutdown()
            except KeyboardInterrupt:
                note("# -> KeyboardInterrupt")
                self._say("elapsed = dev.clock() - start\nreport = w.shutdown()")
                elapsed = self.current_device.clock() - start
                report = self._call_shutdown()
                self._absorb(self._new_firings())
                self.report, self.phase = report, "closed"
                type(self).counters.interrupts += 1
                self._problems(interrupted_problems(report, device=self.current_device,
                                                    policy=self.current_setup.policy, elapsed=elapsed,
                                                    model=self.current_model))
                self._check_outcomes(report, settled, proven_in_time=False)
                return
            finally:
                self.current_device.disarm()
            self._check(not self.current_device.interrupted, "R14", "shutdown() swallowed a KeyboardInterrupt",
                        "raised is not None")
            self._absorb(self._new_firings())  # the interrupt never came: nothing was waited for
            self.report, self.phase = report, "closed"
            self._check_report(report, start, expect, settled)

    def _call_shutdown(self) -> ReportLike:
        try:
            report = self.current_worker.shutdown()
            if self.running and not self.failed:  # R27/R29: late copies the drain proved are released, not unproven
                self._absorb_releases()
            return report
        except SimHang as exc:
            self._fail()
            raise ConformanceError("R11: shutdown() made an unbounded blocking wait (SimHang)") from exc
        except Exception as exc:
            self._fail()
            raise ConformanceError(f"R9: shutdown() raised {exc!r}: teardown must not stop on an "
                                   "Exception") from exc

    @precondition(lambda self: self.phase == "closed")
    @rule()
    def shutdown_again(self) -> None:
        """R8: a second shutdown does nothing and returns the first call's report."""
        with self._step():
            self._say("clock = dev.clock()\nagain = w.shutdown()  # again")
            clock = self.current_device.clock()
            again = self.current_worker.shutdown()
            self._check(again == self.report and self.current_device.clock() == clock, "R8",
                        "a second shutdown() did something or returned another report",
                        "again == report and dev.clock() == clock")

    @precondition(lambda self: self.phase == "closed")
    @rule(data=st.data())
    def use_after_shutdown(self, data: st.DataObject) -> None:
        """R8: after shutdown submissions raise WorkerClosedError, get_finished is [], wait returns at once,
        order_after orders nothing and raises nothing (R23), nor does cancel (R26)."""
        with self._step():
            gpu, cpu = data.draw(self.specs, label="specs")
            job = self._fresh_job()
            clock, fired = self.current_device.clock(), len(self.current_device.plan.fired)
            for direction, src, dst in (("store", gpu, cpu), ("load", cpu, gpu)):
                self._say(f"w.submit_{direction}({job}, {src!r}, {dst!r})  # R8")
                self._outcome("WorkerClosedError")
                submit = self.current_worker.submit_store if direction == "store" else self.current_worker.submit_load
                try:
                    submit(job, src, dst)  # type: ignore[arg-type]
                except WorkerClosedError:
                    pass
                else:
                    self._check(False, "R8", f"submit_{direction} accepted after shutdown", "raised is not None")
            ids = [*[t.job_id for t in self.current_model.pending()][:3], job]
            ordering = self.capabilities.ordering
            self._say(f"assert w.get_finished() == []; w.wait({ids!r})  # R8"
                      + (f"\nw.order_after({ids!r})  # R23: orders nothing" if ordering else ""))
            self._say("w.cpu_snapshot()")
            self._outcome("WorkerClosedError")
            # the script asserts it where it calls it (above), and fails there
            self._check(list(self.current_worker.get_finished()) == [], "R8", "get_finished() after shutdown is not []",
                        "w.get_finished() == []")
            self.current_worker.wait(ids, None)
            if ordering:
                self.current_worker.order_after(ids)
            if self.running:  # R26: after shutdown a cancel does nothing and raises nothing
                self._say(f"w.cancel({ids!r})  # R26: does nothing")
                self.current_worker.cancel(ids)  # type: ignore[attr-defined]
            with contextlib.suppress(WorkerClosedError):
                self.current_worker.cpu_snapshot()
                self._check(False, "R8", "cpu_snapshot() after shutdown did not raise WorkerClosedError",
                            "raised is not None")
            self._check(self.current_device.clock() == clock and len(self.current_device.plan.fired) == fired, "R8",
                        "a call after shutdown touched the device",
                        f"dev.clock() == {clock!r} and len(dev.plan.fired) == {fired}")

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
            self._say("start = dev.clock()\ndel w; gc.collect()")
            expect = expectations(self.current_model, self.current_device, self.current_setup.policy)
            # R29: the region is kept only for a copy that moves bytes; a stuck one is certainly never proven
            stuck_touches = any(t.stuck and any(m.size for m in t.moves) for t in self.current_model.pending())
            start = self.current_device.clock()
            try:
                alive: Callable[[], object] = weakref.ref(self.current_worker)
            except TypeError:  # no weak references to it: assume a cycle may hold it
                alive = bool
            self.worker = None
            if alive() is not None:  # a reference cycle holds it: collect it now, at a safe point (see below)
                gc.collect()
            self._absorb(self._new_firings())
            self.phase = "dropped"
            type(self).counters.drops += 1
            ledger = self.current_device.ledger
            self._check(ledger.live() == {}, "R15/R16", f"live after the worker was dropped: {ledger.live()}",
                        "dev.ledger.live() == {}")
            elapsed = self.current_device.clock() - start
            timeout = self.current_setup.policy.timeout
            self._check(elapsed <= timeout + SLACK, "R11/R15", f"the finalizer took {elapsed} s",
                        f"dev.clock() - start <= {timeout + SLACK!r}")
            kept = region_kept(ledger.quarantined())
            if self.current_setup.policy.on_unproven == "quarantine" and expect.must_quarantine and stuck_touches:
                self._check(kept, "R12/R15", "the finalizer released a region a hung transfer may touch",
                            f"bool({set_literal(REGION_MEMORY)} & set(dev.ledger.quarantined()))")
            if expect.must_release:
                self._check(not kept, "R12/R15", "the finalizer quarantined a region that could be proven idle",
                            f"not {set_literal(REGION_MEMORY)} & set(dev.ledger.quarantined())")

