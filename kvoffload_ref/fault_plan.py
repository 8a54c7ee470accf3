"""The fault plan: which backend calls fail or hang (:class:`Fault`, :class:`FaultPlan`, the fault points).

Both the simulated device and :class:`~kvoffload_ref.faults.FaultyBackend` consult a plan; the names here are
re-exported from :mod:`kvoffload_ref.faults`.

A :class:`Fault` selects calls at one *point* (see :data:`POINTS`) by transfer tag and by count:

* ``direction`` / ``job_id``: match the ``tag=(direction, job_id)`` the call carries (for ``event_query`` and
  ``event_sync``: the tag the event was last recorded with). A selector that is set never matches an untagged
  call.
* ``nth``: 1-based index among the calls at that point that match the other selectors (a reused job id counts
  again each time); ``None`` = every match.

Kinds:

* ``"error"``: the call raises ``DeviceError(status)``. With ``sticky=True`` the device is lost: every later call
  at any fault point fails with the same status and nothing queued runs any more.
* ``"hang"`` (points ``event_query``, ``event_sync``, ``copy``, ``device_sync`` only): the selected transfer's work
  never completes. For the first three the selection happens when the transfer is *submitted*: its start
  record (on a stream other than a compute stream, a transfer's tagged records come in start/end pairs; a
  tagged record that does not close an open pair of its tag is a start), and ``nth`` counts matching
  submissions, a reused job id included; at ``device_sync`` it selects the proof call.
* ``"slow"`` (points ``event_query``, ``event_sync``, ``copy`` only; ``duration=s`` required, a finite number of
  seconds > 0): selected at submission exactly like a hang (the same counting, the same selectors), but the stall
  ends by itself: the transfer's start event completes as usual and its copy starts ``duration`` backend seconds
  later, so its end event completes that much late (R26/R27: a late copy that does land). ``FaultyBackend`` does not
  apply slow faults (see its docstring); the simulated device does.

Release points (:data:`RELEASE_POINTS`: ``destroy`` = ``destroy_stream``/``destroy_event``, ``free`` =
``free_descriptors``, ``unmap`` = ``untrack_host``) take errors only; their calls are untagged, so only a fault
without ``direction`` and ``job_id`` selects them. A batched release (``destroy_events``, ``free_descriptors_many``)
is one call per item. Unlike every other point, a lost device does not fail them.

``plan.fired`` lists, in order, the faults that actually fired, so a test can assert its scenario happened.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from typing import Final, Literal

import numpy as np

from kvoffload_ref.backends.base import FaultPoint, Tag
from kvoffload_ref.errors import CUDA_ERROR_LAUNCH_FAILED, DeviceError, InvalidTransferError
from kvoffload_ref.validate import check_int, check_positive

__all__ = ["HANG_POINTS", "POINTS", "RELEASE_POINTS", "STALL_KINDS", "TRANSFER_HANG_POINTS", "Fault", "FaultKind",
           "FaultPlan", "FaultPoint"]

FaultKind = Literal["error", "hang", "slow"]

POINTS: Final[tuple[FaultPoint, ...]] = (
    "event_query", "event_sync", "copy", "device_sync", "host_register", "host_unregister",
    "stream_create", "event_create", "descriptor_alloc", "destroy", "free", "unmap",
)
#: The release points (besides ``host_unregister``): ``destroy_stream``/``destroy_event(s)``, ``free_descriptors``
#: (``_many``) and ``untrack_host`` (a region's unmap). An error there is a failed release step: the resource stays
#: live on the device, for the library to mark leaked (R16). A lost device does not fail them (R3: releasing goes
#: on); only an error fault that selects the call does.
RELEASE_POINTS: Final[tuple[FaultPoint, ...]] = ("destroy", "free", "unmap")
#: Points where a hang can be injected; the first three select a transfer at submission.
HANG_POINTS: Final[tuple[FaultPoint, ...]] = ("event_query", "event_sync", "copy", "device_sync")
TRANSFER_HANG_POINTS: Final[tuple[FaultPoint, ...]] = ("event_query", "event_sync", "copy")
#: The kinds a transfer's submission is offered to (:meth:`FaultPlan.select_hang`): both stall its stream.
STALL_KINDS: Final[tuple[FaultKind, ...]] = ("hang", "slow")


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected failure. See the module docstring for the selection rules.

    Attributes:
        point: where (one of :data:`POINTS`).
        kind: ``"error"``, ``"hang"`` or ``"slow"``.
        direction: None (any), ``"store"`` or ``"load"``.
        job_id: None (any) or an int (numpy ints are stored as Python ints; any size: it is only compared).
        nth: None (every match) or an int >= 1.
        sticky: a bool: the device is lost once this error fires.
        status: the ``DeviceError`` status, an int >= 0.
        duration: for ``"slow"`` only (required there, refused elsewhere): the backend seconds the stall lasts,
            a finite number > 0 (stored as a float).

    Raises:
        InvalidTransferError: (a ValueError) an unknown point or kind, a hang at a point that cannot hang, a slow
            fault at a point other than a transfer point (:data:`TRANSFER_HANG_POINTS`), a sticky hang or slow fault, a
            ``duration`` missing for ``"slow"`` or given for another kind, a ``duration`` that is not a finite number >
            0 (a bool, NaN, an infinity, zero, a negative number or a string is refused), a direction other than None,
            "store" or "load", a ``job_id`` that is not None or an int, an ``nth`` that is not None or an int >= 1, a
            ``sticky`` that is not a bool, or a ``status`` that is not an int >= 0 (a bool, a float or a string is
            refused: ``job_id=True`` would select job 1, and ``nth=1.5`` would never fire) (R7).
    """

    point: FaultPoint
    kind: FaultKind = "error"
    direction: str | None = None
    job_id: int | None = None
    nth: int | None = None
    sticky: bool = False
    status: int = CUDA_ERROR_LAUNCH_FAILED
    duration: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.point, str) or self.point not in POINTS:
            raise InvalidTransferError(f"unknown fault point {self.point!r}; expected one of {POINTS}")
        if not isinstance(self.kind, str) or self.kind not in ("error", "hang", "slow"):
            raise InvalidTransferError(f"unknown fault kind {self.kind!r}; expected 'error', 'hang' or 'slow'")
        if self.direction is not None and (not isinstance(self.direction, str)
                                           or self.direction not in ("store", "load")):
            raise InvalidTransferError(f"direction must be None, 'store' or 'load', got {self.direction!r}")
        if not isinstance(self.sticky, bool):
            raise InvalidTransferError(f"sticky must be a bool, got {type(self.sticky).__name__} {self.sticky!r}")
        if self.kind == "hang" and self.point not in HANG_POINTS:
            raise InvalidTransferError(f"a hang cannot be injected at {self.point!r}; only at {HANG_POINTS}")
        if self.kind == "slow" and self.point not in TRANSFER_HANG_POINTS:
            raise InvalidTransferError(f"a slow fault cannot be injected at {self.point!r}; only at "
                                       f"{TRANSFER_HANG_POINTS}")
        if self.kind != "error" and self.sticky:
            raise InvalidTransferError(f"sticky applies to errors only, not to a {self.kind!r} fault (e.g. "
                                       f"Fault({self.point!r}, 'error', sticky=True))")
        self._check_duration()
        if self.job_id is not None:
            object.__setattr__(self, "job_id", check_int("Fault.job_id", self.job_id))
        if self.nth is not None:
            if isinstance(self.nth, (int, np.integer)) and not isinstance(self.nth, bool) and self.nth < 1:
                raise InvalidTransferError(f"Fault.nth is 1-based: expected None or an int >= 1, got {self.nth}")
            object.__setattr__(self, "nth", check_int("Fault.nth", self.nth, minimum=1))
        object.__setattr__(self, "status", check_int("Fault.status", self.status, minimum=0))

    def _check_duration(self) -> None:
        """A slow fault's duration: required, a finite number of seconds > 0; refused for the other kinds (R7)."""
        if self.kind != "slow":
            if self.duration is not None:
                raise InvalidTransferError(f"duration applies to slow faults only, not to a {self.kind!r} fault")
            return
        if self.duration is None:
            raise InvalidTransferError("a slow fault needs duration= (seconds the stall lasts, a finite number > 0, "
                                       "e.g. duration=0.5)")
        object.__setattr__(self, "duration", check_positive("Fault.duration", self.duration, unit="seconds"))

    def matches(self, tag: Tag | None) -> bool:
        """Whether a call carrying ``tag`` is selected by this fault's direction/job_id selectors."""
        if self.direction is None and self.job_id is None:
            return True
        if tag is None:
            return False
        direction, job_id = tag
        return (self.direction is None or self.direction == direction) and (
            self.job_id is None or self.job_id == job_id
        )

    def __repr__(self) -> str:
        fields = [repr(self.point), repr(self.kind)]
        fields += [f"{name}={value!r}" for name in ("direction", "job_id", "nth")
                   if (value := getattr(self, name)) is not None]
        if self.sticky:
            fields.append("sticky=True")
        if self.status != CUDA_ERROR_LAUNCH_FAILED:
            fields.append(f"status={self.status!r}")
        if self.duration is not None:
            fields.append(f"duration={self.duration!r}")
        return f"Fault({', '.join(fields)})"


class FaultPlan:
    """A list of faults and the counters that decide when each fires. Thread-safe.

    Backends call :meth:`check` at every fault point, :meth:`select_hang` when a transfer is submitted, and
    :meth:`lost` to learn whether a sticky error has fired.
    """

    def __init__(self, faults: Iterable[Fault] = ()) -> None:
        # Invariant: faults only grows, through add() (a plan can be shared and printed); never reordered.
        self.faults: tuple[Fault, ...] = tuple(faults)
        # Invariant: _counts[i] = number of calls so far that matched faults[i]'s point and selectors.
        self._counts = [0] * len(self.faults)
        # Invariant: the faults that fired, in firing order (a fault firing on every match appears each time).
        self.fired: list[Fault] = []
        # Invariant: once set, the sticky fault that lost the device; every later fault-point call fails.
        self._lost: Fault | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FaultPlan([{', '.join(map(repr, self.faults))}])"

    def add(self, fault: Fault) -> None:
        """Arm one more fault, e.g. in the middle of a run. Thread-safe.

        The new fault's ``nth`` counts the matching calls made from now on (earlier calls are not counted), and a
        hang fault at a transfer point can only select transfers submitted from now on.

        Raises:
            TypeError: ``fault`` is not a :class:`Fault`.
        """
        if not isinstance(fault, Fault):
            raise TypeError(f"expected a Fault, got {type(fault).__name__}")
        with self._lock:
            self.faults = (*self.faults, fault)
            self._counts.append(0)

    def lost(self) -> Fault | None:
        """The sticky fault that lost the device, or None."""
        with self._lock:
            return self._lost

    def check(self, point: FaultPoint, tag: Tag | None = None) -> None:
        """Count one call at ``point`` and raise if an error fault selects it (or the device is lost).

        Hang faults at transfer points are not consulted here (see :meth:`select_hang`).

        Raises:
            DeviceError: an error fault fired, or a sticky fault lost the device earlier.
        """
        fault = self._select(point, tag, kinds=("error",))
        if fault is not None:
            what = "device lost: " if fault.sticky else ""
            raise DeviceError(f"{what}injected {point} failure (tag {tag}, {fault!r})", fault.status)

    def check_release(self, point: FaultPoint) -> None:
        """Count one untagged call at a release point (:data:`RELEASE_POINTS`) and raise if an error fault selects
        it. A lost device does not fail it.

        Raises:
            DeviceError: an error fault fired.
        """
        fault = self._select(point, None, kinds=("error",), consult_lost=False)
        if fault is not None:
            what = "device lost: " if fault.sticky else ""
            raise DeviceError(f"{what}injected {point} failure ({fault!r})", fault.status)

    def armed(self, point: FaultPoint) -> bool:
        """Whether any fault is armed at ``point`` (a batched call takes its one-pass path when none is)."""
        return any(fault.point == point for fault in self.faults)

    def check_hang(self, point: FaultPoint, tag: Tag | None = None) -> bool:
        """Count one call at ``point`` against hang faults (used for ``device_sync``); True if one fires.

        Raises:
            DeviceError: the device is lost.
        """
        self._raise_if_lost(point, tag)
        return self._select(point, tag, kinds=("hang",), consult_lost=False) is not None

    def select_hang(self, tag: Tag | None, kinds: tuple[FaultKind, ...] = STALL_KINDS) -> Fault | None:
        """Called once when a transfer is submitted: the hang or slow fault that selects it, if any.

        Args:
            tag: the transfer's tag.
            kinds: the stall kinds the caller applies (default both; ``FaultyBackend`` applies ``("hang",)``, so a
                slow fault neither counts nor fires there).
        """
        hits = [self._select(point, tag, kinds=kinds, consult_lost=False) for point in TRANSFER_HANG_POINTS]
        return next((fault for fault in hits if fault is not None), None)  # every point counts the call

    def _raise_if_lost(self, point: FaultPoint, tag: Tag | None) -> None:
        lost = self.lost()
        if lost is not None:
            raise DeviceError(f"device lost earlier ({lost!r}); {point} failed (tag {tag})", lost.status)

    def _select(self, point: FaultPoint, tag: Tag | None, *, kinds: tuple[FaultKind, ...],
                consult_lost: bool = True) -> Fault | None:
        if consult_lost:
            self._raise_if_lost(point, tag)
        with self._lock:
            chosen: Fault | None = None
            for i, fault in enumerate(self.faults):
                if fault.point != point or fault.kind not in kinds or not fault.matches(tag):
                    continue
                self._counts[i] += 1
                if chosen is None and (fault.nth is None or fault.nth == self._counts[i]):
                    chosen = fault
            if chosen is not None:
                self.fired.append(chosen)
                if chosen.sticky:
                    self._lost = chosen
            return chosen
