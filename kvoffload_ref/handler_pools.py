"""The fast engine's transfer record and its pooled resources: what one queued transfer holds, what a submission took.

:class:`~kvoffload_ref.handler.DirectionHandler` owns one direction's queue and its pools (plain lists of idle
events and descriptor buffers, LIFO) and decides, through the lifecycle table, what happens to each transfer. This
module is the resource side it builds on: :class:`Transfer`, the slotted record of one queued transfer (and the
accessors that map over a run of them); :class:`Taken`, what one submission took from the pools or created, given
back if the submission fails before the device took its copy (R14); and :func:`release_pools`, the shutdown release
of whatever the handler held, in a few batched backend calls, each failed release leaked (R16) and the unproven
transfers' descriptor buffers freed or quarantined (R12, R13). It imports nothing of the handler.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvoffload_ref.backends import batched
from kvoffload_ref.backends.base import Backend, DescriptorBuffer, Event, Stream, Tag
from kvoffload_ref.errors import DeviceError
from kvoffload_ref.lifecycle import Fate
from kvoffload_ref.quarantine import keeper
from kvoffload_ref.shield import Leaks, Shield, each, finish_all
from kvoffload_ref.specs import Direction
from kvoffload_ref.validate import Int64Array

__all__ = ["EVENTS", "Taken", "Transfer", "release_pools"]

_T = TypeVar("_T")


class Taken:
    """What one submission took so far (from a pool or newly created), to give back if it fails."""

    __slots__ = ("copy_queued", "end_pending", "items", "marker", "transfer")

    def __init__(self) -> None:
        # Invariant: (pool the item belongs to, item, created by this submission), in taking order.
        self.items: list[tuple[list[Any], Any, bool]] = []
        # Invariant: True once copy_batch accepted the copy (the device may read the descriptors from then on).
        self.copy_queued = False
        # Invariant: the transfer being built and its marker event, once its events are taken.
        self.transfer: Any = None
        self.marker: Any = None
        # Invariant: True from just before the copy is queued (its end event is recorded after it).
        self.end_pending = False

    def take(self, pool: list[_T], create: Callable[..., _T], *args: object, tag: Tag) -> _T:
        """Pop an idle item from the pool, or create one: ``create(*args, tag=tag)``."""
        item, created = (pool.pop(), False) if pool else (create(*args, tag=tag), True)
        self.items.append((pool, item, created))
        return item

    def take_three(self, pool: list[_T], create: Callable[..., _T], tag: Tag) -> tuple[_T, _T, _T]:
        """Three items (a transfer's marker, start and end events), as three :meth:`take` calls in a row take them:
        popped while the pool has some, then each created with ``create(tag=tag)``."""
        if len(pool) < 3:
            return self.take(pool, create, tag=tag), self.take(pool, create, tag=tag), self.take(pool, create, tag=tag)
        first, second, third = pool.pop(), pool.pop(), pool.pop()  # the common case: the pool holds them
        self.items += ((pool, first, False), (pool, second, False), (pool, third, False))
        return first, second, third

    def undo(self, backend: Backend, events: list[Event], leaks: Leaks, direction: Direction) -> None:
        """Give back what a submission took before its copy was queued (newest first): a pooled item to its pool
        (``events`` is the handler's event pool; any other pool holds descriptor buffers), a created one is
        released (what cannot be is leaked, R16); a second interrupt meanwhile does not stop it (R14: the first
        one propagates once everything is back)."""
        shield = Shield()
        for pool, item, created in reversed(self.items):
            if not created:
                pool.append(item)
                continue
            release = backend.destroy_event if pool is events else backend.free_descriptors
            kind, what = "event" if pool is events else "descriptor", f"release a {direction} {item!r}"
            finish_all([(what, functools.partial(leaks.release, release, kind, item, what))], shield)  # R16


@dataclasses.dataclass(eq=False, slots=True)
class Transfer:
    """One queued transfer (slotted, its two events held directly: a drain of thousands frees fewer objects)."""

    job_id: int
    start: Event
    end: Event
    descriptors: DescriptorBuffer | None  # None for a zero-op transfer
    nbytes: int
    dst_blocks: Int64Array  # R22: the destination's block ids (GPU blocks of a load, CPU chunks of a store)
    tag: Tag  # (direction, job_id): the one tuple every record of the transfer is tagged with
    gpu_ids: Int64Array  # Invariant: the GPU spec's block ids, set at submit
    cpu_ids: Int64Array  # Invariant: the CPU spec's chunk ids (dst of a store, src of a load), set at submit (R29)
    # Invariant: True once the transfer left the queue (proven, failed or abandoned) if it was a mark (see
    # DirectionHandler._marks) when it left; a transfer no caller waits on is never marked resolved.
    resolved: bool = False
    # Invariant: why its end event could not be recorded after the device took its copy (it can never be proven
    # by that event, so it fails when it reaches the head); None normally.
    broken: DeviceError | None = None
    user_tag: object = None  # the submission's tag=, returned on its result
    dst_groups: tuple[int, ...] = ()  # R22: a load's GPU spec's group_sizes (its destination's groups); () for a store
    deadline: float | None = None  # R26: seconds from its start on the device, or None
    started: float | None = None  # Invariant: the backend time a poll first saw its start event done
    late: float | None = None  # Invariant: the backend time it became late (reported failed, held, R27)
    warned: bool = False  # Invariant: R30's stall warning was logged for it


EVENTS = operator.attrgetter("start", "end")


def release_pools(backend: Backend, direction: Direction, leaks: Leaks, stream: Stream | None, events: list[Event],
                  freed: list[DescriptorBuffer], unproven: Sequence[Transfer], fate: Fate, shield: Shield | None,
                  reason: str, retired: Sequence[Stream] = ()) -> tuple[int, list[str]]:
    """Release what a handler held, taken over from it (see ``DirectionHandler.release``): the stream, the pooled
    ``events`` and ``freed`` descriptor buffers (both lists are extended in place, not copied: a copy of thousands
    would touch each), and the ``unproven`` transfers' events and descriptor buffers, the latter freed if ``fate``
    is RELEASE, else quarantined for ``reason``, like the ``retired`` streams not proven idle (R28: destroyed if
    ``fate`` is RELEASE, else kept and listed in the report). Every step runs, whatever an earlier one raised
    (R14); a failed release is leaked in ``leaks`` and the rest go on (R16).

    Returns:
        (how many descriptor buffers were quarantined, descriptions of the steps that failed).
    """
    events += itertools.chain.from_iterable(map(EVENTS, unproven))
    kept = [t.descriptors for t in unproven if t.descriptors is not None]
    if fate is Fate.RELEASE:
        freed += kept
        kept = []
    streams = [] if stream is None else [stream]
    kept_streams = [] if fate is Fate.RELEASE else list(retired)
    if fate is Fate.RELEASE:
        streams += retired
    steps: list[tuple[str, Callable[[], object]]] = [  # a failed release is leaked, the rest go on (R16)
        (f"destroy the {direction} stream", lambda: each(backend.destroy_stream, streams, leaks.of("stream"))),
        (f"destroy {len(events)} {direction} events",
         lambda: _release_many(backend, leaks, batched.destroy_events, "event", events)),
        (f"free {len(freed)} {direction} descriptor buffers",
         lambda: _release_many(backend, leaks, batched.free_descriptors_many, "descriptor", freed)),
        ("quarantine descriptor buffers", keeper(backend.ledger.quarantine, "descriptor", kept, reason)),  # R12
        ("quarantine retired streams", keeper(backend.ledger.quarantine, "stream", kept_streams, reason)),  # R28
    ]
    failed, _ = finish_all(steps, shield)
    return len(kept), failed


def _release_many(backend: Backend, leaks: Leaks, release: Callable[[Backend, list[Any]], None], kind: str,
                  items: list[Any]) -> None:
    """One batched release call; if it raises, what it could not release is leaked (R16) and it propagates."""
    try:
        release(backend, items)
    except Exception:
        leaks.live_ones(kind, items)
        raise
