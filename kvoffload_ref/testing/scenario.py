"""The explorers' scenario: the configurations, the prelude, the calls under test and what names a case.

The call-point explorer (``explorer.py``), the pair explorer (``pairs.py``) and their checks
(``explorer_checks.py``) all import this module and it imports none of them. A scenario is small on purpose:
three prelude jobs (one reaped, the others queued or proven but unreaped), one store and one load under test, and
a second pair of jobs on other blocks and chunks for the second thread of a pair (so two submissions under test
never touch the same memory: a race between them would be the caller's, not the worker's).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Final, Generic, Protocol, TypeVar

from kvoffload_ref.errors import DeadlineExceeded
from kvoffload_ref.faults import Fault
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.testing.adapter import Setup, SimDevice, WorkerLike
from kvoffload_ref.worker import ShutdownPolicy

__all__ = ["CANCELLED", "CONFIGS", "DEADLINES", "HUNG_TIMEOUT", "PRELUDE", "PROBE", "REFERENCE_FACTORY", "SECOND",
           "TIMEOUT", "UNDER_TEST", "Case", "CaseLike", "Failure", "Job", "cpu", "gpu", "prelude", "worker_call"]

#: The factory explored when none is named: kvoffload_ref's own worker.
REFERENCE_FACTORY: Final = "kvoffload_ref.testing.adapter:reference_factory"

_PAGE = 64
#: The job id of the empty submission that probes whether the worker still accepts work.
PROBE: Final = 99
_LAYOUT = KVCacheLayout(tensor_page_bytes=(_PAGE, _PAGE), groups=((LayerRef(0, _PAGE), LayerRef(1, _PAGE)),))


def gpu(*blocks: int) -> GPULoadStoreSpec:
    """A one-group GPU spec over ``blocks`` (none: an empty transfer)."""
    return GPULoadStoreSpec(list(blocks), group_sizes=(len(blocks),), block_indices=(0,))


def cpu(*chunks: int) -> CPULoadStoreSpec:
    """A CPU spec over ``chunks``."""
    return CPULoadStoreSpec(list(chunks))


#: Seconds (virtual) of a configuration's shutdown; the explored ``wait`` waits half of it.
TIMEOUT: Final = 0.004
#: The same in a hung configuration. There a drain, a proof and a wait poll until their deadline, one backend call
#: after another (an event query, the clock, a sleep, each a call point); the polls of a short schedule still reach
#: every kind of call (a first query, a sleep that doubles, one cut short by the deadline, the last query at the
#: deadline, the proof that finds its deadline passed) in half as many polls, and the other jobs still complete
#: inside it (every case ends as one of the same outcomes as with the long timeout: the same reports, results and
#: exceptions per method and injection).
HUNG_TIMEOUT: Final = 0.0002


def _setup(faults: tuple[Fault, ...] = (), on_unproven: str = "quarantine", shared: bool = False,
           timeout: float = TIMEOUT, refuse: bool = False) -> Setup:
    return Setup(layout=_LAYOUT, blocks_per_chunk=2, num_gpu_blocks=12, num_cpu_chunks=6, gpu_row_pad=(0, 0),
                 policy=ShutdownPolicy(timeout=timeout, on_unproven=on_unproven), faults=faults,
                 shared_region=shared, refuse_registration=refuse)


#: name -> the setup of a configuration. Together they reach every path of shutdown: the clean path, a failed
#: transfer (its head's end event fails: R5 reports it, the proof runs), a hung transfer (the drain times out,
#: the proof times out, quarantine), the same under the release policy, a shared /dev/shm region, a hung
#: transfer with a deadline (R26: it expires at the first poll past it, whichever call polls; its stream is
#: retired and its blocks held, R27/R28), and a platform that refuses host registration, clean and hung (the
#: region is one pinned allocation: built in its place, R2; freed at release, R3; kept whole by a quarantine, R12).
CONFIGS: Final[dict[str, Setup]] = {
    "clean": _setup(),
    "failed": _setup((Fault("event_query", "error", job_id=1),)),
    "hung": _setup((Fault("copy", "hang", job_id=2),), timeout=HUNG_TIMEOUT),
    "hung-release": _setup((Fault("copy", "hang", job_id=2),), on_unproven="release", timeout=HUNG_TIMEOUT),
    "failed-release": _setup((Fault("event_query", "error", job_id=1),), on_unproven="release"),
    "shared": _setup(shared=True),
    "expired": _setup((Fault("copy", "hang", job_id=2),), timeout=HUNG_TIMEOUT),
    "allocated": _setup(refuse=True),
    "allocated-hung": _setup((Fault("copy", "hang", job_id=2),), timeout=HUNG_TIMEOUT, refuse=True),
}
#: configuration -> {prelude job id: its deadline} (R26; seconds from its start on the device). In "expired" the
#: hung load 2 starts at the prelude's first look and passes its deadline before any method under test polls.
DEADLINES: Final[dict[str, dict[int, float]]] = {"expired": {2: 5e-5}}
#: The ids a ``cancel`` under test (or a signal handler's) lists: the queued prelude jobs and an unknown one.
CANCELLED: Final = frozenset({2, 3, 99})

#: (direction, job id, source spec, destination spec) of the prelude's jobs and of the jobs under test.
Job = tuple[str, int, object, object]
PRELUDE: Final[tuple[Job, ...]] = (
    ("store", 1, gpu(0, 1), cpu(0)),
    ("load", 2, cpu(1), gpu(2, 3)),
    ("store", 3, gpu(4, 5), cpu(2)),
)
#: method -> the job it submits (the first thread's, and the single explorer's).
UNDER_TEST: Final[dict[str, Job]] = {
    "submit_store": ("store", 10, gpu(6, 7), cpu(3)),
    "submit_load": ("load", 11, cpu(3), gpu(6, 7)),
}
#: method -> the job the second thread of a pair submits: other ids, blocks and chunks than every job above.
SECOND: Final[dict[str, Job]] = {
    "submit_store": ("store", 20, gpu(8, 9), cpu(4)),
    "submit_load": ("load", 21, cpu(5), gpu(10, 11)),
}


class CaseLike(Protocol):
    """What the checks read of a case (a :class:`Case`, or a pair's case)."""

    @property
    def config(self) -> str: ...
    @property
    def method(self) -> str: ...
    @property
    def point(self) -> int: ...
    @property
    def injection(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class Case:
    """One exploration: interrupt ``method`` at its ``point``-th backend call with ``injection``."""

    config: str
    method: str
    point: int
    injection: str

    def describe(self) -> str:
        """What was done where, for a failure's first line."""
        return f"{self.method} at backend call #{self.point} with {self.injection} ({self.config})"

    def kind(self) -> tuple[str, str]:
        """The method and how it was interrupted (what findings are grouped by, with the problem)."""
        return self.method, self.injection

    def reproduction(self, factory: str = REFERENCE_FACTORY) -> str:
        """The command that reruns this case alone."""
        return (f"kvoffload-ref explore --factory {factory} --config {self.config} --method {self.method} "
                f"--point {self.point} --injection {self.injection}")


class _Reproducible(Protocol):
    @property
    def point(self) -> int: ...
    def describe(self) -> str: ...
    def kind(self) -> tuple[str, str]: ...
    def reproduction(self, factory: str = ...) -> str: ...


C = TypeVar("C", bound=_Reproducible)


@dataclasses.dataclass(frozen=True)
class Failure(Generic[C]):
    """A rule broken in one case (of either explorer): the rules' tags, what happened, and how to rerun it."""

    case: C
    rules: str
    message: str
    factory: str = REFERENCE_FACTORY

    def __str__(self) -> str:
        return (f"[{self.rules}] {self.case.describe()}: {self.message}\n"
                f"    reproduce: {self.case.reproduction(self.factory)}")


def worker_call(method: str, worker: WorkerLike, setup: Setup, jobs: dict[str, Job] = UNDER_TEST
                ) -> Callable[[], object]:
    """The call under test, on a worker after the prelude (``wait`` waits half the shutdown's timeout: store 3
    completes during it, the hung load does not).

    Args:
        method: a public method (not ``construct`` or ``finalizer``).
        worker: the worker after :func:`prelude`. setup: its setup.
        jobs: the submissions' jobs (:data:`UNDER_TEST`, or :data:`SECOND` for a pair's second thread).

    Returns:
        The call, not yet made.

    Raises:
        ValueError: an unknown method.
    """
    if method in jobs:
        direction, job, src, dst = jobs[method]
        submit = worker.submit_store if direction == "store" else worker.submit_load
        return lambda: submit(job, src, dst)  # type: ignore[arg-type]
    if method == "get_finished":
        return worker.get_finished
    if method == "wait":
        return lambda: worker.wait({1, 2, 3}, timeout=setup.policy.timeout / 2)
    if method == "order_after":  # R23: a named stream of the sim waits for the queued jobs (and an unknown id)
        return lambda: worker.order_after({2, 3, 99}, stream="explorer")
    if method == "cancel":  # R26: the queued jobs (and an unknown id); nothing for a worker without cancel
        cancel = getattr(worker, "cancel", None)
        return (lambda: cancel(CANCELLED)) if callable(cancel) else (lambda: None)
    if method == "shutdown":
        return worker.shutdown
    raise ValueError(f"method must be a submission ({', '.join(map(repr, jobs))}) or one of 'get_finished', "
                     f"'wait', 'order_after', 'cancel', 'shutdown', got {method!r} (e.g. 'wait')")


def prelude(worker: WorkerLike, device: SimDevice, method: str, results: list[object],
            config: str = "") -> list[int]:
    """Bring the worker to the method's starting point: three jobs submitted (with the configuration's
    :data:`DEADLINES`), the first one reaped (when it can be), the others left queued or proven but unreaped.

    Args:
        worker: a fresh worker. device: its device. method: the method explored next.
        results: receives what ``get_finished()`` returned. config: the configuration's name.

    Returns:
        The accepted job ids.
    """
    accepted, deadlines = [], DEADLINES.get(config, {})
    for direction, job, src, dst in PRELUDE:
        submit = worker.submit_store if direction == "store" else worker.submit_load
        options = {"deadline": deadlines[job]} if job in deadlines else {}
        submit(job, src, dst, **options)  # type: ignore[arg-type]
        accepted.append(job)
        if job == 1:
            with contextlib.suppress(DeadlineExceeded):
                worker.wait({1}, timeout=0.002)
            results.extend(worker.get_finished())
    if method in ("get_finished", "shutdown", "finalizer"):
        device.advance(0.001)  # the rest completes (unless hung): proven at the next look, not yet reaped
    return accepted
