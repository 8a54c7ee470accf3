"""The simulated device's FIFO copy engines: the ``"fifo"`` link model, one engine per direction.

Theory of operation
-------------------
Under a profile whose ``link_model`` is ``"fifo"`` (``_simcost.py``), a copy whose fixed phase ended does not
start moving its bytes at once: it *arrives* at its direction's engine (``h2d`` = load, ``d2h`` = store), which
serves one copy at a time. The cost model still prices every copy (one pricing home) and runs the link's rates (the
duplex cap across the two engines); this module only decides *which* copy each engine serves and when.

*Arrival order.* An idle engine serves a copy as it arrives; a busy one queues it, and serves its queue in arrival
order. Copies that arrive at the same virtual time go in submission order: the scheduler settles them in its tie
order (latest-submitted first), so a copy that arrives at the moment the copy its engine began to serve at that very
moment arrived, and was submitted before it, takes its place (no time passed; the other goes back to the queue).
Nothing else ranks them: the sim's streams have no priority (``create_stream`` takes none) and the engine reads
neither the stream's name nor its age -- priority-blind, as measured on CUDA copy engines (torchrec #4303, #4339:
a lower- or higher-priority stream changes nothing).

*Blocks (current-stream-first, torchrec #4315).* When an engine finishes a copy, it looks at the ops its stream
had already queued behind it (submitted by that moment: the clock never moves past work not yet run). Skipping
*transparent* ops -- event records, and waits on a record already complete, which take no time -- if the first
other op is a copy, the engine is *held* for it: that copy is served next even if another stream's copy arrived
earlier, and the engine waits for it through its fixed phase (in this model the descriptors' setup is the engine's
own work, as a queued copy's is on a real engine). A block ends at anything else: a compute op (the engine then
yields to another stream, as measured), a wait on a record not yet complete, a hang or a slow stall, or the end of
the stream's queue (a copy submitted later arrives like any other). A copy the engine was held for that turns out,
when priced, to go the other way or not to use the link releases the hold at the moment it was taken (the same
virtual time: no time is lost), and the engine serves its queue.

Nothing here prices anything or touches the heap: :class:`FifoEngines` answers the cost model's questions.
"""

from __future__ import annotations

import bisect
import itertools

from kvoffload_ref.backends._simsched import CopyOp, RecordOp, WaitOp

__all__ = ["DIRECTIONS", "FifoEngines", "block_successor"]

#: The engines: one per link direction.
DIRECTIONS = ("h2d", "d2h")


def block_successor(op: CopyOp) -> CopyOp | None:
    """The copy that continues ``op``'s block as ``op`` finishes, or None (see the module docstring).

    Args:
        op: the copy finishing; it is still its stream's head (the scheduler settles it before popping it).

    Returns:
        The first op queued behind ``op`` past records and completed waits, if it is a copy. (Every op queued
        then was submitted by the time ``op`` finishes: the clock never moves past work not yet run.)
    """
    queue = op.stream.queue
    for nxt in itertools.islice(queue, 1, None):
        kind = nxt.__class__
        if kind is RecordOp or (kind is WaitOp and nxt.record.done):  # type: ignore[attr-defined]  # a WaitOp's
            continue   # transparent: takes no time, moves nothing
        return nxt if kind is CopyOp else None  # type: ignore[return-value]  # a CopyOp
    return None


class FifoEngines:
    """The two copy engines' queues, what each serves and what each is held for (see the module docstring)."""

    def __init__(self) -> None:
        # Invariant: per direction, the copies that arrived and wait, as (arrival time, seq, op) in that order
        # (none of them is served or held for).
        self._queue: dict[str, list[tuple[float, int, CopyOp]]] = {d: [] for d in DIRECTIONS}
        # Invariant: per direction, None or (the copy the engine serves (in the cost model's link phase), when it
        # arrived, whether the engine was held for it).
        self._serving: dict[str, tuple[CopyOp, float, bool] | None] = dict.fromkeys(DIRECTIONS)
        # Invariant: per direction, None or (the copy the engine is held for, the time the hold began); only while
        # nothing is served there; the copy is its stream's next op (not yet arrived).
        self._held: dict[str, tuple[CopyOp, float] | None] = dict.fromkeys(DIRECTIONS)

    def arrive(self, op: CopyOp, direction: str, t: float) -> tuple[bool, CopyOp | None]:
        """A copy ended its fixed phase at ``t``: whether its engine serves it now (else it waits in the queue).

        Args:
            op: the copy.
            direction: ``"h2d"`` or ``"d2h"``.
            t: the virtual time.

        Returns:
            (served now, the copy it displaced or None): a copy that arrived at ``t`` too, was submitted after
            ``op`` and was being served since ``t``; it is queued again and must stop moving bytes.
        """
        held, serving = self._held[direction], self._serving[direction]
        if held is not None and held[0] is op:
            self._held[direction] = None
            self._serving[direction] = (op, t, True)
            return True, None
        if serving is not None and not serving[2] and serving[1] == t and op.seq < serving[0].seq:
            displaced = serving[0]
            bisect.insort(self._queue[direction], (t, displaced.seq, displaced))
            self._serving[direction] = (op, t, False)
            return True, displaced
        if held is not None or serving is not None:
            bisect.insort(self._queue[direction], (t, op.seq, op))
            return False, None
        self._serving[direction] = (op, t, False)
        return True, None

    def finish(self, op: CopyOp, direction: str, t: float) -> CopyOp | None:
        """The engine of ``direction`` finished ``op`` at ``t``: the copy it serves from now, or None.

        None when its queue is empty or the engine is now held for ``op``'s block successor.
        """
        serving = self._serving[direction]
        assert serving is not None and serving[0] is op   # Invariant: only a served copy finishes on the link
        self._serving[direction] = None
        successor = block_successor(op)
        if successor is not None:
            self._held[direction] = (successor, t)
            return None
        return self._next(direction)

    def priced(self, op: CopyOp, direction: str) -> tuple[CopyOp, float] | None:
        """``op`` was priced: its link ``direction`` (``"local"``: it does not use the link).

        Returns:
            None, or -- when an engine was held for ``op`` and ``op`` will not arrive there -- the copy that engine
            serves instead and the time it starts (the moment the hold began).
        """
        for engine in DIRECTIONS:
            held = self._held[engine]
            if held is not None and held[0] is op and engine != direction:
                self._held[engine] = None
                nxt = self._next(engine)
                return None if nxt is None else (nxt, held[1])
        return None

    def waiting(self) -> int:
        """How many copies wait for an engine (for tests)."""
        return sum(len(q) for q in self._queue.values())

    def _next(self, direction: str) -> CopyOp | None:
        queue = self._queue[direction]
        if not queue:
            return None
        arrived, _, op = queue.pop(0)
        self._serving[direction] = (op, arrived, False)
        return op
