"""The values a worker hands its caller: transfer results, the shutdown policy and report, the stats (R5, R8,
R10-R14).

Frozen dataclasses only, no behaviour beyond validating what the caller passes (``ShutdownPolicy``); the handler
and the worker's core build them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Final, Literal

from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.lifecycle import Policy
from kvoffload_ref.validate import check_seconds

__all__ = [
    "DEFAULT_TIMEOUT",
    "DeviceSync",
    "Ended",
    "HandlerReport",
    "HandlerStats",
    "JobOutcome",
    "RegionFate",
    "ShutdownPolicy",
    "ShutdownReport",
    "TransferResult",
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
    """

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class HandlerReport:
    """One handler's part of the shutdown report (R10).

    Attributes:
        drained: transfers proven complete during the shutdown drain (also when it was interrupted, R14).
        abandoned: transfers left with unknown completion.
        error: the first failure of the drain (a DeviceError, DeadlineExceeded, or the interrupting
            BaseException), or None.
        jobs: every job of this direction the caller was never handed, in submission order, with how it ended:
            with ``get_finished()`` it accounts for every accepted job exactly once (R8, R14).
    """

    drained: int = 0
    abandoned: int = 0
    error: BaseException | None = None
    jobs: tuple[JobOutcome, ...] = ()


Ended = Literal["unreaped", "drained", "abandoned"]


@dataclasses.dataclass(frozen=True)
class JobOutcome:
    """A job the caller was never handed by ``get_finished()``, as the shutdown report lists it (R8, R14).

    Attributes:
        result: its result: for "unreaped" the one ``get_finished()`` would have returned; for "drained" a
            success (``transfer_time`` None: the drain does not read timings); for "abandoned" a failure whose
            error says why the drain stopped.
        ended: "unreaped" (its completion was known before shutdown began, nobody reaped it), "drained" (proven
            by the shutdown drain) or "abandoned" (completion unknown, R10).
    """

    result: TransferResult
    ended: Ended


@dataclasses.dataclass(frozen=True)
class HandlerStats:
    """A frozen snapshot of one handler (never a view of its private fields)."""

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

    @property
    def unreported(self) -> tuple[JobOutcome, ...]:
        return (*self.store.jobs, *self.load.jobs)
