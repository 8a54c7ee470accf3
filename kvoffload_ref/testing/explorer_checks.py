"""What the call-point explorer checks after each case (R5, R8, R12, R14, R16, R19, R22); see ``explorer.py``.

Pure functions over an :class:`Outcome`: what the case did (the call's exception, the results, the reports, the
device's memory, ledger and violation log). Each problem is ``(rule ids, message)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload_ref.errors import DeadlineExceeded, ShutdownDeferred, TransferExpired
from kvoffload_ref.testing.adapter import ReportLike, Setup, SimDevice, WorkerLike, initial_gpu_bytes
from kvoffload_ref.testing.model import plan_moves
from kvoffload_ref.testing.scenario import CANCELLED, PRELUDE, CaseLike, Job
from kvoffload_ref.testing.shutdown import _ledger

__all__ = ["Outcome", "check_case"]

Bytes = npt.NDArray[np.uint8]
Problem = tuple[str, str]

#: Injections whose exception must propagate out of the interrupted call.
PROPAGATING: Final = frozenset({"KeyboardInterrupt", "SystemExit", "double", "SIGINT", "handler_shutdown_exit"})
#: Violations the release policy accepts once its shutdown admitted that the proof did not succeed.
RELEASE_HAZARDS: Final = frozenset({"unmap_under_dma", "unregister_under_dma", "descriptor_freed_under_dma"})


@dataclasses.dataclass
class Outcome:
    """Everything one case did, as the checks read it."""

    setup: Setup
    device: SimDevice
    case: CaseLike | None = None
    # Invariant: the submissions the case made besides the prelude's (none, one, or a pair's two).
    under_test: list[Job] = dataclasses.field(default_factory=list)
    # Invariant: the worker while the call under test runs (the signal handler's target); empty otherwise.
    worker_ref: list[WorkerLike] = dataclasses.field(default_factory=list)
    raised: BaseException | None = None
    returned: list[object] = dataclasses.field(default_factory=list)
    injected: list[BaseException] = dataclasses.field(default_factory=list)
    calls: int = 0
    fired: bool = False
    accepted: list[int] = dataclasses.field(default_factory=list)
    # Invariant: every result get_finished() returned during the case, in order.
    results: list[object] = dataclasses.field(default_factory=list)
    baseline_cpu: list[Bytes] = dataclasses.field(default_factory=list)
    baseline_gpu: list[Bytes] = dataclasses.field(default_factory=list)
    final_cpu: list[Bytes] = dataclasses.field(default_factory=list)
    final_gpu: list[Bytes] = dataclasses.field(default_factory=list)
    closed_after_call: bool = False
    # Invariant: the ids of the submissions under test still refused as in flight after the case, unreported.
    reuse_refused: frozenset[int] = frozenset()
    handler_ran: bool = False
    # Invariant: a cancel ran (the method under test, or a signal handler's), so a job may end "cancel" (R26).
    cancelled: bool = False
    # Invariant: the prelude's jobs given a deadline (R26).
    deadlines: frozenset[int] = frozenset()
    handler_report: object | None = None
    handler_raised: BaseException | None = None
    reports: list[ReportLike] = dataclasses.field(default_factory=list)
    after_shutdown: list[object] = dataclasses.field(default_factory=list)
    final_raised: BaseException | None = None

    def case_method(self) -> str:
        return "" if self.case is None else self.case.method

    def tags_under_test(self) -> list[tuple[str, int]]:
        return [(job[0], job[1]) for job in self.under_test]

    def accepted_or_tried(self) -> list[int]:
        return [*self.accepted, *(job for _, job in self.tags_under_test())]

    def reported_ids(self) -> list[int]:
        return [r.job_id for r in self.results]  # type: ignore[attr-defined]

    def jobs(self) -> dict[int, tuple[str, object, object]]:
        """Job id -> (direction, source spec, destination spec) of the prelude's jobs and those under test."""
        return {job: (d, src, dst) for d, job, src, dst in (*PRELUDE, *self.under_test)}


def check_case(case: CaseLike, out: Outcome) -> Iterator[Problem]:
    """Every rule the case broke."""
    if case.point >= 0 and not out.fired:
        return  # the method made fewer calls this time: nothing was injected
    yield from _propagation(case, out)
    yield from _closing(case, out)
    if case.method == "finalizer":
        yield from _violations(out, None)
        if out.device.ledger.live():
            yield "R14/R15/R16", f"live after the finalizer ran: {out.device.ledger.live()}"
        return
    if case.method == "construct" and out.raised is not None:
        if out.device.ledger.live():
            yield "R2/R14", f"construction interrupted, yet live: {out.device.ledger.live()}"
        yield from _violations(out, None)
        return
    report = out.reports[0] if out.reports else None
    yield from _accounting(case, out, report)
    yield from _expiries(out, report)
    yield from _failed_reported_failed(out, report)
    yield from _cancel_carried_out(case, out)
    yield from _bytes(out)
    if report is not None:
        yield from _report(case, out, report)
    yield from _violations(out, report)


def _propagation(case: CaseLike, out: Outcome) -> Iterator[Problem]:
    """R14: an interrupt propagates out of the interrupted call; a handler that caught what it raised does not
    break the call."""
    raised, kind = out.raised, case.injection
    if isinstance(raised, BaseException) and "deadlock" in str(raised) and type(raised).__name__ == "_Injected":
        yield "R19", "the call deadlocked (the watchdog interrupted it)"
        return
    if kind in PROPAGATING:
        expected: tuple[type[BaseException], ...] = (
            (KeyboardInterrupt,) if kind in ("KeyboardInterrupt", "double", "SIGINT") else (SystemExit,))
        if kind == "handler_shutdown_exit":
            expected = (SystemExit, ShutdownDeferred)
        if kind == "handler_shutdown_exit" and not out.handler_ran:
            return
        if not isinstance(raised, expected):
            yield "R14", f"the interrupt did not propagate out of {case.method}: it raised {raised!r}"
    elif (kind == "handler_shutdown" and out.handler_ran and raised is not None
          and not isinstance(raised, DeadlineExceeded)):
            yield "R19", f"{case.method} raised {raised!r} after a signal handler's shutdown() that caught all"
    elif kind == "handler_cancel" and out.handler_ran:
        if out.handler_raised is not None:
            yield "R19/R26", f"cancel() in a signal handler inside {case.method} raised {out.handler_raised!r}"
        if raised is not None and not isinstance(raised, DeadlineExceeded):
            yield "R19/R26", f"{case.method} raised {raised!r} after a signal handler's cancel()"


def _closing(case: CaseLike, out: Outcome) -> Iterator[Problem]:
    """R14/R19: a later shutdown() returns the report; after a signal handler's shutdown() the worker is shut
    down by the time the interrupted call returned."""
    if case.method == "finalizer" or (case.method == "construct" and out.raised is not None):
        return
    if not out.reports:
        yield "R8/R14", f"a later shutdown() did not return the report: it raised {out.final_raised!r}"
        return
    if len(out.reports) == 2 and out.reports[1] is not out.reports[0] and out.reports[1] != out.reports[0]:
        yield "R8", "a second shutdown() returned another report"
    if out.after_shutdown:
        yield "R8", f"get_finished() after shutdown returned {out.after_shutdown}"
    if (out.handler_ran and case.injection.startswith("handler_shutdown") and case.method != "shutdown"
            and not out.closed_after_call):
        yield "R19", (f"a signal handler called shutdown() inside {case.method}, yet the worker accepted a "
                      "submission after the interrupted call returned")


def _accounting(case: CaseLike, out: Outcome, report: ReportLike | None) -> Iterator[Problem]:
    """R5/R8/R14: every accepted job is accounted for exactly once (get_finished() or the report); a submission
    interrupted before the device took its copy leaves no trace and its id free."""
    accepted = list(out.accepted)
    for tag in out.tags_under_test():
        if out.device.copied(tag):
            accepted.append(tag[1])
        elif tag[1] in out.reuse_refused:
            yield "R14/R7", f"job {tag[1]} left no copy on the device, yet its id is still refused as in flight"
    ids = out.reported_ids()
    for job in set(ids):
        if ids.count(job) > 1:
            yield "R5", f"job {job} reported {ids.count(job)} times"
        if job not in accepted:
            yield "R5/R14", f"job {job} reported, but the device never took its copy"
    if report is None:
        return
    listed = getattr(report, "unreported", None)
    if listed is None:  # a report without a job list: count
        counted = sum(part.drained + part.abandoned for part in (report.store, report.load))
        missing = len(set(accepted) - set(ids))
        if counted != missing:
            yield "R8/R14", (f"{missing} accepted jobs never reported, the report accounts for {counted} "
                             f"(drained + abandoned)")
        return
    in_report = [o.result.job_id for o in listed]
    for job in accepted:
        seen = ids.count(job) + in_report.count(job)
        if seen != 1:
            yield "R5/R8/R14", (f"job {job} appears {seen} times across get_finished() and the report "
                                f"(results {sorted(ids)}, report {sorted(in_report)})")


def _every_result(out: Outcome, report: ReportLike | None) -> list[object]:
    """Every result the case saw: those ``get_finished()`` returned, then those the report lists."""
    listed = [] if report is None else [o.result for o in getattr(report, "unreported", ())]
    return [*out.results, *listed]


def _expiries(out: Outcome, report: ReportLike | None) -> Iterator[Problem]:
    """R26: a job ends expired only as the case allows: "cancel" once a cancel ran and listed it, "deadline" only
    for a job given one, "behind" only naming a job that was one of those."""
    for result in _every_result(out, report):
        error = getattr(result, "error", None)
        if not isinstance(error, TransferExpired):
            continue
        job = getattr(result, "job_id", None)
        if error.reason == "cancel" and not (out.cancelled and job in CANCELLED):
            yield "R26", f"job {job} was reported cancelled, but no cancel listed it"
        elif error.reason == "deadline" and job not in out.deadlines:
            yield "R26", f"job {job} expired on a deadline it was never given"
        elif error.reason == "behind" and not ((out.cancelled and error.ahead in CANCELLED)
                                               or error.ahead in out.deadlines):
            yield "R26", (f"job {job} was reported behind job {error.ahead!r}, which neither was cancelled nor had "
                          "a deadline")


def _failed_reported_failed(out: Outcome, report: ReportLike | None) -> Iterator[Problem]:
    """R5/R22: a job whose completion the device made fail (a failed configuration's ``error`` fault) is reported
    ``success=False`` wherever it is reported (``get_finished()`` or the report), listing its destination blocks."""
    failing = {f.job_id for f in out.setup.faults if f.kind == "error" and f.job_id is not None}
    if not failing:
        return
    jobs = out.jobs()
    for result in _every_result(out, report):
        job = getattr(result, "job_id", None)
        if job not in failing or job not in jobs:
            continue
        if getattr(result, "success", False):
            yield "R5", f"job {job}'s completion failed on the device, yet it was reported success=True"
            continue
        direction, _, dst = jobs[job]
        want = tuple(sorted({int(b) for b in getattr(dst, "block_ids", ())}))
        got = tuple(int(b) for b in getattr(result, "invalid_blocks", ()))
        if got != want:
            yield "R22", (f"failed {direction} job {job} lists invalid_blocks {list(got)}, not its destination "
                          f"{list(want)}")


def _cancel_carried_out(case: CaseLike, out: Outcome) -> Iterator[Problem]:
    """R19/R26: a cancel that ran (the method, or a signal handler's inside the call: carried out as the call
    returned) ended every listed job at once, proven or expired: while the worker is open, the next
    ``get_finished()`` reports each (none is left for the shutdown to drain or abandon)."""
    ran = ((case.method == "cancel" and out.raised is None)  # an interrupted cancel may have ended nothing (R14)
           or (case.injection == "handler_cancel" and out.handler_ran))
    if not (ran and out.cancelled) or out.closed_after_call:
        return
    reported = set(out.reported_ids())
    left = sorted(job for job in CANCELLED & set(out.accepted) if job not in reported)
    if left:
        yield "R19/R26", f"cancel({sorted(CANCELLED)}) ran in {case.method}, yet jobs {left} were not ended by it"


def _bytes(out: Outcome) -> Iterator[Problem]:
    """R5: a job reported success=True moved exactly the right bytes."""
    jobs = out.jobs()
    setup = out.setup
    gpu0 = [initial_gpu_bytes(setup, t) for t in range(setup.layout.num_tensors)]
    for result in out.results:
        job = result.job_id  # type: ignore[attr-defined]
        if not result.success or job not in jobs:  # type: ignore[attr-defined]
            continue
        direction, src, dst = jobs[job]
        if direction == "store" and out.final_cpu:
            for m in plan_moves(setup.layout, setup.blocks_per_chunk, src, dst):  # type: ignore[arg-type]
                got = out.final_cpu[m.tensor][m.cpu_row, m.cpu_col:m.cpu_col + m.size]
                if not np.array_equal(got, gpu0[m.tensor][m.gpu_row, :m.size]):
                    yield "R5", f"store job {job} reported success, CPU chunk {m.cpu_row} holds other bytes"
        elif direction == "load" and out.final_gpu:
            for m in plan_moves(setup.layout, setup.blocks_per_chunk, dst, src):  # type: ignore[arg-type]
                want = out.baseline_cpu[m.tensor][m.cpu_row, m.cpu_col:m.cpu_col + m.size]
                if not np.array_equal(out.final_gpu[m.tensor][m.gpu_row, :m.size], want):
                    yield "R5", f"load job {job} reported success, GPU block {m.gpu_row} holds other bytes"


def _report(case: CaseLike, out: Outcome, report: ReportLike) -> Iterator[Problem]:
    """R12/R14/R16: the region's fate, the interrupted mark, and the ledger against the report."""
    if report.region not in ("released", "quarantined"):
        yield "R14", f"the region ended {report.region!r}, neither released nor quarantined"
    if (report.region == "released" and case.injection != "none" and out.setup.policy.on_unproven == "quarantine"
            and report.device_sync not in ("not_needed", "ok")):
        yield "R12", f"the region was released with device_sync={report.device_sync!r}"
    interrupted_shutdown = case.method == "shutdown" and case.injection in PROPAGATING and (
        case.injection != "handler_shutdown_exit" or out.handler_ran)
    if interrupted_shutdown and not report.interrupted:
        yield "R14", "an interrupt propagated out of shutdown(), yet the report is not marked interrupted"
    if not interrupted_shutdown and report.interrupted and case.method != "shutdown":
        yield "R14", f"the report is marked interrupted, but no interrupt reached a shutdown ({case.method})"
    yield from ((rules, message) for rules, message, _ in _ledger(report, out.device))  # explore prints no script


def _violations(out: Outcome, report: ReportLike | None) -> Iterator[Problem]:
    """No misuse seen by the device; the release policy's admitted hazards excepted."""
    hazards_ok = (out.setup.policy.on_unproven == "release" and
                  (report is None or report.device_sync in ("timeout", "failed")))
    for v in out.device.sim.violations:
        if hazards_ok and v.kind in RELEASE_HAZARDS:
            continue
        yield "R3/R12/R20", f"the device saw {v.kind}: {v.detail}"
