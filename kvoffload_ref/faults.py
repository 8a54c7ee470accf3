"""Fault injection: a FaultPlan says which backend calls fail or hang; FaultyBackend applies one to any backend.

The plan -- :class:`Fault`, :class:`FaultPlan`, the fault points (:data:`POINTS`, :data:`RELEASE_POINTS`,
:data:`HANG_POINTS`) and their selection rules and kinds -- is in :mod:`kvoffload_ref.fault_plan`, re-exported
here.

:class:`FaultyBackend` applies a plan to any backend (a real GPU included). Errors are raised before the call
reaches the inner backend, so they leave no trace there. Hangs are emulated above the device: the selected
transfer's stream is marked hung (its later copies are not forwarded), an event recorded on a hung stream is hung
(queries say pending forever, a blocking synchronize gives up with ``SimHang`` after a horizon), and a stream that
waits on a hung event is hung in turn -- the same observable behaviour as the simulated device's hang ops.

Slow faults and ending a hang are the simulated device's only (``SimBackend.end_hangs``): this hang model has no
equivalent. A hung stream's copies are dropped, never forwarded, while its records were forwarded and have
completed on the inner device in the wrong order (before the copies), so nothing can later make the late copy
land and its end event complete after it; replaying would need every op on a hung stream (and on the streams
that waited on it) buffered and re-issued in order, with their descriptors as they were. A plan holding a slow
fault is refused; one armed later (``plan.add``) never fires here (``select_hang`` is asked for hangs only).
It is thread-safe: each call's bookkeeping and its forwarding are atomic under one lock, except blocking waits
(``synchronize``, ``sleep``, ``prove_idle``), which hold no lock while they wait. Like the sim it has an
``on_call`` hook, called at the start of every call before any lock is taken.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends import batched, pinned
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
    poll_pause,
    poll_until,
    record_and_poll,
)
from kvoffload_ref.errors import CUDA_ERROR_NOT_READY, DeviceError, InvalidTransferError, SimHang
from kvoffload_ref.fault_plan import HANG_POINTS, POINTS, RELEASE_POINTS, Fault, FaultKind, FaultPlan
from kvoffload_ref.validate import check_positive

__all__ = ["HANG_POINTS", "POINTS", "RELEASE_POINTS", "Fault", "FaultKind", "FaultPlan", "FaultPoint", "FaultyBackend"]

T = TypeVar("T")


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
        InvalidTransferError: (a ValueError) ``hang_horizon`` is not a finite number > 0 (R7), or the plan holds a
            ``"slow"`` fault (not applied here: see the module docstring).

    Attributes:
        inner: the wrapped backend.
        plan: the fault plan.
        on_call: None, or ``on_call(point, tag)``, called at the start of every call (before any lock), with the
            point names of :data:`~kvoffload_ref.backends.base.CALL_POINTS`.
    """

    def __init__(self, inner: Backend, plan: FaultPlan, *, hang_horizon: float = 3600.0) -> None:
        horizon = check_positive("hang_horizon", hang_horizon, unit="seconds")
        slow = [fault for fault in plan.faults if fault.kind == "slow"]
        if slow:
            raise InvalidTransferError(f"FaultyBackend cannot apply slow faults (the simulated device can): {slow}")
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

    @property
    def refuses_registration(self) -> bool:
        """The inner backend's (its platform refuses host registration, ``backends.pinned``)."""
        return pinned.refuses_registration(self.inner)

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

    def untrack_host_pages(self, ptr: int, nbytes: int) -> None:
        """Fault point ``unmap``, then delegated when the inner backend models a page-granular unmap (R29);
        else nothing more (the inner backend keeps the mapping announced whole).

        Raises:
            DeviceError: an injected fault (the pages stay announced), or the inner backend's error.
        """
        self._hook("untrack_host")
        self.plan.check_release("unmap")
        inner = getattr(self.inner, "untrack_host_pages", None)
        if inner is not None:
            inner(ptr, nbytes)

    def host_register(self, ptr: int, nbytes: int) -> None:
        """Fault point ``host_register``, then delegated.

        Raises:
            DeviceError: an injected fault, a lost device, or the inner backend's error.
        """
        self._fault_point("host_register")
        self.inner.host_register(ptr, nbytes)

    def alloc_pinned(self, nbytes: int) -> tuple[int, npt.NDArray[np.uint8]]:
        """Delegated (``backends.pinned``; raises DeviceError while the device is lost, or where the inner
        backend cannot allocate pinned memory).

        Raises:
            DeviceError: a lost device, or the inner backend's error.
        """
        self._check_alive("alloc_pinned")
        return pinned.alloc_pinned(self.inner, nbytes)

    def free_pinned(self, ptr: int) -> None:
        """Fault point ``unmap`` (the memory is given back), then delegated.

        Raises:
            DeviceError: an injected fault (the allocation stays), or the inner backend's error.
        """
        self._hook("free_pinned")
        self.plan.check_release("unmap")
        pinned.free_pinned(self.inner, ptr)

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

    def poll_sleep(self, seconds: float, *, to_tail: bool = False) -> None:
        """The pause between two polls (``polling.poll_pause``), delegated: the inner backend's ``poll_sleep`` where
        it has one (the sim's ends at the next completion its queries found pending; a hung event here is never
        queried there, so its pause applies in full), else its ``sleep``. Reported to the hook as ``"sleep"``."""
        self._hook("sleep")
        poll_pause(self.inner, seconds, to_tail=to_tail)

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
        return self.plan.select_hang(tag, ("hang",)) is not None   # slow faults: not applied here (docstring)


if TYPE_CHECKING:
    def _conforms(backend: FaultyBackend) -> Backend:   # mypy checks that FaultyBackend satisfies the protocol
        return backend
