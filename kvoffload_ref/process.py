"""Which process owns a library object, so that a forked child leaves the parent's alone (R21).

A ``fork()`` copies every worker, region and shared-region object of the parent into the child, together with
their locks in whatever state they were (held, if another parent thread was inside a worker call). Nothing of
that is the child's: its pinned ranges, mappings and files are the parent's, and a lock the fork copied may have
no owner in the child. So every such object records the process that built it (:class:`ProcessOwner`) and, in
any other process, does nothing at all -- its public calls raise :class:`~kvoffload_ref.errors.WorkerClosedError`
naming the owner (:meth:`ProcessOwner.check`), and its finalizers, ``atexit`` hooks, ``shutdown()`` and
``release()`` return at once (:meth:`ProcessOwner.inherited`), before they touch a lock.

``os.getpid()`` is asked at every check (a system call of about 50 ns, no cache that a fork could leave stale),
so this works for ``os.fork()``, multiprocessing's ``fork`` start method and any C extension that forks alike.

*Cutting a shared file off in the child.* Doing nothing is not enough for a file whose open file description
carries OFD locks (``kvoffload_ref.shared_file``): a fork gives the child a reference to the parent's description
through every inherited descriptor -- the library's own and the one Python's ``mmap`` object keeps -- and through
every inherited ``MAP_SHARED`` mapping of the file. The kernel drops OFD locks only when the last reference goes,
so a child that merely lives on would keep the parent's rank and live locks held after the parent died (and, but
for the explicit unlock of ``SharedFile.close``, after it released them): it would count as a rank (R18). And
through the inherited mapping a stray write of the child would land in the parent's memory.
:func:`cut_off_from_children` registers such a file; in every child forked afterwards (``os.register_at_fork``:
``os.fork()`` and multiprocessing's ``fork``, not a C-level ``fork()`` Python is not told of), before anything
else runs there, every mapping of it is replaced by private zero-filled memory at the same address (the child's
views stay valid and see zeros; the parent's pages are untouched) and every descriptor of it is pointed at
``/dev/null`` (so whoever holds the descriptor number may still close it). The parent's own descriptors and
mappings are not touched: a child's close, munmap or exit can no longer affect them.

The other process-lifetime mechanics both workers use live here too: :func:`sigint_deferred` (a Ctrl-C held back
while a release runs, R14) and :func:`finalize_safely` (a finalizer the garbage collector may run at any
allocation, R15).

This module imports nothing of the package but the error taxonomy.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import logging
import mmap
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final, Protocol

from kvoffload_ref.errors import LifecycleError, WorkerClosedError

__all__ = [
    "CallGuard",
    "Deferring",
    "ProcessOwner",
    "SigintDeferred",
    "cut_off_from_children",
    "finalize_safely",
    "keep_in_children",
    "sigint_deferred",
]

logger = logging.getLogger("kvoffload_ref.process")


#: Invariant: this process's pid -- read at import and again first thing in every child forked afterwards
#: (``os.register_at_fork``: ``os.fork()`` and multiprocessing's ``fork``). R21's check compares it with an owner's
#: pid on every public call without a ``getpid`` system call (~0.1 us each). A C-level ``fork()`` Python is not told
#: of runs no hook and cannot run Python safely anyway (CPython's own state is not reset there either).
_PID = os.getpid()


def _refresh_pid() -> None:
    """``os.register_at_fork(after_in_child=...)``: the new child's pid, before anything else of the package runs."""
    global _PID  # noqa: PLW0603  # one pid for the process
    _PID = os.getpid()


if hasattr(os, "register_at_fork"):  # without it there is no fork either: the pid never changes
    os.register_at_fork(after_in_child=_refresh_pid)


class ProcessOwner:
    """The process that built an object (R21)."""

    __slots__ = ("pid",)

    def __init__(self) -> None:
        # Invariant: the pid of the process that built the object; fixed for its life.
        self.pid = os.getpid()

    def inherited(self) -> bool:
        """Whether this is a forked child's copy (the calling process is not the owner)."""
        return self.pid != _PID

    def check(self, what: str) -> None:
        """Refuse a call on an inherited copy.

        Args:
            what: the object, for the message (e.g. "this worker").

        Raises:
            WorkerClosedError: the calling process is not the owner (a forked child).
        """
        if self.pid != _PID:
            raise WorkerClosedError(
                f"{what} belongs to process {self.pid}; this process ({os.getpid()}) is a forked child, which must "
                "not use it (R21): build its own worker and region instead")


class Deferring(Protocol):
    """What :class:`CallGuard` guards: a worker's lock, its owner, and the shutdown a signal handler asked for."""

    lock: Any  # a threading.RLock
    owner: ProcessOwner
    shutdown_requested: bool
    deferred_cancel: set[int]

    def carry_out_deferred(self) -> None: ...


class CallGuard:
    """One public call of a worker under its lock (the mechanism of R19 and R21).

    Entering refuses a forked child (R21) and a re-entry on a thread already inside a call of the same worker -- a
    signal handler that interrupted it, where only ``shutdown()`` may be called (the worker defers it). Leaving
    releases the lock and then carries out the shutdown such a handler asked for.
    """

    __slots__ = ("_owner", "_worker")

    def __init__(self, worker: Deferring) -> None:
        self._worker = worker
        self._owner = worker.owner.pid  # Invariant: the worker's owning process (fixed for its life)

    def __enter__(self) -> None:
        worker = self._worker
        if self._owner != _PID:  # R21 (the owner's check, inline: every public call comes here)
            worker.owner.check("this worker")
        lock = worker.lock  # read each time: the conformance kit may wrap a worker's lock
        if lock._is_owned():
            raise LifecycleError("a worker method was called from a signal handler on a thread that is inside "
                                 "another call of the same worker; only shutdown() may be called there (R19)")
        lock.acquire()

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        worker = self._worker
        worker.lock.release()
        if (worker.shutdown_requested or worker.deferred_cancel) and not worker.lock._is_owned():
            worker.carry_out_deferred()


# -- cutting shared files off in forked children --------------------------------------------------------------------
Identity = tuple[int, int]

# Invariant: token -> (st_dev, st_ino) of every file registered by cut_off_from_children and not yet released by
# keep_in_children; plain dict operations only (atomic under the GIL), so no lock a fork could copy held.
_FILES: dict[int, Identity] = {}
_TOKENS = itertools.count(1)
#: MAP_FIXED: 0x10 on x86-64, arm64 and the other common Linux architectures (the mmap module does not export it).
_MAP_FIXED: Final = 0x10
_MapFn = Callable[[int, int, int, int, int, int], int | None]
# Invariant: libc's mmap, resolved in the parent the first time a file is registered (never imported in a child).
_LIBC_MMAP: list[_MapFn] = []


def _libc_mmap() -> _MapFn | None:
    if not _LIBC_MMAP:
        try:
            fn = ctypes.CDLL(None, use_errno=True).mmap
        except (OSError, AttributeError):  # pragma: no cover - every Linux libc has mmap
            return None
        fn.restype = ctypes.c_void_p
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
        _LIBC_MMAP.append(fn)
    return _LIBC_MMAP[0]


def cut_off_from_children(fd: int) -> int:
    """Cut the file open on ``fd`` off from every child forked from now on (see the module docstring).

    Args:
        fd: an open descriptor of the file (its ``st_dev``, ``st_ino`` name it; every descriptor and mapping of the
            same inode in a child is cut, the library's and Python's ``mmap`` object's alike).

    Returns:
        A token for :func:`keep_in_children` (call it once the parent no longer holds the file).

    Raises:
        OSError: ``fstat(fd)`` failed.
    """
    st = os.fstat(fd)
    _libc_mmap()
    token = next(_TOKENS)
    _FILES[token] = (st.st_dev, st.st_ino)
    return token


def keep_in_children(token: int) -> None:
    """Stop cutting the file of ``token`` off in children (the parent closed it); unknown tokens are ignored."""
    _FILES.pop(token, None)


def _cut_descriptors(identities: set[Identity]) -> int:
    """Point every descriptor of those files at /dev/null (close-on-exec). Returns how many."""
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    cut = 0
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd == devnull:
                continue
            try:
                st = os.fstat(fd)
            except OSError:  # the directory's own descriptor, closed meanwhile
                continue
            if (st.st_dev, st.st_ino) in identities:
                os.dup2(devnull, fd, inheritable=False)
                cut += 1
    finally:
        os.close(devnull)
    return cut


def _cut_mappings(identities: set[Identity]) -> int:
    """Replace every mapping of those files by private zero-filled memory at the same address. Returns how many."""
    remap = _libc_mmap()
    if remap is None:  # pragma: no cover - see _libc_mmap
        return 0
    with open("/proc/self/maps") as maps:
        lines = maps.read().splitlines()  # read it whole before changing what it describes
    cut = 0
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
    for line in lines:
        fields = line.split()
        if len(fields) < 5 or ":" not in fields[3]:
            continue
        major, minor = (int(part, 16) for part in fields[3].split(":"))
        if (os.makedev(major, minor), int(fields[4])) not in identities:
            continue
        low, high = (int(part, 16) for part in fields[0].split("-"))
        got = remap(low, high - low, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if got != low:
            raise OSError(ctypes.get_errno(), f"cannot replace the inherited mapping at {low:#x}")
        cut += 1
    return cut


def _cut_in_child() -> None:
    """``os.register_at_fork(after_in_child=...)``: cut every registered file off in this new child."""
    identities = set(_FILES.values())
    _FILES.clear()  # the parent's registrations are not this process's
    if not identities:
        return
    try:
        _cut_mappings(identities)
        _cut_descriptors(identities)
    except Exception:  # never fail the fork; the inherited objects stay inert in any case
        logger.error("Could not cut the parent's shared files off in forked child %d", os.getpid(), exc_info=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_cut_in_child)


# -- a Ctrl-C held back (R14) and a finalizer the collector may run (R15) ------------------------------------------
class SigintDeferred:
    """What :func:`sigint_deferred` held back."""

    def __init__(self) -> None:
        # Invariant: the KeyboardInterrupt that SIGINT would have raised meanwhile, or None.
        self.interrupt: BaseException | None = None


@contextlib.contextmanager
def sigint_deferred() -> Iterator[SigintDeferred]:
    """R14: hold back SIGINT (Ctrl-C) while a release runs, then deliver it to the previous handler.

    Only the main thread receives signals in Python, and only it may change their handlers; elsewhere (and when
    the application installed no Python-level SIGINT handler) this does nothing.

    Yields:
        Where the KeyboardInterrupt the previous handler raised on delivery is kept, for the caller to re-raise.
    """
    deferred = SigintDeferred()
    received: list[int] = []
    previous: Any = None
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, TypeError):
            previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield deferred
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if received and callable(previous):
        try:
            previous(signal.SIGINT, None)
        except BaseException as exc:  # the default handler raises KeyboardInterrupt: the caller re-raises it
            deferred.interrupt = exc


# Invariant: True while the cyclic garbage collector runs (set by _track_gc), in whichever thread runs it.
_GC_RUNNING = False


def _track_gc(phase: str, info: dict[str, int]) -> None:
    global _GC_RUNNING  # noqa: PLW0603  # one flag for the process: the collector is process-wide
    _GC_RUNNING = phase == "start"


gc.callbacks.append(_track_gc)


def finalize_safely(shutdown: Callable[[], object], timeout: float, what: str) -> None:
    """R15: run a dropped worker's ``shutdown``, safely from wherever a finalizer runs.

    The garbage collector may run a finalizer at any allocation, also while this thread holds a library lock (a
    ledger's, say). So when called from the collector, the shutdown runs in a thread of its own and this thread
    waits for it at most ``timeout`` plus a second: normally it has finished by then; if this thread held a lock the
    shutdown needs, the wait ends and the shutdown completes as soon as the lock is released, instead of
    deadlocking. An ``Exception`` from the shutdown is logged, never raised.

    Args:
        shutdown: the worker's shutdown.
        timeout: the shutdown's own bound (its policy's timeout).
        what: the worker's class name, for the log line.
    """

    def now() -> None:
        logger.warning("%s was not shut down; shutting it down from its finalizer", what)
        try:
            shutdown()
        except Exception:
            logger.error("Shutdown from the finalizer failed", exc_info=True)

    if not _GC_RUNNING:
        now()
        return
    thread = threading.Thread(target=now, name="kvoffload_ref-finalizer")
    thread.start()
    thread.join(min(timeout + 1.0, threading.TIMEOUT_MAX))  # join() refuses more (OverflowError)
