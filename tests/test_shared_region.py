"""SharedRegion: geometry, the create/join/unlink protocol (R17, R18), ownership (R1, R2), release order (R3).

Process tests spawn real ranks (tests/_shm_ranks.py); they synchronize only through events, barriers and pipes
with bounded waits. Every test works in its own directory under /dev/shm, which must be empty at teardown.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import multiprocessing
import os
import pathlib
import shutil
import stat
import struct
import time
import uuid
from collections.abc import Iterator
from typing import Any

import _shm_ranks as ranks
import numpy as np
import pytest
from _shm_ranks import Rank
from _support import messages

import kvoffload_ref as kv
from kvoffload_ref import shared_file, shared_region
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.region import PAGE

SHM = "/dev/shm"
TEST_DIR_PREFIX = "kvoffload-test-"
JOIN = 10.0  # the longest any process may take to report (a bound for failures, never a pacing)
CTX = multiprocessing.get_context("spawn")

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="needs /dev/shm")


# Invariant: the test directories this session created (other sessions may run at the same time).
_CREATED_DIRS: set[str] = set()


def _library_files() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(shared_region.FILE_PREFIX)}


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_in_dev_shm() -> Iterator[None]:
    """Session check: no file named like the library's appeared in /dev/shm itself, and every test directory of
    this session is gone."""
    before = _library_files()
    yield
    assert _library_files() - before == set()
    assert [d for d in _CREATED_DIRS if os.path.exists(d)] == []


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory under /dev/shm; it must be empty at teardown (then it is removed)."""
    path = os.path.join(SHM, f"{TEST_DIR_PREFIX}{uuid.uuid4().hex}")
    os.mkdir(path, 0o700)
    _CREATED_DIRS.add(path)
    yield path
    left = sorted(os.listdir(path))
    shutil.rmtree(path)
    assert left == [], f"files left behind: {left}"


def _rank(shm_dir: str, rank: int, world_size: int, engine: str = "engine-42", **kwargs: Any) -> Rank:
    return Rank(shm_dir, engine, rank, world_size, **kwargs)


class _Proc:
    """One spawned rank and the read end of its result pipe."""

    def __init__(self, target: Any, *args: Any) -> None:
        self.conn, child_end = CTX.Pipe(duplex=False)
        self.process = CTX.Process(target=target, args=(*args, child_end), daemon=True)
        self.process.start()
        child_end.close()

    def result(self) -> Any:
        assert self.conn.poll(JOIN), "the rank did not report in time"
        status, detail = self.conn.recv()
        self.process.join(JOIN)
        assert status == "ok", detail
        assert self.process.exitcode == 0
        return detail

    def kill(self) -> None:
        self.process.kill()  # SIGKILL
        self.process.join(JOIN)
        assert self.process.exitcode == -9

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(JOIN)
        self.conn.close()


@pytest.fixture
def procs() -> Iterator[list[_Proc]]:
    """Spawned ranks of one test; any still alive at teardown is killed."""
    started: list[_Proc] = []
    yield started
    for proc in started:
        proc.close()


def _spawn(procs: list[_Proc], target: Any, *args: Any) -> _Proc:
    proc = _Proc(target, *args)
    procs.append(proc)
    return proc


def _stopped(procs: list[_Proc], spec: Rank, where: str) -> tuple[_Proc, Any]:
    """Spawn a rank that stops at ``where``; return it once it got there, with its resume event."""
    reached, resume = CTX.Event(), CTX.Event()
    proc = _spawn(procs, ranks.stop_at, spec, where, reached, resume)
    assert reached.wait(JOIN), f"the rank never reached {where}"
    return proc, resume


# -- names, geometry, validation -------------------------------------------------------------------------------------
@pytest.mark.rule("R17")
@pytest.mark.parametrize("engine_id", ["", ".", "..", "a/b", "../x", "a\0b", 42, "x" * 250])
def test_shared_region_rejects_unsafe_engine_ids(shm_dir: str, engine_id: Any) -> None:
    with pytest.raises(kv.InvalidTransferError):
        _rank(shm_dir, 0, 1, engine=engine_id).open(SimBackend())


@pytest.mark.rule("R17")
def test_shared_region_engine_id_leaves_room_for_the_creators_temporary_name(shm_dir: str) -> None:
    longest = 255 - shared_file.TEMP_NAME_EXTRA - len(shared_region.FILE_PREFIX + shared_region.FILE_SUFFIX)
    with pytest.raises(kv.InvalidTransferError, match="temporary name adds 22"):
        shared_region.region_path("x" * (longest + 1), shm_dir)
    region = _rank(shm_dir, 0, 1, engine="x" * longest).open(SimBackend())
    assert len(os.path.basename(region.path)) == 255 - 22
    region.release()


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("rank", "world_size", "extra"), [
    (2, 2, {}), (-1, 2, {}), (0, 0, {}), (0, shared_region.MAX_WORLD_SIZE + 1, {}), (True, 2, {}),
    (0, 2, {"timeout": -1.0}), (0, 2, {"timeout": float("inf")}), (0, 2, {"replicated": 1}),
])
def test_shared_region_rejects_bad_rank_world_size_timeout(shm_dir: str, rank: Any, world_size: Any,
                                                          extra: dict[str, Any]) -> None:
    with pytest.raises(kv.InvalidTransferError):
        _rank(shm_dir, rank, world_size, **extra).open(SimBackend())


BAD_NUMBERS = [10**400, -10**400, float("nan"), float("inf"), True, "1", -1]
BAD_IDS = ["10**400", "-10**400", "nan", "inf", "True", "str", "-1"]


@pytest.mark.rule("R7")
@pytest.mark.parametrize("value", BAD_NUMBERS, ids=BAD_IDS)
@pytest.mark.parametrize("name", ["timeout", "rank", "world_size", "blocks_per_chunk", "num_cpu_chunks"])
def test_shared_region_refuses_bad_numbers_before_touching_the_file(shm_dir: str, name: str, value: Any) -> None:
    """R7: every number is checked before any arithmetic and before the file is created (the directory stays
    empty: the fixture checks it) or anything is announced to the backend."""
    be = SimBackend()
    args: dict[str, Any] = {"blocks_per_chunk": ranks.BPC, "num_cpu_chunks": ranks.CHUNKS, "rank": 0,
                            "world_size": 2, "timeout": 1.0, name: value}
    with pytest.raises(kv.InvalidTransferError, match=rf"^{name}\b"):
        kv.SharedRegion.open("engine-r7", backend=be, layout=ranks.layout(), directory=shm_dir, **args)
    assert os.listdir(shm_dir) == [] and be.ledger.live() == {}


@pytest.mark.rule("R7")
@pytest.mark.parametrize(("bpc", "chunks"), [(2**62, 4), (2**40, 2**40)])
def test_shared_region_refuses_a_file_larger_than_an_offset_spans(shm_dir: str, bpc: int, chunks: int) -> None:
    be = SimBackend()
    with pytest.raises(kv.InvalidTransferError, match=r"bytes: expected at most 9223372036854775807$"):
        kv.SharedRegion.open("engine-r7", backend=be, layout=ranks.layout(), blocks_per_chunk=bpc,
                             num_cpu_chunks=chunks, rank=0, world_size=2, directory=shm_dir, timeout=1.0)
    assert os.listdir(shm_dir) == [] and be.ledger.live() == {}


@pytest.mark.rule("R17")
@pytest.mark.parametrize(("replicated", "stride", "offsets"), [(False, 8192, (3072, 4608)), (True, 4096, (0, 1536))])
def test_shared_region_geometry_is_upstreams_worked_example(shm_dir: str, replicated: bool, stride: int,
                                                            offsets: tuple[int, int]) -> None:
    """Reference 2.5: 2 tensors of 512-byte pages, bpc 3, 2 ranks; rank 1 owns bytes [3072, 6144) of 8192."""
    region = _rank(shm_dir, 1, 2, replicated=replicated).open(SimBackend())
    base = region.ptr + shared_region.HEADER_BYTES
    assert [(g.ptr - base, g.row_bytes, g.row_stride, g.rows) for g in region.geometries()] == [
        (off, 1536, stride, ranks.CHUNKS) for off in offsets]
    assert os.stat(region.path).st_size == PAGE + ranks.CHUNKS * stride == region.nbytes
    assert [s.shape for s in region.snapshot()] == [(ranks.CHUNKS, 1536)] * 2
    region.release()


@pytest.mark.rule("R17")
def test_shared_region_creator_makes_an_exclusive_0600_file(shm_dir: str) -> None:
    r0 = _rank(shm_dir, 0, 2).open(SimBackend())
    st = os.lstat(r0.path)
    assert r0.is_creator and stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert r0.path == os.path.join(shm_dir, "kvoffload_ref_engine-42.mmap")
    r1 = _rank(shm_dir, 1, 2).open(SimBackend())
    assert not r1.is_creator and not os.path.exists(r0.path), "R18: unlinked once every rank mapped it"
    r0.release()
    r1.release()


# -- ownership, release order, accounting (R1, R2, R3, R16) ------------------------------------------------------------
@pytest.mark.rule("R1")
@pytest.mark.rule("R16")
def test_shared_region_worker_owns_it_and_releases_it(shm_dir: str) -> None:
    be = SimBackend()
    region = _rank(shm_dir, 0, 2).open(be)
    gpu = [be.from_host(h) for h in ranks.gpu_pattern(1)]
    worker = kv.create_worker(be, gpu, ranks.layout(), blocks_per_chunk=ranks.BPC, num_cpu_chunks=ranks.CHUNKS,
                              region=region)
    with pytest.raises(kv.OwnershipError):
        region.release()
    ranks.store_all(worker, 1)
    assert all(np.array_equal(a, b) for a, b in zip(worker.cpu_snapshot(), ranks.cpu_rows(1), strict=True))
    assert os.path.exists(region.path), "rank 1 never mapped it: the file stays until the last release"
    report = worker.shutdown()
    assert report.region == "released" and not os.path.exists(region.path)
    assert be.ledger.live() == {} and be.ledger.acquired()["shm_file"] == be.ledger.released()["shm_file"] == 1


@pytest.mark.rule("R2")
def test_shared_region_stays_the_callers_when_construction_fails(shm_dir: str) -> None:
    be = SimBackend(faults=kv.FaultPlan([kv.Fault("host_register", "error", nth=3)]))
    region = _rank(shm_dir, 0, 2).open(be)
    gpu = [be.from_host(h) for h in ranks.gpu_pattern(1)]
    with pytest.raises(kv.InvalidTransferError):
        kv.create_worker(be, gpu[:1], ranks.layout(), blocks_per_chunk=ranks.BPC, num_cpu_chunks=ranks.CHUNKS,
                         region=region)
    with pytest.raises(kv.DeviceError):  # chunked pinning fails at the third chunk and rolls back
        kv.create_worker(be, gpu, ranks.layout(), blocks_per_chunk=ranks.BPC, num_cpu_chunks=ranks.CHUNKS,
                         region=region, pin_chunk_bytes=PAGE, require_pinned=True)
    assert region.state.value == "caller_owned" and not region.pinned and "pinned" not in be.ledger.live()
    assert len(region.snapshot()) == 2 and os.path.exists(region.path)
    assert region.release() == [] and not os.path.exists(region.path)
    assert be.ledger.live() == {}


class _RecordingSim(SimBackend):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def host_unregister(self, ptr: int) -> None:
        self.calls.append(f"unregister {ptr:#x}")
        super().host_unregister(ptr)

    def untrack_host(self, ptr: int) -> None:
        self.calls.append("unmap")
        super().untrack_host(ptr)


@pytest.mark.rule("R3")
def test_shared_region_release_order_unpin_unmap_unlink_close(shm_dir: str, monkeypatch: Any, caplog: Any) -> None:
    calls: list[str] = []
    region = _rank(shm_dir, 0, 2).open(_RecordingSim(calls))
    region.pin(chunk_bytes=PAGE)
    fd, path = region._file.fd, region.path
    real_unlink, real_close = os.unlink, os.close

    def unlink(target: Any, *args: Any, **kwargs: Any) -> None:
        calls.append("unlink")
        real_unlink(target, *args, **kwargs)

    def close(descriptor: int) -> None:
        calls.extend(["close"] if descriptor == fd else [])
        real_close(descriptor)

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "close", close)
    with caplog.at_level(logging.INFO, logger="kvoffload_ref"):
        assert region.release() == []
    unregs = [c for c in calls if c.startswith("unregister")]
    assert len(unregs) == region.nbytes // PAGE and unregs == sorted(unregs, reverse=True), "reverse order"
    assert calls[len(unregs):] == ["unmap", "unlink", "close"]
    assert f"Removed mmap file {path}" in messages(caplog)
    assert region.release() == [] and calls.count("close") == 1, "released at most once"


@pytest.mark.rule("R3")
def test_shared_region_failed_unregister_names_the_rank_and_release_goes_on(shm_dir: str, caplog: Any) -> None:
    be = SimBackend(faults=kv.FaultPlan([kv.Fault("host_unregister", "error", status=713)]))
    region = _rank(shm_dir, 1, 2).open(be)
    region.pin()
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        assert region.release() == ["host_unregister failed (status 713)"]
    assert "cudaHostUnregister failed for rank=1 (code=713)" in messages(caplog)
    assert not os.path.exists(region.path), "the unmap, unlink and close still ran"
    assert be.ledger.leaked() == {"pinned": 1} and be.ledger.live() == {}


@pytest.mark.rule("R18")
def test_shared_region_dropped_unreleased_still_gives_up_its_file(shm_dir: str) -> None:
    be = SimBackend()
    region = _rank(shm_dir, 0, 2).open(be)
    path = region.path
    del region
    gc.collect()
    assert not os.path.exists(path) and "shm_file" not in be.ledger.live()


@pytest.mark.rule("R3")
def test_shared_region_dropped_unreleased_is_unpinned_and_unmapped_too(shm_dir: str, caplog: Any) -> None:
    """The region's finalizer runs R3's steps for a caller-owned shared region; the file's finalizer gives up
    the name: nothing of it stays live on the backend, and the rank can be opened afresh."""
    be = SimBackend()
    region = _rank(shm_dir, 0, 1).open(be)
    region.pin(chunk_bytes=PAGE)
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        del region
        gc.collect()
    assert any(m.startswith("SharedRegion of ") and "dropped without release()" in m for m in messages(caplog))
    assert be.ledger.live() == {} and be.ledger.leaked() == {}
    again = _rank(shm_dir, 0, 1).open(be)
    again.release()
    assert be.ledger.live() == {}


@pytest.mark.rule("R3")
@pytest.mark.rule("R16")
@pytest.mark.parametrize("point", ["host_unregister", "unmap"])
def test_shared_region_release_goes_on_past_a_failed_step(shm_dir: str, point: str) -> None:
    """R3: a failed unregister or unmap is logged, listed and leaked, and the steps after it still run: the last
    opener unlinks the file and closes its descriptor (the file's ledger entry is released)."""
    plan = kv.FaultPlan()
    be = SimBackend(faults=plan)
    region = _rank(shm_dir, 0, 1).open(be)
    path = region.path
    gpu = [be.from_host(h) for h in ranks.gpu_pattern(0)]
    worker = kv.create_worker(be, gpu, ranks.layout(), blocks_per_chunk=ranks.BPC, num_cpu_chunks=ranks.CHUNKS,
                              region=region, policy=kv.ShutdownPolicy(timeout=0.5))
    worker.submit_store(1, kv.GPULoadStoreSpec([0, 1, 2], (3,), (0,)), kv.CPULoadStoreSpec([0]))
    plan.add(kv.Fault(point, "error"))
    report = worker.shutdown()
    kind = "pinned" if point == "host_unregister" else "mapping"
    assert report.region == "released" and dict(report.leaked) == {kind: 1} == be.ledger.leaked()
    assert any(f"{point} failed" in e for e in report.errors), report.errors
    assert not os.path.exists(path), "the file was still unlinked"
    assert be.ledger.live() == {} and be.ledger.released().get("shm_file") == 1


@pytest.mark.rule("R7")
def test_shared_region_knows_its_backend_and_refuses_another(shm_dir: str) -> None:
    be = SimBackend()
    region = _rank(shm_dir, 0, 1).open(be)
    try:
        assert region.backend is be
        region.check_backend(be)
        with pytest.raises(kv.InvalidTransferError, match=r"SharedRegion\.open\(\.\.\., backend=backend\)"):
            region.check_backend(SimBackend())
    finally:
        region.release()


# -- quarantine (R12, R18) ---------------------------------------------------------------------------------------------
@pytest.mark.rule("R18")
@pytest.mark.rule("R12")
def test_shared_region_quarantine_gives_up_the_name_keeps_mapping_pins_and_rank(shm_dir: str) -> None:
    be0, be1 = SimBackend(), SimBackend()
    r0, r1 = _rank(shm_dir, 0, 3).open(be0), _rank(shm_dir, 1, 3).open(be1)
    r0.pin()
    r0.adopt()
    assert r0.quarantine_by_owner("test") == []
    assert os.path.exists(r0.path), "rank 1 is still live: the name stays until it releases"
    assert r0.quarantined_resources == be0.ledger.quarantined() == {"pinned": 1, "mapping": 1, "shm_file": 1}
    assert be0.ledger.live() == {} and np.frombuffer(r0._mmap, np.uint8)[-1] == 0  # type: ignore[arg-type]
    with pytest.raises(kv.OwnershipError, match="already open"):
        _rank(shm_dir, 0, 3).open(SimBackend())  # the quarantined memory is never handed out again
    r1.release()
    assert not os.path.exists(r0.path), "the last live opener removed it"


@pytest.mark.rule("R18")
@pytest.mark.rule("R12")
def test_shared_region_worker_quarantine_removes_the_file(shm_dir: str) -> None:
    be = SimBackend(faults=kv.FaultPlan([kv.Fault("event_query", "hang", direction="store", job_id=1)]))
    region = _rank(shm_dir, 0, 2).open(be)
    gpu = [be.from_host(h) for h in ranks.gpu_pattern(1)]
    worker = kv.create_worker(be, gpu, ranks.layout(), blocks_per_chunk=ranks.BPC, num_cpu_chunks=ranks.CHUNKS,
                              region=region, policy=kv.ShutdownPolicy(timeout=0.5))
    worker.submit_store(1, kv.GPULoadStoreSpec([0, 1, 2], (3,), (0,)), kv.CPULoadStoreSpec([0]))
    report = worker.shutdown()
    assert report.region == "quarantined" and not os.path.exists(region.path)
    assert be.ledger.live() == {} and region.quarantined_resources == {"pinned": 1, "mapping": 1, "shm_file": 1}
    assert be.ledger.quarantined() == {**region.quarantined_resources, "descriptor": 1}, "and the hung copy's"


# -- refusals: geometry, duplicate rank, symlink, foreign files, space (R17, R18) ------------------------------------
@pytest.mark.rule("R17")
@pytest.mark.parametrize(("change", "field"), [
    ({"world_size": 3}, "world_size"), ({"replicated": True}, "replicated"), ({"num_cpu_chunks": 5}, "num_chunks"),
    ({"layout": kv.KVCacheLayout((1024,), ((kv.LayerRef(0, 1024),),))}, "layout_crc"),
])
def test_shared_region_geometry_mismatch_between_ranks_is_refused(shm_dir: str, change: dict[str, Any],
                                                                  field: str) -> None:
    r0 = _rank(shm_dir, 0, 2).open(SimBackend())
    args: dict[str, Any] = dict(backend=SimBackend(), layout=ranks.layout(), blocks_per_chunk=ranks.BPC,
                                num_cpu_chunks=ranks.CHUNKS, rank=1, world_size=2, directory=shm_dir, timeout=1.0)
    with pytest.raises(kv.InvalidTransferError, match=rf"geometry mismatch between ranks .*{field}: file"):
        kv.SharedRegion.open("engine-42", **{**args, **change})
    assert os.path.exists(r0.path), "a refused joiner leaves the file alone"
    r0.release()


@pytest.mark.rule("R17")
def test_shared_region_second_live_opener_of_a_rank_is_refused(shm_dir: str) -> None:
    r0 = _rank(shm_dir, 0, 2).open(SimBackend())
    with pytest.raises(kv.OwnershipError, match=r"rank 0 .* already open in a live process"):
        _rank(shm_dir, 0, 2).open(SimBackend())
    r0.release()


@pytest.mark.rule("R17")
def test_shared_region_symlink_at_the_path_is_refused_at_once(shm_dir: str) -> None:
    target = os.path.join(shm_dir, "target")
    pathlib.Path(target).write_bytes(b"precious")
    path = shared_region.region_path("engine-42", shm_dir)
    os.symlink(target, path)
    started = time.monotonic()
    with pytest.raises(OSError, match="symbolic link") as info:
        _rank(shm_dir, 0, 2, timeout=30.0).open(SimBackend())
    assert info.value.errno == errno.ELOOP and time.monotonic() - started < 1.0, "never waited on"
    assert os.path.islink(path) and pathlib.Path(target).read_bytes() == b"precious"
    os.unlink(path)
    os.unlink(target)


@pytest.mark.rule("R18")
def test_shared_region_never_unlinks_a_foreign_file(shm_dir: str, caplog: Any) -> None:
    path = shared_region.region_path("engine-42", shm_dir)
    pathlib.Path(path).write_bytes(b"not a region")
    with pytest.raises(FileExistsError, match="not a kvoffload_ref region"):
        _rank(shm_dir, 0, 2).open(SimBackend())
    os.truncate(path, 0)  # an empty file: creators publish whole files, so it is not ours: refused, never removed
    with pytest.raises(FileExistsError, match="an empty file, not a published kvoffload_ref region"):
        _rank(shm_dir, 0, 2, timeout=30.0).open(SimBackend())
    assert os.path.exists(path)
    os.unlink(path)
    region = _rank(shm_dir, 0, 2).open(SimBackend())
    os.unlink(path)  # someone replaces our file with theirs: another inode at the same path
    pathlib.Path(path).write_bytes(b"theirs")
    with caplog.at_level(logging.INFO, logger="kvoffload_ref"):
        assert region.release() == []
    assert pathlib.Path(path).read_bytes() == b"theirs" and "Removed mmap file" not in " ".join(messages(caplog))
    os.unlink(path)


@pytest.mark.rule("R17")
def test_shared_region_checks_free_space_before_sizing(shm_dir: str) -> None:
    free = os.statvfs(shm_dir).f_bavail * os.statvfs(shm_dir).f_frsize
    chunks = free // 4096 + 1
    be = SimBackend()
    with pytest.raises(OSError, match=r"needs \d+ bytes, \d+ bytes free") as info:
        kv.SharedRegion.open("big", backend=be, layout=ranks.layout(), blocks_per_chunk=1, num_cpu_chunks=chunks,
                             rank=0, world_size=1, directory=shm_dir)
    assert info.value.errno == errno.ENOSPC and be.ledger.live() == {}, "the creator removed its file"


@pytest.mark.rule("R17")
def test_shared_region_two_engines_never_collide(shm_dir: str) -> None:
    be_a, be_b = SimBackend(), SimBackend()
    a, b = _rank(shm_dir, 0, 2, engine="a").open(be_a), _rank(shm_dir, 0, 2, engine="a.mmap").open(be_b)
    assert a.is_creator and b.is_creator and a.path != b.path
    assert os.stat(a.path).st_ino != os.stat(b.path).st_ino
    gpu = [be_a.from_host(h) for h in ranks.gpu_pattern(1)]
    with kv.create_worker(be_a, gpu, ranks.layout(), blocks_per_chunk=ranks.BPC, num_cpu_chunks=ranks.CHUNKS,
                          region=a) as worker:
        ranks.store_all(worker, 1)
        assert not b.snapshot_rows().any() and a.snapshot_rows().any()
    b.release()


# -- real processes --------------------------------------------------------------------------------------------------
@pytest.mark.rule("R17")
@pytest.mark.rule("R18")
def test_shared_region_ranks_in_processes_read_back_only_their_own_slice(shm_dir: str, procs: list[_Proc]) -> None:
    world = 3
    barrier = CTX.Barrier(world)
    started = [_spawn(procs, ranks.store_and_check, _rank(shm_dir, r, world), barrier) for r in range(world)]
    results = [p.result() for p in started]
    assert sum(r["creator"] for r in results) == 1, "exactly one creator"
    assert not any(r["path_left"] for r in results), "unlinked once every rank mapped it"
    # Each descriptor opened was closed once: one, or two for a rank whose temporary file lost the race to publish.
    assert all(r["released"] == r["acquired"] in (1, 2) for r in results), results


@pytest.mark.rule("R17")
def test_shared_region_replicated_ranks_see_the_same_bytes(shm_dir: str, procs: list[_Proc]) -> None:
    barrier = CTX.Barrier(2)
    started = [_spawn(procs, ranks.store_and_check, _rank(shm_dir, r, 2, replicated=True), barrier)
               for r in range(2)]
    assert [p.result()["path_left"] for p in started] == [False, False]


@pytest.mark.rule("R18")
def test_shared_region_rank_killed_before_mapping_leaves_no_file(shm_dir: str, procs: list[_Proc]) -> None:
    r0 = _rank(shm_dir, 0, 2).open(SimBackend())
    victim, _ = _stopped(procs, _rank(shm_dir, 1, 2), "before_map")
    victim.kill()
    assert os.path.exists(r0.path), "rank 1 never mapped: the set is not complete"
    r0.release()
    assert not os.path.exists(r0.path), "the last live rank removed it"


@pytest.mark.rule("R18")
def test_shared_region_rank_killed_after_mapping_counts_as_mapped(shm_dir: str, procs: list[_Proc]) -> None:
    r0 = _rank(shm_dir, 0, 3).open(SimBackend())
    victim, _ = _stopped(procs, _rank(shm_dir, 2, 3), "after_map")
    with pytest.raises(kv.OwnershipError, match="already open in a live process"):
        _rank(shm_dir, 2, 3).open(SimBackend())  # rank 2 is live in the victim
    victim.kill()
    assert os.path.exists(r0.path)
    r1 = _rank(shm_dir, 1, 3).open(SimBackend())
    assert not os.path.exists(r0.path), "ranks 0, 1 and the dead rank 2 mapped it: rank 1 removed it"
    r0.release()
    r1.release()


def _hold_lock(path: str, byte: int, kind: int = fcntl.F_WRLCK) -> int:
    """Open ``path`` and take an OFD lock on one byte, as a peer process would (byte 0: the gate); the descriptor."""
    fd = os.open(path, os.O_RDWR)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hh4xqqi4x", kind, os.SEEK_SET, byte, 1, 0))
    return fd


class _RealClock:
    """Stands in for ``time`` in shared_file: ``sleep`` advances ``monotonic``, so waits cost no real time."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds


@pytest.mark.rule("R11")
@pytest.mark.rule("R18")
@pytest.mark.parametrize(("policy_timeout", "region_timeout", "busy", "bound"), [
    (0.3, 30.0, False, 0.3),  # the rest of the shutdown's timeout
    (30.0, 0.5, False, 0.5),  # the region's own timeout
    (30.0, 30.0, False, shared_file.RELEASE_GATE_TIMEOUT),
    (0.3, 30.0, True, shared_file.RELEASE_GATE_GRACE),  # a hung transfer spent the budget: the grace only
])
def test_shared_region_frozen_peer_holding_the_lock_costs_at_most_the_callers_timeout(
        shm_dir: str, monkeypatch: Any, policy_timeout: float, region_timeout: float, busy: bool,
        bound: float) -> None:
    """A peer frozen while holding the gate (SIGSTOP) delays the worker's shutdown by no more than what is left
    of its policy's timeout (R11) -- never longer than the region's timeout or RELEASE_GATE_TIMEOUT; the name step
    is then skipped, listed in the report, and the file is left for the next open, which replaces it."""
    faults = kv.FaultPlan([kv.Fault("copy", "hang", direction="store")]) if busy else None
    be = SimBackend(faults=faults)
    region = _rank(shm_dir, 0, 2, timeout=region_timeout).open(be)
    gpu = [be.from_host(h) for h in ranks.gpu_pattern(1)]
    worker = kv.create_worker(be, gpu, ranks.layout(), blocks_per_chunk=ranks.BPC, num_cpu_chunks=ranks.CHUNKS,
                              region=region, policy=kv.ShutdownPolicy(timeout=policy_timeout, on_unproven="release"))
    if busy:
        worker.submit_store(1, kv.GPULoadStoreSpec([0], (1,), (0,)), kv.CPULoadStoreSpec([0]))  # never completes:
        # the drain waits the whole timeout, so nothing is left of it for the lock
    frozen = _hold_lock(region.path, byte=0)
    clock = _RealClock()
    monkeypatch.setattr(shared_file, "time", clock)
    report = worker.shutdown()
    assert bound - 0.01 <= clock.slept <= bound + 0.01, clock.slept
    assert report.region == "released" and any("gave up waiting for the lock" in e for e in report.errors)
    monkeypatch.undo()
    os.close(frozen)  # the peer is gone: the file has no live opener
    assert os.path.exists(region.path)
    again = _rank(shm_dir, 0, 2).open(SimBackend())
    assert again.is_creator, "the stale file was replaced"
    again.release()


def _temps(shm_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(shm_dir) if n.endswith(".tmp"))


@pytest.mark.rule("R17")
def test_shared_region_creator_building_its_file_blocks_nobody(shm_dir: str, procs: list[_Proc]) -> None:
    """A creator still building its file (stopped before sizing it) has published nothing: another rank creates
    and publishes the file at once, without waiting; the first, failing later, removes only its temporary file."""
    creator, resume = _stopped(procs, _rank(shm_dir, 0, 2), "before_size")
    path = shared_region.region_path("engine-42", shm_dir)
    assert not os.path.exists(path) and len(_temps(shm_dir)) == 1, "built under a temporary name"
    region = _rank(shm_dir, 1, 2, timeout=0.0).open(SimBackend())  # no time to wait: it must not need any
    assert region.is_creator and region.path == path and len(_temps(shm_dir)) == 1
    resume.set()  # the stopped creator's sizing step now fails: it removes its temporary file, not the file
    assert creator.result().startswith("open failed as told")
    assert _temps(shm_dir) == [] and os.path.exists(path)
    region.release()


@pytest.mark.rule("R17")
@pytest.mark.rule("R18")
@pytest.mark.parametrize("where", ["after_create", "before_size"])
def test_shared_region_creator_killed_before_publishing_blocks_nobody(shm_dir: str, procs: list[_Proc], where: str,
                                                                      caplog: Any) -> None:
    """A creator SIGKILLed right after creating its file, or before sizing it, leaves no file at the path (at most
    its temporary file): the engine id opens at once, and the dead creator's temporary file is removed."""
    dead, _ = _stopped(procs, _rank(shm_dir, 0, 2, engine="e"), where)
    dead.kill()
    path = shared_region.region_path("e", shm_dir)
    assert not os.path.exists(path), "nothing was published"
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        region = _rank(shm_dir, 1, 2, engine="e", timeout=0.5).open(SimBackend())
    assert region.is_creator and _temps(shm_dir) == []
    assert "Removed stale temporary file" in " ".join(messages(caplog))
    region.release()


@pytest.mark.rule("R18")
def test_shared_region_temporary_files_of_live_creators_and_strangers_are_left_alone(shm_dir: str) -> None:
    """Only a temporary file of this engine's file, whose pid names no process and on which no lock is held, is
    removed: a live process's, a locked one (a creator in another pid namespace) and another engine's stay."""
    base = ".kvoffload_ref_e.mmap"
    live = os.path.join(shm_dir, f"{base}.{os.getppid()}.0123abcd.tmp")  # our parent: alive
    other = os.path.join(shm_dir, f".kvoffload_ref_e.mmap.mmap.{2**22 + 1}.0123abcd.tmp")  # engine "e.mmap"'s
    locked = os.path.join(shm_dir, f"{base}.{2**22 + 1}.89abcdef.tmp")  # no such pid, but a lock is held
    dead = os.path.join(shm_dir, f"{base}.{2**22 + 1}.00000000.tmp")
    for name in (live, other, locked, dead):
        pathlib.Path(name).write_bytes(b"")
    holder = _hold_lock(locked, byte=1, kind=fcntl.F_RDLCK)
    try:
        region = _rank(shm_dir, 0, 1, engine="e").open(SimBackend())
        assert sorted(os.listdir(shm_dir)) == sorted(os.path.basename(n) for n in (live, other, locked))
        region.release()
    finally:
        os.close(holder)
    for name in (live, other, locked):
        os.unlink(name)


@pytest.mark.rule("R18")
def test_shared_region_stale_file_of_a_dead_engine_is_replaced(shm_dir: str, procs: list[_Proc],
                                                               caplog: Any) -> None:
    dead, _ = _stopped(procs, _rank(shm_dir, 0, 2, engine="e"), "after_map")
    dead.kill()
    path = shared_region.region_path("e", shm_dir)
    assert os.path.exists(path), "the whole engine died: its file is left"
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        region = _rank(shm_dir, 1, 2, engine="e").open(SimBackend())
    assert region.is_creator and f"Found stale mmap file {path}" in " ".join(messages(caplog))
    region.release()


@pytest.mark.rule("R18")
def test_shared_region_last_rank_killed_after_the_others_released_leaves_the_file_to_the_next_open(
        shm_dir: str, procs: list[_Proc], caplog: Any) -> None:
    """A group that never completed its set of mappings (rank 2 never opened): rank 0 released while rank 1 was
    live, then rank 1 was SIGKILLed. Nobody is left to unlink the file: it stays until the next open of the
    engine id, which replaces it as stale."""
    r0 = _rank(shm_dir, 0, 3).open(SimBackend())
    victim, _ = _stopped(procs, _rank(shm_dir, 1, 3), "after_map")
    assert r0.release() == [] and os.path.exists(r0.path), "rank 1 is live: rank 0 keeps the name"
    victim.kill()
    assert os.path.exists(r0.path), "the last live rank died: the file is left"
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        again = _rank(shm_dir, 2, 3).open(SimBackend())
    assert again.is_creator and f"Found stale mmap file {again.path}" in " ".join(messages(caplog))
    again.release()


@pytest.mark.rule("R29")
@pytest.mark.rule("R18")
def test_shared_region_quarantine_by_registration_keeps_the_whole_mapping(shm_dir: str) -> None:
    """R29: a shared region's pages are the file's, shared with the other ranks: its quarantine keeps the whole
    mapping and every registration, whatever chunks it is given (docs/shared-region.md)."""
    be0, be1 = SimBackend(), SimBackend()
    r0, r1 = _rank(shm_dir, 0, 3).open(be0), _rank(shm_dir, 1, 3).open(be1)
    r0.pin(r0.nbytes // 4)
    pins = be0.registrations()
    r0.adopt()
    assert len(pins) > 1 and r0.quarantine_by_owner("test", chunks=[0]) == []
    assert r0.kept_ranges == (kv.KeptRange(0, r0.nbytes, "test"),) and r0.quarantined_bytes == r0.nbytes
    assert be0.registrations() == pins and be0.ledger.quarantined()["pinned"] == len(pins)
    r1.release()


# ------------------------------------------------ a region's lifetime: TP=4 -> TP=2 on one host (docs/canonical.md)
def _worker_on(region: kv.SharedRegion, seed: int | None) -> tuple[kv.CPUOffloadingWorker, list[Any]]:
    """A worker owning ``region`` on its backend, over GPU tensors holding ``gpu_pattern(seed)`` (zeros: None)."""
    be = region.backend
    gpu = ([be.from_host(h) for h in ranks.gpu_pattern(seed)] if seed is not None
           else [be.empty_device((ranks.GPU_BLOCKS, ranks.PAGE_BYTES)) for _ in range(ranks.NUM_TENSORS)])
    return kv.create_worker(be, gpu, ranks.layout(), blocks_per_chunk=ranks.BPC, num_cpu_chunks=ranks.CHUNKS,
                            region=region), gpu


@pytest.mark.rule("R17")
def test_shared_region_new_group_finding_no_file_says_it_created_an_empty_one(shm_dir: str,
                                                                               caplog: Any) -> None:
    """The issue's TP=4 -> TP=2 mistake: a TP=4 group (world_size 4) stores; its file's name is given up once all
    four ranks mapped it; TP=2 ranks opening the same engine id then find no file and create an empty one. That is
    not silent: a WARNING naming the engine id, and the region's ``created_empty`` and repr say so."""
    tp4 = [ranks.Rank(shm_dir, "engine-tp", r, 4, replicated=True).open(SimBackend()) for r in range(4)]
    assert [region.created_empty for region in tp4] == [True, False, False, False]
    assert "joined an existing file" in repr(tp4[1]) and not os.path.exists(tp4[0].path)
    for region in tp4:
        region.release()
    with caplog.at_level(logging.INFO, logger="kvoffload_ref"):
        tp2 = ranks.Rank(shm_dir, "engine-tp", 0, 2, replicated=True).open(SimBackend())
    try:
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "no file at" in r.getMessage()]
        assert len(warned) == 1 and "'engine-tp'" in warned[0].getMessage()
        assert "created an empty one" in warned[0].getMessage()
        assert tp2.created_empty and "created empty here" in repr(tp2)
    finally:
        tp2.release()


@pytest.mark.rule("R17")
def test_shared_region_first_creator_of_a_name_logs_at_info_only(shm_dir: str, caplog: Any) -> None:
    with caplog.at_level(logging.INFO, logger="kvoffload_ref"):
        region = ranks.Rank(shm_dir, "engine-first", 0, 1).open(SimBackend())
    region.release()
    assert [r.levelno for r in caplog.records if "no file at" in r.getMessage()] == [logging.INFO]


@pytest.mark.rule("R18")
def test_shared_region_tp4_to_tp2_on_one_host_through_one_group_and_a_long_lived_owner(shm_dir: str,
                                                                                        caplog: Any) -> None:
    """The documented route: one group sized for every rank that will use it (4 + 2 = 6, replicated: every rank
    sees the same bytes), its rank 0 kept open (the long-lived owner) while the other TP=4 ranks are done; the TP=2
    ranks join later as ranks 4 and 5, find the file, and load what rank 0 stored."""
    tp4 = [ranks.Rank(shm_dir, "engine-6", r, 6, replicated=True).open(SimBackend()) for r in range(4)]
    owner, _ = _worker_on(tp4[0], seed=5)
    ranks.store_all(owner, 1)
    for region in tp4[1:]:
        region.release()  # TP=4 ranks 1-3 are done; rank 0's worker keeps the region (and the name) alive
    assert os.path.exists(tp4[0].path), "the name stays until all six ranks have mapped it"
    with caplog.at_level(logging.WARNING, logger="kvoffload_ref"):
        tp2 = [ranks.Rank(shm_dir, "engine-6", r, 6, replicated=True).open(SimBackend()) for r in (4, 5)]
    assert not any("no file at" in r.getMessage() for r in caplog.records)
    assert [region.created_empty for region in tp2] == [False, False]
    assert not os.path.exists(tp4[0].path), "all six mapped it: the name is given up, the bytes live on"
    for region in tp2:  # each TP=2 rank loads every chunk and holds what rank 0 stored
        worker, gpu = _worker_on(region, seed=None)
        ranks.load_all(worker, 2)
        assert [r.success for r in worker.get_finished()] == [True]
        held = [region.backend.to_host(t) for t in gpu]
        assert all(np.array_equal(a, b) for a, b in zip(held, ranks.gpu_pattern(5), strict=True))
        assert worker.shutdown().region == "released"
    assert owner.shutdown().region == "released"


@pytest.mark.rule("R18")
def test_a_shared_region_refuses_a_platform_that_refuses_registration(shm_dir: str) -> None:
    be = SimBackend(host_register="refuse")
    with pytest.raises(kv.RegistrationRefused, match="use a private region") as info:
        kv.SharedRegion.open("refused", backend=be, layout=ranks.layout(), blocks_per_chunk=3, num_cpu_chunks=4,
                          rank=0, world_size=1, directory=shm_dir)
    assert info.value.status == 801
    assert os.listdir(shm_dir) == [] and be.ledger.acquired() == {}, "refused before the file is touched"
