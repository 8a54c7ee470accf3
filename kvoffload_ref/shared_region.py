"""SharedRegion: one host region shared by the ranks of an engine through a file in a tmpfs directory (R17, R18).

Theory of operation
-------------------
*Geometry* (as upstream; reference section 2.2). Every row of the file holds every rank's slice: rank ``r`` owns
bytes ``[r * slice, (r + 1) * slice)`` of each row, ``slice = sum(tensor_page_bytes) * blocks_per_chunk``, and its
tensors follow one another inside its slice. The row stride is ``world_size * slice`` rounded up to the page size
(``slice`` rounded up when ``replicated``: every rank then sees the same bytes). The ``num_chunks`` rows follow a
one-page header, so the file is ``PAGE + num_chunks * row_stride`` bytes and a rank's views are strided.

*The file* is ``<directory>/kvoffload_ref_<engine_id>.mmap``: a header page, then the rows. Creating or joining
it, the locks that admit one opener per rank, and the rule for unlinking it (the last live opener, or the rank
completing the "mapped" set, and only while the path still names the inode held open) are the handshake in
``kvoffload_ref.shared_file``. This module validates the arguments, computes the geometry, maps the file and
makes the region: a :class:`~kvoffload_ref.region.HostRegion` whose release (R3) and quarantine (R18) also give up
the file's name and close (or keep) its descriptor. A region dropped unreleased gives up the name and closes the
descriptor from its finalizer.

*Forked children* (R21). A child forked from a process holding a shared region is never one of its ranks: the
child's copies of the descriptor and of the mapping are cut off at the fork (the child sees zeros at the region's
addresses and holds none of the file's locks), and the inherited region is inert -- ``snapshot_rows()``, like the
HostRegion calls that use the memory, raises ``WorkerClosedError``; ``release()``, the finalizer and the ``atexit``
hook do nothing. The child marks nothing mapped, counts as no live opener and unlinks nothing; it may open a region
of its own with :meth:`SharedRegion.open`.

Linux only (OFD locks); see docs/shared-region.md for the protocol diagram and the failure cases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import mmap
import os
import time
import weakref
import zlib
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.base import Backend, ResourceKind
from kvoffload_ref.backends.pinned import refuses_registration
from kvoffload_ref.errors import InvalidTransferError, OwnershipError, RegistrationRefused
from kvoffload_ref.lifecycle import RegionState
from kvoffload_ref.region import DEFAULT_MAX_REGISTER_BYTES, PAGE, HostRegion
from kvoffload_ref.shared_file import (
    HEADER_BYTES,
    MAX_WORLD_SIZE,
    RELEASE_GATE_TIMEOUT,
    TEMP_NAME_EXTRA,
    SharedFile,
    open_file,
    pack_header,
)
from kvoffload_ref.specs import KVCacheLayout
from kvoffload_ref.validate import INT64_MAX, check_int, check_seconds, check_sizes, short_repr

__all__ = [
    "DEFAULT_DIRECTORY",
    "DEFAULT_TIMEOUT",
    "FILE_PREFIX",
    "FILE_SUFFIX",
    "HEADER_BYTES",
    "MAX_WORLD_SIZE",
    "RELEASE_GATE_TIMEOUT",
    "SharedGeometry",
    "SharedRegion",
    "region_path",
    "validate_engine_id",
]

logger = logging.getLogger("kvoffload_ref.shared_region")

# Invariant: the paths this process has opened a region at (any rank, any group); only grows. A later open that
# finds no file there and creates an empty one is a new group after the earlier one's file was given up (R17/R18).
_OPENED_PATHS: set[str] = set()

DEFAULT_DIRECTORY: Final = "/dev/shm"
DEFAULT_TIMEOUT: Final = 30.0
FILE_PREFIX: Final = "kvoffload_ref_"
FILE_SUFFIX: Final = ".mmap"
_NAME_MAX: Final = 255


# -- names and geometry -------------------------------------------------------------------------------------------
def validate_engine_id(engine_id: object) -> str:
    """Check an engine id for use in a file name (R17).

    Args:
        engine_id: the id; it must be a non-empty str, not ``.`` or ``..``, with no path separator and no NUL.

    Returns:
        The id.

    Raises:
        InvalidTransferError: the id breaks one of those rules, or makes a file name longer than 255 bytes less
            ``TEMP_NAME_EXTRA`` (the room its creator's temporary name needs).
    """
    if not isinstance(engine_id, str) or not engine_id:
        raise InvalidTransferError(f"engine_id must be a non-empty str, got {type(engine_id).__name__} "
                                   f"{short_repr(engine_id)} (e.g. 'engine-0')")
    separators = {os.sep, "/", *([os.altsep] if os.altsep else [])}
    if engine_id in (".", "..") or "\0" in engine_id or any(sep in engine_id for sep in separators):
        raise InvalidTransferError(
            f"engine_id {short_repr(engine_id)} is not a plain name: expected no '.', '..', path separator or NUL "
            "(R17; e.g. 'engine-0')")
    try:
        name = os.fsencode(FILE_PREFIX + engine_id + FILE_SUFFIX)
    except UnicodeEncodeError as exc:
        raise InvalidTransferError(f"engine_id {short_repr(engine_id)} cannot be encoded as a file name: expected "
                                   "characters the file system encoding takes (e.g. 'engine-0')") from exc
    if len(name) + TEMP_NAME_EXTRA > _NAME_MAX:  # its creator's temporary name must fit too (R17)
        raise InvalidTransferError(f"engine_id {short_repr(engine_id)} makes a file name of {len(name)} bytes (its "
                                   f"creator's temporary name adds {TEMP_NAME_EXTRA}): expected at most "
                                   f"{_NAME_MAX - TEMP_NAME_EXTRA} (e.g. 'engine-0')")
    return engine_id


def region_path(engine_id: str, directory: str | os.PathLike[str] = DEFAULT_DIRECTORY) -> str:
    """The file of engine ``engine_id`` in ``directory``: ``<directory>/kvoffload_ref_<engine_id>.mmap``.

    Raises:
        InvalidTransferError: an invalid engine id (see :func:`validate_engine_id`).
    """
    return os.path.join(os.fspath(directory), FILE_PREFIX + validate_engine_id(engine_id) + FILE_SUFFIX)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


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
            InvalidTransferError: sizes that are not ints in [1, 2**63 - 1], a world size outside [1,
                MAX_WORLD_SIZE], a non-bool ``replicated``, or a file of more bytes than an offset spans
                (2**63 - 1).
        """
        bpc, chunks = check_sizes(blocks_per_chunk, num_cpu_chunks)
        ranks = check_int("world_size", world_size, minimum=1, maximum=MAX_WORLD_SIZE)
        if not isinstance(replicated, bool):
            raise InvalidTransferError(f"replicated must be a bool, got {type(replicated).__name__} "
                                       f"{short_repr(replicated)} (e.g. False)")
        row_bytes = tuple(layout.cpu_row_bytes(t, bpc) for t in range(layout.num_tensors))
        geometry = cls(row_bytes, chunks, ranks, replicated)
        if geometry.file_size > INT64_MAX:
            raise InvalidTransferError(f"num_cpu_chunks={chunks}, blocks_per_chunk={bpc}, world_size={ranks}: a "
                                       f"shared file of {geometry.file_size} bytes: expected at most {INT64_MAX}")
        return geometry

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
        return pack_header(state, self.fields())


_NO_SHARED_PINNING: Final = (
    "this platform refuses host registration, and a shared region's file mapping can only be pinned by "
    "registration (a pinned allocation is private to one process); use a private region: create_worker(..., "
    "pinning='auto') or pinning='alloc' (or HostRegion.allocate(..., pinning='alloc'))")


def _say_created(region: SharedRegion, path: str) -> None:
    """Log how the region was opened. Creating an empty file where this process opened one before is a WARNING:
    whatever the earlier group stored there is not in it (a load from it reads zeros)."""
    if region.created_empty:
        again = path in _OPENED_PATHS
        logger.log(logging.WARNING if again else logging.INFO,
                   "shared region %r: no file at %s%s: rank %d of %d created an empty one (all zeros until a rank "
                   "stores into it). A region's bytes live only while one of its openers keeps it mapped, and its "
                   "name only until all world_size ranks have mapped it: to load what another group stored, open "
                   "the region as ranks of that group, or keep one of its regions open until the new ranks joined "
                   "(docs/canonical.md)", region.engine_id, path,
                   " (this process opened a region there before: that group's file was given up)" if again else "",
                   region.rank, region.world_size)
    _OPENED_PATHS.add(path)


def _map_file(fd: int, size: int) -> mmap.mmap:
    """Map the whole file shared, read/write (a separate step so tests can stop a rank before it)."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


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

    #: R29: a quarantine keeps the whole mapping and every registration. Its pages are the file's, shared with the
    #: other ranks: ``MADV_DONTNEED`` would give none of them back, and punching a hole (``MADV_REMOVE``) would
    #: destroy the rows of the ranks that still use them (docs/shared-region.md).
    keeps_whole = True

    def __init__(self, backend: Backend, mapping: mmap.mmap, geometry: SharedGeometry, rank: int,
                 shared: SharedFile, *, engine_id: str, is_creator: bool,
                 max_register_bytes: int = DEFAULT_MAX_REGISTER_BYTES) -> None:
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
                         row_strides=[geometry.row_stride] * len(geometry.row_bytes),
                         max_register_bytes=max_register_bytes)
        # Invariant: gives up the name and closes the descriptor if the region is dropped unreleased, or is alive at
        # exit (``atexit``); in a forked child it does nothing (``SharedFile.abandon``, R21).
        self._finalizer = weakref.finalize(self, shared.abandon)

    @classmethod
    def open(cls, engine_id: str, *, backend: Backend, layout: KVCacheLayout, blocks_per_chunk: int,
             num_cpu_chunks: int, rank: int, world_size: int, replicated: bool = False,
             directory: str | os.PathLike[str] = DEFAULT_DIRECTORY, timeout: float = DEFAULT_TIMEOUT,
             max_register_bytes: int = DEFAULT_MAX_REGISTER_BYTES) -> SharedRegion:
        """Create or join engine ``engine_id``'s shared file, map it and return this rank's caller-owned region.

        The first rank to publish the file is its creator: it builds the whole file under a temporary name and
        links it into place (``link`` fails if the path exists), so the path never names a partly built file;
        the others join it. The file is unlinked as soon as all ``world_size`` ranks have mapped it, or by the
        last rank to release it (R18). A stale file left by a dead engine is removed and created afresh, and so
        are the temporary files of creators that died before publishing.

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
            timeout: real seconds to wait for the file's lock when opening (and, capped by
                ``RELEASE_GATE_TIMEOUT``, when releasing), a finite number >= 0.
            max_register_bytes: the most bytes ``pin`` registers per call (R25; default 64 GiB); every seam lies
                outside this rank's rows.

        Returns:
            A caller-owned SharedRegion (not pinned yet).

        Raises:
            InvalidTransferError: invalid arguments (checked before the file is touched: a size, rank or world size
                that is not an int in range, a timeout that is not a finite number of seconds >= 0 -- a bool,
                NaN, an infinity or an int too large for a float is refused, a ``max_register_bytes`` that is not
                an int >= 1), or a geometry mismatch with the file (another rank's sizes).
            RegistrationRefused: (a DeviceError) the backend's platform refuses host registration
                (``refuses_registration``; e.g. confidential computing, vLLM #55428): a file mapping can only be
                pinned by registration, and a pinned allocation cannot be shared; use a private region
                (``create_worker(..., pinning="auto")`` or ``"alloc"``). Checked before the file is touched.
            OwnershipError: this rank is already open in a live process.
            DeadlineExceeded: the file's lock was not free (or an earlier version's creator did not make its file
                ready) within ``timeout``.
            OSError: a symlink at the path (ELOOP, at once), not enough free space (ENOSPC), a file that is not
                a kvoffload_ref region, an empty one included (FileExistsError, at once, left untouched), a
                missing directory.
        """
        geometry = SharedGeometry.of(layout, blocks_per_chunk, num_cpu_chunks, world_size, replicated)
        rank = check_int("rank", rank, minimum=0, maximum=geometry.world_size - 1)
        timeout = check_seconds("timeout", timeout)
        check_int("max_register_bytes", max_register_bytes, minimum=1)  # R7: before the file is touched
        path = region_path(engine_id, directory)
        if refuses_registration(backend):
            raise RegistrationRefused(f"shared region {engine_id!r}: {_NO_SHARED_PINNING}")
        if not os.path.isdir(directory):
            raise FileNotFoundError(errno.ENOENT, "the shared region directory does not exist", os.fspath(directory))
        shared, is_creator = open_file(path, geometry, rank, backend.ledger, os.fspath(directory), timeout)
        with contextlib.ExitStack() as guards:
            guards.callback(shared.abandon)
            mapping = _map_file(shared.fileno, geometry.file_size)
            guards.callback(_close_mapping, mapping)
            shared.mark_mapped(world_size, time.monotonic() + timeout)
            region = cls(backend, mapping, geometry, rank, shared, engine_id=engine_id, is_creator=is_creator,
                         max_register_bytes=max_register_bytes)
            guards.pop_all()
        _say_created(region, path)
        return region

    @classmethod
    def allocate(cls, backend: Backend, layout: KVCacheLayout, blocks_per_chunk: int, num_cpu_chunks: int, *,
                 max_register_bytes: int = DEFAULT_MAX_REGISTER_BYTES,
                 pinning: Literal["register", "alloc"] = "register") -> HostRegion:
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

    def _describe(self) -> str:
        return f"this SharedRegion ({self.path}, rank {self.rank} of {self.world_size})"

    @property
    def created_empty(self) -> bool:
        """True when this open found no file and created it: its rows were all zeros then, whatever an earlier
        group stored under the same engine id (its file was given up once all its ranks had mapped it, R18)."""
        return self.is_creator

    def __repr__(self) -> str:
        return (f"<SharedRegion {self.state.value} {self.path} rank {self.rank}/{self.world_size}"
                f"{' replicated' if self.replicated else ''}, "
                f"{'created empty here' if self.created_empty else 'joined an existing file'}, "
                f"{self.pinned_ranges} pinned range(s)>")

    def snapshot_rows(self) -> npt.NDArray[np.uint8]:
        """A copy of every row of the file -- all ranks' slices and the padding -- shape (num_chunks, row_stride).

        Raises:
            OwnershipError: the region was released or quarantined.
            WorkerClosedError: this is a forked child's copy of the region (R21).
        """
        self._check_owner()
        if self.state not in (RegionState.CALLER_OWNED, RegionState.WORKER_OWNED) or self._base is None:
            raise OwnershipError(f"the region is {self.state.value}; its memory is no longer readable")
        g = self.geometry
        return self._base[g.data_offset: g.file_size].reshape(g.num_chunks, g.row_stride).copy()

    # -- the file's part of release (R3) and quarantine (R18) ----------------------------------------------------------
    def _refused_hint(self) -> str:
        return _NO_SHARED_PINNING

    def _release_backing(self) -> list[str]:
        """R3, after the unmap: unlink if this process is the last live opener and the path names our inode, then
        close the descriptor. (Never reached in a forked child: ``_finish`` returns first, R21.)"""
        self._finalizer.detach()
        return self._file.abandon(self._release_wait)

    def _quarantine_backing(self) -> list[str]:
        """R18: give up the file name; keep the descriptor (so this rank stays taken) with the mapping and pins."""
        failures = self._file.give_up_name(self._release_wait)
        self._file.quarantine()
        return failures

    def _quarantined_backing(self) -> dict[ResourceKind, int]:
        return {"shm_file": 1}

