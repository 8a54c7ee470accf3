"""The pair explorer (kvoffload_ref.testing.pairs): thread A paused at every backend call of every public method
while thread B runs every other one, in every configuration, finds nothing on either worker -- and finds the bugs
it was built for (the wait() clock race, a shutdown that begins outside the lock, a sleep under the lock, a
shutdown that makes other calls block behind it)."""

from __future__ import annotations

import inspect
import logging
import textwrap
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _support import FACTORIES, WORKERS

from kvoffload_ref import lockcheck, reference
from kvoffload_ref.backends import base
from kvoffload_ref.cli import PAIR_METHODS, main
from kvoffload_ref.errors import DeadlineExceeded
from kvoffload_ref.reference import Core
from kvoffload_ref.testing import mutants, pairs
from kvoffload_ref.testing.adapter import SimDevice
from kvoffload_ref.testing.lock_watch import watch_lock
from kvoffload_ref.testing.pairs import METHODS, PairCase, explore_pairs, run_pair
from kvoffload_ref.testing.scenario import CONFIGS


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """Thousands of shutdowns (quarantines, failed transfers) log as designed; keep the test output readable."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.rule("R4")
@pytest.mark.rule("R5")
@pytest.mark.rule("R8")
@pytest.mark.rule("R12")
@pytest.mark.rule("R14")
@pytest.mark.rule("R16")
@pytest.mark.rule("R19")
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("worker", WORKERS)
def test_pairs_every_call_point_of_every_pair_keeps_every_promise(worker: str, config: str) -> None:
    """Each configuration, each ordered pair of methods, each backend call of the paused one: no rule broken, on
    the engine and on the reference worker; the second thread meets every situation (it runs through, blocks on
    the lock, and -- a second shutdown -- waits for the first one's report)."""
    factory, name = FACTORIES[worker]
    result = explore_pairs(factory, configs=[config], name=name)
    print(result.table())
    assert not result.failures, "\n".join(map(str, result.failures[:10]))
    assert set(result.cases) == {(a, b, config) for a in METHODS for b in METHODS}
    assert all(result.points[(m, config)] > 0 for m in METHODS)
    assert sum(result.cases.values()) == len(METHODS) * sum(result.points.values())  # every point, every B
    assert result.verdicts["not paused"] == 0 and result.verdicts["stuck"] == 0
    assert min(result.verdicts[v] for v in ("ran", "blocked", "waited")) > 0


@pytest.mark.rule("R19")
def test_pairs_are_deterministic() -> None:
    """Two runs give the same counts, the same verdicts and the same failures (here: the wait() clock race)."""
    def run() -> tuple[str, list[str]]:
        result = explore_pairs(configs=["hung"], firsts=["wait", "shutdown"], seconds=["shutdown", "get_finished"])
        return result.table(), [str(f) for f in result.failures]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "wait_polling", _wait_polling_clock_after_poll)
        first = run()
        assert first[1]
        assert run() == first
    assert run()[0] == run()[0]


# -- the bugs it catches ----------------------------------------------------------------------------------------
def _wait_polling_clock_after_poll(backend: Any, settled: Callable[..., bool], started: float,
                                   deadline: float | None, what: str, *, now: float | None = None,
                                   polled: bool = False, args: tuple[object, ...] = ()) -> None:
    """``backends.base.wait_polling`` as it was (be1772e): the clock read *after* the poll (``now``: unused; a poll
    the caller made, ``polled``, counts as the first)."""
    horizon = backend.hang_horizon if deadline is None else None
    longest = base.POLL_MAX_SLEEP if horizon is None else max(base.POLL_MAX_SLEEP, horizon / 64)
    pause = base.POLL_FIRST_SLEEP
    while polled or not settled(*args):
        polled = False
        now = backend.monotonic()
        if deadline is not None and now >= deadline:
            raise DeadlineExceeded(f"{what} not proven complete by the deadline")
        if horizon is not None:
            backend.check_unbounded_wait(started, now, what)
        backend.sleep(pause if deadline is None else max(min(pause, deadline - now), 0.0))
        pause = min(pause * 2, longest)


def _mutate(monkeypatch: pytest.MonkeyPatch, method: str, old: str, new: str) -> None:
    """Replace ``Core.<method>`` by its own source with ``old`` (found exactly once) replaced by ``new``."""
    source = textwrap.dedent(inspect.getsource(getattr(Core, method)))
    assert source.count(old) == 1, f"Core.{method} changed: update the mutant"
    namespace: dict[str, Any] = {}
    exec(compile(source.replace(old, new), reference.__file__, "exec"), vars(reference), namespace)
    monkeypatch.setattr(Core, method, namespace[method])


@pytest.mark.rule("R19")
@pytest.mark.parametrize("worker", WORKERS)
def test_pairs_catch_the_wait_clock_race(worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race of the code before: a wait() paused between its poll and its clock read while another thread's
    whole shutdown ran raised DeadlineExceeded instead of returning empty."""
    monkeypatch.setattr(reference, "wait_polling", _wait_polling_clock_after_poll)
    factory, name = FACTORIES[worker]
    result = explore_pairs(factory, configs=["hung", "hung-release"], firsts=["wait"], name=name)
    assert result.failures
    assert {(f.case.first, f.case.second) for f in result.failures} == {("wait", "shutdown")}
    assert all("wait() raised DeadlineExceeded" in f.message and f.rules == "R19" for f in result.failures)
    assert f"explore --pairs --factory {name} --config hung --method wait --second shutdown --point" in str(
        result.failures[0])


@pytest.mark.rule("R19")
@pytest.mark.parametrize("worker", WORKERS)
def test_pairs_catch_a_shutdown_that_begins_outside_the_lock(worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shutdown whose first transition is made without the lock: a submission paused inside its call (holding
    the lock) no longer keeps it out, and its job is queued behind the drain -- deterministically."""
    _mutate(monkeypatch, "shutdown", "with self.lock:\n            state, action",
            "if True:  # the mutant: no lock\n            state, action")
    factory, name = FACTORIES[worker]
    with lockcheck.suspended():  # the pair explorer catches it on its own (tests/test_lockcheck.py: the check too)
        result = explore_pairs(factory, configs=["clean"], firsts=["submit_store"], seconds=["shutdown"], name=name)
    assert result.failures
    assert any("live after shutdown" in f.message or "the device saw" in f.message for f in result.failures)


@pytest.mark.rule("R19")
@pytest.mark.parametrize("worker", WORKERS)
def test_pairs_catch_a_sleep_under_the_lock(worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait() that takes its pause between polls holding the worker's lock (everyone else blocks for it)."""
    settle = Core._settle

    def sleepy(self: Core, handler: Any, mark: object) -> bool:
        settled = settle(self, handler, mark)
        if not settled:
            with self.lock:
                self.backend.sleep(base.POLL_FIRST_SLEEP)  # the mutant: a pause under the lock
        return bool(settled)

    monkeypatch.setattr(Core, "_settle", sleepy)
    factory, name = FACTORIES[worker]
    result = explore_pairs(factory, configs=["hung"], firsts=["wait"], seconds=["get_finished"], points=[0],
                           name=name)
    assert result.failures
    assert all("sleep() while holding the worker's lock" in f.message for f in result.failures)
    assert any("lock: thread A" in f.message for f in result.failures)


@pytest.mark.rule("R19")
@pytest.mark.parametrize("worker", WORKERS)
def test_pairs_catch_a_call_blocked_behind_a_running_shutdown(worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shutdown that holds the lock while it releases (no sleep there, so only this check sees it): a
    get_finished() in another thread blocks until the whole release is done."""
    release = Core._release

    def locked(self: Core, run: Any, shield: Any) -> None:
        with self.lock:  # the mutant
            release(self, run, shield)

    monkeypatch.setattr(Core, "_release", locked)
    factory, name = FACTORIES[worker]
    result = explore_pairs(factory, configs=["clean"], firsts=["shutdown"], seconds=["get_finished", "wait"],
                           name=name)
    assert result.failures
    assert all("blocked on the worker's lock while a shutdown ran" in f.message for f in result.failures)
    assert {f.case.second for f in result.failures} == {"get_finished", "wait"}


# -- the seam and the command -----------------------------------------------------------------------------------
@pytest.mark.rule("R19")
def test_pairs_watch_the_lock_of_a_core_worker_only() -> None:
    setup = CONFIGS["clean"]
    device = SimDevice(setup)
    wrapped = mutants.interrupts_swallowed(device.backend, device.gpu, setup)
    with pytest.raises(TypeError, match=r"reference\.Core"):
        watch_lock(wrapped, _NoWatcher())
    wrapped.shutdown()


class _NoWatcher:
    def blocking(self) -> None: ...
    def waiting(self) -> None: ...
    def woken(self) -> None: ...


@pytest.mark.rule("R19")
def test_pairs_watched_lock_is_the_lock_it_wraps() -> None:
    """The watched lock excludes as the worker's own (reentrant, owned per thread) and a condition over it works."""
    setup = CONFIGS["clean"]
    device = SimDevice(setup)
    worker = FACTORIES["reference"][0](device.backend, device.gpu, setup)
    inner = worker._core.lock  # type: ignore[attr-defined]
    watched = watch_lock(worker, _NoWatcher())
    with watched, watched:
        assert watched._is_owned() and inner._is_owned()
        other = threading.Thread(target=lambda: seen.append(watched.acquire(False)))
        seen: list[bool] = []
        other.start()
        other.join()
        assert seen == [False]
    assert not inner._is_owned()
    worker.shutdown()


@pytest.mark.rule("R19")
def test_pairs_cli_prints_its_counts_and_exits_by_what_it_found(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    assert PAIR_METHODS == METHODS
    assert main(["explore", "--pairs", "--config", "clean", "--method", "order_after"]) == 0
    out = capsys.readouterr().out
    assert "order_after | shutdown" in out and "0 failures" in out and "B ran:" in out
    monkeypatch.setattr(reference, "wait_polling", _wait_polling_clock_after_poll)
    assert main(["explore", "--pairs", "--config", "hung", "--method", "wait", "--second", "shutdown"]) == 1
    out = capsys.readouterr().out
    assert "reproduce: kvoffload-ref explore --pairs --factory kvoffload_ref.testing.adapter:reference_factory" in out
    assert main(["explore", "--pairs", "--method", "construct"]) == 2
    assert main(["explore", "--pairs", "--injection", "SIGINT"]) == 2
    assert main(["explore", "--second", "wait"]) == 2
    assert main(["explore", "--pairs", "--factory", "kvoffload_ref.testing.mutants:interrupts_swallowed",
                 "--config", "clean", "--method", "wait"]) == 2


@pytest.mark.rule("R19")
def test_pairs_refuse_what_they_do_not_know() -> None:
    with pytest.raises(ValueError, match="unknown"):
        explore_pairs(firsts=["construct"])
    assert run_pair(PairCase("clean", "get_finished", "get_finished", 0)) == []
    assert pairs.count_points("clean", "order_after") > 0
