"""What a host region holds, apart from the region object, and R3's release steps over it (``region.py``).

A :class:`Held` keeps the region's backend, its memory (an anonymous or file ``mmap``, or a pinned allocation where
registration is refused: ``backends.pinned``), the views, the registered ranges and the lifecycle state, so that a
finalizer can hold it without holding the region. Release (R3) is: unregister the registered ranges, newest first
-> drop the views -> unmap the mapping, or free the allocation (a pinned allocation has nothing to unregister and is
not a mapping) -> the backing's own steps (a file: unlink, close). A failed step is logged and the next still run.

Unlike an ``mmap``, whose ``close()`` refuses while a view is exported, an allocation cannot tell whether a view
outlives it: the library drops every view it made before the free, and hands callers copies only (``snapshot``).
"""

from __future__ import annotations

import functools
import logging
import mmap
import threading
from collections.abc import Callable, Container

import numpy as np
import numpy.typing as npt

from kvoffload_ref import lifecycle, tables
from kvoffload_ref.backends.base import Backend, ResourceKind
from kvoffload_ref.backends.pinned import free_pinned
from kvoffload_ref.errors import DeviceError
from kvoffload_ref.lifecycle import Action, RegionInput, RegionState
from kvoffload_ref.process import ProcessOwner
from kvoffload_ref.quarantine import QuarantinedItem, quarantine
from kvoffload_ref.results import RegionPinning
from kvoffload_ref.shield import Shield

__all__ = ["Held", "view_of"]

logger = logging.getLogger("kvoffload_ref.region")


def view_of(base: npt.NDArray[np.uint8], offset: int, rows: int, row_bytes: int,
          row_stride: int) -> npt.NDArray[np.uint8]:
    """A 2-D ``(rows, row_bytes)`` view of ``base`` starting at ``offset``, rows ``row_stride`` bytes apart."""
    if row_stride == row_bytes:
        return base[offset: offset + rows * row_bytes].reshape(rows, row_bytes)
    span = base[offset: offset + (rows - 1) * row_stride + row_bytes]
    return np.lib.stride_tricks.as_strided(span, shape=(rows, row_bytes), strides=(row_stride, 1))


class Held:
    """Everything a region holds, apart from the region object: its backend, mapping, views, pinned ranges and
    lifecycle state, and R3's steps over them. The region's finalizer holds this, never the region."""

    def __init__(self, backend: Backend, mapping: mmap.mmap | None, base: npt.NDArray[np.uint8],
                 log_rank: int) -> None:
        self.backend = backend
        # Invariant: open until release; never closed while the backend may still read it (R12). None for a
        # region whose memory is a pinned allocation (then ``allocation`` is set instead).
        self.mmap: mmap.mmap | None = mapping
        # Invariant: the address of the region's pinned allocation (``backends.pinned``) until it is freed (R3) or
        # forever once quarantined (R12); None for a mapped region.
        self.allocation: int | None = None if mapping is not None else int(base.ctypes.data)
        # Invariant: the only buffer export of mmap (np.frombuffer), or the allocation's buffer; every view derives
        # from it.
        self.base: npt.NDArray[np.uint8] | None = base
        self.ptr: int = int(base.ctypes.data)
        self.nbytes: int = int(base.size)
        # Invariant: how the region is pinned: "allocated" from construction for an allocation; for a mapping
        # "pageable" until pin() registered it whole, then "registered" (kept after release, for the report).
        self.pinning: RegionPinning = "pageable" if mapping is not None else "allocated"
        # Invariant: one 2-D view per layout tensor; emptied (dropped) only by release (R3 step 2).
        self.views: list[npt.NDArray[np.uint8]] = []
        # Invariant: start -> size of the ranges registered and not yet unregistered, in registration order (R29
        # keeps the ones a late copy may touch).
        self.pinned: dict[int, int] = {}
        # Invariant: changed only through step(), i.e. tables.step(REGION_TABLE, ...), under lock.
        self.state = RegionState.CALLER_OWNED
        # Invariant: what release could not release, by ledger kind (filled by release; zeros omitted by users).
        self.leaked: dict[ResourceKind, int] = {}
        self.log_rank = log_rank
        # Invariant: the process that built the region; in any other (a forked child) nothing here is released.
        self.owner = ProcessOwner()
        self.lock = threading.Lock()

    def step(self, event: RegionInput) -> Action:
        with self.lock:
            self.state, action = tables.step(lifecycle.REGION_TABLE, "region", self.state, event)
            return action

    def unpin(self, shield: Shield | None = None, only: Container[int] | None = None) -> list[DeviceError]:
        """Unregister every pinned range (or those in ``only``), newest first. A failure is logged, left recorded,
        and returned. With a ``shield``, an interrupt does not stop it (R14): the call is retried, the interrupt
        kept there. Nothing in a forked child (R21): the pins are the parent's."""
        if self.owner.inherited():
            return []
        failures: list[DeviceError] = []
        run = (shield or Shield()).run
        for ptr in [p for p in reversed(self.pinned) if only is None or p in only]:
            try:
                run(functools.partial(self.backend.host_unregister, ptr))
            except DeviceError as exc:
                logger.warning("cudaHostUnregister failed for rank=%d (code=%d)", self.log_rank, exc.status)
                failures.append(exc)
                continue
            del self.pinned[ptr]
        return failures

    def release_steps(self, release_backing: Callable[[], list[str]], shield: Shield | None = None) -> list[str]:
        """R3: unregister (reverse) -> drop views -> unmap (or free the pinned allocation) -> release the backing
        (unlink, close).

        A failed step is logged; the next steps still run. An interrupt does not stop them (R14): it is kept in
        ``shield`` (re-raised at the end when no shield is given).
        """
        local = shield or Shield()
        errors, _ = self.unpin_or_leak(local)
        self.views.clear()  # R3 step 2: drop every view the library made, then the base export
        self.base = None
        errors.extend(self._free(local) if self.allocation is not None else self._unmap(local))
        errors.extend(release_backing())
        if shield is None:
            local.reraise()
        return errors

    def unpin_or_leak(self, shield: Shield,
                      only: Container[int] | None = None) -> tuple[list[str], list[tuple[int, int]]]:
        """R3 step 1: unregister every range (or those in ``only``), newest first; a range whose unregister failed
        is no longer ours to release: leaked (R16), dropped from ``pinned``.

        Returns:
            (descriptions of the failed unregisters, the ``(start, size)`` of the ranges leaked).
        """
        errors = [f"host_unregister failed (status {exc.status})" for exc in self.unpin(shield, only)]
        leaked = [(ptr, size) for ptr, size in self.pinned.items() if only is None or ptr in only]
        for ptr, _ in leaked:
            self.backend.ledger.leak("pinned", ptr)
            del self.pinned[ptr]
        self.leaked["pinned"] = self.leaked.get("pinned", 0) + len(leaked)
        return errors, leaked

    def _unmap(self, shield: Shield) -> list[str]:
        mapping, self.mmap = self.mmap, None
        if mapping is None:
            return []
        try:
            mapping.close()
        except BufferError as exc:  # someone still holds a view: unmapping now would leave it dangling
            logger.error("Failed to close mmap_obj", exc_info=True)
            self.backend.ledger.leak("mapping", self.ptr)
            self.leaked["mapping"] = 1
            quarantine(QuarantinedItem("region", f"mapping at {self.ptr:#x}", "a view is still exported",
                                       mapping))
            return [f"mmap close failed: {exc}"]
        try:  # the unmap as the device sees it (fault point "unmap")
            shield.run(functools.partial(self.backend.untrack_host, self.ptr))
        except DeviceError as exc:  # R3: logged, leaked (R16), and the next steps still run
            logger.warning("Unmapping the region at %#x failed for rank=%d (code=%d)", self.ptr, self.log_rank,
                           exc.status)
            self.backend.ledger.leak("mapping", self.ptr)
            self.leaked["mapping"] = 1
            return [f"unmap failed (status {exc.status})"]
        return []

    def _free(self, shield: Shield) -> list[str]:
        """R3's last step for a pinned allocation (its views are dropped): free it; nothing to unregister or unmap.
        A failure is logged and the allocation leaked (R16)."""
        ptr, self.allocation = self.allocation, None
        if ptr is None:
            return []
        try:
            shield.run(functools.partial(free_pinned, self.backend, ptr))
        except DeviceError as exc:  # R3: logged, leaked (R16), and the next steps still run
            logger.warning("cudaFreeHost failed for the region at %#x, rank=%d (code=%d)", ptr, self.log_rank,
                           exc.status)
            self.backend.ledger.leak("pinned_alloc", ptr)
            self.leaked["pinned_alloc"] = 1
            return [f"free_pinned failed (status {exc.status})"]
        return []

    def release_dropped(self, kind: str) -> None:
        """The finalizer: release a region its caller dropped without ``release()`` (R3); nothing otherwise.

        Only a caller-owned region is released here: a worker-owned one is its worker's to release (the worker
        holds it), a quarantined one is held by the quarantine registry until exit, a released one is done. Nothing
        in a forked child (R21), before the lock: the fork may have copied it held, and the region is the parent's.
        """
        if self.owner.inherited():
            return
        if self.step(RegionInput.DROPPED) is not Action.RELEASE:
            return
        logger.warning("%s of %d bytes at %#x was dropped without release(); releasing it now (R3)",
                       kind, self.nbytes, self.ptr)
        self.release_steps(list)
