"""Deterministic thread interleavings for the conformance machine: pause a thread at a chosen backend call.

:class:`CallPause` installs itself as the sim's ``on_call`` hook (called at the start of every public backend
call, before the backend's lock): the first call that matches blocks its thread until :meth:`CallPause.release`.
:class:`Runner` runs a function in its own thread. The bounded waits (:data:`SAFETY_TIMEOUT`) only keep a broken
implementation from hanging the run; nothing depends on timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Final, Generic, TypeVar

from kvoffload_ref.backends.base import Tag

__all__ = ["SAFETY_TIMEOUT", "CallPause", "Runner", "paused_or_done"]

T = TypeVar("T")

#: Longest a helper blocks (real seconds): a safety net, not a timing assumption.
SAFETY_TIMEOUT: Final = 10.0

Matcher = Callable[[str, "Tag | None"], bool]


class CallPause:
    """Blocks the first backend call for which ``match(point, tag)`` is True (in the calling thread) until released.

    Args:
        backend: anything with an ``on_call`` attribute (the sim).
        match: which call to pause; it runs in the calling thread (so it may test ``threading.current_thread()``).
        signal: also set once a thread is paused (shared with a :class:`Runner`: "paused, or finished").

    Attributes:
        reached: set once a thread is paused at the call.
    """

    def __init__(self, backend: object, match: Matcher, *, signal: threading.Event | None = None) -> None:
        self._backend = backend
        self._match = match
        self.reached = threading.Event()
        self._signal = signal
        self._go = threading.Event()
        self._lock = threading.Lock()
        self._taken = False
        self._previous: Callable[[str, Tag | None], None] | None = None

    def __enter__(self) -> CallPause:
        self._previous = getattr(self._backend, "on_call", None)
        self._backend.on_call = self._hook  # type: ignore[attr-defined]
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
        self._backend.on_call = self._previous  # type: ignore[attr-defined]

    def release(self) -> None:
        """Let the paused thread (and any later one) go on."""
        self._go.set()

    def _hook(self, point: str, tag: Tag | None) -> None:
        if self._previous is not None:
            self._previous(point, tag)
        if not self._match(point, tag):
            return
        with self._lock:
            mine, self._taken = not self._taken, True
        if mine:
            self.reached.set()
            if self._signal is not None:
                self._signal.set()
            if not self._go.wait(SAFETY_TIMEOUT):
                raise TimeoutError(f"paused at backend call {point!r} and never released")


class Runner(Generic[T]):
    """``fn`` running in its own (daemon) thread named ``name``: join it, then read its result or exception.
    ``signal`` (optional) is set when ``fn`` returns or raises."""

    def __init__(self, fn: Callable[[], T], name: str, *, signal: threading.Event | None = None) -> None:
        self._fn = fn
        self._signal = signal
        self.result: T | None = None
        # Invariant: what fn raised (BaseException included), or None.
        self.exception: BaseException | None = None
        # Invariant: set once fn returned or raised.
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:
            self.exception = exc
        finally:
            self.done.set()
            if self._signal is not None:
                self._signal.set()

    def join(self) -> bool:
        """Wait (bounded) for the thread; True if it finished."""
        self.thread.join(SAFETY_TIMEOUT)
        return not self.thread.is_alive()


def paused_or_done(signal: threading.Event) -> bool:
    """Wait (bounded) until ``signal`` is set: a thread paused, or the one that could pause finished."""
    return signal.wait(SAFETY_TIMEOUT)
