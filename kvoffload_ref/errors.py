"""The error taxonomy: a small set of exceptions that says whose fault a failure is.

* :class:`OffloadError` -- the common base of the errors below (all but :class:`SimHang`); never raised itself.
* :class:`InvalidTransferError` -- the caller's input was wrong (also a :class:`ValueError`).
* :class:`WorkerClosedError` -- the worker was used after its shutdown began (also a :class:`RuntimeError`).
* :class:`OwnershipError` -- a region was used by someone who does not own it (also a :class:`RuntimeError`).
* :class:`DeviceError` -- the device (or its driver) failed; ``.status`` carries a CUDA-style code and the
  backend's own exception, if any, is the ``__cause__``.
* :class:`TransferExpired` -- a :class:`DeviceError`: a transfer passed its deadline, was cancelled, or was queued
  behind one that did (R26); ``.reason`` says which.
* :class:`RegistrationRefused` -- a :class:`DeviceError`: the platform does not allow registering host memory at
  all (status 801), e.g. under confidential computing (vLLM #55428); a pinned allocation may still work.
* :class:`BlocksHeldError` -- an :class:`InvalidTransferError`: a submission touches blocks a late copy may still
  write or read (R27).
* :class:`DeadlineExceeded` -- a bounded wait ran out of time (also a :class:`TimeoutError`).
* :class:`LifecycleError` -- the library itself asked the lifecycle table for a transition it does not allow: a
  bug in kvoffload_ref, never the caller's fault.
* :class:`SimHang` -- a blocking wait met hung work and gave up after a hang horizon (simulated device, or an
  injected hang under ``FaultyBackend``). A :class:`BaseException`, not an :class:`OffloadError`, so that no
  ``except Exception`` swallows it.
* :class:`ShutdownDeferred` -- ``shutdown()`` was called on a thread that is itself inside a worker call (a signal
  handler interrupted it): the shutdown runs as that call returns (R19). A :class:`BaseException`, like trio's
  ``Cancelled``: if the handler lets it escape, it unwinds the interrupted call as an interrupt would (R14).

The ``CUDA_*`` constants are the CUDA runtime status codes the library names (``DeviceError.status``).
"""

from __future__ import annotations

from typing import Final, TypeVar

__all__ = [
    "BlocksHeldError",
    "DeadlineExceeded",
    "DeviceError",
    "InvalidTransferError",
    "LifecycleError",
    "OffloadError",
    "OwnershipError",
    "RegistrationRefused",
    "ShutdownDeferred",
    "SimHang",
    "TransferExpired",
    "WorkerClosedError",
    "detached",
    "submission_refused",
]

# CUDA runtime status codes the library names (CuPy exports none of them; values from the CUDA enum).
CUDA_SUCCESS: Final = 0
CUDA_ERROR_INVALID_VALUE: Final = 1
CUDA_ERROR_MEMORY_ALLOCATION: Final = 2
CUDA_ERROR_INSUFFICIENT_DRIVER: Final = 35
CUDA_ERROR_NO_DEVICE: Final = 100
CUDA_ERROR_INVALID_RESOURCE_HANDLE: Final = 400
CUDA_ERROR_NOT_READY: Final = 600
CUDA_ERROR_TIMEOUT: Final = 909
CUDA_ERROR_ILLEGAL_ADDRESS: Final = 700
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: Final = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: Final = 713
CUDA_ERROR_LAUNCH_FAILED: Final = 719
CUDA_ERROR_NOT_PERMITTED: Final = 800
CUDA_ERROR_NOT_SUPPORTED: Final = 801
CUDA_ERROR_UNKNOWN: Final = 999


class OffloadError(Exception):
    """Base class of every error kvoffload_ref raises on purpose. Not raised itself."""

    def __init__(self, *args: object) -> None:
        if type(self) is OffloadError:
            raise TypeError("OffloadError is abstract; raise one of its subclasses")
        super().__init__(*args)


class InvalidTransferError(OffloadError, ValueError):
    """The caller's input is invalid (R7). Raised before any device work; nothing changed."""


class WorkerClosedError(OffloadError, RuntimeError):
    """The worker's shutdown has begun (R8); it accepts no more transfers."""


class OwnershipError(OffloadError, RuntimeError):
    """A region was used by someone who does not own it (R1), e.g. released by the caller after a worker took it."""


class LifecycleError(OffloadError, RuntimeError):
    """The library asked for a lifecycle transition the tables forbid: a bug in kvoffload_ref."""


class DeadlineExceeded(OffloadError, TimeoutError):
    """A bounded wait ran out of time before what it waited for was proven complete."""


class SimHang(BaseException):
    """A blocking wait could not finish within a hang horizon: raised by the simulated device, and by
    ``FaultyBackend`` (on any device) when a blocking ``synchronize`` meets an injected hang.

    Derives from BaseException on purpose: no ``except Exception`` can swallow an unbounded wait (R11).
    """


class ShutdownDeferred(BaseException):
    """``shutdown()`` was called on a thread that is already inside a call of the same worker -- a signal handler
    that interrupted a submission, a ``get_finished()``, a poll of ``wait()``, or the shutdown itself (R19).

    The worker cannot shut down underneath the interrupted call (it would half-queue a submission or deadlock on
    its own lock), so the request is recorded and carried out, under the usual rules, as the interrupted call
    returns; a later ``shutdown()`` returns the report. A handler that only wants the worker shut down catches
    this; one that lets it escape unwinds the interrupted call like a ``KeyboardInterrupt`` (R14), and the
    interrupted call's caller sees it once the shutdown ran. A BaseException on purpose (as trio's
    ``Cancelled``): no ``except Exception`` in the interrupted code may swallow it.
    """


class DeviceError(OffloadError, RuntimeError):
    """The device failed.

    Attributes:
        status: the CUDA-style status code of the failure (e.g. 700 for an illegal address).
    """

    status: int

    def __init__(self, message: str, status: int = CUDA_ERROR_UNKNOWN) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.status))


def submission_refused(exc: DeviceError, direction: str, job_id: object) -> DeviceError:
    """The error a submission raises when a device call failed before the device took its copy (R5, R7, R14).

    Args:
        exc: the device's error (an injected ``copy`` fault, a failed ``create_event``, ...).
        direction: "store" or "load".
        job_id: the refused job's id.

    Returns:
        A DeviceError of the same status saying that the job was refused and nothing was queued (no result will
        come for it; the id stays free); ``exc`` itself when it is a subclass, which carries its own meaning.
    """
    if type(exc) is not DeviceError:
        return exc
    return DeviceError(f"{direction} job {job_id!r} was refused: nothing was queued, no result will come for it and "
                       f"the job id stays free (a device call failed before the device took the copy: {exc})",
                       exc.status)


class TransferExpired(DeviceError):
    """A transfer ended without proof of completion because of R26: its deadline passed, it was cancelled, or it was
    queued behind one of those on the same stream. Its copy may still run: its blocks are held until it is observed
    done (R27).

    Attributes:
        reason: ``"deadline"``, ``"cancel"`` or ``"behind"``.
        job_id: the job this error ended.
        ahead: for ``"behind"``, the job ahead of it whose deadline or cancel ended it; else None.
    """

    reason: str
    job_id: int
    ahead: int | None

    def __init__(self, message: str, reason: str = "deadline", job_id: int = -1, ahead: int | None = None) -> None:
        Exception.__init__(self, message)  # DeviceError's and OffloadError's own steps, inline: an expiry builds
        self.status = CUDA_ERROR_TIMEOUT  # one per queued transfer (thousands in one reap)
        self.reason, self.job_id, self.ahead = reason, job_id, ahead

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.reason, self.job_id, self.ahead))


class RegistrationRefused(DeviceError):
    """The platform does not allow registering host memory with the device: ``cudaHostRegister`` fails with
    ``cudaErrorNotSupported`` (801) for every size and flag, as on an H200 under NVIDIA Confidential Computing
    (vLLM #55428). Not sticky: the device works on, and a direct pinned allocation (``cudaHostAlloc``) may still be
    allowed. Raised by a backend's ``host_register``; the workers' ``pinning="auto"`` falls back to a pinned
    allocation on it (and on nothing else: any other registration failure is an ordinary :class:`DeviceError`).
    """

    def __init__(self, message: str, status: int = CUDA_ERROR_NOT_SUPPORTED) -> None:
        super().__init__(message, status)


class BlocksHeldError(InvalidTransferError):
    """A submission would touch blocks that a late copy may still write (any access) or read (writes) (R27);
    nothing changed, and the job id stays free. ``worker.held()`` lists the held blocks."""


E = TypeVar("E", bound=BaseException)


def detached(exc: E) -> E:
    """``exc`` without the tracebacks of its chain: an error a worker stores (in a result, a report) must not keep
    the frames it was raised through, nor the objects they hold."""
    link: BaseException | None = exc
    while link is not None:
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc
