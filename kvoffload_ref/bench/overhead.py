"""Bench figures of what safety costs on the fast path, each against the same code without it, in the same run.

* **Race detector** (R20) -- the sim data path (store + load round trip through a worker, as in
  :mod:`~kvoffload_ref.bench.datapath`) on a ``SimBackend(race_check=True)`` against an identical rig with
  ``race_check=False``, timed alternately, best of N, for 4 KiB and 64 KiB pages. Ratio: throughput with the
  detector over throughput without (goal >= 0.8).
* **Locking** (R19) -- uncontended submit + reap from one thread: [2000 / quick: 300] one-block stores, each
  followed by ``get_finished()`` once the clock moved, with the worker's lock as it is against the same worker
  with the lock replaced by a no-op (what an unsafe single-threaded worker would cost). Ratio: transfers/s with the
  lock over transfers/s without it (goal >= 0.9).
"""

from __future__ import annotations

import math
import time
from types import TracebackType
from typing import Any, Final

from kvoffload_ref import lockcheck
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.bench.common import LAYERS, BenchRun, Goal, KiB, MiB, Result, result
from kvoffload_ref.bench.datapath import data_path_rig, round_trip
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.worker import CPUOffloadingWorker, create_worker

__all__ = ["bench_locking", "bench_race_check", "figures"]

GOAL_RACE_CHECK: Final = 0.8
GOAL_LOCKING: Final = 0.9


def bench_race_check(nbytes: int, job_blocks: int, repeats: int) -> list[Result]:
    """The data path with the race detector on against off (alternated), at 4 KiB and 64 KiB pages."""
    results = []
    for page in (4 * KiB, 64 * KiB):
        backends = {on: SimBackend(race_check=on) for on in (True, False)}
        rigs = {on: data_path_rig(page, nbytes, job_blocks, backend=be) for on, be in backends.items()}
        best = {True: math.inf, False: math.inf}
        try:
            for attempt in range(repeats + 1):  # the first is a warm-up
                for on, rig in rigs.items():
                    elapsed = round_trip(rig)
                    if attempt:
                        best[on] = min(best[on], elapsed)
        finally:
            for rig in rigs.values():
                rig.worker.shutdown()
        races = [v for be in backends.values() for v in be.violations if v.kind == "dma_race"]
        if races:
            raise AssertionError(f"race-check bench: the library's ordered schedule was flagged: {races[0]}")
        moved = 2 * int(rigs[True].store_rows.size) * page * LAYERS
        results.append(result(
            f"racecheck_{page // KiB}k", f"sim data path with the race detector, {page // KiB} KiB pages",
            (moved / best[True], "bytes/s"), (moved / best[False], "bytes/s", "the same rig, race_check=False"),
            f">= {GOAL_RACE_CHECK}x", [Goal("ratio", ">=", GOAL_RACE_CHECK)],
            note=f"store+load {moved // MiB} MiB per round trip, best of {repeats}"))
    return results


class _NoLock:
    """A lock that does nothing: what the worker would cost without R19."""

    def __enter__(self) -> bool:
        return True

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        return None

    def acquire(self) -> bool:
        return True

    def release(self) -> None:
        return None

    def _is_owned(self) -> bool:
        return False


def _small_worker(be: SimBackend) -> CPUOffloadingWorker:
    layout = KVCacheLayout((4 * KiB, 4 * KiB), ((LayerRef(0, 4 * KiB), LayerRef(1, 4 * KiB)),))
    gpu = [be.empty_device((64, 4 * KiB)) for _ in range(2)]
    return create_worker(be, gpu, layout, blocks_per_chunk=1, num_cpu_chunks=64)


def _submit_and_reap(worker: CPUOffloadingWorker, be: SimBackend, count: int, first: int) -> float:
    start = time.perf_counter()
    for job in range(first, first + count):
        worker.submit_store(job, GPULoadStoreSpec([job % 64], (1,), (0,)), CPULoadStoreSpec([job % 64]))
        be.clock_advance(1e-3)
        worker.get_finished()
    return time.perf_counter() - start


def bench_locking(count: int, repeats: int) -> Result:
    """Uncontended submit + reap with the worker's lock against the same worker with a no-op lock."""
    rigs = {}
    for locked in (True, False):
        be = SimBackend(race_check=False)
        rigs[locked] = (be, _small_worker(be))
    unsafe: Any = rigs[False][1]._core  # the bench's unsafe baseline: the same core without its lock
    real_lock, unsafe.lock = unsafe.lock, _NoLock()
    best = {True: math.inf, False: math.inf}
    try:
        with lockcheck.suspended():  # the unsafe baseline breaks R19 on purpose; neither rig pays for the check
            for attempt in range(repeats + 1):
                for locked in (True, False) if attempt % 2 else (False, True):  # alternate who goes first
                    be, worker = rigs[locked]
                    elapsed = _submit_and_reap(worker, be, count, attempt * count)
                    if attempt:
                        best[locked] = min(best[locked], elapsed)
    finally:
        unsafe.lock = real_lock  # shutdown waits on the lock's condition
        for _, worker in rigs.values():
            worker.shutdown()
    return result("locking", f"uncontended submit + reap of {count} stores, with the worker's lock",
                  (count / best[True], "transfers/s"),
                  (count / best[False], "transfers/s", "the same worker with a no-op lock"),
                  f">= {GOAL_LOCKING}x", [Goal("ratio", ">=", GOAL_LOCKING)], note=f"best of {repeats}")


def figures(run: BenchRun) -> list[Result]:
    """The overhead figure group: ``racecheck_4k``, ``racecheck_64k``, ``locking``."""
    sizes = run.sizes
    return [*bench_race_check(sizes.datapath_bytes, sizes.job_blocks, sizes.repeats),
            bench_locking(300 if run.quick else 2000, max(sizes.repeats, 10))]
