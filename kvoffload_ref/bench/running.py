"""Bench figures of a running engine (R26-R28): what deadlines and holds cost the fast worker, on the sim.

* **Holds** (R27) -- [2000 / quick: 300] submissions of 16-block stores with 1,000 GPU blocks held by a cancelled,
  hung load (and its 1,000 CPU chunks held against writes) against the same worker whose hung load was not
  cancelled (the same device work pending, nothing held), timed alternately, best of N. Only the submissions are
  timed (the reap in between is not). Ratio: rate with the holds over rate without (goal >= 1/1.1: at most 1.1x
  the time; the hold check is vectorized, a count per id). (A worker with no hung copy at all is faster still:
  the sim's calls cost more while a hang is pending, which is the device's cost, not the check's.)
* **Deadline expiry** (R26, R28) -- one ``get_finished()`` that finds the head of [10,000 / quick: 1,000] queued
  stores past its deadline (its copy hung): it reports the head and every transfer behind it failed
  (``TransferExpired``), holds their blocks and retires the stream. Goal: <= 50 ms. The baseline is one
  ``get_finished()`` that proves as many completed stores (informative). Best of 3, each on a fresh worker, the
  garbage of its setup collected first.
* **Deadlines at submission** (R26) -- the submissions of the holds figure, each with ``deadline=``, against the
  same without (the deadline is one attribute at submission: goal <= 1.1, within noise).
"""

from __future__ import annotations

import gc
import math
import time
from typing import Final

from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.bench.common import BenchRun, Goal, KiB, Result, result
from kvoffload_ref.fault_plan import Fault, FaultPlan
from kvoffload_ref.results import ShutdownPolicy
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.worker import CPUOffloadingWorker, create_worker

__all__ = ["GOAL_DEADLINE_SUBMIT", "GOAL_EXPIRY_SECONDS", "GOAL_HELD_SUBMIT", "bench_deadline_submit",
           "bench_expiry", "bench_held_submit", "figures"]

GOAL_HELD_SUBMIT: Final = 1.1
GOAL_EXPIRY_SECONDS: Final = 0.05
GOAL_DEADLINE_SUBMIT: Final = 1.1

HELD: Final = 1000  # GPU blocks (and CPU chunks) the late load holds
JOB_BLOCKS: Final = 16  # blocks per submitted store
_HUNG: Final = -1  # the job id of the hung transfer
_PAGE: Final = 4 * KiB


def _worker(blocks: int, chunks: int, hung: str | None = None) -> tuple[SimBackend, CPUOffloadingWorker]:
    """A fast worker over two 4 KiB-page tensors (one group), one block per CPU chunk; ``hung``: the direction whose
    job ``_HUNG`` never completes. Unproven memory is released at shutdown (the bench keeps nothing)."""
    faults = None if hung is None else FaultPlan([Fault("copy", "hang", direction=hung, job_id=_HUNG)])
    be = SimBackend(race_check=False, faults=faults)
    layout = KVCacheLayout((_PAGE, _PAGE), ((LayerRef(0, _PAGE), LayerRef(1, _PAGE)),))
    gpu = [be.empty_device((blocks, _PAGE)) for _ in range(2)]
    return be, create_worker(be, gpu, layout, blocks_per_chunk=1, num_cpu_chunks=chunks,
                             policy=ShutdownPolicy(timeout=0.0, on_unproven="release"))


def _gpu(first: int, count: int) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(range(first, first + count), (count,), (0,))


def _cpu(first: int, count: int) -> CPULoadStoreSpec:
    return CPULoadStoreSpec(range(first, first + count))


def _held_rig(held: int, cancel: bool) -> tuple[SimBackend, CPUOffloadingWorker]:
    """A worker with a hung load of ``held`` GPU blocks and CPU chunks ([held, 2 * held)); ``cancel``: cancelled, so
    its blocks are held (R27), else still queued (nothing held: the same device work pending, the baseline)."""
    size = 2 * max(held, HELD)
    be, worker = _worker(size, size, hung="load")
    worker.submit_load(_HUNG, _cpu(held, held), _gpu(held, held))
    if cancel:
        worker.cancel([_HUNG])
    worker.get_finished()
    if len(worker.held().gpu_blocks) != (held if cancel else 0):
        raise AssertionError(f"held-submit bench: expected {held if cancel else 0} held GPU blocks, got "
                         f"{worker.held()}")
    return be, worker


def _submissions(be: SimBackend, worker: CPUOffloadingWorker, count: int, first: int, span: int,
                 deadline: float | None) -> float:
    """The real time of ``count`` 16-block store submissions over blocks and chunks [0, span); their reap after
    (untimed) empties the queue."""
    specs = [(_gpu(o, JOB_BLOCKS), _cpu(o, JOB_BLOCKS)) for o in
             ((j * JOB_BLOCKS) % (span - JOB_BLOCKS + 1) for j in range(count))]
    start = time.perf_counter()
    for job, (gpu, cpu) in enumerate(specs, first):
        worker.submit_store(job, gpu, cpu, deadline=deadline)
    elapsed = time.perf_counter() - start
    be.clock_advance(1.0)
    if len(worker.get_finished()) != count:
        raise AssertionError("submit bench: every store should be proven after a second of virtual time")
    return elapsed


def _alternate(rigs: dict[bool, tuple[SimBackend, CPUOffloadingWorker]], count: int, repeats: int, span: int,
               deadline: dict[bool, float | None]) -> dict[bool, float]:
    """Best-of submission times of two rigs, alternated (who goes first alternates too), after a warm-up."""
    best = {True: math.inf, False: math.inf}
    try:
        for attempt in range(repeats + 1):
            for which in (True, False) if attempt % 2 else (False, True):
                be, worker = rigs[which]
                elapsed = _submissions(be, worker, count, attempt * count, span, deadline[which])
                if attempt:
                    best[which] = min(best[which], elapsed)
    finally:
        for _, worker in rigs.values():
            worker.shutdown()
    return best


def bench_held_submit(count: int, repeats: int, held: int = HELD) -> Result:
    """Store submissions with ``held`` GPU blocks (and CPU chunks) held against the same worker with none."""
    best = _alternate({True: _held_rig(held, True), False: _held_rig(held, False)}, count, repeats, held,
                      {True: None, False: None})
    return result("running_held_submit", f"{count} submissions of {JOB_BLOCKS}-block stores with {held} GPU blocks "
                  "held", (count / best[True], "transfers/s"),
                  (count / best[False], "transfers/s", "the same worker, its hung load not cancelled: nothing held"),
                  f"<= {GOAL_HELD_SUBMIT}x the time", [Goal("ratio", ">=", 1 / GOAL_HELD_SUBMIT)],
                  note=f"submissions only, best of {repeats}; ratio: rate with holds / rate without")


def bench_deadline_submit(count: int, repeats: int) -> Result:
    """Store submissions with ``deadline=`` against the same without."""
    best = _alternate({True: _held_rig(HELD, False), False: _held_rig(HELD, False)}, count, repeats, HELD,
                      {True: 60.0, False: None})
    return result("running_deadline_submit", f"{count} submissions of {JOB_BLOCKS}-block stores with deadline=",
                  (count / best[True], "transfers/s"),
                  (count / best[False], "transfers/s", "the same submissions without a deadline"),
                  f"<= {GOAL_DEADLINE_SUBMIT}x the time", [Goal("ratio", ">=", 1 / GOAL_DEADLINE_SUBMIT)],
                  note=f"submissions only, best of {repeats}; ratio: rate with a deadline / rate without")


def _queued(count: int, hung: bool) -> tuple[SimBackend, CPUOffloadingWorker]:
    """``count`` one-block stores queued on one stream; with ``hung`` the head (deadline 1 s) never completes and
    the first poll saw it start; without, every store is complete but none reaped."""
    be, worker = _worker(64, 64, hung="store" if hung else None)
    for j in range(count):
        job = _HUNG if hung and j == 0 else j
        worker.submit_store(job, _gpu(j % 64, 1), _cpu(j % 64, 1), deadline=1.0 if job == _HUNG else None)
    if hung:
        worker.get_finished()  # the poll that sees the head start (R26)
    be.clock_advance(1.0)
    return be, worker


def bench_expiry(count: int, repeats: int) -> Result:
    """One reap that expires the head of ``count`` queued stores, against one that proves as many."""
    best = {True: math.inf, False: math.inf}
    for _ in range(repeats):
        for hung in (True, False):
            _, worker = _queued(count, hung)
            gc.collect()  # the garbage of the rig's setup is not the reap's to collect
            start = time.perf_counter()
            reported = worker.get_finished()
            elapsed = time.perf_counter() - start
            if len(reported) != count or any(r.success for r in reported) is hung:
                raise AssertionError(f"expiry bench: expected {count} {'expired' if hung else 'proven'} results")
            if hung and worker.stats().store.retired_streams != 1:
                raise AssertionError("expiry bench: the expired head's stream should be retired")
            best[hung] = min(best[hung], elapsed)
            worker.shutdown()
    return result("running_expiry", f"one reap expiring the head of {count} queued stores (failing the chain, "
                  "retiring the stream)", (best[True], "s"),
                  (best[False], "s", f"one reap proving {count} completed stores"),
                  f"<= {GOAL_EXPIRY_SECONDS * 1e3:.0f} ms", [Goal("value", "<=", GOAL_EXPIRY_SECONDS)],
                  note=f"best of {repeats}")


def figures(run: BenchRun) -> list[Result]:
    """The running-engine figure group: ``running_held_submit``, ``running_expiry``, ``running_deadline_submit``."""
    count, repeats = (300, 3) if run.quick else (2000, run.sizes.repeats)
    expiring = run.sizes.drain_transfers  # 10,000 (quick: 1,000)
    return [bench_held_submit(count, repeats), bench_expiry(expiring, 3), bench_deadline_submit(count, repeats)]
