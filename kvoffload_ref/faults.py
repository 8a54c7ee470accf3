"""Fault injection: a FaultPlan says which backend calls fail or hang; FaultyBackend applies one to any backend.

A :class:`Fault` selects calls at one *point* (see :data:`POINTS`) by transfer tag and by count:

* ``direction`` / ``job_id``: match the ``tag=(direction, job_id)`` the call carries (for ``event_query`` and
  ``event_sync``: the tag the event was last recorded with). A selector that is set never matches an untagged
  call.
* ``nth``: 1-based index among the calls at that point that match the other selectors (a reused job id counts
  again each time); ``None`` = every match.

Kinds:

* ``"error"``: the call raises ``DeviceError(status)``. With ``sticky=True`` the device is lost: every later call
  at any fault point fails with the same status and nothing queued runs any more.
* ``"hang"`` (points ``event_query``, ``event_sync``, ``copy``, ``device_sync`` only): the selected transfer's work
  never completes. For the first three the selection happens when the transfer is *submitted*: its start
  record (on a stream other than a compute stream, a transfer's tagged records come in start/end pairs; a
  tagged record that does not close an open pair of its tag is a start), and ``nth`` counts matching
  submissions, a reused job id included; at ``device_sync`` it selects the proof call.

Release points (:data:`RELEASE_POINTS`: ``destroy`` = ``destroy_stream``/``destroy_event``, ``free`` =
``free_descriptors``, ``unmap`` = ``untrack_host``) take errors only; their calls are untagged, so only a fault
without ``direction`` and ``job_id`` selects them. A batched release (``destroy_events``, ``free_descriptors_many``)
is one call per item. Unlike every other point, a lost device does not fail them.

``plan.fired`` lists, in order, the faults that actually fired, so a test can assert its scenario happened.

:class:`FaultyBackend` applies a plan to any backend (a real GPU included). Errors are raised before the call
reaches the inner backend, so they leave no trace there. Hangs are emulated above the device: the selected
transfer's stream is marked hung (its later copies are not forwarded), an event recorded on a hung stream is hung
(queries say pending forever, a blocking synchronize gives up with ``SimHang`` after a horizon), and a stream that
waits on a hung event is hung in turn -- the same observable behaviour as the simulated device's hang ops.
It is thread-safe: each call's bookkeeping and its forwarding are atomic under one lock, except blocking waits
(``synchronize``, ``sleep``, ``prove_idle``), which hold no lock while they wait. Like the sim it has an
``on_call`` hook, called at the start of every call before any lock is taken.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends import batched
from kvoffload_ref.backends.base import (
    Backend,
    CallHook,
    DescriptorBuffer,
    Event,
    FaultPoint,
    Ledger,
    Stream,
    Tag,
    TensorGeometry,
    give_up_past_horizon,
    poll_until,
    record_and_poll,
)
from kvoffload_ref.errors import (
    CUDA_ERROR_LAUNCH_FAILED,
    CUDA_ERROR_NOT_READY,
    DeviceError,
    InvalidTransferError,
    SimHang,
)
from kvoffload_ref.validate import check_int, check_positive

__all__ = ["HANG_POINTS", "POINTS", "RELEASE_POINTS", "Fault", "FaultKind", "FaultPlan", "FaultPoint", "FaultyBackend"]

FaultKind = Literal["error", "hang"]
T = TypeVar("T")

POINTS: Final[tuple[FaultPoint, ...]] = (
    "event_query", "event_sync", "copy", "device_sync", "host_register", "host_unregister",
    "stream_create", "event_create", "descriptor_alloc", "destroy", "free", "unmap",
)
#: The release points (besides ``host_unregister``): ``destroy_stream``/``destroy_event(s)``, ``free_descriptors``
#: (``_many``) and ``untrack_host`` (a region's unmap). An error there is a failed release step: the resource stays
#: live on the device, for the library to mark leaked (R16). A lost device does not fail them (R3: releasing goes
#: on); only an error fault that selects the call does.
RELEASE_POINTS: Final[tuple[FaultPoint, ...]] = ("destroy", "free", "unmap")
#: Points where a hang can be injected; the first three select a transfer at submission.
HANG_POINTS: Final[tuple[FaultPoint, ...]] = ("event_query", "event_sync", "copy", "device_sync")
TRANSFER_HANG_POINTS: Final[tuple[FaultPoint, ...]] = ("event_query", "event_sync", "copy")


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected failure. See the module docstring for the selection rules.

    Attributes:
        point: where (one of :data:`POINTS`).
        kind: ``"error"`` or ``"hang"``.
        direction: None (any), ``"store"`` or ``"load"``.
        job_id: None (any) or an int (numpy ints are stored as Python ints; any size: it is only compared).
        nth: None (every match) or an int >= 1.
        sticky: a bool: the device is lost once this error fires.
        status: the ``DeviceError`` status, an int >= 0.

    Raises:
        InvalidTransferError: (a ValueError) an unknown point or kind, a hang at a point that cannot hang, a
            sticky hang, a direction other than None, "store" or "load", a ``job_id`` that is not None or an int,
            an ``nth`` that is not None or an int >= 1, a ``sticky`` that is not a bool, or a ``status`` that is
            not an int >= 0 (a bool, a float or a string is refused: ``job_id=True`` would select job 1, and
            ``nth=1.5`` would never fire) (R7).
    """

    point: FaultPoint
    kind: FaultKind = "error"
    direction: str | None = None
    job_id: int | None = None
    nth: int | None = None
    sticky: bool = False
    status: int = CUDA_ERROR_LAUNCH_FAILED

    def __post_init__(self) -> None:
        if not isinstance(self.point, str) or self.point not in POINTS:
            raise InvalidTransferError(f"unknown fault point {self.point!r}; expected one of {POINTS}")
        if not isinstance(self.kind, str) or self.kind not in ("error", "hang"):
            raise InvalidTransferError(f"unknown fault kind {self.kind!r}; expected 'error' or 'hang'")
        if self.direction is not None and (not isinstance(self.direction, str)
                                           or self.direction not in ("store", "load")):
            raise InvalidTransferError(f"direction must be None, 'store' or 'load', got {self.direction!r}")
        if not isinstance(self.sticky, bool):
            raise InvalidTransferError(f"sticky must be a bool, got {type(self.sticky).__name__} {self.sticky!r}")
        if self.kind == "hang" and self.point not in HANG_POINTS:
            raise InvalidTransferError(f"a hang cannot be injected at {self.point!r}; only at {HANG_POINTS}")
        if self.kind == "hang" and self.sticky:
            raise InvalidTransferError("sticky applies to errors only")
        if self.job_id is not None:
            object.__setattr__(self, "job_id", check_int("Fault.job_id", self.job_id))
        if self.nth is not None:
            if isinstance(self.nth, (int, np.integer)) and not isinstance(self.nth, bool) and self.nth < 1:
                raise InvalidTransferError(f"Fault.nth is 1-based: expected None or an int >= 1, got {self.nth}")
            object.__setattr__(self, "nth", check_int("Fault.nth", self.nth, minimum=1))
        object.__setattr__(self, "status", check_int("Fault.status", self.status, minimum=0))

    def matches(self, tag: Tag | None) -> bool:
        """Whether a call carrying ``tag`` is selected by this fault's direction/job_id selectors."""
        if self.direction is None and self.job_id is None:
            return True
        if tag is None:
            return False
        direction, job_id = tag
        return (self.direction is None or self.direction == direction) and (
            self.job_id is None or self.job_id == job_id
        )

    def __repr__(self) -> str:
        fields = [repr(self.point), repr(self.kind)]
        fields += [f"{name}={value!r}" for name in ("direction", "job_id", "nth")
                   if (value := getattr(self, name)) is not None]
        if self.sticky:
            fields.append("sticky=True")
        if self.status != CUDA_ERROR_LAUNCH_FAILED:
            fields.append(f"status={self.status!r}")
        return f"Fault({', '.join(fields)})"


class FaultPlan:
    """A list of faults and the counters that decide when each fires. Thread-safe.

    Backends call :meth:`check` at every fault point, :meth:`select_hang` when a transfer is submitted, and
    :meth:`lost` to learn whether a sticky error has fired.
    """

    def __init__(self, faults: Iterable[Fault] = ()) -> None:
        # Invariant: faults only grows, through add() (a plan can be shared and printed); never reordered.
        self.faults: tuple[Fault, ...] = tuple(faults)
        # Invariant: _counts[i] = number of calls so far that matched faults[i]'s point and selectors.
        self._counts = [0] * len(self.faults)
        # Invariant: the faults that fired, in firing order (a fault firing on every match appears each time).
        self.fired: list[Fault] = []
        # Invariant: once set, the sticky fault that lost the device; every later fault-point call fails.
        self._lost: Fault | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FaultPlan([{', '.join(map(repr, self.faults))}])"

    def add(self, fault: Fault) -> None:
        """Arm one more fault, e.g. in the middle of a run. Thread-safe.

        The new fault's ``nth`` counts the matching calls made from now on (earlier calls are not counted), and a
        hang fault at a transfer point can only select transfers submitted from now on.

        Raises:
            TypeError: ``fault`` is not a :class:`Fault`.
        """
        if not isinstance(fault, Fault):
            raise TypeError(f"expected a Fault, got {type(fault).__name__}")
        with self._lock:
            self.faults = (*self.faults, fault)
            self._counts.append(0)

    def lost(self) -> Fault | None:
        """The sticky fault that lost the device, or None."""
        with self._lock:
            return self._lost

    def check(self, point: FaultPoint, tag: Tag | None = None) -> None:
        """Count one call at ``point`` and raise if an error fault selects it (or the device is lost).

        Hang faults at transfer points are not consulted here (see :meth:`select_hang`).

        Raises:
            DeviceError: an error fault fired, or a sticky fault lost the device earlier.
        """
        fault = self._select(point, tag, kinds=("error",))
        if fault is not None:
            what = "device lost: " if fault.sticky else ""
            raise DeviceError(f"{what}injected {point} failure (tag {tag}, {fault!r})", fault.status)

    def check_release(self, point: FaultPoint) -> None:
        """Count one untagged call at a release point (:data:`RELEASE_POINTS`) and raise if an error fault selects
        it. A lost device does not fail it.

        Raises:
            DeviceError: an error fault fired.
        """
        fault = self._select(point, None, kinds=("error",), consult_lost=False)
        if fault is not None:
            what = "device lost: " if fault.sticky else ""
            raise DeviceError(f"{what}injected {point} failure ({fault!r})", fault.status)

    def armed(self, point: FaultPoint) -> bool:
        """Whether any fault is armed at ``point`` (a batched call takes its one-pass path when none is)."""
        return any(fault.point == point for fault in self.faults)

    def check_hang(self, point: FaultPoint, tag: Tag | None = None) -> bool:
        """Count one call at ``point`` against hang faults (used for ``device_sync``); True if one fires.

        Raises:
            DeviceError: the device is lost.
        """
        self._raise_if_lost(point, tag)
        return self._select(point, tag, kinds=("hang",), consult_lost=False) is not None

    def select_hang(self, tag: Tag | None) -> Fault | None:
        """Called once when a transfer is submitted: the hang fault that selects it, if any."""
        hits = [self._select(point, tag, kinds=("hang",), consult_lost=False) for point in TRANSFER_HANG_POINTS]
        return next((fault for fault in hits if fault is not None), None)  # every point counts the call

    def _raise_if_lost(self, point: FaultPoint, tag: Tag | None) -> None:
        lost = self.lost()
        if lost is not None:
            raise DeviceError(f"device lost earlier ({lost!r}); {point} failed (tag {tag})", lost.status)

    def _select(self, point: FaultPoint, tag: Tag | None, *, kinds: tuple[FaultKind, ...],
                consult_lost: bool = True) -> Fault | None:
        if consult_lost:
            self._raise_if_lost(point, tag)
        with self._lock:
            chosen: Fault | None = None
            for i, fault in enumerate(self.faults):
                if fault.point != point or fault.kind not in kinds or not fault.matches(tag):
                    continue
                self._counts[i] += 1
                if chosen is None and (fault.nth is None or fault.nth == self._counts[i]):
                    chosen = fault
            if chosen is not None:
                self.fired.append(chosen)
                if chosen.sticky:
                    self._lost = chosen
            return chosen


class FaultyBackend:
    """Any backend, with a :class:`FaultPlan` applied at the same points and with the same kinds as the sim's.

    Handles are the inner backend's own (so ledger keys match); the wrapper keeps, per live handle, the tag of
    an event's latest record and which streams and events are hung. Everything that is not a fault point is
    delegated unchanged, except that while the plan reports the device lost, non-release calls raise too.

    Args:
        inner, plan: the backend to wrap, and the faults to inject.
        hang_horizon: seconds (on the inner clock) a blocking ``synchronize`` of hung work, or a wait without a
            timeout (``check_unbounded_wait``), waits before it raises ``SimHang``: a finite number > 0.

    Raises:
        InvalidTransferError: (a ValueError) ``hang_horizon`` is not a finite number > 0 (R7).

    Attributes:
        inner: the wrapped backend.
        plan: the fault plan.
        on_call: None, or ``on_call(point, tag)``, called at the start of every call (before any lock), with the
            point names of :data:`~kvoffload_ref.backends.base.CALL_POINTS`.
    """

    def __init__(self, inner: Backend, plan: FaultPlan, *, hang_horizon: float = 3600.0) -> None:
        horizon = check_positive("hang_horizon", hang_horizon, unit="seconds")
        self.inner, self.plan, self._horizon = inner, plan, horizon
        self.name: str = f"faulty({inner.name})"
        self.on_call: CallHook | None = None
        # Invariant: guards the fields below and makes each non-blocking call (bookkeeping plus the forwarded
        # inner call) atomic; never held across a blocking wait or the on_call hook. Reentrant: record_and_poll.
        self._lock = threading.RLock()
        # Invariant: id() of each live stream that is hung (selected by a hang, or waited on a hung event), and of
        # each live event whose latest record was made on a hung stream.
        self._hung_streams: set[int] = set()
        self._hung_events: set[int] = set()
        # Invariant: id() of each live event recorded at least once -> the tag of its latest record.
        self._event_tags: dict[int, Tag | None] = {}
        # Invariant: id() of each live stream -> the tag of the transfer whose start was recorded on it and whose
        # end was not yet (the start was offered to FaultPlan.select_hang).
        self._hang_tags: dict[int, Tag] = {}
        # Invariant: id() of every stream current_stream()/compute_stream() returned (never offered to hangs).
        self._compute_ids: set[int] = set()

    def __repr__(self) -> str:
        return f"<FaultyBackend over {self.inner!r} with {self.plan!r}>"

    @property
    def ledger(self) -> Ledger:
        """The inner backend's ledger."""
        return self.inner.ledger

    @property
    def hang_horizon(self) -> float:
        """Backend seconds after which a wait without a bound on hung work gives up with SimHang."""
        return self._horizon

    @property
    def pageable_copies_block(self) -> bool:
        """The inner backend's (a copy to or from pageable host memory blocks the host there, R11)."""
        return bool(getattr(self.inner, "pageable_copies_block", False))

    def check_unbounded_wait(self, started: float, now: float, what: str) -> None:
        """SimHang once a wait without a timeout outlived :attr:`hang_horizon` (no hook, no inner call)."""
        give_up_past_horizon(self._horizon, started, now, what)

    # -- memory: delegated ------------------------------------------------------------------------------------

    def empty_device(self, shape: tuple[int, int]) -> object:
        """Delegated (raises DeviceError while the device is lost)."""
        self._check_alive("empty_device")
        return self.inner.empty_device(shape)

    def from_host(self, array: npt.NDArray[np.uint8]) -> object:
        """Delegated (raises DeviceError while the device is lost)."""
        self._check_alive("from_host")
        return self.inner.from_host(array)

    def to_host(self, array: object) -> npt.NDArray[np.uint8]:
        """Delegated (raises DeviceError while the device is lost)."""
        self._check_alive("to_host")
        return self.inner.to_host(array)

    def array_info(self, array: object) -> TensorGeometry:
        """Delegated."""
        self._hook("array_info")
        return self.inner.array_info(array)

    def track_host(self, ptr: int, nbytes: int) -> None:
        """Delegated."""
        self._hook("track_host")
        self.inner.track_host(ptr, nbytes)

    def untrack_host(self, ptr: int) -> None:
        """Fault point ``unmap``, then delegated.

        Raises:
            DeviceError: an injected fault (the mapping stays announced), or the inner backend's error.
        """
        self._hook("untrack_host")
        self.plan.check_release("unmap")
        self.inner.untrack_host(ptr)

    def host_register(self, ptr: int, nbytes: int) -> None:
        """Fault point ``host_register``, then delegated.

        Raises:
            DeviceError: an injected fault, a lost device, or the inner backend's error.
        """
        self._fault_point("host_register")
        self.inner.host_register(ptr, nbytes)

    def host_unregister(self, ptr: int) -> None:
        """Fault point ``host_unregister``, then delegated.

        Raises:
            DeviceError: an injected fault (the range stays pinned), a lost device, or the inner error.
        """
        self._fault_point("host_unregister")
        self.inner.host_unregister(ptr)

    def alloc_descriptors(self, capacity: int, *, tag: Tag | None = None) -> DescriptorBuffer:
        """Fault point ``descriptor_alloc``, then delegated.

        Raises:
            DeviceError: an injected fault, a lost device, or the inner backend's error.
        """
        self._fault_point("descriptor_alloc", tag)
        return self.inner.alloc_descriptors(capacity, tag=tag)

    def free_descriptors(self, buf: DescriptorBuffer) -> None:
        """Fault point ``free``, then delegated.

        Raises:
            DeviceError: an injected fault (the buffer stays allocated), or the inner backend's error.
        """
        self._hook("free_descriptors")
        self.plan.check_release("free")
        self.inner.free_descriptors(buf)

    def free_descriptors_many(self, bufs: Sequence[DescriptorBuffer]) -> None:
        """Fault point ``free`` once per buffer; the others are delegated, then the first injected error raised.

        Raises:
            DeviceError: an injected fault (those buffers stay allocated), or the inner backend's error.
        """
        self._hook("free_descriptors")
        kept, failed = self._release_checks("free", bufs)
        batched.free_descriptors_many(self.inner, kept)
        if failed is not None:
            raise failed

    # -- streams and events -----------------------------------------------------------------------------------

    def current_stream(self) -> Stream:
        """Delegated (the stream is never offered to hang selection)."""
        self._hook("current_stream")
        with self._lock:
            stream = self.inner.current_stream()
            self._compute_ids.add(id(stream))
            return stream

    def compute_stream(self, stream: object | None = None) -> Stream:
        """Delegated (the stream is never offered to hang selection).

        Raises:
            InvalidTransferError: the inner backend refuses ``stream``.
        """
        self._hook("compute_stream")
        with self._lock:
            resolved = self.inner.compute_stream(stream)
            self._compute_ids.add(id(resolved))
            return resolved

    def create_stream(self, *, tag: Tag | None = None) -> Stream:
        """Fault point ``stream_create``, then delegated.

        Raises:
            DeviceError: an injected fault, a lost device, or the inner backend's error.
        """
        self._fault_point("stream_create", tag)
        return self.inner.create_stream(tag=tag)

    def destroy_stream(self, stream: Stream) -> None:
        """Fault point ``destroy``, then delegated; forgets the stream's hang.

        Raises:
            DeviceError: an injected fault (the stream stays), or the inner backend's error.
        """
        self._hook("destroy_stream")
        self.plan.check_release("destroy")
        with self._lock:
            self._hung_streams.discard(id(stream))
            self._hang_tags.pop(id(stream), None)
            self.inner.destroy_stream(stream)

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Delegated; waiting on a hung event hangs the stream.

        Raises:
            DeviceError: a lost device, or the inner backend's error.
        """
        self._check_alive("wait_event")
        with self._lock:
            self.inner.wait_event(stream, event)
            if id(event) in self._hung_events:
                self._hung_streams.add(id(stream))

    def create_event(self, *, tag: Tag | None = None) -> Event:
        """Fault point ``event_create``, then delegated.

        Raises:
            DeviceError: an injected fault, a lost device, or the inner backend's error.
        """
        self._fault_point("event_create", tag)
        return self.inner.create_event(tag=tag)

    def destroy_event(self, event: Event) -> None:
        """Fault point ``destroy``, then delegated; forgets the event's tag and hang.

        Raises:
            DeviceError: an injected fault (the event stays), or the inner backend's error.
        """
        self._hook("destroy_event")
        self.plan.check_release("destroy")
        self._destroy_event(event)

    def _destroy_event(self, event: Event) -> None:
        """Forget the event's tag and hang, then destroy it on the inner backend (no fault point: the proof's)."""
        with self._lock:
            self._hung_events.discard(id(event))
            self._event_tags.pop(id(event), None)
            self.inner.destroy_event(event)

    def destroy_events(self, events: Sequence[Event]) -> None:
        """Fault point ``destroy`` once per event; the others are delegated (their tags and hangs forgotten), then
        the first injected error raised.

        Raises:
            DeviceError: an injected fault (those events stay), or the inner backend's error.
        """
        self._hook("destroy_event")
        kept, failed = self._release_checks("destroy", events)
        with self._lock:
            for event in kept:
                self._hung_events.discard(id(event))
                self._event_tags.pop(id(event), None)
            batched.destroy_events(self.inner, kept)
        if failed is not None:
            raise failed

    def record(self, event: Event, stream: Stream, *, tag: Tag | None = None) -> None:
        """Delegated. The event is hung if the stream is. A transfer is submitted at its start record (see the
        module docstring): that record offers it to ``FaultPlan.select_hang`` (a reused job id is offered again)
        and, if selected, hangs the stream right after this record.

        Raises:
            DeviceError: a lost device, or the inner backend's error.
        """
        self._check_alive("record", tag)
        with self._lock:
            self.inner.record(event, stream, tag=tag)
            self._event_tags[id(event)] = tag
            if id(stream) in self._hung_streams:
                self._hung_events.add(id(event))
            else:
                self._hung_events.discard(id(event))
            if self._selects_hang(stream, tag):
                self._hung_streams.add(id(stream))

    def query_prefix(self, events: Sequence[Event]) -> int:
        """Delegated when nothing here is instrumented; else 0: every query goes through ``query`` (its faults,
        hangs and hook keep their per-call meaning)."""
        if self.on_call is not None or self.plan.faults or self._hung_events:
            return 0
        return batched.query_prefix(self.inner, events)

    def query(self, event: Event) -> bool:
        """Fault point ``event_query`` (matched on the event's tag); False forever for a hung event.

        Raises:
            DeviceError: an injected fault, a lost device, or the inner backend's error.
        """
        tag = self._tag_of(event)
        self._fault_point("event_query", tag)
        if self._is_hung(event):
            return False
        return self.inner.query(event)

    def synchronize(self, event: Event) -> None:
        """Fault point ``event_sync``; for a hung event, sleeps out the horizon and raises SimHang.

        Raises:
            DeviceError: an injected fault, a lost device, or the inner backend's error.
            SimHang: the event is hung.
        """
        tag = self._tag_of(event)
        self._fault_point("event_sync", tag)
        if not self._is_hung(event):
            self.inner.synchronize(event)
            return
        deadline = self.inner.monotonic() + self._horizon
        while (left := deadline - self.inner.monotonic()) > 0:
            self.inner.sleep(min(left, 1.0))
        raise SimHang(f"synchronize({event!r}): hung work did not complete within {self._horizon} s")

    def elapsed(self, start: Event, end: Event) -> float:
        """Delegated; DeviceError(600) if either event is hung.

        Raises:
            DeviceError: a hung event (600), a lost device, or the inner backend's error.
        """
        self._check_alive("elapsed", self._tag_of(end))
        if self._is_hung(start) or self._is_hung(end):
            raise DeviceError("elapsed: an event has not completed (hung)", CUDA_ERROR_NOT_READY)
        return self.inner.elapsed(start, end)

    # -- copies, clock, proof ---------------------------------------------------------------------------------

    def copy_batch(self, stream: Stream, buf: DescriptorBuffer, count: int, *, tag: Tag | None = None) -> None:
        """Fault point ``copy``, then delegated -- unless the stream is hung: hung work never runs, so the copy
        is not forwarded.

        Raises:
            DeviceError: an injected fault, a lost device, or the inner backend's error.
        """
        self._fault_point("copy", tag)
        with self._lock:
            if id(stream) not in self._hung_streams:
                self.inner.copy_batch(stream, buf, count, tag=tag)

    def monotonic(self) -> float:
        """Delegated."""
        self._hook("monotonic")
        return self.inner.monotonic()

    def sleep(self, seconds: float) -> None:
        """Delegated (no lock held)."""
        self._hook("sleep")
        self.inner.sleep(seconds)

    def prove_idle(self, streams: Sequence[Stream], deadline: float) -> bool:
        """Fault point ``device_sync``; then the generic proof through this wrapper (fresh events on ``streams``
        only), so fresh events recorded on hung streams never complete. Under a ``device_sync`` hang, polls
        until the deadline and returns False. Holds no lock while it polls.

        Raises:
            DeviceError: an injected fault, a lost device, or the inner backend's error.
        """
        self._hook("device_sync")
        hang = self.plan.check_hang("device_sync")   # as the sim: both kinds count the call; an error wins
        self.plan.check("device_sync")
        if hang:
            poll_until(self, lambda: False, deadline)
            return False
        return record_and_poll(self, streams, deadline, destroy=self._destroy_proof_event)

    def _destroy_proof_event(self, event: Event) -> None:
        """destroy_event for the proof's own events: the hook sees it; no fault point (not a library release)."""
        self._hook("destroy_event")
        self._destroy_event(event)

    # -- internals --------------------------------------------------------------------------------------------

    def _hook(self, point: str, tag: Tag | None = None) -> None:
        hook = self.on_call
        if hook is not None:
            hook(point, tag)

    def _fault_point(self, point: FaultPoint, tag: Tag | None = None) -> None:
        """The start of a call at fault point ``point``: the hook, then ``plan.check`` (DeviceError)."""
        self._hook(point, tag)
        self.plan.check(point, tag)

    def _release_checks(self, point: FaultPoint, items: Sequence[T]) -> tuple[Sequence[T], DeviceError | None]:
        """One release-point check per item: (the items no fault selected, the first injected error or None)."""
        if not self.plan.armed(point):
            return items, None
        kept: list[T] = []
        failed: DeviceError | None = None
        for item in items:
            try:
                self.plan.check_release(point)
            except DeviceError as exc:
                failed = failed or exc
                continue
            kept.append(item)
        return kept, failed

    def _check_alive(self, point: str, tag: Tag | None = None) -> None:
        """The start of a delegated call that fails while the device is lost: the hook, then that check."""
        self._hook(point, tag)
        lost = self.plan.lost()
        if lost is not None:
            raise DeviceError(f"device lost earlier ({lost!r})", lost.status)

    def _tag_of(self, event: Event) -> Tag | None:
        with self._lock:
            return self._event_tags.get(id(event))

    def _is_hung(self, event: Event) -> bool:
        with self._lock:
            return id(event) in self._hung_events

    def _selects_hang(self, stream: Stream, tag: Tag | None) -> bool:
        """Called with the lock held: whether this tagged record submits a transfer a hang selects."""
        key = id(stream)
        if tag is None or key in self._compute_ids:
            return False
        if self._hang_tags.get(key) == tag:   # the transfer's end record closes its pair
            del self._hang_tags[key]
            return False
        if stream == self.inner.current_stream():
            self._compute_ids.add(key)
            return False
        self._hang_tags[key] = tag
        return self.plan.select_hang(tag) is not None


if TYPE_CHECKING:
    def _conforms(backend: FaultyBackend) -> Backend:   # mypy checks that FaultyBackend satisfies the protocol
        return backend
