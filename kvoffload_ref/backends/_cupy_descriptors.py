"""The CuPy backend's descriptor buffers: pinned ``[src | dst | sizes]`` words with a device twin, pooled.

A block holds ``slots`` int64 words per array in one ``cudaHostAlloc`` block (not CuPy's pinned pool, which
rounds to a power of two and caches), plus a device twin of the same size that the copy kernel reads. Blocks are
pooled by power-of-two slot count and never freed on the transfer or shutdown path: ``cudaFree`` and
``cudaFreeHost`` synchronize the device, which may hang (R11). Only :meth:`DescriptorPool.release_cached` frees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._cupy_copy import MIN_DESCRIPTOR_SLOTS
from kvoffload_ref.backends._cupy_runtime import HOST_ALLOC_FLAGS, CudaCalls, host_words
from kvoffload_ref.backends.base import DescriptorBuffer, Tag
from kvoffload_ref.errors import DeviceError, InvalidTransferError, LifecycleError
from kvoffload_ref.validate import short_repr

__all__ = ["DescriptorBlock", "DescriptorPool"]


@dataclasses.dataclass(eq=False)
class DescriptorBlock:
    """Pinned host words ``[src | dst | sizes]`` (``slots`` each) and their device twin for the kernel path."""

    owner: int          # Invariant: id() of the pool that made it.
    host_ptr: int       # Invariant: the cudaHostAlloc block, 3 * 8 * slots bytes.
    dev_ptr: int        # Invariant: the device twin, same size.
    slots: int
    words: npt.NDArray[np.int64]
    # Invariant: the DescriptorBuffer this block is issued to, or None while it is in the pool.
    issued_to: DescriptorBuffer | None = None


class DescriptorPool:
    """Issues descriptor buffers from pooled blocks. Thread-safe.

    Args:
        cuda: the backend's CUDA call wrapper (device and error mapping).
    """

    def __init__(self, cuda: CudaCalls) -> None:
        self._cuda = cuda
        self._lock = threading.Lock()
        # Invariant: free blocks by slot count; never freed except by release_cached().
        self._free: dict[int, list[DescriptorBlock]] = {}

    def issue(self, capacity: int, tag: Tag | None, on_issue: Callable[[DescriptorBuffer], None]
              ) -> DescriptorBuffer:
        """A buffer of exactly ``capacity`` entries per array, from a pooled or new block.

        Args:
            capacity: entries per array, >= 0.
            tag: the transfer's tag, for error messages.
            on_issue: called with the buffer before it is handed out (the backend's ledger); if it raises, the
                block goes back to the pool and the error propagates.

        Returns:
            The buffer; its ``handle`` is the :class:`DescriptorBlock`.

        Raises:
            InvalidTransferError: a negative capacity.
            DeviceError: the pinned or device allocation failed (nothing is kept).
        """
        if capacity < 0:
            raise InvalidTransferError(f"alloc_descriptors: capacity must be >= 0, got {capacity!r} (e.g. 0)")
        slots = max(MIN_DESCRIPTOR_SLOTS, 1 << max(capacity - 1, 0).bit_length())
        block = self._take(slots, tag)
        words = block.words
        buf = DescriptorBuffer(words[0:capacity], words[slots:slots + capacity],
                               words[2 * slots:2 * slots + capacity], block)
        try:
            on_issue(buf)
        except BaseException:
            self._give_back(block)
            raise
        block.issued_to = buf
        return buf

    def block_of(self, buf: DescriptorBuffer) -> DescriptorBlock:
        """The block behind a buffer this pool issued.

        Raises:
            InvalidTransferError: not a buffer of this pool.
        """
        block = getattr(buf, "handle", None)
        if not isinstance(block, DescriptorBlock) or block.owner != id(self):
            raise InvalidTransferError(f"buf: {type(buf).__name__} {short_repr(buf)} was not allocated by this "
                                       "backend: expected one from its alloc_descriptors()")
        return block

    def retire(self, buf: DescriptorBuffer, on_retire: Callable[[DescriptorBuffer], None]) -> None:
        """Return a buffer's block to the pool (no CUDA call).

        Args:
            buf: a buffer this pool issued and that no copy reads any more.
            on_retire: called with the buffer first (the backend's ledger).

        Raises:
            InvalidTransferError: not a buffer of this pool.
            LifecycleError: returned twice, possibly after its block was issued again (a library bug).
        """
        block = self.block_of(buf)
        if block.issued_to is not buf:
            raise LifecycleError(f"{buf!r} was already freed")
        on_retire(buf)
        block.issued_to = None
        self._give_back(block)

    def _take(self, slots: int, tag: Tag | None) -> DescriptorBlock:
        with self._lock:
            free = self._free.get(slots)
            if free:
                return free.pop()
        nbytes = 3 * 8 * slots
        rt = self._cuda.rt
        host_ptr = dev_ptr = 0
        try:
            with self._cuda("alloc_descriptors", tag):
                host_ptr = int(rt.hostAlloc(nbytes, HOST_ALLOC_FLAGS))
                dev_ptr = int(rt.malloc(nbytes))
        except DeviceError:
            if host_ptr:
                with contextlib.suppress(DeviceError), self._cuda("freeHost"):
                    rt.freeHost(host_ptr)
            raise
        return DescriptorBlock(id(self), host_ptr, dev_ptr, slots, host_words(host_ptr, 3 * slots, np.int64))

    def _give_back(self, block: DescriptorBlock) -> None:
        with self._lock:
            self._free.setdefault(block.slots, []).append(block)

    def release_cached(self) -> int:
        """Free the pooled blocks (``cudaFree``/``cudaFreeHost``). BLOCKING: both synchronize the device.

        Returns:
            The number of blocks freed.

        Raises:
            DeviceError: a free failed (the remaining blocks stay pooled).
        """
        with self._lock:
            blocks = [b for pool in self._free.values() for b in pool]
            self._free.clear()
        rt = self._cuda.rt
        for i, block in enumerate(blocks):
            try:
                with self._cuda("release_cached_memory"):
                    rt.free(block.dev_ptr)
                    rt.freeHost(block.host_ptr)
            except DeviceError:
                for rest in blocks[i:]:
                    self._give_back(rest)
                raise
        return len(blocks)
