"""A parent holding a worker over a SharedRegion forks, and its child leaves one way or another (R21, R18).

Not a test module. ``tests/test_fork.py`` runs it as a script in a fresh interpreter,
``python tests/_fork_child.py MODE DIRECTORY``, so that the child's exit is the interpreter's real one (``atexit``
hooks, ``weakref.finalize`` at exit), which a child forked from pytest cannot have. It prints one JSON line of
facts for the test to assert on. The test also imports the helpers (building the parent, calling everything in
a child, checking the parent afterwards, waiting for a child with a bound).

Modes (the child's way out):

* ``sys_exit``, ``return``, ``os_exit``: ``os.fork()``; the child does nothing and leaves by ``sys.exit(0)``, by
  returning from ``main`` (the script ends), or by ``os._exit(0)``;
* ``calls``: ``os.fork()``; the child calls every public method of the worker and of the region, then
  ``sys.exit(0)``;
* ``mp_return``, ``mp_exit``: a ``multiprocessing`` "fork" process whose target calls everything, then returns
  or calls ``sys.exit(0)``;
* ``paused_thread``: another thread of the parent is inside ``submit_store`` (paused at its copy call, holding
  the worker's lock) when the parent forks; the child leaves by ``sys.exit(0)`` and must exit promptly.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import _shm_ranks as ranks
import numpy as np

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend

ENGINE = "fork-engine"
WORLD = 2
JOIN = 10.0  # the longest a child may take to report (a bound for failures, never a pacing)
PROMPT = 1.0  # a child's exit, from its last word to its end: milliseconds when nothing waits on a copied lock
MODES = ("sys_exit", "return", "os_exit", "calls", "mp_return", "mp_exit", "paused_thread")
#: What :func:`check_parent` finds when the child left the parent alone.
PARENT_INTACT: dict[str, Any] = {
    "file_left": True, "joiner_is_creator": False, "joiner_sees_the_parents_bytes": True,
    "file_unlinked_once_both_mapped": True, "parent_cpu_exact": True, "parent_load_exact": True,
    "report_region": "released", "report_errors": [], "ledger_live": {}, "violations": [], "joiner_release": [],
    "joiner_ledger_live": {}, "left_in_directory": [],
}


@dataclasses.dataclass
class Parent:
    """Rank 0 of engine ENGINE (of WORLD ranks) in ``directory``: its backend, region and worker, job 1 stored."""

    directory: str
    backend: SimBackend
    region: kv.SharedRegion
    worker: kv.CPUOffloadingWorker
    gpu: list[Any]

    @classmethod
    def build(cls, directory: str) -> Parent:
        be = SimBackend()
        region = ranks.Rank(directory, ENGINE, 0, WORLD).open(be)
        gpu = [be.from_host(h) for h in ranks.gpu_pattern(1)]
        worker = kv.create_worker(be, gpu, ranks.layout(), blocks_per_chunk=ranks.BPC,
                                  num_cpu_chunks=ranks.CHUNKS, region=region)
        ranks.store_all(worker, 1)
        return cls(directory, be, region, worker, gpu)


def _outcome(call: Callable[[], object], owner: int) -> str:
    try:
        call()
    except kv.WorkerClosedError as exc:
        return "closed" if f"process {owner}" in str(exc) else f"closed, not naming {owner}: {exc}"
    except BaseException as exc:  # reported, never raised: the child must reach its way out
        return f"raised {exc!r}"
    return "returned"


def child_calls(parent: Parent, owner: int) -> dict[str, str]:
    """In a child: every public call of the inherited worker and region, and what each did."""
    worker, region = parent.worker, parent.region
    gpu = kv.GPULoadStoreSpec(list(range(ranks.GPU_BLOCKS)), (ranks.GPU_BLOCKS,), (0,))
    cpu = kv.CPULoadStoreSpec(list(range(ranks.CHUNKS)))
    worker_calls: dict[str, Callable[[], object]] = {
        "submit_store": lambda: worker.submit_store(90, gpu, cpu),
        "submit_load": lambda: worker.submit_load(91, cpu, gpu),
        "get_finished": worker.get_finished,
        "wait": lambda: worker.wait({1}, timeout=0.0),
        "cpu_snapshot": worker.cpu_snapshot,
        "shutdown": worker.shutdown,
        "stats": worker.stats,
    }
    outcomes = {name: _outcome(call, owner) for name, call in worker_calls.items()}
    refused: dict[str, Callable[[], object]] = {
        "region.snapshot": region.snapshot, "region.snapshot_rows": region.snapshot_rows, "region.pin": region.pin,
        "region.adopt": region.adopt, "region.check_backend": lambda: region.check_backend(parent.backend)}
    outcomes.update({name: _outcome(call, owner) for name, call in refused.items()})
    gives_up: dict[str, Callable[[], object]] = {
        "region.release": region.release, "region.unpin": region.unpin,
        "region.release_by_owner": region.release_by_owner,
        "region.quarantine_by_owner": lambda: region.quarantine_by_owner("child")}
    for name, give_up in gives_up.items():
        try:
            outcomes[name] = repr(give_up())
        except BaseException as exc:
            outcomes[name] = f"raised {exc!r}"
    outcomes["region.state"] = region.state.value
    return outcomes


def wait_exit(pid: int, timeout: float) -> int | None:
    """Wait at most ``timeout`` seconds for child ``pid``; its exit code, or None (it was then SIGKILLed)."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def read_some(fd: int, timeout: float) -> bytes:
    """One read of ``fd`` once it is readable within ``timeout`` seconds (b"" if it is not)."""
    return os.read(fd, 65536) if select.select([fd], [], [], timeout)[0] else b""


def read_all(fd: int, timeout: float) -> bytes:
    """Read ``fd`` until EOF or ``timeout`` seconds (what was read by then); closes it."""
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    return data


def fork_quietly() -> int:
    """``os.fork()``; Python 3.12+ warns (DeprecationWarning) when the process has threads: intended here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def check_parent(parent: Parent) -> dict[str, Any]:
    """After the child: the file is there, a joiner shares the parent's memory, the parent's transfers are
    byte-exact and its shutdown is clean."""
    be, region, worker = parent.backend, parent.region, parent.worker
    facts: dict[str, Any] = {"file_left": os.path.exists(region.path)}
    joiner_be = SimBackend()
    joiner = ranks.Rank(parent.directory, ENGINE, 1, WORLD).open(joiner_be)
    facts["joiner_is_creator"] = joiner.is_creator
    width = ranks.BPC * ranks.PAGE_BYTES
    rows = joiner.snapshot_rows()
    seen = [rows[:, t * width:(t + 1) * width] for t in range(ranks.NUM_TENSORS)]  # rank 0's slice
    facts["joiner_sees_the_parents_bytes"] = all(
        np.array_equal(a, b) for a, b in zip(seen, ranks.cpu_rows(1), strict=True))
    facts["file_unlinked_once_both_mapped"] = not os.path.exists(region.path)
    facts["parent_cpu_exact"] = all(
        np.array_equal(a, b) for a, b in zip(worker.cpu_snapshot(), ranks.cpu_rows(1), strict=True))
    for dev in parent.gpu:  # clobber the GPU copy, so that the load below must bring the bytes back
        be.enqueue_compute_write(dev, list(range(ranks.GPU_BLOCKS)), value=0, delay=0.0)
    ranks.load_all(worker, 2)
    facts["parent_load_exact"] = all(
        np.array_equal(be.to_host(g), h) for g, h in zip(parent.gpu, ranks.gpu_pattern(1), strict=True))
    report = worker.shutdown()
    facts.update(report_region=report.region, report_errors=list(report.errors),
                 ledger_live=dict(be.ledger.live()), violations=[repr(v) for v in be.violations])
    facts["joiner_release"] = joiner.release()
    facts["joiner_ledger_live"] = dict(joiner_be.ledger.live())
    facts["left_in_directory"] = sorted(os.listdir(parent.directory))
    return facts


def _mp_target(parent: Parent, owner: int, conn: Any, mode: str) -> None:
    conn.send(child_calls(parent, owner))
    conn.close()
    if mode == "mp_exit":
        sys.exit(0)


def _run_mp(parent: Parent, mode: str) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe(duplex=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        process = ctx.Process(target=_mp_target, args=(parent, os.getpid(), theirs, mode))
        process.start()
    theirs.close()
    calls = mine.recv() if mine.poll(JOIN) else None
    said = time.monotonic()
    process.join(JOIN if calls is None else PROMPT)
    exited = time.monotonic() - said
    if process.is_alive():
        process.kill()
        process.join(JOIN)
        return {"calls": calls, "exitcode": None, "exit_seconds": exited}
    return {"calls": calls, "exitcode": process.exitcode, "exit_seconds": exited}


class PausedSubmission:
    """Another thread of the parent inside ``submit_store`` of job 3 -- under the worker's lock -- paused at its
    copy call through the sim's ``on_call`` hook (as ``kvoffload_ref.testing.threads.CallPause`` does; this one
    spares the script the import of Hypothesis, so the child's real exit stays short)."""

    def __init__(self, parent: Parent) -> None:
        self.reached, self._go = threading.Event(), threading.Event()
        # Invariant: what the paused submit_store returned (True) or raised, once the thread finished.
        self.outcome: object = None
        parent.backend.on_call = self._hook
        gpu = kv.GPULoadStoreSpec(list(range(ranks.GPU_BLOCKS)), (ranks.GPU_BLOCKS,), (0,))
        cpu = kv.CPULoadStoreSpec(list(range(ranks.CHUNKS)))
        self._thread = threading.Thread(target=self._submit, args=(parent, gpu, cpu), name="paused-store",
                                        daemon=True)
        self._thread.start()
        if not self.reached.wait(JOIN):
            raise RuntimeError("the submission never reached its copy call")

    def _hook(self, point: str, tag: object) -> None:
        if point == "copy" and threading.current_thread() is self._thread and not self.reached.is_set():
            self.reached.set()
            if not self._go.wait(JOIN):
                raise TimeoutError("paused at the copy call and never resumed")

    def _submit(self, parent: Parent, gpu: kv.GPULoadStoreSpec, cpu: kv.CPULoadStoreSpec) -> None:
        try:
            self.outcome = parent.worker.submit_store(3, gpu, cpu)
        except BaseException as exc:
            self.outcome = exc

    def resume(self) -> bool:
        """Let the submission go on; whether it then completed (returned True) within the bound."""
        self._go.set()
        self._thread.join(JOIN)
        return not self._thread.is_alive() and self.outcome is True


def main(mode: str, directory: str) -> bool:
    """Run ``mode``. Returns False in the child (which then leaves ``main`` normally), True in the parent."""
    parent = Parent.build(directory)
    owner = os.getpid()
    if mode.startswith("mp_"):
        child = _run_mp(parent, mode)
    else:
        paused = PausedSubmission(parent) if mode == "paused_thread" else None
        read_end, write_end = os.pipe()
        pid = fork_quietly()
        if pid == 0:
            os.close(read_end)
            calls = child_calls(parent, owner) if mode == "calls" else {}
            os.write(write_end, json.dumps(calls).encode())
            os.close(write_end)
            if mode == "os_exit":
                os._exit(0)
            if mode == "return":
                return False
            sys.exit(0)
        os.close(write_end)
        said = read_all(read_end, JOIN)
        started = time.monotonic()
        code = wait_exit(pid, PROMPT if said else JOIN)
        child = {"calls": json.loads(said) if said else None, "exitcode": code,
                 "exit_seconds": time.monotonic() - started}
        if paused is not None:
            child["paused_submission"] = paused.resume()
            parent.worker.wait({3})
    print(json.dumps({"mode": mode, "child": child, **check_parent(parent)}))
    return True


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
