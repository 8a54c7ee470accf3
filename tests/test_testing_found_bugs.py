"""Core bugs the conformance kit found, as minimal reproductions; all three are fixed (they were strict xfails).

Found by the machine (kvoffload_ref.testing) or while modelling what it checks; each test is the minimal
reproduction, kept as a regression test.
"""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from _support import at_call, raise_interrupt

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    with caplog.at_level(logging.CRITICAL + 1, logger="kvoffload_ref"):
        yield


def _worker(plan: kv.FaultPlan, chunks: int = 8) -> tuple[SimBackend, kv.CPUOffloadingWorker]:
    be = SimBackend(plan)
    layout = kv.KVCacheLayout((512,), ((kv.LayerRef(0, 512),),))
    return be, kv.create_worker(be, [be.empty_device((8, 512))], layout, blocks_per_chunk=1, num_cpu_chunks=chunks)


def _g(block: int) -> kv.GPULoadStoreSpec:
    return kv.GPULoadStoreSpec([block], group_sizes=(1,), block_indices=(0,))


def _c(chunk: int) -> kv.CPULoadStoreSpec:
    return kv.CPULoadStoreSpec([chunk])


@pytest.mark.rule("R15")
def test_testing_found_dropped_worker_with_an_unreported_failure_is_finalized() -> None:
    be, worker = _worker(kv.FaultPlan([kv.Fault("event_query", "error", job_id=1)]))
    worker.submit_store(1, _g(1), _c(1))
    worker.wait([1], timeout=1.0)  # job 1 fails inside wait(); its result is not reported yet
    ref = weakref.ref(worker)
    del worker
    gc.collect()
    alive = ref()
    if alive is not None:
        alive.shutdown()  # do not leave it to the interpreter's exit
    assert alive is None, "the dropped worker is still alive: its finalizer cannot run (R15)"
    assert be.ledger.live() == {}


@pytest.mark.rule("R4")
@pytest.mark.rule("R27")
@pytest.mark.rule("R28")
def test_testing_found_failed_submission_does_not_poison_a_pooled_stream() -> None:
    # Once a pooled stream per transfer; then one stream per handler, and job 4 waited behind the hung job 2 for
    # good. Now (R28) job 2's failure retires its stream: job 4 goes to a fresh one and completes, while job 2's
    # blocks stay held (R27): its copy may still run.
    plan = kv.FaultPlan([kv.Fault("copy", "hang", job_id=2),           # job 2's copy never completes
                         kv.Fault("copy", "error", job_id=3),          # job 3's submission fails at its copy
                         kv.Fault("event_query", "error", job_id=2)])  # job 2 then fails
    be, worker = _worker(plan)
    worker.submit_store(0, _g(0), _c(0))
    worker.submit_store(1, _g(1), _c(1))
    worker.wait([0, 1], timeout=1.0)
    assert [r.success for r in worker.get_finished()] == [True, True]
    worker.submit_store(2, _g(2), _c(2))  # hangs
    with pytest.raises(kv.DeviceError):
        worker.submit_store(3, _g(3), _c(3))  # the copy fails: nothing queued, nothing leaked
    be.clock_advance(0.1)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, False)]
    with pytest.raises(kv.BlocksHeldError):
        worker.submit_load(4, _c(4), _g(2))  # job 2's late copy may still read GPU block 2: held against writes
    with pytest.raises(kv.BlocksHeldError):
        worker.submit_store(4, _g(5), _c(2))  # ... and write chunk 2: held for any access
    worker.submit_store(4, _g(4), _c(4))  # no fault selects job 4, and it is not queued behind job 2 (R28)
    worker.wait([4], timeout=1.0)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(4, True)]
    assert worker.held() == kv.HeldBlocks((2,), (2,), (2,), ()) and worker.take_released() == []
    report = worker.shutdown()
    assert report.region == "quarantined" and report.store.abandoned == 0
    assert not be.violations


@pytest.mark.rule("R15")
def test_testing_found_finalizer_does_not_deadlock_on_the_ledger_lock() -> None:
    # In a child process: a deadlocked collection would leave this process's garbage collector stuck "collecting".
    code = textwrap.dedent("""
        import gc, logging
        import kvoffload_ref as kv
        from kvoffload_ref.backends.sim import SimBackend
        logging.disable(logging.CRITICAL)
        be = SimBackend()
        layout = kv.KVCacheLayout((512,), ((kv.LayerRef(0, 512),),))
        worker = kv.create_worker(be, [be.empty_device((8, 512))], layout, blocks_per_chunk=1, num_cpu_chunks=8,
                                  policy=kv.ShutdownPolicy(timeout=0.2))
        cycle = [worker]
        cycle.append(cycle)          # only a reference cycle holds the worker: the cyclic collector finalizes it
        del worker, cycle
        with be.ledger._lock:        # what Ledger._tally holds while it allocates (any allocation may collect)
            gc.collect()
        print("finished")
    """)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10.0,
                              check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the finalizer's shutdown deadlocked on the ledger lock")
    assert done.stdout.strip() == "finished", done.stderr


@pytest.mark.rule("R29")
@pytest.mark.rule("R27")
@pytest.mark.parametrize("create", [kv.create_worker, kv.create_reference_worker])
def test_testing_found_a_late_copy_the_drain_proves_before_an_interrupt_leaves_nothing_to_keep(create: Any) -> None:
    # Found by a 100,000-step campaign on the reference worker: job 1 fails (its end event's first query), job 2
    # (nothing to copy) behind it; both are late. The shutdown's drain proves job 1's late copy (its hold ends,
    # take_released() says so even after shutdown), then an interrupt stops the drain at job 2: only job 2 is
    # unproven, and it touches no byte, so R29 keeps nothing and the region is released. The kit expected a
    # quarantine: it now takes the releases a shutdown's drain made before it judges the region.
    plan = kv.FaultPlan([kv.Fault("event_query", "error", job_id=1, nth=1)])
    be = SimBackend(plan)
    layout = kv.KVCacheLayout((8, 8), ((kv.LayerRef(0, 8), kv.LayerRef(1, 8)),))
    w = create(be, [be.empty_device((4, 8)), be.empty_device((4, 8))], layout, blocks_per_chunk=1,
               num_cpu_chunks=2, policy=kv.ShutdownPolicy(timeout=0.0))
    w.submit_load(1, kv.CPULoadStoreSpec([0, 1]), kv.GPULoadStoreSpec([0, 1], (2,), (0,)))
    w.submit_load(2, kv.CPULoadStoreSpec([]), kv.GPULoadStoreSpec([], (0,), (0,)))
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, False), (2, False)]
    be.clock_advance(0.01)  # job 1's copy has run (nobody observed it yet)
    with at_call(be, "event_query", raise_interrupt, nth=2), pytest.raises(KeyboardInterrupt):  # the 2nd query
        w.shutdown()
    report = w.shutdown()
    assert report.interrupted and report.device_sync == "skipped"
    assert [(r.job_id, r.gpu_blocks) for r in w.take_released()] == [(1, (0, 1))]  # proven by the drain
    assert report.region == "released" and report.kept == ()  # job 2 touches nothing (R29)
    assert not be.violations
