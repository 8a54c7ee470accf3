"""The polling helpers of bounded waits: the back-off between polls (``Backoff``), ``poll_until``, ``wait_polling``
(a worker's ``wait``, R6/R19) and ``record_and_poll`` (the generic device-level proof, R13).

Every pause between two polls goes through :func:`poll_pause`: a backend that can tell when a poll's answer may
change next offers ``poll_sleep(seconds)`` (the simulated device: its clock stops at the next completion a poll
found pending, never past the pause, so a wait returns exactly when the work it awaited completed); any other
backend sleeps the pause (``sleep``: a real clock, ``FaultyBackend`` over a backend without it, a third party's).

They ask of a backend only the calls they make (the protocols below, which every
:class:`~kvoffload_ref.backends.base.Backend` satisfies), so this module does not import ``base``; ``base``
re-exports its names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, Protocol, TypeVar

from kvoffload_ref.errors import DeadlineExceeded
from kvoffload_ref.shield import Shield

__all__ = [
    "POLL_FIRST_SLEEP",
    "POLL_MAX_SLEEP",
    "Backoff",
    "Clock",
    "ProvingDevice",
    "WaitClock",
    "poll_pause",
    "poll_until",
    "record_and_poll",
    "wait_polling",
]

# Poll back-off for bounded waits: start short so completed work is seen at once, grow so a long wait
# costs little CPU; the cap bounds how far past a deadline a wait can overshoot.
POLL_FIRST_SLEEP: Final = 20e-6
POLL_MAX_SLEEP: Final = 1e-3

_S = TypeVar("_S")  # a backend's stream handle
_S_contra = TypeVar("_S_contra", contravariant=True)
_E = TypeVar("_E")  # a backend's event handle


class Clock(Protocol):
    """What a poll asks of a backend: its clock and its sleep (``Backend.monotonic``, ``Backend.sleep``)."""

    def monotonic(self) -> float:
        """The backend's clock in seconds."""
        ...

    def sleep(self, seconds: float) -> None:
        """Let the clock advance by ``seconds``."""
        ...


class WaitClock(Clock, Protocol):
    """What ``wait_polling`` asks of a backend besides its clock: the hang bound of an unbounded wait."""

    @property
    def hang_horizon(self) -> float | None:
        """``Backend.hang_horizon``."""
        ...

    def check_unbounded_wait(self, started: float, now: float, what: str) -> None:
        """``Backend.check_unbounded_wait``."""
        ...


class ProvingDevice(Clock, Protocol[_S_contra, _E]):
    """What ``record_and_poll`` asks of a backend besides its clock: events on its streams."""

    def create_event(self) -> _E:
        """``Backend.create_event``."""
        ...

    def record(self, event: _E, stream: _S_contra) -> None:
        """``Backend.record``."""
        ...

    def query(self, event: _E) -> bool:
        """``Backend.query``."""
        ...

    def destroy_event(self, event: _E) -> None:
        """``Backend.destroy_event``."""
        ...


def poll_pause(backend: Clock, seconds: float, *, to_tail: bool = False) -> None:
    """The pause between two polls of a bounded wait: the backend's ``poll_sleep(seconds, to_tail=...)`` where it has
    one (it may end the pause early, at the next completion that can change a poll's answer; never later), else
    ``sleep(seconds)``.

    Args:
        backend: whose clock to pause on. seconds: the pause, >= 0 (already bounded by the wait's deadline).
        to_tail: the poller awaits everything queued on the streams it queried (a shutdown drain, R10): the pause may
            run on through the work queued behind the record it found pending, up to its stream's last record.
    """
    exact = getattr(backend, "poll_sleep", None)
    if exact is None:
        backend.sleep(seconds)
    else:
        exact(seconds, to_tail=to_tail)


class Backoff:
    """The pause before the next poll of a bounded wait: it starts at POLL_FIRST_SLEEP and doubles up to
    POLL_MAX_SLEEP after each poll that found the work pending. One backoff may serve several waits in a row (a
    shutdown drain's heads, R10): the pause then carries over from one awaited transfer to the next instead of
    starting short again, so a queue of thousands of pending transfers costs a poll per pause, not several per
    transfer. A drain's backoff (``to_tail=True``) lets each pause run on to the last record queued on the streams
    its polls found pending: the drain awaits all of them, so the heads between change nothing it reports."""

    __slots__ = ("pause", "to_tail")

    def __init__(self, *, to_tail: bool = False) -> None:
        # Invariant: POLL_FIRST_SLEEP <= pause <= POLL_MAX_SLEEP; never shrinks.
        self.pause = POLL_FIRST_SLEEP
        # Invariant: True for a drain's backoff: each pause may run on to the tail of the streams a poll found
        # pending (``poll_pause``); False (a single wait, a proof): it ends at the first completion found pending.
        self.to_tail = to_tail

    def sleep(self, backend: Clock, now: float, deadline: float | None) -> None:
        """Pause for the current pause (never past ``deadline``) on the backend's clock (:func:`poll_pause`: on the
        sim, up to the next completion a poll found pending), then grow the pause."""
        step = self.pause if deadline is None else min(self.pause, deadline - now)
        poll_pause(backend, max(step, 0.0), to_tail=self.to_tail)
        self.pause = min(self.pause * 2, POLL_MAX_SLEEP)


def poll_until(backend: Clock, done: Callable[[], bool], deadline: float | None,
               backoff: Backoff | None = None) -> bool:
    """Poll ``done()`` with the backend's clock until it returns True or ``deadline`` passes.

    ``done`` is polled at least once, even when the deadline has already passed, so work that is complete is
    still seen. Sleeps between polls grow from POLL_FIRST_SLEEP to POLL_MAX_SLEEP and never past the deadline.

    Args:
        backend: whose clock and sleep to use.
        done: a zero-argument callable returning bool (it may raise; the error propagates).
        deadline: absolute time on ``backend.monotonic()``, or None for no bound.
        backoff: the pause to continue from (and grow) when the caller waits for several things in a row; None: a
            new one (the first sleep is POLL_FIRST_SLEEP).

    Returns:
        True if ``done()`` returned True, False if the deadline passed first.
    """
    pause = Backoff() if backoff is None else backoff
    while True:
        now = backend.monotonic()  # before the poll: a poll that began past the deadline is the last (R11)
        if done():
            return True
        if deadline is not None and now >= deadline:
            return False
        pause.sleep(backend, now, deadline)


def wait_polling(backend: WaitClock, settled: Callable[..., bool], started: float, deadline: float | None,
                 what: str, *, now: float | None = None, polled: bool = False, args: tuple[object, ...] = ()) -> None:
    """Poll ``settled(*args)`` until it returns True, sleeping between polls on the backend's clock (``wait``, R6).

    ``settled`` takes the worker's lock for one non-blocking poll; the sleeps run without it (R19). It is polled at
    least once. A simulated clock (one with a ``hang_horizon``) sleeps for free, so without a deadline the backoff
    grows without a cap and an unbounded wait reaches the horizon in a few dozen polls; a real clock polls at least
    every POLL_MAX_SLEEP. Each pause is :func:`poll_pause`: on the sim it ends at the next completion a poll found
    pending, so the wait returns with the clock exactly at the awaited completion (no pause is then due: on hung
    work the pauses apply in full, and the horizon is still reached).

    Args:
        backend: whose clock and sleep to use. settled: one poll. started: when the wait began (backend clock).
        deadline: absolute backend time, or None for no bound. what: the awaited job, for messages.
        now: the clock as read just before this wait's first poll, by a caller that read it then (it is then not
            read again before that poll); None: read here.
        polled: the caller made that first poll itself (``now`` is its reading) and it found the work pending:
            the wait goes on from there (its deadline check), as if ``settled()`` had just returned False.
        args: what each poll passes ``settled`` (no partial object built per wait).

    Raises:
        DeadlineExceeded: the deadline passed first (R6).
        SimHang: no deadline, and the backend's hung work outlived its ``hang_horizon`` (``check_unbounded_wait``;
            a real device never raises it).
    """
    horizon = backend.hang_horizon if deadline is None else None
    longest = POLL_MAX_SLEEP if horizon is None else max(POLL_MAX_SLEEP, horizon / 64)
    pause = POLL_FIRST_SLEEP
    if now is None:
        now = backend.monotonic()
    while True:
        # R19: the clock is read before the poll, so time that passed after it (another thread's shutdown that
        # completed meanwhile) is never held against it: a wait gives up only after a poll begun past its deadline.
        if not polled and settled(*args):
            return
        polled = False
        if deadline is not None and now >= deadline:
            raise DeadlineExceeded(f"{what} not proven complete by the deadline")
        if horizon is not None:
            backend.check_unbounded_wait(started, now, what)
        poll_pause(backend, pause if deadline is None else max(min(pause, deadline - now), 0.0))
        pause = min(pause * 2, longest)
        now = backend.monotonic()


def record_and_poll(backend: ProvingDevice[_S, _E], streams: Sequence[_S], deadline: float, *,
                    destroy: Callable[[_E], object] | None = None) -> bool:
    """The generic device-level proof: record a fresh event on each of ``streams`` (only those), then poll all
    of them until the deadline. Backends use it to implement ``prove_idle``.

    The events are created and destroyed here (so they pass through the ledger), with ``destroy`` (default
    ``backend.destroy_event``): a backend with release fault points passes one that skips them -- the proof's own
    events are not a release step of the library's (R16's report could not list them).
    """
    targets = list(streams)
    events: list[_E] = []
    try:
        for stream in targets:
            event = backend.create_event()
            events.append(event)
            backend.record(event, stream)
        pending = list(events)

        def all_done() -> bool:
            pending[:] = [e for e in pending if not backend.query(e)]
            return not pending

        done = poll_until(backend, all_done, deadline)
    except BaseException:
        _destroy_all(destroy or backend.destroy_event, events)  # an interrupt meanwhile is dropped: the one in
        # flight propagates
        raise
    _destroy_all(destroy or backend.destroy_event, events).reraise()
    return done


def _destroy_all(destroy: Callable[[_E], object], events: list[_E]) -> Shield:
    """Destroy the proof's events, every one whatever interrupts arrive meanwhile (R14: none stays live).

    Returns:
        The shield holding the interrupt that arrived meanwhile, for the caller to re-raise.
    """
    shield = Shield()
    while events:
        shield.run(lambda: destroy(events[-1]))
        events.pop()
    return shield
