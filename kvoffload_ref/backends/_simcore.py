"""The simulated device's state, its host-memory calls and its internal mechanics; ``sim.py`` builds the rest
of the public facade on it (with the memory calls of ``_simarrays.py`` and the batched calls of ``_simbatch.py``).

:class:`SimCore` holds what a :class:`~kvoffload_ref.backends.sim.SimBackend` knows (the address map, the
scheduler, live handles, pending copies, violations, the race detector) and the steps its public calls share:
fault checks, waiting for a record within the hang horizon, poisoning pending copies, timing and applying ops,
resolving handles and arrays, and naming memory in violations. It also implements the host-memory calls
(``track_host``, ``untrack_host``, ``host_register``, ``host_unregister``). See ``sim.py`` for the theory of operation.
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import threading
from collections.abc import Sequence
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._simcost import CostModel, CostProfile, LinkModel
from kvoffload_ref.backends._simmem import DescriptorWords, Memory, Span, address
from kvoffload_ref.backends._simrace import Access, RaceDetector, Violation, ViolationKind, transfer_name
from kvoffload_ref.backends._simsched import (
    ComputeOp,
    CopyOp,
    HangOp,
    Op,
    Record,
    RecordOp,
    Scheduler,
    SimEvent,
    SimStream,
    SlowOp,
    descriptor_rows,
)
from kvoffload_ref.backends._simtrace import SimTrace
from kvoffload_ref.backends.base import (
    CallHook,
    DescriptorBuffer,
    Event,
    FaultPoint,
    FaultSource,
    Ledger,
    StallFault,
    Stream,
    Tag,
    TensorGeometry,
)
from kvoffload_ref.backends.copy_paths import CopyPath, check_copy_path
from kvoffload_ref.backends.sim_profiles import profile_named
from kvoffload_ref.backends.trace_format import write_document
from kvoffload_ref.errors import (
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_INVALID_RESOURCE_HANDLE,
    DeviceError,
    InvalidTransferError,
    SimHang,
)
from kvoffload_ref.validate import INT64_MAX, check_int, check_positive, check_seconds, short_repr

__all__ = ["SimCore", "checked_shape", "describe", "tag_of", "transfer_name"]

T = TypeVar("T")

#: The page size: the unit of :meth:`SimCore.untrack_host_pages` (R29).
PAGE: Final = mmap.PAGESIZE
#: Up to this many pending copies, a release checks them one by one; beyond, in one vectorized pass.
SMALL_PENDING: Final = 16
#: A thread's watched records are pruned of the completed ones once it holds this many, then at each power of two
#: (``SimCore._watch``).
WATCH_PRUNE: Final = 64

Bytes = npt.NDArray[np.uint8]


class _ProfileValue(float):
    """The default of ``latency``/``pinned_bandwidth``/``pageable_bandwidth``: the profile's value."""

    def __repr__(self) -> str:
        return "<the profile's value>"


#: The sentinel default: an explicit number overrides the profile's term; this one takes it.
PROFILE_VALUE: float = _ProfileValue("nan")



def _check_switches(copy_path: object, host_register: object, trace: object, race_check: object) -> None:
    """Refuse a constructor switch outside its values (R7: InvalidTransferError naming it, the value, the valid)."""
    check_copy_path(copy_path)
    if host_register not in ("allow", "refuse"):
        raise InvalidTransferError(f"host_register must be 'allow' or 'refuse'; got {short_repr(host_register)}")
    for name, value in (("trace", trace), ("race_check", race_check)):
        if not isinstance(value, bool):
            raise InvalidTransferError(f"{name} must be a bool, got {type(value).__name__} {short_repr(value)} "
                                       "(e.g. True)")

class SimCore:
    """State and internal steps of the simulated device (the constructor's arguments: see ``SimBackend``).

    Raises:
        InvalidTransferError: a latency that is not a finite number of seconds >= 0, a bandwidth or a hang
            horizon that is not a finite number > 0 (a bool, a string, NaN, an infinity and an int too large for a
            float included), or a ``race_check`` that is not a bool (R7).
    """

    def __init__(self, faults: FaultSource | None = None, *, latency: float = PROFILE_VALUE,
                 pinned_bandwidth: float = PROFILE_VALUE, pageable_bandwidth: float = PROFILE_VALUE,
                 hang_horizon: float = 3600.0, race_check: bool = True, profile: str | CostProfile = "simple",
                 copy_path: CopyPath = "auto", trace: bool = False, link_model: LinkModel | None = None,
                 host_register: str = "allow") -> None:
        try:
            chosen = profile_named(profile)
        except ValueError as exc:
            raise InvalidTransferError(str(exc)) from None
        latency = chosen.call_cost if latency is PROFILE_VALUE else check_seconds("latency", latency)
        # an explicit pinned_bandwidth is both directions' link (it clears a profile's separate load link)
        load_link = chosen.load_link_bandwidth if pinned_bandwidth is PROFILE_VALUE else None
        pinned_bandwidth = chosen.link_bandwidth if pinned_bandwidth is PROFILE_VALUE else check_positive(
            "pinned_bandwidth", pinned_bandwidth, unit="bytes per second")
        pageable_bandwidth = chosen.pageable_bandwidth if pageable_bandwidth is PROFILE_VALUE else check_positive(
            "pageable_bandwidth", pageable_bandwidth, unit="bytes per second")
        _check_switches(copy_path, host_register, trace, race_check)
        # Invariant: _refuse_register: the platform refuses every host registration (host_register="refuse": 801,
        # as under confidential computing, vLLM #55428; pinned memory then comes from alloc_pinned only);
        # refuses_registration: what it says in advance (backends.pinned.refuses_registration), at first the same.
        self._refuse_register = self.refuses_registration = host_register == "refuse"
        # Invariant: the cost terms in force (the named profile with the explicit overrides applied).
        # (replace validates link_model: InvalidTransferError naming it, the value and the valid ones).
        self.profile = dataclasses.replace(chosen, call_cost=latency, link_bandwidth=pinned_bandwidth,
                                           load_link_bandwidth=load_link,
                                           pageable_bandwidth=pageable_bandwidth,
                                           link_model=chosen.link_model if link_model is None else link_model)
        # Invariant: "auto", "kernel" or "memcpy" when set through the constructor: the path rule's setting, read
        # when a copy starts (profiles with paths only; "simple" has none).
        self.copy_path: CopyPath = copy_path
        hang_horizon = check_positive("hang_horizon", hang_horizon, unit="seconds")
        self._plan = faults
        self._latency, self._hang_horizon = latency, hang_horizon
        self._pinned_bw, self._pageable_bw = pinned_bandwidth, pageable_bandwidth
        # Invariant: held by every public method but prove_idle (and never while calling on_call).
        self._lock = threading.RLock()
        self.on_call: CallHook | None = None
        self._ledger = Ledger()
        self._memory = Memory()
        # (halted asked only where it can say True: a fault plan, or once the sticky error is set)
        self._sched = Scheduler(self._op_duration, self._apply_op, self._halted if faults is not None else None)
        # Invariant: None under a profile without a shared link ("simple"); else prices copies and runs the link.
        self._cost = CostModel(self.profile, self._sched.push) if self.profile.shared_link else None
        if self._cost is not None:
            self._sched.settle = self._cost.settle
        # Invariant: None unless trace=True; then records every op that finishes, faults and violations.
        self._trace = SimTrace(f"sim profile {self.profile.name}") if trace else None
        if self._trace is not None:
            self._sched.trace = self._trace.on_finish
        self._labels = itertools.count(1)
        # Invariant: the compute stream; never destroyed and never in the ledger.
        self._compute = SimStream(self, "compute", compute=True)
        # Invariant: name -> the named compute stream (compute_stream(name)); never destroyed, not in the ledger.
        self._named: dict[str, SimStream] = {}
        # Invariant: None when race_check is off; else tracks happens-before over every memory op (R20).
        self._race = RaceDetector(self._name_range) if race_check else None
        # Invariant: id -> handle for every live (created, not destroyed/freed) stream, event, descriptor buffer.
        self._streams: dict[int, SimStream] = {}
        self._events: dict[int, SimEvent] = {}
        self._buffers: dict[int, DescriptorBuffer] = {}
        # Invariant: where new descriptor buffers' rows come from (zeroed words, never handed out twice).
        self._descriptor_words = DescriptorWords()
        # Invariant: id(buffer) -> number of pending copies reading it (no entry when zero; a plain dict: a Counter's
        # missing key and deletion are Python calls, one each per copy).
        self._buffer_users: dict[int, int] = {}
        # Invariant: the copies submitted and not yet executed, including those stuck behind a hang.
        self._pending: dict[CopyOp, None] = {}
        # Invariant: the hang ops queued and not yet finished (hung, or ended and not yet run), in submission
        # order; end_hangs looks here (a hang may sit on a destroyed stream or behind other work).
        self._hangs: dict[HangOp, None] = {}
        # Invariant: every device array ever allocated; device memory is never freed, so no copy can touch
        # memory that was given back.
        self._device_arrays: list[Bytes] = []
        # Invariant: start address -> index in _device_arrays (for naming memory in violations).
        self._device_index: dict[int, int] = {}
        self._violations: list[Violation] = []
        # Invariant: address -> buffer of every live pinned allocation (alloc_pinned, not yet freed); each is also a
        # live host span and a pinned range of _memory, and a live "pinned_alloc" in the ledger.
        self._allocs: dict[int, Bytes] = {}
        # Invariant: pointers unregistered and not registered again since (to tell a double unregister).
        self._unpinned: set[int] = set()
        # Invariant: None while healthy; once a copy hit an illegal address, why (sticky: never reset).
        self._sticky: str | None = None
        # Invariant: thread id -> the records that thread's queries found pending since its clock last moved (its
        # sleep or poll pause); a poll pause stops at the first of them to complete (``_simclock.py``).
        self._watched: dict[int, set[Record]] = {}

    def __repr__(self) -> str:
        return f"<SimBackend t={self._sched.now:.6g}s violations={len(self._violations)}>"

    def _check_registrations(self, buf: DescriptorBuffer, count: int, tag: Tag | None) -> None:
        """R25: record ``crosses_registration`` for a copy with a host span in two registrations (the sim merges
        no descriptors, so each descriptor's span is checked as it is); the copy still runs."""
        if len(self._memory.pinned) <= 1:   # no two registrations to span (first_crossing's own first test)
            return
        src, dst, sizes = descriptor_rows(buf, count)
        for side, addrs in (("source", src), ("destination", dst)):
            found = self._memory.first_crossing(addrs, sizes)
            if found is not None:
                k, first, second = found
                lo = int(addrs[k])
                self._violate("crosses_registration",
                              f"copy {tag}: descriptor {k}'s {side} {self._name_range(lo, lo + int(sizes[k]))} "
                              f"spans the registrations at {first:#x} and {second:#x}", tag)
                return

    # -- timeline --------------------------------------------------------------------------------------------

    def trace_document(self) -> dict[str, Any]:
        """The timeline recorded so far, as Chrome trace-event JSON (``backends.trace_format``); work that never
        ran is listed with a zero-length span at the current time.

        Raises:
            InvalidTransferError: the device was made without ``trace=True``.
        """
        if self._trace is None:
            raise InvalidTransferError("trace_document: this device was made with trace=False and records no "
                                       "timeline: expected SimBackend(trace=True)")
        with self._lock:
            self._catch_up()
            return self._trace.document(self._pending, self._sched.now)

    def write_trace(self, path: str) -> None:
        """Write :meth:`trace_document` to ``path`` as JSON (open it in Perfetto or ``chrome://tracing``).

        Raises:
            InvalidTransferError: the device was made without ``trace=True``.
            OSError: the file cannot be written.
        """
        write_document(path, self.trace_document())

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
            if self._trace is None:
                self._plan.check(point, tag)
            else:
                try:
                    self._plan.check(point, tag)
                except DeviceError as exc:
                    self._trace_fault(point, tag, exc)
                    raise
        self._check_alive()

    def _release_fault(self, point: FaultPoint) -> None:
        """A release point (``destroy``, ``free``, ``unmap``): only an error fault that selects the call fails it;
        a lost device does not."""
        if self._plan is not None:
            try:
                self._plan.check_release(point)
            except DeviceError as exc:
                if self._trace is not None:
                    self._trace_fault(point, None, exc)
                raise

    def _release_checks(self, point: FaultPoint, items: Sequence[T]) -> tuple[Sequence[T], DeviceError | None]:
        """A batched release: one check per item (none when nothing is armed at ``point``): (the items no fault
        selected, the first injected error or None)."""
        if self._plan is None or not self._plan.armed(point):
            return items, None
        kept: list[T] = []
        failed: DeviceError | None = None
        for item in items:
            try:
                self._release_fault(point)
            except DeviceError as exc:
                failed = failed or exc
                continue
            kept.append(item)
        return kept, failed

    def _trace_fault(self, point: FaultPoint, tag: Tag | None, exc: DeviceError) -> None:
        assert self._trace is not None
        self._trace.instant(None, f"fault: {point} error {exc.status}", self._sched.now, "fault",
                            {"point": point, "tag": list(tag) if tag else None, "status": exc.status})

    def _catch_up(self) -> None:
        self._sched.catch_up()

    def _watch(self, record: Record) -> None:
        """A query of the calling thread found ``record`` pending: its completion can change that poll's answer, so
        the thread's next poll pause ends there (``SimClockCalls.poll_sleep``)."""
        thread = threading.get_ident()
        watched = self._watched.get(thread)
        if watched is None:
            self._watched[thread] = {record}
            return
        watched.add(record)
        size = len(watched)
        if size >= WATCH_PRUNE and not size & (size - 1):  # a thread that queries and never pauses: at each power
            watched.difference_update([r for r in watched if r.done])  # of two, drop what completed (amortized)

    def _wait_for(self, record: Record, what: str) -> None:
        """Run work until ``record`` completes; past the hang horizon, advance the clock by it and raise."""
        start = self._sched.now
        done = record.done_at is not None or self._sched.run(
            start + self._hang_horizon, stops={record})
        self._check_alive()
        if not done:
            self._sched.now = max(self._sched.now, start + self._hang_horizon)
            raise SimHang(f"{what} did not complete within {self._hang_horizon} virtual seconds "
                          "(hung work, or work waiting on hung work)")

    def _select_stall(self, stream: SimStream, tag: Tag | None) -> StallFault | None:
        """The hang or slow fault that selects the transfer this tagged record submits, if any (see ``record``)."""
        if tag is None or stream.compute:
            return None
        if stream.hang_tag == tag:   # the transfer's end record closes its pair
            stream.hang_tag = None
            return None
        stream.hang_tag = tag
        stall = self._plan.select_hang(tag) if self._plan is not None else None
        if stall is not None and self._trace is not None:
            args: dict[str, Any] = {"point": "copy", "tag": list(tag)}
            if stall.duration is not None:
                args["duration_s"] = stall.duration
            self._trace.instant(stream, f"fault: {stall.kind} after {transfer_name(tag, stream)}", self._sched.now,
                                "fault", args)
        return stall

    def _queue_stall(self, stream: SimStream, tag: Tag | None) -> None:
        """Right after a transfer's start record: queue the stall a hang or slow fault selected for it, if any."""
        stall = self._select_stall(stream, tag)
        if stall is None:
            return
        if stall.kind == "slow" and stall.duration is not None:
            self._sched.submit(SlowOp(stream, tag, stall.duration))
        else:
            hang = HangOp(stream, tag)
            self._hangs[hang] = None
            self._sched.submit(hang)

    def _end_hangs(self, direction: str | None, job_id: int | None) -> int:
        """End the hang ops whose tag matches (None: any); the count ended (see ``SimBackend.end_hangs``)."""
        ended = 0
        for hang in list(self._hangs):
            tag = hang.tag
            if direction is not None and (tag is None or tag[0] != direction):
                continue
            if job_id is not None and (tag is None or tag[1] != job_id):
                continue
            if self._sched.end_hang(hang):
                ended += 1
                if self._trace is not None:
                    self._trace.instant(hang.stream, f"hang ended: {transfer_name(tag, hang.stream)}",
                                        self._sched.now, "fault", {"tag": list(tag) if tag else None})
        return ended

    def _submit_record(self, stream: SimStream) -> Record:
        record = Record(stream)
        self._sched.submit(RecordOp(stream, record))
        if self._race is not None:
            self._race.on_record(stream, record)
        return record

    def _check_race(self, stream: SimStream, name: str | None, tag: Tag | None, access: Access) -> None:
        assert self._race is not None   # callers check; an internal invariant, not user input
        if self._trace is not None:
            self._trace.memory_op(stream, name, tag, self._sched.now)
        for detail, found, pair in self._race.on_op(stream, name, tag, access):
            self._violate("dma_race", detail, found, pair)

    def _name_range(self, lo: int, hi: int) -> str:
        """Names [lo, hi) for a violation: a device array's rows, or bytes of a host mapping."""
        span = self._memory.span_holding(lo, max(hi - lo, 0))
        if span is None:
            return f"bytes [{lo:#x}, {hi:#x})"
        if span.is_host:
            return f"host mapping {span.start:#x} bytes [{lo - span.start}, {hi - span.start})"
        index = self._device_index[span.start]
        array = self._device_arrays[index]
        stride = int(array.strides[0])
        first, last = (lo - span.start) // stride, (hi - 1 - span.start) // stride
        rows = f"row {first}" if first == last else f"rows {first}..{last}"
        return f"device array {index} ({array.shape[0]}x{array.shape[1]}) {rows}"

    def _new_device_array(self, shape: tuple[int, int]) -> Bytes:
        self._check_alive()
        rows, row_bytes = checked_shape(shape)
        array = np.zeros((rows, row_bytes), dtype=np.uint8)
        self._memory.add(Span(address(array), address(array) + array.nbytes, False, array.reshape(-1)))
        self._device_index[address(array)] = len(self._device_arrays)
        self._device_arrays.append(array)
        return array

    def _violate(self, kind: ViolationKind, detail: str, tag: Tag | None = None,
                 pair: tuple[int, int] | None = None) -> None:
        self._violations.append(Violation(self._sched.now, kind, detail, tag, pair))
        if self._trace is not None:
            self._trace.violation(kind, detail, self._sched.now, pair)

    def _poison_pending(self, lo: int, hi: int, kind: ViolationKind, why: str) -> None:
        for op in self._pending_touching(lo, hi):
            self._violate(kind, f"copy {op.tag} is pending while {why}", op.tag)
            op.poison = op.poison or f"{why} while the copy was pending"

    def _pending_touching(self, lo: int, hi: int) -> list[CopyOp]:
        """The pending copies with a descriptor touching [lo, hi), in pending order: one vectorized pass over all
        their descriptors (a release of many ranges under thousands of pending copies, R29, stays cheap)."""
        ops = list(self._pending)
        if len(ops) <= SMALL_PENDING:
            return [op for op in ops if op.touches(lo, hi)]
        parts = [op.descriptors() for op in ops]
        src, dst, sizes = (np.concatenate([p[k] for p in parts]) for k in range(3))
        owner = np.repeat(np.arange(len(ops)), [len(p[2]) for p in parts])
        hit = (sizes > 0) & (((src < hi) & (src + sizes > lo)) | ((dst < hi) & (dst + sizes > lo)))
        return [ops[i] for i in np.unique(owner[hit]).tolist()]

    def _op_duration(self, op: Op) -> float:
        if op.__class__ is not CopyOp:   # the common op first (no subclass of any op class exists)
            if isinstance(op, SlowOp):
                return op.duration   # exact: a stall is not priced by the profile
            if isinstance(op, ComputeOp):
                return op.delay if self._cost is None else op.delay * self._cost.compute_factor()
            return 0.0
        # A CopyOp (its class, as tested): its descriptors are read there, a snapshot (not started yet: the buffer's
        # rows, as CopyOp.descriptors reads them then).
        op.plan, slow = self._memory.plan(*descriptor_rows(op.buf, op.count))
        if self._cost is not None:
            return self._cost.price(op, op.plan, slow, self.copy_path, self._memory.seams())
        total = op.plan.live_bytes()
        return self._latency + (total - slow) / self._pinned_bw + slow / self._pageable_bw

    def _apply_op(self, op: Op, t: float) -> None:
        if op.__class__ is CopyOp:   # the common op first (no subclass of any op class exists)
            self._execute_copy(op)
        elif isinstance(op, ComputeOp):
            op.target[op.rows] = op.value
        elif isinstance(op, HangOp):
            del self._hangs[op]   # an ended hang ran

    def _execute_copy(self, op: CopyOp) -> None:
        del self._pending[op]
        users, key = self._buffer_users, id(op.buf)
        left = users[key] - 1
        if left:
            users[key] = left
        else:
            del users[key]
        plan = op.plan
        bad = plan.first_bad() if plan is not None else None
        if plan is not None and op.poison is None and bad is None:
            plan.execute()
            return
        detail = op.poison or _outside_detail(op, bad)
        self._violate("illegal_address", f"copy {op.tag}: {detail}", op.tag)
        self._sticky = detail
        self._sched.halted = self._halted   # from now on the device is halted (the scheduler asks)

    def _own_stream(self, stream: Stream) -> SimStream:
        if isinstance(stream, SimStream) and stream.owner is self and not stream.destroyed:
            return stream
        raise DeviceError(f"{stream!r} is not a live stream of this device", CUDA_ERROR_INVALID_RESOURCE_HANDLE)

    def _own_event(self, event: Event) -> SimEvent:
        if self._events.get(id(event)) is event:  # only this device's live events are in its table
            return event  # type: ignore[return-value]  # the table holds SimEvents only
        raise DeviceError(f"{event!r} is not a live event of this device", CUDA_ERROR_INVALID_RESOURCE_HANDLE)

    def _geometry(self, array: object) -> tuple[TensorGeometry, npt.NDArray[np.uint8]]:
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 2:
            raise InvalidTransferError(f"array must be a 2-D uint8 device array of this backend (e.g. "
                                       f"be.empty_device((4, 64))), got {describe(array)}")
        rows, row_bytes = (int(n) for n in array.shape)
        stride, column_stride = (int(n) for n in array.strides)
        if rows == 0 or row_bytes == 0 or column_stride != 1 or (rows > 1 and stride < row_bytes):
            raise InvalidTransferError(f"array must be non-empty with contiguous, non-overlapping rows (e.g. "
                                       f"be.empty_device((4, 64)) or a row slice of one), got shape {array.shape}, "
                                       f"strides {array.strides}")
        stride = stride if rows > 1 else max(stride, row_bytes)
        ptr = address(array)
        span = self._memory.span_holding(ptr, (rows - 1) * stride + row_bytes)
        if span is None or span.is_host:
            raise InvalidTransferError(f"array: the {describe(array)} at {ptr:#x} is not a device array of this "
                                       "backend: expected one it made (e.g. be.empty_device((4, 64)))")
        return TensorGeometry(ptr, rows, row_bytes, stride), array

    def _device_view(self, array: object) -> npt.NDArray[np.uint8]:
        return self._geometry(array)[1]


def tag_of(event: Event) -> Tag | None:
    """The tag of an event's latest record, read without the lock (for the call hook only)."""
    return event.tag if isinstance(event, SimEvent) else None


def checked_shape(shape: tuple[int, int]) -> tuple[int, int]:
    """A device array's ``(rows, row_bytes)``: two ints >= 1 whose product fits in int64 (R7).

    Raises:
        InvalidTransferError: not a pair, an element that is not an int (a float, a bool, a string), a size < 1,
            or more bytes than int64 addresses span.
    """
    if not isinstance(shape, (tuple, list)) or len(shape) != 2:
        raise InvalidTransferError(f"shape must be (rows, row_bytes), got {type(shape).__name__} "
                                   f"{short_repr(shape)} (e.g. (4, 64))")
    rows = check_int("shape[0] (rows)", shape[0], minimum=1, maximum=INT64_MAX)
    row_bytes = check_int("shape[1] (row_bytes)", shape[1], minimum=1, maximum=INT64_MAX)
    if rows * row_bytes > INT64_MAX:
        raise InvalidTransferError(f"shape ({rows}, {row_bytes}) is {rows * row_bytes} bytes: expected at most "
                                   f"{INT64_MAX} bytes (e.g. (4, 64))")
    return rows, row_bytes


def describe(value: object) -> str:
    """``value`` for a message: an array by its dtype and shape, anything else by its type and (short) repr."""
    if isinstance(value, np.ndarray):
        return f"an ndarray of dtype {value.dtype} and shape {value.shape}"
    return f"{type(value).__name__} {short_repr(value)}"


def _outside_detail(op: CopyOp, bad: int | None) -> str:
    if bad is None:
        return "descriptors never read"
    src, dst, sizes = op.descriptors()
    return (f"descriptor {bad} (src {int(src[bad]):#x}, dst {int(dst[bad]):#x}, {int(sizes[bad])} bytes) "
            "touches memory outside every live span")
