"""The lock check (R19): a write of a worker's or a handler's state by a thread the rule does not allow raises at the
write -- deterministically, in one run, where a stress test needs an unlucky thread switch.

The planted bugs are the real code with one change: :func:`_hoisted` moves the first statements of a method's
first ``with`` block in front of it (``Core.shutdown``'s first transition, taken before the lock).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import pytest
from _interleave import Pause, run_in_thread
from _support import BPC, CPU_CHUNKS, CREATE, cspec, gspec, patterned_gpu, small_layout

import kvoffload_ref as kv
from kvoffload_ref import handler_api, lockcheck, reference
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.lifecycle import HandlerState, WorkerState
from kvoffload_ref.reference import Core


def _worker(kind: str, be: Any = None) -> tuple[Any, Any, Core]:
    """A sim backend (unless given), a worker of ``kind`` over it, and the worker's core."""
    be = be if be is not None else SimBackend()
    layout = small_layout()
    worker = CREATE[kind](be, patterned_gpu(be, layout), layout, blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS,
                          policy=kv.ShutdownPolicy(timeout=1.0))
    return be, worker, worker._core


def _hoisted(method: Callable[..., Any], count: int) -> Callable[..., Any]:
    """``method`` (a function of ``reference``) with the first ``count`` statements of its first ``with`` block
    moved in front of that block: the same code, run before the ``with`` is entered."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    block = next(node for node in ast.walk(fn) if isinstance(node, ast.With))
    assert ast.unparse(block.items[0].context_expr) == "self.lock", "the planted bug expects `with self.lock:`"
    outer = next(node for node in ast.walk(fn) if block in getattr(node, "body", ()))
    moved, block.body = block.body[:count], block.body[count:]
    at = outer.body.index(block)  # type: ignore[attr-defined]
    outer.body[at:at] = moved  # type: ignore[attr-defined]
    namespace: dict[str, Any] = {}
    exec(compile(ast.fix_missing_locations(tree), inspect.getfile(method), "exec"), vars(reference), namespace)
    planted: Callable[..., Any] = namespace[fn.name]
    return planted


@pytest.mark.rule("R19")
def test_lockcheck_is_on_in_the_tests_and_guards_both_workers() -> None:
    """The kit (imported by conftest) switches the check on; a worker binds its fields and its handlers'."""
    assert lockcheck.enabled()
    for kind in CREATE:
        _, worker, core = _worker(kind)
        for obj, fields in ((core, reference.GUARDED), (core.store, handler_api.GUARDED),
                            (core.load, handler_api.GUARDED)):
            for name in fields:
                assert isinstance(type(obj).__dict__.get(name), lockcheck._Guard), (kind, type(obj), name)
        worker.shutdown()


@pytest.mark.rule("R19")
@pytest.mark.rule("R14")
@pytest.mark.parametrize("kind", list(CREATE))
def test_lockcheck_catches_a_shutdown_whose_first_transition_runs_outside_the_lock(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug only a randomized stress test caught: OPEN -> SHUTTING_DOWN (and the running thread) set before the
    lock is taken, so a submission may slip in between. One plain shutdown(), one thread: it raises at the write."""
    monkeypatch.setattr(Core, "shutdown", _hoisted(Core.shutdown, 2))
    be, worker, core = _worker(kind)
    worker.submit_store(1, gspec([1]), cspec([1]))
    with pytest.raises(lockcheck.LockCheckError, match=r"^Core\.state written .* without the worker's lock "
                                                      r"\(worker OPEN\)"):
        worker.shutdown()
    assert core.state is WorkerState.OPEN and core.shutdown_thread is None  # refused before the write
    assert len(lockcheck.take_violations()) == 1
    monkeypatch.undo()
    assert worker.shutdown().region == "released"  # the real shutdown still works on it


@pytest.mark.rule("R19")
@pytest.mark.rule("R15")
def test_lockcheck_a_violation_a_caller_swallows_is_still_seen(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The finalizer logs what its shutdown raised (R15) and returns: the violation is kept for take_violations,
    which the suite's autouse fixture asserts empty after every test."""
    monkeypatch.setattr(Core, "shutdown", _hoisted(Core.shutdown, 2))
    _, worker, core = _worker("engine")
    core.finalize()  # raises nothing
    assert "Shutdown from the finalizer failed" in caplog.text
    assert [v.split(" written")[0] for v in lockcheck.take_violations()] == ["Core.state"]
    monkeypatch.undo()
    worker.shutdown()


@pytest.mark.rule("R19")
def test_lockcheck_suspended_switches_it_off_for_a_block_only() -> None:
    _, worker, core = _worker("reference")
    with lockcheck.suspended():
        assert not lockcheck.enabled()
        core.state = core.state  # a wrong worker's lock that cannot say who holds it: not asked
        with lockcheck.suspended():
            pass
        assert not lockcheck.enabled()
    assert lockcheck.enabled()
    worker.shutdown()


@pytest.mark.rule("R19")
@pytest.mark.parametrize("kind", list(CREATE))
def test_lockcheck_catches_a_handler_state_write_outside_the_lock(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A get_finished that reaps before taking the lock: the handler's HEAD_PROVEN step raises at its write."""

    def get_finished_reaping_unlocked(self: Core) -> list[kv.TransferResult]:
        self.store.reap()  # the bug: a handler's heads observed -- its state stepped -- without the lock
        with self.call:
            return self.store.take_results()

    be, worker, core = _worker(kind)
    worker.submit_store(1, gspec([1]), cspec([1]))
    be.clock_advance(1.0)
    monkeypatch.setattr(Core, "get_finished", get_finished_reaping_unlocked)
    with pytest.raises(lockcheck.LockCheckError, match=r"\.state written .* without the worker's lock"):
        worker.get_finished()
    assert core.store.state is HandlerState.ACCEPTING
    assert len(lockcheck.take_violations()) == 1
    monkeypatch.undo()
    assert [r.job_id for r in worker.get_finished()] == [1]
    worker.shutdown()


@pytest.mark.rule("R19")
@pytest.mark.parametrize("kind", list(CREATE))
def test_lockcheck_while_shutting_down_only_the_shutdown_thread_writes_without_the_lock(kind: str) -> None:
    """The documented exception is exact: from SHUTTING_DOWN on the shutdown thread drains and releases without the
    lock, but another thread may not write then (nor after CLOSED), and the lock's holder always may."""
    be, worker, core = _worker(kind, SimBackend(kv.FaultPlan([kv.Fault("copy", "hang", job_id=1)])))
    worker.submit_store(1, gspec([1]), cspec([1]))
    with Pause(be, "sleep") as pause:  # the shutdown thread, in its drain's poll, holds no lock
        shutdown = run_in_thread(worker.shutdown)
        assert pause.reached.wait(10)
        assert core.state is WorkerState.SHUTTING_DOWN
        with pytest.raises(lockcheck.LockCheckError, match=r"\.state written .* \(worker SHUTTING_DOWN\)"):
            core.store.state = core.store.state
        with pytest.raises(lockcheck.LockCheckError, match=r"^Core\.report written"):
            core.report = None
        assert core.lock.acquire(blocking=False)  # the shutdown thread holds no lock here
        core.lock.release()
        pause.release()
    assert shutdown.join() and shutdown.result().region == "quarantined"  # its own unlocked writes were allowed
    with pytest.raises(lockcheck.LockCheckError, match=r"\(worker CLOSED\)"):
        core.load.state = core.load.state
    assert len(lockcheck.take_violations()) == 3
    with core.lock:
        core.load.state = core.load.state  # the lock's holder may


class _Worker:
    """Just what the rule reads of a worker."""

    def __init__(self, state: WorkerState, shutdown_thread: int | None) -> None:
        self.lock = threading.RLock()
        self.state, self.shutdown_thread = state, shutdown_thread


@pytest.mark.rule("R19")
@pytest.mark.parametrize("state", list(WorkerState))
@pytest.mark.parametrize("runs_shutdown", [True, False])
def test_lockcheck_may_write_is_the_lock_or_the_shutdown_thread_while_shutting_down(
        state: WorkerState, runs_shutdown: bool) -> None:
    me = threading.get_ident()
    worker = _Worker(state, me if runs_shutdown else me + 1)
    assert lockcheck.may_write(worker) is (state is WorkerState.SHUTTING_DOWN and runs_shutdown)
    with worker.lock:
        assert lockcheck.may_write(worker)


@pytest.mark.rule("R19")
def test_lockcheck_off_installs_nothing_and_on_again_guards_existing_workers() -> None:
    """Off, a guarded write is a plain store (no descriptor on the class: nothing to pay); switching on again guards
    the workers built meanwhile; the values are kept across both switches."""
    _, worker, core = _worker("engine")
    lockcheck.disable()
    try:
        assert not lockcheck.enabled()
        assert "state" not in vars(Core) and "state" not in vars(type(core.store))
        core.state = core.state  # unguarded: no error
        _, other, other_core = _worker("reference")
    finally:
        lockcheck.enable()
    assert core.state is WorkerState.OPEN and other_core.store.state is HandlerState.ACCEPTING
    with pytest.raises(lockcheck.LockCheckError):
        other_core.store.state = other_core.store.state
    assert len(lockcheck.take_violations()) == 1
    worker.shutdown()
    other.shutdown()


@pytest.mark.rule("R19")
def test_lockcheck_before_binding_writes_are_free_and_a_class_attribute_is_refused() -> None:
    class Built:
        state = "class attribute"

    class Plain:
        def __init__(self) -> None:
            self.state = 1  # not bound yet: free

    owner = _Worker(WorkerState.OPEN, None)
    plain = Plain()
    lockcheck.bind(plain, owner, ("state",))
    with pytest.raises(lockcheck.LockCheckError):
        plain.state = 2
    assert plain.state == 1 and len(lockcheck.take_violations()) == 1
    with pytest.raises(TypeError, match="class attribute"):
        lockcheck.bind(Built(), owner, ("state",))
