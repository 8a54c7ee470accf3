"""The lock check (R19): every write of a worker's or a handler's guarded state asserts the writer may write it.

R19's design (docs/architecture.md, "Concurrency") has one rule for who may change a worker's state and its two
handlers': **the thread holding the worker's lock, or -- once the worker is SHUTTING_DOWN -- the thread running
the shutdown sequence** (no other call touches the handlers then, so it drains and releases without the lock).
This module checks that rule at every write, deterministically: a write outside it raises
:class:`LockCheckError` at the write itself, in one single-threaded run, instead of waiting for an unlucky thread
switch in a stress test. Each one is also kept for :func:`take_violations`, so that one a caller swallowed (a
release step's error list, a finalizer's log) is still seen: the test suite asserts after every test that none was.

*What is guarded.* :func:`bind` names, for one object, the fields that follow the rule and the worker whose lock
guards them: ``reference.Core`` binds its own lifecycle fields (state, report, the shutdown thread, the deferred
shutdown) and each handler's fields named by ``handler_api.GUARDED`` (its lifecycle state, written by every
transition of the handler table). Before :func:`bind` -- while an object is being built and no other thread can
reach it -- its writes are free.

*When it is on.* Off by default: the library then runs exactly as without it (no descriptor is installed, so a
write is a plain attribute store). :func:`enable` switches it on for the process -- the conformance kit does so
when it is imported (``kvoffload_ref.testing``: the explorer, the machine, the campaigns and the test suite), and
so does the environment variable ``KVOFFLOAD_REF_LOCKCHECK=1`` at import. On, each guarded field of a bound
class is a data descriptor with ``__set__`` only (reads still go straight to the instance dict): one Python call
and the check per write.

This module imports nothing of the package but the lifecycle's states.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from kvoffload_ref.lifecycle import WorkerState

__all__ = ["LockCheckError", "LockedWorker", "bind", "disable", "enable", "enabled", "may_write", "suspended",
           "take_violations"]

#: The instance-dict key under which a bound object keeps (a weak reference to) the worker whose lock guards it.
_WORKER = "_lockcheck_worker"


class LockCheckError(AssertionError):
    """A guarded field was written by a thread the rule does not allow (a bug in the library, never the caller's)."""


class LockedWorker(Protocol):
    """What the check reads of the worker (``reference.Core``): its lock, its state and the shutdown thread."""

    lock: Any  # a threading.RLock
    state: WorkerState
    shutdown_thread: int | None


def may_write(worker: LockedWorker) -> bool:
    """R19: whether the calling thread may change the state of ``worker`` and of its handlers now.

    Args:
        worker: the worker whose lock guards the state.

    Returns:
        True if the thread holds the worker's lock, or the worker is SHUTTING_DOWN and the thread runs its shutdown.
    """
    if worker.lock._is_owned():
        return True
    return worker.state is WorkerState.SHUTTING_DOWN and worker.shutdown_thread == threading.get_ident()


class _Guard:
    """A guarded field: a data descriptor with ``__set__`` only, so reads find the value in the instance dict."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name  # Invariant: the attribute this guards (its value lives in the instance dict under it)

    def __set__(self, obj: object, value: object) -> None:
        ref = obj.__dict__.get(_WORKER)
        worker = None if ref is None else ref()
        if worker is not None and not may_write(worker):
            message = (f"{type(obj).__name__}.{self.name} written on thread {threading.get_ident()} without the "
                       f"worker's lock (worker {worker.state.name}): only the lock's holder, or the shutdown thread "
                       "once shutdown began, may change a worker's or its handlers' state (R19)")
            _VIOLATIONS.append(message)  # kept even if a caller on the way up swallows the error
            raise LockCheckError(message)
        obj.__dict__[self.name] = value


class _Unset:
    """Marks "no class attribute of that name"."""


_UNSET = _Unset()

# Invariant: every class an object was bound for -> the fields guarded on it; the descriptors are installed on
# these classes exactly while _ON[0] is True. Changed only by bind/enable/disable (the GIL serialises them).
_CLASSES: dict[type, frozenset[str]] = {}
_ON = [os.environ.get("KVOFFLOAD_REF_LOCKCHECK", "") == "1"]
# Invariant: the message of every LockCheckError raised since the last take_violations() (list.append is atomic).
_VIOLATIONS: list[str] = []


def _install(cls: type, fields: Iterable[str]) -> None:
    for name in fields:
        setattr(cls, name, _Guard(name))


def bind(obj: object, worker: LockedWorker, fields: Iterable[str]) -> None:
    """From now on, a write of any of ``fields`` of ``obj`` must follow :func:`may_write` for ``worker``.

    Args:
        obj: the worker itself or one of its handlers (an instance with a ``__dict__``), fully built.
        worker: the worker whose lock guards it (held weakly: binding creates no reference cycle).
        fields: instance fields of ``obj`` (never class attributes).

    Raises:
        TypeError: a field is a class attribute of ``obj``'s class (a guard would replace it).
    """
    cls, known = type(obj), _CLASSES.get(type(obj), frozenset())
    new = frozenset(fields) - known
    for name in new:
        if not isinstance(cls.__dict__.get(name, _UNSET), _Unset):
            raise TypeError(f"{cls.__name__}.{name} is a class attribute; the lock check guards instance fields")
    if new:
        _CLASSES[cls] = known | new
        if _ON[0]:
            _install(cls, new)
    obj.__dict__[_WORKER] = weakref.ref(worker)


def enable() -> None:
    """Switch the check on for this process (every bound class, and those bound later)."""
    if not _ON[0]:
        for cls, fields in _CLASSES.items():
            _install(cls, fields)
        _ON[0] = True


def disable() -> None:
    """Switch the check off: guarded writes are plain attribute stores again (values are kept)."""
    if _ON[0]:
        for cls, fields in _CLASSES.items():
            for name in fields:
                if isinstance(cls.__dict__.get(name), _Guard):
                    delattr(cls, name)
        _ON[0] = False


def enabled() -> bool:
    """Whether the check is on."""
    return _ON[0]


def take_violations() -> list[str]:
    """The messages of the ``LockCheckError`` s raised since the last call, oldest first -- also those a caller
    caught on the way up (a release step's error list, a finalizer's log) -- and forget them."""
    taken = _VIOLATIONS[:]
    del _VIOLATIONS[:len(taken)]
    return taken


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Switch the check off for a block, then back to what it was (for a deliberately wrong worker whose lock
    cannot say which thread holds it, so the rule cannot be asked)."""
    was = _ON[0]
    disable()
    try:
        yield
    finally:
        if was:
            enable()
