"""The simulated device: a deterministic GPU model over real numpy memory, safe to call from several threads.

Theory of operation
-------------------
*Scheduling.* A virtual clock, per-stream FIFOs of ops and one heap of started ops keyed by finish time
(``_simsched.py``): only ``sleep``/``clock_advance`` move the clock freely, ``synchronize`` and ``to_host`` move it
to when what they wait for completes, and a bounded wait's pause (``poll_sleep``, ``_simclock.py``) to the next
completion its polls found pending (never past the pause); ops finishing at the same time apply latest-submitted
first. ``schedule_length`` reads the device-side span of what was queued, host polling not counted.

*Memory.* Device arrays are C-contiguous 2-D uint8 numpy arrays; host mappings announced with ``track_host``
are viewed through numpy arrays built from their raw address. Each is a *span* in an address map (``_simmem.py``;
the copy engine is ``_simcopy.py``). A copy reads its descriptors when it starts and moves the bytes when it
finishes, all sources read before any destination is written; every range must lie inside one live span. The
sim never touches an address outside a live span: a copy whose range was unmapped or unpinned while it was
pending is *poisoned* and is stopped at execution. ``untrack_host_pages`` unmaps a page-aligned piece of a tracked
mapping (R29: the platform's page-granular unmap); the rest of the mapping stays live, and stays one ledger
"mapping" until ``untrack_host`` of its start.

*Violations.* Misuse that real hardware punishes late or silently is recorded in :attr:`SimBackend.violations`:
unmapping or unpinning memory a pending copy touches, freeing a descriptor buffer a pending copy reads, a copy
touching no live span (sticky illegal-address error, status 700, as CUDA), a double unregister, and releasing a
handle that is not live. "Pending" includes a copy stuck behind a hang forever. With ``race_check`` (the
default), two device operations touching the same bytes, one writing, that nothing orders (``dma_race``, R20;
``_simrace.py``). A copy with a host span in two registrations (``crosses_registration``, R25: the sim records
each ``host_register``, see ``registrations()``). docs/simulator.md is the user's guide.

*Faults.* A :class:`~kvoffload_ref.faults.FaultPlan` is consulted at every fault point; see ``faults.py``. A hang
is selected when a transfer is submitted (its start: a tagged ``record`` on a stream other than a compute stream
that does not close the stream's open start/end pair of that tag), and is a hang op queued right after it
(``end_hangs`` ends it, so a test can watch the late copy land); a slow fault is selected the same way and queues
a stall of its ``duration`` there instead.
Once the device is lost (a sticky fault, or the sim's own illegal-address error) nothing queued runs any more
and every call but the clock, the release calls (``destroy_*``, ``free_descriptors``, ``untrack_host``: they fail
only where an error fault selects them), ``track_host``, ``array_info``, ``current_stream`` and ``compute_stream``
raises.

*Accounting.* Streams, events, descriptor buffers, pinned ranges and host mappings pass through the
:class:`~kvoffload_ref.backends.base.Ledger`, only once the call that acquires them has succeeded.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._simarrays import SimArrayCalls
from kvoffload_ref.backends._simbatch import SimBatchCalls
from kvoffload_ref.backends._simclock import ScheduleLength, SimClockCalls
from kvoffload_ref.backends._simcore import describe, tag_of, transfer_name
from kvoffload_ref.backends._simhost import SimHostCalls
from kvoffload_ref.backends._simrace import Violation, ViolationKind, copy_access, rows_access
from kvoffload_ref.backends._simsched import (
    ComputeOp,
    CopyOp,
    SimEvent,
    SimStream,
    WaitOp,
)
from kvoffload_ref.backends.base import (
    Backend,
    DescriptorBuffer,
    Event,
    FaultSource,
    Ledger,
    Stream,
    Tag,
    give_up_past_horizon,
    poll_until,
    record_and_poll,
)
from kvoffload_ref.errors import (
    CUDA_ERROR_INVALID_RESOURCE_HANDLE,
    CUDA_ERROR_NOT_READY,
    DeviceError,
    InvalidTransferError,
    SimHang,
)
from kvoffload_ref.validate import check_id_array, check_int, check_seconds, short_repr

__all__ = ["ScheduleLength", "SimBackend", "SimEvent", "SimHang", "SimStream", "Violation", "ViolationKind"]

I64 = npt.NDArray[np.int64]
Bytes = npt.NDArray[np.uint8]


class SimBackend(SimArrayCalls, SimBatchCalls, SimHostCalls, SimClockCalls):
    """The deterministic simulated device (see the module docstring). Implements :class:`Backend`.

    Args:
        faults: the faults to inject, or None.
        latency: virtual seconds every copy op costs on top of its bytes (default: the profile's ``call_cost``,
            5 us for ``"simple"``).
        pinned_bandwidth: bytes per virtual second for device memory and pinned host memory (default: the
            profile's ``link_bandwidth``, 25 GB/s for ``"simple"``; under another profile it caps every path and
            is both directions' link, replacing a profile's separate ``load_link_bandwidth``).
        pageable_bandwidth: bytes per virtual second when a host side is not inside one pinned range (default:
            the profile's, 8 GB/s).
        hang_horizon: virtual seconds a blocking wait (``synchronize``, ``to_host``) waits before it gives up
            with :class:`SimHang`.
        race_check: detect unordered overlapping device operations (violation ``dma_race``, R20); on by
            default.
        profile: the cost model, by name (``"simple"``, the default: ``latency + bytes / bandwidth``;
            ``"h200"``, ``"h100"``, ``"mi300x"``, ``"mi355x"``, ``"gb200"``, ``"h20"``: copy paths,
            per-descriptor costs and a shared link, ``sim_profiles.py``, docs/simulator.md) or a ``CostProfile``.
        copy_path: ``"auto"`` (default), ``"kernel"`` or ``"memcpy"``: the path rule the CuPy backend applies
            (``copy_paths.choose_path``), priced by the profile; also the attribute :attr:`copy_path`.
        trace: record a timeline (``trace_document``, ``write_trace``: Chrome trace-event JSON); off by default.
        link_model: None (default: the profile's, ``"fair"`` for every named profile), ``"fair"`` (the copies in
            their link phase share it) or ``"fifo"`` (one copy engine per direction: arrival order, one stream's
            queued copies as a block; ``_simengine.py``, docs/simulator.md "Copy-engine order"). Overrides the
            profile's ``link_model``; needs a profile with a shared link (not ``"simple"``).
        host_register: ``"allow"`` (default) or ``"refuse"``: a platform that refuses every host registration
            (``host_register`` raises ``RegistrationRefused``, status 801, as under confidential computing, vLLM
            #55428); ``alloc_pinned`` still works. Also the attribute ``refuses_registration``.

    Attributes:
        on_call: None, or ``on_call(point, tag)`` called at the start of every public call (before the internal
            lock is taken), with the point name of :data:`~kvoffload_ref.backends.base.CALL_POINTS` and the
            call's tag (for ``query``/``synchronize``/``elapsed``: the tag of the event's latest record). Tests
            use it to pause a thread at a chosen call.

    Thread safety: every public call is atomic under one internal lock, except that ``prove_idle`` and the hook
    run outside it (``prove_idle`` is made of ordinary calls).

    Raises:
        InvalidTransferError: a latency that is not a finite number of seconds >= 0, a bandwidth or a horizon that
            is not a finite number > 0 (a bool, a string, NaN, an infinity or an int too large for a float is
            refused), a ``race_check`` or ``trace`` that is not a bool, an unknown profile, ``copy_path`` or
            ``host_register``, a ``link_model`` other than ``"fair"``/``"fifo"`` or ``"fifo"`` under ``"simple"``
            (R7). It is a ValueError.
    """

    name: str = "sim"

    # -- inspection ---------------------------------------------------------------------------------------------

    @property
    def ledger(self) -> Ledger:
        """The resources the library acquired through this backend (R16)."""
        return self._ledger

    @property
    def hang_horizon(self) -> float:
        """Virtual seconds after which a wait without a bound on hung work gives up with SimHang."""
        return self._hang_horizon

    def check_unbounded_wait(self, started: float, now: float, what: str) -> None:
        """SimHang once a wait without a timeout outlived :attr:`hang_horizon` (a pure check: no hook, no lock).

        Raises:
            SimHang: ``now - started >= hang_horizon``.
        """
        give_up_past_horizon(self._hang_horizon, started, now, what)

    @property
    def violations(self) -> list[Violation]:
        """A copy of the violations detected so far, in detection order."""
        with self._lock:
            return list(self._violations)

    @property
    def faults(self) -> FaultSource | None:
        """The fault plan this device applies, if any."""
        return self._plan

    # -- streams and events ------------------------------------------------------------------------------------

    def current_stream(self) -> Stream:
        """The default compute stream (not in the ledger). The sim has no per-thread current stream."""
        if self.on_call is not None:
            self.on_call("current_stream", None)
        return self._compute

    def compute_stream(self, stream: object | None = None) -> Stream:
        """Resolve a compute stream (R4: the stream transfers wait on at submission).

        Args:
            stream: None for the default compute stream (:meth:`current_stream`); a ``str`` for the named
                compute stream of that name (created on first use; the same stream for the same name; never
                destroyed, not in the ledger); or a stream of this device, returned as is.

        Raises:
            InvalidTransferError: anything else (another device's stream, a destroyed stream, another type).
        """
        if self.on_call is not None:
            self.on_call("compute_stream", None)
        if stream is None:
            return self._compute
        with self._lock:
            if isinstance(stream, str):
                named = self._named.get(stream)
                if named is None:
                    named = self._named[stream] = SimStream(self, f"compute:{stream}", compute=True)
                return named
            if isinstance(stream, SimStream) and stream.owner is self and not stream.destroyed:
                return stream
        raise InvalidTransferError(f"compute_stream: stream must be None, a str naming a compute stream (e.g. "
                                   f"'model') or a live stream of this device; got {describe(stream)}")

    def create_stream(self, *, tag: Tag | None = None) -> Stream:
        """A new stream (ledger kind "stream", key id(stream)).

        Raises:
            DeviceError: an injected ``stream_create`` fault or a lost device.
        """
        if self.on_call is not None:
            self.on_call("stream_create", tag)
        with self._lock:
            self._fault("stream_create", tag)
            stream = SimStream(self, f"s{next(self._labels)}")
            self._streams[id(stream)] = stream
            self._ledger.acquire("stream", id(stream))
            return stream

    def destroy_stream(self, stream: Stream) -> None:
        """Destroy a stream (fault point ``destroy``); work already queued on it still runs (misuse:
        ``invalid_release``).

        Raises:
            DeviceError: an injected ``destroy`` fault (nothing happens: the stream stays live).
        """
        key = id(stream)
        if self.on_call is not None:
            self.on_call("destroy_stream", None)
        with self._lock:
            self._release_fault("destroy")
            if self._streams.pop(key, None) is not stream or not isinstance(stream, SimStream):
                self._violate("invalid_release", f"destroy_stream({stream!r}): not a live stream of this device")
                return
            stream.destroyed = True
            if self._race is not None:
                self._race.forget_stream(stream)
            self._ledger.release("stream", key)

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Make later work on ``stream`` wait for the event's current record (a never-recorded event: no-op).

        Raises:
            DeviceError: a lost device, or a handle that is not live on this device (400).
        """
        if self.on_call is not None:
            self.on_call("wait_event", None)
        with self._lock:
            if self._sticky is not None or self._plan is not None:  # else _check_alive finds nothing
                self._check_alive()
            target, awaited = self._own_stream(stream), self._own_event(event)
            latest = awaited.latest
            if latest is not None:
                self._sched.submit(WaitOp(target, latest))
                if self._race is not None:
                    self._race.on_wait(target, latest)

    def create_event(self, *, tag: Tag | None = None) -> Event:
        """A new event (ledger kind "event", key id(event)); it counts as complete until recorded.

        Raises:
            DeviceError: an injected ``event_create`` fault or a lost device.
        """
        if self.on_call is not None:
            self.on_call("event_create", tag)
        with self._lock:
            self._fault("event_create", tag)
            event = SimEvent(self, next(self._labels))
            key = event.key  # id(event): one int for both tables (a teardown touches every one)
            self._events[key] = event
            self._ledger.acquire("event", key)
            return event

    def destroy_event(self, event: Event) -> None:
        """Destroy an event (fault point ``destroy``; misuse: ``invalid_release``).

        Raises:
            DeviceError: an injected ``destroy`` fault (nothing happens: the event stays live).
        """
        self._destroy_event(event, fault=True)

    def _destroy_event(self, event: Event, *, fault: bool) -> None:
        """``destroy_event``; ``fault=False`` for the device-level proof's own events (not a release step of the
        library's: no fault point applies, the hook still sees the call)."""
        key = id(event)
        if self.on_call is not None:
            self.on_call("destroy_event", None)
        with self._lock:
            if fault:
                self._release_fault("destroy")
            if self._events.pop(key, None) is not event or not isinstance(event, SimEvent):
                self._violate("invalid_release", f"destroy_event({event!r}): not a live event of this device")
                return
            self._ledger.release("event", key)

    def record(self, event: Event, stream: Stream, *, tag: Tag | None = None) -> None:
        """Start a new generation of the event, completing once the work queued on the stream before it ran.

        On a stream other than a compute stream, a transfer's tagged records come in pairs (start, end): a
        tagged record that does not close an open pair of the same tag *submits* a transfer and offers it to
        ``FaultPlan.select_hang`` (so ``nth`` counts submissions, a reused job id included); if a hang is
        selected, the stream blocks right after this record until :meth:`end_hangs` ends it (forever otherwise);
        if a slow fault is, the stream stalls there for its ``duration``.

        Raises:
            DeviceError: a lost device, or a handle that is not live on this device (400).
        """
        if self.on_call is not None:
            self.on_call("record", tag)
        with self._lock:
            if self._sticky is not None or self._plan is not None:  # else _check_alive finds nothing
                self._check_alive()
            target, recorded = self._own_stream(stream), self._own_event(event)
            recorded.latest, recorded.tag = self._submit_record(target), tag
            if tag is not None and self._plan is not None and not target.compute:  # else no stall can follow it
                self._queue_stall(target, tag)   # (``_select_stall``; without a fault plan nothing is selected)

    def query(self, event: Event) -> bool:
        """Whether the event's latest record completed (True if never recorded). Runs work due by now.

        Raises:
            DeviceError: an injected ``event_query`` fault (matched on the event's tag), a lost device, the
                sticky illegal-address error (700), or a handle that is not live (400).
        """
        if self.on_call is not None:
            self.on_call("event_query", tag_of(event))
        with self._lock:
            recorded = self._own_event(event)
            if self._plan is not None or self._sticky is not None:  # else _fault and _check_alive do nothing
                self._fault("event_query", recorded.tag)
            self._sched.catch_up()
            if self._trace is not None:
                self._trace.host_query(self._sched.now)
            if self._plan is not None or self._sticky is not None:
                self._check_alive()
            latest = recorded.latest
            if latest is None:
                return True
            if latest.done_at is None:
                self._watch(latest)  # the thread's next poll pause ends at its completion (``poll_sleep``)
                return False
            if self._race is not None:
                self._race.observe(latest)
            return True

    def synchronize(self, event: Event) -> None:
        """Advance the clock until the event's latest record completes.

        Raises:
            DeviceError: an injected ``event_sync`` fault, a lost device, the sticky illegal-address error, or
                a handle that is not live.
            SimHang: the record cannot complete within the hang horizon (the clock then advanced by it).
        """
        if self.on_call is not None:
            self.on_call("event_sync", tag_of(event))
        with self._lock:
            recorded = self._own_event(event)
            self._fault("event_sync", recorded.tag)
            if recorded.latest is not None:
                self._wait_for(recorded.latest, f"synchronize({recorded!r})")
                if self._race is not None:
                    self._race.observe(recorded.latest)

    def elapsed(self, start: Event, end: Event) -> float:
        """Virtual seconds between the completions of two events' latest records.

        Raises:
            DeviceError: 600 if either has not completed (or was never recorded); a lost device; 400 for a
                handle that is not live.
        """
        if self.on_call is not None:
            self.on_call("elapsed", tag_of(end))
        with self._lock:
            if self._sticky is not None or self._plan is not None:  # else _check_alive finds nothing
                self._check_alive()
            self._sched.catch_up()
            first, last = self._own_event(start).latest, self._own_event(end).latest
            if first is None or last is None or first.done_at is None or last.done_at is None:
                raise DeviceError("elapsed: both events must have completed", CUDA_ERROR_NOT_READY)
            return last.done_at - first.done_at

    # -- copies ------------------------------------------------------------------------------------------------

    def copy_batch(self, stream: Stream, buf: DescriptorBuffer, count: int, *, tag: Tag | None = None) -> None:
        """Queue the first ``count`` descriptors of ``buf`` as one copy op on ``stream``.

        The descriptors are read when the op starts; it takes latency + bytes / bandwidth (under a profile with
        paths: its path's costs, sharing the link of its direction; ``_simcost.py``) and moves the bytes when it
        finishes. Each range must lie inside one live span, else the device gets the sticky
        illegal-address error then (violation ``illegal_address``). A descriptor whose host span lies in two
        registrations is recorded at submission (``crosses_registration``, R25); the copy still runs.

        Raises:
            InvalidTransferError: ``count`` is not an int (checked first: no fault point is counted), or is outside
                [0, capacity].
            DeviceError: an injected ``copy`` fault, a lost device, or a stream or buffer that is not live (400).
        """
        count = check_int("copy_batch: count", count)
        if self.on_call is not None:
            self.on_call("copy", tag)
        with self._lock:
            target = self._own_stream(stream)
            if self._plan is not None or self._sticky is not None:  # else _fault and _check_alive do nothing
                self._fault("copy", tag)
            if self._buffers.get(id(buf)) is not buf:
                raise DeviceError(f"copy_batch: {buf!r} is not a live descriptor buffer of this device",
                                  CUDA_ERROR_INVALID_RESOURCE_HANDLE)
            if not 0 <= count <= buf.capacity:
                raise InvalidTransferError(f"copy_batch: count must be an int in [0, {buf.capacity}] (the "
                                           f"buffer's capacity), got {count!r} (e.g. {buf.capacity})")
            op = CopyOp(target, buf, count, tag)
            self._check_registrations(buf, count, tag)  # R25
            if self._race is not None:
                self._check_race(target, None if tag is not None else transfer_name(tag, target), tag,
                                 copy_access(buf, count))  # a tagged copy is named only in a message
            self._pending[op] = None
            users, key = self._buffer_users, id(buf)
            users[key] = users.get(key, 0) + 1
            self._sched.submit(op)

    # -- clock and the device-level proof ----------------------------------------------------------------------

    def monotonic(self) -> float:
        """The virtual clock, in seconds."""
        if self.on_call is not None:
            self.on_call("monotonic", None)
        with self._lock:
            return self._sched.now

    def prove_idle(self, streams: Sequence[Stream], deadline: float) -> bool:
        """The device-level proof (R13): fresh events on each of ``streams`` (only those), polled until
        ``deadline`` (at least once). Fault point ``device_sync``. Runs outside the internal lock: it is made of
        ordinary calls (``create_event``, ``record``, ``query``, ``sleep``...), each atomic and each reported to
        ``on_call``.

        Returns:
            True if every fresh event completed; False at the deadline (always, under a ``device_sync`` hang,
            with the clock then at the deadline).

        Raises:
            DeviceError: an injected fault or a lost device.
        """
        if self.on_call is not None:
            self.on_call("device_sync", None)
        with self._lock:
            # Both kinds count this call (nth counts every call at the point); an error wins over a hang.
            hang = self._plan is not None and self._plan.check_hang("device_sync")
            self._fault("device_sync", None)
        if hang:
            poll_until(self, lambda: False, deadline)
            return False
        return record_and_poll(self, streams, deadline, destroy=functools.partial(self._destroy_event, fault=False))

    # -- test helpers ------------------------------------------------------------------------------------------

    def end_hangs(self, direction: str | None = None, job_id: int | None = None) -> int:
        """Test helper: end the injected hangs of the matching transfers now, so a test can watch a late copy
        land (R26, R27).

        Every hang op (a ``"hang"`` fault at ``copy``, ``event_query`` or ``event_sync``) whose transfer tag
        matches finishes at the current virtual time: at once where it is its stream's head, else as soon as the
        work ahead of it ran. The work behind it (the transfer's copy, its end record, what waits on them) then
        runs as the clock advances (``sleep``, ``synchronize``...), taking its usual time. A hang ended earlier
        is not counted again. Fault points are not consulted; the ``on_call`` hook is not called; a lost device
        still runs nothing.

        Args:
            direction: None (any), ``"store"`` or ``"load"``: the tag's direction.
            job_id: None (any) or an int: the tag's job id.

        Returns:
            How many hangs this call ended.

        Raises:
            InvalidTransferError: a direction other than None, "store" or "load", or a ``job_id`` that is not
                None or an int (a bool is refused) (R7).
        """
        if direction is not None and (not isinstance(direction, str) or direction not in ("store", "load")):
            raise InvalidTransferError(f"end_hangs: direction must be None, 'store' or 'load', got {direction!r}")
        wanted = None if job_id is None else check_int("end_hangs: job_id", job_id)
        with self._lock:
            ended = self._end_hangs(direction, wanted)
            self._catch_up()
            return ended

    def enqueue_compute_write(self, dev: object, rows: npt.ArrayLike, value: int, delay: float, *,
                              stream: object | None = None) -> None:
        """Test helper: queue on a compute stream a kernel that runs ``delay`` virtual seconds and then writes
        byte ``value`` into the given rows of ``dev``.

        Args:
            dev: a device array of this backend.
            rows: the row indices to write.
            value: the byte written.
            delay: virtual seconds the kernel runs.
            stream: the compute stream, as :meth:`compute_stream` resolves it (None: the default one).

        Raises:
            InvalidTransferError: not a device array of this backend, rows that are not a 1-D list of ints
                (or a scalar int) in range, a value that is not an int in 0..255, a delay that is not a finite
                number of seconds >= 0, or a stream :meth:`compute_stream` refuses.
            DeviceError: the device is lost.
        """
        byte = check_int("enqueue_compute_write: value", value, minimum=0, maximum=255)
        seconds = check_seconds("enqueue_compute_write: delay", delay)
        scalar = isinstance(rows, (int, np.integer)) and not isinstance(rows, bool)
        picked = check_id_array("enqueue_compute_write: rows", [rows] if scalar else rows, noun="rows")
        target_stream = cast(SimStream, self.compute_stream(stream))
        with self._lock:
            self._check_alive()
            target = self._device_view(dev)
            if picked.size and picked.max() >= target.shape[0]:
                raise InvalidTransferError(f"enqueue_compute_write: rows must be in [0, {target.shape[0]}) (the "
                                           f"array's rows), got {short_repr(picked.tolist())} (e.g. [0])")
            if self._race is not None:
                name = f"compute work on stream {target_stream.label!r}"
                self._check_race(target_stream, name, None, rows_access(target, picked))
            self._sched.submit(ComputeOp(target_stream, target, picked, byte, seconds))


if TYPE_CHECKING:
    def _conforms(backend: SimBackend) -> Backend:   # mypy checks that SimBackend satisfies the protocol
        return backend
