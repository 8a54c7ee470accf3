"""The conformance machine's checks: each result, memory against the model, shutdown reports, and the
invariants run after every step (no misuse seen by the device, the races the model predicts, the ledger
balances, every accepted job accounted for once).

Run after every step: :meth:`Checks.no_violation` (R3/R10/R12; the release policy's accepted hazards are
explained in :mod:`kvoffload_ref.testing.machine`), :meth:`Checks.races_match` (R4/R20/R23),
:meth:`Checks.ledger_balances` (R16), :meth:`Checks.jobs_accounted_once` (R14/R22) and, for a running engine,
:meth:`Checks.holds_match` (R27: each ``take_released()`` record, then ``held()``, against the model; see
:mod:`kvoffload_ref.testing.holds`). The shutdown report's job
list is checked against the model by :mod:`kvoffload_ref.testing.outcomes`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from hypothesis.stateful import invariant

from kvoffload_ref.backends.base import RESOURCE_KINDS
from kvoffload_ref.errors import DeviceError, TransferExpired
from kvoffload_ref.testing.adapter import (
    ReportLike,
    ResultLike,
    RunningLike,
)
from kvoffload_ref.testing.expiry import failure_problems
from kvoffload_ref.testing.holds import held_problems, held_sets, release_problems
from kvoffload_ref.testing.machine_base import MachineBase
from kvoffload_ref.testing.model import ModelTransfer
from kvoffload_ref.testing.outcomes import LISTED, accounting_problems, attribution_problems, outcome_problems
from kvoffload_ref.testing.reproduction import set_literal
from kvoffload_ref.testing.shutdown import (
    Expectations,
    report_problems,
)

__all__ = ["Checks"]


def _in_order(job: int, later: int) -> str:
    """R5/R28 in the script's terms: ``job`` is reported no later than ``later`` (submitted after it on its
    stream, reported earlier or in the same call): not in this call's results, or ahead of ``later`` in them."""
    ids = "[r.job_id for r in results]"
    return f"{job} not in {ids} or ({later} in {ids} and {ids}.index({job}) < {ids}.index({later}))"


class Checks(MachineBase):
    """What the rules check (results, memory, reports) and the invariants: a mixin over
    :class:`~kvoffload_ref.testing.machine_base.MachineBase`, composed with the rules in
    :class:`~kvoffload_ref.testing.machine.OffloadingMachine`."""

    def _check_result(self, result: ResultLike) -> None:
        model = self.current_model
        job = result.job_id
        self._say(f"# -> ({job}, success={result.success})")
        transfer = model.transfers.get(job)
        unreported = f"{job} not in [r.job_id for r in results]"  # R5: the script's assertion
        self._check(transfer is not None, "R5", f"reported job {job}, which was never (successfully) submitted",
                    unreported)
        assert transfer is not None
        self._check(transfer.status == "pending", "R5", f"job {job} reported twice", unreported)
        expired = isinstance(getattr(result, "error", None), TransferExpired)  # R26: ended at once, ahead of others
        self._check(expired or transfer.index > model.last_reported.get(transfer.lane, -1), "R5/R28",
                    f"{transfer.direction} job {job} reported out of submission order (on its stream)",
                    lambda: _in_order(job, self._reported_after(transfer)))
        if result.success:
            self._check_success(transfer, result)
        else:
            error = getattr(result, "error", None)
            self._problems(failure_problems(model, transfer, error, self.current_device.clock(),
                                            unreliable=self._unreliable(), running=self.running))
            if isinstance(error, TransferExpired):
                transfer.expired = error.reason
                type(self).counters.expired += 1
        self._check_attribution(transfer, result)
        self.handed[job] += 1
        counters = type(self).counters
        counters.succeeded += result.success
        counters.failed += not result.success
        model.resolve(transfer, result.success, expired=expired)

    def _reported_after(self, transfer: ModelTransfer) -> int:
        """The job reported last on ``transfer``'s stream (R5/R28: one submitted after it)."""
        model, last = self.current_model, self.current_model.last_reported[transfer.lane]
        return next(t.job_id for t in model.transfers.values() if t.lane == transfer.lane and t.index == last)

    def _check_attribution(self, transfer: ModelTransfer, result: ResultLike) -> None:
        """R22 (when the worker has attribution): which side the ids index, and the blocks a failure poisoned."""
        if self.capabilities.attribution:
            self._problems(attribution_problems(result, transfer, f"{transfer.direction} job {transfer.job_id}"))

    def _check_success(self, transfer: ModelTransfer, result: ResultLike, results: str = "results") -> None:
        """R5/R20/R27: a job reported successful may be (``results``: the script's expression of the list it was
        reported in -- the last get_finished(), or a shutdown report's unreported jobs)."""
        job = transfer.job_id
        failed = f"all(not r.success for r in {results} if r.job_id == {job})"  # the script's assertion
        self._check(not transfer.hung, "R5", f"job {job} reported success although a hang selected it: its "
                                             "completion can never be proven", failed)
        self._check(not transfer.blocked, "R4/R5", f"job {job} reported success although it is queued behind a "
                                                   "hung transfer of its direction", failed)
        self._check(not transfer.must_fail, "R5", f"job {job} reported success although an injected error fired "
                                                  "on its end event (or on the one it was queued behind)", failed)
        self._check(not transfer.released, "R27", f"job {job} reported success although take_released() handed out "
                                                  "its hold (only a late copy is held)", failed)
        self._check(self.current_race.is_observed((transfer.direction, job)), "R5/R20",
                    f"job {job} reported success although the device never saw its completion observed (no query "
                    "of its end event returned True)", f"{failed} or {(transfer.direction, job)!r} in dev.observed()")
        self._check(result.transfer_size == transfer.nbytes, "R5",
                    f"job {job} reported {result.transfer_size} bytes, expected {transfer.nbytes}",
                    f"all(not r.success or r.transfer_size == {transfer.nbytes} for r in {results} "
                    f"if r.job_id == {job})")

    def _check_memory(self) -> None:
        """R4/R5: every settled byte (GPU, and the CPU region) holds what the model says it holds."""
        type(self).counters.data_checks += 1
        if not self.current_device.lost():
            # the script reads it too: a read moves the clock past the compute stream's queued work (what the
            # worker does next depends on it)
            self._say("dev.read_gpu()  # the memory check")
            try:
                gpu = self.current_device.read_gpu()
            except DeviceError:
                self._raised("DeviceError")
                gpu = []
            for t, actual in enumerate(gpu):
                self._compare("gpu", t, actual)
        for t, actual in enumerate(self.current_worker.cpu_snapshot()):
            self._compare("cpu", t, np.asarray(actual))

    def _compare(self, side_name: str, tensor: int, actual: npt.NDArray[np.uint8]) -> None:
        side = self.current_model.sides[side_name]
        where = side.mismatch(tensor, actual)
        if where is not None:
            row, col = where
            expected = int(side.value[tensor][row, col])
            read = "w.cpu_snapshot()" if side_name == "cpu" else "dev.read_gpu()"  # what the check read
            self._check(False, "R4/R5", f"{side_name} tensor {tensor} row {row} byte {col} holds "
                                        f"{int(actual[row, col])}, expected {expected} "
                                        f"(last written by {self.current_model.writer(side_name, tensor, row, col)})",
                        f"int({read}[{tensor}][{row}][{col}]) == {expected}")

    def _check_report(self, report: ReportLike, start: float, expect: Expectations,
                      settled: frozenset[int]) -> None:
        counters = type(self).counters
        counters.shutdowns += 1
        counters.quarantined += report.region == "quarantined"
        self._problems(report_problems(report, model=self.current_model, device=self.current_device,
                                       policy=self.current_setup.policy,
                                       elapsed=self.current_device.clock() - start, expect=expect))
        self._check_outcomes(report, settled, proven_in_time=expect.must_release and not report.interrupted)
        self._check_switches(report)

    def _check_switches(self, report: ReportLike) -> None:
        """R4/R28: a direction moved to a fresh stream only after a job on its stream became late (reported
        failed by ``get_finished()`` or in the report)."""
        if not self.capabilities.attribution:  # a late job may be listed in the report only
            return
        model = self.current_model
        listed = report.unreported
        late = {t.lane for t in model.transfers.values() if t.status == "failed"}
        late |= {model.transfers[o.result.job_id].lane for o in listed
                 if not o.result.success and o.result.job_id in model.transfers}
        for direction, lane, job in model.switches:
            self._check(lane in late, "R4/R28", f"{direction} job {job} was queued on a new stream although no job "
                                                f"on the old one ({lane}) became late: R4 keeps a direction FIFO",
                        f"dev.streams.get(({direction!r}, {job})) == {lane!r}")

    def _check_outcomes(self, report: ReportLike, settled: frozenset[int], *, proven_in_time: bool) -> None:
        """R5/R10/R14/R22: the report's job list against the model (see :mod:`~kvoffload_ref.testing.outcomes`);
        every success it lists is checked as a reported success is.

        Args:
            settled: the jobs whose results the worker held before shutdown began (``outcomes.settled_jobs``).
            proven_in_time: the model knows the drain proves every queued job (nothing may fire, nothing hangs,
                the timeout suffices).
        """
        if not self.capabilities.attribution:
            return
        self.jobs_accounted_once()
        model, device = self.current_model, self.current_device
        for outcome in report.unreported:  # R26: what each listed expiry says (a "behind" names one of them)
            error = getattr(outcome.result, "error", None)
            if isinstance(error, TransferExpired) and outcome.result.job_id in model.transfers:
                model.transfers[outcome.result.job_id].expired = error.reason
        self._problems(outcome_problems(report, model, settled, unreliable=self._unreliable(),
                                        proven_in_time=proven_in_time, running=self.running, now=device.clock()))
        for outcome in report.unreported:
            transfer = model.transfers[outcome.result.job_id]
            if outcome.result.success:
                self._check_success(transfer, outcome.result, LISTED)
        type(self).counters.outcomes_checked += len(report.unreported)


    # -- invariants ---------------------------------------------------------------------------------------------
    @invariant()
    def no_violation(self) -> None:
        """R3/R10/R12: no copy ever touched released memory (the sim's log is empty); see the module docstring
        for the release policy's accepted hazards."""
        if self.dev is None or not self.dev.violations():
            return
        if self._hazard_accepted():
            return
        type(self).counters.violations += 1
        self._check(False, "R3/R10/R12", f"the simulated device saw misuse: {self.current_device.violations()}",
                    "dev.violations() == []")

    @invariant()
    def races_match(self) -> None:
        """R4/R20: the device flagged ``dma_race`` for exactly the pairs of operations the model says are unordered
        and overlap (no false positive: the worker ordered what R4 says it orders; no miss: the detector sees every
        race the rules predict)."""
        if self.dev is None or self.race is None:
            return
        flagged, predicted = self.dev.races(), self.race.races
        if flagged == predicted:
            type(self).counters.races += len(predicted) - self.races_seen
            self.races_seen = len(predicted)
            return
        type(self).counters.violations += 1
        extra, missed = sorted(map(str, flagged - predicted)), sorted(map(str, predicted - flagged))
        waits = f"; order_after (R23) waits in this run: {self.race.waits}" if self.race.waits else ""
        self._check(False, "R4/R20", f"dma_race pairs differ from the model: flagged but ordered by the rules "
                                     f"{extra}; unordered by the rules but not flagged {missed} "
                                     f"(details: {self.dev.race_details()}){waits}",
                    f"dev.races() == {set_literal(predicted)}")

    def _hazard_accepted(self) -> bool:
        if self.current_setup.policy.on_unproven != "release" or self.phase not in ("closed", "dropped"):
            return False
        if self.report is not None and self.report.device_sync not in ("timeout", "failed"):
            return False
        if not self.hazard_counted:
            self.hazard_counted = True
            type(self).counters.hazards += 1
        return True

    @invariant()
    def jobs_accounted_once(self) -> None:
        """R14/R22: across ``get_finished()`` and the shutdown report, every job the worker accepted appears
        exactly once, and nothing else appears (checked once the report exists; before it, each job is handed
        out at most once, R5)."""
        if self.model is None or self.report is None or not self.capabilities.attribution:
            return
        self._problems(accounting_problems(self.report, self.model, self.handed))

    @invariant()
    def holds_match(self) -> None:
        """R27: each hold ``take_released()`` hands out is a late job's, once, after its copy was observed done;
        then ``held()`` lists what the late jobs not released touch, as they touch it (checked while the worker
        is open and has a running engine's calls)."""
        if self.phase != "open" or not self.running or self.failed:
            return
        self._absorb_releases()
        worker: RunningLike = self.current_worker  # type: ignore[assignment]
        self._problems(held_problems(held_sets(worker.held()), self.current_model))

    def _absorb_releases(self) -> None:
        """R27: each ``take_released()`` record against the model (after every step, and right after a shutdown:
        its drain may prove a late copy, which R29's region check must know)."""
        worker: RunningLike = self.current_worker  # type: ignore[assignment]
        model, race = self.current_model, self.current_race
        records = list(worker.take_released())
        if records:  # the script takes them too: what held() lists next depends on it
            self._say(f"released = w.take_released()  # -> {[(r.direction, r.job_id) for r in records]}")
        for record in records:
            self._problems(release_problems(record, model, race.is_observed((record.direction, record.job_id))))
            model.release(model.transfers[record.job_id])
            type(self).counters.released += 1

    @invariant()
    def ledger_balances(self) -> None:
        """R16: per kind, acquired == released + live + quarantined + leaked; after shutdown nothing is live."""
        if self.dev is None:
            return
        ledger = self.current_device.ledger
        acquired, released = ledger.acquired(), ledger.released()
        live, kept, leaked = ledger.live(), ledger.quarantined(), ledger.leaked()
        for kind in RESOURCE_KINDS:
            total = released.get(kind, 0) + live.get(kind, 0) + kept.get(kind, 0) + leaked.get(kind, 0)
            self._check(acquired.get(kind, 0) == total, "R16", f"ledger does not balance for {kind}",
                        f"dev.ledger.acquired().get({kind!r}, 0) == sum(part().get({kind!r}, 0) for part in "
                        "(dev.ledger.released, dev.ledger.live, dev.ledger.quarantined, dev.ledger.leaked))")
        if self.phase in ("closed", "dropped", "refused"):
            self._check(live == {}, "R16", f"live after shutdown: {live}", "dev.ledger.live() == {}")

