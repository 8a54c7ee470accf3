"""The optional batched calls of a backend, and the per-call defaults for a backend without them.

A teardown destroys thousands of events and frees thousands of descriptor buffers, and a drain proves thousands of
transfers: a device that can do these in one call offers :class:`BatchedBackend`'s three methods. They are not part
of the required :class:`~kvoffload_ref.backends.base.Backend` protocol: the library calls the module functions
here (:func:`destroy_events`, :func:`free_descriptors_many`, :func:`query_prefix`), which use the backend's batched
method when it has one and else make one call each -- the same result, only slower.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvoffload_ref.backends.base import Backend, DescriptorBuffer, Event
from kvoffload_ref.errors import DeviceError

__all__ = ["BatchedBackend", "destroy_events", "free_descriptors_many", "query_prefix"]


@runtime_checkable
class BatchedBackend(Backend, Protocol):
    """A backend with batched teardown and drain calls (the simulated device)."""

    def destroy_events(self, events: Sequence[Event]) -> None:
        """Destroy several events in one call (a teardown destroys thousands). Each event is one call at the fault
        point ``destroy``: every event that can be is destroyed, then the first failure is raised (those stay
        live)."""
        ...

    def free_descriptors_many(self, bufs: Sequence[DescriptorBuffer]) -> None:
        """Free several descriptor buffers in one call (a teardown frees thousands). Each buffer is one call at the
        fault point ``free``: every buffer that can be is freed, then the first failure is raised (those stay
        live)."""
        ...

    def query_prefix(self, events: Sequence[Event]) -> int:
        """How many of ``events``, from the first, completed without error: each counts as observed done, exactly
        as if ``query`` had returned True for it (a drain of thousands of transfers asks once). ``events`` were
        recorded on one stream, in this order (a handler's queue of end events).

        Stops at the first event that is not done, or whose ``query`` would raise or is instrumented (a fault
        plan, an ``on_call`` hook): the caller queries that one alone, so errors, injected faults and hooks keep
        their per-call meaning. Never raises.
        """
        ...


def destroy_events(backend: Backend, events: Sequence[Event]) -> None:
    """Destroy ``events``: the backend's ``destroy_events`` if it has one, else one ``destroy_event`` each."""
    batched = getattr(backend, "destroy_events", None)
    if batched is None:
        _destroy_each(backend, events)
    else:
        batched(events)


def free_descriptors_many(backend: Backend, bufs: Sequence[DescriptorBuffer]) -> None:
    """Free ``bufs``: the backend's ``free_descriptors_many`` if it has one, else one ``free_descriptors`` each."""
    batched = getattr(backend, "free_descriptors_many", None)
    if batched is None:
        _free_each(backend, bufs)
    else:
        batched(bufs)


def query_prefix(backend: Backend, events: Sequence[Event]) -> int:
    """How many of ``events``, from the first, are done (:meth:`BatchedBackend.query_prefix`): the backend's
    ``query_prefix`` if it has one, else one ``query`` per event up to the first not done or raising."""
    batched = getattr(backend, "query_prefix", None)
    if batched is None:
        return _query_each(backend, events)
    count: int = batched(events)
    return count


def _destroy_each(backend: Backend, events: Sequence[Event]) -> None:
    _every(backend.destroy_event, events)


def _free_each(backend: Backend, bufs: Sequence[DescriptorBuffer]) -> None:
    _every(backend.free_descriptors, bufs)


def _every(release: Callable[[Any], object], items: Sequence[object]) -> None:
    """``release`` each item; one that raises does not stop the others: the first failure is raised once done."""
    failed: Exception | None = None
    for item in items:
        try:
            release(item)
        except Exception as exc:
            failed = failed or exc
    if failed is not None:
        raise failed


def _query_each(backend: Backend, events: Sequence[Event]) -> int:
    """Stops at the first event not done or whose query raises (not raised here: the caller queries that event
    alone and sees the error)."""
    count = 0
    for event in events:
        try:
            if not backend.query(event):
                break
        except DeviceError:
            break
        count += 1
    return count
