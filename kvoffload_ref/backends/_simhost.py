"""The simulated device's host-memory calls: announcing a mapping (``track_host``), forgetting it whole or a page at
a time (``untrack_host``, ``untrack_host_pages``, R29), pinning and unpinning ranges of it (``host_register``,
``host_unregister``), the registrations live now (``registrations``, R25), and pinned memory allocated directly
(``alloc_pinned``, ``free_pinned``: where registration is refused, ``host_register="refuse"``).

:class:`SimHostCalls` adds them to :class:`~kvoffload_ref.backends._simcore.SimCore`'s state and steps;
:class:`~kvoffload_ref.backends.sim.SimBackend` inherits them. See ``sim.py`` for the theory of operation.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._simcore import PAGE, SimCore
from kvoffload_ref.backends._simmem import Span, host_view
from kvoffload_ref.errors import (
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
    CUDA_ERROR_INVALID_VALUE,
    DeviceError,
    InvalidTransferError,
    RegistrationRefused,
)
from kvoffload_ref.validate import INT64_MAX, check_int

__all__ = ["SimHostCalls"]


class SimHostCalls(SimCore):
    """The host-memory calls of the :class:`~kvoffload_ref.backends.sim.SimBackend` facade (in their own module for
    the size of the core's)."""

    def track_host(self, ptr: int, nbytes: int) -> None:
        """Announce a host mapping [ptr, ptr+nbytes) (ledger kind "mapping", key ptr); copies may then use it.

        The caller vouches that the memory stays mapped until :meth:`untrack_host`. No device failure applies.

        Raises:
            InvalidTransferError: an address or size that is not an int, not positive, or ends beyond the int64
                address range; or a range overlapping live memory.
        """
        ptr = check_int("track_host: ptr", ptr, maximum=INT64_MAX)
        nbytes = check_int("track_host: nbytes", nbytes, maximum=INT64_MAX)
        if ptr <= 0 or nbytes <= 0 or ptr + nbytes > INT64_MAX:
            raise InvalidTransferError(f"track_host: ptr and nbytes must be positive with ptr + nbytes <= {INT64_MAX}, "
                                       f"got ptr={ptr:#x}, nbytes={nbytes} (e.g. ptr=0x10000, nbytes=4096)")
        if self.on_call is not None:
            self.on_call("track_host", None)
        with self._lock:
            self._memory.add(Span(ptr, ptr + nbytes, True, host_view(ptr, nbytes)))
            self._ledger.acquire("mapping", ptr)

    def untrack_host(self, ptr: int) -> None:
        """Forget the host mapping starting at ptr (fault point ``unmap``).

        Pending copies touching it are recorded (``unmap_under_dma``) and poisoned: they will not touch it and
        will raise the sticky illegal-address error when they execute. An unknown ptr is recorded
        (``invalid_release``). Ranges still pinned inside it stay registered (as after a failed unregister).

        Raises:
            DeviceError: an injected ``unmap`` fault (nothing happens: the mapping stays tracked and live).
        """
        if self.on_call is not None:
            self.on_call("untrack_host", None)
        with self._lock:
            self._release_fault("unmap")
            self._catch_up()
            pieces = [] if ptr in self._allocs else self._memory.mapping_pieces(ptr)
            if not pieces:
                self._violate("invalid_release", f"untrack_host({ptr:#x}): no tracked mapping starts there")
                return
            for span in pieces:  # the mapping whole, or what untrack_host_pages left of it (R29)
                where = f"mapping [{span.start:#x}, {span.end:#x})"
                self._poison_pending(span.start, span.end, "unmap_under_dma", f"{where} was untracked")
                self._memory.remove(span.start)
            self._ledger.release("mapping", ptr)

    def untrack_host_pages(self, ptr: int, nbytes: int) -> None:
        """Forget the page-aligned piece ``[ptr, ptr+nbytes)`` of one tracked host mapping (R29: a page-granular
        unmap; fault point ``unmap``). The rest of the mapping stays tracked, and the mapping stays one ledger
        "mapping" (key: its start) until :meth:`untrack_host` of its start forgets what is left of it.

        Pending copies touching the piece are recorded (``unmap_under_dma``) and poisoned, as for
        :meth:`untrack_host`; a copy submitted later that touches it touches memory outside every live span
        (``illegal_address``). A piece not inside one tracked mapping is recorded (``invalid_release``). Ranges
        pinned inside the piece stay registered (as after a failed unregister).

        Raises:
            InvalidTransferError: ``ptr`` or ``nbytes`` is not an int >= 1, or ``ptr`` is not page-aligned, or
                the piece ends neither on a page boundary nor at the end of its mapping (R7).
            DeviceError: an injected ``unmap`` fault (nothing happens).
        """
        ptr = check_int("untrack_host_pages: ptr", ptr, minimum=1, maximum=INT64_MAX)
        nbytes = check_int("untrack_host_pages: nbytes", nbytes, minimum=1, maximum=INT64_MAX - ptr)
        if self.on_call is not None:
            self.on_call("untrack_host", None)
        with self._lock:
            self._release_fault("unmap")
            self._catch_up()
            span = self._memory.span_holding(ptr, nbytes)
            end = ptr + nbytes
            if span is None or not span.is_host or span.start in self._allocs:
                self._violate("invalid_release", f"untrack_host_pages({ptr:#x}, {nbytes}): not inside one tracked "
                              "mapping")
                return
            if ptr % PAGE or (end % PAGE and end != span.end):
                raise InvalidTransferError(f"untrack_host_pages: ptr must be a multiple of the page ({PAGE} bytes) "
                                           f"and ptr + nbytes one too or the mapping's end ({span.end:#x}), got "
                                           f"ptr={ptr:#x}, nbytes={nbytes} (e.g. ptr={span.start:#x}, "
                                           f"nbytes={min(PAGE, span.end - span.start)})")
            self._poison_pending(ptr, end, "unmap_under_dma", f"pages [{ptr:#x}, {end:#x}) were untracked")
            self._memory.cut(ptr, end)

    def host_register(self, ptr: int, nbytes: int) -> None:
        """Pin [ptr, ptr+nbytes) of a tracked mapping (ledger kind "pinned", key ptr). Fault point.

        Raises:
            InvalidTransferError: ``ptr`` or ``nbytes`` is not an int (or beyond int64); nothing is counted.
            DeviceError: an injected fault or a lost device; status 1 if the range is not inside one tracked
                mapping; 712 if it overlaps a pinned range (or a pinned allocation).
            RegistrationRefused: the platform refuses every registration (``host_register="refuse"``; status 801,
                after the fault checks; not sticky).
        """
        ptr = check_int("host_register: ptr", ptr, maximum=INT64_MAX)
        nbytes = check_int("host_register: nbytes", nbytes, maximum=INT64_MAX)
        if self.on_call is not None:
            self.on_call("host_register", None)
        with self._lock:
            self._fault("host_register", None)
            if self._refuse_register:
                raise RegistrationRefused(f"host_register({ptr:#x}, {nbytes}): this platform does not support host "
                                          "registration (cudaErrorNotSupported)")
            span = self._memory.span_holding(ptr, nbytes) if nbytes > 0 else None
            if span is None or not span.is_host:
                raise DeviceError(f"host_register({ptr:#x}, {nbytes}): not inside one tracked host mapping",
                                  CUDA_ERROR_INVALID_VALUE)
            if self._memory.pins_overlapping(ptr, ptr + nbytes):
                raise DeviceError(f"host_register({ptr:#x}, {nbytes}): overlaps a pinned range",
                                  CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
            self._memory.pin(ptr, ptr + nbytes)
            self._unpinned.discard(ptr)
            self._ledger.acquire("pinned", ptr)

    def host_unregister(self, ptr: int) -> None:
        """Unpin the range registered at ptr. Fault point.

        Pending copies touching the range are recorded (``unregister_under_dma``) and poisoned (they raise the
        sticky illegal-address error when they execute).

        Raises:
            DeviceError: an injected fault or a lost device (the range stays pinned); 713 if nothing is
                registered at ptr (a second unregister is also recorded as ``double_unregister``).
        """
        if self.on_call is not None:
            self.on_call("host_unregister", None)
        with self._lock:
            self._fault("host_unregister", None)
            if ptr not in self._memory.pinned or ptr in self._allocs:  # an allocation is freed, not unregistered
                if ptr in self._unpinned:
                    self._violate("double_unregister", f"host_unregister({ptr:#x}) called twice")
                raise DeviceError(f"host_unregister({ptr:#x}): not registered",
                                  CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
            self._catch_up()
            end = self._memory.pinned[ptr]
            self._poison_pending(ptr, end, "unregister_under_dma",
                                 f"pinned range [{ptr:#x}, {end:#x}) was unregistered")
            self._memory.unpin(ptr)
            self._unpinned.add(ptr)
            self._ledger.release("pinned", ptr)

    def registrations(self) -> list[tuple[int, int]]:
        """The ``(start, end)`` of every range registered and not unregistered, in address order (R25); pinned
        allocations are not registrations."""
        with self._lock:
            return sorted((s, e) for s, e in self._memory.pinned.items() if s not in self._allocs)

    def alloc_pinned(self, nbytes: int) -> tuple[int, npt.NDArray[np.uint8]]:
        """Allocate ``nbytes`` of pinned host memory, page-aligned and zeroed (ledger kind ``"pinned_alloc"``, key:
        its address). It is a live host span pinned whole: copies use it as a registered range, with no seam
        inside it (R25), and the race and use-after-free checks see it as they see registered pages. Allowed
        whether or not the platform refuses registration (``cudaHostAlloc`` works there).

        Returns:
            ``(ptr, buffer)``: the address and a 1-D uint8 array of exactly its bytes.

        Raises:
            InvalidTransferError: ``nbytes`` is not an int in [1, 2**63 - 1] (R7).
            DeviceError: a lost device.
        """
        nbytes = check_int("alloc_pinned: nbytes", nbytes, minimum=1, maximum=INT64_MAX)
        if self.on_call is not None:
            self.on_call("alloc_pinned", None)
        with self._lock:
            self._check_alive()
            raw = np.zeros(nbytes + PAGE, dtype=np.uint8)
            skip = -int(raw.ctypes.data) % PAGE
            buffer = raw[skip: skip + nbytes]
            ptr = int(buffer.ctypes.data)
            self._memory.add(Span(ptr, ptr + nbytes, True, buffer))
            self._memory.pin(ptr, ptr + nbytes)
            self._allocs[ptr] = buffer
            self._ledger.acquire("pinned_alloc", ptr)
            return ptr, buffer

    def free_pinned(self, ptr: int) -> None:
        """Free the pinned allocation at ``ptr`` (fault point ``unmap``: the memory is given back).

        Pending copies touching it are recorded (``unmap_under_dma``) and poisoned, as for :meth:`untrack_host`; a
        copy submitted later that touches it touches memory outside every live span (``illegal_address``). An
        unknown ptr is recorded (``invalid_release``).

        Raises:
            DeviceError: an injected ``unmap`` fault (nothing happens: the allocation stays live).
        """
        if self.on_call is not None:
            self.on_call("free_pinned", None)
        with self._lock:
            self._release_fault("unmap")
            self._catch_up()
            buffer = self._allocs.get(ptr)
            if buffer is None:
                self._violate("invalid_release", f"free_pinned({ptr:#x}): no pinned allocation starts there")
                return
            end = ptr + buffer.size
            self._poison_pending(ptr, end, "unmap_under_dma", f"pinned allocation [{ptr:#x}, {end:#x}) was freed")
            self._memory.remove(ptr)
            self._memory.unpin(ptr)
            del self._allocs[ptr]
            self._ledger.release("pinned_alloc", ptr)
