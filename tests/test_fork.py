"""Fork safety (R21): in a forked child everything inherited is inert, and the child is never a rank (R18).

Real forks only: ``os.fork()`` from this process (the child always ends with ``os._exit`` in a ``finally``, so it
never runs pytest's code), and, for a child's real exit (``sys.exit``, returning, ``atexit``, multiprocessing's
"fork" processes), a fresh interpreter running ``tests/_fork_child.py``. Every child reports through a pipe or its
exit code; every wait for a child is bounded, and a child that outlives its bound is killed, so a hang fails the
test instead of hanging it. Each test works in its own directory under /dev/shm, which must be empty at teardown.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import pickle
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import _fork_child as forked
import _shm_ranks as ranks
import numpy as np
import pytest
from _fork_child import JOIN, PROMPT, Parent, fork_quietly, read_all, wait_exit
from _support import FACTORIES, WORKERS, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.process import ProcessOwner
from kvoffload_ref.region import PAGE
from kvoffload_ref.testing.adapter import SimDevice
from kvoffload_ref.testing.explorer import CONFIGS as SETUPS

SHM = "/dev/shm"
SCRIPT = pathlib.Path(__file__).resolve().parent / "_fork_child.py"

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.isdir(SHM) or not hasattr(os, "pidfd_open"),
    reason="needs Linux (fork, OFD locks, pidfd_open) and /dev/shm")


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory under /dev/shm; it must be empty at teardown (then it is removed)."""
    path = os.path.join(SHM, f"kvoffload-test-fork-{uuid.uuid4().hex}")
    os.mkdir(path, 0o700)
    yield path
    left = sorted(os.listdir(path))
    shutil.rmtree(path)
    assert left == [], f"files left behind: {left}"


def _in_child(body: Callable[[], object], bound: float = JOIN) -> tuple[object, float]:
    """Run ``body`` in a child forked from this process; its result (re-raised here if it raised) and how long
    the child took from the fork to its exit. A child still running after ``bound`` seconds is killed: fails."""
    read_end, write_end = os.pipe()
    started = time.monotonic()
    pid = fork_quietly()
    if pid == 0:  # the child: never returns into pytest
        exit_code = 1
        try:
            os.close(read_end)
            try:
                result: tuple[str, object] = ("ok", body())
            except BaseException:
                result = ("error", traceback.format_exc())
            os.write(write_end, pickle.dumps(result))
            exit_code = 0
        finally:
            os._exit(exit_code)
    os.close(write_end)
    said = read_all(read_end, bound)
    code: int | None = wait_exit(pid, max(bound - (time.monotonic() - started), 0.0))
    took = time.monotonic() - started
    assert code is not None, f"the child did not exit within {bound} s (killed)"
    assert said and code == 0, f"the child failed (exit code {code})"
    status, value = pickle.loads(said)
    assert status == "ok", value
    return value, took


def _outcome(call: Callable[[], object], owner: int) -> str:
    """What a call did in the child: "closed" (WorkerClosedError naming ``owner``), "returned", or what it raised."""
    try:
        call()
    except kv.WorkerClosedError as exc:
        return "closed" if f"process {owner}" in str(exc) else f"closed, not naming {owner}: {exc}"
    except BaseException as exc:
        return f"raised {exc!r}"
    return "returned"


def _descriptors_of(path_identity: tuple[int, int]) -> int:
    """How many descriptors of this process refer to the file with that (st_dev, st_ino)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.fstat(int(name))
        except OSError:
            continue
        count += (st.st_dev, st.st_ino) == path_identity
    return count


def _mappings_of(path_identity: tuple[int, int]) -> int:
    """How many mappings of this process map the file with that (st_dev, st_ino) (from /proc/self/maps)."""
    count = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 5 and ":" in fields[3]:
                major, minor = (int(part, 16) for part in fields[3].split(":"))
                count += (os.makedev(major, minor), int(fields[4])) == path_identity
    return count


# -- the owner ------------------------------------------------------------------------------------------------------
@pytest.mark.rule("R21")
def test_fork_process_owner_names_the_parent_in_a_child() -> None:
    owner = ProcessOwner()
    parent = os.getpid()

    def child() -> tuple[bool, str]:
        return owner.inherited(), _outcome(lambda: owner.check("this thing"), parent)

    assert _in_child(child)[0] == (True, "closed")
    assert not owner.inherited()
    owner.check("this thing")  # the owner itself is never refused


# -- regions: inert in the child, the parent's pins, memory and file intact -----------------------------------------
@pytest.mark.rule("R21")
@pytest.mark.parametrize("pinning", ["register", "alloc"])
def test_fork_inherited_host_region_is_inert_in_the_child(pinning: Any) -> None:
    be = SimBackend(host_register="refuse" if pinning == "alloc" else "allow")  # alloc: a pinned allocation
    region = kv.HostRegion.allocate(be, small_layout(), 3, 4, pinning=pinning)
    region.pin(chunk_bytes=PAGE)
    live = dict(be.ledger.live())
    parent = os.getpid()

    def child() -> dict[str, Any]:
        calls: list[str] = []
        be.on_call = lambda point, tag: calls.append(point)  # every backend call the child makes
        refused: dict[str, Callable[[], object]] = {
            "snapshot": region.snapshot, "pin": region.pin, "adopt": region.adopt,
            "check_backend": lambda: region.check_backend(be)}
        out: dict[str, Any] = {name: _outcome(call, parent) for name, call in refused.items()}
        out["gave_up"] = [region.release(), region.unpin(), region.release_by_owner(),
                          region.quarantine_by_owner("child")]
        region._dropped()  # its finalizer, as when the child drops it
        out.update(state=region.state.value, pinned=region.pinned_ranges, calls=calls, live=dict(be.ledger.live()))
        return out

    out, _ = _in_child(child)
    assert out == {"snapshot": "closed", "pin": "closed", "adopt": "closed", "check_backend": "closed",
                   "gave_up": [[], [], [], []], "state": "caller_owned", "pinned": region.pinned_ranges,
                   "calls": [], "live": live}
    assert region.pinned and be.ledger.live() == live and len(region.snapshot()) == 2
    assert region.release() == [] and be.ledger.live() == {}


@pytest.mark.rule("R21")
@pytest.mark.rule("R18")
def test_fork_inherited_shared_region_is_inert_and_cut_off_from_the_parents_memory(shm_dir: str) -> None:
    be = SimBackend()
    region = ranks.Rank(shm_dir, "engine-f", 0, 2).open(be)
    region.pin(chunk_bytes=PAGE)
    pattern = ranks.cpu_rows(7)
    for t, rows in enumerate(pattern):  # (no name may keep a view alive: release unmaps)
        region._views[t][:] = rows
    st = os.stat(region.path)
    identity, parent = (st.st_dev, st.st_ino), os.getpid()

    def child() -> dict[str, Any]:
        calls: list[str] = []
        be.on_call = lambda point, tag: calls.append(point)
        out: dict[str, Any] = {"sees_parent_bytes": [bool(v.any()) for v in region._views],
                               "descriptors": _descriptors_of(identity), "mappings": _mappings_of(identity)}
        for t in range(len(region._views)):  # a stray write of the child lands in its own memory only
            region._views[t][:] = 0xFF
        refused: dict[str, Callable[[], object]] = {
            "snapshot": region.snapshot, "snapshot_rows": region.snapshot_rows, "pin": region.pin}
        out.update({name: _outcome(call, parent) for name, call in refused.items()})
        out["release"] = region.release()
        region._finalizer()  # the file's finalizer (the one atexit runs) and the region's
        region._dropped()
        out.update(calls=calls, file_left=os.path.exists(region.path), state=region.state.value)
        return out

    out, _ = _in_child(child)
    assert _descriptors_of(identity) == 2 and _mappings_of(identity) == 1, "the parent's: its own and mmap's"
    assert out == {"sees_parent_bytes": [False, False], "descriptors": 0, "mappings": 0, "snapshot": "closed",
                   "snapshot_rows": "closed", "pin": "closed", "release": [], "calls": [], "file_left": True,
                   "state": "caller_owned"}
    assert all(np.array_equal(a, b) for a, b in zip(region.snapshot(), pattern, strict=True)), "parent untouched"
    joiner = ranks.Rank(shm_dir, "engine-f", 1, 2).open(SimBackend())
    assert not joiner.is_creator, "the joiner found the parent's file"
    rows = joiner.snapshot_rows()
    width = ranks.BPC * ranks.PAGE_BYTES
    assert all(np.array_equal(rows[:, t * width:(t + 1) * width], p) for t, p in enumerate(pattern))
    assert not os.path.exists(region.path), "R18: both ranks mapped it, so it is unlinked"
    assert region.release() == [] and joiner.release() == [] and be.ledger.live() == {}


@pytest.mark.rule("R21")
@pytest.mark.rule("R18")
def test_fork_living_child_does_not_keep_a_released_rank_taken(shm_dir: str) -> None:
    """The child's inherited copies of the descriptor and mapping would keep the open file description -- and its
    rank lock -- alive after the parent closed it: they are cut off at the fork, and the parent's close unlocks
    every byte explicitly besides."""
    r1 = ranks.Rank(shm_dir, "engine-t", 1, 3).open(SimBackend())
    r0 = ranks.Rank(shm_dir, "engine-t", 0, 3).open(SimBackend())
    go_read, go_write = os.pipe()
    up_read, up_write = os.pipe()
    pid = fork_quietly()
    if pid == 0:
        try:
            os.close(go_write)
            os.write(up_write, b"up")  # Python code runs in a child after the fork hooks
            os.read(go_read, 1)  # lives until the test closes its end
        finally:
            os._exit(0)
    os.close(go_read)
    os.close(up_write)
    try:
        assert forked.read_some(up_read, JOIN) == b"up", "the child never started"
        assert r0.release() == []
        again = ranks.Rank(shm_dir, "engine-t", 0, 3).open(SimBackend())  # OwnershipError if the child held it
        assert not again.is_creator and again.release() == [] and r1.release() == []
        assert not os.path.exists(r1.path), "the last live rank unlinked it"
    finally:
        os.close(go_write)
        os.close(up_read)
        assert wait_exit(pid, JOIN) == 0


@pytest.mark.rule("R21")
@pytest.mark.rule("R18")
def test_fork_living_child_does_not_keep_a_killed_rank_live(shm_dir: str, caplog: Any) -> None:
    """A rank is SIGKILLed while a child it forked lives on: the child holds none of its locks, so the file is
    stale for the next opener and the last live rank leaves no file behind (R18)."""
    go_read, go_write = os.pipe()
    said_read, said_write = os.pipe()
    rank = fork_quietly()
    if rank == 0:  # rank 0: open, fork a child that lives on, say so, wait to be killed
        try:
            os.close(go_write)
            os.close(said_read)
            region = ranks.Rank(shm_dir, "engine-k", 0, 3).open(SimBackend())
            up_read, up_write = os.pipe()
            if fork_quietly() == 0:
                try:
                    os.write(up_write, b"up")  # Python code runs in a child after the fork hooks
                    os.read(go_read, 1)  # holds said_write open until the test closes go_write
                finally:
                    os._exit(0)
            os.close(up_write)
            if forked.read_some(up_read, JOIN) != b"up":
                raise RuntimeError("the grandchild never started")
            os.write(said_write, region.path.encode())
            os.read(go_read, 1)
        finally:
            os._exit(0)
    os.close(go_read)
    os.close(said_write)
    killed = False
    try:
        assert forked.read_some(said_read, JOIN), "rank 0 never said it was ready"
        os.kill(rank, signal.SIGKILL)
        killed = wait_exit(rank, JOIN) == -signal.SIGKILL
        assert killed, "rank 0 was not killed"
        joiner = ranks.Rank(shm_dir, "engine-k", 1, 3).open(SimBackend())
        assert joiner.is_creator, "nobody live held the file: the joiner replaced it as stale"
        assert "Found stale mmap file" in caplog.text
        assert joiner.release() == [] and not os.path.exists(joiner.path)
    finally:
        os.close(go_write)  # the grandchild (and rank 0, if the test failed before killing it) leaves
        assert killed or wait_exit(rank, JOIN) is not None
        assert read_all(said_read, JOIN) == b"", "the grandchild exited (its end of the pipe closed)"


@pytest.mark.rule("R21")
def test_fork_child_may_open_and_use_its_own_region(shm_dir: str) -> None:
    """What a child may do: open its own region (here rank 1 of the parent's engine) and build its own worker."""
    parent = Parent.build(shm_dir)

    def child() -> dict[str, Any]:
        be = SimBackend()
        region = ranks.Rank(shm_dir, forked.ENGINE, 1, forked.WORLD).open(be)
        gpu = [be.from_host(h) for h in ranks.gpu_pattern(2)]
        worker = kv.create_worker(be, gpu, ranks.layout(), blocks_per_chunk=ranks.BPC,
                                  num_cpu_chunks=ranks.CHUNKS, region=region)
        ranks.store_all(worker, 1)
        rows = region.snapshot_rows()
        width = ranks.BPC * ranks.PAGE_BYTES
        slices = [rows[:, t * width:(t + 1) * width] for t in range(2 * ranks.NUM_TENSORS)]
        worker_rows = worker.cpu_snapshot()
        report = worker.shutdown()
        return {"owner_is_me": region.owner.pid == os.getpid(),
                "sees_parent": all(np.array_equal(a, b) for a, b in zip(slices[:2], ranks.cpu_rows(1),
                                                                        strict=True)),
                "own_slice": all(np.array_equal(a, b) for a, b in zip(worker_rows, ranks.cpu_rows(2), strict=True)),
                "region": report.region, "errors": list(report.errors), "live": dict(be.ledger.live())}

    out, _ = _in_child(child)
    assert out == {"owner_is_me": True, "sees_parent": True, "own_slice": True, "region": "released",
                   "errors": [], "live": {}}
    assert not os.path.exists(parent.region.path), "the child's own rank completed the mapped set (R18)"
    assert all(np.array_equal(a, b) for a, b in zip(parent.worker.cpu_snapshot(), ranks.cpu_rows(1), strict=True))
    report = parent.worker.shutdown()
    assert report.region == "released" and report.errors == () and parent.backend.ledger.live() == {}


# -- workers: a child forked while another thread is inside a worker call ---------------------------------------------
@pytest.mark.rule("R21")
def test_fork_child_forked_during_a_worker_call_exits_promptly(shm_dir: str) -> None:
    """Another thread holds the worker's lock (paused inside submit_store) at the fork: in the child that lock has
    no owner, so the finalizers and shutdown() must not wait for it."""
    parent = Parent.build(shm_dir)
    paused = forked.PausedSubmission(parent)
    owner = os.getpid()

    def child() -> dict[str, str]:
        out = {"shutdown": _outcome(parent.worker.shutdown, owner)}
        parent.worker._finalizer()  # what the child's exit runs (atexit), run now
        parent.region._finalizer()
        parent.region._dropped()
        out["finalizers"] = "returned"
        return out

    try:
        try:
            out, took = _in_child(child, bound=PROMPT)
        finally:
            resumed = paused.resume()
        assert out == {"shutdown": "closed", "finalizers": "returned"} and took < PROMPT
        assert resumed, f"the parent's paused submission did not complete: {paused.outcome!r}"
        parent.worker.wait({3})
        assert forked.check_parent(parent) == forked.PARENT_INTACT
    finally:
        parent.worker.shutdown()  # idempotent: after a failure, it still gives the file up


#: What ``stats()`` of an inherited worker does in the child: the engine may return a read of its copy (inert too).
STATS_IN_CHILD = {"engine": ("returned", "closed"), "reference": ("closed",)}


@pytest.mark.rule("R21")
@pytest.mark.parametrize("worker", WORKERS)
def test_fork_inherited_worker_is_inert_in_a_forked_child(worker: str) -> None:
    """Every public call of an inherited worker refuses in a child, naming the parent; its finalizer and shutdown
    touch nothing of the parent's; the parent is unaffected (the engine and the reference worker)."""
    factory, _ = FACTORIES[worker]
    setup = SETUPS["clean"]
    device = SimDevice(setup)
    built = factory(device.backend, device.gpu, setup)
    parent = os.getpid()

    def child() -> list[str]:
        calls = [built.get_finished, lambda: built.wait([1], 0.0), built.cpu_snapshot, built.stats, built.shutdown]
        outcomes = [_outcome(call, parent) for call in calls]
        live = dict(device.ledger.live())
        del calls
        gc.collect()
        return [*outcomes, str(dict(device.ledger.live()) == live)]

    found, _ = _in_child(child)
    assert isinstance(found, list)
    assert found.pop(3) in STATS_IN_CHILD[worker]
    assert found == ["closed"] * 4 + ["True"]
    assert built.shutdown().region == "released"
    assert device.ledger.live() == {}


# -- a child's real exit (a fresh interpreter forks; the child's exit is the interpreter's own) ------------------------
def _expected_calls() -> dict[str, object]:
    closed = ["submit_store", "submit_load", "get_finished", "wait", "cpu_snapshot", "shutdown", "region.snapshot",
              "region.snapshot_rows", "region.pin", "region.adopt", "region.check_backend"]
    return {**dict.fromkeys(closed, "closed"), "region.release": "[]", "region.unpin": "[]",
            "region.release_by_owner": "[]", "region.quarantine_by_owner": "[]", "region.state": "worker_owned"}


@pytest.mark.rule("R21")
@pytest.mark.rule("R18")
@pytest.mark.parametrize("mode", forked.MODES)
def test_fork_child_leaving_any_way_leaves_the_parents_worker_and_file(shm_dir: str, mode: str) -> None:
    """sys.exit, return, os._exit, after calling everything, from multiprocessing's "fork" processes, and while
    another parent thread held the worker's lock: the child exits promptly and the parent is unaffected."""
    proc = subprocess.run([sys.executable, "-W", "error", str(SCRIPT), mode, shm_dir], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    child = facts.pop("child")
    assert child["exitcode"] == 0, f"the child did not exit cleanly within {PROMPT} s (None: killed): {child}"
    if mode in ("calls", "mp_return", "mp_exit"):
        calls = child["calls"]
        assert calls.pop("stats") in ("returned", "closed")  # a read of the copy, or refused: both inert
        assert calls == _expected_calls()
    if mode == "paused_thread":
        assert child["paused_submission"] is True, "the parent's paused submission went on after the fork"
    assert facts == {"mode": mode, **forked.PARENT_INTACT}
