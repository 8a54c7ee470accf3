"""Spawn targets for tests/test_shared_region.py: each runs one rank of a shared region in a fresh process.

Not a test module. Every target reports through a one-way pipe -- ("ok", detail) or ("error", traceback) -- and
synchronizes only through the events and barriers it is given (bounded waits, never sleeps).
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

import kvoffload_ref as kv
from kvoffload_ref import shared_file, shared_region
from kvoffload_ref.backends.sim import SimBackend

PAGE_BYTES = 512
NUM_TENSORS = 2
BPC = 3
CHUNKS = 4
GPU_BLOCKS = BPC * CHUNKS
WAIT = 10.0  # seconds any cross-process wait may take before the rank gives up (a failure, never a pacing)

Bytes = npt.NDArray[np.uint8]


def layout() -> kv.KVCacheLayout:
    return kv.KVCacheLayout(tensor_page_bytes=(PAGE_BYTES,) * NUM_TENSORS,
                            groups=(tuple(kv.LayerRef(t, PAGE_BYTES) for t in range(NUM_TENSORS)),))


@dataclasses.dataclass(frozen=True)
class Rank:
    """What one rank opens: engine ``engine`` in ``directory`` as ``rank`` of ``world_size``."""

    directory: str
    engine: str
    rank: int
    world_size: int
    replicated: bool = False
    timeout: float = WAIT

    def open(self, backend: Any) -> kv.SharedRegion:
        return kv.SharedRegion.open(self.engine, backend=backend, layout=layout(), blocks_per_chunk=BPC,
                                    num_cpu_chunks=CHUNKS, rank=self.rank, world_size=self.world_size,
                                    replicated=self.replicated, directory=self.directory, timeout=self.timeout)


def gpu_pattern(seed: int) -> list[Bytes]:
    """Host copies of the GPU tensors a rank stores: distinct random bytes per seed."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (GPU_BLOCKS, PAGE_BYTES), dtype=np.uint8) for _ in range(NUM_TENSORS)]


def cpu_rows(seed: int) -> list[Bytes]:
    """The CPU tensors after storing GPU blocks 0..GPU_BLOCKS-1 into chunks 0..CHUNKS-1 (BPC blocks a row)."""
    return [t.reshape(CHUNKS, BPC * PAGE_BYTES) for t in gpu_pattern(seed)]


def store_all(worker: kv.CPUOffloadingWorker, job: int) -> None:
    worker.submit_store(job, kv.GPULoadStoreSpec(list(range(GPU_BLOCKS)), (GPU_BLOCKS,), (0,)),
                        kv.CPULoadStoreSpec(list(range(CHUNKS))))
    worker.wait({job})


def load_all(worker: kv.CPUOffloadingWorker, job: int) -> None:
    worker.submit_load(job, kv.CPULoadStoreSpec(list(range(CHUNKS))),
                       kv.GPULoadStoreSpec(list(range(GPU_BLOCKS)), (GPU_BLOCKS,), (0,)))
    worker.wait({job})


def _report(conn: Connection, body: Callable[[], object]) -> None:
    try:
        conn.send(("ok", body()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _check_all_slices(region: kv.SharedRegion, world_size: int) -> None:
    """Rank 0 sees every rank's slice at its own offset, byte-exact, and zero padding: the slices do not overlap."""
    rows = region.snapshot_rows()
    width = BPC * PAGE_BYTES
    covered = np.zeros(rows.shape[1], dtype=bool)
    for r in range(world_size):
        for t, expected in enumerate(cpu_rows(seed=r + 1)):
            start = r * NUM_TENSORS * width + t * width
            assert not covered[start:start + width].any(), f"rank {r} tensor {t} overlaps another slice"
            covered[start:start + width] = True
            assert np.array_equal(rows[:, start:start + width], expected), f"rank {r} tensor {t} differs"
    assert not rows[:, ~covered].any(), "the padding of every row is untouched"


def store_and_check(spec: Rank, barrier: Any, conn: Connection) -> None:
    """A rank with a worker: store its own pattern, read back exactly its own slice, load it back to the GPU."""
    def body() -> dict[str, Any]:
        be = SimBackend()
        region = spec.open(be)
        writer = spec.rank == 0 or not spec.replicated
        seed = 1 if spec.replicated else spec.rank + 1
        gpu = [be.from_host(h) for h in gpu_pattern(seed if writer else 99)]
        with kv.create_worker(be, gpu, layout(), blocks_per_chunk=BPC, num_cpu_chunks=CHUNKS,
                              region=region) as worker:
            if writer:
                store_all(worker, 1)
            barrier.wait(WAIT)  # every rank has mapped (so the file is unlinked) and stored
            snapshot = worker.cpu_snapshot()
            assert all(np.array_equal(a, b) for a, b in zip(snapshot, cpu_rows(seed), strict=True)), "own slice"
            if spec.rank == 0 and not spec.replicated:
                _check_all_slices(region, spec.world_size)
            load_all(worker, 2)
            assert all(np.array_equal(be.to_host(g), h) for g, h in zip(gpu, gpu_pattern(seed), strict=True))
            barrier.wait(WAIT)  # nobody writes any more before everyone has read
        report = worker.shutdown()
        assert report.region == "released" and not be.ledger.live() and not be.violations, report
        return {"creator": region.is_creator, "path_left": os.path.exists(region.path),
                "released": be.ledger.released().get("shm_file"), "acquired": be.ledger.acquired().get("shm_file")}
    _report(conn, body)


def _block(reached: Any, resume: Any) -> NoReturn:
    """Tell the parent this point was reached, then wait until it resumes us (or kills us)."""
    reached.set()
    if not resume.wait(WAIT):
        raise TimeoutError("the parent never resumed this rank")
    raise RuntimeError("stopped here by the test")


def stop_at(spec: Rank, where: str, reached: Any, resume: Any, conn: Connection) -> None:
    """Open a rank and stop at ``where``: "after_create" (a creator, right after its ``O_EXCL`` create: the next
    step is the ``fchmod`` of the new file), "before_size" (creator), "before_map" or "after_map".

    The parent then kills the process (SIGKILL) or sets ``resume``, which makes the stopped step raise.
    """
    def stuck(fd: int, size: int) -> NoReturn:
        _block(reached, resume)

    def body() -> str:
        if where == "after_create":
            shared_file.os.fchmod = stuck  # this process only opens the region: nothing else calls fchmod
        elif where == "before_size":
            shared_file._size_file = stuck
        elif where == "before_map":
            shared_region._map_file = stuck
        be = SimBackend()
        try:
            region = spec.open(be)
        except RuntimeError as exc:
            assert not be.ledger.live(), be.ledger.live()
            return f"open failed as told: {exc}"
        try:
            _block(reached, resume)
        finally:
            region.release()
    _report(conn, body)
