"""The simulated device's batched release and polling calls (``free_descriptors_many``, ``destroy_events``,
``query_prefix``): one lock, one catch-up and one pass over many handles, with the single calls' checks.

:class:`SimBatchCalls` adds them to :class:`~kvoffload_ref.backends._simcore.SimCore`'s state and steps;
:class:`~kvoffload_ref.backends.sim.SimBackend` inherits them. See ``sim.py`` for the theory of operation.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any, Final, cast

from kvoffload_ref.backends._simcore import SimCore
from kvoffload_ref.backends._simsched import Record, SimEvent
from kvoffload_ref.backends.base import DescriptorBuffer, Event

__all__ = ["PREFIX_FIRST_RUN", "SimBatchCalls"]

#: How many events ``query_prefix`` looks at first (then twice as many each time, until one is not done).
PREFIX_FIRST_RUN: Final = 16


class SimBatchCalls(SimCore):
    """The batched calls of the :class:`~kvoffload_ref.backends.sim.SimBackend` facade (in their own module
    for the size of the facade's)."""

    def free_descriptors_many(self, bufs: Sequence[DescriptorBuffer]) -> None:
        """Free several descriptor buffers in one call, with ``free_descriptors``'s checks; one ``free`` fault
        point per buffer.

        Raises:
            DeviceError: an injected ``free`` fault, once every other buffer was freed (that one stays live).
        """
        if self.on_call is not None:
            self.on_call("free_descriptors", None)
        with self._lock:
            bufs, failed = self._release_checks("free", bufs)
            self._free_many(bufs)
        if failed is not None:
            raise failed

    def _free_many(self, bufs: Sequence[DescriptorBuffer]) -> None:
        """free_descriptors_many's work (the lock held)."""
        self._catch_up()
        keys = list(map(id, bufs))
        freed = self._pop_live(self._buffers, keys, bufs, "free_descriptors", "buffer")
        users = self._buffer_users
        if users and any(map(users.get, freed)):
            released = set(freed)
            for buf in bufs:
                if id(buf) in released and users.get(id(buf)):
                    self._violate("descriptor_freed_under_dma",
                                  f"{buf!r} freed while {users[id(buf)]} pending copies read it")
        self._ledger.release_many("descriptor", freed)

    def destroy_events(self, events: Sequence[Event]) -> None:
        """Destroy several events in one call, with ``destroy_event``'s checks; one ``destroy`` fault point per
        event.

        Raises:
            DeviceError: an injected ``destroy`` fault, once every other event was destroyed (that one stays live).
        """
        if self.on_call is not None:
            self.on_call("destroy_event", None)
        with self._lock:
            events, failed = self._release_checks("destroy", events)
            keys = _event_keys(events)
            self._ledger.release_many("event", self._pop_live(self._events, keys, events, "destroy_event", "event"))
        if failed is not None:
            raise failed

    def _pop_live(self, live: dict[int, Any], keys: list[int], handles: Sequence[object], call: str,
                  what: str) -> list[int]:
        """Remove ``handles`` (keys ``keys``: each one's ``id()``) from the ``live`` table (each live handle held
        under its own ``id()``); returns the keys removed. A handle that is not live there (or named twice) is
        recorded as ``invalid_release`` and left as it was."""
        popped = list(map(live.pop, keys, itertools.repeat(None)))
        # Two live objects never share an id(): whatever a handle's id() finds in the table is that handle, so all
        # found (none None: one C pass over truth values, no call per handle) is all live. The sim's handles define
        # neither __bool__ nor __len__; a false one would only take the checked path below.
        if all(popped):
            return keys
        removed = []  # misuse: put back what was popped by mistake, record each handle that was not live
        for key, handle, found in zip(keys, handles, popped, strict=True):
            if found is handle and found is not None:   # (None is never live: a None handle finds the default)
                removed.append(key)
                continue
            if found is not None:
                live[key] = found
            self._violate("invalid_release", f"{call}({handle!r}): not a live {what} of this device")
        return removed

    def query_prefix(self, events: Sequence[Event]) -> int:
        """How many of ``events``, from the first, completed (each observed as by ``query``). 0 when a fault
        plan, a lost device or an ``on_call`` hook is present: then every query goes through ``query``.

        Stops at the first event not done: the events are looked at in runs of PREFIX_FIRST_RUN, then twice as
        many each time, so a poll that finds the head pending looks at a few events, not at every one asked
        about (a drain polls a queue of thousands many times). The events may belong to several streams (a
        retired stream's and a fresh one's, R28): the race detector observes the latest counted record of each
        stream, which covers the earlier records of that stream (R20)."""
        if self.on_call is not None or self._plan is not None or self._sticky is not None:
            return 0
        with self._lock:
            self._catch_up()
            if self._trace is not None:
                self._trace.host_query(self._sched.now)
            count, size, total, race = 0, PREFIX_FIRST_RUN, len(events), self._race
            # Invariant: stream -> the latest record counted so far on it (insertion keeps the latest per key); kept
            # only for the race detector (without it nothing reads it: no per-record work on the poll).
            lasts: dict[object, Record] = {}
            while count < total:
                run = events[count:count + size]
                done, counted = _done_prefix(self._events, run)
                count += done
                if counted and race is not None:
                    _note_lasts(lasts, counted)
                if done < len(run):
                    pending = _pending_record(self._events, run[done])
                    if pending is not None:
                        self._watch(pending)
                    break
                size *= 2
            if race is not None:
                for last in lasts.values():
                    race.observe(last)
            return count


def _pending_record(table: dict[int, SimEvent], event: Event) -> Record | None:
    """The record of ``event`` a prefix query stopped at, if it is live and pending (its completion can change the
    answer: the caller's next poll pause ends there)."""
    if table.get(id(event)) is not event:
        return None
    latest = cast(SimEvent, event).latest
    return latest if latest is not None and not latest.done else None


def _done_prefix(table: dict[int, SimEvent], events: Sequence[Event]) -> tuple[int, Sequence[Record]]:
    """How many of ``events``, from the first, are live in ``table`` and done (a never-recorded event counts as
    done), and the records of those counted, in order (an event never recorded has none)."""
    if len(events) == 1:   # a wait's own job at the head: the same answer without the list machinery
        return _done_one(table, events[0])
    records = _all_done(table, events)
    if records is not None:
        return len(events), records
    live = list(map(table.get, _event_keys(events)))
    if not all(map(operator.is_, live, events)):  # a handle that is not live: stop before it
        live = live[:next(i for i, (a, b) in enumerate(zip(live, events, strict=True)) if a is not b)]
    latest: list[Record | None] = list(map(_LATEST, live))
    if None in latest:  # a never-recorded event counts as complete
        pending = [r is not None and r.done_at is None for r in latest]
        count = pending.index(True) if True in pending else len(pending)
        return count, [r for r in latest[:count] if r is not None]
    done = list(map(_DONE, latest))
    count = len(done) if all(done) else done.index(False)
    return count, cast(list[Record], latest[:count])


def _all_done(table: dict[int, SimEvent], events: Sequence[Event]) -> list[Record] | None:
    """:func:`_done_prefix`'s common case, a drain's run of completed transfers: when every one of ``events`` is a
    live SimEvent of ``table`` whose latest record is done, those records in order (three comprehensions: on
    CPython 3.11 a specialized attribute read beats ``map`` over an ``attrgetter``); else None, and the general
    path counts. The run's last event is looked at first: a run that ends pending (a poll of queued work) costs
    one look, not three passes."""
    last = events[-1]
    if not isinstance(last, SimEvent) or last.latest is None or not last.latest.done:
        return None
    if not all(map(isinstance, events, _SIM_EVENTS)):
        return None
    sim, get = cast(Sequence[SimEvent], events), table.get
    if [e for e in sim if get(e.key) is not e]:  # a handle that is not live
        return None
    latest = [e.latest for e in sim]
    if [r for r in latest if r is None or not r.done]:  # never recorded (the general path counts it), or pending
        return None
    return cast(list[Record], latest)


def _note_lasts(lasts: dict[object, Record], counted: Sequence[Record]) -> None:
    """Note in ``lasts`` the latest of ``counted`` (in stream order) per stream, as ``dict.update`` over (stream,
    record) pairs would: one assignment when all are on one stream (a handler's queue: the common case), else one
    per record."""
    last = counted[-1]
    stream = last.stream
    if [r for r in counted if r.stream is not stream]:
        lasts.update(zip(map(_STREAM, counted), counted, strict=True))
    else:
        lasts[stream] = last


def _done_one(table: dict[int, SimEvent], event: Event) -> tuple[int, Sequence[Record]]:
    """:func:`_done_prefix` of one event."""
    if table.get(id(event)) is not event:   # not live: stop before it
        return 0, ()
    latest = cast(SimEvent, event).latest
    if latest is None:   # never recorded: complete
        return 1, ()
    return (1, (latest,)) if latest.done else (0, ())


_LATEST = operator.attrgetter("latest")
_DONE = operator.attrgetter("done")
_STREAM = operator.attrgetter("stream")
_SIM_EVENTS = itertools.repeat(SimEvent)  # isinstance's second argument, for map (infinite: reusable)


def _event_keys(events: Sequence[Event]) -> list[int]:
    """``id()`` of each handle: the ``key`` a SimEvent holds when all are SimEvents (no new int per event)."""
    if all(map(isinstance, events, _SIM_EVENTS)):
        return [e.key for e in cast(Sequence[SimEvent], events)]  # a comprehension: see _all_done
    return list(map(id, events))
