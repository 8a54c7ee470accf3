"""The file behind a SharedRegion: its header, its OFD locks, and the create/join/unlink handshake (R17, R18).

Theory of operation
-------------------
*The file* is ``<directory>/kvoffload_ref_<engine_id>.mmap``. Its header page holds a magic, a state (CREATING,
READY), the geometry and one "mapped" byte per rank. Open-file-description (OFD) byte-range locks carry the
protocol; the kernel drops them when the descriptor is closed or its process dies, even on SIGKILL:

* the *gate* (byte 0, exclusive, held for a few system calls): every decision about the file -- admitting a rank,
  marking it mapped, unlinking -- is taken under it, right after checking that the path still names the inode
  this descriptor holds open;
* the *live* lock (byte 1, shared): held by every admitted opener until it gives up the name (release,
  quarantine) or dies;
* the *rank* locks (byte 64 + r, exclusive): held by rank r's opener until its descriptor closes, so a second
  live opener of the same rank is refused.

*Creation* (R17) is atomic publication: the creator builds the whole file under a temporary name in the same
directory, ``.<name>.<pid>.<8 hex digits>.tmp`` (``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600; admitted on it at
once, so it holds locks from its first step; free space checked; ``ftruncate`` to the full size; header READY),
then ``link``s it to the path -- which fails with EEXIST, never replacing anything, if a file is already there
(another creator won, or a stale or foreign file: the temporary name is dropped and the file joined) -- and
unlinks the temporary name. The path therefore only ever names a complete, READY file whose creator is admitted:
a creator killed at any step leaves at most its temporary file, which blocks nobody; the next open of the engine
id removes it (its pid names no process and nobody holds a lock on it). Joiners open with ``O_NOFOLLOW`` (a
symlink fails with ELOOP at once, never waited on), check under the gate that it is READY (a file of an earlier
version's creator may still say CREATING: polled, bounded by ``timeout``), compare the geometry, and are
admitted. A file at the path without our magic, empty or not, is refused at once and left untouched.

*Unlink* (R18): after mapping, a rank sets its mapped byte under the gate; the one that completes the set unlinks.
At release (and quarantine) a rank drops its live lock under the gate and, if no other live opener remains, unlinks.
Every unlink is taken under the gate and only while ``lstat(path)`` shows the ``(st_dev, st_ino)`` of the descriptor
still open, so the inode number cannot have been reused and a stranger's file is never removed.

*Stale files*: a file with our magic and no live opener was left by an engine whose processes all died; an opener
finds it under the gate, unlinks it (same inode check) and starts over with ``O_EXCL``.

Waiting uses real time (``time.monotonic``), not the backend clock: the peers are other processes. A release waits
for the gate at most the region's ``timeout``, RELEASE_GATE_TIMEOUT, and what its caller has left (a worker's
shutdown passes the rest of its policy's timeout, R11). Linux only (OFD locks); see docs/shared-region.md for the
protocol diagram and the failure cases.

This module holds no region: :class:`SharedFile` is one descriptor and the protocol steps taken through it, and
:func:`open_file` creates or joins a file for a geometry. ``kvoffload_ref.shared_region`` maps it and makes the
region.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import time
from collections.abc import Iterator
from typing import Final, Protocol

from kvoffload_ref.backends.base import Ledger
from kvoffload_ref.errors import DeadlineExceeded, InvalidTransferError, LifecycleError, OwnershipError
from kvoffload_ref.process import ProcessOwner, cut_off_from_children, keep_in_children

__all__ = [
    "HEADER_BYTES",
    "MAX_WORLD_SIZE",
    "RELEASE_GATE_GRACE",
    "RELEASE_GATE_TIMEOUT",
    "TEMP_NAME_EXTRA",
    "FileGeometry",
    "SharedFile",
    "open_file",
    "pack_header",
]

logger = logging.getLogger("kvoffload_ref.shared_file")

#: The header page at the start of the file; the data rows start after it.
HEADER_BYTES: Final = mmap.PAGESIZE
_RANK_BYTES: Final = 64  # offset of the per-rank "mapped" bytes in the header, and of the rank locks
MAX_WORLD_SIZE: Final = HEADER_BYTES - _RANK_BYTES
#: The longest a release waits for the gate (held by live peers for a few system calls only); never longer than
#: the region's ``timeout``, nor than what is left of a worker's shutdown timeout (R11, see ``give_up_name``).
RELEASE_GATE_TIMEOUT: Final = 2.0
#: What a release may still wait for the gate once the caller's budget is spent (R11's small constant): a live peer
#: holds it for a few system calls; a frozen one costs this much, not RELEASE_GATE_TIMEOUT.
RELEASE_GATE_GRACE: Final = 0.05
#: Bytes a creator's temporary name adds to the file's name: ``.<name>.<pid>.<8 hex digits>.tmp`` (a pid has at
#: most 7 digits on Linux, ``pid_max`` <= 2**22).
TEMP_NAME_EXTRA: Final = len(".") + len(".4194304") + len(".0123abcd") + len(".tmp")
_POLL_SECONDS: Final = 0.005  # upstream's joiner poll interval
_GATE_POLL_SECONDS: Final = 0.0005

_MAGIC: Final = b"KVOREF\x00\x01"
# magic, state, world_size, replicated, layout crc, num_chunks, row_stride, slice_bytes, data_offset, file_size
_HEADER: Final = struct.Struct("<8sIIII5Q")
_CREATING, _READY = 1, 2
_GATE_BYTE, _LIVE_BYTE = 0, 1
# struct flock on 64-bit Linux: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid (+ padding).
_FLOCK: Final = struct.Struct("hh4xqqi4x")


class FileGeometry(Protocol):
    """What the handshake needs of a geometry: the header fields a joiner compares and the file's size."""

    @property
    def file_size(self) -> int:
        """The full size of the file (the last header field)."""

    def fields(self) -> tuple[int, ...]:
        """The geometry fields the header records (everything that fixes where bytes lie)."""


def pack_header(state: int, fields: tuple[int, ...]) -> bytes:
    """The header bytes for a geometry's ``fields`` in ``state`` (CREATING or READY)."""
    return _HEADER.pack(_MAGIC, state, *fields)


_FIELD_NAMES: Final = ("world_size", "replicated", "layout_crc", "num_chunks", "row_stride", "slice_bytes",
                       "data_offset", "file_size")


def _mismatch(path: str, theirs: tuple[int, ...], ours: tuple[int, ...], size: int) -> str | None:
    """Why the file does not fit this rank's geometry (None if it does)."""
    diffs = [f"{n}: file {a}, this rank {b}" for n, a, b in zip(_FIELD_NAMES, theirs, ours, strict=True) if a != b]
    if size != ours[-1]:
        diffs.append(f"size: file {size} bytes, this rank expects {ours[-1]}")
    if not diffs:
        return None
    return f"geometry mismatch between ranks for {path}: " + "; ".join(diffs)


# -- OFD byte-range locks -----------------------------------------------------------------------------------------
def _set_lock(fd: int, kind: int, byte: int) -> bool:
    """Take, convert or drop (``F_UNLCK``) an OFD lock on one byte without waiting.

    Returns:
        False if another open file description holds a conflicting lock, else True.
    """
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _unlock_all(fd: int) -> None:
    """Drop every OFD lock of ``fd``'s open file description (``l_len`` 0: to the end of the file and beyond)."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 0, 0))


def _held_elsewhere(fd: int, byte: int) -> bool:
    """Whether another open file description (in any process) holds a lock on ``byte``."""
    probe = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return bool(_FLOCK.unpack(probe)[0] != fcntl.F_UNLCK)


# -- one open descriptor of the file ------------------------------------------------------------------------------
class SharedFile:
    """One descriptor of the shared file, its locks, and the protocol steps taken through it.

    Holds no reference to a region, so a region's finalizer may hold it.

    In a forked child (R21) it is inert: the steps that give something up (:meth:`give_up_name`, :meth:`close`,
    :meth:`quarantine`, :meth:`abandon`) return at once, touching neither a lock nor the
    ledger, and the steps that would act on the file (:attr:`fileno`, hence every lock, and :meth:`unlink_if_ours`)
    raise ``WorkerClosedError``. The child's copies of the descriptor and of the mapping are cut off at the fork
    (``kvoffload_ref.process.cut_off_from_children``), so the child holds none of the parent's OFD locks either.
    """

    def __init__(self, fd: int, path: str, rank: int, ledger: Ledger, *, lock_timeout: float = RELEASE_GATE_TIMEOUT,
                 temp: bool = False) -> None:
        # Invariant: the process that opened the descriptor; in any other (a forked child) this object is inert.
        self.owner = ProcessOwner()
        st = os.fstat(fd)
        # Invariant: open from construction until close(); then None.
        self.fd: int | None = fd
        # Invariant: the name the protocol acts on: the file's path, or the creator's temporary name until publish().
        self.path = path
        # Invariant: the creator's temporary name while it may still name our inode (building, or published but
        # not yet unlinked); None for a joiner and once dropped.
        self.temp: str | None = path if temp else None
        # Invariant: the most real seconds a release waits for the gate (the region's timeout), >= 0.
        self.lock_timeout = lock_timeout
        # Invariant: (st_dev, st_ino) of the inode fd refers to; stable while fd is open.
        self.identity = (st.st_dev, st.st_ino)
        self.rank = rank
        # Invariant: True from admission until the name is given up (release, quarantine, failed open).
        self.live = False
        self._ledger = ledger
        # Invariant: this descriptor's "shm_file" ledger entry (live, or quarantined, until close).
        self._key = (st.st_dev, st.st_ino, fd)
        ledger.acquire("shm_file", self._key)
        # Invariant: registered with the fork hook while fd is open (every child forked meanwhile gets no reference
        # to this open file description, hence none of its locks); dropped by close().
        self._cut = cut_off_from_children(fd)

    @classmethod
    def wrap(cls, fd: int, path: str, rank: int, ledger: Ledger, *, lock_timeout: float = RELEASE_GATE_TIMEOUT,
             temp: bool = False) -> SharedFile:
        """Own ``fd``: close it if the wrapping fails."""
        try:
            return cls(fd, path, rank, ledger, lock_timeout=lock_timeout, temp=temp)
        except BaseException:
            os.close(fd)
            raise

    @property
    def fileno(self) -> int:
        """The open descriptor.

        Raises:
            LifecycleError: it was closed. WorkerClosedError: this is a forked child's copy (R21).
        """
        self.owner.check(f"the descriptor of {self.path}")
        if self.fd is None:
            raise LifecycleError(f"the descriptor of {self.path} is closed")
        return self.fd

    def names_inode(self, path: str | None = None) -> bool:
        """Whether ``path`` (default: :attr:`path`) still names, without following links, the inode this descriptor
        holds open."""
        try:
            st = os.stat(self.path if path is None else path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.identity

    def publish(self, path: str) -> bool:
        """Creator (R17): link the whole, READY file from its temporary name to ``path`` -- atomic, and never over
        an existing name (``link`` fails with EEXIST; it follows no symlink) -- then drop the temporary name.

        Returns:
            True: ``path`` names this inode now. False: something already is at ``path`` (another creator won, a
            stale or a foreign file): nothing was linked, the temporary name is dropped; join (or replace) it.

        Raises:
            OSError: the link failed otherwise (the temporary name is still ours: :meth:`abandon` drops it).
        """
        assert self.temp is not None  # Invariant: only a creator's temporary file is published
        try:
            os.link(self.temp, path, follow_symlinks=False)
        except FileExistsError:
            self.drop_temp()
            return False
        self.path = path
        self.drop_temp()
        return True

    def drop_temp(self) -> None:
        """Unlink the creator's temporary name if it still names this inode (never a stranger's file); once."""
        temp, self.temp = self.temp, None
        if temp is not None and self.names_inode(temp):
            os.unlink(temp)

    def others_live(self) -> bool:
        """Whether another open description (another process, or another opener in this one) holds the live lock."""
        return _held_elsewhere(self.fileno, _LIVE_BYTE)

    @contextlib.contextmanager
    def gate(self, deadline: float) -> Iterator[None]:
        """Hold the gate lock, polling (never blocking) until ``deadline`` (at least one try).

        Raises:
            DeadlineExceeded: another process held it until the deadline.
        """
        while not _set_lock(self.fileno, fcntl.F_WRLCK, _GATE_BYTE):
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"gave up waiting for the lock of {self.path}: another process holds it")
            time.sleep(_GATE_POLL_SECONDS)
        try:
            yield
        finally:
            _set_lock(self.fileno, fcntl.F_UNLCK, _GATE_BYTE)

    def admit(self) -> None:
        """Under the gate: take this rank's lock, then the live lock.

        Raises:
            OwnershipError: another live opener holds this rank.
        """
        if not _set_lock(self.fileno, fcntl.F_WRLCK, _RANK_BYTES + self.rank):
            raise OwnershipError(f"rank {self.rank} of {self.path} is already open in a live process "
                                 "(a second opener for the same rank is refused)")
        if not _set_lock(self.fileno, fcntl.F_RDLCK, _LIVE_BYTE):  # pragma: no cover - nobody write-locks it
            raise OSError(errno.EAGAIN, f"cannot take the live lock of {self.path}", self.path)
        self.live = True

    def unlink_if_ours(self) -> bool:
        """Under the gate: unlink the path if it still names our inode (R18). Returns whether it did.

        Raises:
            WorkerClosedError: this is a forked child's copy (R21).
        """
        self.owner.check(f"the descriptor of {self.path}")
        if not self.names_inode():
            return False
        os.unlink(self.path)
        logger.info("Removed mmap file %s", self.path)
        return True

    def mark_mapped(self, world_size: int, deadline: float) -> None:
        """Record that this rank mapped the file; the rank completing the set unlinks it (R18)."""
        with self.gate(deadline):
            os.pwrite(self.fileno, b"\x01", _RANK_BYTES + self.rank)
            mapped = os.pread(self.fileno, world_size, _RANK_BYTES)
            if len(mapped) == world_size and all(mapped):
                self.unlink_if_ours()

    def give_up_name(self, wait: float | None = None) -> list[str]:
        """Stop counting as a live opener; unlink the file if no other live opener remains (R3, R18).

        Never raises: a failure is logged and returned (the live lock is dropped in any case). Nothing in a forked
        child (R21): an unlock there would drop the parent's lock, the description being the same.

        Args:
            wait: the real seconds the caller can still spend (a worker's shutdown: what is left of its policy's
                timeout, R11); None: no budget of its own. The gate is waited for at most :attr:`lock_timeout`
                (the region's ``timeout``) and RELEASE_GATE_TIMEOUT, and at most ``wait`` -- though
                RELEASE_GATE_GRACE at least. When a peer holds it longer (a frozen process), the name step is
                skipped: the file is left for the next open, which replaces it once no opener is live.
        """
        if not self.live or self.fd is None or self.owner.inherited():
            return []
        limit = min(self.lock_timeout, RELEASE_GATE_TIMEOUT)
        if wait is not None:
            limit = min(limit, max(wait, RELEASE_GATE_GRACE))
        try:
            with self.gate(time.monotonic() + limit):
                _set_lock(self.fileno, fcntl.F_UNLCK, _LIVE_BYTE)
                self.live = False
                if not self.others_live():
                    self.unlink_if_ours()
        except (OSError, DeadlineExceeded) as exc:
            logger.error("Failed to give up the name of mmap file %s: %s", self.path, exc)
            return [f"unlink of {self.path} failed: {exc}"]
        finally:
            if self.live:
                _set_lock(self.fileno, fcntl.F_UNLCK, _LIVE_BYTE)
                self.live = False
        return []

    def quarantine(self) -> None:
        """Keep the descriptor (and its rank lock) until process exit (R12/R18). Nothing in a forked child (R21)."""
        if self.owner.inherited():
            return
        self._ledger.quarantine("shm_file", self._key)

    def close(self) -> list[str]:
        """Drop all this descriptor's locks, then close it; idempotent. A failure is logged and returned.

        The locks are dropped explicitly: closing drops them only with the last reference to the open file
        description, and a mapping kept alive (a view still exported) or a child forked a moment ago (until the
        fork hook cut its copies off) may still hold one. Nothing in a forked child (R21): the descriptor is the
        parent's, and an unlock there would drop the parent's locks.
        """
        if self.owner.inherited():
            return []
        fd, self.fd = self.fd, None
        if fd is None:
            return []
        self.live = False
        self._ledger.release("shm_file", self._key)
        with contextlib.suppress(OSError):  # then closing the last reference drops them anyway
            _unlock_all(fd)
        try:
            os.close(fd)
        except OSError as exc:
            logger.warning("Failed to close the descriptor of mmap file %s: %s", self.path, exc)
            return [f"close of {self.path} failed: {exc}"]
        finally:
            keep_in_children(self._cut)  # after the close: a child forked before it still gets its copy cut
        return []

    def abandon(self, wait: float | None = None) -> list[str]:
        """Give up the name (within ``wait``, see :meth:`give_up_name`), then close: what a release, a failed open
        and a finalizer do; a creator's temporary name is dropped too. Nothing in a forked child (R21)."""
        if self.owner.inherited():
            return []
        failures = self.give_up_name(wait)
        try:
            self.drop_temp()
        except OSError as exc:
            logger.error("Failed to remove the temporary file of %s: %s", self.path, exc)
            failures.append(f"unlink of the temporary file of {self.path} failed: {exc}")
        return failures + self.close()


# -- opening: create or join (R17) ----------------------------------------------------------------------------------
def _check_free_space(directory: str, needed: int, path: str) -> None:
    """Fail fast (upstream PR #50358) when the directory cannot hold the file."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise OSError(errno.ENOSPC, f"not enough space in {directory} for shared region {path}: "
                      f"needs {needed} bytes, {free} bytes free", path)


def _size_file(fd: int, size: int) -> None:
    """Give the file its full size (a separate step so tests can stop a creator before it)."""
    os.ftruncate(fd, size)


def temp_name(path: str) -> str:
    """A creator's temporary name for ``path``: ``.<name>.<pid>.<8 hex digits>.tmp`` in the same directory (hidden,
    recognisable as this file's, naming the process that builds it; the random part keeps two creators of one
    process apart)."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _temp_pattern(path: str) -> re.Pattern[str]:
    """The temporary names of ``path``'s creators (group 1: the creator's pid)."""
    return re.compile(re.escape(f".{os.path.basename(path)}.") + r"(\d+)\.[0-9a-f]{8}\.tmp")


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (this one included; one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temp(temp: str) -> None:
    """Unlink a dead creator's temporary file: ours (a regular file of this user), no lock held on it (its creator
    is admitted from its first step on, so a live one holds some), and still the inode checked (R18's rule)."""
    try:
        fd = os.open(temp, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:  # gone meanwhile, a symlink, not ours to open: left alone
        return
    try:
        st = os.fstat(fd)
        probe = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        held = _FLOCK.unpack(probe)[0] != fcntl.F_UNLCK
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or held:
            return
        now = os.stat(temp, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(temp)
            logger.warning("Removed stale temporary file %s: its creator died before publishing it", temp)
    except OSError as exc:
        logger.warning("Could not remove stale temporary file %s: %s", temp, exc)
    finally:
        os.close(fd)


def clean_stale_temps(path: str) -> None:
    """Remove the temporary files that creators of ``path`` left when they died before publishing it: those whose
    pid names no process and on which nobody holds a lock. Never raises (a directory it cannot list is skipped)."""
    pattern = _temp_pattern(path)
    directory = os.path.dirname(path) or "."
    try:
        with os.scandir(directory) as entries:
            found = [(e.path, int(m[1])) for e in entries if (m := pattern.fullmatch(e.name))]
    except OSError:
        return
    for temp, pid in found:
        if not _pid_alive(pid):
            _remove_stale_temp(temp)


def _create(path: str, geometry: FileGeometry, rank: int, ledger: Ledger, directory: str,
            timeout: float) -> SharedFile | None:
    """Creator (R17): build the whole file under a temporary name, then publish it (:meth:`SharedFile.publish`),
    so that ``path`` never names a file that is not complete and READY.

    The temporary file is created ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600; the creator is admitted on it at once
    (rank and live locks: from then on it is recognisably in use), checks the free space, sizes it, writes the
    header READY and links it into place. A creator killed at any step leaves at most its temporary file, which
    blocks nobody and is removed by the next open (:func:`clean_stale_temps`).

    Returns:
        The admitted descriptor of the published file; None if something already is at ``path`` (join it).
    """
    while True:
        temp = temp_name(path)
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:  # the random part collided (or a dead process with our pid left one): draw again
            continue
        break
    shared = SharedFile.wrap(fd, temp, rank, ledger, lock_timeout=timeout, temp=True)
    try:
        os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask
        shared.admit()
        _check_free_space(directory, geometry.file_size, path)
        _size_file(fd, geometry.file_size)
        os.pwrite(fd, pack_header(_READY, geometry.fields()), 0)
        published = shared.publish(path)
    except BaseException:
        shared.abandon()
        raise
    if published:
        return shared
    shared.close()
    return None


def _open_existing(path: str, rank: int, ledger: Ledger, timeout: float) -> SharedFile | None:
    """Open an existing file without following a symlink (R17); None if it vanished meanwhile.

    Raises:
        OSError: ELOOP for a symlink (at once); FileExistsError for something that is not our regular file.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"refusing {path}: it is a symbolic link (R17)", path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise FileExistsError(errno.EEXIST, f"refusing {path}: not a regular file of this user", path)
    return SharedFile.wrap(fd, path, rank, ledger, lock_timeout=timeout)


def _inspect(shared: SharedFile, geometry: FileGeometry, deadline: float) -> tuple[str, str]:
    """Joiner, under the gate: ("admitted" | "restart" | "wait", what was seen).

    Raises:
        FileExistsError: the file is not a kvoffload_ref region (it is left alone).
        InvalidTransferError: geometry mismatch. OwnershipError: this rank is open in a live process.
    """
    with shared.gate(deadline):
        if not shared.names_inode():
            return "restart", "the file was removed or replaced"
        size = os.fstat(shared.fileno).st_size
        raw = os.pread(shared.fileno, _HEADER.size, 0)
        if len(raw) < _HEADER.size or raw[:len(_MAGIC)] != _MAGIC:
            # R17: creators publish whole files, so a file without our magic, empty or not, is not ours.
            what = "not a kvoffload_ref region" if size else "an empty file, not a published kvoffload_ref region"
            raise FileExistsError(errno.EEXIST, f"refusing {shared.path}: {what} (left untouched)", shared.path)
        _, state, *fields = _HEADER.unpack(raw)
        if not shared.others_live():
            logger.warning("Found stale mmap file %s: no live process holds it (its engine died)", shared.path)
            shared.unlink_if_ours()
            return "restart", "stale file removed"
        if state != _READY:  # only an earlier version's creator publishes a file before it is READY
            return "wait", f"its creator has not sized it yet ({size} of {geometry.file_size} bytes)"
        if (why := _mismatch(shared.path, tuple(fields), geometry.fields(), size)) is not None:
            raise InvalidTransferError(why)
        shared.admit()
        return "admitted", ""


def _join(shared: SharedFile, geometry: FileGeometry, deadline: float, timeout: float) -> bool:
    """Joiner: wait (bounded) until the file is READY, then be admitted. False: start over."""
    try:
        while (verdict := _inspect(shared, geometry, deadline))[0] == "wait":
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"{shared.path} was not ready within {timeout} s: {verdict[1]}")
            time.sleep(_POLL_SECONDS)
    except BaseException:
        shared.abandon()
        raise
    if verdict[0] == "restart":
        shared.close()
        return False
    return True


def open_file(path: str, geometry: FileGeometry, rank: int, ledger: Ledger, directory: str,
               timeout: float) -> tuple[SharedFile, bool]:
    """Create the file or join it, starting over when the file opened was reaped or replaced meanwhile; first
    remove what creators that died before publishing left (:func:`clean_stale_temps`).

    Returns:
        The admitted descriptor and whether this process created the file.
    """
    deadline = time.monotonic() + timeout
    clean_stale_temps(path)
    while True:
        created = _create(path, geometry, rank, ledger, directory, timeout)
        if created is not None:
            return created, True
        if (joined := _open_existing(path, rank, ledger, timeout)) is not None and _join(joined, geometry, deadline,
                                                                                          timeout):
            return joined, False
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"could not create or join {path} within {timeout} s "
                                   "(it kept being removed or replaced)")

