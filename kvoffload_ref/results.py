"""The values a worker hands its caller: transfer results, the shutdown policy and report, the stats (R5, R8,
R10-R14).

Frozen dataclasses, no behaviour beyond validating what the caller passes (``ShutdownPolicy``); the handlers and
the worker build them, the report through :class:`ShutdownRun` (the scratch state of one shutdown sequence).
"""

from __future__ import annotations

import array
import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Literal, Protocol, overload

import numpy as np

from kvoffload_ref.backends.base import ResourceKind
from kvoffload_ref.errors import DeviceError, InvalidTransferError, detached
from kvoffload_ref.lifecycle import Policy, ProofOutcome, RegionState
from kvoffload_ref.validate import Int64Array, check_seconds

__all__ = [
    "DEFAULT_TIMEOUT",
    "DeviceSync",
    "RegionPinning",
    "Ended",
    "HandlerReport",
    "HandlerStats",
    "HeldBlocks",
    "JobOutcome",
    "JobOutcomes",
    "KeptRange",
    "RegionFate",
    "ReleasedHold",
    "ShutdownPolicy",
    "ShutdownReport",
    "ShutdownRun",
    "TransferResult",
    "TRANSFER_TYPE",
    "WorkerStats",
    "destination_blocks",
    "failed_in_order",
    "PoisonedBlocks",
    "Unproven",
    "by_group",
    "failure",
    "poisoned_by_tag",
    "poisoned_cpu_chunks",
    "poisoned_gpu_blocks",
    "poisoned_gpu_blocks_by_group",
    "proven",
    "stopped_outcomes",
]


@dataclasses.dataclass(frozen=True)
class TransferResult:
    """The outcome of one transfer, reported exactly once by ``get_finished`` (R5).

    Attributes:
        job_id: the caller's id.
        success: True only if the transfer's completion was proven.
        transfer_size: bytes copied (None when not proven).
        transfer_time: seconds between the transfer's start and end events (None when not proven or unknown).
        error: why it failed (None on success).
        invalid_blocks: R22: on failure, the destination blocks whose contents are now undefined, sorted and
            distinct -- for a load the GPU block ids it was to write, for a store the CPU chunk ids; () on success.
        transfer_type: ("GPU", "CPU") for a store, ("CPU", "GPU") for a load (as vLLM's older results had it).
        tag: the opaque ``tag=`` the submission carried (None if none), returned as given.
        invalid_blocks_by_group: R22 by KV-cache group: for a failed load, one tuple per group of its GPU spec
            (``group_sizes``), each that group's GPU block ids, sorted and distinct (an empty group gives ());
            () on success and for a store (its CPU chunks hold every group's pages, so they are not per group).
    """

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    error: BaseException | None = None
    invalid_blocks: tuple[int, ...] = ()
    transfer_type: tuple[str, str] | None = None
    tag: object = None
    invalid_blocks_by_group: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class HeldBlocks:
    """What late copies still hold (R27): ``worker.held()``.

    Attributes:
        gpu_blocks: every held GPU block id, sorted. cpu_chunks: every held CPU chunk id, sorted.
        gpu_blocks_writes_only: the GPU blocks held only against writes (a late store may still read them; a
            store may read them too). cpu_chunks_writes_only: likewise for CPU chunks (a late load reads them).
    """

    gpu_blocks: tuple[int, ...] = ()
    cpu_chunks: tuple[int, ...] = ()
    gpu_blocks_writes_only: tuple[int, ...] = ()
    cpu_chunks_writes_only: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ReleasedHold:
    """One ended hold (R27), handed out once by ``worker.take_released()``: the late copy was observed done, so
    its blocks may be used again (recompute what its failed result's ``invalid_blocks`` named before reading).

    Attributes:
        job_id: the late job. direction: "store" or "load". gpu_blocks, cpu_chunks: the ids it held, sorted.
        tag: the submission's ``tag=``.
    """

    job_id: int
    direction: str
    gpu_blocks: tuple[int, ...]
    cpu_chunks: tuple[int, ...]
    tag: object = None


@dataclasses.dataclass(frozen=True)
class HandlerReport:
    """One handler's part of the shutdown report (R10).

    Attributes:
        drained: transfers proven complete during the shutdown drain (also when it was interrupted, R14).
        abandoned: transfers the drain did not prove: a head whose end event failed, and those it then left with
            unknown completion (R10).
        error: the first failure of the drain (a DeviceError, DeadlineExceeded, or the interrupting
            BaseException), or None.
        jobs: every job of this direction the caller was never handed, in submission order, with how it ended:
            with ``get_finished()`` it accounts for every accepted job exactly once (R8, R14).
        retired_streams: retired streams (R28) that could not be proven idle, kept (not destroyed) until exit.
    """

    drained: int = 0
    abandoned: int = 0
    error: BaseException | None = None
    jobs: Sequence[JobOutcome] = ()
    retired_streams: int = 0


Ended = Literal["unreaped", "drained", "failed", "abandoned"]


@dataclasses.dataclass(frozen=True)
class JobOutcome:
    """A job the caller was never handed by ``get_finished()``, as the shutdown report lists it (R8, R14).

    Attributes:
        result: its result: for "unreaped" the one ``get_finished()`` would have returned (a success or a
            failure); for "drained" a success (``transfer_time`` None: the drain does not read timings); for
            "failed" and "abandoned" a failure whose error says why, with its ``invalid_blocks`` (R22).
        ended: "unreaped" (its result was known before shutdown began; nobody reaped it), "drained" (proven by the
            shutdown drain), "failed" (the drain's head, whose own end event reported an error) or "abandoned"
            (completion unknown: the drain stopped before proving it, R10).
    """

    result: TransferResult
    ended: Ended


@dataclasses.dataclass(frozen=True)
class HandlerStats:
    """A frozen snapshot of one handler (never a view of its private fields). Where a worker's polls ask the queue
    head's start event (the head has a deadline, or ``stall_warning`` is on), ``stats()`` asks it too if no poll saw
    it start yet (R30's age; a failure there fails the head, R5); otherwise it makes no device call."""

    direction: str
    state: str
    queued: int  # submitted, completion not yet known
    unreported: int  # completion known, not yet returned by get_finished
    submitted: int
    completed: int  # proven complete
    failed: int  # reported success=False
    abandoned: int  # left unproven by the shutdown drain
    unproven: int  # transfers whose resources wait for the device-level proof
    pooled_streams: int  # the handler's own stream (1 until released)
    pooled_events: int
    pooled_descriptors: int
    # R30: health (at the end, with defaults: positional callers keep working).
    oldest_unproven_age: float | None = None  # seconds (backend clock) since the device start of the oldest queued
    # transfer not yet proven, as polls saw it start (see above); None: none seen started
    held_gpu_blocks: int = 0  # R27: distinct GPU blocks held by this direction's late copies
    held_cpu_chunks: int = 0  # R27: distinct CPU chunks held by this direction's late copies
    oldest_hold_age: float | None = None  # seconds since the oldest of this direction's holds began, or None
    retired_streams: int = 0  # R28: retired streams not yet proven idle


DEFAULT_TIMEOUT: Final = 5.0


@dataclasses.dataclass(frozen=True, init=False)
class ShutdownPolicy:
    """How shutdown treats time and unproven memory.

    Built as ``ShutdownPolicy(timeout=5.0, on_unproven="quarantine")``; ``on_unproven`` may be a
    :class:`~kvoffload_ref.lifecycle.Policy` or its string value.

    Attributes:
        timeout: seconds (backend clock) for the whole shutdown: drains and the device-level proof (R11).
        policy: what to do with memory that may still be under DMA: ``Policy.QUARANTINE`` (default: keep it
            alive until process exit, R12) or ``Policy.RELEASE`` (vLLM #51622: release it after a best-effort
            proof). ``on_unproven`` is the same as a string ("quarantine" or "release").

    Raises:
        InvalidTransferError: a timeout that is not a finite number of seconds >= 0 (a bool, a string, NaN, an
            infinity and an int too large for a float, e.g. ``10**400``, are refused: see
            :func:`~kvoffload_ref.specs.check_seconds`), or an unknown on_unproven.
    """

    timeout: float
    policy: Policy

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, on_unproven: Policy | str = Policy.QUARANTINE) -> None:
        object.__setattr__(self, "timeout", check_seconds("timeout", timeout))
        object.__setattr__(self, "policy", _as_policy(on_unproven))

    @property
    def on_unproven(self) -> str:
        """The policy's string value, "quarantine" or "release" (the constructor's spelling)."""
        return self.policy.value

    def __repr__(self) -> str:
        return f"ShutdownPolicy(timeout={self.timeout!r}, on_unproven={self.on_unproven!r})"


def _as_policy(value: object) -> Policy:
    if isinstance(value, Policy):
        return value
    if isinstance(value, str) and value in _POLICIES:
        return _POLICIES[value]
    raise InvalidTransferError(f"on_unproven must be 'quarantine' or 'release', got {value!r}")


_POLICIES: Final = {p.value: p for p in Policy}

#: ``ShutdownReport.device_sync``: the values of :class:`~kvoffload_ref.lifecycle.ProofOutcome`, as strings.
DeviceSync = Literal["not_needed", "ok", "timeout", "failed", "skipped"]
RegionFate = Literal["released", "quarantined", "absent"]
#: How a region's memory is pinned: ``"registered"`` (a mapping, registered in R25's chunks), ``"allocated"``
#: (pinned memory allocated directly, where registration is refused), ``"pageable"`` (a mapping not registered).
RegionPinning = Literal["registered", "allocated", "pageable"]


@dataclasses.dataclass(frozen=True)
class KeptRange:
    """A range of the region kept in quarantine until process exit (R29).

    Attributes:
        offset: its first byte, from the region's start.
        length: its bytes.
        reason: why it is kept (the quarantine's reason).
    """

    offset: int
    length: int
    reason: str


@dataclasses.dataclass(frozen=True)
class ShutdownReport:
    """What shutdown did.

    Attributes:
        store, load: each handler's drain: transfers drained, abandoned, and the first failure (R10).
        device_sync: whether the device-level proof (R13) ran and what it established: "not_needed" (the clean
            path held), "ok", "timeout", "failed", or "skipped" (an interrupt stopped all waiting, R14).
        region: "released" or "quarantined" (R12); "absent" only if the region could not be finished at all.
        quarantined: ledger kind -> count kept alive on purpose until process exit (R12).
        leaked: ledger kind -> count the library could not release (a failed release step, R16).
        errors: every failure of the teardown, as text (R9).
        elapsed: seconds on the backend clock (R11).
        interrupted: a BaseException cut the shutdown short (R14).
        unreported: every job the caller was never handed by ``get_finished()``, store's first, each with how it
            ended (``store.jobs`` then ``load.jobs``): with ``get_finished()`` they account for every accepted job
            exactly once (R8, R14).
        kept: the ranges of the region kept in quarantine, in address order (R29: the registrations an unproven
            copy may still touch; the whole region where it cannot be given back in part); () when released.
        pinning: how the region was pinned (``"registered"``, ``"allocated"``: a pinned allocation, which a
            quarantine keeps whole and never frees, or ``"pageable"``).
    """

    store: HandlerReport
    load: HandlerReport
    device_sync: DeviceSync
    region: RegionFate
    quarantined: Mapping[str, int]
    leaked: Mapping[str, int]
    errors: tuple[str, ...]
    elapsed: float
    interrupted: bool
    kept: tuple[KeptRange, ...] = ()
    pinning: RegionPinning = "registered"

    @property
    def unreported(self) -> tuple[JobOutcome, ...]:
        return (*self.store.jobs, *self.load.jobs)


class JobOutcomes(Sequence[JobOutcome]):
    """A handler's ``HandlerReport.jobs``, built when first read: the jobs known before the drain (``head``), those
    the drain proved (their ids, Python ints of any size (R7), their byte counts, an int64 array, and their tags:
    () when no job of the handler carried one, else one per id), and those it stopped at (``tail``), in submission
    order. A teardown of thousands of transfers so allocates no outcome nobody reads."""

    def __init__(self, head: Sequence[JobOutcome], drained_ids: Sequence[int], drained_bytes: array.array[int],
                 kind: tuple[str, str], tail: Sequence[JobOutcome], drained_tags: Sequence[object] = ()) -> None:
        # Invariant: copies (the handler keeps appending to its own); len(drained_ids) == len(drained_bytes), and
        # drained_tags is () (all None) or as long.
        self._parts = (tuple(head), tuple(drained_ids), array.array("q", drained_bytes), kind, tuple(tail))
        self._tags = tuple(drained_tags)
        self._built: tuple[JobOutcome, ...] | None = None  # Invariant: the whole list once built

    def _all(self) -> tuple[JobOutcome, ...]:
        if self._built is None:
            head, ids, nbytes, kind, tail = self._parts
            tags = self._tags or itertools.repeat(None, len(ids))
            drained = (JobOutcome(TransferResult(job, True, size, transfer_type=kind, tag=tag), "drained")
                       for job, size, tag in zip(ids, nbytes, tags, strict=True))
            self._built = (*head, *drained, *tail)
        return self._built

    def __len__(self) -> int:
        head, ids, _, _, tail = self._parts
        return len(head) + len(ids) + len(tail)

    @overload
    def __getitem__(self, index: int) -> JobOutcome: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[JobOutcome, ...]: ...
    def __getitem__(self, index: int | slice) -> JobOutcome | tuple[JobOutcome, ...]:
        return self._all()[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and self._all() == tuple(other)

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


#: ``TransferResult.transfer_type`` of each direction.
TRANSFER_TYPE: Final[Mapping[str, tuple[str, str]]] = {"store": ("GPU", "CPU"), "load": ("CPU", "GPU")}


def destination_blocks(ids: Iterable[int]) -> tuple[int, ...]:
    """R22: a transfer's destination block ids as ``invalid_blocks`` lists them: sorted, distinct."""
    if isinstance(ids, np.ndarray):  # a record's ids: Python ints in one C call (an expiry builds thousands)
        return tuple(sorted(set(ids.tolist())))
    return tuple(sorted({int(i) for i in ids}))


class Unproven(Protocol):
    """What a failed result is built from: the fields both handlers' transfer records have."""

    @property
    def job_id(self) -> int: ...
    @property
    def dst_blocks(self) -> Int64Array: ...  # R22: the destination's ids (GPU blocks of a load, CPU chunks of a store)
    @property
    def dst_groups(self) -> tuple[int, ...]: ...  # a load's GPU spec's group_sizes; () for a store
    @property
    def user_tag(self) -> object: ...  # the submission's tag=


def by_group(blocks: Int64Array, groups: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """R22 by KV-cache group: ``blocks`` (group after group, ``groups`` the group sizes) as one sorted, distinct
    tuple per group; () when ``groups`` is () (a store)."""
    result, at = [], 0
    for size in groups:
        result.append(destination_blocks(blocks[at:at + size]))
        at += size
    return tuple(result)


def failure(kind: tuple[str, str], transfer: Unproven, error: BaseException | None) -> TransferResult:
    """R22: the failed result of ``transfer`` (its blocks, by group too, and its tag) with ``error``.

    Built without the frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field): an expiry builds one
    per queued transfer, thousands in one reap. The result is equal to the one ``__init__`` would build (every
    field is set; ``TransferResult`` has no ``__post_init__``)."""
    blocks, groups = transfer.dst_blocks, transfer.dst_groups
    result = _NEW(TransferResult)
    result.__dict__.update(_FAILED, job_id=transfer.job_id, error=error, invalid_blocks=destination_blocks(blocks),
                           transfer_type=kind, tag=transfer.user_tag,
                           invalid_blocks_by_group=by_group(blocks, groups) if groups else ())
    return result


def proven(job_id: int, nbytes: int, seconds: float | None, kind: tuple[str, str], tag: object) -> TransferResult:
    """R5: the result of a transfer proven complete (``nbytes`` copied in ``seconds``), built as :func:`failure`
    builds its results -- the fast engine builds one per proven job, and the frozen dataclass's ``__init__`` costs
    a microsecond more. Equal to ``TransferResult(job_id, True, nbytes, seconds, transfer_type=kind, tag=tag)``."""
    result = _NEW(TransferResult)
    fields = result.__dict__
    fields.update(_PROVEN)  # then each in place (no keyword dict to build and merge: ~0.3 us less)
    fields["job_id"], fields["transfer_size"], fields["transfer_time"] = job_id, nbytes, seconds
    fields["transfer_type"], fields["tag"] = kind, tag
    return result


_NEW: Final = object.__new__
#: Every field of a failed TransferResult, at its default but ``success`` (``failure`` sets the others).
_FAILED: Final = {**{f.name: f.default for f in dataclasses.fields(TransferResult)}, "success": False}
#: Every field of a proven TransferResult, at its default but ``success`` (``proven`` sets the others).
_PROVEN: Final = {**_FAILED, "success": True}


def failed_in_order(direction: str, failed: Sequence[Unproven], exc: DeviceError) -> list[TransferResult]:
    """R5/R22: a failed head and every transfer queued behind it, as failed results naming what they poisoned.

    Args:
        direction: "store" or "load". failed: the transfer records, head first.
        exc: the head's error. It is stored without its tracebacks (a stored error must not keep the frames it was
            raised through); each transfer behind the head gets a DeviceError caused by it.
    """
    exc = detached(exc)
    head, kind = failed[0].job_id, TRANSFER_TYPE[direction]
    results = []
    for transfer in failed:
        error: DeviceError = exc
        if transfer.job_id != head:
            error = DeviceError(f"{direction} job {transfer.job_id} was queued behind job {head}, which failed: its "
                                "data cannot be trusted", exc.status)
            error.__cause__ = exc
        results.append(failure(kind, transfer, error))
    return results


def stopped_outcomes(direction: str, stopped: Sequence[Unproven], error: BaseException | None, *,
                     head_failed: bool) -> list[JobOutcome]:
    """R10/R22: the jobs a shutdown drain stopped at, as the report lists them: each a failure naming the blocks it
    poisoned, ended "abandoned" (completion unknown) -- the first "failed" if its own end event reported ``error``.

    Args:
        direction: "store" or "load". stopped: the transfer records, head first.
        error: why the drain stopped (None: an interrupt before the drain began). head_failed: the head failed.
    """
    kind = TRANSFER_TYPE[direction]
    return [JobOutcome(failure(kind, transfer, error), "failed" if head_failed and i == 0 else "abandoned")
            for i, transfer in enumerate(stopped)]


def _results(source: Iterable[TransferResult] | ShutdownReport) -> list[TransferResult]:
    return [o.result for o in source.unreported] if isinstance(source, ShutdownReport) else list(source)


def _poisoned(source: Iterable[TransferResult] | ShutdownReport, kind: tuple[str, str]) -> tuple[int, ...]:
    return destination_blocks(b for r in _results(source) if not r.success and r.transfer_type == kind
                              for b in r.invalid_blocks)


def poisoned_gpu_blocks(source: Iterable[TransferResult] | ShutdownReport) -> tuple[int, ...]:
    """R22: the GPU blocks whose contents failed loads left undefined: recompute them before use.

    Args:
        source: results from ``get_finished()``, or a shutdown report (its ``unreported`` jobs).

    Returns:
        The sorted, distinct GPU block ids of every failed load in ``source``.
    """
    return _poisoned(source, TRANSFER_TYPE["load"])


def poisoned_cpu_chunks(source: Iterable[TransferResult] | ShutdownReport) -> tuple[int, ...]:
    """R22: the CPU chunks whose contents failed stores left undefined: never publish or load them.

    Args:
        source: results from ``get_finished()``, or a shutdown report (its ``unreported`` jobs).

    Returns:
        The sorted, distinct CPU chunk ids of every failed store in ``source``.
    """
    return _poisoned(source, TRANSFER_TYPE["store"])


def poisoned_gpu_blocks_by_group(source: Iterable[TransferResult] | ShutdownReport) -> dict[int, tuple[int, ...]]:
    """R22 by KV-cache group: the GPU blocks failed loads left undefined, per group (a model with several KV-cache
    groups recomputes each group's blocks on its own).

    Args:
        source: results from ``get_finished()``, or a shutdown report (its ``unreported`` jobs).

    Returns:
        Group index (the position in the GPU spec's ``group_sizes``) -> the sorted, distinct GPU block ids of that
        group over every failed load in ``source``; only groups with such a block are keys.
    """
    groups: dict[int, list[int]] = {}
    for result in _results(source):
        if not result.success and result.transfer_type == TRANSFER_TYPE["load"]:
            for group, blocks in enumerate(result.invalid_blocks_by_group):
                if blocks:
                    groups.setdefault(group, []).extend(blocks)
    return {group: destination_blocks(blocks) for group, blocks in sorted(groups.items())}


@dataclasses.dataclass(frozen=True)
class PoisonedBlocks:
    """R22 for one tag (``poisoned_by_tag``): what the failed jobs submitted with it poisoned.

    Attributes:
        gpu_blocks: as :func:`poisoned_gpu_blocks` (failed loads). cpu_chunks: as :func:`poisoned_cpu_chunks`
            (failed stores). gpu_blocks_by_group: as :func:`poisoned_gpu_blocks_by_group` (a dict, so a
            ``PoisonedBlocks`` compares by value but is not hashable).
    """

    gpu_blocks: tuple[int, ...] = ()
    cpu_chunks: tuple[int, ...] = ()
    gpu_blocks_by_group: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)


def poisoned_by_tag(source: Iterable[TransferResult] | ShutdownReport) -> dict[object, PoisonedBlocks]:
    """R22 per submission tag: what each tag's failed jobs poisoned (an engine that tags each transfer with its
    request recomputes per request, vLLM #54733).

    Args:
        source: results from ``get_finished()``, or a shutdown report (its ``unreported`` jobs).

    Returns:
        Tag -> its :class:`PoisonedBlocks`, for every tag (None for untagged jobs) with a failed job in
        ``source``, in the order the tags first failed.

    Raises:
        TypeError: a failed job's tag is not hashable (it cannot be a key).
    """
    failed: dict[object, list[TransferResult]] = {}
    for result in _results(source):
        if not result.success:
            try:
                failed.setdefault(result.tag, []).append(result)
            except TypeError:
                raise TypeError(f"poisoned_by_tag needs hashable tags; job {result.job_id} has a "
                                f"{type(result.tag).__name__}") from None
    return {tag: PoisonedBlocks(poisoned_gpu_blocks(results), poisoned_cpu_chunks(results),
                                poisoned_gpu_blocks_by_group(results)) for tag, results in failed.items()}


_REGION_FATE: Final[dict[RegionState, RegionFate]] = {
    RegionState.RELEASED: "released", RegionState.QUARANTINED: "quarantined"}


class ShutdownRun:
    """Scratch state of one shutdown sequence, turned into the report at its end."""

    def __init__(self) -> None:
        self.started = 0.0  # Invariant: the backend clock when the sequence began (0.0 until read).
        self.clean = True  # Invariant: every transfer drained so far was proven by its own end event (R13).
        self.proof = ProofOutcome.NOT_NEEDED
        self.interrupt: BaseException | None = None  # Invariant: the first BaseException that cut it short (R14).
        self.errors: list[str] = []
        # Invariant: "quarantined"/"leaked" -> ledger kind -> count, only counts > 0.
        self.counts: dict[str, dict[str, int]] = {"quarantined": {}, "leaked": {}}
        self.kept: tuple[KeptRange, ...] = ()  # Invariant: the region's kept ranges once quarantined (R29).
        self.pinning: RegionPinning = "registered"  # Invariant: how the region was pinned, once it was finished.

    def add(self, table: str, kind: str, count: int) -> None:
        if count:
            self.counts[table][kind] = self.counts[table].get(kind, 0) + count

    def report(self, store: HandlerReport, load: HandlerReport, region: RegionState, elapsed: float) -> ShutdownReport:
        return ShutdownReport(
            store=store, load=load, device_sync=self.proof.value,
            region=_REGION_FATE.get(region, "absent"), quarantined=dict(self.counts["quarantined"]),
            leaked=dict(self.counts["leaked"]), errors=tuple(self.errors), elapsed=elapsed,
            interrupted=self.interrupt is not None, kept=self.kept, pinning=self.pinning)


@dataclasses.dataclass(frozen=True)
class WorkerStats:
    """A frozen snapshot of a worker (for tests, invariants and dashboards)."""

    state: str
    store: HandlerStats
    load: HandlerStats
    region: str
    pinned: bool
    ledger_live: Mapping[ResourceKind, int]
    quarantined_bytes: int = 0  # R30: bytes of this worker's region kept in quarantine (0 while open)
    pinning: RegionPinning = "registered"  # how the region is pinned ("registered", "allocated", "pageable")
