"""The CuPy backend's streams and events: raw runtime handles (``CupyStream``, ``CupyEvent``), their creation,
records, strict queries and destruction, and the compute stream of any framework as an unowned handle.

:class:`StreamsMixin` holds the calls; :class:`~kvoffload_ref.backends.cupy.CupyBackend` owns the state they use
(the ledger, the lock, the table of compute-stream handles). A failed destroy is logged, never raised.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvoffload_ref.backends import _cupy_runtime as _cuda_rt
from kvoffload_ref.backends._cupy_interop import parse_stream_object
from kvoffload_ref.backends._cupy_runtime import CudaCalls, CupyEvent, CupyStream, tag_text
from kvoffload_ref.backends.base import Event, Ledger, Stream, Tag
from kvoffload_ref.errors import (
    CUDA_ERROR_INVALID_RESOURCE_HANDLE,
    CUDA_ERROR_NOT_READY,
    CUDA_SUCCESS,
    DeviceError,
    InvalidTransferError,
)
from kvoffload_ref.validate import short_repr

__all__ = ["StreamsMixin"]

_log = logging.getLogger("kvoffload_ref.backends.cupy")


class StreamsMixin:
    """The stream and event calls of the CuPy backend (``current_stream`` .. ``elapsed``)."""

    _cp: Any
    _rt: Any
    _cuda: CudaCalls
    _device: int
    _ledger: Ledger
    _lock: threading.Lock
    # Invariant: at most one (unowned) handle per compute-stream pointer; see current_stream().
    _compute_handles: dict[int, CupyStream]

    def _current_ptr(self, what: str) -> int:
        """The calling thread's current CuPy stream's pointer, read on this device."""
        with self._cuda(what):
            return int(self._cp.cuda.get_current_stream().ptr)

    def current_stream(self) -> Stream:
        """The calling thread's current CuPy stream on this device (not owned)."""
        return self._unowned(self._current_ptr("current_stream"))

    def _unowned(self, ptr: int) -> CupyStream:
        # One handle per stream pointer, so callers (e.g. FaultyBackend) can tell it apart by identity.
        with self._lock:
            return self._compute_handles.setdefault(ptr, CupyStream(ptr, owned=False))

    def compute_stream(self, stream: object | None = None) -> Stream:
        """The handle of the stream the model computes on, usable by ``record``/``wait_event`` from any thread.

        Args:
            stream: None for the calling thread's current CuPy stream (:meth:`current_stream`); or a raw
                ``cudaStream_t`` int; or an object with ``__cuda_stream__`` (the CUDA stream protocol, giving
                ``(0, handle)``), ``.cuda_stream`` (torch) or ``.ptr`` (CuPy). Not owned: never destroyed here.

        Returns:
            An unowned stream handle (the same handle for the same stream).

        Raises:
            InvalidTransferError: an object of none of these kinds, a negative handle, the per-thread default
                stream (handle 2, a different stream in every thread), or a stream of another device.
            DeviceError: reading CuPy's current stream failed.
        """
        device: int | None = None
        if stream is None:
            ptr = self._current_ptr("compute_stream")
        else:
            ptr, device = parse_stream_object(stream)
        if device is not None and device != self._device:
            raise InvalidTransferError(f"compute_stream: stream is on cuda:{device}: expected a stream on the "
                                       f"backend's device, cuda:{self._device}")
        if ptr == 2:
            raise InvalidTransferError("compute_stream: stream=None found the per-thread default stream (handle 2), "
                                       "a different stream in every thread: expected the model's stream, passed "
                                       "explicitly (e.g. compute_stream(torch.cuda.current_stream()))")
        return self._unowned(ptr)

    def create_stream(self, *, tag: Tag | None = None) -> Stream:
        """A new non-blocking stream (``cudaStreamCreateWithFlags(cudaStreamNonBlocking)``; ledger "stream", key
        ``id(handle)``).

        Raises:
            DeviceError: the creation failed (nothing recorded).
        """
        with self._cuda("create_stream", tag):
            ptr = int(self._rt.streamCreateWithFlags(_cuda_rt.STREAM_NON_BLOCKING))
        handle = CupyStream(ptr, owned=True)
        self._ledger.acquire("stream", id(handle))
        return handle

    def destroy_stream(self, stream: Stream) -> None:
        """Destroy a stream this backend created (queued work still runs; returns at once). A failure is logged,
        never raised. The compute stream (not owned) is left alone.

        Raises:
            InvalidTransferError: not a stream handle of this backend.
            LifecycleError: destroyed twice (a library bug).
        """
        handle = self._stream(stream, allow_destroyed=True)
        if not handle.owned:
            return
        if not handle.destroyed:
            handle.destroyed = True
            try:
                with self._cuda("destroy_stream"):
                    self._rt.streamDestroy(handle.ptr)
            except DeviceError as exc:
                _log.warning("%s; the stream is forgotten", exc)
        self._ledger.release("stream", id(handle))

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Later work on ``stream`` waits (on the device) for the event's latest record.

        Raises:
            DeviceError: the call failed, or a handle was already destroyed (status 400).
        """
        s, e = self._stream(stream), self._event(event)
        with self._cuda("wait_event", e.tag):
            self._rt.streamWaitEvent(s.ptr, e.ptr, 0)

    def create_event(self, *, tag: Tag | None = None) -> Event:
        """A new timing event (``cudaEventCreateWithFlags(0)``; ledger "event", key ``id(handle)``).

        Raises:
            DeviceError: the creation failed (nothing recorded).
        """
        with self._cuda("create_event", tag):
            ptr = int(self._rt.eventCreateWithFlags(_cuda_rt.EVENT_DEFAULT))
        handle = CupyEvent(ptr)
        self._ledger.acquire("event", id(handle))
        return handle

    def destroy_event(self, event: Event) -> None:
        """Destroy an event (returns at once even if its record is pending). A failure is logged, never raised.

        Raises:
            InvalidTransferError: not an event handle of this backend.
            LifecycleError: destroyed twice (a library bug).
        """
        handle = self._event(event, allow_destroyed=True)
        if not handle.destroyed:
            handle.destroyed = True
            try:
                with self._cuda("destroy_event"):
                    self._rt.eventDestroy(handle.ptr)
            except DeviceError as exc:
                _log.warning("%s; the event is forgotten", exc)
        self._ledger.release("event", id(handle))

    def record(self, event: Event, stream: Stream, *, tag: Tag | None = None) -> None:
        """Record the event on the stream (``cudaEventRecord``); remembers ``tag`` for the event's errors.

        Raises:
            DeviceError: the call failed, or a handle was already destroyed (status 400).
        """
        e, s = self._event(event), self._stream(stream)
        with self._cuda("record", tag):
            self._rt.eventRecord(e.ptr, s.ptr)
        e.tag = tag

    def query(self, event: Event) -> bool:
        """Strict, non-blocking poll: ``cudaEventQuery`` 0 -> True, 600 (not ready) -> False, anything else is an
        error (CuPy's ``Event.done`` would hide it as "pending").

        Raises:
            DeviceError: any other status (the CUDARuntimeError for it as ``__cause__``), or a destroyed handle.
        """
        e = self._event(event)
        with self._cuda("event query", e.tag):
            status = int(self._rt.eventQuery(e.ptr))
        if status == CUDA_SUCCESS:
            return True
        if status == CUDA_ERROR_NOT_READY:
            return False
        cause = self._rt.CUDARuntimeError(status)
        raise DeviceError(f"event query failed on cuda:{self._device}{tag_text(e.tag)}: {cause}", status) from cause

    def synchronize(self, event: Event) -> None:
        """Block (GIL released) until the event completes. Unbounded: never used on the shutdown path.

        Raises:
            DeviceError: the device reported an error.
        """
        e = self._event(event)
        with self._cuda("event synchronize", e.tag):
            self._rt.eventSynchronize(e.ptr)

    def elapsed(self, start: Event, end: Event) -> float:
        """Seconds between two completed timing events (``cudaEventElapsedTime`` gives milliseconds).

        Raises:
            DeviceError: e.g. status 600 if an event has not completed.
        """
        a, b = self._event(start), self._event(end)
        with self._cuda("elapsed", b.tag):
            return float(self._rt.eventElapsedTime(a.ptr, b.ptr)) / 1000.0

    def _stream(self, stream: Stream, *, allow_destroyed: bool = False) -> CupyStream:
        if not isinstance(stream, CupyStream):
            raise InvalidTransferError(f"stream: {type(stream).__name__} {short_repr(stream)} is not a stream of the "
                                       "CuPy backend: expected one from its create_stream() or compute_stream()")
        if stream.destroyed and not allow_destroyed:
            raise DeviceError(f"stream {stream.ptr:#x} was destroyed", CUDA_ERROR_INVALID_RESOURCE_HANDLE)
        return stream

    def _event(self, event: Event, *, allow_destroyed: bool = False) -> CupyEvent:
        if not isinstance(event, CupyEvent):
            raise InvalidTransferError(f"event: {type(event).__name__} {short_repr(event)} is not an event of the "
                                       "CuPy backend: expected one from its create_event()")
        if event.destroyed and not allow_destroyed:
            raise DeviceError(f"event {event.ptr:#x} was destroyed", CUDA_ERROR_INVALID_RESOURCE_HANDLE)
        return event
