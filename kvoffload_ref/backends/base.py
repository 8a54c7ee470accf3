"""The Backend protocol every device implements, and the Ledger of what the library acquired (R16).

A backend is a thin, synchronous facade over one device: memory, streams, events, batched copies, a clock and
the device-level proof of idleness (R13). The simulated device (``sim.py``) and the CuPy device (``cupy.py``)
implement it; ``faults.FaultyBackend`` wraps any of them to inject failures.

Handles (streams, events) are opaque: only the backend that made one may use it. Every call that acts for one
transfer takes ``tag=(direction, job_id)`` so faults can select a transfer and error messages can name it.

The polling helpers (``Backoff``, ``poll_pause``, ``poll_until``, ``wait_polling``, ``record_and_poll``, the
``POLL_*`` pauses) live in ``polling.py`` and are re-exported here.

Nothing here knows about handlers, regions or workers.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Final, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.polling import (
    POLL_FIRST_SLEEP,
    POLL_MAX_SLEEP,
    Backoff,
    poll_pause,
    poll_until,
    record_and_poll,
    wait_polling,
)
from kvoffload_ref.errors import LifecycleError, SimHang
from kvoffload_ref.specs import TensorGeometry

__all__ = [
    "POLL_FIRST_SLEEP",
    "POLL_MAX_SLEEP",
    "RESOURCE_KINDS",
    "CALL_POINTS",
    "CONSULTED",
    "Backend",
    "Backoff",
    "CallHook",
    "DescriptorBuffer",
    "Event",
    "FaultPoint",
    "FaultSource",
    "Ledger",
    "LostFault",
    "ResourceKind",
    "StallFault",
    "Stream",
    "Tag",
    "TensorGeometry",
    "give_up_past_horizon",
    "poll_pause",
    "poll_until",
    "record_and_poll",
    "wait_polling",
]

#: ``(direction, job_id)``; direction is ``"store"`` or ``"load"``.
Tag = tuple[str, int]

#: The backend calls where a fault can be injected (``faults.Fault``); see ``faults.py`` for their meaning.
FaultPoint = Literal[
    "event_query", "event_sync", "copy", "device_sync", "host_register", "host_unregister",
    "stream_create", "event_create", "descriptor_alloc", "destroy", "free", "unmap",
]

#: The point name each backend method reports to an ``on_call`` hook: a fault point's name where the method is
#: one (``copy_batch`` -> ``"copy"``, ``query`` -> ``"event_query"``, ``synchronize`` -> ``"event_sync"``,
#: ``prove_idle`` -> ``"device_sync"``, ``create_stream`` -> ``"stream_create"``, ``create_event`` ->
#: ``"event_create"``, ``alloc_descriptors`` -> ``"descriptor_alloc"``, ``host_register``, ``host_unregister``),
#: else the method's own name (the release calls keep theirs: ``destroy_stream``/``destroy_event`` are the fault point
#: ``"destroy"``, ``free_descriptors`` is ``"free"``, ``untrack_host`` is ``"unmap"``); ``poll_sleep``, a wait's
#: pause between polls, reports ``"sleep"`` as the sleep it stands for.
CALL_POINTS: Final[dict[str, str]] = {
    "destroy_events": "destroy_event", "free_descriptors_many": "free_descriptors",
    "query_prefix": "event_query",
    "copy_batch": "copy", "query": "event_query", "synchronize": "event_sync", "prove_idle": "device_sync",
    "create_stream": "stream_create", "create_event": "event_create", "alloc_descriptors": "descriptor_alloc",
    "host_register": "host_register", "host_unregister": "host_unregister",
    "record": "record", "wait_event": "wait_event", "destroy_stream": "destroy_stream",
    "destroy_event": "destroy_event", "free_descriptors": "free_descriptors", "track_host": "track_host",
    "untrack_host": "untrack_host", "untrack_host_pages": "untrack_host",
    "current_stream": "current_stream", "compute_stream": "compute_stream",
    "elapsed": "elapsed", "monotonic": "monotonic", "sleep": "sleep", "poll_sleep": "sleep",
    "empty_device": "empty_device", "from_host": "from_host", "to_host": "to_host", "array_info": "array_info",
    "alloc_pinned": "alloc_pinned", "free_pinned": "free_pinned",
}

#: The fault point each ``on_call`` point consults (a point absent here consults none): the fault point of the same
#: name, and the release calls' shared ones (``destroy_stream``/``destroy_event`` -> ``"destroy"``,
#: ``free_descriptors`` -> ``"free"``, ``untrack_host``/``free_pinned`` -> ``"unmap"``).
CONSULTED: Final[dict[str, FaultPoint]] = {
    "event_query": "event_query", "event_sync": "event_sync", "copy": "copy", "device_sync": "device_sync",
    "host_register": "host_register", "host_unregister": "host_unregister", "stream_create": "stream_create",
    "event_create": "event_create", "descriptor_alloc": "descriptor_alloc", "destroy_stream": "destroy",
    "destroy_event": "destroy", "free_descriptors": "free", "untrack_host": "unmap", "free_pinned": "unmap",
}

#: ``on_call(point, tag)``: called at the start of a backend call, before the backend takes its lock.
CallHook = Callable[[str, "Tag | None"], None]

#: ``"pinned"``: a registered range of a mapping; ``"pinned_alloc"``: pinned host memory allocated directly
#: (``backends.pinned``, where registration is refused).
ResourceKind = Literal["stream", "event", "descriptor", "pinned", "mapping", "shm_file", "pinned_alloc"]
RESOURCE_KINDS: Final[tuple[ResourceKind, ...]] = (
    "stream", "event", "descriptor", "pinned", "mapping", "shm_file", "pinned_alloc",
)


class Stream(Protocol):
    """An opaque stream handle made by one backend."""


class Event(Protocol):
    """An opaque event handle made by one backend."""


class LostFault(Protocol):
    """What a backend needs of the fault that lost the device."""

    @property
    def status(self) -> int:
        """The CUDA-style status every later call fails with."""
        ...


class StallFault(Protocol):
    """What a backend needs of the fault that stalls a submitted transfer (a hang or a slow copy)."""

    @property
    def kind(self) -> str:
        """``"hang"`` (never ends by itself) or ``"slow"`` (ends after :attr:`duration`)."""
        ...

    @property
    def duration(self) -> float | None:
        """A slow fault's stall, in backend seconds; None for a hang."""
        ...


class FaultSource(Protocol):
    """What a backend asks of a fault plan (``faults.FaultPlan`` implements it): the simulated device depends
    on this protocol, not on ``faults.py``, so that no import circle joins them."""

    def check(self, point: FaultPoint, tag: Tag | None = None) -> None:
        """Count one call at ``point``; raise ``DeviceError`` if an error fault selects it or the device is lost."""
        ...

    def check_release(self, point: FaultPoint) -> None:
        """Count one untagged call at a release point; raise ``DeviceError`` if an error fault selects it (a lost
        device does not fail it)."""
        ...

    def armed(self, point: FaultPoint) -> bool:
        """Whether any fault is armed at ``point``."""
        ...

    def check_hang(self, point: FaultPoint, tag: Tag | None = None) -> bool:
        """Count one call at ``point`` against hang faults; True if one fires."""
        ...

    def select_hang(self, tag: Tag | None) -> StallFault | None:
        """Called once per submitted transfer: the hang or slow fault that selects it, if any."""
        ...

    def lost(self) -> LostFault | None:
        """The sticky fault that lost the device, or None."""
        ...


class DescriptorBuffer:
    """Host-visible arrays holding one transfer's copy descriptors (source, destination, size).

    The handler writes the first ``count`` entries, then passes the buffer to ``Backend.copy_batch``; the
    backend may read it until the copy completes, so the buffer is freed (or reused) only after that is proven.

    Attributes:
        capacity: number of descriptors it can hold.
        src, dst, sizes: int64 arrays of length ``capacity``.
        handle: the backend's own object for this buffer (opaque).
    """

    __slots__ = ("capacity", "dst", "handle", "sizes", "src")

    def __init__(self, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
                 sizes: npt.NDArray[np.int64], handle: object) -> None:
        # Invariant: src, dst and sizes have the same length, == capacity.
        self.capacity: int = int(src.shape[0])
        self.src = src
        self.dst = dst
        self.sizes = sizes
        self.handle = handle

    def fill(self, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
             sizes: npt.NDArray[np.int64]) -> int:
        """Copy a plan into the first entries; returns the number of descriptors written."""
        count = int(src.shape[0])
        self.src[:count] = src
        self.dst[:count] = dst
        self.sizes[:count] = sizes
        return count

    def __repr__(self) -> str:
        return f"<DescriptorBuffer capacity={self.capacity} at {id(self):#x}>"


class Ledger:
    """Every resource the library acquired through a backend, by kind, with its fate (R16).

    A resource is *live* from ``acquire`` until it is ``release``-d, ``quarantine``-d (kept alive on purpose
    because it may still be under DMA) or ``leak``-ed (a release step failed). ``live()`` therefore excludes
    quarantined and leaked resources, and the conservation law

        acquired == released + live + quarantined + leaked      (per kind)

    always holds. Thread-safe. User-allocated device arrays are not resources.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Invariant: per kind, each key ever acquired -> when it was first acquired (a global sequence number), in
        # that order; a key that is in none of the fate tables below is "released" (addresses get reused: a
        # released key may be acquired again).
        self._seen: dict[ResourceKind, dict[Hashable, int]] = {kind: {} for kind in RESOURCE_KINDS}
        # Invariant: per fate, per kind, the keys in that fate -> their first acquisition; a key is in at most one
        # fate table. One dict per (fate, kind), so that a transition is a pop and an insert keyed by the key
        # itself, and a batch of releases is one C-level pass.
        self._fates: dict[str, dict[ResourceKind, dict[Hashable, int]]] = {
            fate: {kind: {} for kind in RESOURCE_KINDS} for fate in ("live", "quarantined", "leaked")}
        self._live = self._fates["live"]
        # Invariant: from 1, so that a first acquisition is never falsy (release_many tells a popped None by it).
        self._sequence = itertools.count(1)
        # Invariant: running totals; acquired == released + (live + quarantined + leaked now), per kind.
        self._acquired: dict[ResourceKind, int] = dict.fromkeys(RESOURCE_KINDS, 0)
        self._released: dict[ResourceKind, int] = dict.fromkeys(RESOURCE_KINDS, 0)

    def acquire(self, kind: ResourceKind, key: Hashable) -> None:
        """Record a new live resource. Raises LifecycleError if the key is already live."""
        with self._lock:
            live = self._live[kind]
            if key in live or key in self._fates["quarantined"][kind]:
                raise LifecycleError(f"ledger: {kind} {key!r} acquired twice")
            seen = self._seen[kind]
            born = seen.get(key)
            if born is None:
                born = seen[key] = next(self._sequence)
            else:
                self._fates["leaked"][kind].pop(key, None)
            live[key] = born
            self._acquired[kind] += 1

    def release(self, kind: ResourceKind, key: Hashable) -> None:
        """Record that a live (or quarantined) resource was released. Raises LifecycleError otherwise."""
        with self._lock:
            if self._live[kind].pop(key, None) is None and self._fates["quarantined"][kind].pop(key, None) is None:
                raise LifecycleError(f"ledger: cannot mark {kind} {key!r} released: it is "
                                     f"{self._state(kind, key) or 'unknown'}")
            self._released[kind] += 1

    def release_many(self, kind: ResourceKind, keys: Iterable[Hashable]) -> None:
        """``release`` for many keys of one kind under one lock (a teardown releases thousands).

        Raises:
            LifecycleError: a key is neither live nor quarantined, or is named twice (the keys before it are
                released).
        """
        keys = keys if isinstance(keys, list) else list(keys)
        with self._lock:
            live = self._live[kind]
            popped = list(map(live.pop, keys, itertools.repeat(None)))
            if all(popped):  # the common case: every key live, none named twice (a first acquisition is >= 1)
                self._released[kind] += len(keys)
                return
            for key, born in zip(keys, popped, strict=True):  # a key not live or named twice: undo (the order of
                if born is not None:                          # a fate table is never read), then one by one
                    live[key] = born
            for key in keys:  # the slow path: one by one, up to the first bad key
                if live.pop(key, None) is None and self._fates["quarantined"][kind].pop(key, None) is None:
                    raise LifecycleError(f"ledger: cannot mark {kind} {key!r} released: it is "
                                         f"{self._state(kind, key) or 'unknown'}")
                self._released[kind] += 1

    def quarantine(self, kind: ResourceKind, key: Hashable) -> None:
        """Record that a live resource is kept alive on purpose until process exit."""
        self._move(kind, key, "quarantined")

    def leak(self, kind: ResourceKind, key: Hashable) -> None:
        """Record that releasing a live resource failed; it is no longer the library's to release."""
        self._move(kind, key, "leaked")

    def _move(self, kind: ResourceKind, key: Hashable, target: str) -> None:
        """A live resource's transition to ``target``."""
        with self._lock:
            born = self._live[kind].pop(key, None)
            if born is None:
                raise LifecycleError(f"ledger: cannot mark {kind} {key!r} {target}: it is "
                                     f"{self._state(kind, key) or 'unknown'}")
            self._fates[target][kind][key] = born

    def _state(self, kind: ResourceKind, key: Hashable) -> str | None:
        """The fate of one key (the caller holds the lock)."""
        for fate, tables in self._fates.items():
            if key in tables.get(kind, {}):
                return fate
        return "released" if key in self._seen.get(kind, {}) else None

    def state_of(self, kind: ResourceKind, key: Hashable) -> str | None:
        """The fate of one resource: "live", "released", "quarantined", "leaked", or None if never seen."""
        with self._lock:
            return self._state(kind, key)

    def live(self) -> dict[ResourceKind, int]:
        """Live resources by kind (kinds with none are omitted)."""
        return self._tally("live")

    def quarantined(self) -> dict[ResourceKind, int]:
        """Quarantined resources by kind (omitting zeros)."""
        return self._tally("quarantined")

    def leaked(self) -> dict[ResourceKind, int]:
        """Leaked resources by kind (omitting zeros)."""
        return self._tally("leaked")

    def acquired(self) -> dict[ResourceKind, int]:
        """Total acquisitions by kind, ever (omitting zeros)."""
        return self._nonzero(self._acquired)

    def released(self) -> dict[ResourceKind, int]:
        """Total releases by kind, ever (omitting zeros)."""
        return self._nonzero(self._released)

    def _tally(self, wanted: str) -> dict[ResourceKind, int]:
        """Resources in fate ``wanted`` by kind; kinds ordered by their first such resource's acquisition."""
        with self._lock:
            found = [(min(table.values()), kind, len(table)) for kind, table in self._fates[wanted].items() if table]
            return {kind: count for _, kind, count in sorted(found)}

    def _nonzero(self, counts: dict[ResourceKind, int]) -> dict[ResourceKind, int]:
        with self._lock:
            return {k: v for k, v in counts.items() if v}

    def keys(self, kind: ResourceKind, state: str = "live") -> Iterator[Hashable]:
        """The keys of one kind in one state (a snapshot), in the order of their first acquisition."""
        with self._lock:
            seen = self._seen.get(kind, {})
            if state == "released":
                return iter([k for k in seen if self._state(kind, k) == "released"])
            table = self._fates.get(state, {}).get(kind, {})
            return iter(sorted(table, key=table.__getitem__))


@runtime_checkable
class Backend(Protocol):
    """What a device must offer (docs/architecture.md, "The Backend protocol"; docs/backends.md).

    Every method may raise ``DeviceError`` (with a CUDA-style ``.status``) unless it says otherwise. A release call
    (``destroy_*``, ``free_descriptors``, ``untrack_host``, ``host_unregister``) that raises leaves its resource as
    it was: live in the ledger, which the library then marks leaked (R16) before it goes on with the next release
    step (R3, R9, R10). A batched release call (``destroy_events``, ``free_descriptors_many``) releases every item
    it can and raises the first failure once done; the items it could not release stay live.

    The batched calls a teardown or a drain of thousands of transfers wants (``destroy_events``,
    ``free_descriptors_many``, ``query_prefix``) are an optional extension: :class:`~kvoffload_ref.backends.
    batched.BatchedBackend`; callers go through :mod:`kvoffload_ref.backends.batched`, which falls back to one call
    each for a backend without them.

    ``untrack_host_pages(ptr, nbytes)`` is optional too: a backend that models a page-granular unmap of part of a
    tracked mapping (the sim) offers it; a quarantine by registration (R29) announces each unmapped piece through it
    where it exists, and the rest of the mapping stays tracked.

    ``poll_sleep(seconds, *, to_tail=False)`` is optional as well: the pause between two polls of a bounded wait,
    which a backend that knows when a poll's answer can change next may end early (the sim: at the next completion
    its queries found pending; with ``to_tail``, a drain's, at the last record queued on that stream), never late; it
    reports the ``on_call`` point ``"sleep"``. The polling helpers call it through ``polling.poll_pause``, which
    sleeps the pause (:meth:`sleep`) on a backend without it (a real clock).
    ``alloc_pinned``/``free_pinned`` (pinned host memory allocated directly, for a platform that refuses host
    registration) are optional as well: :class:`~kvoffload_ref.backends.pinned.PinnedAllocBackend`; the library
    calls them through :mod:`kvoffload_ref.backends.pinned`, which refuses with a ``DeviceError`` for a backend
    without them.
    """

    name: str

    @property
    def ledger(self) -> Ledger:
        """The resources the library acquired through this backend."""
        ...

    @property
    def hang_horizon(self) -> float | None:
        """Seconds (on :meth:`monotonic`) after which a wait without a timeout gives up on hung work, for a device
        that models hangs (the simulated one); None on a real device, whose waits have no such bound."""
        ...

    def check_unbounded_wait(self, started: float, now: float, what: str) -> None:
        """Called by a wait without a timeout each time it polled ``what`` and found it not done (``started`` and
        ``now`` on :meth:`monotonic`): raise this device's hang error once the wait outlived :attr:`hang_horizon`
        (the simulated device: :class:`~kvoffload_ref.errors.SimHang`). A real device never raises. Makes no
        other call and reports no ``on_call`` point (a pure check).
        """
        ...

    # -- device memory (the user's; not in the ledger) --------------------------------------------------------
    def empty_device(self, shape: tuple[int, int]) -> object:
        """A new 2-D uint8 device array (contents unspecified)."""
        ...

    def from_host(self, array: npt.NDArray[np.uint8]) -> object:
        """A new device array holding a copy of a 2-D uint8 host array (synchronous)."""
        ...

    def to_host(self, array: object) -> npt.NDArray[np.uint8]:
        """A host copy of a device array (synchronous; waits for the compute stream)."""
        ...

    def array_info(self, array: object) -> TensorGeometry:
        """Geometry of one of this backend's 2-D uint8 device arrays.

        Raises:
            InvalidTransferError: the object is not such an array of this backend.
        """
        ...

    # -- host memory ------------------------------------------------------------------------------------------
    def track_host(self, ptr: int, nbytes: int) -> None:
        """Announce a host mapping [ptr, ptr+nbytes) (ledger kind "mapping"). Never fails."""
        ...

    def untrack_host(self, ptr: int) -> None:
        """Announce that the mapping starting at ptr is about to be unmapped. May fail (the mapping then stays
        announced: leaked)."""
        ...

    def host_register(self, ptr: int, nbytes: int) -> None:
        """Pin [ptr, ptr+nbytes) of a tracked mapping (ledger kind "pinned", key ptr)."""
        ...

    def host_unregister(self, ptr: int) -> None:
        """Unpin the range registered at ptr. May fail (the range then stays pinned: leaked)."""
        ...

    # -- descriptor buffers -----------------------------------------------------------------------------------
    def alloc_descriptors(self, capacity: int, *, tag: Tag | None = None) -> DescriptorBuffer:
        """A descriptor buffer for ``capacity`` copies (ledger kind "descriptor")."""
        ...

    def free_descriptors(self, buf: DescriptorBuffer) -> None:
        """Free a descriptor buffer. May fail (the buffer then stays allocated: leaked)."""
        ...

    # -- streams and events -----------------------------------------------------------------------------------
    def current_stream(self) -> Stream:
        """The calling thread's current stream: where its kernels run."""
        ...

    def compute_stream(self, stream: object | None = None) -> Stream:
        """Resolve the compute stream transfers wait on (R4).

        Args:
            stream: None for the calling thread's current stream (:meth:`current_stream`); otherwise a value
                naming a compute stream in the backend's own terms (the simulated device: a ``str`` name or one
                of its streams; CuPy: a CuPy stream or a raw stream pointer).

        Raises:
            InvalidTransferError: a value the backend does not accept (the message says what it accepts).
        """
        ...

    def create_stream(self, *, tag: Tag | None = None) -> Stream:
        """A new non-blocking stream (ledger kind "stream")."""
        ...

    def destroy_stream(self, stream: Stream) -> None:
        """Destroy a stream; work already queued on it still runs. May fail (the stream then stays: leaked)."""
        ...

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Make later work on ``stream`` wait for the event's latest record (device side)."""
        ...

    def create_event(self, *, tag: Tag | None = None) -> Event:
        """A new timing event (ledger kind "event")."""
        ...

    def destroy_event(self, event: Event) -> None:
        """Destroy an event. May fail (the event then stays: leaked)."""
        ...

    def record(self, event: Event, stream: Stream, *, tag: Tag | None = None) -> None:
        """Record the event on the stream; the event completes when the work queued before it has run."""
        ...

    def query(self, event: Event) -> bool:
        """True if the event's latest record completed (or it was never recorded), False if pending.

        Raises:
            DeviceError: the device reported an error for it (never hidden as "pending").
        """
        ...

    def synchronize(self, event: Event) -> None:
        """Block until the event completes. Unbounded: never used on the shutdown path."""
        ...

    def elapsed(self, start: Event, end: Event) -> float:
        """Seconds between two completed events."""
        ...

    # -- copies -----------------------------------------------------------------------------------------------
    def copy_batch(self, stream: Stream, buf: DescriptorBuffer, count: int, *, tag: Tag | None = None) -> None:
        """Queue, as one submission, the first ``count`` copies described in ``buf`` on ``stream``."""
        ...

    # -- clock and the device-level proof ---------------------------------------------------------------------
    def monotonic(self) -> float:
        """The backend's clock in seconds (real time on a GPU, virtual time on the sim)."""
        ...

    def sleep(self, seconds: float) -> None:
        """Let the clock advance by ``seconds`` without holding the GIL (the sim runs due work)."""
        ...

    def prove_idle(self, streams: Sequence[Stream], deadline: float) -> bool:
        """The device-level proof (R13): fresh events on each of ``streams`` (and on no other stream: the caller
        lists the compute stream it needs proven), polled until ``deadline`` (at least once). True if all
        completed; False if the deadline passed first.

        Raises:
            DeviceError: the device failed while proving.
        """
        ...


def give_up_past_horizon(horizon: float, started: float, now: float, what: str) -> None:
    """``Backend.check_unbounded_wait`` for a device that models hangs: :class:`~kvoffload_ref.errors.SimHang` once
    a wait without a timeout, begun at ``started``, is still not done ``horizon`` seconds later."""
    if now - started >= horizon:
        raise SimHang(f"wait() without a timeout: {what} did not complete within {horizon} s")
