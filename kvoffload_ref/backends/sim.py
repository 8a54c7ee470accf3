"""The simulated device: a deterministic, single-threaded GPU model over real numpy memory.

Theory of operation
-------------------
*Clock.* A virtual clock starts at 0.0. Only :meth:`SimBackend.sleep` / :meth:`SimBackend.clock_advance` move it
forward freely; :meth:`SimBackend.synchronize` (and ``to_host``) move it to the moment what they wait for
completes, or by ``hang_horizon`` when it never can (then :class:`SimHang`). Nothing else advances it, so every
deadline a test sets is exact and repeatable.

*Streams.* Each stream is a FIFO of ops (record, wait, copy, compute write, hang). The head op of a stream starts
when the op before it finished (never before it was submitted) and, for a wait, once the awaited event record has
completed. A started op sits in one global heap keyed by its finish time; its *effect* (bytes moved, event
completed) is applied when the heap pops it. Ops finishing at the same virtual time pop latest-submitted first,
so code that forgot a wait sees stale data instead of the convenient order. Work runs lazily: whenever a call
observes the device (query, sleep, synchronize, a release that must know what is still pending), the heap is
drained up to the current time. A hang op never finishes, so everything behind it on its stream, and every
stream waiting on an event recorded behind it, never runs either. Draining costs O(log n) per op (a heap, never
a scan of the streams): 10,000 chained transfers drain in about a quarter of a second of real time.

*Memory.* Device arrays are C-contiguous 2-D uint8 numpy arrays; host mappings announced with ``track_host``
are viewed through numpy arrays built from their raw address. Each is a *span* in an address map (``_simmem.py``,
which also holds the copy engine). A copy is a batch of (src, dst, size) descriptors read from its descriptor
buffer when the copy starts; every byte range must lie inside one live span, checked vectorized with
``np.searchsorted``. The bytes move when the copy finishes, all sources read before any destination is written,
grouped by (source span, destination span, size) with one integer key per descriptor (no sort when, as planner
output does, each group is one contiguous segment): contiguous runs of rows move in one numpy pass each (a
slice assignment, ``np.take`` into a run, or a fancy assignment from one); otherwise large rows move one slice
assignment each and small rows by chunked fancy indexing over ``sliding_window_view`` windows; batches of a few
descriptors go one by one. The sim never touches an address outside a live span (that would crash the
interpreter): a copy whose range was unmapped or unpinned while it was pending is *poisoned* and is stopped at
execution.

*Violations.* Misuse that real hardware punishes late or silently is recorded in :attr:`SimBackend.violations`:
unmapping or unpinning memory a pending copy touches, freeing a descriptor buffer a pending copy reads, a copy
touching no live span (sticky illegal-address error, status 700, as CUDA), a double unregister, and releasing a
handle that is not live. "Pending" includes a copy stuck behind a hang forever.

*Faults.* A :class:`~kvoffload_ref.faults.FaultPlan` is consulted at every fault point; see ``faults.py``. A hang
is selected at a transfer's first tagged ``record`` on a stream other than the compute stream, and is a hang op
queued right after that record. Once the device is lost (a sticky fault, or the sim's own illegal-address
error) nothing queued runs any more and every call but the clock, the release calls (``destroy_*``,
``free_descriptors``, ``untrack_host``), ``track_host``, ``array_info`` and ``current_stream`` raises.

*Accounting.* Streams, events, descriptor buffers, pinned ranges and host mappings pass through the
:class:`~kvoffload_ref.backends.base.Ledger`, only once the call that acquires them has succeeded.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._simmem import CopyPlan, Memory, Span, address, host_view
from kvoffload_ref.backends.base import (
    Backend,
    DescriptorBuffer,
    Event,
    Ledger,
    Stream,
    Tag,
    TensorGeometry,
    poll_until,
    record_and_poll,
)
from kvoffload_ref.errors import (
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_INVALID_RESOURCE_HANDLE,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_READY,
    DeviceError,
    InvalidTransferError,
)

if TYPE_CHECKING:
    from kvoffload_ref.faults import FaultPlan, FaultPoint

__all__ = ["SimBackend", "SimHang", "Violation", "ViolationKind"]

I64 = npt.NDArray[np.int64]
Bytes = npt.NDArray[np.uint8]

ViolationKind = Literal[
    "unmap_under_dma", "unregister_under_dma", "descriptor_freed_under_dma", "illegal_address",
    "double_unregister", "invalid_release",
]


class SimHang(BaseException):
    """A blocking wait on the simulated device could not finish within the virtual hang horizon.

    Derives from BaseException on purpose: no ``except Exception`` can swallow an unbounded wait (R11).
    """


@dataclasses.dataclass(frozen=True)
class Violation:
    """One misuse the simulated device detected.

    Attributes:
        time: virtual time of detection.
        kind: what happened (see :data:`ViolationKind`).
        detail: a human-readable description naming the addresses involved.
        tag: the tag of the copy involved, if any.
    """

    time: float
    kind: ViolationKind
    detail: str
    tag: Tag | None = None


# -- streams, events and ops -----------------------------------------------------------------------------------


class _Record:
    """One generation of an event: completes when its record op runs."""

    __slots__ = ("done_at", "waiters")

    def __init__(self) -> None:
        # Invariant: None until the record op ran; then the virtual time it completed. Never reset.
        self.done_at: float | None = None
        # Invariant: the streams whose head op is a wait on this record (None: none, the common case, so that
        # most records allocate no list); None again once the record completed.
        self.waiters: list[SimStream] | None = None


class SimStream:
    """A stream handle of one SimBackend."""

    __slots__ = ("destroyed", "label", "owner", "queue")

    def __init__(self, owner: SimBackend, label: str) -> None:
        self.owner = owner
        self.label = label
        # Invariant: ops not yet finished, in submission order; queue[0] is running or blocked (wait/hang).
        self.queue: collections.deque[_Op] = collections.deque()
        # Invariant: True once destroyed; queued work still runs (as CUDA) but no new work is accepted.
        self.destroyed = False

    def __repr__(self) -> str:
        return f"<SimStream {self.label}{' destroyed' if self.destroyed else ''}>"


class SimEvent:
    """An event handle of one SimBackend."""

    __slots__ = ("destroyed", "label", "latest", "owner", "tag")

    def __init__(self, owner: SimBackend, label: str) -> None:
        self.owner = owner
        self.label = label
        # Invariant: the current generation; None while never recorded (such an event counts as complete).
        self.latest: _Record | None = None
        # Invariant: the tag of the latest record (fault selectors match it).
        self.tag: Tag | None = None
        self.destroyed = False

    def __repr__(self) -> str:
        return f"<SimEvent {self.label} tag={self.tag}>"


class _Op:
    """One unit of stream work; subclasses say what it does."""

    __slots__ = ("seq", "stream", "submitted_at")

    def __init__(self, stream: SimStream) -> None:
        self.stream = stream
        # Invariant: seq and submitted_at are set once, by _Scheduler.submit; seq is unique and increases in
        # submission order.
        self.seq = -1
        self.submitted_at = 0.0


class _RecordOp(_Op):
    __slots__ = ("record",)

    def __init__(self, stream: SimStream, record: _Record) -> None:
        super().__init__(stream)
        self.record = record


class _WaitOp(_Op):
    __slots__ = ("record",)

    def __init__(self, stream: SimStream, record: _Record) -> None:
        super().__init__(stream)
        self.record = record


class _HangOp(_Op):
    """Never finishes: blocks its stream forever."""

    __slots__ = ()


class _ComputeOp(_Op):
    __slots__ = ("delay", "rows", "target", "value")

    def __init__(self, stream: SimStream, target: Bytes, rows: I64, value: int, delay: float) -> None:
        super().__init__(stream)
        self.target, self.rows, self.value, self.delay = target, rows, value, delay


class _CopyOp(_Op):
    __slots__ = ("buf", "count", "plan", "poison", "tag")

    def __init__(self, stream: SimStream, buf: DescriptorBuffer, count: int, tag: Tag | None) -> None:
        super().__init__(stream)
        self.buf, self.count, self.tag = buf, count, tag
        # Invariant: None until the op starts; then the descriptors as read at start, resolved to spans.
        self.plan: CopyPlan | None = None
        # Invariant: why the op must not touch memory (a range it uses was unmapped/unpinned), or None.
        self.poison: str | None = None

    def descriptors(self) -> tuple[I64, I64, I64]:
        """The (src, dst, sizes) this copy uses: the snapshot once started, else the buffer's current rows."""
        if self.plan is not None:
            return self.plan.src, self.plan.dst, self.plan.sizes
        n = self.count
        return self.buf.src[:n], self.buf.dst[:n], self.buf.sizes[:n]

    def touches(self, lo: int, hi: int) -> bool:
        """Whether any descriptor's source or destination intersects [lo, hi)."""
        src, dst, sizes = self.descriptors()
        live = sizes > 0
        return bool(np.any(live & (src < hi) & (src + sizes > lo)) or
                    np.any(live & (dst < hi) & (dst + sizes > lo)))


# -- the scheduler ---------------------------------------------------------------------------------------------


class _Scheduler:
    """Virtual clock, per-stream FIFOs and the heap of started ops (see the module docstring)."""

    def __init__(self, duration: Callable[[_Op], float], apply: Callable[[_Op, float], None],
                 halted: Callable[[], bool]) -> None:
        self._duration = duration
        self._apply = apply
        self._halted = halted
        # Invariant: never decreases.
        self.now = 0.0
        # Invariant: one entry per started op that will finish: (finish time, -seq, op); -seq makes ties pop
        # latest-submitted first, and seq is unique so ops themselves are never compared.
        self._heap: list[tuple[float, int, _Op]] = []
        self._seq = itertools.count()

    def submit(self, op: _Op) -> None:
        """Append an op to its stream; start it now if the stream is idle."""
        op.seq = next(self._seq)
        op.submitted_at = self.now
        queue = op.stream.queue
        queue.append(op)
        if len(queue) == 1:
            self._start_head(op.stream, self.now)

    def run(self, limit: float, until: Callable[[], bool] | None = None) -> bool:
        """Apply, in order, the ops finishing at or before ``limit`` (none once the device is halted).

        Returns:
            True as soon as ``until()`` holds after an op (the clock then stands at that op's finish time).
        """
        while self._heap and self._heap[0][0] <= limit and not self._halted():
            t, _, op = heapq.heappop(self._heap)
            self.now = max(self.now, t)
            self._finish(op, t)
            if until is not None and until():
                return True
        return False

    def catch_up(self) -> None:
        """:meth:`run` up to the current time (cheap when nothing is due)."""
        heap = self._heap
        if heap and heap[0][0] <= self.now:
            self.run(self.now)

    def _start_head(self, stream: SimStream, t: float) -> None:
        op = stream.queue[0]
        if isinstance(op, _HangOp):
            return
        if isinstance(op, _WaitOp) and op.record.done_at is None:
            if op.record.waiters is None:
                op.record.waiters = [stream]
            else:
                op.record.waiters.append(stream)
            return
        start = max(t, op.submitted_at)
        heapq.heappush(self._heap, (start + self._duration(op), -op.seq, op))

    def _finish(self, op: _Op, t: float) -> None:
        stream = op.stream
        stream.queue.popleft()
        if isinstance(op, _RecordOp):
            op.record.done_at = t
            waiters, op.record.waiters = op.record.waiters, None
            for waiter in waiters or ():
                self._start_head(waiter, t)
        elif not isinstance(op, _WaitOp):
            self._apply(op, t)
        if stream.queue:
            self._start_head(stream, t)


# -- the backend -----------------------------------------------------------------------------------------------


class SimBackend:
    """The deterministic simulated device (see the module docstring). Implements :class:`Backend`.

    Args:
        faults: the faults to inject, or None.
        latency: virtual seconds every copy op costs on top of its bytes.
        pinned_bandwidth: bytes per virtual second for device memory and pinned host memory.
        pageable_bandwidth: bytes per virtual second when a host side is not inside one pinned range.
        hang_horizon: virtual seconds a blocking wait (``synchronize``, ``to_host``) waits before it gives up
            with :class:`SimHang`.

    Raises:
        ValueError: a negative latency, or a non-positive bandwidth or horizon.
    """

    name: str = "sim"

    def __init__(self, faults: FaultPlan | None = None, *, latency: float = 5e-6,
                 pinned_bandwidth: float = 25e9, pageable_bandwidth: float = 8e9,
                 hang_horizon: float = 3600.0) -> None:
        if latency < 0 or min(pinned_bandwidth, pageable_bandwidth, hang_horizon) <= 0:
            raise ValueError("latency must be >= 0; bandwidths and hang_horizon must be > 0")
        self._plan = faults
        self._latency, self._hang_horizon = latency, hang_horizon
        self._pinned_bw, self._pageable_bw = pinned_bandwidth, pageable_bandwidth
        # Invariant: held by every public method; reentrant because prove_idle calls public methods.
        self._lock = threading.RLock()
        self._ledger = Ledger()
        self._memory = Memory()
        self._sched = _Scheduler(self._op_duration, self._apply_op, self._halted)
        self._labels = itertools.count(1)
        # Invariant: the compute stream; never destroyed and never in the ledger.
        self._compute = SimStream(self, "compute")
        # Invariant: id -> handle for every live (created, not destroyed/freed) stream, event, descriptor buffer.
        self._streams: dict[int, SimStream] = {}
        self._events: dict[int, SimEvent] = {}
        self._buffers: dict[int, DescriptorBuffer] = {}
        # Invariant: id(buffer) -> number of pending copies reading it (no entry when zero).
        self._buffer_users: collections.Counter[int] = collections.Counter()
        # Invariant: the copies submitted and not yet executed, including those stuck behind a hang.
        self._pending: dict[_CopyOp, None] = {}
        # Invariant: every device array ever allocated; device memory is never freed, so no copy can touch
        # memory that was given back.
        self._device_arrays: list[Bytes] = []
        self._violations: list[Violation] = []
        # Invariant: pointers unregistered and not registered again since (to tell a double unregister).
        self._unpinned: set[int] = set()
        # Invariant: the tags already offered to FaultPlan.select_hang (each transfer is selected at most once).
        self._seen_tags: set[Tag] = set()
        # Invariant: None while healthy; once a copy hit an illegal address, why (sticky: never reset).
        self._sticky: str | None = None

    def __repr__(self) -> str:
        return f"<SimBackend t={self._sched.now:.6g}s violations={len(self._violations)}>"

    # -- inspection ---------------------------------------------------------------------------------------------

    @property
    def ledger(self) -> Ledger:
        """The resources the library acquired through this backend (R16)."""
        return self._ledger

    @property
    def hang_horizon(self) -> float:
        """Virtual seconds after which a wait without a bound on hung work gives up with SimHang."""
        return self._hang_horizon

    @property
    def violations(self) -> list[Violation]:
        """A copy of the violations detected so far, in detection order."""
        with self._lock:
            return list(self._violations)

    @property
    def faults(self) -> FaultPlan | None:
        """The fault plan this device applies, if any."""
        return self._plan

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
        with self._lock:
            self._check_alive()
            rows, row_bytes = _checked_shape(shape)
            array = np.zeros((rows, row_bytes), dtype=np.uint8)
            self._memory.add(Span(address(array), address(array) + array.nbytes, False, array.reshape(-1)))
            self._device_arrays.append(array)
            return array

    def from_host(self, array: npt.NDArray[np.uint8]) -> object:
        """A new device array holding a copy of a 2-D uint8 host array.

        Raises:
            InvalidTransferError: not a non-empty 2-D uint8 numpy array.
            DeviceError: the device is lost.
        """
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 2:
            raise InvalidTransferError(f"from_host needs a 2-D uint8 numpy array, got {_describe(array)}")
        with self._lock:
            device = self.empty_device((int(array.shape[0]), int(array.shape[1])))
            np.copyto(self._device_view(device), array)
            return device

    def to_host(self, array: object) -> npt.NDArray[np.uint8]:
        """A host copy of a device array, taken once the compute stream's queued work has run.

        The clock advances to when that work completes.

        Raises:
            InvalidTransferError: not a device array of this backend.
            DeviceError: the device is lost (or fails while the compute stream drains).
            SimHang: the compute stream's work cannot complete within the hang horizon.
        """
        with self._lock:
            self._check_alive()
            view = self._device_view(array)
            marker = _Record()
            self._sched.submit(_RecordOp(self._compute, marker))
            self._wait_for(marker, "to_host: the compute stream's queued work")
            return np.array(view, copy=True)

    def array_info(self, array: object) -> TensorGeometry:
        """Geometry of a device array of this backend, or of a 2-D row-contiguous view of one.

        Raises:
            InvalidTransferError: anything else (another backend's array, wrong dtype, not 2-D, empty,
                rows not contiguous).
        """
        with self._lock:
            return self._geometry(array)[0]

    # -- host memory -------------------------------------------------------------------------------------------

    def track_host(self, ptr: int, nbytes: int) -> None:
        """Announce a host mapping [ptr, ptr+nbytes) (ledger kind "mapping", key ptr); copies may then use it.

        The caller vouches that the memory stays mapped until :meth:`untrack_host`. No device failure applies.

        Raises:
            InvalidTransferError: a non-positive size or address, or a range overlapping live memory.
        """
        if ptr <= 0 or nbytes <= 0:
            raise InvalidTransferError(f"track_host({ptr:#x}, {nbytes}): address and size must be positive")
        with self._lock:
            self._memory.add(Span(ptr, ptr + nbytes, True, host_view(ptr, nbytes)))
            self._ledger.acquire("mapping", ptr)

    def untrack_host(self, ptr: int) -> None:
        """Forget the host mapping starting at ptr. Never fails.

        Pending copies touching it are recorded (``unmap_under_dma``) and poisoned: they will not touch it and
        will raise the sticky illegal-address error when they execute. An unknown ptr is recorded
        (``invalid_release``). Ranges still pinned inside it stay registered (as after a failed unregister).
        """
        with self._lock:
            self._catch_up()
            span = self._memory.host_span_at(ptr)
            if span is None:
                self._violate("invalid_release", f"untrack_host({ptr:#x}): no tracked mapping starts there")
                return
            where = f"mapping [{span.start:#x}, {span.end:#x})"
            self._poison_pending(span.start, span.end, "unmap_under_dma", f"{where} was untracked")
            self._memory.remove(ptr)
            self._ledger.release("mapping", ptr)

    def host_register(self, ptr: int, nbytes: int) -> None:
        """Pin [ptr, ptr+nbytes) of a tracked mapping (ledger kind "pinned", key ptr). Fault point.

        Raises:
            DeviceError: an injected fault or a lost device; status 1 if the range is not inside one tracked
                mapping; 712 if it overlaps a pinned range.
        """
        with self._lock:
            self._fault("host_register", None)
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
        with self._lock:
            self._fault("host_unregister", None)
            if ptr not in self._memory.pinned:
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

    # -- descriptor buffers ------------------------------------------------------------------------------------

    def alloc_descriptors(self, capacity: int, *, tag: Tag | None = None) -> DescriptorBuffer:
        """A zeroed descriptor buffer for ``capacity`` copies (ledger kind "descriptor", key id(buffer)).

        Raises:
            InvalidTransferError: a negative capacity.
            DeviceError: an injected ``descriptor_alloc`` fault or a lost device.
        """
        with self._lock:
            self._fault("descriptor_alloc", tag)
            if capacity < 0:
                raise InvalidTransferError(f"descriptor capacity must be >= 0, got {capacity}")
            src, dst, sizes = (np.zeros(capacity, dtype=np.int64) for _ in range(3))
            buf = DescriptorBuffer(src, dst, sizes, handle=f"sim-descriptors-{next(self._labels)}")
            self._buffers[id(buf)] = buf
            self._ledger.acquire("descriptor", id(buf))
            return buf

    def free_descriptors(self, buf: DescriptorBuffer) -> None:
        """Free a descriptor buffer. Never fails.

        Freeing one that a pending copy still reads is recorded (``descriptor_freed_under_dma``); the copy
        still runs with the descriptors it reads. An unknown or already freed buffer is recorded
        (``invalid_release``).
        """
        key = id(buf)
        with self._lock:
            self._catch_up()
            if self._buffers.get(key) is not buf:
                self._violate("invalid_release", f"free_descriptors({buf!r}): not a live buffer of this device")
                return
            users = self._buffer_users.get(key)
            if users:
                self._violate("descriptor_freed_under_dma", f"{buf!r} freed while {users} pending copies read it")
            del self._buffers[key]
            self._ledger.release("descriptor", key)

    # -- streams and events ------------------------------------------------------------------------------------

    def current_stream(self) -> Stream:
        """The compute stream (not in the ledger)."""
        return self._compute

    def create_stream(self, *, tag: Tag | None = None) -> Stream:
        """A new stream (ledger kind "stream", key id(stream)).

        Raises:
            DeviceError: an injected ``stream_create`` fault or a lost device.
        """
        with self._lock:
            self._fault("stream_create", tag)
            stream = SimStream(self, f"s{next(self._labels)}")
            self._streams[id(stream)] = stream
            self._ledger.acquire("stream", id(stream))
            return stream

    def destroy_stream(self, stream: Stream) -> None:
        """Destroy a stream; work already queued on it still runs. Never fails (misuse: ``invalid_release``)."""
        key = id(stream)
        with self._lock:
            if self._streams.pop(key, None) is not stream or not isinstance(stream, SimStream):
                self._violate("invalid_release", f"destroy_stream({stream!r}): not a live stream of this device")
                return
            stream.destroyed = True
            self._ledger.release("stream", key)

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Make later work on ``stream`` wait for the event's current record (a never-recorded event: no-op).

        Raises:
            DeviceError: a lost device, or a handle that is not live on this device (400).
        """
        with self._lock:
            self._check_alive()
            target, awaited = self._own_stream(stream), self._own_event(event)
            if awaited.latest is not None:
                self._sched.submit(_WaitOp(target, awaited.latest))

    def create_event(self, *, tag: Tag | None = None) -> Event:
        """A new event (ledger kind "event", key id(event)); it counts as complete until recorded.

        Raises:
            DeviceError: an injected ``event_create`` fault or a lost device.
        """
        with self._lock:
            self._fault("event_create", tag)
            event = SimEvent(self, f"e{next(self._labels)}")
            self._events[id(event)] = event
            self._ledger.acquire("event", id(event))
            return event

    def destroy_event(self, event: Event) -> None:
        """Destroy an event. Never fails (misuse: ``invalid_release``)."""
        key = id(event)
        with self._lock:
            if self._events.pop(key, None) is not event or not isinstance(event, SimEvent):
                self._violate("invalid_release", f"destroy_event({event!r}): not a live event of this device")
                return
            event.destroyed = True
            self._ledger.release("event", key)

    def record(self, event: Event, stream: Stream, *, tag: Tag | None = None) -> None:
        """Start a new generation of the event, completing once the work queued on the stream before it ran.

        The first tagged record of a tag on a stream other than the compute stream submits the transfer to
        ``FaultPlan.select_hang``; if a hang is selected, the stream blocks forever right after this record.

        Raises:
            DeviceError: a lost device, or a handle that is not live on this device (400).
        """
        with self._lock:
            self._check_alive()
            target, recorded = self._own_stream(stream), self._own_event(event)
            recorded.latest, recorded.tag = _Record(), tag
            self._sched.submit(_RecordOp(target, recorded.latest))
            if self._selects_hang(target, tag):
                self._sched.submit(_HangOp(target))

    def query(self, event: Event) -> bool:
        """Whether the event's latest record completed (True if never recorded). Runs work due by now.

        Raises:
            DeviceError: an injected ``event_query`` fault (matched on the event's tag), a lost device, the
                sticky illegal-address error (700), or a handle that is not live (400).
        """
        with self._lock:
            recorded = self._own_event(event)
            if self._plan is not None or self._sticky is not None:  # else _fault and _check_alive do nothing
                self._fault("event_query", recorded.tag)
            self._catch_up()
            if self._plan is not None or self._sticky is not None:
                self._check_alive()
            latest = recorded.latest
            return latest is None or latest.done_at is not None

    def synchronize(self, event: Event) -> None:
        """Advance the clock until the event's latest record completes.

        Raises:
            DeviceError: an injected ``event_sync`` fault, a lost device, the sticky illegal-address error, or
                a handle that is not live.
            SimHang: the record cannot complete within the hang horizon (the clock then advanced by it).
        """
        with self._lock:
            recorded = self._own_event(event)
            self._fault("event_sync", recorded.tag)
            if recorded.latest is not None:
                self._wait_for(recorded.latest, f"synchronize({recorded!r})")

    def elapsed(self, start: Event, end: Event) -> float:
        """Virtual seconds between the completions of two events' latest records.

        Raises:
            DeviceError: 600 if either has not completed (or was never recorded); a lost device; 400 for a
                handle that is not live.
        """
        with self._lock:
            self._check_alive()
            self._catch_up()
            first, last = self._own_event(start).latest, self._own_event(end).latest
            if first is None or last is None or first.done_at is None or last.done_at is None:
                raise DeviceError("elapsed: both events must have completed", CUDA_ERROR_NOT_READY)
            return last.done_at - first.done_at

    # -- copies ------------------------------------------------------------------------------------------------

    def copy_batch(self, stream: Stream, buf: DescriptorBuffer, count: int, *, tag: Tag | None = None) -> None:
        """Queue the first ``count`` descriptors of ``buf`` as one copy op on ``stream``.

        The descriptors are read when the op starts; it takes latency + bytes / bandwidth and moves the bytes
        when it finishes. Each range must lie inside one live span, else the device gets the sticky
        illegal-address error then (violation ``illegal_address``).

        Raises:
            InvalidTransferError: ``count`` outside [0, capacity].
            DeviceError: an injected ``copy`` fault, a lost device, or a stream or buffer that is not live (400).
        """
        with self._lock:
            target = self._own_stream(stream)
            self._fault("copy", tag)
            if self._buffers.get(id(buf)) is not buf:
                raise DeviceError(f"copy_batch: {buf!r} is not a live descriptor buffer of this device",
                                  CUDA_ERROR_INVALID_RESOURCE_HANDLE)
            if not 0 <= count <= buf.capacity:
                raise InvalidTransferError(f"copy_batch: count {count} outside [0, {buf.capacity}]")
            op = _CopyOp(target, buf, count, tag)
            self._pending[op] = None
            self._buffer_users[id(buf)] += 1
            self._sched.submit(op)

    # -- clock and the device-level proof ----------------------------------------------------------------------

    def monotonic(self) -> float:
        """The virtual clock, in seconds."""
        with self._lock:
            return self._sched.now

    def sleep(self, seconds: float) -> None:
        """Advance the virtual clock by ``seconds``, running the work due by then. Never raises a DeviceError.

        Raises:
            ValueError: a negative duration.
        """
        if seconds < 0:
            raise ValueError(f"cannot sleep a negative time ({seconds})")
        with self._lock:
            now = self._sched.now
            target = now + seconds if now + seconds > now or seconds == 0 else np.nextafter(now, np.inf)
            self._sched.run(float(target))
            self._sched.now = max(self._sched.now, float(target))

    def clock_advance(self, seconds: float) -> None:
        """Test helper: the same as :meth:`sleep`."""
        self.sleep(seconds)

    def prove_idle(self, streams: Sequence[Stream], deadline: float) -> bool:
        """The device-level proof (R13): fresh events on the compute stream and ``streams``, polled until
        ``deadline`` (at least once). Fault point ``device_sync``.

        Returns:
            True if every fresh event completed; False at the deadline (always, under a ``device_sync`` hang,
            with the clock then at the deadline).

        Raises:
            DeviceError: an injected fault or a lost device.
        """
        with self._lock:
            # Both kinds count this call (nth counts every call at the point); an error wins over a hang.
            hang = self._plan is not None and self._plan.check_hang("device_sync")
            self._fault("device_sync", None)
            if hang:
                poll_until(self, lambda: False, deadline)
                return False
            return record_and_poll(self, streams, deadline)

    # -- test helpers ------------------------------------------------------------------------------------------

    def enqueue_compute_write(self, dev: object, rows: npt.ArrayLike, value: int, delay: float) -> None:
        """Test helper: queue on the compute stream a kernel that runs ``delay`` virtual seconds and then
        writes byte ``value`` into the given rows of ``dev``.

        Raises:
            InvalidTransferError: not a device array of this backend, a row out of range, a value outside
                0..255, or a negative delay.
            DeviceError: the device is lost.
        """
        with self._lock:
            self._check_alive()
            target = self._device_view(dev)
            picked = np.asarray(rows, dtype=np.int64).reshape(-1)
            if picked.size and (picked.min() < 0 or picked.max() >= target.shape[0]):
                raise InvalidTransferError(f"enqueue_compute_write: rows outside [0, {target.shape[0]})")
            if not 0 <= value <= 255 or delay < 0:
                raise InvalidTransferError("enqueue_compute_write: value must be a byte and delay >= 0")
            self._sched.submit(_ComputeOp(self._compute, target, picked, value, delay))

    # -- internals ---------------------------------------------------------------------------------------------

    def _halted(self) -> bool:
        return self._sticky is not None or (self._plan is not None and self._plan.lost() is not None)

    def _check_alive(self) -> None:
        if self._sticky is not None:
            raise DeviceError(f"device has a sticky illegal-address error: {self._sticky}",
                              CUDA_ERROR_ILLEGAL_ADDRESS)
        lost = self._plan.lost() if self._plan is not None else None
        if lost is not None:
            raise DeviceError(f"device lost earlier ({lost!r})", lost.status)

    def _fault(self, point: FaultPoint, tag: Tag | None) -> None:
        if self._plan is not None:
            self._plan.check(point, tag)
        self._check_alive()

    def _catch_up(self) -> None:
        self._sched.catch_up()

    def _wait_for(self, record: _Record, what: str) -> None:
        """Run work until ``record`` completes; past the hang horizon, advance the clock by it and raise."""
        start = self._sched.now
        done = record.done_at is not None or self._sched.run(
            start + self._hang_horizon, until=lambda: record.done_at is not None)
        self._check_alive()
        if not done:
            self._sched.now = max(self._sched.now, start + self._hang_horizon)
            raise SimHang(f"{what} did not complete within {self._hang_horizon} virtual seconds "
                          "(hung work, or work waiting on hung work)")

    def _selects_hang(self, stream: SimStream, tag: Tag | None) -> bool:
        if self._plan is None or tag is None or stream is self._compute or tag in self._seen_tags:
            return False
        self._seen_tags.add(tag)
        return self._plan.select_hang(tag) is not None

    def _violate(self, kind: ViolationKind, detail: str, tag: Tag | None = None) -> None:
        self._violations.append(Violation(self._sched.now, kind, detail, tag))

    def _poison_pending(self, lo: int, hi: int, kind: ViolationKind, why: str) -> None:
        for op in self._pending:
            if op.touches(lo, hi):
                self._violate(kind, f"copy {op.tag} is pending while {why}", op.tag)
                op.poison = op.poison or f"{why} while the copy was pending"

    def _op_duration(self, op: _Op) -> float:
        if isinstance(op, _ComputeOp):
            return op.delay
        if not isinstance(op, _CopyOp):
            return 0.0
        n = op.count
        op.plan, slow = self._memory.plan(op.buf.src[:n].copy(), op.buf.dst[:n].copy(), op.buf.sizes[:n].copy())
        total = int(op.plan.sizes[op.plan.sizes > 0].sum())
        return self._latency + (total - slow) / self._pinned_bw + slow / self._pageable_bw

    def _apply_op(self, op: _Op, t: float) -> None:
        if isinstance(op, _ComputeOp):
            op.target[op.rows] = op.value
        elif isinstance(op, _CopyOp):
            self._execute_copy(op)

    def _execute_copy(self, op: _CopyOp) -> None:
        del self._pending[op]
        self._buffer_users[id(op.buf)] -= 1
        if not self._buffer_users[id(op.buf)]:
            del self._buffer_users[id(op.buf)]
        plan = op.plan
        bad = plan.first_bad() if plan is not None else None
        if plan is not None and op.poison is None and bad is None:
            plan.execute()
            return
        detail = op.poison or _outside_detail(op, bad)
        self._violate("illegal_address", f"copy {op.tag}: {detail}", op.tag)
        self._sticky = detail

    def _own_stream(self, stream: Stream) -> SimStream:
        if isinstance(stream, SimStream) and stream.owner is self and not stream.destroyed:
            return stream
        raise DeviceError(f"{stream!r} is not a live stream of this device", CUDA_ERROR_INVALID_RESOURCE_HANDLE)

    def _own_event(self, event: Event) -> SimEvent:
        if isinstance(event, SimEvent) and event.owner is self and not event.destroyed:
            return event
        raise DeviceError(f"{event!r} is not a live event of this device", CUDA_ERROR_INVALID_RESOURCE_HANDLE)

    def _geometry(self, array: object) -> tuple[TensorGeometry, npt.NDArray[np.uint8]]:
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 2:
            raise InvalidTransferError(f"expected a 2-D uint8 sim device array, got {_describe(array)}")
        rows, row_bytes = (int(n) for n in array.shape)
        stride, column_stride = (int(n) for n in array.strides)
        if rows == 0 or row_bytes == 0 or column_stride != 1 or (rows > 1 and stride < row_bytes):
            raise InvalidTransferError(f"sim device arrays must be non-empty with contiguous, non-overlapping "
                                       f"rows; got shape {array.shape}, strides {array.strides}")
        stride = stride if rows > 1 else max(stride, row_bytes)
        ptr = address(array)
        span = self._memory.span_holding(ptr, (rows - 1) * stride + row_bytes)
        if span is None or span.is_host:
            raise InvalidTransferError(f"array at {ptr:#x} is not a device array of this backend")
        return TensorGeometry(ptr, rows, row_bytes, stride), array

    def _device_view(self, array: object) -> npt.NDArray[np.uint8]:
        return self._geometry(array)[1]


def _checked_shape(shape: tuple[int, int]) -> tuple[int, int]:
    try:
        rows, row_bytes = (int(n) for n in shape)
    except (TypeError, ValueError):
        raise InvalidTransferError(f"shape must be (rows, row_bytes), got {shape!r}") from None
    if rows <= 0 or row_bytes <= 0:
        raise InvalidTransferError(f"shape must be positive, got {shape!r}")
    return rows, row_bytes


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"an ndarray of dtype {value.dtype} and shape {value.shape}"
    return type(value).__name__


def _outside_detail(op: _CopyOp, bad: int | None) -> str:
    if bad is None:
        return "descriptors never read"
    src, dst, sizes = op.descriptors()
    return (f"descriptor {bad} (src {int(src[bad]):#x}, dst {int(dst[bad]):#x}, {int(sizes[bad])} bytes) "
            "touches memory outside every live span")


if TYPE_CHECKING:
    def _conforms(backend: SimBackend) -> Backend:   # mypy checks that SimBackend satisfies the protocol
        return backend
