"""What the model knows about why a job may be reported failed (R5, R26): an error, or an expiry.

A failure needs a cause the model knows: an injected error fired on the job's end event or on one ahead of it on
its stream (``must_fail``), an unreliable device (lost, or it saw misuse), or -- for a running engine -- an expiry
(R26) whose ``TransferExpired`` says why, and the model agrees:

* ``"deadline"``: the job had a deadline, and at least that long passed since its submission (its start on the
  device is no earlier);
* ``"cancel"``: a ``cancel`` listed it while it was pending;
* ``"behind"``: ``ahead`` names a job of its direction queued before it on the same stream, itself reported with
  reason ``"deadline"`` or ``"cancel"``;

and never for a job whose copy had completed before the cancel that listed it (``proven_first``: a proven job
is reported as it is). Pure functions; the machine turns each problem into a failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from kvoffload_ref.errors import TransferExpired
from kvoffload_ref.testing.model import Model, ModelTransfer

__all__ = ["EPSILON", "failure_problems"]

#: Virtual seconds of rounding allowed when comparing a deadline with the clock.
EPSILON: Final = 1e-9

#: (rule ids, message, the check as a reproduction asserts it: a Python expression over the results it names,
#: true when the rule holds)
Problem = tuple[str, str, str]


def failure_problems(model: Model, transfer: ModelTransfer, error: object, now: float, *, unreliable: bool,
                     running: bool, results: str = "results") -> Iterator[Problem]:
    """Why ``transfer`` may not be reported failed with ``error`` at device time ``now`` (nothing: it may).

    Args:
        unreliable: the device was lost or saw misuse (queries may fail without a recorded firing).
        running: the worker's running-engine calls are checked (else an expiry is never a cause).
        results: the results the job's is among, as the reproduction names them (its last ``get_finished()``,
            or a report's list).
    """
    what = f"{transfer.direction} job {transfer.job_id}"
    if isinstance(error, TransferExpired) and running:
        yield from _expiry(model, transfer, error, now, what, results)
        return
    if transfer.must_fail or unreliable:
        return
    if running and error is None and model.may_be_late(transfer):
        return  # an implementation whose results carry no error: an expiry may explain it
    yield ("R5", f"{what} reported failed ({error!r}) although nothing failed",
           f"all(r.success for r in {results} if r.job_id == {transfer.job_id})")


def _expiry(model: Model, transfer: ModelTransfer, error: TransferExpired, now: float,
            what: str, results: str) -> Iterator[Problem]:
    job = transfer.job_id
    expiries = (f"[r.error for r in {results} if r.job_id == {job} "
                "and isinstance(getattr(r, 'error', None), TransferExpired)]")
    reasons = f"[e.reason for e in {expiries}]"
    if error.job_id != transfer.job_id:
        yield ("R26", f"{what} failed with a TransferExpired naming job {error.job_id!r}",
               f"all(e.job_id == {job} for e in {expiries})")
    if transfer.proven_first:
        yield "R26", (f"{what} reported expired ({error.reason!r}) although its copy had completed before the cancel "
                      "that listed it: cancel looks first, and a proven job is reported as it is"), f"{expiries} == []"
        return
    reason = error.reason
    if reason == "deadline":
        limit = transfer.deadline
        if limit is None or now + EPSILON < transfer.submitted_at + limit:
            due = "" if limit is None else f" or dev.clock() + {EPSILON!r} >= {transfer.submitted_at + limit!r}"
            yield "R26", (f"{what} expired on its deadline ({limit!r} s) at {now} s, submitted at "
                          f"{transfer.submitted_at} s"), f"'deadline' not in {reasons}{due}"
    elif reason == "cancel":
        if not transfer.cancelled:
            yield ("R26", f"{what} reported cancelled although no cancel listed it while it was pending",
                   f"'cancel' not in {reasons}")
    elif reason == "behind":
        ahead = model.transfers.get(error.ahead) if isinstance(error.ahead, int) else None
        if ahead is None or ahead.direction != transfer.direction or ahead.lane != transfer.lane \
                or ahead.index >= transfer.index or ahead.expired not in ("deadline", "cancel"):
            valid = sorted(t.job_id for t in model.transfers.values()
                           if t.direction == transfer.direction and t.lane == transfer.lane
                           and t.index < transfer.index and t.expired in ("deadline", "cancel"))
            yield "R26", (f"{what} reported 'behind' job {error.ahead!r}, which is not a job queued ahead of it on "
                          "its stream and reported expired (deadline or cancel)"), (
                f"all(e.ahead in {valid!r} for e in {expiries} if e.reason == 'behind')")
    else:
        yield ("R26", f"{what} expired with reason {reason!r}, not one of 'deadline', 'cancel', 'behind'",
               f"set({reasons}) <= {{'deadline', 'cancel', 'behind'}}")
