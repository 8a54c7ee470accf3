"""DirectionHandler: one direction's FIFO of in-flight transfers, its pools, and its bounded drain.

Theory of operation
-------------------
Each handler owns **one stream**, and every transfer of its direction is queued on it. R4 ("a transfer starts
only after the previous transfer of its handler has ended") is then the stream's own FIFO order -- also after a
failure, since the stream keeps every transfer ever queued on it in order, failed or not. A stream per in-flight
transfer would buy no concurrency (the transfers are serialised anyway) and cost one create and one destroy each.

``submit`` validates and plans the copies (the handler's ``layout.Planner``, built once over its geometry;
invalid input raises before any device work and before anything is taken from a pool, R7), takes two events and
a descriptor buffer from the pools (or creates them), writes the copies straight into the descriptor buffer, and
queues on the stream: a wait for a marker event just recorded on the compute stream (R4), the start event, one
batched copy, the end event. (The marker goes back to the pool at once: a stream's wait captures the record
current when it is issued, so re-recording the marker later cannot affect it.)

A transfer leaves the queue only once *proven*: its end event was observed done without error (R5, R10). What
happens then is the lifecycle table's action, not this module's choice: while accepting, a proven head is
reported and a failed head fails the whole queue (reported ``success=False``); while draining, a proven head is
counted as drained and a failure abandons the rest. Proven transfers give their events and descriptor buffer
back to the pools; failed and abandoned ones go to the *unproven* bin: never reused, released at shutdown only if
the device-level proof succeeds (R13), else their descriptor buffers are quarantined (a copy may still read them).

``drain`` is the shutdown half (:mod:`kvoffload_ref.handler_drain`, a base of this class): head first, each wait
bounded by the one shutdown deadline (R11), then what retired streams still hold (R28); ``release`` frees the
transfer-side resources in a few batched backend calls and reports what must be quarantined. The running engine's
rules -- deadlines, cancel, held blocks, retired streams (R26-R28) -- are :mod:`kvoffload_ref.running`'s, carried
out here. The handler never holds the region (R1): it gets tensor geometries only.

The handler is not thread-safe by itself: the worker serialises every call into it (R19). The transfer record,
what a submission took and the batched release of the pools live in :mod:`kvoffload_ref.handler_pools`.
"""

from __future__ import annotations

import array
import collections
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence

from kvoffload_ref import lifecycle, tables
from kvoffload_ref.backends import batched
from kvoffload_ref.backends.base import Backend, DescriptorBuffer, Event, Stream, Tag
from kvoffload_ref.canonical_plan import CanonicalLayout
from kvoffload_ref.errors import DeviceError, detached
from kvoffload_ref.handler_drain import DrainHalf
from kvoffload_ref.handler_pools import Taken, Transfer
from kvoffload_ref.lifecycle import Action, HandlerInput, HandlerState
from kvoffload_ref.planner import Planner, PreparedPlan
from kvoffload_ref.results import (
    TRANSFER_TYPE,
    HandlerReport,
    HandlerStats,
    JobOutcome,
    TransferResult,
    failed_in_order,
    proven,
)
from kvoffload_ref.running import Holds, Mark, Retired, Running
from kvoffload_ref.shield import Leaks, Shield
from kvoffload_ref.specs import Direction, KVCacheLayout, TensorGeometry
from kvoffload_ref.validate import Int64Array

__all__ = ["DirectionHandler", "HandlerReport", "HandlerStats", "JobOutcome", "TransferResult"]  # the values: results

logger = logging.getLogger("kvoffload_ref.handler")

# What every submission and proven head reads, bound once: reading a member through its enum class runs the
# metaclass's slot hook (``EnumType`` defines ``__getattr__``, which puts a Python-level hook on every lookup:
# ~65 ns a read against ~6 ns for a bound name, on CPython 3.11.7).
_SUBMIT, _HEAD_PROVEN = HandlerInput.SUBMIT, HandlerInput.HEAD_PROVEN
_ENQUEUE, _REPORT, _COUNT_DRAINED = Action.ENQUEUE, Action.REPORT, Action.COUNT_DRAINED
#: The handler table's legal steps, read once (``_step``: one dict read a step; a refused pair goes to
#: ``tables.step``, which raises).
_HANDLER_MOVES = tables.moves(lifecycle.HANDLER_TABLE, HandlerState)

#: The most end events one ``query_prefix`` call is asked about: few enough that a window's transfers, events and
#: records are still in cache when the proven heads are booked (a drain of thousands runs window by window).
PREFIX_WINDOW = 512


class DirectionHandler(DrainHalf):
    """One direction (store: GPU->CPU, or load: CPU->GPU) of a worker. Built and driven by the worker."""

    def __init__(self, backend: Backend, direction: Direction, layout: KVCacheLayout,
                 gpu: Sequence[TensorGeometry], cpu: Sequence[TensorGeometry], blocks_per_chunk: int,
                 *, compute_stream: Stream | None = None, prewarm: int = 0,
                 canonical: CanonicalLayout | None = None, running: Running | None = None) -> None:
        """Build a handler: its planner, its stream, and ``prewarm`` transfers' worth of events up front.

        Args:
            compute_stream: the stream whose queued work every transfer waits for (R4); None = the backend's
                current stream now.
            canonical: this rank's canonical mappings (R24): the planner copies their fragments, stores only
                the pages this rank writes; None: plain mode.
            running: the worker's holds and stall warning, shared with the other direction (R27, R30); None: this
                handler's own (a handler built alone).

        Raises:
            InvalidTransferError: the geometry does not fit the layout (nothing was created).
            DeviceError: creating the stream or a prewarmed event failed (what was created is destroyed).
        """
        self._backend = backend
        self.direction: Direction = direction
        self._kind = TRANSFER_TYPE[direction]  # ``TransferResult.transfer_type`` of this direction
        self._machine = f"{direction} handler"  # the lifecycle machine's name in error messages
        # Invariant: holds geometry only (addresses and strides, validated once here), never the region (R1).
        self._planner = Planner(layout, gpu, cpu, blocks_per_chunk, canonical)
        # Invariant: the stream R4's wait is recorded on; fixed for the handler's life.
        self._compute = compute_stream if compute_stream is not None else backend.current_stream()
        # Invariant: submission order, all on self._stream; none is proven yet, none is late.
        self._queue: collections.deque[Transfer] = collections.deque()
        # Invariant: shared with the other direction of the worker (R27, R30).
        self._running = running or Running(Holds(max(g.rows for g in gpu), max(c.rows for c in cpu)))

        # Invariant: completion known (proven or failed), not yet reported; in resolution (= submission) order.
        self._resolved: list[TransferResult] = []
        # Invariant: job ids in _queue or _resolved (the ids "in flight" for R7's duplicate check).
        self._jobs: set[int] = set()
        # Invariant: the marks last_of handed out that are still queued: when one leaves the queue it is marked
        # resolved (and dropped from here), so that no other transfer is written to on its way out.
        self._marks: set[Transfer] = set()
        # Invariant: transfers whose completion is unknown; their resources are never reused.
        self._unproven: list[Transfer] = []
        # Invariant: pooled objects are idle (their last use was proven complete); LIFO.
        self._events: list[Event] = []
        self._descriptors: list[DescriptorBuffer] = []
        self._counts = collections.Counter[str]()
        # Invariant: what a release call of this handler failed to release, marked leaked in the ledger (R16).
        self.leaks = Leaks(backend.ledger)
        # Invariant: the retired streams and what is still queued on them (R28).
        self._retired: Retired[Transfer] = Retired(backend, direction, self._running, self.leaks)
        # Invariant: retired streams the drain could not prove idle, kept for the proof and the release (R28).
        self._unproven_streams: list[Stream] = []
        self._kept_streams = 0  # Invariant: retired streams release() kept (not proven idle, R28)
        # Invariant: the jobs the shutdown drain took over without reporting them (results dropped at its start,
        # proven by it, abandoned by it), in submission order: the report lists them (R8, R14). Only appended to:
        # the unreaped at the drain's start, the drained as it proves them, the abandoned when it stops.
        # Invariant: the report's jobs, in submission order: those known before the drain began (_outcomes), then
        # those the drain proved (ids and bytes: no outcome object until a report is read), then those it stopped at.
        self._outcomes: list[JobOutcome] = []
        # R7: a job id is any int (2**63 and uuid4().int included): ids are kept as Python ints, never packed
        # into a fixed-width array; byte counts fit in int64 (every address range was checked to).
        self._drained_ids: list[int] = []
        self._drained_bytes: array.array[int] = array.array("q")
        # Invariant: () until a submission carried a tag=; from then on, the drained jobs' tags, one per id (the
        # drain runs after every submission, so it is one or the other for the whole drain).
        self._drained_tags: list[object] = []
        self._tagged = False  # Invariant: some submission carried a tag= (not None)
        self._stopped: list[JobOutcome] = []
        # Invariant: True while some queued transfer is broken (its end event unrecorded): prefixes stop there.
        self._broken = False
        # Invariant: the first failure of the shutdown drain (None before it or if there was none).
        self._drain_error: BaseException | None = None
        # Invariant: changed only through tables.step(HANDLER_TABLE, ...), in _step.
        self.state = HandlerState.ACCEPTING
        # Invariant: every transfer of this direction's current generation runs on this one stream (R4); None once
        # released, or once retired (R28) until the next submission creates a fresh one.
        self._stream: Stream | None = None
        try:
            self._stream = backend.create_stream()
            self._events.extend(backend.create_event() for _ in range(3 * prewarm))
        except BaseException:
            self.discard()
            raise

    # -- submission -----------------------------------------------------------------------------------------------
    def submit(self, job_id: int, src: object, dst: object, deadline: float | None = None, tag: object = None
               ) -> None:
        """Queue one transfer (see the module docstring for what is queued).

        Raises:
            InvalidTransferError: the specs do not fit the layout (nothing changed, R7).
            WorkerClosedError: the handler is draining or closed (R8).
            DeviceError: a device call failed before the device took the copy; nothing was queued and what was
                taken for it is given back. (Once the device took the copy the job is queued whatever happens: a
                failure to record its end event is reported as its failure, R5.)
            BaseException: an interrupt (R14): raised before the device took the copy, nothing is left of the
                submission; after, the job is queued whole first.
        """
        if self._step(_SUBMIT) is not _ENQUEUE:  # every other pair is refused
            return
        plan = self._planner.prepare(self.direction, src, dst)  # type: ignore[arg-type]  # R7: it checks the types
        gpu_ids, cpu_ids = plan.gpu_ids, plan.cpu_ids  # the checked specs' ids
        holds = self._running.holds
        if holds.count:  # R27: nothing done if refused (no hold: nothing to check, no call)
            holds.check(self.direction, job_id, gpu_ids, cpu_ids)
        if self._stream is None:  # R28: the last stream was retired: new work goes to a fresh one
            self._stream = self._backend.create_stream()
        taken, shield = Taken(), Shield()
        try:
            transfer = self._enqueue(job_id, plan, taken, cpu_ids if self.direction == "store" else gpu_ids, gpu_ids,
                                     cpu_ids)  # R22: the destination spec's ids (the same array)
        except BaseException as exc:
            if not taken.copy_queued:
                # R14: no copy on the device: no trace, the id stays free
                taken.undo(self._backend, self._events, self.leaks, self.direction)
                raise
            transfer, shield.interrupt = taken.transfer, exc  # raised once the job is queued
        # R14: the device took the copy (or there is none): the job is queued, whatever is raised from here on.
        if taken.end_pending:
            self._record_end(transfer, shield)
        self._events.append(taken.marker)  # reusable at once: the stream's wait captured the record it needs
        transfer.user_tag, transfer.deadline = tag, deadline
        if self.direction == "load":  # R22 by group: a load's destination is its GPU spec
            transfer.dst_groups = dst.group_sizes  # type: ignore[attr-defined]  # a checked GPU spec
        if tag is not None:
            self._tagged = True
        self._queue.append(transfer)
        self._jobs.add(job_id)
        self._counts["submitted"] += 1
        if shield.interrupt is not None:  # no call in the common case (no interrupt)
            shield.reraise()

    def _enqueue(self, job_id: int, plan: PreparedPlan, taken: Taken, dst_blocks: Int64Array, gpu_ids: Int64Array,
                 cpu_ids: Int64Array) -> Transfer:
        backend, tag, stream = self._backend, (self.direction, job_id), self._stream
        assert stream is not None  # Invariant: an accepting handler has its stream
        descriptors = None
        if plan.num_ops:
            descriptors = self._take_descriptors(plan.num_ops, tag, taken)
            plan.write(descriptors.src, descriptors.dst, descriptors.sizes)
        marker, start, end = taken.take_three(self._events, backend.create_event, tag)
        backend.record(marker, self._compute, tag=tag)
        backend.wait_event(stream, marker)  # R4: after the compute work queued so far
        backend.record(start, stream, tag=tag)  # R4: after this handler's previous transfer (stream order)
        transfer = taken.transfer = Transfer(job_id, start, end, descriptors, plan.nbytes, dst_blocks, tag, gpu_ids,
                                             cpu_ids)
        taken.marker = marker
        if descriptors is None:
            backend.record(end, stream, tag=tag)  # no copy: until this returns, an interrupt leaves no trace
            return transfer
        taken.end_pending = True
        backend.copy_batch(stream, descriptors, plan.num_ops, tag=tag)
        taken.copy_queued = True  # the device took the copy: the submission carries through (R14)
        return transfer

    def _record_end(self, transfer: Transfer, shield: Shield) -> None:
        """Record the end event of a transfer whose copy the device already took, retried through interrupts;
        if it cannot be recorded, the transfer can never be proven by it and fails at the head (R5)."""
        try:
            shield.run(self._backend.record, transfer.end, self._stream, tag=transfer.tag)
        except Exception as exc:
            transfer.broken = detached(DeviceError(f"recording the end event of {self.direction} job "
                                                    f"{transfer.job_id} failed: {exc!r}"))
        except BaseException:
            transfer.broken = DeviceError(f"interrupted while recording the end event of {self.direction} job "
                                          f"{transfer.job_id}")
        self._broken = self._broken or transfer.broken is not None

    def _take_descriptors(self, count: int, tag: Tag, taken: Taken) -> DescriptorBuffer:
        while self._descriptors and self._descriptors[-1].capacity < count:
            self.leaks.release(self._backend.free_descriptors, "descriptor", self._descriptors.pop(),  # idle but too
                               f"free a {self.direction} descriptor buffer too small to reuse")  # small, as upstream
        return taken.take(self._descriptors, self._backend.alloc_descriptors, count, tag=tag)

    # -- completion -----------------------------------------------------------------------------------------------
    def knows(self, job_id: int) -> bool:
        """Whether the job is in flight here or completed but not yet reported."""
        return job_id in self._jobs

    def end_events(self, job_ids: set[int]) -> list[Event]:
        """R23: the end events of the listed jobs still queued (a broken transfer's was never recorded). A pooled
        event is re-recorded only after its transfer left the queue, and a stream wait captures the record current
        at the call, so what a caller's stream waits for never changes."""
        live = [*self._retired.marks(job_ids), *self._queue] if self._retired else self._queue
        return [t.end for t in live if t.job_id in job_ids and t.broken is None]

    def get_finished(self) -> list[TransferResult]:
        """Reap what is proven (or failed) without blocking; report each job once, in submission order (R5)."""
        self.reap()
        return self.take_results()

    def take_results(self) -> list[TransferResult]:
        """Hand over the waiting results; no backend call, so no interrupt at a call splits it (R14)."""
        results, self._resolved = self._resolved, []
        if results:
            self._jobs.difference_update([r.job_id for r in results])
        return results

    def last_of(self, job_ids: set[int]) -> Transfer | Mark[Transfer] | None:
        """The last queued transfer among ``job_ids`` (None if none is queued): in FIFO order, once it is
        resolved, every listed job here is (R6); with retired streams (R28), a mark of it and the listed live jobs
        queued on them."""
        queue = self._queue
        if not queue and not self._retired.lanes:  # nothing queued here (the other direction's wait): no search
            return None
        mark = queue[-1] if queue and queue[-1].job_id in job_ids else next(  # the newest first (then a search)
            (t for t in reversed(queue) if t.job_id in job_ids), None)
        if mark is not None:
            self._marks.add(mark)
        retired = self._retired.marks(job_ids) if self._retired.lanes else []  # the lanes: no __bool__ call
        if not retired:
            return mark
        return Mark([*retired, *([] if mark is None else [mark])])

    def settle(self, mark: object) -> bool:
        """Observe the queue's heads without blocking, up to ``mark``; whether ``mark`` is resolved now."""
        if type(mark) is Transfer:  # a wait's own job here (what last_of returns without retired streams)
            self.reap(mark)
            return mark.resolved
        assert isinstance(mark, Mark)  # Invariant: the worker passes what last_of returned
        self.reap()
        return mark.resolved

    def reap(self, mark: Transfer | None = None) -> None:
        """Observe the heads without blocking (up to ``mark``, if given) until one is still pending; what is proven
        or failed waits in the results (R5). Runs of completed heads are proven with one prefix query, and ``mark``
        itself, once it is the head, with one ``query`` (a prefix query of one event would say no more, and a
        pending head would then be queried twice). Retired streams first (R28); a pending head past its deadline
        expires (R26)."""
        if self._retired.lanes:  # the common case (none) tested without a call
            self._retired.poll(self._backend.query, self._proven_retired, self._failed_retired, self._free_late,
                               self._backend.monotonic(), self._expired)
        while self._queue and (mark is None or not mark.resolved):
            if mark is self._queue[0]:   # a wait's own job at the head: its one query settles it (no prefix)
                if not self._observe_head(self._backend.query):
                    break
            elif not self._prove_prefix(mark) and not self._observe_head(self._backend.query):
                break
        else:
            return
        head = self._queue[0] if self._queue else None
        if head is not None and (head.deadline is not None or self._running.watches):
            self._check_head(head)

    def _check_head(self, head: Transfer) -> None:
        """R26/R30: the head is pending: its age on the device decides its deadline and the stall warning."""
        try:
            late = self._running.overdue(self._backend, self.direction, head)
        except DeviceError as exc:  # its start event failed: the head fails as its end event would (R5)
            self._head_failed(exc)
            return
        if late:
            self._expire(0, "deadline")

    def _prove_prefix(self, mark: Transfer | None = None) -> int:
        """Prove, with one backend call, the run of heads whose own end events are done (R5, R10); the head that
        is not done, fails, or is instrumented is left for ``_observe_head``. Returns how many were proven."""
        window: Iterable[Transfer] = itertools.islice(self._queue, PREFIX_WINDOW)
        if self._broken:
            window = itertools.takewhile(lambda t: t.broken is None, window)
        if mark is None:
            ends = [t.end for t in window]  # a comprehension: on CPython 3.11 it beats map over an attrgetter
        else:
            ends = []
            for transfer in window:
                ends.append(transfer.end)
                if transfer is mark:
                    break
        count = batched.query_prefix(self._backend, ends)
        if count:
            self._heads_proven(count)
        return count

    def _observe_head(self, observe: Callable[[Event], bool]) -> bool:
        """Observe the head's end event once: the head is proven, or failed, or (False) still pending."""
        head = self._queue[0]
        try:
            if head.broken is not None:
                raise head.broken
            done = observe(head.end)
        except DeviceError as exc:
            self._head_failed(exc)
            return True
        if done:
            self._heads_proven(1)  # as _head_proven does, with no frame of its own
        return done

    def _head_proven(self) -> None:
        self._heads_proven(1)

    def _heads_proven(self, count: int) -> None:
        """The ``count`` oldest transfers were proven by their own end events. HEAD_PROVEN is a self-loop in every
        state that allows it, so one table step decides for the whole run: report them, or count them drained."""
        queue = self._queue
        whole = count == len(queue)
        self._book_proven(self._step(_HEAD_PROVEN), queue if whole else list(itertools.islice(queue, count)))
        if whole:
            queue.clear()
        else:  # popleft ``count`` times, in C
            collections.deque(itertools.starmap(queue.popleft, itertools.repeat((), count)), maxlen=0)

    def _book_proven(self, action: Action, run: Sequence[Transfer]) -> None:
        """``run`` was proven by its own end events (the table said ``action``): reported, or counted drained; its
        events and descriptor buffers go back to the pools. The caller then removes it from its queue."""
        # R14: the timings (backend calls, where an interrupt may land) are read before anything changes; from
        # here on no backend call is made, so the heads move from the queue to the results as one step.
        if action is _REPORT:
            kind, resolved, elapsed = self._kind, self._resolved, self._backend.elapsed
            for h in run:  # a loop, not a comprehension: no frame of its own (a wait proves one head)
                try:  # the timing read inline (no frame per head)
                    seconds: float | None = elapsed(h.start, h.end)
                except DeviceError:
                    self._timing_lost(h)
                    seconds = None
                resolved.append(proven(h.job_id, h.nbytes, seconds, kind, h.user_tag))
        events, descriptors = self._events.append, self._descriptors.append
        for transfer in run:  # one pass, no (start, end) tuple per transfer
            events(transfer.start)
            events(transfer.end)
            if transfer.descriptors is not None:  # None: no copy
                descriptors(transfer.descriptors)
        # The drain reads no timings: a drained head leaves only its id and byte count (a list, a C array); its
        # outcome is built when a report is read, so a teardown of thousands allocates nothing per job.
        if action is _COUNT_DRAINED:
            self._drained_ids += [t.job_id for t in run]
            self._drained_bytes.fromlist([t.nbytes for t in run])  # one resize (extend grows item by item)
            if self._tagged:  # an untagged handler keeps no tags (nothing per job)
                self._drained_tags += [t.user_tag for t in run]
            self._counts["drained"] += len(run)
        self._leave(run)
        self._counts["completed"] += len(run)

    def _leave(self, run: Iterable[Transfer]) -> None:
        """``run`` (heads of the queue) is leaving it: the marks among them are resolved."""
        marks = self._marks
        if marks:
            for transfer in run:
                if transfer in marks:
                    transfer.resolved = True
                    marks.discard(transfer)

    def _timing_lost(self, transfer: Transfer) -> None:
        """Log, inside the ``except`` that caught it, that ``transfer``'s timing could not be read (its result
        then has no seconds)."""
        logger.warning("Could not read the timing of %s job %d", self.direction, transfer.job_id, exc_info=True)

    def _head_failed(self, exc: DeviceError) -> None:
        """R5/R10: observing the head raised; the table says whether the queue is reported failed or abandoned."""
        action = self._step(HandlerInput.HEAD_FAILED)
        if action is Action.REPORT_FAILED:
            self._report_failed(exc)
        elif action is Action.ABANDON:
            self._abandon(exc, head_failed=True, current=True)

    def _report_failed(self, exc: DeviceError) -> None:
        """R5/R27/R28: the head and everything behind it have unknown completion: reported failed, held, and their
        stream retired (the clock is read first: an interrupt there changes nothing, R14)."""
        now = self._backend.monotonic()
        failed = list(self._queue)
        self._leave(failed)
        self._queue.clear()
        self._failed(failed, exc)
        self._retired.retire(self._stream, [], failed, now)
        self._stream = None

    def _failed(self, failed: list[Transfer], exc: DeviceError) -> None:
        """R5/R22: ``failed`` (head first) are reported failed; the caller holds them (their copies may still run)."""
        self._counts["failed"] += len(failed)
        self._resolved += failed_in_order(self.direction, failed, exc)

    def _failed_retired(self, failed: list[Transfer], exc: DeviceError, now: float) -> None:
        """R5: live jobs on a retired stream failed: reported failed and held (R27)."""
        self._step(HandlerInput.HEAD_FAILED)  # REPORT_FAILED
        self._leave(failed)
        self._failed(failed, exc)
        self._retired.hold(failed, now)

    def _proven_retired(self, head: Transfer) -> None:
        """A live job on a retired stream, proven by its own end event: reported (or drained) like any other."""
        self._book_proven(self._step(_HEAD_PROVEN), (head,))

    def _free_late(self, transfer: Transfer) -> None:
        """Its copy was observed done (R27: only now): its events and descriptor buffer go back to the pools."""
        self._events += (transfer.start, transfer.end)
        if transfer.descriptors is not None:
            self._descriptors.append(transfer.descriptors)

    def _expire(self, index: int, reason: str, cancelled: set[int] | frozenset[int] = frozenset()) -> None:
        """R26-R28: the queue's transfer at ``index`` and everything behind it are late: reported failed with
        ``TransferExpired`` and held; the stream is retired with the live transfers ahead of it."""
        now = self._backend.monotonic()  # the only backend call: before anything changes (R14)
        self._step(HandlerInput.EXPIRE)  # REPORT_EXPIRED
        queued = list(self._queue)
        self._queue.clear()
        self._report_expired(*self._retired.end_stream(self._stream, queued, index, reason, cancelled, now))
        self._stream = None

    def _expired(self, late: list[Transfer], results: list[TransferResult]) -> None:
        """R26: live jobs on a retired stream became late (cancelled, or past their deadline): reported."""
        self._step(HandlerInput.EXPIRE)  # REPORT_EXPIRED
        self._report_expired(late, results)

    def _report_expired(self, late: list[Transfer], results: list[TransferResult]) -> None:
        self._leave(late)
        self._counts["expired"] += len(late)
        self._resolved += results

    def cancel(self, job_ids: set[int]) -> None:
        """R26: query first (never wait): a done job is reported as done; then every listed job still queued, and
        the jobs behind it on its stream, are late ("cancel"/"behind"); unknown or reported ids are ignored."""
        self.reap()
        if self._retired:  # live jobs on retired streams
            self._retired.cancel(job_ids, self._backend.monotonic(), self._expired)
        index = next((i for i, t in enumerate(self._queue) if t.job_id in job_ids), None)
        if index is not None:
            self._expire(index, "cancel", job_ids)

    # -- snapshots and helpers ------------------------------------------------------------------------------------
    def stats(self) -> HandlerStats:
        """A frozen snapshot; no device call but the clock (R30: the pending head's age is from the start a poll
        saw)."""
        head = self._queue[0] if self.state is HandlerState.ACCEPTING and self._queue else None
        now = self._backend.monotonic()
        health = self._retired.health(self._running.head_age(head, now), now, len(self._unproven_streams))
        c = self._counts
        return HandlerStats(
            self.direction, self.state.value, len(self._queue), len(self._resolved), c["submitted"], c["completed"],
            c["failed"], c["abandoned"], len(self._unproven) + self._retired.late_count(),
            int(self._stream is not None), len(self._events), len(self._descriptors), *health)

    def _step(self, event: HandlerInput) -> Action:
        move = _HANDLER_MOVES.get((self.state, event))
        if move is None:  # a refused pair: step raises its error
            move = tables.step(lifecycle.HANDLER_TABLE, self._machine, self.state, event)
        self.state, action = move
        return action
