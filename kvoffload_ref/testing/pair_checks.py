"""What the pair explorer checks after each case, beyond the single-thread explorer's checks (R4, R8, R19).

Pure functions over a :class:`PairOutcome`: what the two threads did (each one's result or exception), how the
second thread's call ended while the first was paused (ran to its end, blocked on the worker's lock, or waited on
the worker's condition for a first shutdown's report), whether the first was paused inside a shutdown that had
begun, and each backend ``sleep`` made while its thread held the worker's lock. Each problem is
``(rule ids, message)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Final

from kvoffload_ref.errors import DeadlineExceeded, WorkerClosedError
from kvoffload_ref.testing.explorer_checks import Outcome

__all__ = ["BLOCKED", "RAN", "WAITED", "PairOutcome", "check_pair"]

Problem = tuple[str, str]

#: How the second thread's call ended while the first thread was paused.
RAN: Final = "ran"  # it returned or raised
BLOCKED: Final = "blocked"  # it blocked taking the worker's lock
WAITED: Final = "waited"  # it waited on the worker's condition (a second shutdown awaits the first one's report)
STUCK: Final = "stuck"  # none of those within the watchdog (a deadlock)

#: Methods whose call may wait for a report: only a second shutdown() (R8/R19).
_MAY_AWAIT_REPORT: Final = frozenset({"shutdown"})


@dataclasses.dataclass
class PairOutcome(Outcome):
    """One pair case: :class:`Outcome` (the first thread's call in ``raised``/``returned``) and the second's."""

    second: str = ""
    # Invariant: the second thread's verdict while the first was paused (RAN, BLOCKED, WAITED or STUCK).
    verdict: str = ""
    # Invariant: True when the first thread was paused inside a shutdown() that had begun (its state changed).
    began: bool = False
    second_raised: BaseException | None = None
    second_returned: list[object] = dataclasses.field(default_factory=list)
    # Invariant: names of the threads still running when the case gave up on them (a deadlock).
    stuck: list[str] = dataclasses.field(default_factory=list)
    # Invariant: which thread (A, B, the settling thread) made each backend sleep() holding the worker's lock.
    slept_locked: list[str] = dataclasses.field(default_factory=list)


def check_pair(first: str, out: PairOutcome) -> Iterator[Problem]:
    """Every rule the pair broke that the single-thread checks do not see."""
    if out.stuck:
        yield "R19", f"deadlock: {', '.join(out.stuck)} never finished"
    for who in dict.fromkeys(out.slept_locked):  # one problem per thread, in the order first seen
        yield "R19", (f"a backend sleep() while holding the worker's lock: {who} "
                      f"({out.slept_locked.count(who)} times)")
    yield from _behind_shutdown(out)
    other_closed = out.second == "shutdown" and out.verdict == RAN  # a whole shutdown ran while the first paused
    yield from _promise("first", first, out.raised, out.returned, out, closed=other_closed,
                        may_close=out.second == "shutdown")
    if out.verdict in (RAN, BLOCKED, WAITED):
        yield from _promise("second", out.second, out.second_raised, out.second_returned, out, closed=out.began,
                            may_close=first == "shutdown")
    both = first == "shutdown" and out.second == "shutdown" and out.returned and out.second_returned
    if both and out.second_returned[0] is not out.returned[0] and out.second_returned[0] != out.returned[0]:
        yield "R8", "the two concurrent shutdown() calls returned different reports"


def _behind_shutdown(out: PairOutcome) -> Iterator[Problem]:
    """R19: nothing blocks behind a running shutdown; only a second shutdown() waits, for the first one's report."""
    if not out.began:
        return
    if out.verdict == BLOCKED:
        yield "R19", (f"{out.second}() blocked on the worker's lock while a shutdown ran in another thread "
                      "(it must return at once)")
    elif out.verdict == WAITED and out.second not in _MAY_AWAIT_REPORT:
        yield "R19", f"{out.second}() waited on the worker's condition while a shutdown ran in another thread"
    elif out.verdict == RAN and out.second in _MAY_AWAIT_REPORT:
        yield "R8/R19", ("a second shutdown() returned while the first was still running (it must wait for the "
                         "first one's report)")


def _promise(which: str, method: str, raised: BaseException | None, returned: list[object], out: PairOutcome,
             *, closed: bool, may_close: bool) -> Iterator[Problem]:
    """R19/R4/R8: what one thread's call may end with. ``closed``: a shutdown began before the call took the lock
    (the second thread during the first's shutdown; the first after a whole shutdown ran in the second);
    ``may_close``: the other thread's call is a shutdown (it may have begun first)."""
    label = f"the {which} thread's {method}()"
    if method.startswith("submit_"):
        yield from _submission(label, which, raised, out, closed=closed, may_close=may_close)
        return
    if method == "wait" and isinstance(raised, DeadlineExceeded) and not closed:
        return  # R6: a job still pending at the deadline
    if raised is not None:
        yield "R19", f"{label} raised {raised!r}"
        return
    if not returned:
        return
    if closed and method == "get_finished" and returned[0] != []:
        yield "R8/R19", f"{label} returned {returned[0]!r} after shutdown began (it must return empty)"
    if method == "shutdown" and not hasattr(returned[0], "region"):
        yield "R8", f"{label} returned {returned[0]!r}, not a report"


def _submission(label: str, which: str, raised: BaseException | None, out: PairOutcome, *,
                closed: bool, may_close: bool) -> Iterator[Problem]:
    """R19/R4: a submission is queued whole (it returned and the device took its copy) or refused whole
    (WorkerClosedError once shutdown began, and no copy)."""
    tag = out.tags_under_test()[0 if which == "first" else -1]
    copied = bool(out.device.copied(tag))
    if raised is None:
        if closed:
            yield "R8/R19", f"{label} was accepted after shutdown began (it must raise WorkerClosedError)"
        elif not copied:
            yield "R4/R19", f"{label} returned, yet the device never took its copy (not queued whole)"
    elif isinstance(raised, WorkerClosedError):
        if copied:
            yield "R19", f"{label} raised WorkerClosedError, yet its copy was queued (half-queued)"
        if not (closed or may_close):
            yield "R8", f"{label} raised WorkerClosedError, yet no shutdown was called"
    else:
        yield "R19", f"{label} raised {raised!r}"
