"""Deterministic thread interleavings: pause a thread at a chosen backend call, act, then let it go on.

Usage::

    with Pause(be, "copy", direction="store", job_id=3) as pause:
        worker_thread = run_in_thread(lambda: w.submit_store(3, gpu_spec, cpu_spec))
        assert pause.reached.wait(timeout=10)     # the submitting thread now sits at its copy_batch call
        report = w.shutdown()                      # whatever must happen at that moment
        pause.release()
    worker_thread.join(10)

The hook runs before the backend takes its lock, so the paused thread holds no backend lock. The bounded waits
only keep a broken test from hanging CI; nothing here depends on timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from kvoffload_ref.backends.base import CALL_POINTS, Tag
from kvoffload_ref.testing.threads import SAFETY_TIMEOUT, CallPause, Runner

__all__ = ["SAFETY_TIMEOUT", "Handle", "Pause", "run_in_thread"]

T = TypeVar("T")


class Pause(CallPause):
    """Blocks the ``nth`` call at ``point`` matching ``direction``/``job_id`` (in any thread) until released.

    The conformance kit's :class:`~kvoffload_ref.testing.threads.CallPause` with a matcher by point, tag and count.

    Args:
        backend: a SimBackend or FaultyBackend (anything with an ``on_call`` attribute).
        point: a point name (``"copy"``, ``"record"``, ``"event_query"``...) or a method name that maps to one
            (``"copy_batch"``, ``"query"``, ``"synchronize"``, ``"prove_idle"``...).
        direction, job_id: match the call's tag (a set selector never matches an untagged call).
        nth: pause the nth matching call (1-based); later matching calls pass through.

    Attributes:
        reached: set once a thread is paused at the call.
        calls: the matching calls seen so far.
        paused_thread: the thread paused (None until one is).
    """

    def __init__(self, backend: Any, point: str, *, direction: str | None = None, job_id: int | None = None,
                 nth: int = 1) -> None:
        if nth < 1:
            raise ValueError("nth is 1-based")
        super().__init__(backend, self._counts)
        self.point = CALL_POINTS.get(point, point)
        self._direction, self._job_id, self._nth = direction, job_id, nth
        self._count_lock = threading.Lock()
        self.calls = 0
        self.paused_thread: threading.Thread | None = None

    def _matches(self, point: str, tag: Tag | None) -> bool:
        if point != self.point:
            return False
        if self._direction is None and self._job_id is None:
            return True
        if tag is None:
            return False
        return (self._direction in (None, tag[0])) and (self._job_id in (None, tag[1]))

    def _counts(self, point: str, tag: Tag | None) -> bool:
        """The matcher: True for the nth matching call only (it runs in the calling thread)."""
        if not self._matches(point, tag):
            return False
        with self._count_lock:
            self.calls += 1
            mine = self.calls == self._nth
        if mine:
            self.paused_thread = threading.current_thread()
        return mine


class Handle(Generic[T]):
    """A function running in its own thread (the kit's :class:`~kvoffload_ref.testing.threads.Runner`): join it,
    then read its result or exception."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._runner: Runner[T] = Runner(fn, "test-thread")

    @property
    def exception(self) -> BaseException | None:
        """What the function raised (BaseException included), or None."""
        return self._runner.exception

    def join(self, timeout: float = SAFETY_TIMEOUT) -> bool:
        """Wait (bounded) for the thread; True if it finished."""
        self._runner.thread.join(timeout)
        return not self._runner.thread.is_alive()

    @property
    def done(self) -> bool:
        """Whether the function returned or raised."""
        return self._runner.done.is_set()

    def result(self) -> T:
        """The function's return value; re-raises what it raised.

        Raises:
            RuntimeError: the thread has not finished.
        """
        if not self._runner.done.is_set():
            raise RuntimeError("the thread is still running")
        if self._runner.exception is not None:
            raise self._runner.exception
        return self._runner.result  # type: ignore[return-value]


def run_in_thread(fn: Callable[[], T]) -> Handle[T]:
    """Start ``fn()`` in a new daemon thread; returns its :class:`Handle`."""
    return Handle(fn)
