"""Pinned host memory allocated directly, for platforms that refuse host registration (vLLM #55428).

Under NVIDIA Confidential Computing (an H200, vLLM #55428) ``cudaHostRegister`` fails with
``cudaErrorNotSupported`` (801) for every size and flag, while ``cudaHostAlloc`` works. A backend that can allocate
pinned host memory offers :class:`PinnedAllocBackend`'s two methods; they are not part of the required
:class:`~kvoffload_ref.backends.base.Backend` protocol. The library calls the module functions here
(:func:`alloc_pinned`, :func:`free_pinned`), which refuse with a :class:`~kvoffload_ref.errors.DeviceError` for a
backend without them (a third-party backend, a test double), so such a backend keeps working as before wherever no
pinned allocation is asked for.

A backend whose ``host_register`` refuses every registration raises
:class:`~kvoffload_ref.errors.RegistrationRefused` there (a typed error: the library never reads a message); one
that knows in advance says so with a ``refuses_registration`` attribute (:func:`refuses_registration`), which a
shared region, whose file mapping can only be registered, checks when it is opened.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.errors import CUDA_ERROR_NOT_SUPPORTED, DeviceError

__all__ = ["PinnedAllocBackend", "alloc_pinned", "free_pinned", "refuses_registration"]


@runtime_checkable
class PinnedAllocBackend(Backend, Protocol):
    """A backend that allocates pinned host memory directly (the simulated device, CuPy)."""

    def alloc_pinned(self, nbytes: int) -> tuple[int, npt.NDArray[np.uint8]]:
        """Allocate ``nbytes`` of pinned host memory (ledger kind ``"pinned_alloc"``, key: its address).

        Copies may use it at once, as a registered range, with no seam inside it (R25).

        Returns:
            ``(ptr, buffer)``: its address and a 1-D uint8 array of exactly its bytes. The buffer does not keep
            the memory alive: once :meth:`free_pinned` ran, no view of it may be used.
        """
        ...

    def free_pinned(self, ptr: int) -> None:
        """Free the allocation at ``ptr``. May fail (the allocation then stays: leaked)."""
        ...


def alloc_pinned(backend: Backend, nbytes: int) -> tuple[int, npt.NDArray[np.uint8]]:
    """``backend.alloc_pinned(nbytes)`` (:meth:`PinnedAllocBackend.alloc_pinned`).

    Raises:
        DeviceError: the backend cannot allocate pinned host memory (it has no ``alloc_pinned``; status 801), or
            its allocation failed.
    """
    alloc = getattr(backend, "alloc_pinned", None)
    if alloc is None:
        raise DeviceError(f"backend {backend.name!r} cannot allocate pinned host memory (it has no alloc_pinned): "
                          f"use a region pinned by registration (pinning='register')", CUDA_ERROR_NOT_SUPPORTED)
    ptr, buffer = alloc(nbytes)
    return int(ptr), buffer


def free_pinned(backend: Backend, ptr: int) -> None:
    """``backend.free_pinned(ptr)`` (:meth:`PinnedAllocBackend.free_pinned`).

    Raises:
        DeviceError: the backend has no ``free_pinned`` (status 801; it allocated nothing), or the free failed.
    """
    free = getattr(backend, "free_pinned", None)
    if free is None:
        raise DeviceError(f"backend {backend.name!r} cannot free pinned host memory (it has no free_pinned)",
                          CUDA_ERROR_NOT_SUPPORTED)
    free(ptr)


def refuses_registration(backend: Backend) -> bool:
    """Whether ``backend`` says in advance that its ``host_register`` refuses every registration (an optional
    ``refuses_registration`` attribute; False when absent: a refusal is then seen only when registering)."""
    return bool(getattr(backend, "refuses_registration", False))
