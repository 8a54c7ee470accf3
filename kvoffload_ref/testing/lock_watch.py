"""A worker's lock, watched: the pair explorer's seam for seeing a thread block on it (R19).

Both of kvoffload_ref's workers run ``reference.Core``, whose one lock (a reentrant lock, ``Core.lock``) every
public call takes and whose condition (``Core.done``, over that lock) a second ``shutdown()`` waits on for the
first one's report. :func:`watch_lock` replaces the two on a freshly built worker, before any thread uses it, by a
:class:`WatchedLock` over the same reentrant lock and a condition over it. The watched lock behaves exactly as the
lock it wraps; it tells a :class:`LockWatcher` when a thread is about to *block* (a try to take it failed), when a
thread gives it up to wait on the condition, and when that thread was woken and is about to take it back. So
"thread B blocks on the lock" is detected as it happens, never guessed from a timeout.

Nothing in the library imports this module: production code keeps its plain ``threading.RLock``.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

__all__ = ["LockWatcher", "WatchedLock", "watch_lock"]


class LockWatcher(Protocol):
    """What a :class:`WatchedLock` tells (each call runs in the thread concerned, holding no lock of the worker).

    ``blocking()``: the thread is about to block taking the lock (it may hold the thread back first).
    ``waiting()``: the thread gave the lock up to wait on the worker's condition (it must not block).
    ``woken()``: that thread was notified and is about to take the lock back (it may hold the thread back first).
    """

    def blocking(self) -> None: ...
    def waiting(self) -> None: ...
    def woken(self) -> None: ...


class WatchedLock:
    """A reentrant lock that reports blocking to a :class:`LockWatcher`; otherwise exactly the lock it wraps.

    Args:
        inner: the worker's own reentrant lock (still the one that excludes).
        watcher: told when a thread blocks on it, waits on a condition over it, or is woken.
    """

    def __init__(self, inner: Any, watcher: LockWatcher) -> None:
        self._inner = inner  # Invariant: the worker's RLock; every acquire and release goes to it
        self._watcher = watcher  # Invariant: told before a blocking acquire, after a condition's release, on wake

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock; a try that would block tells the watcher first."""
        if self._inner.acquire(False):
            return True
        if not blocking:
            return False
        self._watcher.blocking()
        return bool(self._inner.acquire(True, timeout))

    def release(self) -> None:
        self._inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _is_owned(self) -> bool:
        """Whether the calling thread holds it (what ``Core`` and ``CallGuard`` ask)."""
        return bool(self._inner._is_owned())

    # threading.Condition's protocol for a reentrant lock: give it up wholly, take it back at the same depth.
    def _release_save(self) -> Any:
        saved = self._inner._release_save()
        self._watcher.waiting()
        return saved

    def _acquire_restore(self, saved: Any) -> None:
        self._watcher.woken()
        self._inner._acquire_restore(saved)


def watch_lock(worker: object, watcher: LockWatcher) -> WatchedLock:
    """Put a :class:`WatchedLock` in place of a fresh worker's lock (and its condition over a new one).

    Call it before any other thread uses the worker.

    Args:
        worker: a worker built on ``reference.Core`` (both of kvoffload_ref's are: ``worker._core``).
        watcher: what the lock tells.

    Returns:
        The watched lock now in place.

    Raises:
        TypeError: the worker is not built on ``reference.Core`` (its lock cannot be watched).
    """
    core = getattr(worker, "_core", None)
    inner = getattr(core, "lock", None)
    if inner is None or not hasattr(inner, "_release_save") or not hasattr(core, "done"):
        raise TypeError(f"worker: {type(worker).__name__} is not built on kvoffload_ref.reference.Core: the pair "
                        "explorer watches that worker's lock (Core.lock) to see a thread block on it; expected a "
                        "worker that create_reference_worker built (e.g. the factory "
                        "kvoffload_ref.testing.adapter:reference_factory)")
    watched = WatchedLock(inner, watcher)
    core.lock = watched  # type: ignore[union-attr]
    core.done = threading.Condition(watched)  # type: ignore[union-attr, arg-type]
    return watched
