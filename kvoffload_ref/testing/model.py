"""The pure model the conformance machine runs beside the worker: what must be observable, never timing.

Theory of operation
-------------------
*Placement.* :func:`~kvoffload_ref.placement.plan_moves` (re-exported here) is the plain-Python placement rule
(§2.3/§2.4, ``kvoffload_ref.placement``): which bytes of which GPU row go to which bytes of which CPU row. It never
calls the vectorized planner.

*Memory.* Each side (GPU, CPU) is a :class:`Side`: per tensor the *eventual* bytes (``value``: what the memory
holds once all work submitted so far has run, in the order the rules guarantee), ``known`` (the eventual value is
determined), ``writers`` (pending transfers that may still write the byte), ``lingering`` (late copies -- failed,
expired or cancelled transfers, R26/R27 -- that may still write it until their hold is released), ``poison``
(something may write it at any later time, so it is never known again) and ``last`` (the transfer that last wrote
it). A byte is *settled* when it is known and no pending transfer may write it: only settled bytes are compared
with memory. A byte a late copy wrote stays unknown after its release until something writes it again.

*Transfers.* A submitted transfer captures its source bytes at once (R4: it runs after the compute work queued
so far and after its direction's previous transfer) and applies them to its destination at once; bytes are
unknown where an *unordered* writer may interfere: a pending transfer of the other direction (R4: stores and
loads are not ordered), a compute write enqueued after the transfer, or a failed transfer. When a later write
hits bytes a pending transfer still has to read, that transfer's capture -- and what it wrote, where it is still
the last writer -- becomes unknown.

*Ordering (R23).* ``order_after`` on the worker's compute stream orders the compute work queued there afterwards
after the listed transfers still queued, and after everything queued before them in their direction (stream
FIFO): ``compute_after`` keeps, per direction, the newest transfer so ordered. A compute write then races only
with the pending transfers it is not ordered after. Compute work on a named stream is ordered with nothing the
worker queues: its rows are poisoned (they may be written at any time), as a failed transfer's are.

*Outcomes.* The model never predicts *when* a transfer completes. It knows which transfers can never be proven
(a hang selected them, or they wait behind one on the same stream: ``blocked``) and which must fail (an injected
error fired on their end event, or on the one they are queued behind on their stream, R5). ``chain`` holds each
direction's live queued transfers, in submission order; ``lane`` is the device stream each was queued on (the
kit's device says which): after a failure the worker retires the stream and queues new work on a fresh one
(R28), which waits for nothing of the retired one. A failed result names the transfer's destination ids
(``dst_ids``: GPU blocks of a load, CPU chunks of a store, R22).

*Deadlines and cancel (R26).* A transfer may carry a ``deadline`` (seconds from its start on the device, which
is no earlier than its submission, ``submitted_at``) and may be listed in a ``cancel`` (``cancelled``). Either
may end it -- and those behind it on its stream -- as a late failure (``TransferExpired``), or it may be proven
first: the model does not know which (:meth:`Model.may_be_late`), except when the machine let its copy complete
on the device before the cancel (``proven_first``: it must be reported as it is, a success).

*Holds (R27).* A transfer reported failed (or released) is *late*: its copy may still run, so the worker holds
its blocks (``gpu_ids``, ``cpu_ids``: what it writes for any access, what it reads against writes) until a
``take_released()`` record says its copy was observed done (``released``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from kvoffload_ref.placement import Move, plan_moves
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout

__all__ = ["COMPUTE", "ORDER_SLACK", "TRANSFER_TYPE", "Model", "ModelTransfer", "Move", "Side", "plan_moves"]

Direction = Literal["store", "load"]
#: R22: ``transfer_type`` of each direction's results (stated here, independent of the library's table).
TRANSFER_TYPE: Final = {"store": ("GPU", "CPU"), "load": ("CPU", "GPU")}
#: Virtual seconds by which one copy a compute stream waits for (``order_after``) has run on the kit's device once
#: what it waits for has (a copy is a few microseconds there): the compute stream may run that much later per copy.
ORDER_SLACK: Final = 1e-4
Bytes = npt.NDArray[np.uint8]
Mask = npt.NDArray[np.bool_]

#: ``Side.last`` value for bytes last written by a compute-stream kernel.
COMPUTE: Final = -2
#: ``Side.last`` value for bytes never written.
NOBODY: Final = -1


class Side:
    """One memory side (GPU or CPU) as the model sees it; see the module docstring.

    Args:
        name: "gpu" or "cpu".
        shapes: per tensor, (rows, row bytes).
        initial: per tensor, the initial bytes, or None when unknown.
    """

    def __init__(self, name: str, shapes: Sequence[tuple[int, int]], initial: Sequence[Bytes] | None) -> None:
        self.name = name
        self.value = [np.zeros(s, np.uint8) if initial is None else initial[t].copy() for t, s in enumerate(shapes)]
        self.known = [np.full(s, initial is not None) for s in shapes]
        self.poison = [np.zeros(s, np.bool_) for s in shapes]
        self.lingering = [np.zeros(s, np.int32) for s in shapes]
        self.writers = [np.zeros(s, np.int32) for s in shapes]
        self.last = [np.full(s, NOBODY, np.int64) for s in shapes]

    def settled(self, tensor: int) -> Mask:
        """Bytes whose value is known and that no pending transfer may still write."""
        mask: Mask = self.known[tensor] & (self.writers[tensor] == 0)
        return mask

    def mismatch(self, tensor: int, actual: Bytes) -> tuple[int, int] | None:
        """The first settled byte (row, column) of ``tensor`` whose actual value differs, or None."""
        bad = self.settled(tensor) & (actual != self.value[tensor])
        if not bad.any():
            return None
        row, col = (int(v[0]) for v in np.nonzero(bad))
        return row, col

    def capture(self, move: Move) -> tuple[Bytes, Mask]:
        """The eventual bytes a move reads here, and which of them are certain (no unordered pending writer)."""
        row, lo, hi = move.at(self.name)
        t = move.tensor
        certain: Mask = self.known[t][row, lo:hi] & (self.writers[t][row, lo:hi] == 0)
        return self.value[t][row, lo:hi].copy(), certain

    def write(self, move: Move, data: Bytes, certain: Mask, writer: int) -> None:
        """Apply a pending transfer's write in submission order (it stays a pending writer until resolved)."""
        row, lo, hi = move.at(self.name)
        t = move.tensor
        self.value[t][row, lo:hi] = data
        self.known[t][row, lo:hi] = certain & self.clear(t, row, lo, hi)
        self.writers[t][row, lo:hi] += 1
        self.last[t][row, lo:hi] = writer

    def clear(self, tensor: int, row: int | list[int], lo: int = 0, hi: int | None = None) -> Mask:
        """Bytes nothing may write at an unknown time (no poison, no late copy lingering)."""
        cols = slice(lo, hi)
        mask: Mask = ~self.poison[tensor][row, cols] & (self.lingering[tensor][row, cols] == 0)
        return mask

    def finish(self, move: Move, failed: bool) -> None:
        """A pending write resolved; a failed one is a late copy that may still land until it is released."""
        row, lo, hi = move.at(self.name)
        t = move.tensor
        self.writers[t][row, lo:hi] -= 1
        if failed:
            self.lingering[t][row, lo:hi] += 1
            self.known[t][row, lo:hi] = False

    def release(self, move: Move) -> None:
        """R27: a late copy was observed done: it writes nothing more (its bytes stay unknown until rewritten)."""
        row, lo, hi = move.at(self.name)
        self.lingering[move.tensor][row, lo:hi] -= 1

    def forget(self, move: Move, lost: Mask, writer: int) -> None:
        """The bytes of a move that ``writer`` wrote from an invalidated capture are unknown (if still its)."""
        row, lo, hi = move.at(self.name)
        t = move.tensor
        stale = lost & (self.last[t][row, lo:hi] == writer)
        self.known[t][row, lo:hi] &= ~stale


@dataclasses.dataclass(eq=False)
class ModelTransfer:
    """One successfully submitted transfer, as the model tracks it.

    Attributes:
        index: submission order over the whole run (also its ``Side.last`` id).
        hung: a hang fault selected it: it is never proven (R5, R12).
        blocked: queued behind a hung transfer of its direction: never proven either (R4).
        must_fail: an error fired on its end event or on the one it waits behind: success is forbidden (R5).
        status: "pending" until reported; then "succeeded" or "failed".
        dst_ids: R22: the sorted, distinct destination ids a failed result names (GPU blocks of a load, CPU chunks
            of a store).
        gpu_ids, cpu_ids: R27: the sorted, distinct GPU block and CPU chunk ids it touches (what a hold keeps).
        lane: R28: the stream it was queued on, as the kit's device names it (its direction when unknown).
        released: R27: a ``take_released()`` record said its late copy was observed done.
        deadline, submitted_at: R26: its deadline (None: none) and the device clock when it was submitted.
        cancelled: R26: a ``cancel`` listed it while it was pending.
        proven_first: R26: its copy had completed on the device when a ``cancel`` listed it (the cancel must
            report it as it is).
        expired: R26: the ``TransferExpired.reason`` it was reported with ("" when none).
    """

    job_id: int
    direction: Direction
    index: int
    moves: list[Move]
    nbytes: int
    data: list[Bytes]
    certain: list[Mask]
    dst_ids: tuple[int, ...] = ()
    gpu_ids: tuple[int, ...] = ()
    cpu_ids: tuple[int, ...] = ()
    lane: str = ""
    released: bool = False
    deadline: float | None = None
    submitted_at: float = 0.0
    cancelled: bool = False
    proven_first: bool = False
    expired: str = ""
    hung: bool = False
    blocked: bool = False
    must_fail: bool = False
    status: str = "pending"

    @property
    def stuck(self) -> bool:
        """It can never be proven complete."""
        return self.hung or self.blocked

    @property
    def reads(self) -> str:
        return "gpu" if self.direction == "store" else "cpu"

    @property
    def writes(self) -> str:
        return "cpu" if self.direction == "store" else "gpu"

    @property
    def transfer_type(self) -> tuple[str, str]:
        """R22: the ``transfer_type`` of its results."""
        return TRANSFER_TYPE[self.direction]


class Model:
    """The pure model of one worker run (see the module docstring).

    Args:
        layout, blocks_per_chunk, num_gpu_blocks, num_cpu_chunks: the geometry.
        gpu_initial: the GPU tensors' initial bytes (unpadded rows).
        cpu_initial: the CPU tensors' bytes before the first transfer (None: unknown).
    """

    def __init__(self, layout: KVCacheLayout, blocks_per_chunk: int, num_gpu_blocks: int, num_cpu_chunks: int,
                 gpu_initial: Sequence[Bytes], cpu_initial: Sequence[Bytes] | None = None) -> None:
        self.layout = layout
        self.bpc = blocks_per_chunk
        pages = layout.tensor_page_bytes
        self.sides = {
            "gpu": Side("gpu", [(num_gpu_blocks, p) for p in pages], gpu_initial),
            # The CPU region's initial bytes are not part of the contract: the first snapshot's, or unknown.
            "cpu": Side("cpu", [(num_cpu_chunks, p * blocks_per_chunk) for p in pages], cpu_initial),
        }
        # Invariant: every successfully submitted transfer, by job id.
        self.transfers: dict[int, ModelTransfer] = {}
        # Invariant: per direction, the transfers still queued in the worker as far as the model knows: submitted,
        # not reported, and not failed by a fired error (R4/R5's FIFO).
        self.chain: dict[str, list[ModelTransfer]] = {"store": [], "load": []}
        # Invariant: per lane (stream), the submission index of the last reported job (R5: in submission order;
        # R28: per stream generation, a retired stream never holds a newer one's results back).
        self.last_reported: dict[str, int] = {}
        # Invariant: jobs a wait() returned for while pending: the next get_finished must report them (R6).
        self.awaited: set[int] = set()
        # Invariant: virtual time at which the compute stream has run everything enqueued so far.
        self.compute_busy_until = 0.0
        # Invariant: directions where a hang fired inside a submission that then failed (shutdown predicts less).
        self.tainted: set[str] = set()
        # Invariant: the lanes (streams) of such submissions: they may be reused, so any later transfer queued
        # there may hang without being selected (no liveness is predicted for it).
        self.tainted_lanes: set[str] = set()
        # Invariant: lanes a transfer that can never complete (hung, or blocked behind one) was queued on: every
        # later transfer queued there waits behind it for good (R4), failed or not.
        self.stuck_lanes: set[str] = set()
        # Invariant: lanes (streams) the worker must have retired (R28): a job queued there became late (an error
        # fired on it, or it was reported failed); no new work may be queued there.
        self.retired_lanes: set[str] = set()
        # Invariant: (direction, the lane it left, the job queued on the new one) for each move of a direction to
        # another stream while the model knew no job on the old one late: one of its jobs must turn out late
        # (R28), else the move broke R4's FIFO (and the race model, which follows the device's streams, would
        # miss it).
        self.switches: list[tuple[str, str, int]] = []
        # Invariant: per direction, the submission index of the newest transfer the worker's compute stream was
        # made to wait for (order_after, R23): later compute work there is ordered after it and all before it.
        self.compute_after: dict[str, int] = {"store": -1, "load": -1}
        # Invariant: copies queued so far (transfers and failed submissions whose copy was queued).
        self.copies = 0
        self.any_hung = False
        self.any_failed = False
        # Invariant: a copy was queued whose submission then failed (a ghost) and it moves bytes: it may touch the
        # CPU region at any time, unproven (R29: the region is never released for it).
        self.ghost_touches = False
        self._next_index = 0

    # -- queries --------------------------------------------------------------------------------------------------
    def writer(self, side: str, tensor: int, row: int, col: int) -> str:
        """Who last wrote a byte, for messages."""
        last = int(self.sides[side].last[tensor][row, col])
        if last == COMPUTE:
            return "a compute kernel"
        return next((f"job {t.job_id}" for t in self.transfers.values() if t.index == last), "nobody")

    def pending(self, direction: str | None = None) -> list[ModelTransfer]:
        """Transfers submitted and not yet reported, in submission order."""
        return [t for t in self.transfers.values()
                if t.status == "pending" and (direction is None or t.direction == direction)]

    def can_finish(self, transfer: ModelTransfer) -> bool:
        """Nothing the model knows keeps the transfer from resolving (proven or failed)."""
        return not transfer.stuck and transfer.lane not in self.tainted_lanes

    def next_lane(self, direction: Direction) -> str | None:
        """The stream the next transfer of ``direction`` goes to as far as the model knows: its latest transfer's,
        unless that one was retired (None: a fresh stream, R28)."""
        lane = self._latest_lane(direction)
        return None if lane is None or lane in self.retired_lanes else lane

    def may_be_late(self, transfer: ModelTransfer) -> bool:
        """R26: a deadline or a cancel may have ended it (or one ahead of it on its stream) without the model
        knowing yet: it, or one ahead of it on its stream not reported a success, has a deadline or was cancelled."""
        return any(t.lane == transfer.lane and t.index <= transfer.index and t.status != "succeeded"
                   and (t.cancelled or t.deadline is not None) for t in self.transfers.values())

    def holding(self) -> list[ModelTransfer]:
        """R27: the late transfers not yet released (their blocks must be held)."""
        return [t for t in self.transfers.values() if t.status == "failed" and not t.released]

    # -- events ---------------------------------------------------------------------------------------------------
    def submit(self, direction: Direction, job_id: int, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec,
               *, hung: bool, lane: str | None = None, deadline: float | None = None,
               now: float = 0.0) -> ModelTransfer:
        """A submission succeeded: capture, invalidate what it races with, apply, and queue it (R4) on ``lane``
        (the stream the device saw it queued on; None: unknown, its direction's one)."""
        moves = plan_moves(self.layout, self.bpc, gpu_spec, cpu_spec)
        source = self.sides["gpu" if direction == "store" else "cpu"]
        captured = [source.capture(m) for m in moves]
        destination = cpu_spec if direction == "store" else gpu_spec
        lane = direction if lane is None else lane
        previous = self._latest_lane(direction)
        if previous is not None and previous != lane and previous not in self.retired_lanes:
            self.switches.append((direction, previous, job_id))  # R28 must explain it: checked at shutdown
        transfer = ModelTransfer(job_id, direction, self._next_index, moves, sum(m.size for m in moves),
                                 [d for d, _ in captured], [c for _, c in captured],
                                 _ids(destination.block_ids), _ids(gpu_spec.block_ids), _ids(cpu_spec.block_ids),
                                 lane, deadline=deadline, submitted_at=now, hung=hung, blocked=lane in self.stuck_lanes)
        if transfer.stuck:
            self.stuck_lanes.add(lane)
        self._next_index += 1
        self.copies += 1
        self.any_hung |= hung
        target = self.sides[transfer.writes]
        self._invalidate_readers(transfer.writes, self._mask(transfer.writes, moves))
        for move, data, certain in zip(moves, transfer.data, transfer.certain, strict=True):
            target.write(move, data, certain, transfer.index)
        self.transfers[job_id] = transfer
        self.chain[direction].append(transfer)
        return transfer

    def compute_write(self, tensor: int, rows: Sequence[int], value: int, delay: float, now: float,
                      stream: str | None = None) -> None:
        """A compute kernel writes whole GPU rows. On the worker's compute stream (``stream`` None) it is ordered
        before later transfers and after those ``order_after`` ordered it behind (R23), racing the other pending
        ones; on a named stream it is ordered with nothing the worker queues: its rows are poisoned."""
        gpu = self.sides["gpu"]
        mask = [np.zeros_like(k) for k in gpu.known]
        picked = list(rows)
        mask[tensor][picked, :] = True
        if stream is not None:
            self._invalidate_readers("gpu", mask)
            gpu.poison[tensor][picked, :] = True
            gpu.known[tensor][picked, :] = False
            gpu.last[tensor][picked, :] = COMPUTE
            return
        self._invalidate_readers("gpu", mask, exempt=self.compute_after["store"])
        gpu.value[tensor][picked, :] = value
        racing = np.zeros_like(gpu.known[tensor][picked, :])  # pending loads it is not ordered after
        ordered = self.compute_after["load"]
        for load in self.pending("load"):
            if load.index > ordered:
                racing |= self._mask("gpu", load.moves)[tensor][picked, :]
        gpu.known[tensor][picked, :] = gpu.clear(tensor, picked) & ~racing
        gpu.last[tensor][picked, :] = COMPUTE
        self.compute_busy_until = max(self.compute_busy_until, now) + delay

    def order_after(self, transfers: Sequence[ModelTransfer], now: float) -> None:
        """R23: the worker's compute stream waits on the device for these transfers (each still queued in the
        worker, and able to finish): later compute work there runs after them and what precedes them in their
        direction. The compute stream may now run later: by :data:`ORDER_SLACK` per copy queued so far."""
        for transfer in transfers:
            direction = transfer.direction
            self.compute_after[direction] = max(self.compute_after[direction], transfer.index)
        if transfers:
            self.compute_busy_until = max(self.compute_busy_until, now) + ORDER_SLACK * self.copies

    def ghost(self, moves: Sequence[Move], direction: Direction) -> None:
        """A submission failed after its copy was queued: the copy may land at any time (its destination is
        never known again) and it reads its source unordered with later writes (nothing reported reads it)."""
        target = self.sides["cpu" if direction == "store" else "gpu"]
        self.copies += 1
        self.ghost_touches |= any(m.size for m in moves)
        for move in moves:
            row, lo, hi = move.at(target.name)
            target.poison[move.tensor][row, lo:hi] = True
            target.known[move.tensor][row, lo:hi] = False

    def error_fired(self, direction: str, job_id: int) -> None:
        """An injected error fired on a job's end event: it and everything queued behind it on its stream must fail
        (R5), and that stream is retired (R28: later work goes to a fresh one)."""
        chain = self.chain[direction]
        for i, transfer in enumerate(chain):
            if transfer.job_id == job_id:
                failed = [t for t in chain[i:] if t.lane == transfer.lane]
                for t in failed:
                    t.must_fail = True
                self.chain[direction] = [t for t in chain if t not in failed]
                self.retired_lanes.add(transfer.lane)
                return

    def release(self, transfer: ModelTransfer) -> None:
        """R27: the worker handed out the release of a late transfer's hold: its copy writes nothing more."""
        transfer.released = True
        if transfer.status == "failed":  # else its writes still count as pending: released once reported
            target = self.sides[transfer.writes]
            for move in transfer.moves:
                target.release(move)

    def resolve(self, transfer: ModelTransfer, success: bool, *, expired: bool = False) -> None:
        """The worker reported the transfer (checks are the machine's; this only updates the model). ``expired``:
        reported with a ``TransferExpired``, which does not move its stream's order (R26: live jobs ahead of it
        come later)."""
        transfer.status = "succeeded" if success else "failed"
        self.any_failed |= not success
        if not success:
            self.retired_lanes.add(transfer.lane)
        if not expired:
            self.last_reported[transfer.lane] = transfer.index
        if transfer in self.chain[transfer.direction]:
            self.chain[transfer.direction].remove(transfer)
        target = self.sides[transfer.writes]
        for move in transfer.moves:
            target.finish(move, failed=not success)
            if transfer.released and not success:  # released before it was reported (by a wait's polls)
                target.release(move)

    # -- internals ------------------------------------------------------------------------------------------------
    def _latest_lane(self, direction: str) -> str | None:
        """The stream ``direction``'s latest transfer was queued on (None: none yet)."""
        return next((t.lane for t in reversed(self.transfers.values()) if t.direction == direction), None)

    def _mask(self, side: str, moves: Sequence[Move]) -> list[Mask]:
        mask = [np.zeros_like(k) for k in self.sides[side].known]
        for move in moves:
            row, lo, hi = move.at(side)
            mask[move.tensor][row, lo:hi] = True
        return mask

    def _invalidate_readers(self, side: str, written: Sequence[Mask], exempt: int = -1) -> None:
        """Pending transfers that read bytes now being written race with the write (only the other direction
        reads this side, and it is not ordered against it, R4): their capture there is unknown, and so is what
        they wrote from it. Readers up to submission index ``exempt`` are ordered before the write (R23)."""
        for reader in self.pending():
            if reader.reads != side or reader.index <= exempt:
                continue
            target = self.sides[reader.writes]
            for i, move in enumerate(reader.moves):
                row, lo, hi = move.at(side)
                hit = written[move.tensor][row, lo:hi]
                if hit.any():
                    reader.certain[i] = reader.certain[i] & ~hit
                    target.forget(move, hit, reader.index)


def _ids(block_ids: object) -> tuple[int, ...]:
    """Sorted, distinct ids."""
    return tuple(sorted({int(i) for i in block_ids}))  # type: ignore[attr-defined]
