"""SharedRegion: one host region shared by the ranks of an engine through a file in a tmpfs directory (R17, R18).

Theory of operation
-------------------
*Geometry* (as upstream; reference section 2.2). Every row of the file holds every rank's slice: rank ``r`` owns
bytes ``[r * slice, (r + 1) * slice)`` of each row, ``slice = sum(tensor_page_bytes) * blocks_per_chunk``, and its
tensors follow one another inside its slice. The row stride is ``world_size * slice`` rounded up to the page size
(``slice`` rounded up when ``replicated``: every rank then sees the same bytes). The ``num_chunks`` rows follow a
one-page header, so the file is ``PAGE + num_chunks * row_stride`` bytes and a rank's views are strided.

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

*Creation* (R17): ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600; under the gate: admit, write the header (CREATING);
check the free space; ``ftruncate`` to the full size; under the gate: mark READY. Joiners open with ``O_NOFOLLOW``
(a symlink fails with ELOOP at once, never waited on), poll under the gate until READY (bounded by ``timeout``),
compare the geometry, and are admitted.

*Unlink* (R18): after mapping, a rank sets its mapped byte under the gate; the one that completes the set unlinks.
At release (and quarantine) a rank drops its live lock under the gate and, if no other live opener remains, unlinks.
Every unlink is taken under the gate and only while ``lstat(path)`` shows the ``(st_dev, st_ino)`` of the descriptor
still open, so the inode number cannot have been reused and a stranger's file is never removed.

*Stale files*: a file with our magic and no live opener was left by an engine whose processes all died; an opener
finds it under the gate, unlinks it (same inode check) and starts over with ``O_EXCL``.

Waiting uses real time (``time.monotonic``), not the backend clock: the peers are other processes. Linux only (OFD
locks); see docs/shared-region.md for the protocol diagram and the failure cases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import math
import mmap
import os
import stat
import struct
import time
import weakref
import zlib
from collections.abc import Iterator
from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.base import Backend, Ledger, ResourceKind
from kvoffload_ref.errors import DeadlineExceeded, InvalidTransferError, LifecycleError, OwnershipError
from kvoffload_ref.layout import KVCacheLayout
from kvoffload_ref.lifecycle import RegionState
from kvoffload_ref.region import PAGE, HostRegion, check_sizes

__all__ = [
    "DEFAULT_DIRECTORY",
    "DEFAULT_TIMEOUT",
    "FILE_PREFIX",
    "FILE_SUFFIX",
    "HEADER_BYTES",
    "MAX_WORLD_SIZE",
    "SharedGeometry",
    "SharedRegion",
    "region_path",
    "validate_engine_id",
]

logger = logging.getLogger("kvoffload_ref.shared_region")

DEFAULT_DIRECTORY: Final = "/dev/shm"
DEFAULT_TIMEOUT: Final = 30.0
FILE_PREFIX: Final = "kvoffload_ref_"
FILE_SUFFIX: Final = ".mmap"
#: The header page at the start of the file; the data rows start after it.
HEADER_BYTES: Final = PAGE
_RANK_BYTES: Final = 64  # offset of the per-rank "mapped" bytes in the header, and of the rank locks
MAX_WORLD_SIZE: Final = HEADER_BYTES - _RANK_BYTES
#: How long a release waits for the gate (held by live peers for a few system calls only).
RELEASE_GATE_TIMEOUT: Final = 2.0
_POLL_SECONDS: Final = 0.005  # upstream's joiner poll interval
_GATE_POLL_SECONDS: Final = 0.0005
_NAME_MAX: Final = 255

_MAGIC: Final = b"KVOREF\x00\x01"
# magic, state, world_size, replicated, layout crc, num_chunks, row_stride, slice_bytes, data_offset, file_size
_HEADER: Final = struct.Struct("<8sIIII5Q")
_CREATING, _READY = 1, 2
_GATE_BYTE, _LIVE_BYTE = 0, 1
# struct flock on 64-bit Linux: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid (+ padding).
_FLOCK: Final = struct.Struct("hh4xqqi4x")


# -- names and geometry -------------------------------------------------------------------------------------------
def validate_engine_id(engine_id: object) -> str:
    """Check an engine id for use in a file name (R17).

    Args:
        engine_id: the id; it must be a non-empty str, not ``.`` or ``..``, with no path separator and no NUL.

    Returns:
        The id.

    Raises:
        InvalidTransferError: the id breaks one of those rules, or makes a file name longer than 255 bytes.
    """
    if not isinstance(engine_id, str) or not engine_id:
        raise InvalidTransferError(f"engine_id must be a non-empty str, got {engine_id!r}")
    separators = {os.sep, "/", *([os.altsep] if os.altsep else [])}
    if engine_id in (".", "..") or "\0" in engine_id or any(sep in engine_id for sep in separators):
        raise InvalidTransferError(
            f"engine_id {engine_id!r} is not a plain name: no '.', '..', path separator or NUL (R17)")
    try:
        name = os.fsencode(FILE_PREFIX + engine_id + FILE_SUFFIX)
    except UnicodeEncodeError as exc:
        raise InvalidTransferError(f"engine_id {engine_id!r} cannot be encoded as a file name") from exc
    if len(name) > _NAME_MAX:
        raise InvalidTransferError(f"engine_id {engine_id!r} makes a file name of {len(name)} bytes (> 255)")
    return engine_id


def region_path(engine_id: str, directory: str | os.PathLike[str] = DEFAULT_DIRECTORY) -> str:
    """The file of engine ``engine_id`` in ``directory``: ``<directory>/kvoffload_ref_<engine_id>.mmap``.

    Raises:
        InvalidTransferError: an invalid engine id (see :func:`validate_engine_id`).
    """
    return os.path.join(os.fspath(directory), FILE_PREFIX + validate_engine_id(engine_id) + FILE_SUFFIX)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _require(value: object, name: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidTransferError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class SharedGeometry:
    """Where every rank's CPU tensors lie in the shared file (reference section 2.2).

    Attributes:
        row_bytes: one CPU row size per tensor (``tensor_page_bytes[t] * blocks_per_chunk``).
        num_chunks: rows of the file.
        world_size: ranks sharing the file.
        replicated: every rank sees the same bytes (one copy per row instead of one per rank).
    """

    row_bytes: tuple[int, ...]
    num_chunks: int
    world_size: int
    replicated: bool

    @classmethod
    def of(cls, layout: KVCacheLayout, blocks_per_chunk: int, num_cpu_chunks: int, world_size: int,
           replicated: bool) -> SharedGeometry:
        """The geometry for a layout.

        Raises:
            InvalidTransferError: non-positive sizes, a world size outside [1, MAX_WORLD_SIZE], a non-bool
                ``replicated``.
        """
        check_sizes(blocks_per_chunk, num_cpu_chunks)
        _require(world_size, "world_size", 1, MAX_WORLD_SIZE)
        if not isinstance(replicated, bool):
            raise InvalidTransferError(f"replicated must be a bool, got {replicated!r}")
        row_bytes = tuple(layout.cpu_row_bytes(t, blocks_per_chunk) for t in range(layout.num_tensors))
        return cls(row_bytes, num_cpu_chunks, world_size, replicated)

    @property
    def slice_bytes(self) -> int:
        """Bytes of one rank's slice of a row (upstream's ``cpu_page_size_per_worker``)."""
        return sum(self.row_bytes)

    @property
    def row_stride(self) -> int:
        """Bytes between rows: every copy's slice, rounded up to the page size."""
        return _round_up(self.slice_bytes * (1 if self.replicated else self.world_size), PAGE)

    @property
    def data_offset(self) -> int:
        """Where row 0 starts (after the header page)."""
        return HEADER_BYTES

    @property
    def file_size(self) -> int:
        """The full size of the file."""
        return self.data_offset + self.num_chunks * self.row_stride

    def offsets(self, rank: int) -> list[int]:
        """Byte offset of row 0 of each of ``rank``'s tensors in the file."""
        start = self.data_offset + (0 if self.replicated else rank * self.slice_bytes)
        return [start + sum(self.row_bytes[:t]) for t in range(len(self.row_bytes))]

    def fields(self) -> tuple[int, ...]:
        """What the header records and a joiner compares (everything that fixes where bytes lie)."""
        crc = zlib.crc32(",".join(map(str, self.row_bytes)).encode())
        return (self.world_size, int(self.replicated), crc, self.num_chunks, self.row_stride,
                self.slice_bytes, self.data_offset, self.file_size)

    def header(self, state: int) -> bytes:
        """The header bytes in ``state`` (CREATING or READY)."""
        return _HEADER.pack(_MAGIC, state, *self.fields())


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


def _held_elsewhere(fd: int, byte: int) -> bool:
    """Whether another open file description (in any process) holds a lock on ``byte``."""
    probe = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return bool(_FLOCK.unpack(probe)[0] != fcntl.F_UNLCK)


# -- one open descriptor of the file ------------------------------------------------------------------------------
class _SharedFile:
    """One descriptor of the shared file, its locks, and the protocol steps taken through it.

    Holds no reference to a region, so a region's finalizer may hold it.
    """

    def __init__(self, fd: int, path: str, rank: int, ledger: Ledger) -> None:
        st = os.fstat(fd)
        # Invariant: open from construction until close(); then None.
        self.fd: int | None = fd
        self.path = path
        # Invariant: (st_dev, st_ino) of the inode fd refers to; stable while fd is open.
        self.identity = (st.st_dev, st.st_ino)
        self.rank = rank
        # Invariant: True from admission until the name is given up (release, quarantine, failed open).
        self.live = False
        self._ledger = ledger
        # Invariant: this descriptor's "shm_file" ledger entry (live, or quarantined, until close).
        self._key = (st.st_dev, st.st_ino, fd)
        ledger.acquire("shm_file", self._key)

    @classmethod
    def wrap(cls, fd: int, path: str, rank: int, ledger: Ledger) -> _SharedFile:
        """Own ``fd``: close it if the wrapping fails."""
        try:
            return cls(fd, path, rank, ledger)
        except BaseException:
            os.close(fd)
            raise

    @property
    def fileno(self) -> int:
        if self.fd is None:
            raise LifecycleError(f"the descriptor of {self.path} is closed")
        return self.fd

    def names_inode(self) -> bool:
        """Whether the path still names (without following links) the inode this descriptor holds open."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.identity

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
        """Under the gate: unlink the path if it still names our inode (R18). Returns whether it did."""
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

    def give_up_name(self) -> list[str]:
        """Stop counting as a live opener; unlink the file if no other live opener remains (R3, R18).

        Never raises: a failure is logged and returned (the live lock is dropped in any case).
        """
        if not self.live or self.fd is None:
            return []
        try:
            with self.gate(time.monotonic() + RELEASE_GATE_TIMEOUT):
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
        """Keep the descriptor (and its rank lock) until process exit (R12/R18)."""
        self._ledger.quarantine("shm_file", self._key)

    def close(self) -> list[str]:
        """Close the descriptor (dropping all its locks); idempotent. A failure is logged and returned."""
        fd, self.fd = self.fd, None
        if fd is None:
            return []
        self.live = False
        self._ledger.release("shm_file", self._key)
        try:
            os.close(fd)
        except OSError as exc:
            logger.warning("Failed to close the descriptor of mmap file %s: %s", self.path, exc)
            return [f"close of {self.path} failed: {exc}"]
        return []

    def abandon(self) -> list[str]:
        """Give up the name, then close: what a failed open and a finalizer do."""
        return self.give_up_name() + self.close()

    def abandon_creation(self) -> None:
        """A creator that failed: unlink its file (it is the only live opener, joiners wait for READY), close."""
        if not self.live and self.fd is not None and self.names_inode():
            # Not admitted (the gate was never free): no joiner can have been admitted either.
            os.unlink(self.path)
            logger.info("Removed mmap file %s", self.path)
        self.abandon()


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


def _map_file(fd: int, size: int) -> mmap.mmap:
    """Map the whole file shared, read/write (a separate step so tests can stop a rank before it)."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _create(path: str, rank: int, ledger: Ledger) -> _SharedFile | None:
    """Create the file exclusively, mode 0600 (R17); None if something already exists at the path."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return None
    os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask
    return _SharedFile.wrap(fd, path, rank, ledger)


def _open_existing(path: str, rank: int, ledger: Ledger) -> _SharedFile | None:
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
    return _SharedFile.wrap(fd, path, rank, ledger)


def _finish_creation(shared: _SharedFile, geometry: SharedGeometry, directory: str, deadline: float) -> bool:
    """Creator: admit, write the header, check space, size the file, mark it READY. False: start over."""
    try:
        with shared.gate(deadline):
            reaped = not shared.names_inode()  # removed or replaced by someone between O_EXCL and the gate
            if not reaped:
                shared.admit()
                os.pwrite(shared.fileno, geometry.header(_CREATING), 0)
        if not reaped:
            _check_free_space(directory, geometry.file_size, shared.path)
            _size_file(shared.fileno, geometry.file_size)
            with shared.gate(deadline):
                os.pwrite(shared.fileno, geometry.header(_READY), 0)
    except BaseException:
        shared.abandon_creation()
        raise
    if reaped:
        shared.close()
    return not reaped


def _inspect(shared: _SharedFile, geometry: SharedGeometry, deadline: float) -> tuple[str, str]:
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
            if size:
                raise FileExistsError(errno.EEXIST, f"refusing {shared.path}: it is not a kvoffload_ref region "
                                      "(left untouched)", shared.path)
            return "wait", "the file is empty (its creator has not written the header)"
        _, state, *fields = _HEADER.unpack(raw)
        if not shared.others_live():
            logger.warning("Found stale mmap file %s: no live process holds it (its engine died)", shared.path)
            shared.unlink_if_ours()
            return "restart", "stale file removed"
        if state != _READY:
            return "wait", f"its creator has not sized it yet ({size} of {geometry.file_size} bytes)"
        if (why := _mismatch(shared.path, tuple(fields), geometry.fields(), size)) is not None:
            raise InvalidTransferError(why)
        shared.admit()
        return "admitted", ""


def _join(shared: _SharedFile, geometry: SharedGeometry, deadline: float, timeout: float) -> bool:
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


def _open_file(path: str, geometry: SharedGeometry, rank: int, ledger: Ledger, directory: str,
               timeout: float) -> tuple[_SharedFile, bool]:
    """Create the file or join it, starting over when the file opened was reaped or replaced meanwhile.

    Returns:
        The admitted descriptor and whether this process created the file.
    """
    deadline = time.monotonic() + timeout
    while True:
        created = _create(path, rank, ledger)
        if created is not None:
            if _finish_creation(created, geometry, directory, deadline):
                return created, True
        elif (joined := _open_existing(path, rank, ledger)) is not None and _join(joined, geometry, deadline,
                                                                                   timeout):
            return joined, False
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"could not create or join {path} within {timeout} s "
                                   "(it kept being removed or replaced)")


def _close_mapping(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        logger.error("Failed to close mmap_obj", exc_info=True)


# -- the region -----------------------------------------------------------------------------------------------------
class SharedRegion(HostRegion):
    """A HostRegion whose memory is this rank's slice of a file shared by ``world_size`` ranks (R17, R18).

    Build with :meth:`open`. Usable wherever a HostRegion is: ``create_worker(..., region=region)`` takes
    ownership (R1); until then ``release()`` is the caller's way to give it up (R3).
    """

    def __init__(self, backend: Backend, mapping: mmap.mmap, geometry: SharedGeometry, rank: int,
                 shared: _SharedFile, *, engine_id: str, is_creator: bool) -> None:
        """Wrap an admitted descriptor and its mapping (use :meth:`open`)."""
        # Invariant: this rank's descriptor; its name is given up and it is closed by release (R3), or its name
        # given up and the descriptor kept by quarantine (R18).
        self._file = shared
        self.engine_id = engine_id
        self.geometry = geometry
        self.rank = rank
        self.log_rank = rank
        self.is_creator = is_creator
        super().__init__(backend, mapping, geometry.offsets(rank), geometry.row_bytes, geometry.num_chunks,
                         row_strides=[geometry.row_stride] * len(geometry.row_bytes))
        # Invariant: gives up the name and closes the descriptor if the region is dropped unreleased.
        self._finalizer = weakref.finalize(self, shared.abandon)

    @classmethod
    def open(cls, engine_id: str, *, backend: Backend, layout: KVCacheLayout, blocks_per_chunk: int,
             num_cpu_chunks: int, rank: int, world_size: int, replicated: bool = False,
             directory: str | os.PathLike[str] = DEFAULT_DIRECTORY,
             timeout: float = DEFAULT_TIMEOUT) -> SharedRegion:
        """Create or join engine ``engine_id``'s shared file, map it and return this rank's caller-owned region.

        The first rank to create the file (``O_EXCL``) is its creator; the others wait, bounded by ``timeout``,
        until it is sized. The file is unlinked as soon as all ``world_size`` ranks have mapped it, or by the
        last rank to release it (R18). A stale file left by a dead engine is removed and created afresh.

        Args:
            engine_id: names the file (validated, R17).
            backend: the device the mapping is announced to (ledger "mapping"; the file is "shm_file").
            layout: the KV-cache layout (the same on every rank).
            blocks_per_chunk: GPU blocks per CPU row.
            num_cpu_chunks: rows of the file.
            rank: this rank, in [0, world_size).
            world_size: ranks sharing the file, in [1, MAX_WORLD_SIZE].
            replicated: every rank sees the same bytes instead of its own slice of each row.
            directory: an existing (tmpfs) directory for the file.
            timeout: real seconds to wait for the creator and for the file's lock.

        Returns:
            A caller-owned SharedRegion (not pinned yet).

        Raises:
            InvalidTransferError: invalid arguments, or a geometry mismatch with the file (another rank's sizes).
            OwnershipError: this rank is already open in a live process.
            DeadlineExceeded: the file was not ready (or its lock not free) within ``timeout``.
            OSError: a symlink at the path (ELOOP, at once), not enough free space (ENOSPC), a file that is not
                a kvoffload_ref region (FileExistsError, left untouched), a missing directory.
        """
        geometry = SharedGeometry.of(layout, blocks_per_chunk, num_cpu_chunks, world_size, replicated)
        _require(rank, "rank", 0, world_size - 1)
        if not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
            raise InvalidTransferError(f"timeout must be a finite number >= 0, got {timeout!r}")
        path = region_path(engine_id, directory)
        if not os.path.isdir(directory):
            raise FileNotFoundError(errno.ENOENT, "the shared region directory does not exist", os.fspath(directory))
        shared, is_creator = _open_file(path, geometry, rank, backend.ledger, os.fspath(directory), timeout)
        with contextlib.ExitStack() as guards:
            guards.callback(shared.abandon)
            mapping = _map_file(shared.fileno, geometry.file_size)
            guards.callback(_close_mapping, mapping)
            shared.mark_mapped(world_size, time.monotonic() + timeout)
            region = cls(backend, mapping, geometry, rank, shared, engine_id=engine_id, is_creator=is_creator)
            guards.pop_all()
        return region

    @classmethod
    def allocate(cls, backend: Backend, layout: KVCacheLayout, blocks_per_chunk: int,
                 num_cpu_chunks: int) -> HostRegion:
        """Not for shared regions: they need an engine id, a rank and a world size.

        Raises:
            TypeError: always; use :meth:`open`.
        """
        raise TypeError("SharedRegion.allocate() is not available: use SharedRegion.open(engine_id, ...)")

    @property
    def path(self) -> str:
        """The file's path (it may already be unlinked: the mapping outlives the name)."""
        return self._file.path

    @property
    def world_size(self) -> int:
        return self.geometry.world_size

    @property
    def replicated(self) -> bool:
        return self.geometry.replicated

    def __repr__(self) -> str:
        return (f"<SharedRegion {self.state.value} {self.path} rank {self.rank}/{self.world_size}"
                f"{' replicated' if self.replicated else ''}, {self.pinned_ranges} pinned range(s)>")

    def snapshot_rows(self) -> npt.NDArray[np.uint8]:
        """A copy of every row of the file -- all ranks' slices and the padding -- shape (num_chunks, row_stride).

        Raises:
            OwnershipError: the region was released or quarantined.
        """
        if self.state not in (RegionState.CALLER_OWNED, RegionState.WORKER_OWNED) or self._base is None:
            raise OwnershipError(f"the region is {self.state.value}; its memory is no longer readable")
        g = self.geometry
        return self._base[g.data_offset: g.file_size].reshape(g.num_chunks, g.row_stride).copy()

    # -- the file's part of release (R3) and quarantine (R18) ----------------------------------------------------------
    def _release_backing(self) -> list[str]:
        """R3, after the unmap: unlink if this process is the last live opener and the path names our inode, then
        close the descriptor."""
        self._finalizer.detach()
        return self._file.abandon()

    def _quarantine_backing(self) -> list[str]:
        """R18: give up the file name; keep the descriptor (so this rank stays taken) with the mapping and pins."""
        failures = self._file.give_up_name()
        self._file.quarantine()
        return failures

    def _quarantined_backing(self) -> dict[ResourceKind, int]:
        return {"shm_file": 1}

