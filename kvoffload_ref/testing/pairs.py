"""The pair explorer: one thread paused at every backend call of a public method while a second thread runs
another (R4, R5, R8, R12, R14, R16, R19).

The call-point explorer interrupts one thread; this one puts a second thread where the first one stands. For each
configuration of the scenario (``scenario.CONFIGS``), each ordered pair (A, B) of the public methods a second
thread can meet (:data:`METHODS`: ``submit_store``, ``submit_load``, ``get_finished``, ``wait``, ``order_after``,
``cancel`` and ``shutdown``; construction and the finalizer path have no worker for a second thread to call, or one it
keeps alive) and each backend call ``k`` that A makes there (found by a first, counting run), it builds a fresh
worker through the factory, runs the scenario's prelude, then:

1. thread A calls its method and is paused at the start of its ``k``-th backend call (the sim's ``on_call`` hook
   and a ``threading.Event`` handshake, never a sleep);
2. thread B calls its method (a submission uses :data:`~kvoffload_ref.testing.scenario.SECOND`'s job, on other
   blocks and chunks) until it returns, raises, *blocks on the worker's lock*, or *waits on the worker's
   condition* (a second ``shutdown()`` awaiting the first one's report). Both are seen as they happen: the
   worker's lock is a :class:`~kvoffload_ref.testing.lock_watch.WatchedLock` (``lock_watch.py``);
3. A resumes and runs to its end while a blocked B is held back (so the two never run at once: every case is
   one interleaving, the same on every run); then B finishes.

The worker is then settled and checked exactly as by the single-thread explorer (``explorer.settle`` and
``explorer_checks.check_case``: every accepted job accounted for once, the region's fate, the ledger, the bytes,
no device misuse), and by ``pair_checks.check_pair``: no deadlock; no backend ``sleep()`` while holding the
worker's lock (checked at every sleep of every thread, the prelude and the settling included); nothing blocks
behind a running shutdown (with A paused inside a ``shutdown()`` that began, B's call returns at once:
``get_finished()`` empty, ``wait()`` and ``order_after()`` return, a submission raises ``WorkerClosedError``;
only a second ``shutdown()`` waits, for the first one's report, and returns it once A resumed); and each call's
own promises (a ``wait()`` that met a shutdown returns empty, never ``DeadlineExceeded`` or ``SimHang``; a
submission is queued whole or refused whole with ``WorkerClosedError``).

A watchdog (real seconds, :data:`WATCHDOG`) is only a safety net against a deadlock. :func:`explore_pairs`
returns the counts and every failure with a reproduction line; ``kvoffload-ref explore --pairs`` is the command.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Final

import numpy as np

from kvoffload_ref.backends.base import Tag
from kvoffload_ref.testing.adapter import Setup, SimDevice, WorkerFactory, WorkerLike, reference_factory
from kvoffload_ref.testing.explorer import own_heap, settle
from kvoffload_ref.testing.explorer_checks import check_case
from kvoffload_ref.testing.lock_watch import WatchedLock, watch_lock
from kvoffload_ref.testing.pair_checks import BLOCKED, RAN, STUCK, WAITED, PairOutcome, check_pair
from kvoffload_ref.testing.scenario import (
    CONFIGS,
    DEADLINES,
    REFERENCE_FACTORY,
    SECOND,
    UNDER_TEST,
    Failure,
    prelude,
    worker_call,
)
from kvoffload_ref.testing.threads import Runner

__all__ = ["METHODS", "WATCHDOG", "PairCase", "PairFailure", "PairResult", "count_points", "explore_pairs",
           "run_pair"]

#: The methods paired, in the order they are reported.
METHODS: Final = ("submit_store", "submit_load", "get_finished", "wait", "order_after", "cancel", "shutdown")
#: Real seconds a thread may take to pause, block or finish before the case is called a deadlock (a safety net).
WATCHDOG: Final = 10.0
_FIRST, _SECOND = "pair-first", "pair-second"


@dataclasses.dataclass(frozen=True)
class PairCase:
    """One case: thread A runs ``first`` and is paused at its ``point``-th backend call while B runs ``second``."""

    config: str
    first: str
    second: str
    point: int

    @property
    def method(self) -> str:
        """The paused method (what the single-thread checks call the method under test)."""
        return self.first

    @property
    def injection(self) -> str:
        """What is done at the call point: a second thread runs (never an interrupt)."""
        return "pair"

    def describe(self) -> str:
        """What was done where, for a failure's first line."""
        return f"{self.first} paused at backend call #{self.point} while {self.second} ran ({self.config})"

    def kind(self) -> tuple[str, str]:
        """The paused method and what ran meanwhile (what findings are grouped by, with the problem)."""
        return self.first, f"while {self.second}"

    def reproduction(self, factory: str = REFERENCE_FACTORY) -> str:
        """The command that reruns this case alone."""
        return (f"kvoffload-ref explore --pairs --factory {factory} --config {self.config} --method {self.first} "
                f"--second {self.second} --point {self.point}")


PairFailure = Failure[PairCase]  #: a rule broken in one pair case


@dataclasses.dataclass
class PairResult:
    """What :func:`explore_pairs` exercised and found."""

    # Invariant: (method, config) -> backend calls the method makes there (the points A is paused at).
    points: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    # Invariant: (first, second, config) -> cases run (one per point of first).
    cases: dict[tuple[str, str, str], int] = dataclasses.field(default_factory=dict)
    # Invariant: verdict (ran, blocked, waited, stuck) -> how many cases' second thread ended so.
    verdicts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    failures: list[PairFailure] = dataclasses.field(default_factory=list)

    def table(self) -> str:
        """Cases per pair (rows) and configuration (columns), then how the second threads ended, then totals."""
        configs = sorted({c for *_, c in self.cases}, key=list(CONFIGS).index)
        pairs = sorted({(a, b) for a, b, _ in self.cases}, key=lambda p: (METHODS.index(p[0]), METHODS.index(p[1])))
        width = max((len(f"{a} | {b}") for a, b in pairs), default=6)
        lines = [f"{'cases (A paused | B runs)':<{width}}  " + "  ".join(f"{c:>14}" for c in configs)]
        for a, b in pairs:
            lines.append(f"{f'{a} | {b}':<{width}}  " +
                         "  ".join(f"{self.cases.get((a, b, c), 0):>14}" for c in configs))
        lines.append("B " + ", ".join(f"{v}: {self.verdicts[v]}" for v in (RAN, BLOCKED, WAITED, STUCK)))
        lines.append(f"{sum(self.points.values())} call points, {sum(self.cases.values())} cases, "
                     f"{len(self.failures)} failures")
        return "\n".join(lines)

    def cases_per_method(self) -> dict[str, int]:
        """Paused method -> cases run (the findings' summary)."""
        per: dict[str, int] = {}
        for (first, _, _), n in self.cases.items():
            per[first] = per.get(first, 0) + n
        return per


class _Control:
    """The case's choreography: the sim's ``on_call`` hook (pauses A at its chosen call; checks every sleep) and
    the watched lock's :class:`~kvoffload_ref.testing.lock_watch.LockWatcher` (sees B block or wait, and holds it
    back until A finished)."""

    def __init__(self, point: int | None, out: PairOutcome) -> None:
        self._point, self._out = point, out
        self.calls = 0  # Invariant: backend calls A made so far
        self.fired = False  # Invariant: True once A was paused at its chosen call
        self.lock: WatchedLock | None = None
        self.verdict = ""  # Invariant: how B first stopped while A was paused (BLOCKED or WAITED), else ""
        self.first_stopped = threading.Event()  # A paused, or finished
        self.second_stopped = threading.Event()  # B blocked, waited, or finished
        self._resume = threading.Event()  # A may go on
        self._gate = threading.Event()  # B may take the lock: A finished

    def hook(self, point: str, tag: Tag | None) -> None:
        name = threading.current_thread().name
        if point == "sleep" and self.lock is not None and self.lock._is_owned():  # R19
            self._out.slept_locked.append({_FIRST: "thread A", _SECOND: "thread B"}.get(name, "the settling thread"))
        if name != _FIRST:
            return
        k, self.calls = self.calls, self.calls + 1
        if k == self._point:
            self.fired = True
            self.first_stopped.set()
            if not self._resume.wait(WATCHDOG):
                raise TimeoutError(f"thread A was paused at backend call #{k} and never resumed")

    def resume_first(self) -> None:
        self._resume.set()

    def open_gate(self) -> None:
        self._gate.set()

    def _held_back(self) -> bool:
        return threading.current_thread().name == _SECOND and not self._gate.is_set()

    # -- LockWatcher --
    def blocking(self) -> None:
        if self._held_back():
            self.verdict = self.verdict or BLOCKED
            self.second_stopped.set()
            self._gate.wait(WATCHDOG)

    def waiting(self) -> None:
        if self._held_back():
            self.verdict = self.verdict or WAITED
            self.second_stopped.set()

    def woken(self) -> None:
        if threading.current_thread().name == _SECOND:
            self._gate.wait(WATCHDOG)


def run_pair(case: PairCase, factory: WorkerFactory = reference_factory,
             name: str = REFERENCE_FACTORY) -> list[PairFailure]:
    """Run one pair case and check it.

    Args:
        case: which method pauses where, and which runs meanwhile.
        factory: builds the worker under test (one built on ``reference.Core``: its lock is watched).
        name: the factory's ``module:callable`` (for the reproduction line).

    Returns:
        The rules the case broke (empty: none).

    Raises:
        TypeError: the factory's worker is not built on ``reference.Core``.
    """
    return _judge(case, factory, name)[0]


def _judge(case: PairCase, factory: WorkerFactory, name: str) -> tuple[list[PairFailure], str]:
    """Run and check one case: its failures and how its second thread ended ("" when A was never paused)."""
    with own_heap():
        out = _run(case, factory)
        problems = [] if out.stuck else list(check_case(case, out))
        if out.fired:
            problems += check_pair(case.first, out)
    return [PairFailure(case, rules, message, name) for rules, message in problems], out.verdict


def count_points(config: str, method: str, factory: WorkerFactory = reference_factory) -> int:
    """How many backend calls ``method`` makes in ``config``, in a thread of its own, with no second thread."""
    with own_heap():
        return _run(PairCase(config, method, "", -1), factory).calls


def _run(case: PairCase, factory: WorkerFactory) -> PairOutcome:
    setup = CONFIGS[case.config]
    device = SimDevice(setup)
    jobs = [UNDER_TEST[case.first]] if case.first in UNDER_TEST else []
    if case.point >= 0 and case.second in SECOND:
        jobs.append(SECOND[case.second])
    out = PairOutcome(setup=setup, device=device, case=case, under_test=jobs, second=case.second,
                      cancelled="cancel" in (case.first, case.second),
                      deadlines=frozenset(DEADLINES.get(case.config, {})))
    control = _Control(case.point if case.point >= 0 else None, out)
    device.sim.on_call = control.hook
    worker = factory(device.backend, device.gpu, setup)
    control.lock = watch_lock(worker, control)
    out.accepted = prelude(worker, device, case.first, out.results, case.config)
    out.baseline_cpu = [np.array(a, copy=True) for a in worker.cpu_snapshot()]
    out.baseline_gpu = device.read_gpu()
    first = Runner(worker_call(case.first, worker, setup), _FIRST, signal=control.first_stopped)
    if not control.first_stopped.wait(WATCHDOG):
        out.stuck.append(f"thread A ({case.first})")
        return out
    second = _second(case, worker, setup, control, out) if control.fired else None
    control.resume_first()
    if not first.done.wait(WATCHDOG):
        out.stuck.append(f"thread A ({case.first})")
    control.open_gate()
    if second is not None and not second.done.wait(WATCHDOG):
        out.stuck.append(f"thread B ({case.second})")
    out.calls, out.fired = control.calls, control.fired
    _record(out, first, second)
    if not out.stuck:
        settle(out, worker)
    return out


def _second(case: PairCase, worker: WorkerLike, setup: Setup, control: _Control,
            out: PairOutcome) -> Runner[object]:
    """Start B with A paused; return once B finished, blocked on the lock or waits on the condition."""
    out.began = _shutdown_began(worker, control)
    second = Runner(worker_call(case.second, worker, setup, SECOND), _SECOND, signal=control.second_stopped)
    out.verdict = (control.verdict or RAN) if control.second_stopped.wait(WATCHDOG) else STUCK
    return second


def _shutdown_began(worker: WorkerLike, control: _Control) -> bool:
    """Whether thread A (paused) is the thread running the worker's shutdown sequence (``Core.shutdown_thread``,
    read while every other thread of the case is still)."""
    core = getattr(worker, "_core", None)
    runner = getattr(core, "shutdown_thread", None)
    return runner is not None and any(t.name == _FIRST and t.ident == runner for t in threading.enumerate())


def _record(out: PairOutcome, first: Runner[object], second: Runner[object] | None) -> None:
    """The two calls' results and exceptions; what a get_finished() returned joins the results (A's first)."""
    out.raised = first.exception
    out.returned = [first.result] if first.done.is_set() and first.exception is None else []
    if second is not None:
        out.second_raised = second.exception
        out.second_returned = [second.result] if second.done.is_set() and second.exception is None else []
    for method, returned in ((out.case_method(), out.returned), (out.second, out.second_returned)):
        if method == "get_finished" and returned and isinstance(returned[0], list):
            out.results.extend(returned[0])


def explore_pairs(factory: WorkerFactory = reference_factory, *, configs: Iterable[str] = CONFIGS,
                  firsts: Iterable[str] = METHODS, seconds: Iterable[str] = METHODS,
                  points: Iterable[int] | None = None, name: str = REFERENCE_FACTORY,
                  progress: Callable[[str], None] | None = None) -> PairResult:
    """Run every pair case: each configuration x paused method x its backend calls x method run meanwhile.

    Args:
        factory: builds the worker under test (one built on ``reference.Core``).
        configs: a subset of the scenario's configurations. firsts, seconds: subsets of :data:`METHODS` for the
            paused thread and for the other one.
        points: only these call points of the paused method (None: every one it makes).
        name: the factory's ``module:callable`` (for the reproduction lines).
        progress: called with a line per (paused method, configuration) explored.

    Returns:
        The points per (method, configuration), the cases per (pair, configuration), how the second threads
        ended, and every failure.

    Raises:
        ValueError: an unknown configuration or method.
        TypeError: the factory's worker is not built on ``reference.Core``.
    """
    configs, firsts, seconds = list(configs), list(firsts), list(seconds)
    unknown = (set(configs) - set(CONFIGS)) | (set(firsts) - set(METHODS)) | (set(seconds) - set(METHODS))
    if unknown:
        raise ValueError(f"configs, firsts, seconds: unknown configuration or method {sorted(unknown)}; expected "
                         f"configurations from {sorted(CONFIGS)} and methods from {sorted(METHODS)}")
    chosen = None if points is None else set(points)
    result = PairResult()
    for config in configs:
        for first in firsts:
            count = count_points(config, first, factory)
            result.points[(first, config)] = count
            found = len(result.failures)
            for case in _cases(config, first, count, seconds, chosen):
                result.cases[(first, case.second, config)] = result.cases.get((first, case.second, config), 0) + 1
                failures, verdict = _judge(case, factory, name)
                result.failures.extend(failures)
                result.verdicts[verdict or "not paused"] += 1
            if progress is not None:
                progress(f"{first:>13} / {config:<14} {count:3d} call points, "
                         f"{len(result.failures) - found} failures")
    return result


def _cases(config: str, first: str, count: int, seconds: list[str], chosen: set[int] | None) -> Iterator[PairCase]:
    for point in range(count):
        if chosen is not None and point not in chosen:
            continue
        for second in seconds:
            yield PairCase(config, first, second, point)
