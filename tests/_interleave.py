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
from types import TracebackType
from typing import Any, Generic, TypeVar

from kvoffload_ref.backends.base import CALL_POINTS, Tag

T = TypeVar("T")

#: Longest a helper blocks (seconds): a safety net against a hung test, not a timing assumption.
SAFETY_TIMEOUT = 10.0


class Pause:
    """Blocks the ``nth`` call at ``point`` matching ``direction``/``job_id`` (in any thread) until released.

    Args:
        backend: a SimBackend or FaultyBackend (anything with an ``on_call`` attribute).
        point: a point name (``"copy"``, ``"record"``, ``"event_query"``...) or a method name that maps to one
            (``"copy_batch"``, ``"query"``, ``"synchronize"``, ``"prove_idle"``...).
        direction, job_id: match the call's tag (a set selector never matches an untagged call).
        nth: pause the nth matching call (1-based); later matching calls pass through.

    Attributes:
        reached: set once a thread is paused at the call.
        calls: the matching calls seen so far.
    """

    def __init__(self, backend: Any, point: str, *, direction: str | None = None, job_id: int | None = None,
                 nth: int = 1) -> None:
        if nth < 1:
            raise ValueError("nth is 1-based")
        self._backend = backend
        self.point = CALL_POINTS.get(point, point)
        self._direction, self._job_id, self._nth = direction, job_id, nth
        self.reached = threading.Event()
        self._go = threading.Event()
        self._lock = threading.Lock()
        self.calls = 0
        self._previous: Callable[[str, Tag | None], None] | None = None
        self.paused_thread: threading.Thread | None = None

    def __enter__(self) -> Pause:
        self._previous = self._backend.on_call
        self._backend.on_call = self._hook
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
        self._backend.on_call = self._previous

    def release(self) -> None:
        """Let the paused thread (and any later one) go on."""
        self._go.set()

    def _matches(self, point: str, tag: Tag | None) -> bool:
        if point != self.point:
            return False
        if self._direction is None and self._job_id is None:
            return True
        if tag is None:
            return False
        return (self._direction in (None, tag[0])) and (self._job_id in (None, tag[1]))

    def _hook(self, point: str, tag: Tag | None) -> None:
        if self._previous is not None:
            self._previous(point, tag)
        if not self._matches(point, tag):
            return
        with self._lock:
            self.calls += 1
            mine = self.calls == self._nth
        if mine:
            self.paused_thread = threading.current_thread()
            self.reached.set()
            if not self._go.wait(SAFETY_TIMEOUT):
                raise TimeoutError(f"Pause at {self.point}: never released")


class Handle(Generic[T]):
    """A function running in its own thread: join it, then read its result or exception."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._result: T | None = None
        # Invariant: what fn raised (BaseException included), or None.
        self.exception: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:
            self.exception = exc

    def join(self, timeout: float = SAFETY_TIMEOUT) -> bool:
        """Wait (bounded) for the thread; True if it finished."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def done(self) -> bool:
        """Whether the thread finished."""
        return not self._thread.is_alive()

    def result(self) -> T:
        """The function's return value; re-raises what it raised.

        Raises:
            RuntimeError: the thread has not finished.
        """
        if self._thread.is_alive():
            raise RuntimeError("the thread is still running")
        if self.exception is not None:
            raise self.exception
        return self._result  # type: ignore[return-value]


def run_in_thread(fn: Callable[[], T]) -> Handle[T]:
    """Start ``fn()`` in a new daemon thread; returns its :class:`Handle`."""
    return Handle(fn)
