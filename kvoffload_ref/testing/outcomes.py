"""What the model knows about the shutdown report's job list (R22): which jobs it lists, how each ended, and what
each poisoned.

Theory of operation
-------------------
*Accounting.* Every job the worker accepted (``Model.transfers``) appears exactly once across the results
``get_finished()`` handed out and ``report.unreported``; nothing else appears in either (R14, R22).

*How a job ended.* The model never predicts when a transfer completes, so it predicts the job list as constraints
that pin down everything the rules fix:

* a job whose result the worker held before shutdown began -- a ``wait()`` returned for it, or an injected error
  fired on its end event (or on the one it was queued behind) -- is ``unreaped`` (:func:`settled_jobs`);
* ``drained`` is a success, ``failed`` and ``abandoned`` are failures; an ``unreaped`` job is either;
* a success is checked as a reported success is (never hung, blocked or hit by an error; observed complete; the
  model's byte count), and names no blocks; a failure names exactly the destination ids the transfer was to write
  (``ModelTransfer.dst_ids``), with the ``transfer_type`` of its direction;
* a failure that is ``unreaped`` or ``failed`` needs a cause (an error fired on its end event, a lost device, a
  violation); when the model knows the drain proves every queued job (nothing may fire, nothing hangs, the
  timeout suffices, no interrupt), nothing is ``failed`` or ``abandoned``;
* per direction the list is in submission order and reads ``unreaped* drained* failed? abandoned*`` (the drain
  goes head first, stops at its first failure and abandons the rest, R10), and the handler's counts agree with it:
  ``drained`` = its drained jobs, ``abandoned`` = its failed and abandoned jobs.

Pure functions over the report, the model and the handed-out counts; the machine turns each problem into a failure.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from typing import Final

from kvoffload_ref.errors import TransferExpired
from kvoffload_ref.testing.adapter import HandlerReportLike, JobOutcomeLike, ReportLike, ResultLike
from kvoffload_ref.testing.expiry import failure_problems
from kvoffload_ref.testing.model import Model, ModelTransfer

__all__ = ["ENDINGS", "accounting_problems", "attribution_problems", "outcome_problems", "settled_jobs"]

#: How a listed job may have ended, in the order a direction's list goes through them.
ENDINGS: Final = ("unreaped", "drained", "failed", "abandoned")

#: (rule ids, message, the check as a reproduction asserts it: a Python expression over ``report`` and ``handed``
#: -- the job ids its ``get_finished()`` calls handed out -- true when the rule holds)
Problem = tuple[str, str, str]
#: The report's listed results, as the reproduction names them.
LISTED: Final = "[o.result for o in report.unreported]"


def _listed(job: int, field: str = "o") -> str:
    """The report's entries for ``job`` (each as ``field`` of ``o``), as the reproduction names them."""
    return f"[{field} for o in report.unreported if o.result.job_id == {job!r}]"


def _of(jobs: object) -> str:
    """The report's entries for the jobs in ``jobs`` (a Python literal with ``in``), in its order."""
    return f"[o for o in report.unreported if o.result.job_id in {jobs!r}]"


def settled_jobs(model: Model) -> frozenset[int]:
    """The pending jobs whose results the worker must already hold now (a shutdown starting now lists them as
    ``unreaped``): those a ``wait()`` returned for (R6), those an injected error fired on, or behind (R5), and
    those a ``cancel`` listed (R26: proven or expired at once)."""
    return frozenset(t.job_id for t in model.pending() if t.job_id in model.awaited or t.must_fail or t.cancelled)


def accounting_problems(report: ReportLike, model: Model, handed: Mapping[int, int]) -> Iterator[Problem]:
    """R14/R22: every accepted job exactly once across get_finished() (``handed``: job -> times handed out) and
    the report; nothing else in either."""
    listed = collections.Counter(o.result.job_id for o in report.unreported)
    every = "(handed + [o.result.job_id for o in report.unreported])"  # handed out, then listed
    for job in sorted(set(listed) | set(handed), key=repr):
        if job not in model.transfers:
            where = "the report lists" if listed[job] else "get_finished() handed out"
            yield "R14/R22", f"{where} job {job!r}, which the worker never accepted", f"{job!r} not in {every}"
    for job, transfer in model.transfers.items():
        seen = handed.get(job, 0) + listed[job]
        if seen == 1:
            continue
        once = f"{every}.count({job}) == 1"
        if seen == 0:
            queued = transfer in model.chain[transfer.direction]
            yield ("R10/R22" if queued else "R14/R22"), (
                f"{transfer.direction} job {job} was accepted, never handed out by get_finished(), and the report "
                f"does not list it" + (" (it was queued at shutdown: the drain neither proved nor abandoned it)"
                                       if queued else "")), once
        else:
            yield "R14/R22", (f"{transfer.direction} job {job} appears {seen} times across get_finished() "
                              f"({handed.get(job, 0)}) and the report ({listed[job]})"), once


def outcome_problems(report: ReportLike, model: Model, settled: frozenset[int], *, unreliable: bool,
                     proven_in_time: bool, running: bool = False, now: float = 0.0) -> Iterator[Problem]:
    """Every way the report's job list contradicts the model (see the module docstring); the successes it lists
    are left to the machine's success check.

    Args:
        report: the shutdown report.
        model: the model, with the shutdown's firings absorbed.
        settled: :func:`settled_jobs` just before shutdown began.
        unreliable: the device was lost or saw misuse (queries may fail without a recorded firing).
        proven_in_time: the model knows the drain proves every queued job.
        running: the worker's running-engine calls are checked (an expiry may explain an ``unreaped`` failure).
        now: the device clock (an expiry's deadline is checked against it).
    """
    lists: dict[str, list[tuple[ModelTransfer, str]]] = {"store": [], "load": []}
    for outcome in report.unreported:
        transfer = model.transfers.get(outcome.result.job_id)
        if transfer is None:
            continue  # accounting_problems names it
        if outcome.ended not in ENDINGS:
            yield ("R22", f"{transfer.direction} job {transfer.job_id} ended {outcome.ended!r}, not one of {ENDINGS}",
                   f"all(o.ended in {ENDINGS!r} for o in report.unreported)")
            continue
        lists[transfer.direction].append((transfer, outcome.ended))
        yield from _one(outcome, transfer, settled, unreliable=unreliable, proven_in_time=proven_in_time)
        if not outcome.result.success and outcome.ended == "unreaped":  # R5/R26: its cause
            yield from failure_problems(model, transfer, getattr(outcome.result, "error", None), now,
                                        unreliable=unreliable, running=running, results=LISTED)
    expired = frozenset(o.result.job_id for o in report.unreported
                        if isinstance(getattr(o.result, "error", None), TransferExpired))
    for direction, items in lists.items():
        yield from _direction(direction, items, report.store if direction == "store" else report.load, expired)


def _one(outcome: JobOutcomeLike, transfer: ModelTransfer, settled: frozenset[int], *, unreliable: bool,
         proven_in_time: bool) -> Iterator[Problem]:
    """One listed job against the model."""
    result, ended = outcome.result, outcome.ended
    job, direction = transfer.job_id, transfer.direction
    success = result.success
    if success != (ended == "drained") and ended != "unreaped":
        yield ("R10/R22", f"listed {direction} job {job} ended {ended!r} with success={success}",
               f"all(o.result.success == (o.ended == 'drained') for o in {_listed(job)} if o.ended != 'unreaped')")
    yield from attribution_problems(result, transfer, f"listed {direction} job {job} ({ended})", LISTED)
    if job in settled and ended != "unreaped":
        yield "R5/R6/R22", (f"{direction} job {job} ended {ended!r}, but its result was known before shutdown "
                            "began (a wait() returned for it, or an error fired on its end event): 'unreaped'"), (
            f"set({_listed(job, 'o.ended')}) <= {{'unreaped'}}")
    if not success and ended == "failed" and not (transfer.must_fail or unreliable):
        yield ("R5/R10", f"listed {direction} job {job} {ended} although nothing failed",
               f"all(o.result.success or o.ended != 'failed' for o in {_listed(job)})")
    if proven_in_time and ended in ("failed", "abandoned"):
        yield "R10/R22", (f"{direction} job {job} ended {ended!r} although the drain could prove every queued "
                          "transfer within the timeout"), (
            f"not set({_listed(job, 'o.ended')}) & {{'failed', 'abandoned'}}")


def attribution_problems(result: ResultLike, transfer: ModelTransfer, what: str,
                         results: str = "results") -> Iterator[Problem]:
    """R22: ``result`` says which side its ids index, and a failure names exactly the destination ids ``transfer``
    was to write (sorted, distinct), a success none. ``what`` names the job in the messages; ``results`` the
    results it is among, as the reproduction names them."""
    kind = result.transfer_type
    mine = f"for r in {results} if r.job_id == {transfer.job_id}"
    if kind is None or tuple(kind) != transfer.transfer_type:
        yield ("R22", f"{what} has transfer_type {kind!r}, expected {transfer.transfer_type!r}",
               f"all(tuple(r.transfer_type or ()) == {transfer.transfer_type!r} {mine})")
    blocks, expected = tuple(result.invalid_blocks), () if result.success else transfer.dst_ids
    if blocks != expected:
        side = "CPU chunks" if transfer.direction == "store" else "GPU blocks"
        yield "R22", (f"{what} (success={result.success}) names invalid_blocks {blocks!r}; expected {expected!r}"
                      + ("" if result.success else f" (the {side} it was to write)")), (
            f"all(tuple(r.invalid_blocks) == (() if r.success else {transfer.dst_ids!r}) {mine})")


def _direction(direction: str, items: list[tuple[ModelTransfer, str]], part: HandlerReportLike,
               expired: frozenset[int]) -> Iterator[Problem]:
    """One direction's listed jobs: submission order and the drain's sequence per stream (R28: a retired stream's
    live jobs are drained apart; R26: an expired job is reported at once, ahead of live ones queued before it),
    the handler's counts."""
    endings = [ended for _, ended in items]
    mine = _of({t.job_id for t, _ in items})
    for lane in dict.fromkeys(t.lane for t, _ in items):
        on = [(t, ended) for t, ended in items if t.lane == lane]
        indices = [t.index for t, _ in on if t.job_id not in expired]
        if indices != sorted(indices):
            index = {t.job_id: t.index for t, _ in on if t.job_id not in expired}
            ids = f"[o.result.job_id for o in {_of(index)}]"
            yield "R5/R22", (f"the report lists {direction} jobs {[t.job_id for t, _ in on]} (one stream) out of "
                             "submission order"), f"{ids} == sorted({ids}, key={index!r}.get)"
        ranks = [ENDINGS.index(ended) for _, ended in on]
        if ranks != sorted(ranks):
            got = f"[{ENDINGS!r}.index(o.ended) for o in {_of({t.job_id for t, _ in on})}]"
            yield "R10/R22", (f"{direction} jobs ended {[ended for _, ended in on]} (one stream): a drain goes head "
                              "first (unreaped, drained, at most one failed head, then abandoned)"), (
                f"{got} == sorted({got})")
    if endings.count("failed") > 1:
        yield ("R10/R22", f"{direction} jobs ended {endings}: a drain stops at its first failed head",
               f"[o.ended for o in {mine}].count('failed') <= 1")
    drained, stopped = endings.count("drained"), endings.count("failed") + endings.count("abandoned")
    if (part.drained, part.abandoned) != (drained, stopped):
        yield "R10/R22", (f"{direction} handler reports drained={part.drained}, abandoned={part.abandoned}; its "
                          f"listed jobs say {drained} drained, {stopped} failed or abandoned"), (
            f"(report.{direction}.drained, report.{direction}.abandoned) == (sum(o.ended == 'drained' for o in "
            f"{mine}), sum(o.ended in ('failed', 'abandoned') for o in {mine}))")
