"""``kvoffload-ref demo``: the main job on the simulated device, in five acts, every check printed.

1. Round trips: a realistic layout (8 layers in two KV-cache groups), a few hundred store and load jobs, every
   byte verified; the bandwidth printed is the simulated device's *modelled* figure, not a measurement.
2. A load that never completes, under the default "quarantine" policy: a bounded shutdown that quarantines the
   region.
3. The same fault under the vLLM #51622 "release" policy: the region is freed under a running copy, and the
   simulated device detects the use-after-free.
4. A racy schedule (a load into GPU blocks a pending store still reads) is flagged as a ``dma_race`` naming both
   jobs (R20); the same schedule with a ``wait()`` in between is clean.
5. The canonical layout (R24, ``demo_canonical``): a TP=4 model stores in canonical mode into a shared region, a
   TP=2 model loads the pages back, byte-exact.

Each act says what it does, and which error lines it is about to log, before it runs. Exit status 0 only if every
check held.
"""

from __future__ import annotations

import logging
import sys
from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.backends.trace_format import write_merged
from kvoffload_ref.demo_canonical import canonical_act
from kvoffload_ref.faults import Fault, FaultPlan
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.worker import CPUOffloadingWorker, ShutdownPolicy, ShutdownReport, create_worker

__all__ = ["demo"]

PAGE = 16 * 1024
NUM_LAYERS = 8
BPC = 4
GPU_BLOCKS = 512
JOBS = 128  # stores, and as many loads
CPU_CHUNKS = JOBS * 2 * 8 // BPC
BLOCKS_PER_JOB = 8  # per group


class _Checks:
    """Runs the demo's checks, printing each one as it holds or fails."""

    def __init__(self) -> None:
        # Invariant: passed + len(failed) == checks made so far.
        self.passed = 0
        self.failed: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        """Record one check and print it (``ok`` or ``CHECK FAILED``)."""
        if ok:
            self.passed += 1
            print(f"  check ok: {what}")
        else:
            self.failed.append(what)
            print(f"  CHECK FAILED: {what}")


def _layout() -> KVCacheLayout:
    half = NUM_LAYERS // 2
    return KVCacheLayout(
        tensor_page_bytes=(PAGE,) * NUM_LAYERS,
        groups=(tuple(LayerRef(t, PAGE) for t in range(half)),
                tuple(LayerRef(t, PAGE) for t in range(half, NUM_LAYERS))),
    )


def _gpu_spec(blocks: npt.NDArray[np.int64]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(np.concatenate([blocks, blocks]), group_sizes=(len(blocks), len(blocks)),
                            block_indices=(0, 0))


def _round_trip(checks: _Checks) -> None:
    """Store JOBS jobs, load every one back (in waves) into other GPU blocks, verify every byte."""
    print(f"Act 1 -- round trips: {JOBS} stores of {BLOCKS_PER_JOB} blocks x {NUM_LAYERS} layers to pinned CPU "
          f"memory and {JOBS} loads back into other GPU blocks, every byte compared. No errors are expected.")
    rng = np.random.default_rng(42)
    be = _device("act 1: round trips")
    source = [rng.integers(0, 256, (GPU_BLOCKS, PAGE), dtype=np.uint8) for _ in range(NUM_LAYERS)]
    gpu = [be.from_host(a) for a in source]
    chunks_per_job = BLOCKS_PER_JOB // BPC
    with create_worker(be, gpu, _layout(), blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS) as w:
        stored = []
        for job in range(JOBS):
            blocks = rng.choice(GPU_BLOCKS // 2, BLOCKS_PER_JOB, replace=False).astype(np.int64)
            chunks = np.arange(2 * chunks_per_job, dtype=np.int64) + job * 2 * chunks_per_job
            w.submit_store(job, _gpu_spec(blocks), CPULoadStoreSpec(chunks))
            stored.append((blocks, chunks))
        w.wait(range(JOBS))
        results = w.get_finished()
        checks.check(len(results) == JOBS and all(r.success for r in results), "every store succeeded")
        wave = GPU_BLOCKS // 2 // BLOCKS_PER_JOB  # loads per wave: each wave fills the upper half of the GPU
        exact = True
        for first in range(0, JOBS, wave):
            jobs = range(first, min(first + wave, JOBS))
            for i, job in enumerate(jobs):
                dst = GPU_BLOCKS // 2 + i * BLOCKS_PER_JOB + np.arange(BLOCKS_PER_JOB, dtype=np.int64)
                w.submit_load(JOBS + job, CPULoadStoreSpec(stored[job][1]), _gpu_spec(dst))
            w.wait(JOBS + j for j in jobs)
            after = [be.to_host(a) for a in gpu]
            exact &= all(np.array_equal(after[t][GPU_BLOCKS // 2 + i * BLOCKS_PER_JOB:][:BLOCKS_PER_JOB],
                                        source[t][stored[job][0]])
                         for i, job in enumerate(jobs) for t in range(NUM_LAYERS))
        loads = w.get_finished()
        checks.check(len(loads) == JOBS and all(r.success for r in loads), "every load succeeded")
        checks.check(exact, "every loaded byte equals the stored byte")
        results += loads
        nbytes = sum(r.transfer_size or 0 for r in results)
        seconds = sum(r.transfer_time or 0.0 for r in results)
        print(f"  round trip: {len(results)} jobs ({JOBS} stores, {len(loads)} loads), {nbytes / 2**20:.0f} MiB "
              f"verified; the sim's modelled device time {seconds * 1e3:.2f} ms, i.e. a modelled bandwidth of "
              f"{nbytes / max(seconds, 1e-12) / 1e9:.1f} GB/s (the simulated device's cost model, not a "
              "measurement)")
    report = w.shutdown()
    checks.check(report.region == "released" and report.device_sync == "not_needed", "clean shutdown released")
    checks.check(not be.ledger.live(), f"ledger balanced after shutdown (live: {be.ledger.live()})")
    checks.check(not be.violations, f"no use-after-free (violations: {be.violations})")


def _hung_shutdown(checks: _Checks, on_unproven: str) -> None:
    """A load that never completes; shutdown must return within its timeout."""
    act, what = _ACTS[on_unproven]
    print(f"\nAct {act} -- {what}")
    print("  The [log ...] lines below are expected: the library logs the hung load it abandons and the device "
          "proof that times out.")
    be = _device(f"act {act}: hung load, {on_unproven}", FaultPlan([Fault("copy", "hang", direction="load",
                                                                          job_id=2)]))
    layout = _layout()
    gpu = [be.empty_device((GPU_BLOCKS, PAGE)) for _ in range(NUM_LAYERS)]
    policy = ShutdownPolicy(timeout=2.0, on_unproven=on_unproven)
    w: CPUOffloadingWorker = create_worker(be, gpu, layout, blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS,
                                           policy=policy)
    blocks = np.arange(BLOCKS_PER_JOB, dtype=np.int64)
    chunks = np.arange(BLOCKS_PER_JOB // BPC * 2, dtype=np.int64)
    w.submit_store(1, _gpu_spec(blocks), CPULoadStoreSpec(chunks))
    w.wait({1}, timeout=1.0)  # the loads read what job 1 wrote: observe it first (R20)
    w.submit_load(2, CPULoadStoreSpec(chunks), _gpu_spec(blocks + 100))
    w.submit_load(3, CPULoadStoreSpec(chunks), _gpu_spec(blocks + 200))
    report = w.shutdown()
    _print_report(f"hung load, policy {on_unproven!r}", report)
    checks.check(report.elapsed <= policy.timeout + 0.01, f"shutdown bounded ({report.elapsed:.3f} s)")
    checks.check(report.load.abandoned == 2, "the hung load and the one behind it were abandoned")
    checks.check(report.device_sync == "timeout", "the device-level proof timed out")
    if on_unproven == "quarantine":
        checks.check(report.region == "quarantined", "region quarantined, not freed under DMA")
        checks.check(not be.violations, "no use-after-free under the quarantine policy")
        checks.check(not be.ledger.live(), "nothing live but the quarantine")
    else:
        checks.check(report.region == "released", "region released anyway (vLLM #51622 behaviour)")
        kinds = sorted({v.kind for v in be.violations})
        print(f"  use-after-free detected by the sim under 'release': {kinds}")
        checks.check(bool(be.violations), "the sim detects the release under DMA")


_ACTS: Final = {
    "quarantine": (2, "a load that never completes, policy 'quarantine': shutdown() must return within its "
                      "2 s timeout (on the sim's clock), abandon the hung load and the one queued behind it, and "
                      "quarantine the region instead of freeing memory a copy may still use."),
    "release": (3, "the same hung load under policy 'release' (the behaviour of vLLM #51622): the region is "
                   "freed anyway, and the simulated device catches the copy that then runs into freed memory "
                   "(a use-after-free)."),
}


def _racy_schedule(checks: _Checks) -> None:
    """Act 4: a store, then at once a load into the same GPU blocks (R20), without and with a wait in between."""
    print("\nAct 4 -- a racy offload schedule: store GPU blocks to CPU chunks, then at once load other chunks back "
          "into the same GPU blocks, without waiting for the store. The load may overwrite the blocks while the "
          "store still reads them -- whatever the timing happens to be, the simulated device flags the unordered "
          "pair as a dma_race naming both jobs. The same schedule with a wait() in between is clean. No errors are "
          "expected.")
    blocks = np.arange(BLOCKS_PER_JOB, dtype=np.int64)
    chunks = np.arange(BLOCKS_PER_JOB // BPC * 2, dtype=np.int64)
    for waited in (False, True):
        be = _device(f"act 4: {'with' if waited else 'without'} wait()")
        gpu = [be.empty_device((GPU_BLOCKS, PAGE)) for _ in range(NUM_LAYERS)]
        with create_worker(be, gpu, _layout(), blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS) as w:
            w.submit_store(1, _gpu_spec(blocks), CPULoadStoreSpec(chunks))
            if waited:
                w.wait({1})
            w.submit_load(2, CPULoadStoreSpec(chunks + len(chunks)), _gpu_spec(blocks))
            w.wait({2})
        races = [v for v in be.violations if v.kind == "dma_race"]
        if waited:
            checks.check(not races, "with wait({1}) between them, no race is reported")
        else:
            if races:
                print(f"  flagged: {races[0].detail}")
            named = bool(races) and all(job in races[0].detail for job in ("store job 1", "load job 2"))
            checks.check(named, f"the racy schedule is flagged as a dma_race naming both jobs ({len(races)} pairs)")


def _print_report(title: str, report: ShutdownReport) -> None:
    print(f"{title}: shutdown in {report.elapsed:.3f} s (sim clock), device_sync={report.device_sync}, "
          f"region={report.region}")
    print(f"  store drained={report.store.drained} abandoned={report.store.abandoned}; "
          f"load drained={report.load.drained} abandoned={report.load.abandoned}")
    print(f"  quarantined={dict(report.quarantined)} leaked={dict(report.leaked)} errors={len(report.errors)}")


class _NoTraceback(logging.Formatter):
    def formatException(self, ei: object) -> str:
        return ""

    def format(self, record: logging.LogRecord) -> str:
        record.exc_text = ""
        text = super().format(record)
        return text if not record.exc_info else f"{text} ({record.exc_info[1]!r})"


#: The devices made while ``demo(trace=...)`` runs, by act (empty when not tracing).
_TRACED: list[tuple[str, SimBackend]] = []
_TRACING: list[bool] = [False]


def _device(act: str, faults: FaultPlan | None = None) -> SimBackend:
    """A simulated device for one act (recording a timeline when the demo traces)."""
    be = SimBackend(faults, trace=_TRACING[0])
    if _TRACING[0]:
        _TRACED.append((act, be))
    return be


def demo(trace: str | None = None) -> int:
    """Run the demo's five acts on the simulated device, printing each check.

    Args:
        trace: None, or a path: write the acts' timelines there as one Chrome trace-event JSON (one process per
            act's device; open it in Perfetto or chrome://tracing).

    Returns:
        The exit status: 0 only if every check held.

    Raises:
        OSError: the trace file cannot be written.
    """
    _TRACING[0], _TRACED[:] = trace is not None, []
    try:
        status = _acts()
        if trace is not None:
            write_merged(trace, [(act, be.trace_document()) for act, be in _TRACED])
            print(f"timeline of every act written to {trace} (open it in https://ui.perfetto.dev, or draw it, one "
                  f"panel per act: kvoffload-ref trace-plot {trace} timeline.png)")
        return status
    finally:
        _TRACING[0], _TRACED[:] = False, []


def _acts() -> int:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_NoTraceback("  [log %(levelname)s] %(message)s"))
    log = logging.getLogger("kvoffload_ref")
    log.addHandler(handler)
    checks = _Checks()
    try:
        _round_trip(checks)
        _hung_shutdown(checks, "quarantine")
        _hung_shutdown(checks, "release")
        _racy_schedule(checks)
        canonical_act(checks.check, 5, lambda rank: _device(f"act 5: {rank}"))
    finally:
        log.removeHandler(handler)  # the demo's log lines end with it (a caller's process logs as before)
    print(f"\n{checks.passed} checks passed, {len(checks.failed)} failed")
    return 0 if not checks.failed else 1
