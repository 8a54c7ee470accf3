"""Bench figures of shutdown: past the deadline (a hung transfer) and draining many completed transfers.

* **Shutdown past the deadline** -- a store whose copy never completes (a ``copy`` hang), with the default
  :class:`~kvoffload_ref.worker.ShutdownPolicy` timeout. Reported: the virtual elapsed time against the timeout,
  the real wall time of the whole shutdown against a clean shutdown of the same setup, and the real wall time
  spent after the virtual clock reached the deadline (the sim's analogue of a real overshoot; see
  docs/benchmarks.md).
* **Shutdown drain** -- [10k / quick: 1k] one-block stores (a K and a V tensor: two 4 KiB descriptors each, so
  that the sim's own cost of running the copies stays small; shutdown never touches them), the clock advanced
  until all completed, then ``shutdown()``: the drain phase (until the first stream is destroyed, i.e. release
  begins) and the whole shutdown, both against the real time it took to submit those transfers. The whole
  shutdown is also profiled with cProfile once; the top cost centers are part of the results
  (``BenchRun.drain_profile``), and the submit rate is the fuzz figure's baseline (``BenchRun.submit_rate``).
* **Shutdown of truly pending transfers** -- the same [10k / 1k] stores, but the clock is not advanced: when
  ``shutdown()`` begins every copy is still queued on the sim (the virtual clock stands at 0 and each copy takes
  at least the sim's latency), so the drain polls, the sim runs the copies as its sleeps advance the clock, and
  the drain proves them head first as they complete. The whole shutdown against the real time it took to submit
  them (checked: all drained, the region released, the virtual time at least the copies' latencies).
"""

from __future__ import annotations

import cProfile
import dataclasses
import math
import os
import pstats
import time
from typing import Final

import numpy as np

from kvoffload_ref.backends.base import Stream
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.bench.common import BPC, BenchRun, Goal, KiB, Result, Sizes, label, one_group_gpu_spec, result
from kvoffload_ref.faults import Fault, FaultPlan
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.worker import DEFAULT_TIMEOUT, CPUOffloadingWorker, ShutdownPolicy, ShutdownReport, create_worker

__all__ = [
    "GOAL_DRAIN_S", "GOAL_OVERSHOOT_S", "GOAL_PENDING_RATIO", "bench_drain", "bench_hung_shutdown", "bench_pending",
    "figures", "pending_result",
]

#: Goals (issue 6, item 4).
GOAL_OVERSHOOT_S: Final = 0.020
GOAL_DRAIN_S: Final = 0.050
#: The whole shutdown of the drain figure, against the time it took to submit those transfers (issue 9).
GOAL_DRAIN_RATIO: Final = 0.04
#: The whole shutdown of transfers still queued on the device, against the time it took to submit them (issue 25).
GOAL_PENDING_RATIO: Final = 0.2
PROFILE_TOP: Final = 10



class _WatchedSim(SimBackend):
    """A SimBackend that notes the real time of two shutdown milestones.

    ``passed_deadline_at``: when a sleep first brought the virtual clock to ``deadline``; ``release_at``: when the
    first stream was destroyed (the handlers' release, which follows the drains and the device-level proof).
    """

    def __init__(self, faults: FaultPlan | None = None) -> None:
        super().__init__(faults)
        self.deadline = math.inf
        self.passed_deadline_at: float | None = None
        self.release_at: float | None = None
        self.sleeps = 0  # sleeps so far: the pauses between polls of bounded waits, plus the bench's own advances

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        self._slept()

    def poll_sleep(self, seconds: float, *, to_tail: bool = False) -> None:
        super().poll_sleep(seconds, to_tail=to_tail)
        self._slept()

    def _slept(self) -> None:
        self.sleeps += 1
        if self.passed_deadline_at is None and self.monotonic() >= self.deadline:
            self.passed_deadline_at = time.perf_counter()

    def destroy_stream(self, stream: Stream) -> None:
        if self.release_at is None:
            self.release_at = time.perf_counter()
        super().destroy_stream(stream)


#: The shutdown workers: a K and a V tensor of 4 KiB pages, few blocks (a quarantined region lives until exit;
#: small copies keep the sim's own cost of running 10k transfers low -- shutdown never touches the copies).
SMALL_TENSORS: Final = 2
SMALL_BLOCKS: Final = 16
SMALL_CHUNKS: Final = 4


def _small_worker(be: SimBackend, policy: ShutdownPolicy | None = None) -> CPUOffloadingWorker:
    """SMALL_TENSORS tensors of 4 KiB pages, SMALL_BLOCKS GPU blocks, SMALL_CHUNKS CPU chunks of 4 blocks."""
    page = 4 * KiB
    layout = KVCacheLayout([page] * SMALL_TENSORS, [[LayerRef(t, page) for t in range(SMALL_TENSORS)]])
    gpu = [be.empty_device((SMALL_BLOCKS, page)) for _ in range(SMALL_TENSORS)]
    return create_worker(be, gpu, layout, blocks_per_chunk=BPC, num_cpu_chunks=SMALL_CHUNKS, policy=policy)


def _one_block(job: int) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    """A one-block transfer (2 descriptors of 4 KiB); jobs cycle over the blocks and chunks."""
    return one_group_gpu_spec(np.array([job % SMALL_BLOCKS], dtype=np.int64)), CPULoadStoreSpec([job % SMALL_CHUNKS])


@dataclasses.dataclass(frozen=True)
class _Shutdown:
    """One timed shutdown: the backend (with its milestones), the report and the real start and end times."""

    be: _WatchedSim
    report: ShutdownReport
    start: float
    end: float
    polls: int  # sleeps during the shutdown
    released: int  # ledger releases during the shutdown (streams, events, buffers, pins, mappings)

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def past_deadline(self) -> float:
        """Real time from the virtual clock reaching the deadline to the end (0 if it never reached it)."""
        return 0.0 if self.be.passed_deadline_at is None else self.end - self.be.passed_deadline_at

    @property
    def drain(self) -> float:
        """Real time until the handlers' release began (the drains, and the proof if one was attempted)."""
        return (self.be.release_at or self.end) - self.start


def _timed_shutdown(be: _WatchedSim, worker: CPUOffloadingWorker, timeout: float) -> _Shutdown:
    """Shut ``worker`` down (deadline ``timeout`` from now on the sim clock), timing it in real time."""
    be.deadline = be.monotonic() + timeout
    sleeps, released = be.sleeps, sum(be.ledger.released().values())
    start = time.perf_counter()
    report = worker.shutdown()
    end = time.perf_counter()
    return _Shutdown(be, report, start, end, be.sleeps - sleeps, sum(be.ledger.released().values()) - released)


def _hung_shutdown(hang: bool) -> _Shutdown:
    """Three stores (the second never completes if ``hang``) and two loads, the clock advanced, then shutdown
    under the default policy."""
    be = _WatchedSim(FaultPlan([Fault("copy", "hang", direction="store", job_id=1)] if hang else []))
    w = _small_worker(be, ShutdownPolicy())
    for job in range(3):
        w.submit_store(job, *_one_block(job))
    for job in range(3, 5):
        gpu_spec, cpu_spec = _one_block(job)
        w.submit_load(job, cpu_spec, gpu_spec)
    be.sleep(0.1)
    return _timed_shutdown(be, w, DEFAULT_TIMEOUT)


def bench_hung_shutdown(repeats: int) -> list[Result]:
    """Shutdown with a never-completing store: virtual overshoot, real wall time, real time past the deadline."""
    clean = min(_hung_shutdown(False).wall for _ in range(repeats))
    hung = min((_hung_shutdown(True) for _ in range(repeats)), key=lambda run: run.wall)
    report, timeout = hung.report, DEFAULT_TIMEOUT
    if report.device_sync != "timeout" or report.region != "quarantined" or report.store.abandoned != 2:
        raise AssertionError(f"hung shutdown: unexpected report {report}")
    overshoot = report.elapsed - timeout
    goal = f"<= {GOAL_OVERSHOOT_S * 1e3:.0f} ms"
    return [
        result("shutdown_hung_virtual", f"hung shutdown, virtual elapsed (timeout {timeout:g} s)",
                (report.elapsed, "virtual s"), (timeout, "virtual s", "the policy timeout"),
                f"overshoot {goal}", [Goal("value", "<=", timeout + GOAL_OVERSHOOT_S)],
                note=f"virtual overshoot {overshoot * 1e3:.3f} ms"),
        result("shutdown_hung_wall", "hung shutdown, real wall time (whole shutdown)", (hung.wall, "s"),
                (clean, "s", "clean shutdown, same setup"), goal, [Goal("value", "<=", GOAL_OVERSHOOT_S)],
                note=f"{hung.polls} polls through {timeout:g} virtual s; a real GPU sleeps those out before the "
                     "deadline"),
        result("shutdown_hung_past_deadline", "hung shutdown, real time after the clock reached the deadline",
                (hung.past_deadline, "s"), (hung.wall, "s", "the whole hung shutdown"), goal,
                [Goal("value", "<=", GOAL_OVERSHOOT_S)],
                note="the sim's analogue of the real overshoot: abandon, device proof, release, quarantine"),
    ]


def _submitted_transfers(count: int) -> tuple[_WatchedSim, CPUOffloadingWorker, float]:
    """A worker with ``count`` one-block stores submitted, the clock not advanced: every copy still queued.

    Returns:
        The backend, the worker and the real time the submissions took.
    """
    be = _WatchedSim()
    w = _small_worker(be)
    start = time.perf_counter()
    for job in range(count):
        w.submit_store(job, *_one_block(job))
    return be, w, time.perf_counter() - start


def _completed_transfers(count: int) -> tuple[_WatchedSim, CPUOffloadingWorker, float]:
    """A worker with ``count`` one-block stores submitted and completed (clock advanced, nothing observed yet).

    Returns:
        The backend, the worker and the real time the submissions took.
    """
    be, w, submitted = _submitted_transfers(count)
    be.sleep(1.0 + count * 1e-4)  # each takes ~10 virtual us
    return be, w, submitted


def _drain_shutdown(count: int) -> tuple[_Shutdown, float]:
    """Shut down a worker with ``count`` completed transfers; returns the timed shutdown and the submit time."""
    be, w, submitted = _completed_transfers(count)
    run = _timed_shutdown(be, w, DEFAULT_TIMEOUT)
    report = run.report
    if report.store.drained != count or report.region != "released" or be.ledger.live():
        raise AssertionError(f"drain shutdown: unexpected report {report}")
    return run, submitted


def _profile(count: int) -> list[dict[str, object]]:
    """The top cost centers (by own time) of one shutdown of ``count`` completed transfers, under cProfile."""
    _, w, _ = _completed_transfers(count)
    profiler = cProfile.Profile()
    profiler.enable()
    w.shutdown()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # pstats' documented-by-use table
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:PROFILE_TOP]
    return [{"function": _where(key), "calls": int(value[1]), "tottime_ms": value[2] * 1e3,
             "cumtime_ms": value[3] * 1e3} for key, value in rows]


def _where(key: tuple[str, int, str]) -> str:
    """``package/module.py:line(function)``, or the built-in's name."""
    filename, line, name = key
    if filename == "~":
        return name
    parts = filename.replace(os.sep, "/").split("/")
    short = "/".join(parts[parts.index("kvoffload_ref"):]) if "kvoffload_ref" in parts else parts[-1]
    return f"{short}:{line}({name})"


def bench_drain(sizes: Sizes) -> tuple[list[Result], float, list[dict[str, object]]]:
    """Shutdown of many completed transfers: the drain phase and the whole, against submitting them.

    Returns:
        The results, the submit rate (transfers/s, the fuzz baseline) and the cProfile top cost centers.
    """
    count = sizes.drain_transfers
    runs = [_drain_shutdown(count) for _ in range(sizes.drain_runs)]
    best, _ = min(runs, key=lambda r: r[0].wall)
    submitted = min(s for _, s in runs)
    reference = (submitted, "s", f"submitting the {label(count)} transfers")
    goal = f"<= {GOAL_DRAIN_S * 1e3:.0f} ms"
    results = [
        result("shutdown_drain_phase", f"shutdown of {label(count)} completed transfers, drain phase",
                (best.drain, "s"), reference, goal, [Goal("value", "<=", GOAL_DRAIN_S)],
                note="until the handlers' release begins"),
        result("shutdown_drain_total", f"shutdown of {label(count)} completed transfers, whole",
                (best.wall, "s"), reference, f"<= {GOAL_DRAIN_RATIO}x the submission time",
                [Goal("ratio", "<=", GOAL_DRAIN_RATIO)],
                note=f"release: {(best.wall - best.drain) * 1e3:.1f} ms, {best.released} resources released "
                     "(streams, events, descriptor buffers, pin, mapping) in batched calls"),
    ]
    return results, count / submitted, _profile(count)

def _pending_shutdown(count: int) -> tuple[_Shutdown, float]:
    """Shut down a worker with ``count`` stores still queued on the sim; returns the timed shutdown and the submit
    time."""
    be, w, submitted = _submitted_transfers(count)
    begun = be.monotonic()
    run = _timed_shutdown(be, w, DEFAULT_TIMEOUT)
    report = run.report
    if report.store.drained != count or report.region != "released" or be.ledger.live():
        raise AssertionError(f"pending shutdown: unexpected report {report}")
    if begun != 0.0 or be.monotonic() - begun < count * be.profile.call_cost:
        raise AssertionError("pending shutdown: the copies were not all still queued when shutdown began")
    return run, submitted


def pending_result(count: int, run: _Shutdown, submitted: float) -> Result:
    """The ``shutdown_pending_total`` line of one timed shutdown of ``count`` truly pending transfers that took
    ``submitted`` seconds to submit (goal: GOAL_PENDING_RATIO)."""
    return result("shutdown_pending_total", f"shutdown of {label(count)} truly pending transfers, whole",
                  (run.wall, "s"), (submitted, "s", f"submitting the {label(count)} transfers"),
                  f"<= {GOAL_PENDING_RATIO}x the submission time", [Goal("ratio", "<=", GOAL_PENDING_RATIO)],
                  note=f"every copy still queued on the sim when shutdown began; drain phase "
                       f"{run.drain * 1e3:.1f} ms, {run.polls} polls over {run.report.elapsed * 1e3:.1f} virtual ms")


def bench_pending(sizes: Sizes) -> list[Result]:
    """Shutdown of many transfers still queued on the sim, against submitting them (the best shutdown of
    ``drain_runs`` against the best submission time)."""
    count = sizes.drain_transfers
    runs = [_pending_shutdown(count) for _ in range(sizes.drain_runs)]
    best, _ = min(runs, key=lambda r: r[0].wall)
    return [pending_result(count, best, min(s for _, s in runs))]  # as the drain figure: each at its best


def figures(run: BenchRun) -> list[Result]:
    """The shutdown figure group: ``shutdown_hung_*``, ``shutdown_drain_*`` and ``shutdown_pending_total``; sets
    ``run.submit_rate`` and ``run.drain_profile``."""
    results = bench_hung_shutdown(run.sizes.repeats)
    drain, run.submit_rate, run.drain_profile = bench_drain(run.sizes)
    return [*results, *drain, *bench_pending(run.sizes)]
