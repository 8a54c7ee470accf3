"""The simulated device's clock moves for waits, and the device-side length of a schedule.

* ``sleep(s)`` / ``clock_advance(s)`` advance the virtual clock by exactly ``s`` (a test's or a model's own time).
* ``poll_sleep(s)`` is the pause between two polls of a bounded wait (``polling.poll_pause``: a worker's ``wait``,
  a shutdown drain, a device-level proof): it advances the clock to the next completion of a record that the calling
  thread's queries found pending since its clock last moved -- the only completion that can change what its next
  poll sees -- and never past ``s``. A wait therefore returns with the clock exactly at the completion it awaited,
  where a plain sleep of the back-off would overshoot it by up to the pause. With nothing watched, or nothing watched
  due within ``s`` (hung work), the pause applies in full, so an unbounded wait still reaches the hang horizon. A
  shutdown drain awaits everything on its streams (``to_tail``): its pause runs on to the last record queued on a
  watched record's stream, so it costs a poll per pause, not per transfer, and still ends at the last completion.
* ``schedule_length()`` is the device-side span of the device ops (copies, compute work, stalls) submitted since
  construction or :meth:`SimClockCalls.mark_schedule`: from the first one's start to the last one's finish, host
  polling not counted, the clock untouched.

:class:`SimClockCalls` adds them to :class:`~kvoffload_ref.backends._simcore.SimCore`;
:class:`~kvoffload_ref.backends.sim.SimBackend` inherits them. See ``sim.py`` for the theory of operation.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import threading

import numpy as np

from kvoffload_ref.backends._simcore import SimCore
from kvoffload_ref.backends._simsched import Record
from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.validate import check_seconds

__all__ = ["ScheduleLength", "SimClockCalls"]

#: Whether a record completed (``any(map(_DONE, records))``: no generator per poll pause).
_DONE = operator.attrgetter("done")


@dataclasses.dataclass(frozen=True)
class ScheduleLength:
    """The device-side span of a schedule (:meth:`SimClockCalls.schedule_length`).

    Attributes:
        seconds: ``end - start``; 0.0 while no counted device op finished.
        start: virtual time the first counted device op started (None: none started).
        end: virtual time the last counted device op finished (None: none finished).
        ops: counted device ops that finished (copies, compute work, slow stalls, ended hangs).
        pending: counted device ops submitted and not finished yet (queued, running, hung, or behind a hang). While
            it is not 0 the span is the finished part only: advance the clock (a wait, ``sleep``) to complete it.
    """

    seconds: float
    start: float | None
    end: float | None
    ops: int
    pending: int

    @property
    def complete(self) -> bool:
        """Whether every counted device op finished (``pending == 0``)."""
        return self.pending == 0


class SimClockCalls(SimCore):
    """The clock and schedule calls of the :class:`~kvoffload_ref.backends.sim.SimBackend` facade (see the module
    docstring)."""

    def poll_sleep(self, seconds: float, *, to_tail: bool = False) -> None:
        """The pause between two polls of a bounded wait (``polling.poll_pause``; reported to ``on_call`` as
        ``"sleep"``): advance the clock by ``seconds`` -- or less, to the completion of the first record this thread's
        queries found pending since its clock last moved, running the work due by then. Never past ``seconds``;
        with nothing watched due within it (hung work) the whole pause. Never raises a DeviceError.

        Args:
            seconds: a finite number of seconds >= 0.
            to_tail: the caller awaits everything queued on those records' streams (a shutdown drain, R10): the pause
                runs on through each stream's later records and ends when one of those streams' last queued record
                completes (or at ``seconds``), so a drain's clock still ends exactly at its last completion.

        Raises:
            InvalidTransferError: what :meth:`sleep` raises for ``seconds``.
        """
        self._pause(seconds, exact=True, to_tail=to_tail)

    def _pause(self, seconds: float, *, exact: bool, to_tail: bool) -> None:
        """``sleep`` and ``poll_sleep`` (both the ``on_call`` point ``"sleep"``): the thread's clock moves, so what its
        queries watched is dropped -- a poll pause (``exact``) stops at the first of them to complete."""
        if self.on_call is not None:
            self.on_call("sleep", None)
        seconds = check_seconds("seconds", seconds)
        with self._lock:
            watched = self._watched.pop(threading.get_ident(), None)
            self._advance(seconds, (watched or None) if exact else None, to_tail)

    def sleep(self, seconds: float) -> None:
        """Advance the virtual clock by ``seconds``, running the work due by then. Never raises a DeviceError.

        A duration too short to move the clock (below its resolution at the current time) moves it by one step.

        Args:
            seconds: a finite number of seconds >= 0 (an int or a float).

        Raises:
            InvalidTransferError: a negative duration, NaN, an infinity, a bool, a non-number, an int too large for
                a float, or a duration that would move the clock past the largest float (R7; the clock is left
                as it was). It is a ValueError.
        """
        self._pause(seconds, exact=False, to_tail=False)

    def clock_advance(self, seconds: float) -> None:
        """Test helper: the same as :meth:`sleep`.

        Raises:
            InvalidTransferError: what :meth:`sleep` raises.
        """
        self.sleep(seconds)

    def _advance(self, seconds: float, watched: set[Record] | None, to_tail: bool = False) -> None:
        """Move the clock by ``seconds`` (``sleep``), or to the first completion of a ``watched`` record if sooner
        (if one completed already it does not move: the next poll sees it at once; ``to_tail``: to the completion
        of the last record queued on a watched record's stream). Under the lock."""
        sched = self._sched
        now = sched.now
        target = now + seconds
        if target == math.inf:
            raise InvalidTransferError(f"sleep: seconds={seconds!r} at virtual time {now!r} would move the clock "
                                       "past the largest float: expected a finite end time (e.g. seconds=1.0)")
        if target == now and seconds != 0:
            target = float(np.nextafter(now, np.inf))
        if watched is None:
            sched.run(target)
            sched.now = max(sched.now, target)
        else:
            sched.catch_up()
            # A watched record completed already (another thread's call ran it): the next poll sees it at once.
            stop = _tails(watched) if to_tail else watched
            if not any(map(_DONE, watched)) and not sched.run(target, stop):
                sched.now = max(sched.now, target)
        if self._trace is not None:  # the host's wait, drawn apart from the device's streams
            self._trace.host_poll(now, sched.now)

    def mark_schedule(self) -> None:
        """Begin a new schedule: :meth:`schedule_length` counts only the device ops submitted after this call (the
        work queued before it runs on, uncounted). Moves no clock and runs nothing; no ``on_call`` point."""
        with self._lock:
            self._sched.mark()

    def schedule_length(self) -> ScheduleLength:
        """The device-side span of what was queued since construction or :meth:`mark_schedule`: from the start of
        the first device op (a copy, compute work, a stall) to the finish of the last, host polling not counted.

        Runs the work already due by the current time (as any call that looks at the device) and never moves the
        clock: work not finished yet is counted in ``pending`` and left out of the span, so an incomplete schedule
        reads as such instead of being run to the end by asking. No ``on_call`` point, no fault point; a lost device
        still answers (its unfinished work stays pending).

        Returns:
            The span (:class:`ScheduleLength`): ``seconds``, ``start``, ``end``, ``ops`` finished and ``pending``.
        """
        with self._lock:
            sched = self._sched
            sched.catch_up()
            done = sched.span_done
            started = None if sched.span_start == math.inf else sched.span_start
            ended = None if done == 0 else sched.span_end
            seconds = 0.0 if started is None or ended is None else ended - started
            return ScheduleLength(seconds, started, ended, done, sched.span_queued - done)


def _tails(watched: set[Record]) -> set[Record]:
    """``Scheduler.run``'s ``stops`` for a drain's pause: the last record queued on each watched record's stream (its
    ``last_record``; the run holds the lock, so none is queued meanwhile)."""
    return {op.record for op in {r.stream.last_record for r in watched if r.stream is not None} if op is not None}
