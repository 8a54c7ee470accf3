"""The simulated device's timeline recorder (``SimBackend(trace=True)``; format: ``trace_format``).

The scheduler calls :meth:`SimTrace.on_finish` with every op as it finishes. An op's start is exact without being
stored: a stream is a FIFO, so an op started when the op before it on its stream finished, or when it was submitted
if later (for a wait: when it became the stream's head; the span then covers the time it blocked). Faults fired
and violations are instants on the track of the stream they concern (a ``dma_race`` on both operations' tracks:
memory operations are numbered in enqueue order, as the race detector numbers them for ``Violation.pair``). A
stall is drawn as a span (category ``fault``) on its stream: a slow fault's for its duration, an ended hang's from
its start to its end (a hang never ended is not drawn: its stream's later work is listed as never run). The host's
polling is on a track of its own (:data:`HOST_TRACK`, category ``host``): a run of sleeps between polls one span
(``polls`` counts its queries), a lone ``query`` an instant, so that a gap on a stream reads as what it is -- the
host waiting between polls, not the device idle.
Off (the default), the sim holds no recorder and pays one ``is None`` test per op.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvoffload_ref.backends._simsched import ComputeOp, CopyOp, HangOp, Op, RecordOp, SimStream, SlowOp, WaitOp
from kvoffload_ref.backends.base import Tag
from kvoffload_ref.backends.trace_format import HOST_TRACK, TraceBuilder, copy_args, copy_name

__all__ = ["SimTrace"]


class SimTrace:
    """Records what the sim ran (see the module docstring).

    Args:
        source: the ``otherData.source`` text (the profile's name).
    """

    def __init__(self, source: str) -> None:
        # Invariant: every event recorded so far (spans of finished ops, instants), in recording order.
        self.builder = TraceBuilder(source)
        # Invariant: stream -> (tid, the virtual time its last op finished).
        self._last: dict[SimStream, float] = {}
        # Invariant: id(record) -> (tid, completion time) for every record that completed.
        self._records: dict[int, tuple[int, float]] = {}
        # Invariant: memory op number (race detector order) -> (tid, name, submission time).
        self._memory_ops: list[tuple[int, str, float]] = []
        # Invariant: the number of copy spans in builder (copies that finished).
        self.copies = 0
        # Invariant: the host's current polling span (its event in builder, its end in seconds), or None.
        self._polling: tuple[dict[str, Any], float] | None = None

    def tid(self, stream: SimStream) -> int:
        """The stream's track."""
        return self.builder.track(stream.label)

    def on_finish(self, op: Op, t: float) -> None:
        """Add the span of an op that finishes at ``t``."""
        stream = op.stream
        start = max(self._last.get(stream, 0.0), op.submitted_at)
        self._last[stream] = t
        tid = self.tid(stream)
        b = self.builder
        if isinstance(op, CopyOp):
            self.copies += 1
            b.span(tid, copy_name(op.tag), start, t, "copy", self._copy_args(op, t - start))
        elif isinstance(op, ComputeOp):
            b.span(tid, "compute", start, t, "compute", {"rows": int(op.rows.size), "delay_s": op.delay,
                                                         "ran_s": t - start})
        elif isinstance(op, RecordOp):
            self._records[id(op.record)] = (tid, t)
            b.span(tid, "record", t, t, "sync")
        elif isinstance(op, SlowOp):
            b.span(tid, f"slow: {copy_name(op.tag)}", start, t, "fault", {"duration_s": op.duration})
        elif isinstance(op, HangOp):   # an ended hang: the span covers the time its stream was blocked
            b.span(tid, f"hang: {copy_name(op.tag)}", start, t, "fault", {"ended_at": op.ended})
        elif isinstance(op, WaitOp):
            b.span(tid, "wait", start, t, "sync")
            found = self._records.get(id(op.record))
            if found is not None:
                b.flow(found[0], found[1], tid, t)

    def host_poll(self, start: float, end: float) -> None:
        """A host sleep between polls (``sleep``: the worker's wait back-off, a proof's polling) on the host track:
        the clock moved because the host waited, not because the device ran anything. Sleeps that follow one
        another (only polls between them) are one span, its ``polls`` counting the queries made along it."""
        last = self._polling
        if last is not None and last[1] == start:
            last[0]["dur"] = (end * 1e6) - last[0]["ts"]
            self._polling = (last[0], end)
            return
        self.builder.span(self.builder.track(HOST_TRACK), "host: polling", start, end, "host", {"polls": 1})
        self._polling = (self.builder.events[-1], end)

    def host_query(self, now: float) -> None:
        """A host ``query`` of an event (a poll): counted on the polling span it ends, else an instant."""
        last = self._polling
        if last is not None and last[1] == now:
            last[0]["args"]["polls"] += 1
            return
        self.builder.instant(self.builder.track(HOST_TRACK), "host: query", now, "host", {})

    def memory_op(self, stream: SimStream, name: str | None, tag: Tag | None, now: float) -> None:
        """Number one memory op as the race detector does (called right before it)."""
        self._memory_ops.append((self.tid(stream), name or copy_name(tag), now))

    def instant(self, stream: SimStream | None, name: str, now: float, cat: str, args: dict[str, Any]) -> None:
        """A marker on a stream's track (None: the device track)."""
        self.builder.instant(0 if stream is None else self.tid(stream), name, now, cat, args)

    def violation(self, kind: str, detail: str, now: float, pair: tuple[int, int] | None) -> None:
        """A violation's marker(s): on both operations' tracks for a race, else on the device track."""
        args: dict[str, Any] = {"detail": detail}
        if pair is None or max(pair) >= len(self._memory_ops):
            self.builder.instant(0, kind, now, "violation", args)
            return
        names = [self._memory_ops[i][1] for i in pair]
        args["operations"] = names
        for i in pair:
            tid, name, submitted = self._memory_ops[i]
            self.builder.instant(tid, f"{kind}: {name}", max(now, submitted), "violation", args)

    def document(self, pending: Iterable[Op], now: float) -> dict[str, Any]:
        """The trace document; ops that never ran (stuck behind a hang) get a zero-length span at ``now``."""
        b = TraceBuilder(self.builder.source)
        b.events, b._tids = list(self.builder.events), dict(self.builder._tids)
        stuck = 0
        for op in pending:
            if isinstance(op, HangOp):
                continue
            stuck += 1
            name = copy_name(op.tag) if isinstance(op, CopyOp) else type(op).__name__
            b.span(b.track(op.stream.label), f"{name} (never ran)", now, now, "stuck")
        return b.document(clock="virtual", copies=self.copies, never_ran=stuck)

    @staticmethod
    def _copy_args(op: CopyOp, seconds: float) -> dict[str, object]:
        flow = op.flow
        if flow is not None:
            args = copy_args(flow.bytes, flow.count, flow.path, seconds)  # type: ignore[attr-defined]
            if flow.waited:  # type: ignore[attr-defined]  # a Flow's: it queued for its copy engine ("fifo")
                args["engine_wait_s"] = flow.waited  # type: ignore[attr-defined]
            return args
        plan = op.plan
        nbytes = int(plan.sizes[plan.sizes > 0].sum()) if plan is not None else 0
        return copy_args(nbytes, op.count, "simple", seconds)
