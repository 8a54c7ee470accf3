"""What the worker asks of one direction's handler: the seam between the worker level and a handler.

Both workers share one worker level (``reference.Core``: the lock, the calls, the shutdown sequence) and
differ in the handler behind this protocol: ``reference.ReferenceHandler`` (plain: one query per head, no pools)
and ``handler.DirectionHandler`` (fast: pools, batched calls, prefix queries, the vectorized planner). The worker
serialises every call under its lock while it is open (R19); from shutdown on only the shutdown thread calls.
The lock check (``lockcheck``) holds every handler behind this seam to that at each write of its ``GUARDED`` fields.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final, Protocol

from kvoffload_ref.backends.base import Backend, Event, Stream
from kvoffload_ref.canonical_plan import CanonicalLayout
from kvoffload_ref.lifecycle import Fate, HandlerState
from kvoffload_ref.results import HandlerReport, HandlerStats, TransferResult
from kvoffload_ref.running import Running
from kvoffload_ref.shield import Leaks, Shield
from kvoffload_ref.specs import Direction, KVCacheLayout, TensorGeometry

__all__ = ["GUARDED", "DirectionHandlerAPI", "NewHandler", "unproven_chunks"]

#: The fields of every handler behind this seam that the worker's lock check guards (R19, ``lockcheck``): its
#: lifecycle state, which each transition of the handler table writes. The worker binds them (``Core.__init__``).
GUARDED: Final = ("state",)

logger = logging.getLogger("kvoffload_ref.worker")


class DirectionHandlerAPI(Protocol):
    """One direction (R4): its stream, its FIFO of transfers, its results, its drain and release."""

    direction: Direction
    state: HandlerState  # Invariant: changed only through the handler table, by a thread the lock check allows
    #: What this handler's release calls failed to release, marked leaked (R16), with the failures outside release().
    leaks: Leaks

    def submit(self, job_id: int, src: object, dst: object, deadline: float | None = None, tag: object = None
               ) -> None:
        """R4/R7/R14: check the transfer (R27: against the holds), then queue it whole on this direction's stream
        (R28: a fresh one if the last was retired), or leave no trace. ``deadline``: checked seconds or None (R26)."""

    def cancel(self, job_ids: set[int]) -> None:
        """R26: query without waiting (a done job is reported as done), then end the listed jobs still queued and
        those behind them on their stream: reported failed, held (R27), their stream retired (R28)."""

    def knows(self, job_id: int) -> bool:
        """Whether the job is queued here or its result waits for ``get_finished`` (R7's "in flight")."""

    def end_events(self, job_ids: set[int]) -> list[Event]:
        """R23: the end events of the listed jobs still queued here, to order a caller's stream after them."""

    def reap(self) -> None:
        """Observe heads without blocking; what is proven or failed waits in the results (R5)."""

    def take_results(self) -> list[TransferResult]:
        """Hand the waiting results over, in submission order; no backend call (R14)."""

    def last_of(self, job_ids: set[int]) -> object | None:
        """The last queued transfer among ``job_ids`` (None if none): in FIFO order it settles them all (R6)."""

    def settle(self, mark: object) -> bool:
        """Observe heads without blocking up to ``mark`` (from :meth:`last_of`); whether it is resolved now."""

    def drain(self, deadline: float, *, interrupted: bool = False) -> object:
        """R10/R11: prove head first until ``deadline``; stop at the first failure and abandon the rest; with
        ``interrupted`` (R14) abandon at once. A BaseException while waiting abandons the rest and propagates."""

    def abandon_undrained(self) -> None:
        """R14: an interrupt came before this drain began: begin it now and abandon everything, without a wait."""

    @property
    def drain_error(self) -> BaseException | None:
        """The first failure of the drain, or None."""

    @property
    def clean(self) -> bool:
        """R13's clean path: every transfer submitted here was proven by its own end event."""

    def unproven_chunks(self) -> set[int]:
        """R29: the CPU chunk ids (rows of the region's per-tensor views) that an unproven copy of this handler --
        one still queued, late on a retired stream, failed or abandoned -- may still touch; what a quarantine keeps
        registered."""

    def streams_in_use(self) -> list[Stream]:
        """The streams this handler still holds, retired ones included (what the device-level proof covers, R13)."""

    def release(self, fate: Fate, shield: Shield | None = None, *,
                reason: str = "device not proven idle") -> tuple[int, int, list[str]]:
        """R10/R12: release the stream and events, free or quarantine (``fate``) unproven descriptor buffers and
        retired streams not proven idle (R28).

        Returns:
            (descriptor buffers quarantined, retired streams quarantined (the report's ``retired_streams``),
            descriptions of the steps that failed).
        """

    def discard(self) -> None:
        """R2: construction rollback: destroy what the constructor created."""

    def report(self) -> HandlerReport:
        """This direction's part of the shutdown report (R10, R14)."""

    def stats(self) -> HandlerStats:
        """A frozen snapshot."""


#: A handler's constructor as ``reference.build_core`` calls it: (backend, direction, compute stream, layout, GPU
#: geometries, CPU geometries, blocks per chunk, canonical layout or None, the worker's running-engine state).
NewHandler = Callable[[Backend, Direction, Stream, KVCacheLayout, Sequence[TensorGeometry], Sequence[TensorGeometry],
                       int, CanonicalLayout | None, Running], DirectionHandlerAPI]


def unproven_chunks(*handlers: DirectionHandlerAPI) -> set[int] | None:
    """R29: the CPU chunks an unproven copy of any of ``handlers`` may still touch (what a quarantine keeps); None
    -- keep the whole region -- if a handler cannot say (logged: a quarantine must never keep too little)."""
    try:
        return set().union(*(h.unproven_chunks() for h in handlers))
    except Exception:
        logger.exception("Could not list the chunks unproven copies may touch; keeping the whole region")
        return None
