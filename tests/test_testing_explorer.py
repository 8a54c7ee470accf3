"""The call-point explorer (kvoffload_ref.testing.explorer): every backend call of every public method, in every
configuration, interrupted every way, finds nothing on the library -- and finds the bugs it was built for."""

from __future__ import annotations

import ast
import logging
import pathlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from _support import FACTORIES, WORKERS

from kvoffload_ref import lockcheck
from kvoffload_ref.backends.base import Backend
from kvoffload_ref.cli import EXPLORE_CONFIGS, EXPLORE_INJECTIONS, EXPLORE_METHODS, main
from kvoffload_ref.reference import Core
from kvoffload_ref.testing import explorer, mutants
from kvoffload_ref.testing.adapter import Setup, WorkerLike, reference_factory, reference_worker_factory
from kvoffload_ref.testing.explorer import CONFIGS, INJECTIONS, METHODS, Case, explore, run_case


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """Thousands of interrupted shutdowns log as designed; keep the test output readable."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.rule("R5")
@pytest.mark.rule("R8")
@pytest.mark.rule("R12")
@pytest.mark.rule("R14")
@pytest.mark.rule("R16")
@pytest.mark.rule("R19")
@pytest.mark.rule("R21")
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("worker", WORKERS)
def test_explorer_every_call_point_of_every_method_breaks_no_rule(worker: str, config: str) -> None:
    """Each configuration, each public method, each backend call it makes, each injection: no rule broken, on
    the engine and on the reference worker."""
    factory, name = FACTORIES[worker]
    result = explore(factory, configs=[config], name=name)
    print(result.table())
    assert {m for m, _ in result.points} == set(METHODS)
    assert all(result.points[(m, config)] > 0 for m in METHODS)  # every method reaches the device
    assert result.cases >= 5 * sum(result.points.values()) // 2
    assert not result.failures, "\n".join(map(str, result.failures[:10]))


@pytest.mark.parametrize("worker", WORKERS)
def test_explorer_reaches_the_paths_of_shutdown(worker: str) -> None:
    """The configurations differ where they must: a failure and a hang make shutdown longer (the proof, the
    drain's polls: of a late copy held since its failure, R27, or of a hung one), and the hang makes wait() poll
    until its deadline."""
    factory, _ = FACTORIES[worker]
    points = {c: explorer.count_points(c, "shutdown", factory) for c in CONFIGS}
    assert points["clean"] < min(points["failed"], points["hung"])
    assert explorer.count_points("hung", "wait", factory) > explorer.count_points("clean", "wait", factory)


def _swallowing_reference(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """A deliberately wrong reference worker: the kit's ``interrupts_swallowed`` mutant applied to it."""
    return mutants._Swallower(reference_worker_factory(backend, gpu, setup))


#: The kit's ``interrupts_swallowed`` mutant on each worker: (factory, its name).
SWALLOWING: dict[str, tuple[Any, str]] = {
    "engine": (mutants.interrupts_swallowed, "kvoffload_ref.testing.mutants:interrupts_swallowed"),
    "reference": (_swallowing_reference, "tests.test_testing_explorer:_swallowing_reference"),
}


@pytest.mark.rule("R14")
@pytest.mark.parametrize("worker", WORKERS)
def test_explorer_catches_a_swallowed_interrupt(worker: str) -> None:
    factory, name = SWALLOWING[worker]
    result = explore(factory, configs=["clean"], methods=["submit_store"], injections=["KeyboardInterrupt"],
                     name=name)
    assert result.failures and all(f.rules.startswith("R14") for f in result.failures)
    assert "did not propagate" in result.failures[0].message
    assert f"--factory {name}" in str(result.failures[0])


def _found(cases: Sequence[Case], factory: Any = reference_factory) -> list[str]:
    return [str(f) for case in cases for f in run_case(case, factory)]


@pytest.mark.rule("R14")
def test_explorer_catches_a_shutdown_interrupted_before_its_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug of the code before: an interrupt before the drain began left both handlers accepting, so the
    release refused and the worker stayed half shut down with everything live."""
    monkeypatch.setattr(Core, "_stop_waiting", lambda self, run, shield: None)
    found = _found([Case("hung", "shutdown", 0, "KeyboardInterrupt")])
    assert any("neither released nor quarantined" in f or "live after shutdown" in f for f in found)


@pytest.mark.rule("R14")
def test_explorer_catches_results_lost_between_the_two_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug of the code before: get_finished() took the store handler's results, then an interrupt in the
    load handler's reap lost them."""
    def old_get_finished(self: Core) -> list[Any]:
        with self.lock:
            taken: list[Any] = []
            for handler in (self.store, self.load):
                handler.reap()
                taken += handler.take_results()
            return taken

    monkeypatch.setattr(Core, "get_finished", old_get_finished)
    points = explorer.count_points("clean", "get_finished")
    found = _found([Case("clean", "get_finished", k, "KeyboardInterrupt") for k in range(points)])
    assert any("appears 0 times" in f for f in found)


class _PlainLock:
    """A non-reentrant lock that cannot tell who holds it: the worker's lock before R19's signal-handler rule."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _is_owned(self) -> bool:
        return False


def _plain_lock_factory(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    worker = reference_factory(backend, gpu, setup)
    core = worker._core  # type: ignore[attr-defined]
    core.lock = _PlainLock()
    core.done = threading.Condition(core.lock)  # type: ignore[arg-type]
    return worker


@pytest.mark.rule("R19")
def test_explorer_catches_a_signal_handler_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug of the code before: a signal handler's shutdown() on a thread inside submit_store waited for the
    lock its own interrupted frame held. The watchdog (a safety net in real seconds) turns it into a failure."""
    monkeypatch.setattr(explorer, "WATCHDOG", 0.3)
    with lockcheck.suspended():  # its lock cannot say who holds it: the lock check (R19) cannot ask it
        found = _found([Case("clean", "submit_store", 3, "handler_shutdown")], _plain_lock_factory)
    assert any("deadlocked" in f for f in found)


def test_explorer_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="unknown"):
        explore(configs=["nope"])


def test_explorer_cli_lists_match_the_explorer() -> None:
    assert (tuple(CONFIGS), METHODS, INJECTIONS) == (EXPLORE_CONFIGS, EXPLORE_METHODS, EXPLORE_INJECTIONS)


def test_explorer_cli_prints_its_counts_and_exits_by_what_it_found(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explore", "--config", "clean", "--method", "get_finished"]) == 0
    out = capsys.readouterr().out
    assert "get_finished" in out and "0 failures" in out
    assert main(["explore", "--factory", "kvoffload_ref.testing.mutants:interrupts_swallowed", "--config",
                 "clean", "--method", "submit_store", "--injection", "SystemExit", "--show", "1"]) == 0
    assert main(["explore", "--factory", "kvoffload_ref.testing.mutants:interrupts_swallowed", "--config",
                 "clean", "--method", "submit_store", "--injection", "SIGINT", "--show", "1"]) == 1
    out = capsys.readouterr().out
    assert "reproduce: kvoffload-ref explore --factory kvoffload_ref.testing.mutants:interrupts_swallowed" in out
    assert main(["explore", "--factory", "no_such_module:f"]) == 2


def _imports_within(package: pathlib.Path, prefix: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports, at module level or inside a function."""
    modules = {f"{prefix}.{p.stem}": p for p in package.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {c for c in (node.module, *(f"{node.module}.{a.name}" for a in node.names)) if c in modules}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        graph[name] = found - {name}
    return graph


def test_the_kit_has_no_import_circle() -> None:
    """No module of the kit imports one that imports it back, directly or through others (lazy imports
    included): the explorers' scenario is a module both import."""
    graph = _imports_within(pathlib.Path(explorer.__file__).parent, "kvoffload_ref.testing")
    assert "kvoffload_ref.testing.scenario" in graph["kvoffload_ref.testing.explorer_checks"]

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(m == goal or (m not in seen and not seen.add(m) and reaches(m, goal, seen))  # type: ignore[func-returns-value]
                   for m in graph[start])

    circles = sorted(m for m in graph if reaches(m, m, set()))
    assert not circles, circles


def _cancel_dropping(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """A deliberately wrong engine: a cancel a signal handler asked for inside a call is dropped at its exit."""
    worker = reference_factory(backend, gpu, setup)
    core: Any = worker._core  # type: ignore[attr-defined]
    carry_out = core.carry_out_deferred

    def dropped() -> None:
        core.deferred_cancel.clear()
        carry_out()

    core.carry_out_deferred = dropped
    return worker


@pytest.mark.rule("R19")
@pytest.mark.rule("R26")
def test_explorer_catches_a_dropped_deferred_cancel() -> None:
    """A signal handler's cancel inside a call is carried out as the call returns: one that is dropped leaves the
    listed jobs queued, and the explorer says so (the correct engine: no failure)."""
    name = "tests.test_testing_explorer:_cancel_dropping"
    kwargs: dict[str, Any] = {"configs": ["hung"], "methods": ["get_finished", "wait", "submit_store"],
                              "injections": ["handler_cancel"]}
    wrong = explore(_cancel_dropping, name=name, **kwargs)
    assert wrong.failures and all("R19/R26" in f.rules and "not ended" in f.message for f in wrong.failures)
    assert not explore(reference_factory, **kwargs).failures


@pytest.mark.rule("R26")
@pytest.mark.parametrize("worker", WORKERS)
def test_explorer_expired_configuration_expires_the_hung_load(worker: str) -> None:
    """In "expired" the hung load 2 passes its deadline during (wait) or before (get_finished) the call under
    test: a poll reports it (TransferExpired, "deadline"); the store beside it completes."""
    factory, _ = FACTORIES[worker]
    for method in ("get_finished", "wait"):
        out = explorer._run(Case("expired", method, -1, "none"), factory)
        reasons = {getattr(r, "job_id", None): getattr(getattr(r, "error", None), "reason", None)
                   for r in out.results}
        assert reasons[2] == "deadline" and reasons[3] is None, (method, reasons)
