"""The lifecycle state machines of kvoffload_ref, kept as data.

Three machines: the **worker** (open -> shutting down -> closed: which public calls are allowed when), each
**handler** (one per direction; accepting -> draining -> drained | abandoned -> closed: when a transfer may be
submitted, how the shutdown drain ends) and the **region** (caller-owned -> worker-owned -> released | quarantined:
who may release the host memory, and whether it is released at all). Two decision tables join them at shutdown:
:data:`PROOF_DECISION` (is the device-level proof needed? R13, R14) and :data:`FATE` (from the proof's outcome and
the policy: release or quarantine what may be under DMA, R12). Every transition lives here: ``reference.py``,
``handler.py`` and ``region.py`` report an input and do what the table decides. Every table is total: each (state,
input) pair maps to a ``Transition`` (next state, action) or a ``Refusal`` (the typed error; the state stays);
``tables.step`` reads one. No devices, clocks or I/O here; the docs diagram is generated from these tables.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from kvoffload_ref.errors import LifecycleError, OwnershipError, WorkerClosedError
from kvoffload_ref.tables import Refusal, Table, Transition

__all__ = ["FATE", "HANDLER_TABLE", "MACHINES", "PROOF_DECISION", "REGION_TABLE", "WORKER_TABLE", "Action", "Fate",
           "HandlerInput", "HandlerState", "Policy", "ProofOutcome", "RegionInput", "RegionState", "WorkerInput",
           "WorkerState"]


class _Member(enum.Enum):
    """A lifecycle enum: members hash by identity (a C slot), not by name through ``Enum.__hash__`` (a Python
    call): every public call looks up one or two ``(state, input)`` pairs in a table. Members are singletons and
    compare by identity, so the hash agrees with equality."""

    __hash__ = object.__hash__


class Action(_Member):
    """What the driver does after a transition."""

    PROCEED = "proceed"  # carry out the call normally
    NOTHING = "nothing"  # the call has no effect (idempotent repeats)
    RETURN_EMPTY = "return_empty"  # return at once, empty (get_finished/wait/order_after after shutdown began)
    RETURN_REPORT = "return_report"  # return the stored shutdown report (second shutdown, R8)
    AWAIT_REPORT = "await_report"  # wait for the running shutdown to finish, then return its report (R8, R19)
    RUN_SHUTDOWN = "run_shutdown"  # run the shutdown sequence (R9-R14)
    RELEASE = "release"  # release the region now (R3)
    QUARANTINE = "quarantine"  # keep the region mapped and pinned until process exit (R12)
    # -- a handler's actions --
    ENQUEUE = "enqueue"  # queue the transfer on the handler's stream (R4)
    REPORT = "report"  # the proven head leaves the queue and is reported success=True (R5)
    REPORT_FAILED = "report_failed"  # the failed head and every transfer behind it are reported failed (R5)
    REPORT_EXPIRED = "report_expired"  # a job past its deadline or cancelled, and those behind it: reported failed,
    # held, its stream retired (R26-R28)
    DROP_RESULTS = "drop_results"  # shutdown began: unreported results are dropped, nothing is reported (R8)
    COUNT_DRAINED = "count_drained"  # the proven head leaves the queue, counted as drained, not reported (R10)
    ABANDON = "abandon"  # every queued transfer is abandoned, completion unknown (R10, R14)
    RELEASE_RESOURCES = "release_resources"  # release streams, events, descriptor buffers (R10)


# -- worker -----------------------------------------------------------------------------------------------------
class WorkerState(_Member):
    OPEN = "open"
    SHUTTING_DOWN = "shutting_down"
    CLOSED = "closed"


class WorkerInput(_Member):
    SUBMIT = "submit"  # submit_store / submit_load
    GET_FINISHED = "get_finished"
    WAIT = "wait"
    SNAPSHOT = "snapshot"  # cpu_snapshot
    ORDER = "order_after"  # order_after: make a caller's stream wait for queued jobs on the device (R23)
    CANCEL = "cancel"  # cancel(job_ids) (R26)
    SHUTDOWN = "shutdown"  # shutdown() called (by the user, the context manager or the finalizer)
    SHUTDOWN_COMPLETE = "shutdown_complete"  # the sequence ran to its end
    INTERRUPTED = "interrupted"  # a BaseException cut the sequence short (R14)


_W, _WI = WorkerState, WorkerInput
_CLOSED_SUBMIT = Refusal(WorkerClosedError, "the worker's shutdown has begun; it accepts no transfers (R8)")
_CLOSED_SNAPSHOT = Refusal(WorkerClosedError, "the worker's CPU region is gone after shutdown began")
_NOT_SHUTTING_DOWN = Refusal(LifecycleError, "no shutdown is running")

WORKER_TABLE: Final[Table[Action]] = {
    (_W.OPEN, _WI.SUBMIT): Transition(_W.OPEN, Action.PROCEED),
    (_W.OPEN, _WI.GET_FINISHED): Transition(_W.OPEN, Action.PROCEED),
    (_W.OPEN, _WI.WAIT): Transition(_W.OPEN, Action.PROCEED),
    (_W.OPEN, _WI.SNAPSHOT): Transition(_W.OPEN, Action.PROCEED),
    (_W.OPEN, _WI.ORDER): Transition(_W.OPEN, Action.PROCEED),
    (_W.OPEN, _WI.CANCEL): Transition(_W.OPEN, Action.PROCEED),
    (_W.OPEN, _WI.SHUTDOWN): Transition(_W.SHUTTING_DOWN, Action.RUN_SHUTDOWN),
    (_W.OPEN, _WI.SHUTDOWN_COMPLETE): _NOT_SHUTTING_DOWN,
    (_W.OPEN, _WI.INTERRUPTED): _NOT_SHUTTING_DOWN,
    (_W.SHUTTING_DOWN, _WI.SUBMIT): _CLOSED_SUBMIT,
    (_W.SHUTTING_DOWN, _WI.GET_FINISHED): Transition(_W.SHUTTING_DOWN, Action.RETURN_EMPTY),
    (_W.SHUTTING_DOWN, _WI.WAIT): Transition(_W.SHUTTING_DOWN, Action.RETURN_EMPTY),
    (_W.SHUTTING_DOWN, _WI.SNAPSHOT): _CLOSED_SNAPSHOT,
    (_W.SHUTTING_DOWN, _WI.ORDER): Transition(_W.SHUTTING_DOWN, Action.RETURN_EMPTY),
    (_W.SHUTTING_DOWN, _WI.CANCEL): Transition(_W.SHUTTING_DOWN, Action.RETURN_EMPTY),  # R26: a no-op
    (_W.SHUTTING_DOWN, _WI.SHUTDOWN): Transition(_W.SHUTTING_DOWN, Action.AWAIT_REPORT),
    (_W.SHUTTING_DOWN, _WI.SHUTDOWN_COMPLETE): Transition(_W.CLOSED, Action.PROCEED),
    (_W.SHUTTING_DOWN, _WI.INTERRUPTED): Transition(_W.CLOSED, Action.PROCEED),
    (_W.CLOSED, _WI.SUBMIT): _CLOSED_SUBMIT,
    (_W.CLOSED, _WI.GET_FINISHED): Transition(_W.CLOSED, Action.RETURN_EMPTY),
    (_W.CLOSED, _WI.WAIT): Transition(_W.CLOSED, Action.RETURN_EMPTY),
    (_W.CLOSED, _WI.SNAPSHOT): _CLOSED_SNAPSHOT,
    (_W.CLOSED, _WI.ORDER): Transition(_W.CLOSED, Action.RETURN_EMPTY),
    (_W.CLOSED, _WI.CANCEL): Transition(_W.CLOSED, Action.RETURN_EMPTY),
    (_W.CLOSED, _WI.SHUTDOWN): Transition(_W.CLOSED, Action.RETURN_REPORT),
    (_W.CLOSED, _WI.SHUTDOWN_COMPLETE): _NOT_SHUTTING_DOWN,
    (_W.CLOSED, _WI.INTERRUPTED): _NOT_SHUTTING_DOWN,
}


# -- handler ----------------------------------------------------------------------------------------------------
class HandlerState(_Member):
    ACCEPTING = "accepting"
    DRAINING = "draining"
    DRAINED = "drained"  # every queued transfer was proven complete by its own event
    ABANDONED = "abandoned"  # the drain stopped early; the rest were abandoned, completion unknown
    CLOSED = "closed"  # transfer-side resources released (or handed to quarantine)


class HandlerInput(_Member):
    SUBMIT = "submit"
    HEAD_PROVEN = "head_proven"  # the oldest transfer's end event was observed done without error
    HEAD_FAILED = "head_failed"  # observing the oldest transfer raised (R5/R10)
    EXPIRE = "expire"  # a queued job passed its deadline or was cancelled (R26)
    BEGIN_DRAIN = "begin_drain"
    QUEUE_EMPTY = "queue_empty"  # nothing left to drain
    DEADLINE = "deadline"  # the shutdown budget ran out during the drain
    INTERRUPT = "interrupt"  # a BaseException arrived during the drain (R14)
    RELEASE = "release"


_H, _HI = HandlerState, HandlerInput
_H_CLOSED_SUBMIT = Refusal(WorkerClosedError, "the handler is shutting down; it accepts no transfers (R8)")
_NOT_DRAINING = Refusal(LifecycleError, "the handler is not draining")
_NOT_DRAINED = Refusal(LifecycleError, "the handler must finish draining before it is released")
_H_DONE = Refusal(LifecycleError, "the handler is closed")

HANDLER_TABLE: Final[Table[Action]] = {
    (_H.ACCEPTING, _HI.SUBMIT): Transition(_H.ACCEPTING, Action.ENQUEUE),
    (_H.ACCEPTING, _HI.HEAD_PROVEN): Transition(_H.ACCEPTING, Action.REPORT),
    (_H.ACCEPTING, _HI.HEAD_FAILED): Transition(_H.ACCEPTING, Action.REPORT_FAILED),
    (_H.ACCEPTING, _HI.EXPIRE): Transition(_H.ACCEPTING, Action.REPORT_EXPIRED),
    (_H.ACCEPTING, _HI.BEGIN_DRAIN): Transition(_H.DRAINING, Action.DROP_RESULTS),
    (_H.ACCEPTING, _HI.QUEUE_EMPTY): _NOT_DRAINING,
    (_H.ACCEPTING, _HI.DEADLINE): _NOT_DRAINING,
    (_H.ACCEPTING, _HI.INTERRUPT): _NOT_DRAINING,
    (_H.ACCEPTING, _HI.RELEASE): _NOT_DRAINED,
    (_H.DRAINING, _HI.SUBMIT): _H_CLOSED_SUBMIT,
    (_H.DRAINING, _HI.HEAD_PROVEN): Transition(_H.DRAINING, Action.COUNT_DRAINED),
    (_H.DRAINING, _HI.HEAD_FAILED): Transition(_H.ABANDONED, Action.ABANDON),
    (_H.DRAINING, _HI.EXPIRE): Refusal(LifecycleError, "the drain decides by the shutdown deadline; no job expires "
                                                       "while draining (R26)"),
    (_H.DRAINING, _HI.BEGIN_DRAIN): Refusal(LifecycleError, "the handler is already draining"),
    (_H.DRAINING, _HI.QUEUE_EMPTY): Transition(_H.DRAINED, Action.PROCEED),
    (_H.DRAINING, _HI.DEADLINE): Transition(_H.ABANDONED, Action.ABANDON),
    (_H.DRAINING, _HI.INTERRUPT): Transition(_H.ABANDONED, Action.ABANDON),
    (_H.DRAINING, _HI.RELEASE): _NOT_DRAINED,
    **{(state, inp): _H_CLOSED_SUBMIT if inp is _HI.SUBMIT else _H_DONE
       for state in (_H.DRAINED, _H.ABANDONED, _H.CLOSED) for inp in _HI},
    # The drain's end and a late interrupt after it abandoned: nothing left to do.
    (_H.ABANDONED, _HI.QUEUE_EMPTY): Transition(_H.ABANDONED, Action.NOTHING),
    (_H.ABANDONED, _HI.INTERRUPT): Transition(_H.ABANDONED, Action.NOTHING),
    (_H.DRAINED, _HI.RELEASE): Transition(_H.CLOSED, Action.RELEASE_RESOURCES),
    (_H.ABANDONED, _HI.RELEASE): Transition(_H.CLOSED, Action.RELEASE_RESOURCES),
    (_H.CLOSED, _HI.RELEASE): Transition(_H.CLOSED, Action.NOTHING),
}


# -- region -----------------------------------------------------------------------------------------------------
class RegionState(_Member):
    CALLER_OWNED = "caller_owned"  # built, not (yet) adopted by a worker (R1)
    WORKER_OWNED = "worker_owned"  # a worker's constructor returned successfully with it (R1)
    RELEASED = "released"  # unpinned, views dropped, unmapped (R3)
    QUARANTINED = "quarantined"  # kept mapped and pinned until process exit (R12)


class RegionInput(_Member):
    ADOPT = "adopt"  # a worker takes ownership
    CALLER_RELEASE = "caller_release"  # region.release() by its caller
    WORKER_RELEASE = "worker_release"  # the owning worker's shutdown proved it idle (or policy "release")
    WORKER_QUARANTINE = "worker_quarantine"  # the owning worker could not prove it idle
    DROPPED = "dropped"  # the region object was collected without release() (its finalizer)


_R, _RI = RegionState, RegionInput
_WORKER_OWNS = Refusal(OwnershipError, "a worker owns this region; its shutdown releases it (R1)")
_NOT_WORKERS = Refusal(LifecycleError, "the region is not owned by a worker")
_GONE = Refusal(OwnershipError, "the region was already released or quarantined")

REGION_TABLE: Final[Table[Action]] = {
    (_R.CALLER_OWNED, _RI.ADOPT): Transition(_R.WORKER_OWNED, Action.PROCEED),
    (_R.CALLER_OWNED, _RI.CALLER_RELEASE): Transition(_R.RELEASED, Action.RELEASE),
    (_R.CALLER_OWNED, _RI.WORKER_RELEASE): _NOT_WORKERS,
    (_R.CALLER_OWNED, _RI.WORKER_QUARANTINE): _NOT_WORKERS,
    (_R.CALLER_OWNED, _RI.DROPPED): Transition(_R.RELEASED, Action.RELEASE),  # the caller forgot release() (R3)
    (_R.WORKER_OWNED, _RI.ADOPT): Refusal(OwnershipError, "the region is already owned by a worker (R1)"),
    (_R.WORKER_OWNED, _RI.CALLER_RELEASE): _WORKER_OWNS,
    (_R.WORKER_OWNED, _RI.WORKER_RELEASE): Transition(_R.RELEASED, Action.RELEASE),
    (_R.WORKER_OWNED, _RI.WORKER_QUARANTINE): Transition(_R.QUARANTINED, Action.QUARANTINE),
    (_R.WORKER_OWNED, _RI.DROPPED): Transition(_R.WORKER_OWNED, Action.NOTHING),  # its worker's to release (R1)
    # Released or quarantined: gone for good; every other input changes nothing (R3: idempotent; R12: held until
    # process exit).
    **{(state, inp): _GONE if inp is _RI.ADOPT else Transition(state, Action.NOTHING)
       for state in (_R.RELEASED, _R.QUARANTINED) for inp in _RI},
}


# -- shutdown decisions -----------------------------------------------------------------------------------------
class ProofOutcome(_Member):
    """What the device-level proof (R13) established; the values are ``ShutdownReport.device_sync``'s strings."""

    NOT_NEEDED = "not_needed"  # the clean path held: every transfer proven by its own event; no proof ran
    OK = "ok"  # the proof ran and the device is idle
    TIMEOUT = "timeout"  # the proof ran out of time (the drain's deadline)
    FAILED = "failed"  # the proof raised a DeviceError
    SKIPPED = "skipped"  # a BaseException stopped all waiting (R14); no proof ran


class Policy(_Member):
    """``ShutdownPolicy.on_unproven``: what to do with memory that may still be under DMA."""

    QUARANTINE = "quarantine"  # the default: keep it alive until process exit (R12)
    RELEASE = "release"  # vLLM #51622: release regardless, after a best-effort proof


class Fate(_Member):
    """What happens to the region and to the descriptor buffers of unproven transfers."""

    RELEASE = "release"
    QUARANTINE = "quarantine"


#: (clean path held, interrupted) -> the proof's outcome decided without running it, or None: attempt the proof
#: (R13, R14).
PROOF_DECISION: Final[Mapping[tuple[bool, bool], ProofOutcome | None]] = {
    (True, False): ProofOutcome.NOT_NEEDED,
    (True, True): ProofOutcome.NOT_NEEDED,
    (False, False): None,
    (False, True): ProofOutcome.SKIPPED,
}

#: (proof outcome, policy) -> fate of whatever the proof covered (R12, R14). An interrupted shutdown
#: quarantines even under the release policy: the caller asked to stop, not to gamble.
FATE: Final[Mapping[tuple[ProofOutcome, Policy], Fate]] = {
    (ProofOutcome.NOT_NEEDED, Policy.QUARANTINE): Fate.RELEASE,
    (ProofOutcome.OK, Policy.QUARANTINE): Fate.RELEASE,
    (ProofOutcome.TIMEOUT, Policy.QUARANTINE): Fate.QUARANTINE,
    (ProofOutcome.FAILED, Policy.QUARANTINE): Fate.QUARANTINE,
    (ProofOutcome.SKIPPED, Policy.QUARANTINE): Fate.QUARANTINE,
    (ProofOutcome.NOT_NEEDED, Policy.RELEASE): Fate.RELEASE,
    (ProofOutcome.OK, Policy.RELEASE): Fate.RELEASE,
    (ProofOutcome.TIMEOUT, Policy.RELEASE): Fate.RELEASE,
    (ProofOutcome.FAILED, Policy.RELEASE): Fate.RELEASE,
    (ProofOutcome.SKIPPED, Policy.RELEASE): Fate.QUARANTINE,
}

#: The three machines as (state enum, input enum, table), by name: the docs diagram and the tests walk them.
MACHINES: Final[Mapping[str, tuple[type[enum.Enum], type[enum.Enum], Table[Action]]]] = {
    "worker": (WorkerState, WorkerInput, WORKER_TABLE),
    "handler": (HandlerState, HandlerInput, HANDLER_TABLE),
    "region": (RegionState, RegionInput, REGION_TABLE),
}
