"""The call-point explorer: every backend call of every public method, interrupted every way (R14, R19).

The conformance machine draws *some* interleavings; this explorer tries *all* of them for a fixed scenario. For
each configuration (:data:`CONFIGS`: a clean run, a failed transfer, a hung transfer, both policies, a shared
region, a deadline that passes), each public method (:data:`METHODS`: construction, ``submit_store``,
``submit_load``, ``get_finished``, ``wait``, ``order_after``, ``cancel``, ``shutdown`` and the finalizer path)
and each backend call ``k`` that method makes (found by a first, counting run), it builds a fresh worker
through the factory, brings it to the method's starting point with the same prelude, and injects at the start
of the ``k``-th call (:data:`INJECTIONS`):

* ``KeyboardInterrupt`` / ``SystemExit`` raised there; ``double``: a KeyboardInterrupt there and another at the
  next call (a second Ctrl-C while the first is handled);
* ``SIGINT``: a real SIGINT delivered there to Python's default handler (so a library that holds SIGINT back
  must still deliver it, and say so);
* ``handler_shutdown``: a signal handler that calls ``shutdown()`` there and catches what it raises (R19: it
  must neither deadlock nor half-queue anything, and the worker must be shut down once the interrupted call
  returned); ``handler_shutdown_exit``: a SIGTERM-style handler that calls ``shutdown()`` and then raises
  ``SystemExit``, letting whatever ``shutdown()`` raised escape; ``handler_cancel``: a signal handler that calls
  ``cancel`` on the queued jobs (R26: it never raises nor blocks; inside a call it is carried out as the call
  returns, and the call is not broken).

Then it settles the worker (waits, reaps, shuts down) and checks the rules as stated: the injected exception
propagated (R14); the submission under test is queued whole or left no trace and its id is free (R14, R7); no
result was lost or reported twice, every accepted job is accounted for by ``get_finished()`` or the report
(R5, R8, R14); a later ``shutdown()`` returns the report and it is marked interrupted when an interrupt
propagated out of a shutdown (R8, R14); the region ended released or quarantined, never released while
unproven under the quarantine policy (R12); the ledger agrees with the report (R16); every byte a successful
job moved is right and the device saw no misuse (no ``illegal_address``, ``*_under_dma``, ``dma_race``); and
no call deadlocked (a watchdog, real seconds, only as a safety net).

Everything is deterministic (the sim's ``on_call`` hook picks the call; the virtual clock; no sleeps) and runs in
the main thread (Python runs signal handlers there). :func:`explore` returns the counts per method and
configuration and every failure with a reproduction line; ``kvoffload-ref explore`` is the command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final

import numpy as np

from kvoffload_ref.backends.base import Tag
from kvoffload_ref.errors import DeadlineExceeded, WorkerClosedError
from kvoffload_ref.testing.adapter import SimDevice, WorkerFactory, WorkerLike, reference_factory
from kvoffload_ref.testing.explorer_checks import Outcome, check_case
from kvoffload_ref.testing.scenario import (
    CANCELLED,
    CONFIGS,
    DEADLINES,
    PROBE,
    REFERENCE_FACTORY,
    UNDER_TEST,
    Case,
    Failure,
    cpu,
    gpu,
    prelude,
    worker_call,
)

__all__ = ["CONFIGS", "INJECTIONS", "METHODS", "Case", "ExploreResult", "Failure", "explore", "guarded", "own_heap",
           "run_case", "settle"]

#: The public methods explored, in the order they are reported.
METHODS: Final = ("construct", "submit_store", "submit_load", "get_finished", "wait", "order_after", "cancel",
                  "shutdown", "finalizer")
#: Every way a call point is interrupted.
INJECTIONS: Final = ("KeyboardInterrupt", "SystemExit", "double", "SIGINT", "handler_shutdown",
                     "handler_shutdown_exit", "handler_cancel")
#: The injections that need Python's signal machinery (main thread only; not on the finalizer path, which a
#: collector may run in another thread).
SIGNAL_INJECTIONS: Final = frozenset({"SIGINT", "handler_shutdown", "handler_shutdown_exit", "handler_cancel"})
#: Real seconds a method may block before the explorer calls it a deadlock (a safety net, not a timing rule).
WATCHDOG: Final = 2.0


@dataclasses.dataclass
class ExploreResult:
    """What :func:`explore` exercised and found."""

    # Invariant: (method, config) -> number of backend calls the method makes there (the points explored).
    points: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    cases: int = 0
    # Invariant: method -> cases run (the findings' summary); its values sum to ``cases``.
    per_method: dict[str, int] = dataclasses.field(default_factory=dict)
    failures: list[Failure[Case]] = dataclasses.field(default_factory=list)

    def table(self) -> str:
        """Points per method (rows) and configuration (columns), then the totals."""
        configs = sorted({c for _, c in self.points}, key=list(CONFIGS).index)
        methods = [m for m in METHODS if any(k[0] == m for k in self.points)]
        width = max(len(m) for m in methods) if methods else 6
        lines = [f"{'points':<{width}}  " + "  ".join(f"{c:>14}" for c in configs)]
        for m in methods:
            lines.append(f"{m:<{width}}  " + "  ".join(f"{self.points.get((m, c), 0):>14}" for c in configs))
        lines.append(f"{sum(self.points.values())} call points, {self.cases} cases, "
                     f"{len(self.failures)} failures")
        return "\n".join(lines)


class _Injected(BaseException):
    """Marks the watchdog's interruption of a call that blocked (a deadlock)."""


class _Hook:
    """The sim's ``on_call`` hook: counts the calls of the method under test and injects at the chosen one."""

    def __init__(self, inject_at: int | None, action: Callable[[int], None]) -> None:
        self.calls = 0
        self.armed = False
        self._at = inject_at
        self._action = action
        # Invariant: True once the injection ran (at least its first part).
        self.fired = False

    def __call__(self, point: str, tag: Tag | None) -> None:
        if not self.armed:
            return
        k = self.calls
        self.calls += 1
        if self._at is not None and k in (self._at, self._at + 1):
            if k == self._at:
                self.fired = True
            self._action(k - self._at)


def run_case(case: Case, factory: WorkerFactory = reference_factory,
             name: str = REFERENCE_FACTORY) -> list[Failure[Case]]:
    """Run one case and check it.

    Args:
        case: what to interrupt where; ``point=-1`` runs the method without injecting (the counting run).
        factory: builds the worker under test (docs/conformance.md).
        name: the factory's ``module:callable`` (for the reproduction line).

    Returns:
        The rules the case broke (empty: none).
    """
    with own_heap():
        problems = list(check_case(case, _run(case, factory)))
    return [Failure(case, rules, message, name) for rules, message in problems]


def count_points(config: str, method: str, factory: WorkerFactory = reference_factory) -> int:
    """How many backend calls ``method`` makes in ``config`` without an interrupt."""
    with own_heap():
        return _run(Case(config, method, -1, "none"), factory).calls


@contextlib.contextmanager
def own_heap() -> Iterator[None]:
    """A case's garbage is its own: what existed before it is frozen (``gc.freeze``) for its duration, so the
    finalizer path's ``gc.collect()`` looks at the case's objects only (a full collection of a test session's
    heap costs ~100 times the rest of the case), and the case's garbage is collected as it ends (no finalizer of
    one case runs during another). When something else already froze objects, the heap is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        gc.unfreeze()


def _run(case: Case, factory: WorkerFactory) -> Outcome:
    setup = CONFIGS[case.config]
    device = SimDevice(setup)
    out = Outcome(setup=setup, device=device, case=case,
                  under_test=[UNDER_TEST[case.method]] if case.method in UNDER_TEST else [],
                  cancelled=case.method == "cancel", deadlines=frozenset(DEADLINES.get(case.config, {})))
    box: list[WorkerLike] = []  # Invariant: the only strong reference to the worker (the finalizer case drops it)
    hook = _Hook(case.point if case.point >= 0 else None, _injector(case, out))
    device.sim.on_call = hook
    with _signals(case, out):
        if case.method == "construct":
            hook.armed = True
            out.raised = guarded(lambda: box.append(factory(device.backend, device.gpu, setup)))
        else:
            box.append(factory(device.backend, device.gpu, setup))
            out.accepted = prelude(box[0], device, case.method, out.results, case.config)
            out.baseline_cpu = [np.array(a, copy=True) for a in box[0].cpu_snapshot()]
            out.baseline_gpu = device.read_gpu()
            call = _drop_last(box) if case.method == "finalizer" else worker_call(case.method, box[0], setup)
            out.worker_ref[:] = box if case.method != "finalizer" else []
            hook.armed = True
            out.raised = guarded(lambda: out.returned.append(call()))
        hook.armed = False
        out.worker_ref.clear()
    out.calls, out.fired = hook.calls, hook.fired
    if case.method == "finalizer":
        return out
    if case.method == "get_finished" and out.returned:
        out.results.extend(out.returned[0])  # type: ignore[arg-type]  # get_finished() returned a list
    if box:
        settle(out, box[0])
    return out


def guarded(call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` under the deadlock watchdog; what it raised (None if it returned)."""
    on_main = threading.current_thread() is threading.main_thread()
    previous = None
    if on_main:
        def _alarm(signum: int, frame: object) -> None:
            raise _Injected("deadlock: the call blocked for longer than the watchdog")
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, WATCHDOG)
    try:
        call()
    except BaseException as exc:  # the explorer judges what propagated
        return exc
    finally:
        if on_main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return None


def _drop_last(box: list[WorkerLike]) -> Callable[[], object]:
    """The finalizer path: drop the last reference (the finalizer runs, from the collector for a cycle); what
    it raised is reported as unraisable, so it is captured and re-raised here."""

    def drop() -> None:
        caught: list[BaseException] = []
        previous = sys.unraisablehook
        sys.unraisablehook = lambda info: caught.append(info.exc_value) if info.exc_value is not None else None
        try:
            box.clear()
            gc.collect()
        finally:
            sys.unraisablehook = previous
        if caught:
            raise caught[0]

    return drop


def _injector(case: Case, out: Outcome) -> Callable[[int], None]:
    """What happens at the chosen call (part 0) and at the next one (part 1, ``double`` only)."""
    kind = case.injection

    def act(part: int) -> None:
        if part == 1:
            if kind == "double":
                out.injected.append(KeyboardInterrupt("second"))
                raise out.injected[-1]
            return
        if kind in ("KeyboardInterrupt", "double"):
            out.injected.append(KeyboardInterrupt("explorer"))
            raise out.injected[-1]
        if kind == "SystemExit":
            out.injected.append(SystemExit("explorer"))
            raise out.injected[-1]
        if kind == "SIGINT":
            out.injected.append(KeyboardInterrupt("SIGINT"))
            signal.raise_signal(signal.SIGINT)
        elif kind in ("handler_shutdown", "handler_shutdown_exit", "handler_cancel"):
            signal.raise_signal(signal.SIGUSR1)

    return act


class _signals:
    """Python's default SIGINT handler and, for the handler injections, a SIGUSR1 handler that calls
    ``shutdown()`` on the worker under test; restored afterwards."""

    def __init__(self, case: Case, out: Outcome) -> None:
        self._case, self._out = case, out
        self._saved: list[tuple[int, object]] = []

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        out, kind = self._out, self._case.injection
        self._saved.append((signal.SIGINT, signal.signal(signal.SIGINT, signal.default_int_handler)))

        def _handler(signum: int, frame: object) -> None:
            worker = out.worker_ref[0] if out.worker_ref else None
            if worker is None:
                return
            out.handler_ran = True
            if kind == "handler_cancel":  # R26: a handler may cancel; inside a call it is carried out at its exit
                cancel = getattr(worker, "cancel", None)
                if callable(cancel):
                    out.cancelled = True
                    try:
                        cancel(CANCELLED)
                    except _Injected:
                        raise
                    except BaseException as exc:
                        out.handler_raised = exc
                return
            if kind == "handler_shutdown":
                try:
                    out.handler_report = worker.shutdown()
                except _Injected:
                    raise  # the watchdog: the handler's shutdown() blocked (a deadlock)
                except BaseException as exc:  # the documented handler catches what it raises
                    out.handler_raised = exc
                return
            try:
                out.handler_report = worker.shutdown()
            except BaseException as exc:
                out.handler_raised = exc
                raise
            out.injected.append(SystemExit("handler"))
            raise out.injected[-1]

        self._saved.append((signal.SIGUSR1, signal.signal(signal.SIGUSR1, _handler)))

    def __exit__(self, *exc: object) -> None:
        for signum, handler in reversed(self._saved):
            signal.signal(signum, handler)  # type: ignore[arg-type]


def settle(out: Outcome, worker: WorkerLike) -> None:
    """Reap and shut down what a case left, recording everything the checks read (the pair explorer's too)."""
    out.closed_after_call = _refuses_submission(out, worker)
    if not out.closed_after_call:
        pending = [j for j in out.accepted_or_tried() if j not in out.reported_ids()]
        with contextlib.suppress(DeadlineExceeded):
            worker.wait(set(pending), timeout=0.002)
        out.results.extend(worker.get_finished())
        out.reuse_refused = _reuse_refused(out, worker)
        out.final_cpu = [a.copy() for a in worker.cpu_snapshot()]
        out.final_gpu = out.device.read_gpu()
    out.final_raised = guarded(lambda: out.reports.append(worker.shutdown()))
    if out.reports:
        out.after_shutdown = list(worker.get_finished())
        out.reports.append(worker.shutdown())


def _refuses_submission(out: Outcome, worker: WorkerLike) -> bool:
    """Whether the worker is shut down (a fresh, empty submission is refused with WorkerClosedError)."""
    try:
        worker.submit_store(PROBE, gpu(), cpu())  # an empty transfer: copies nothing
    except WorkerClosedError:
        return True
    worker.wait({PROBE}, timeout=0.002)
    out.results.extend(r for r in worker.get_finished() if r.job_id != PROBE)
    return False


def _reuse_refused(out: Outcome, worker: WorkerLike) -> frozenset[int]:
    """The ids of the submissions under test still refused as in flight, though unreported (R14: an id never
    accepted must be free again; the checks ask which of these the device never took a copy of)."""
    refused = set()
    for _, job, _, _ in out.under_test:
        if job in out.reported_ids():
            continue
        try:
            worker.submit_store(job, gpu(), cpu())  # empty: copies nothing, takes the id
        except WorkerClosedError:
            continue
        except Exception:  # InvalidTransferError: "already in flight"
            refused.add(job)
            continue
        worker.wait({job}, timeout=0.002)
        out.results.extend(r for r in worker.get_finished() if r.job_id != job)
    return frozenset(refused)


def explore(factory: WorkerFactory = reference_factory, *, configs: Iterable[str] = CONFIGS,
            methods: Iterable[str] = METHODS, injections: Sequence[str] = INJECTIONS,
            points: Iterable[int] | None = None, name: str = REFERENCE_FACTORY,
            progress: Callable[[str], None] | None = None) -> ExploreResult:
    """Run every case: each configuration x method x backend call x injection.

    Args:
        factory: builds the worker under test.
        configs, methods, injections: subsets of :data:`CONFIGS`, :data:`METHODS`, :data:`INJECTIONS`.
        points: only these call points (None: every one the method makes).
        name: the factory's ``module:callable`` (for the reproduction lines).
        progress: called with a line per (method, configuration) explored.

    Returns:
        The points explored per (method, configuration), the number of cases, and every failure.

    Raises:
        RuntimeError: not called from the main thread (signal handlers run there only).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("explore() must run in the main thread: Python runs signal handlers there only")
    unknown = (set(configs) - set(CONFIGS)) | (set(methods) - set(METHODS)) | (set(injections) - set(INJECTIONS))
    if unknown:
        raise ValueError(f"configs, methods, injections: unknown {sorted(unknown)}; expected configurations from "
                         f"{sorted(CONFIGS)}, methods from {sorted(METHODS)}, injections from {sorted(INJECTIONS)}")
    chosen = None if points is None else set(points)
    result = ExploreResult()
    for config in configs:
        for method in methods:
            count = count_points(config, method, factory)
            result.points[(method, config)] = count
            found = 0
            for case in _cases(config, method, count, injections):
                if chosen is not None and case.point not in chosen:
                    continue
                failures = run_case(case, factory, name)
                result.cases += 1
                result.per_method[method] = result.per_method.get(method, 0) + 1
                found += len(failures)
                result.failures.extend(failures)
            if progress is not None:
                progress(f"{method:>13} / {config:<14} {count:3d} call points, {found} failures")
    return result


def _cases(config: str, method: str, points: int, injections: Sequence[str]) -> Iterator[Case]:
    for point in range(points):
        for injection in injections:
            if method == "finalizer" and injection in SIGNAL_INJECTIONS:
                continue
            yield Case(config, method, point, injection)
