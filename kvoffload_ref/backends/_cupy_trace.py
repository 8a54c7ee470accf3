"""The CuPy backend's timeline: each ``copy_batch`` between two CUDA events of its own, written in the format the
simulated device writes (``trace_format``), so a sim prediction and a GPU measurement open side by side.

:meth:`TracingMixin.start_trace` records one *base* event on the legacy default stream; from then on every
``copy_batch`` records a start event before its submission and an end event after it, on the copy's stream.
:meth:`TracingMixin.trace_document` waits for those events (``cudaEventSynchronize``: blocking, never on a shutdown
path) and places each copy at ``cudaEventElapsedTime(base, start)`` .. ``(base, end)``, one track per stream.
Only copies are traced (the CUDA side has no record of the worker's records and waits); the events are destroyed
by :meth:`TracingMixin.stop_trace`. Off (the default), ``copy_batch`` pays one ``is None`` test.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from kvoffload_ref.backends._cupy_runtime import EVENT_DEFAULT, CudaCalls
from kvoffload_ref.backends.base import Tag
from kvoffload_ref.backends.trace_format import TraceBuilder, copy_args, copy_name, write_document

__all__ = ["CupyTracer", "TracingMixin"]


@dataclasses.dataclass(frozen=True)
class _Copy:
    stream: int
    tag: Tag | None
    nbytes: int
    count: int
    path: str
    start: int  # the start event's handle
    end: int    # the end event's handle


class CupyTracer:
    """Events around copies, relative to one base event (see the module docstring).

    Args:
        cuda: the backend's :class:`CudaCalls` (device and error mapping).
        source: the ``otherData.source`` text.

    Raises:
        DeviceError: the base event could not be created or recorded.
    """

    def __init__(self, cuda: CudaCalls, source: str) -> None:
        # Invariant: the backend's calls, its runtime and the trace's source text; set once.
        self._cuda, self._rt, self.source = cuda, cuda.rt, source
        # Invariant: guards _copies (copy_batch may run on several threads).
        self._lock = threading.Lock()
        # Invariant: the copies traced so far, in submission order; their events live until close().
        self._copies: list[_Copy] = []
        # Invariant: the base event every span is placed relative to; recorded once, live until close().
        with cuda("trace: base event"):
            self._base = int(self._rt.eventCreateWithFlags(EVENT_DEFAULT))
            self._rt.eventRecord(self._base, 0)

    def begin(self, stream: int) -> int:
        """Record a start event on ``stream`` (before a submission); returns it."""
        with self._cuda("trace: start event"):
            event = int(self._rt.eventCreateWithFlags(EVENT_DEFAULT))
            self._rt.eventRecord(event, stream)
        return event

    def abandon(self, start: int) -> None:
        """Destroy the start event of a copy whose submission failed (it gets no span)."""
        with self._cuda("trace: start event"):
            self._rt.eventDestroy(start)

    def end(self, start: int, stream: int, tag: Tag | None, nbytes: int, count: int, path: str) -> None:
        """Record the end event of the copy ``begin`` started (after its submission)."""
        with self._cuda("trace: end event", tag):
            event = int(self._rt.eventCreateWithFlags(EVENT_DEFAULT))
            self._rt.eventRecord(event, stream)
        with self._lock:
            self._copies.append(_Copy(stream, tag, nbytes, count, path, start, event))

    def document(self) -> dict[str, Any]:
        """The trace document (blocks until every traced copy completed)."""
        with self._lock:
            copies = list(self._copies)
        b = TraceBuilder(self.source)
        with self._cuda("trace: read events"):
            for c in copies:
                self._rt.eventSynchronize(c.end)
                t0 = float(self._rt.eventElapsedTime(self._base, c.start)) / 1e3
                t1 = float(self._rt.eventElapsedTime(self._base, c.end)) / 1e3
                b.span(b.track(f"stream {c.stream:#x}"), copy_name(c.tag), t0, t1, "copy",
                       copy_args(c.nbytes, c.count, c.path, t1 - t0))
        return b.document(clock="cuda events", copies=len(copies))

    def close(self) -> None:
        """Destroy every event (failures ignored: the events are only timing)."""
        with self._lock:
            handles = [self._base, *(e for c in self._copies for e in (c.start, c.end))]
            self._copies = []
        for handle in handles:
            try:
                with self._cuda("trace: destroy event"):
                    self._rt.eventDestroy(handle)
            except Exception:
                pass


class TracingMixin:
    """``start_trace``/``trace_document``/``write_trace``/``stop_trace`` of the CuPy backend."""

    _cuda: CudaCalls
    device_name: str
    # Invariant: None while not tracing; else the tracer every copy_batch reports to.
    _tracer: CupyTracer | None = None

    def start_trace(self) -> None:
        """Start recording every ``copy_batch`` between two CUDA events (a no-op when already tracing).

        Raises:
            DeviceError: the base event could not be created or recorded.
        """
        if self._tracer is None:
            self._tracer = CupyTracer(self._cuda, f"cupy {self.device_name}")

    def trace_document(self) -> dict[str, Any]:
        """The copies traced so far as Chrome trace-event JSON (blocks until they completed).

        Raises:
            RuntimeError: :meth:`start_trace` was not called.
            DeviceError: reading the events failed.
        """
        if self._tracer is None:
            raise RuntimeError("trace_document: call start_trace() first")
        return self._tracer.document()

    def write_trace(self, path: str) -> None:
        """Write :meth:`trace_document` to ``path``.

        Raises:
            RuntimeError: not tracing. DeviceError: reading the events failed. OSError: the file.
        """
        write_document(path, self.trace_document())

    def stop_trace(self) -> None:
        """Stop tracing and destroy the trace's events."""
        tracer, self._tracer = self._tracer, None
        if tracer is not None:
            tracer.close()
