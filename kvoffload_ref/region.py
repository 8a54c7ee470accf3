"""HostRegion: the host memory KV pages are offloaded to, and how it is pinned, released or quarantined.

A region is one anonymous ``mmap`` holding one 2-D uint8 CPU tensor per layout tensor, shape
``(num_cpu_chunks, tensor_page_bytes[t] * blocks_per_chunk)``, each tensor's segment page-aligned. Views are
made with ``np.frombuffer`` so that ``mmap.close()`` refuses (``BufferError``) while any view is alive, instead of
succeeding and leaving a dangling view that segfaults later.

*Pinned allocation* (``allocate(..., pinning="alloc")``). Where the platform refuses host registration (status 801,
``RegistrationRefused``; e.g. under confidential computing, vLLM #55428) the region's memory is instead one pinned
allocation of the backend (``backends.pinned``; ``cudaHostAlloc``; ledger "pinned_alloc"), with the same views and
geometry. ``region.pinning`` says which (``"registered"``, ``"allocated"``, or ``"pageable"`` for a mapping not
registered). For an allocation: R3's release is drop the views -> free the allocation (nothing to unregister or
unmap); R12's quarantine keeps the allocation, never freed; R29: one allocation is one unit, kept whole (a part of
it cannot be given back); R25: there is no seam inside it; R21: as for a mapping (a forked child frees nothing).
A file-backed region (``SharedRegion``) cannot use it.

Ownership (R1) and fate (R3, R12) follow ``lifecycle.REGION_TABLE``: the caller owns a new region; a worker adopts
it when its constructor succeeds; then only that worker's shutdown releases it, or quarantines it when it cannot
prove no DMA may still touch it. Release runs R3's steps in order -- unregister pinned ranges (reverse order of
registration), drop the views, unmap -- logging a failed step and going on. A quarantined region stays mapped and
pinned in a module-level registry until the process exits, so garbage collection can never unmap it.

Handlers never see a region: the worker gives them ``geometries()`` (addresses and strides) only.

``pin`` registers the region in chunks of at most ``max_register_bytes`` (64 GiB by default) whose seams lie outside
every CPU row (R25, ``seams.py``): the driver refuses a copy whose host span lies in two registrations.

A region remembers the backend it was built on (``region.backend``); ``region.check_backend(backend)`` refuses
another one (R7), since the region's memory is announced to -- and pinned through -- that backend only.

What a region holds (backend, mapping or allocation, views, pinned ranges, lifecycle state) lives in a separate
``region_held.Held`` object (with R3's steps), so that a finalizer can hold it without holding the region. A
*caller-owned* region dropped without ``release()`` is released from that finalizer (R3's steps, with a warning); a
worker-owned region is the worker's to release, and a quarantined one is kept alive by the quarantine registry, so
their finalizers do nothing.

A region belongs to the process that built it (R21): in a forked child its copy answers queries, refuses what
would use its memory or device (``snapshot``, ``pin``, ``adopt``, ``check_backend``: ``WorkerClosedError`` naming
the owner) and gives nothing up (``release``, ``unpin``, ``*_by_owner``, the finalizer return at once, lock-free).

Subclasses (``shared_region.SharedRegion``) keep all of this and override two steps: ``_release_backing`` (R3's
last steps: unlink the file if this process is to unlink it, then close the descriptor) and
``_quarantine_backing`` (R18: give up the file name, keep the mapping and the pins).
"""

from __future__ import annotations

import logging
import mmap
import weakref
from collections.abc import Iterable, Sequence
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends import pinned as pinned_memory
from kvoffload_ref.backends.base import Backend, ResourceKind
from kvoffload_ref.errors import DeviceError, InvalidTransferError, OwnershipError, RegistrationRefused
from kvoffload_ref.lifecycle import Action, RegionInput, RegionState
from kvoffload_ref.process import ProcessOwner
from kvoffload_ref.quarantine import QuarantinedItem, quarantine, quarantined
from kvoffload_ref.region_held import Held, view_of
from kvoffload_ref.region_keep import give_back_unkept, kept_ranges, rows_to_keep
from kvoffload_ref.results import KeptRange, RegionPinning
from kvoffload_ref.seams import DEFAULT_MAX_REGISTER_BYTES, register_chunks
from kvoffload_ref.shield import Shield
from kvoffload_ref.specs import KVCacheLayout, TensorGeometry
from kvoffload_ref.validate import INT64_MAX, Int64Array, check_int, check_sizes, check_views, map_refused, short_repr

# QuarantinedItem, quarantine and quarantined live in kvoffload_ref.quarantine; re-exported here for compatibility.
__all__ = ["DEFAULT_MAX_REGISTER_BYTES", "DEFAULT_PIN_CHUNK_BYTES", "HostRegion", "QuarantinedItem", "quarantine",
           "quarantined"]

logger = logging.getLogger("kvoffload_ref.region")

PAGE: Final = mmap.PAGESIZE
#: The workers' ``pin_chunk_bytes`` default: the same cap as a region's ``max_register_bytes`` (R25, seams.py).
DEFAULT_PIN_CHUNK_BYTES: Final = DEFAULT_MAX_REGISTER_BYTES


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class HostRegion:
    """Host memory for one worker's CPU tensors: an anonymous mmap, or pinned memory allocated directly where
    registration is refused (``pinning="alloc"``). Build with :meth:`allocate`."""

    def __init__(self, backend: Backend, mapping: mmap.mmap | npt.NDArray[np.uint8], offsets: Sequence[int],
                 row_bytes: Sequence[int], num_cpu_chunks: int, *, row_strides: Sequence[int] | None = None,
                 max_register_bytes: int = DEFAULT_MAX_REGISTER_BYTES) -> None:
        """Wrap an existing mapping (use :meth:`allocate`). Announces it to the backend (ledger "mapping"); a pinned
        allocation is not announced (it is in the ledger already).

        Args:
            backend: the device the mapping is announced to.
            mapping: the mapping; the region owns it from here on. Or the 1-D uint8 buffer of a pinned allocation
                of ``backend`` (``backends.pinned.alloc_pinned``): the region owns and frees it (it is already
                pinned and in the ledger as "pinned_alloc": nothing is announced).
            offsets: byte offset of each CPU tensor's row 0 in the mapping.
            row_bytes: bytes of one row of each CPU tensor.
            num_cpu_chunks: rows per CPU tensor.
            row_strides: bytes between consecutive rows of each tensor (default: ``row_bytes``, contiguous).
            max_register_bytes: the most bytes :meth:`pin` registers per call (R25; default 64 GiB).

        Raises:
            InvalidTransferError: the tensors do not lie inside the mapping (see :func:`check_views`), or
                ``max_register_bytes`` is not an int >= 1 (R7).
        """
        allocated = isinstance(mapping, np.ndarray)
        size = int(mapping.size) if isinstance(mapping, np.ndarray) else len(mapping)  # (isinstance: mypy narrows)
        offsets, row_bytes, num_cpu_chunks, strides = check_views(size, offsets, row_bytes, num_cpu_chunks,
                                                                  row_strides)
        # Invariant: the cap of one registration (R25); seams fall on row boundaries of every view (seams.py).
        self.max_register_bytes = check_int("max_register_bytes", max_register_bytes, minimum=1)
        # Invariant: what the region holds; shared with the finalizer, which never holds the region itself.
        base = mapping if isinstance(mapping, np.ndarray) else np.frombuffer(mapping, dtype=np.uint8)
        self._held = held = Held(backend, None if isinstance(mapping, np.ndarray) else mapping, base, self.log_rank)
        self.ptr: int = held.ptr
        self.nbytes: int = held.nbytes
        self.num_cpu_chunks = num_cpu_chunks
        held.views.extend(view_of(base, off, num_cpu_chunks, rb, st)
                          for off, rb, st in zip(offsets, row_bytes, strides, strict=True))
        self._geometries = tuple(
            TensorGeometry(ptr=self.ptr + off, rows=num_cpu_chunks, row_bytes=rb, row_stride=st)
            for off, rb, st in zip(offsets, row_bytes, strides, strict=True)
        )
        # Invariant: why the owning worker quarantined the region (set just before quarantining).
        self._quarantine_reason = "not proven idle"
        # Invariant: the CPU rows an unproven copy may still touch (R29), set just before a quarantine by
        # registration; None: the quarantine keeps the whole region.
        self._keep_rows: Int64Array | None = None
        # Invariant: the ranges the quarantine kept, in address order (R29); () unless quarantined.
        self._kept: tuple[KeptRange, ...] = ()
        # Invariant: the real seconds the owning worker's release or quarantine may still wait (R11: what is left
        # of its shutdown timeout; set just before, None otherwise): bounds a file-backed region's lock wait.
        self._release_wait: float | None = None
        if not allocated:  # an allocation is in the ledger already ("pinned_alloc")
            backend.track_host(self.ptr, self.nbytes)
        # Invariant: releases the region if its caller drops it unreleased; detached once released or quarantined.
        self._dropped = weakref.finalize(self, held.release_dropped, type(self).__name__)
        self._dropped.atexit = False  # at exit the backend may be gone; the OS takes the memory back anyway

    @classmethod
    def allocate(cls, backend: Backend, layout: KVCacheLayout, blocks_per_chunk: int, num_cpu_chunks: int, *,
                 max_register_bytes: int = DEFAULT_MAX_REGISTER_BYTES,
                 pinning: Literal["register", "alloc"] = "register") -> HostRegion:
        """Map and announce a region sized for ``layout`` (not pinned yet; the caller owns it), or allocate it
        pinned (``pinning="alloc"``: pinned already, for a platform that refuses registration).

        Args:
            backend: the device the region will be announced to.
            layout: the KV-cache layout (one CPU tensor per layout tensor).
            blocks_per_chunk: GPU blocks per CPU chunk (>= 1).
            num_cpu_chunks: CPU rows per tensor (>= 1).
            max_register_bytes: the most bytes :meth:`pin` registers per call (R25; default 64 GiB).
            pinning: ``"register"`` (default): an anonymous mapping, registered in R25's chunks by :meth:`pin`;
                ``"alloc"``: one pinned allocation of the backend (``cudaHostAlloc``; ledger "pinned_alloc"), where
                the platform refuses registration (vLLM #55428). It is one unit: no seam inside it (R25), freed
                whole by release (R3), kept whole by a quarantine (R12, R29).

        Returns:
            A caller-owned HostRegion.

        Raises:
            InvalidTransferError: sizes that are not ints in [1, 2**63 - 1], a region of more bytes than an
                address spans (2**63 - 1), a ``max_register_bytes`` that is not an int >= 1, or an unknown
                ``pinning``.
            OSError: the system cannot map that much memory (ENOMEM).
            DeviceError: ``pinning="alloc"`` and the backend cannot allocate pinned memory (or that much).
        """
        blocks_per_chunk, num_cpu_chunks = check_sizes(blocks_per_chunk, num_cpu_chunks)
        check_int("max_register_bytes", max_register_bytes, minimum=1)  # R7: before anything is mapped
        if pinning not in ("register", "alloc"):
            raise InvalidTransferError(f"pinning must be 'register' or 'alloc', got {type(pinning).__name__} "
                                       f"{short_repr(pinning)} (e.g. 'register')")
        row_bytes = [layout.cpu_row_bytes(t, blocks_per_chunk) for t in range(layout.num_tensors)]
        offsets, total = [], 0
        for rb in row_bytes:
            offsets.append(total)
            total = _round_up(total + rb * num_cpu_chunks, PAGE)
        if total > INT64_MAX:
            raise InvalidTransferError(f"num_cpu_chunks={num_cpu_chunks}, blocks_per_chunk={blocks_per_chunk}: a "
                                       f"region of {total} bytes: expected at most {INT64_MAX}")
        if pinning == "alloc":
            return cls._allocated(backend, total, offsets, row_bytes, num_cpu_chunks, max_register_bytes)
        try:
            mapping = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:  # R7: say what was asked for, by which field, and what would fit
            raise OSError(exc.errno, map_refused(exc, total, num_cpu_chunks, blocks_per_chunk)) from exc
        return cls(backend, mapping, offsets, row_bytes, num_cpu_chunks, max_register_bytes=max_register_bytes)

    @classmethod
    def _allocated(cls, backend: Backend, total: int, offsets: list[int], row_bytes: list[int], num_cpu_chunks: int,
                   max_register_bytes: int) -> HostRegion:
        """A region over one new pinned allocation of ``total`` bytes, freed again if the region cannot be made."""
        ptr, buffer = pinned_memory.alloc_pinned(backend, total)
        try:
            return cls(backend, buffer, offsets, row_bytes, num_cpu_chunks, max_register_bytes=max_register_bytes)
        except BaseException:
            pinned_memory.free_pinned(backend, ptr)
            raise

    #: The rank named in unregister warnings (upstream's text carries one; a private region is rank 0).
    log_rank: int = 0

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.state.value} {self.nbytes} bytes at {self.ptr:#x}, "
                f"{self.pinning}, {len(self._pinned)} pinned range(s)>")

    # -- what the region holds (read-only views of _held, for subclasses, the worker and tests) --------------------
    @property
    def state(self) -> RegionState:
        """The region's lifecycle state (caller-owned, worker-owned, released, quarantined)."""
        return self._held.state

    @property
    def leaked(self) -> dict[ResourceKind, int]:
        """What release could not release, by ledger kind (filled by release)."""
        return self._held.leaked

    @property
    def _backend(self) -> Backend:
        return self._held.backend

    @property
    def _mmap(self) -> mmap.mmap | None:
        return self._held.mmap

    @property
    def _base(self) -> npt.NDArray[np.uint8] | None:
        return self._held.base

    @property
    def _views(self) -> list[npt.NDArray[np.uint8]]:
        return self._held.views

    @property
    def _pinned(self) -> dict[int, int]:
        return self._held.pinned

    @property
    def owner(self) -> ProcessOwner:
        """The process that built the region; in any other (a forked child) the region is inert (R21)."""
        return self._held.owner

    def _describe(self) -> str:  # the region, for a forked child's WorkerClosedError (R21)
        return f"this {type(self).__name__} ({self.nbytes} bytes at {self.ptr:#x})"

    def _check_owner(self) -> None:  # R21: refuse, in a forked child, a call using the memory or the device
        self._held.owner.check(self._describe())

    # -- queries --------------------------------------------------------------------------------------------------
    def geometries(self) -> tuple[TensorGeometry, ...]:
        """Address and stride of each CPU tensor (what handlers get instead of the region, R1)."""
        return self._geometries

    @property
    def backend(self) -> Backend:
        """The backend the region was built on: its mapping is announced to it and pinned through it."""
        return self._held.backend

    def check_backend(self, backend: Backend) -> None:
        """Refuse to serve a worker on another backend than the one the region was built on (R7).

        The same device seen through a wrapper (a ``FaultyBackend`` over the region's backend, or the other way
        round) is the same backend: they share one ledger, the record of what the region announced and pinned.

        Args:
            backend: the backend a worker over this region would copy with.

        Raises:
            InvalidTransferError: ``backend`` is another device (every copy would fail as an illegal address).
            WorkerClosedError: this is a forked child's copy of the region (R21): it serves no worker there.
        """
        self._check_owner()
        mine = self._held.backend
        if backend is mine or backend.ledger is mine.ledger:
            return
        raise InvalidTransferError(
            f"backend: the region was built on backend {mine.name!r}, not on the worker's backend {backend.name!r}: "
            f"expected the worker's backend (e.g. HostRegion.allocate(backend, ...) or SharedRegion.open(..., "
            f"backend=backend)), or let create_worker build it")

    @property
    def pinned(self) -> bool:
        """Whether the region's memory is pinned: registered with the device, or a live pinned allocation."""
        return bool(self._pinned) or self._held.allocation is not None

    @property
    def pinning(self) -> RegionPinning:
        """How the region is pinned: ``"registered"`` (its mapping registered by :meth:`pin`), ``"allocated"``
        (pinned memory allocated directly, ``allocate(..., pinning="alloc")``) or ``"pageable"`` (a mapping not
        registered). A released region says how it was pinned."""
        return self._held.pinning

    @property
    def allocated(self) -> bool:
        """Whether the region's memory is a pinned allocation (not a mapping)."""
        return self._held.pinning == "allocated"

    @property
    def pinned_ranges(self) -> int:
        """How many registered ranges the region holds."""
        return len(self._pinned)

    def snapshot(self) -> list[npt.NDArray[np.uint8]]:
        """Copies of the CPU tensors.

        Raises:
            OwnershipError: the region was released or quarantined.
            WorkerClosedError: this is a forked child's copy of the region (R21).
        """
        self._check_owner()
        if self.state not in (RegionState.CALLER_OWNED, RegionState.WORKER_OWNED):
            raise OwnershipError(f"the region is {self.state.value}; its memory is no longer readable")
        return [view.copy() for view in self._views]

    # -- pinning --------------------------------------------------------------------------------------------------
    def registration_chunks(self, chunk_bytes: int | None = None) -> list[tuple[int, int]]:
        """The ``(address, size)`` of each registration :meth:`pin` makes, in order (R25, ``seams.py``): chunks of
        at most the cap whose page-aligned seams lie outside every row of every CPU tensor (a row larger than the
        cap is registered whole).

        Args:
            chunk_bytes: a cap for this call (the workers' ``pin_chunk_bytes``); the smaller of it and the region's
                ``max_register_bytes`` applies. None: the region's.

        Raises:
            InvalidTransferError: ``chunk_bytes`` is not an int >= 1.
        """
        cap = self.max_register_bytes
        if chunk_bytes is not None:
            cap = min(cap, check_int("pin_chunk_bytes", chunk_bytes, minimum=1))
        return register_chunks(self.ptr, self.nbytes, self._geometries, cap, PAGE)

    def pin(self, chunk_bytes: int | None = None, *, required: bool = True, raise_refused: bool = False) -> bool:
        """Register the whole region with the device, one ``host_register`` per chunk of
        :meth:`registration_chunks` (R25: no CPU row straddles two registrations). A pinned allocation is pinned
        already: nothing is registered and True returned.

        On a failure, the chunks already registered are unregistered in reverse order; a chunk whose rollback fails
        stays recorded, so release retries it.

        Args:
            chunk_bytes: a cap for this call besides the region's ``max_register_bytes`` (the smaller applies).
            required: False: a failed registration is logged as a warning (transfers then run from pageable memory)
                and False returned, instead of raised.
            raise_refused: raise a refusal of registration by the platform (``RegistrationRefused``) even when
                ``required`` is False (the workers' ``pinning="auto"``: a region it built falls back to a pinned
                allocation on it).

        Returns:
            True once the region is pinned; False when a registration failed and ``required`` is False.

        Raises:
            DeviceError: a registration failed (after the rollback) and ``required`` is True.
            RegistrationRefused: (a DeviceError) the platform refuses registration, and ``required`` or
                ``raise_refused`` is True; the message says what to use instead.
            InvalidTransferError: ``chunk_bytes`` is not an int >= 1.
            WorkerClosedError: this is a forked child's copy of the region (R21).
        """
        self._check_owner()
        if self.allocated:  # R25: one allocation, pinned whole, no seam inside it
            return True
        chunks = self.registration_chunks(chunk_bytes)
        try:
            for ptr, nbytes in chunks:
                self._backend.host_register(ptr, nbytes)
                self._pinned[ptr] = nbytes
        except BaseException as exc:
            self.unpin()
            if isinstance(exc, RegistrationRefused) and (required or raise_refused):
                raise RegistrationRefused(f"{exc}: {self._refused_hint()}", exc.status) from exc
            if required or not isinstance(exc, DeviceError):
                raise
            logger.warning("Failed to pin the CPU region (status %d); transfers run from pageable memory", exc.status)
            return False
        self._held.pinning = "registered"
        return True

    def _refused_hint(self) -> str:
        """What to do when the platform refuses registration (a file-backed region cannot use an allocation)."""
        return ("this platform refuses host registration; build the region with HostRegion.allocate(..., "
                "pinning='alloc'), or let create_worker build it with pinning='auto' or 'alloc'")

    def unpin(self) -> list[DeviceError]:
        """Unregister every pinned range, newest first. A failure is logged, left recorded, and returned; in a
        forked child nothing is unregistered and [] returned (R21: the pins are the parent's). Nothing for a pinned
        allocation (it is freed by release, R3)."""
        failures = self._held.unpin()
        if not self._pinned and not self.allocated:
            self._held.pinning = "pageable"
        return failures

    # -- ownership and fate (R1, R3, R12) -------------------------------------------------------------------------
    def adopt(self) -> None:
        """A worker takes ownership (its constructor succeeded).

        Raises:
            OwnershipError: the region is not caller-owned.
            WorkerClosedError: this is a forked child's copy of the region (R21).
        """
        self._check_owner()
        self._step(RegionInput.ADOPT)

    def release(self) -> list[str]:
        """The caller gives up a region no worker took (R3); idempotent. In a forked child it does nothing and
        returns [] (R21): the memory, pins and file are the parent's.

        Returns:
            Descriptions of release steps that failed (each also logged).

        Raises:
            OwnershipError: a worker owns the region; its shutdown releases it.
        """
        return self._finish(RegionInput.CALLER_RELEASE)

    def release_by_owner(self, shield: Shield | None = None, *, wait: float | None = None) -> list[str]:
        """The owning worker releases the region after proving it idle (or under policy "release"). Nothing in a
        forked child (R21).

        Args:
            shield: collects interrupts arriving meanwhile; every step still runs (R14). None: re-raised at the end.
            wait: the real seconds the release may still wait (R11: what is left of the shutdown's timeout); a
                file-backed region waits for its file's lock no longer (see ``SharedFile.give_up_name``). None:
                the region's own bound.

        Returns:
            Descriptions of release steps that failed (each also logged).
        """
        self._release_wait = wait
        return self._finish(RegionInput.WORKER_RELEASE, shield)

    def quarantine_by_owner(self, reason: str, *, wait: float | None = None, chunks: Iterable[int] | None = None,
                            shield: Shield | None = None) -> list[str]:
        """The owning worker keeps the region -- or, with ``chunks``, only the registrations an unproven copy may
        still touch (R29) -- mapped and pinned until process exit (R12). Nothing in a forked child (R21).

        With ``chunks``, a registration (R25's chunk) is kept if its bytes meet row ``r`` of any tensor for some
        ``r`` in ``chunks``; the rest is unregistered and given back where the platform can (``region_keep.py``
        says how, per platform; an unpinned region keeps those rows' pages). An empty ``chunks`` keeps nothing:
        the region is released (R3). A region that cannot be kept in part (``keeps_whole``) keeps the whole.

        Args:
            reason: why, for the quarantine registry and the log.
            wait: as for :meth:`release_by_owner` (a file-backed region gives up its file's name within it).
            chunks: the CPU chunk ids (rows) an unproven copy may still touch; None: keep the whole region.
            shield: collects interrupts arriving meanwhile (R14); None: re-raised at the end.

        Returns:
            Descriptions of quarantine steps that failed (each also logged), e.g. a file region's unlink (R18).

        Chunk ids that are not ints in ``[0, num_cpu_chunks)`` are logged and the whole region kept (never raised:
        this is a shutdown step).
        """
        if self._held.owner.inherited():
            return []
        rows = None if chunks is None else rows_to_keep(chunks, self.num_cpu_chunks)
        self._quarantine_reason, self._release_wait = reason, wait
        if rows is not None and not rows.size:  # R29: nothing an unproven copy may touch: released (R3)
            return self._finish(RegionInput.WORKER_RELEASE, shield)
        self._keep_rows = None if self.keeps_whole else rows  # R29
        return self._finish(RegionInput.WORKER_QUARANTINE, shield)

    @property
    def keeps_whole(self) -> bool:
        """Whether a quarantine keeps the whole region whatever ``chunks`` says (R29): a pinned allocation is one
        unit (CUDA frees none of it in part)."""
        return self.allocated

    @property
    def memory_kind(self) -> ResourceKind:
        """The ledger kind of the region's memory: ``"pinned_alloc"`` for a pinned allocation, else ``"mapping"``."""
        return "pinned_alloc" if self.allocated else "mapping"

    def inherit_leaks(self, leaked: dict[ResourceKind, int]) -> None:
        """Take over the leaks of a region this one replaces (``pinning="auto"``'s fallback releases the refused
        mapped region first): they are reported with this region's own ``leaked`` (R16)."""
        for kind, count in leaked.items():
            self._held.leaked[kind] = self._held.leaked.get(kind, 0) + count

    @property
    def kept_ranges(self) -> tuple[KeptRange, ...]:
        """The ranges of the region kept in quarantine, in address order (R29); () unless quarantined."""
        return self._kept

    @property
    def quarantined_bytes(self) -> int:
        """Bytes of the region kept in quarantine (R30); 0 unless quarantined."""
        return sum(k.length for k in self._kept)

    def _step(self, event: RegionInput) -> Action:
        return self._held.step(event)

    def _finish(self, event: RegionInput, shield: Shield | None = None) -> list[str]:
        if self._held.owner.inherited():  # R21: before the lock, which the fork may have copied held
            return []
        action = self._step(event)
        if action is Action.RELEASE:
            self._dropped.detach()
            return self._release_steps(shield)
        if action is Action.QUARANTINE:
            self._dropped.detach()
            return self._quarantine(shield)
        return []

    @property
    def quarantined_resources(self) -> dict[ResourceKind, int]:
        """What a quarantine keeps alive until process exit, by ledger kind ({} unless quarantined, R12/R16)."""
        if self.state is not RegionState.QUARANTINED:
            return {}
        kept: dict[ResourceKind, int] = {"pinned": len(self._pinned), self.memory_kind: 1,
                                         **self._quarantined_backing()}
        return {kind: count for kind, count in kept.items() if count}

    def _quarantined_backing(self) -> dict[ResourceKind, int]:
        """Ledger kinds, besides pins and the mapping, that a quarantine keeps (a file-backed region's fd)."""
        return {}

    def _quarantine_backing(self) -> list[str]:
        """R18 hook: what a quarantine does to the region's backing store (nothing for anonymous memory)."""
        return []

    def _quarantine(self, shield: Shield | None = None) -> list[str]:
        """R12: keep the mapping and pins alive until process exit (R29: with rows to keep, only the registrations
        that hold them; the rest given back first, in R3's order), after the backing's own step (R18). A pinned
        allocation is kept whole and never freed (R29: one allocation is one unit)."""
        local, rows, self._keep_rows = shield or Shield(), self._keep_rows, None
        failures: list[str] = []
        given_back: list[tuple[int, int]] = []  # the (start, end) ranges given back (R29)
        if rows is not None:
            try:
                failures += give_back_unkept(self._held, self._geometries, rows, local, given_back)
            except BaseException as exc:  # R14: interrupted past retries: what is left stays kept, the interrupt
                local.interrupt = local.interrupt or exc  # is re-raised once the quarantine is done
                logger.warning("Quarantine by registration interrupted; the rest of the region stays kept")
        failures += self._quarantine_backing()
        ledger = self._backend.ledger
        for ptr in self._pinned:
            ledger.quarantine("pinned", ptr)
        # the mapping stays one resource, kept whole or in part; an allocation is kept whole, never freed (R12)
        ledger.quarantine(self.memory_kind, self.ptr)
        reason = self._quarantine_reason
        self._kept = kept_ranges(self.ptr, self.nbytes, self._geometries, rows, given_back, reason)
        held = "one pinned allocation, kept whole" if self.allocated else f"{len(self._pinned)} pinned range(s)"
        quarantine(QuarantinedItem("region", f"{self.quarantined_bytes} of {self.nbytes} bytes at {self.ptr:#x}, "
                                   f"{self.pinning}: {held}", reason, self,
                                   tuple((k.offset, k.length) for k in self._kept)))
        logger.warning("Region of %d bytes at %#x quarantined until process exit (%d bytes kept in %d range(s)): %s",
                       self.nbytes, self.ptr, self.quarantined_bytes, len(self._kept), reason)
        if shield is None:
            local.reraise()
        return failures

    def _release_steps(self, shield: Shield | None = None) -> list[str]:
        """R3: unregister (reverse) -> drop views -> unmap (or free the pinned allocation) -> release the backing
        (unlink, close).

        A failed step is logged; the next steps still run, whatever interrupts arrive (kept in ``shield``).
        """
        return self._held.release_steps(self._release_backing, shield)

    def _release_backing(self) -> list[str]:
        """R3 steps after the unmap (unlink the file, close its descriptor); nothing for anonymous memory."""
        return []
