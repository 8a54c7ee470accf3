"""The simulated device's memory calls: device arrays (``empty_device``, ``from_host``, ``to_host``,
``array_info``) and descriptor buffers (``alloc_descriptors``, ``free_descriptors``).

:class:`SimArrayCalls` adds them to :class:`~kvoffload_ref.backends._simcore.SimCore`'s state and steps;
:class:`~kvoffload_ref.backends.sim.SimBackend` inherits them. See ``sim.py`` for the theory of operation.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._simcore import SimCore, describe
from kvoffload_ref.backends.base import DescriptorBuffer, Tag, TensorGeometry
from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.validate import INT64_MAX, check_int

__all__ = ["SimArrayCalls"]


class SimArrayCalls(SimCore):
    """The device-array and descriptor-buffer calls of the :class:`~kvoffload_ref.backends.sim.SimBackend` facade
    (in their own module for the size of the facade's)."""

    # -- device memory -----------------------------------------------------------------------------------------

    def empty_device(self, shape: tuple[int, int]) -> object:
        """A new zero-filled, C-contiguous 2-D uint8 device array.

        Args:
            shape: (rows, row_bytes), both positive.

        Returns:
            A numpy array whose memory the device may copy to and from.

        Raises:
            InvalidTransferError: a malformed shape.
            DeviceError: the device is lost.
        """
        if self.on_call is not None:
            self.on_call("empty_device", None)
        with self._lock:
            return self._new_device_array(shape)

    def from_host(self, array: npt.NDArray[np.uint8]) -> object:
        """A new device array holding a copy of a 2-D uint8 host array.

        Raises:
            InvalidTransferError: not a non-empty 2-D uint8 numpy array.
            DeviceError: the device is lost.
        """
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 2:
            raise InvalidTransferError(f"from_host: array must be a 2-D uint8 numpy array (e.g. "
                                       f"np.zeros((4, 64), np.uint8)), got {describe(array)}")
        if self.on_call is not None:
            self.on_call("from_host", None)
        with self._lock:
            device = self._new_device_array((int(array.shape[0]), int(array.shape[1])))
            np.copyto(device, array)
            return device

    def to_host(self, array: object) -> npt.NDArray[np.uint8]:
        """A host copy of a device array, taken once the compute stream's queued work has run.

        The clock advances to when that work completes.

        Raises:
            InvalidTransferError: not a device array of this backend.
            DeviceError: the device is lost (or fails while the compute stream drains).
            SimHang: the compute stream's work cannot complete within the hang horizon.
        """
        if self.on_call is not None:
            self.on_call("to_host", None)
        with self._lock:
            self._check_alive()
            view = self._device_view(array)
            marker = self._submit_record(self._compute)
            self._wait_for(marker, "to_host: the compute stream's queued work")
            if self._race is not None:   # observed; to_host itself is an inspection, never part of a race
                self._race.observe(marker)
            return np.array(view, copy=True)

    def array_info(self, array: object) -> TensorGeometry:
        """Geometry of a device array of this backend, or of a 2-D row-contiguous view of one.

        Raises:
            InvalidTransferError: anything else (another backend's array, wrong dtype, not 2-D, empty,
                rows not contiguous).
        """
        if self.on_call is not None:
            self.on_call("array_info", None)
        with self._lock:
            return self._geometry(array)[0]

    # -- descriptor buffers ------------------------------------------------------------------------------------

    def alloc_descriptors(self, capacity: int, *, tag: Tag | None = None) -> DescriptorBuffer:
        """A zeroed descriptor buffer for ``capacity`` copies (ledger kind "descriptor", key id(buffer)).

        Raises:
            InvalidTransferError: a capacity that is not an int in [0, 2**63 - 1] (checked first: no fault point is
                counted).
            DeviceError: an injected ``descriptor_alloc`` fault or a lost device.
        """
        capacity = check_int("descriptor capacity", capacity, minimum=0, maximum=INT64_MAX)
        if self.on_call is not None:
            self.on_call("descriptor_alloc", tag)
        with self._lock:
            self._fault("descriptor_alloc", tag)
            src, dst, sizes = self._descriptor_words.carve(capacity)
            buf = DescriptorBuffer(src, dst, sizes, handle=next(self._labels))  # the handle: the buffer's number
            key = id(buf)  # one int for both tables
            self._buffers[key] = buf
            self._ledger.acquire("descriptor", key)
            return buf

    def free_descriptors(self, buf: DescriptorBuffer) -> None:
        """Free a descriptor buffer (fault point ``free``).

        Freeing one that a pending copy still reads is recorded (``descriptor_freed_under_dma``); the copy
        still runs with the descriptors it reads. An unknown or already freed buffer is recorded
        (``invalid_release``).

        Raises:
            DeviceError: an injected ``free`` fault (nothing happens: the buffer stays live).
        """
        key = id(buf)
        if self.on_call is not None:
            self.on_call("free_descriptors", None)
        with self._lock:
            self._release_fault("free")
            self._catch_up()
            if buf is None or self._buffers.get(key) is not buf:  # (None finds get's default: never live)
                self._violate("invalid_release", f"free_descriptors({buf!r}): not a live buffer of this device")
                return
            users = self._buffer_users.get(key)
            if users:
                self._violate("descriptor_freed_under_dma", f"{buf!r} freed while {users} pending copies read it")
            del self._buffers[key]
            self._ledger.release("descriptor", key)
