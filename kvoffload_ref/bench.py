"""The ``kvoffload-ref bench`` command: performance figures, each a ratio to a baseline measured in the same run.

Theory of operation
-------------------
Absolute speeds move with the machine, so every figure is paired with a *reference* measured in the same process,
on the same data, right next to it, and the *ratio* of the two is what the goals are mostly about (machine noise
and machine speed cancel). All timings are real (wall) time, ``time.perf_counter``, best of N after a warm-up,
except the one figure explicitly on the simulated device's virtual clock.

Measurements (sizes in brackets: full run / ``quick=True``):

* **Planner** -- the planner the way the handler runs it on every submission: a
  :class:`~kvoffload_ref.layout.Planner` built once over the geometry (as each handler builds one), then per
  transfer ``Planner.prepare`` (validates the specs completely, R7) and ``PreparedPlan.write`` into three int64
  arrays allocated once and reused (as the handler writes into its pooled descriptor buffers). On a realistic
  layout: 32 layer tensors in one KV-cache group, 16 KiB pages, ``blocks_per_chunk = 4``, scattered GPU block ids,
  the first CPU chunk half used (block index 1), store direction. Descriptors = blocks x 32 refs, for
  [1k, 64k, 640k / 1k, 8k, 80k] descriptors. Reference: a naive per-(ref, block) Python loop computing the same
  descriptors (no validation), then turning its three lists into int64 arrays, measured on the *same* sizes (not
  extrapolated); its output is checked equal to the planner's. The one-call
  :func:`~kvoffload_ref.layout.plan_copies` (validates the geometry too, returns new arrays) is timed as well and
  reported in the notes. Plus the scaling figure: planner time at the largest size over the middle one.
* **Sim data path** -- store then load through a real worker on the :class:`~kvoffload_ref.backends.sim.SimBackend`
  (submit every job, ``wait``, ``get_finished``; the store source and load destination are disjoint random GPU
  blocks, CPU chunks contiguous per job), 32 layer tensors, ``blocks_per_chunk = 4``, for 4 KiB and 64 KiB pages,
  at least [64 MiB / 8 MiB] each way in jobs of [64 / 16] blocks (at 64 KiB pages one 64-block job is already
  128 MiB); a sample of the loaded rows is verified byte-exact after every repetition (outside the timing).
  Reference: one ``np.copyto`` between two preallocated contiguous arrays of the same total bytes (store + load),
  timed alternately with the round trips so that a slow spell of the machine hits both.
* **Shutdown past the deadline** -- a store whose copy never completes (a ``copy`` hang), with the default
  :class:`~kvoffload_ref.worker.ShutdownPolicy` timeout. Reported: the virtual elapsed time against the timeout,
  the real wall time of the whole shutdown against a clean shutdown of the same setup, and the real wall time
  spent after the virtual clock reached the deadline (the sim's analogue of a real overshoot; see
  docs/benchmarks.md).
* **Shutdown drain** -- [10k / 1k] one-block stores (a K and a V tensor: two 4 KiB descriptors each, so that the
  sim's own cost of running the copies stays small; shutdown never touches them), the clock advanced until all
  completed, then ``shutdown()``:
  the drain phase (until the first stream is destroyed, i.e. release begins) and the whole shutdown, both against
  the real time it took to submit those transfers. The whole shutdown is also profiled with cProfile once; the
  top cost centers are part of the results.
* **Fuzz** -- ``kvoffload_ref.testing.campaign.run_campaign`` for [2000 / 100] steps, if that module exists,
  against the rate of plain submissions from the drain measurement.

Log records the library emits (hung shutdowns log errors with tracebacks) are formatted into a buffer while the
bench runs, so their cost is measured but they do not clutter the output.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import datetime
import importlib
import io
import json
import logging
import math
import os
import platform
import pstats
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Final, Literal, TextIO, cast

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.base import Stream
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.faults import Fault, FaultPlan
from kvoffload_ref.layout import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    KVCacheLayout,
    LayerRef,
    Planner,
    TensorGeometry,
    plan_copies,
)
from kvoffload_ref.worker import DEFAULT_TIMEOUT, CPUOffloadingWorker, ShutdownPolicy, ShutdownReport, create_worker

__all__ = ["Result", "run_bench"]

I64 = npt.NDArray[np.int64]
KiB: Final = 1024
MiB: Final = 1024 * KiB

#: The realistic layout of the planner and data-path measurements.
LAYERS: Final = 32
PLANNER_PAGE: Final = 16 * KiB
BPC: Final = 4
#: Goals (issue 6, item 4).
GOAL_PLANNER_RATE: Final = 20e6
GOAL_PLANNER_VS_LOOP: Final = 50.0
GOAL_SCALING: Final = 11.0
GOAL_OVERSHOOT_S: Final = 0.020
GOAL_DRAIN_S: Final = 0.050
GOAL_FUZZ_RATE: Final = 500.0
PROFILE_TOP: Final = 10


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """What one run measures: the full run or the quick smoke run."""

    planner: tuple[int, int, int]  # descriptors: small, medium, large
    datapath_bytes: int  # per direction (at least one job)
    job_blocks: int  # blocks per data-path job
    drain_transfers: int
    drain_runs: int
    fuzz_steps: int
    repeats: int  # best-of for the data path and the hung shutdown


FULL: Final = _Sizes((1024, 65536, 655360), 64 * MiB, 64, 10_000, 3, 2000, 7)
QUICK: Final = _Sizes((1024, 8192, 81920), 8 * MiB, 16, 1000, 1, 100, 2)


# ----------------------------------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class _Goal:
    """One condition on a result: ``field op threshold`` (field "value" or "ratio")."""

    field: Literal["value", "ratio"]
    op: Literal[">=", "<="]
    threshold: float

    def holds(self, value: float | None, ratio: float | None) -> bool:
        got = value if self.field == "value" else ratio
        if got is None or math.isnan(got):
            return False
        return got >= self.threshold if self.op == ">=" else got <= self.threshold


@dataclasses.dataclass(frozen=True)
class Result:
    """One line of the table.

    Attributes:
        key: a stable identifier (the same in quick and full runs).
        metric: what was measured, with its size.
        value: the measured figure (None when not available), in ``unit``.
        unit: "descriptors/s", "bytes/s", "s" (real), "virtual s" (the sim's clock), "steps/s" or "transfers/s".
        reference: the same-run baseline, in ``reference_unit``.
        reference_unit: the baseline's unit.
        reference_label: what the baseline is.
        ratio: value / reference (dimensionless; None when not available).
        goal: the goal, in words.
        met: whether every goal condition holds (None: no goal, or not available).
        note: anything a reader needs to interpret the line.
    """

    key: str
    metric: str
    value: float | None
    unit: str
    reference: float | None
    reference_unit: str
    reference_label: str
    ratio: float | None
    goal: str
    met: bool | None
    note: str = ""


def _result(key: str, metric: str, measured: tuple[float, str], reference: tuple[float, str, str],
            goal: str, conditions: Sequence[_Goal], note: str = "") -> Result:
    """A result whose ratio is measured / reference; ``met`` is None when there are no conditions."""
    value, unit = measured
    ref, ref_unit, ref_label = reference
    ratio = value / ref if ref > 0 else math.inf
    met = all(c.holds(value, ratio) for c in conditions) if conditions else None
    return Result(key, metric, value, unit, ref, ref_unit, ref_label, ratio, goal, met, note)


# ------------------------------------------------------------------------------------------------------ timing


def _best_of(run: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """The shortest real time of ``repeats`` calls of ``run`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


@contextlib.contextmanager
def _captured_logs() -> Iterator[io.StringIO]:
    """Format the package's log records into a buffer (their cost stays in the timings) instead of stderr."""
    logger = logging.getLogger("kvoffload_ref")
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield buffer
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


# ----------------------------------------------------------------------------------------------------- planner


@dataclasses.dataclass(frozen=True)
class _PlannerCase:
    """One planner input: the layout, synthetic geometries (no memory behind them) and the specs; the Planner
    over them and the reused output arrays (a handler's planner and descriptor buffer)."""

    layout: KVCacheLayout
    gpu: tuple[TensorGeometry, ...]
    cpu: tuple[TensorGeometry, ...]
    gpu_spec: GPULoadStoreSpec
    cpu_spec: CPULoadStoreSpec
    skip: int
    planner: Planner
    out: tuple[I64, I64, I64]

    @property
    def descriptors(self) -> int:
        return len(self.gpu_spec.block_ids) * LAYERS


def _planner_case(num_descriptors: int, seed: int = 0) -> _PlannerCase:
    """32 layers, 16 KiB pages, bpc 4, one group; scattered GPU blocks, first CPU chunk entered at sub-block 1."""
    rng = np.random.default_rng(seed)
    blocks, skip = num_descriptors // LAYERS, 1
    chunks = -(-(blocks + skip) // BPC)
    gpu_rows, cpu_rows = 2 * blocks, 2 * chunks
    layout = KVCacheLayout([PLANNER_PAGE] * LAYERS, [[LayerRef(t, PLANNER_PAGE) for t in range(LAYERS)]])
    gpu = tuple(TensorGeometry(0x7F00_0000_0000 + t * 2**36, gpu_rows, PLANNER_PAGE, PLANNER_PAGE)
                for t in range(LAYERS))
    row = PLANNER_PAGE * BPC
    cpu = tuple(TensorGeometry(0x1000_0000 + t * cpu_rows * row, cpu_rows, row, row) for t in range(LAYERS))
    gpu_spec = GPULoadStoreSpec(rng.permutation(gpu_rows)[:blocks], [blocks], [skip])
    cpu_spec = CPULoadStoreSpec(rng.permutation(cpu_rows)[:chunks])
    out = (np.zeros(blocks * LAYERS, dtype=np.int64), np.zeros(blocks * LAYERS, dtype=np.int64),
           np.zeros(blocks * LAYERS, dtype=np.int64))
    return _PlannerCase(layout, gpu, cpu, gpu_spec, cpu_spec, skip, Planner(layout, gpu, cpu, BPC), out)


def _plan(case: _PlannerCase) -> tuple[I64, I64, I64]:
    """The handler's path: validate the specs, write the descriptors into the reused arrays."""
    n = case.planner.prepare("store", case.gpu_spec, case.cpu_spec).write(*case.out)
    src, dst, sizes = case.out
    return src[:n], dst[:n], sizes[:n]


def _plan_copies(case: _PlannerCase) -> tuple[I64, I64, I64]:
    """The one-call path: validate the geometry and the specs, return new arrays."""
    plan = plan_copies(case.layout, "store", case.gpu_spec, case.cpu_spec, case.gpu, case.cpu, BPC)
    return plan.src, plan.dst, plan.sizes


def _naive_plan(case: _PlannerCase) -> tuple[I64, I64, I64]:
    """The same descriptors as :func:`_plan`, one (ref, block) at a time in Python; no validation."""
    src: list[int] = []
    dst: list[int] = []
    sizes: list[int] = []
    gpu_ids, cpu_ids = case.gpu_spec.block_ids.tolist(), case.cpu_spec.block_ids.tolist()
    for ref in case.layout.groups[0]:
        g, c, page = case.gpu[ref.tensor_idx], case.cpu[ref.tensor_idx], PLANNER_PAGE
        for i, block in enumerate(gpu_ids):
            k = case.skip + i
            src.append(g.ptr + block * g.row_stride)
            dst.append(c.ptr + cpu_ids[k // BPC] * c.row_stride + (k % BPC) * page)
            sizes.append(ref.page_size_bytes)
    return (np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.array(sizes, dtype=np.int64))


def _planner_repeats(descriptors: int, quick: bool) -> tuple[int, int]:
    """(planner repeats, loop repeats) for one size: many for small sizes, few for large ones."""
    if quick:
        return 5, 1
    if descriptors <= 4096:
        return 200, 20
    return (30, 3) if descriptors <= 100_000 else (10, 2)


def _label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where ``getrusage`` is not available)."""
    try:
        resource = importlib.import_module("resource")
    except ImportError:
        return 0
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


@dataclasses.dataclass(frozen=True)
class _PlannerTiming:
    """Best real times of the planner (the handler's path), of plan_copies and of the naive loop on one case,
    and the page faults per call of the first two."""

    descriptors: int
    planner: float
    loop: float
    faults_per_call: float
    one_call: float
    one_call_faults: float


def _timed_with_faults(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best time, minor page faults per call) of ``repeats`` calls after one warm-up."""
    faults = _minor_faults()
    best = _best_of(run, repeats)
    return best, (_minor_faults() - faults) / (repeats + 1)


def _time_planner(num_descriptors: int, quick: bool) -> _PlannerTiming:
    """Check the loop against both planner paths once, then time them (planner paths first, as the sizes come)."""
    case = _planner_case(num_descriptors)
    want = _naive_plan(case)
    for path in (_plan, _plan_copies):
        if not all(np.array_equal(a, b) for a, b in zip(path(case), want, strict=True)):
            raise AssertionError(f"the naive loop and {path.__name__} disagree at {num_descriptors} descriptors")
    fast_runs, loop_runs = _planner_repeats(num_descriptors, quick)
    fast, faults = _timed_with_faults(lambda: _plan(case), fast_runs)
    one_call, one_call_faults = _timed_with_faults(lambda: _plan_copies(case), fast_runs)
    slow = _best_of(lambda: _naive_plan(case), loop_runs)
    return _PlannerTiming(case.descriptors, fast, slow, faults, one_call, one_call_faults)


def _planner_goal(which: str) -> tuple[str, list[_Goal]]:
    """The goal of one planner size: none at the small size (the fixed per-call cost dominates there)."""
    if which == "small":
        return "none (fixed per-call cost dominates)", []
    loop = f">= {GOAL_PLANNER_VS_LOOP:.0f}x loop"
    if which == "large":
        return loop, [_Goal("ratio", ">=", GOAL_PLANNER_VS_LOOP)]
    return (f">= {GOAL_PLANNER_RATE / 1e6:.0f} M/s and {loop}",
            [_Goal("ratio", ">=", GOAL_PLANNER_VS_LOOP), _Goal("value", ">=", GOAL_PLANNER_RATE)])


def bench_planner(sizes: _Sizes, quick: bool) -> list[Result]:
    """Planner rate at three sizes against the naive loop, and the scaling from the middle to the largest size."""
    timings = [_time_planner(n, quick) for n in sizes.planner]
    results: list[Result] = []
    for which, t in zip(("small", "medium", "large"), timings, strict=True):
        goal, conditions = _planner_goal(which)
        results.append(_result(
            f"planner_{which}", f"planner, {_label(t.descriptors)} descriptors",
            (t.descriptors / t.planner, "descriptors/s"),
            (t.descriptors / t.loop, "descriptors/s", "naive per-block Python loop, same descriptors"), goal,
            conditions, note=f"planner (prepare + write into reused arrays) {t.planner * 1e3:.3f} ms "
                             f"({t.faults_per_call:.0f} minor page faults per call); plan_copies (new arrays) "
                             f"{t.one_call * 1e3:.3f} ms ({t.one_call_faults:.0f} faults per call, "
                             f"{t.descriptors / t.one_call / 1e6:.3g} M desc/s, {t.loop / t.one_call:.1f}x loop); "
                             f"loop {t.loop * 1e3:.1f} ms"))
    medium, large = timings[1], timings[2]
    results.append(_result(
        "planner_scaling", f"planner time, {_label(large.descriptors)} vs {_label(medium.descriptors)} descriptors",
        (large.planner, "s"), (medium.planner, "s", f"planner time at {_label(medium.descriptors)}"),
        f"<= {GOAL_SCALING:.0f}x", [_Goal("ratio", "<=", GOAL_SCALING)],
        note=f"{large.descriptors // medium.descriptors}x the descriptors"))
    return results


# --------------------------------------------------------------------------------------------------- data path


@dataclasses.dataclass
class _DataPathRig:
    """A worker on the sim with 32 tensors of ``2 * blocks`` rows, and the jobs of one round trip."""

    worker: CPUOffloadingWorker
    gpu: list[npt.NDArray[np.uint8]]
    source: list[npt.NDArray[np.uint8]]  # the original GPU contents
    stores: list[tuple[GPULoadStoreSpec, CPULoadStoreSpec]]
    loads: list[tuple[CPULoadStoreSpec, GPULoadStoreSpec]]
    store_rows: I64  # GPU rows stored, in job order
    load_rows: I64  # GPU rows loaded into, in the same order
    next_job: int = 0


def _gpu_spec(rows: I64) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(rows, [len(rows)], [0])


def _data_path_rig(page: int, nbytes: int, job_blocks: int, seed: int = 0) -> _DataPathRig:
    """Build the worker and the jobs of ``job_blocks`` blocks moving ``nbytes`` (at least one job) each way."""
    rng = np.random.default_rng(seed)
    blocks = max(job_blocks, nbytes // (page * LAYERS) // job_blocks * job_blocks)
    be = SimBackend()
    layout = KVCacheLayout([page] * LAYERS, [[LayerRef(t, page) for t in range(LAYERS)]])
    source = [np.frombuffer(rng.bytes(2 * blocks * page), dtype=np.uint8).reshape(2 * blocks, page)
              for _ in range(LAYERS)]
    gpu = [cast(npt.NDArray[np.uint8], be.from_host(a)) for a in source]
    worker = create_worker(be, gpu, layout, blocks_per_chunk=BPC, num_cpu_chunks=blocks // BPC)
    rows = rng.permutation(2 * blocks).astype(np.int64)
    store_rows, load_rows = rows[:blocks], rows[blocks:]
    per_job = job_blocks // BPC
    stores, loads = [], []
    for j in range(blocks // job_blocks):
        part = slice(j * job_blocks, (j + 1) * job_blocks)
        chunks = CPULoadStoreSpec(np.arange(j * per_job, (j + 1) * per_job, dtype=np.int64))
        stores.append((_gpu_spec(store_rows[part]), chunks))
        loads.append((chunks, _gpu_spec(load_rows[part])))
    return _DataPathRig(worker, gpu, source, stores, loads, store_rows, load_rows)


def _round_trip(rig: _DataPathRig) -> float:
    """Store every job, wait, load every job back into other rows, wait; returns the real time taken."""
    w, first = rig.worker, rig.next_job
    store_ids = range(first, first + len(rig.stores))
    load_ids = range(store_ids.stop, store_ids.stop + len(rig.loads))
    rig.next_job = load_ids.stop
    start = time.perf_counter()
    for job, (gpu_spec, cpu_spec) in zip(store_ids, rig.stores, strict=True):
        w.submit_store(job, gpu_spec, cpu_spec)
    w.wait(store_ids)
    for job, (cpu_spec, gpu_spec) in zip(load_ids, rig.loads, strict=True):
        w.submit_load(job, cpu_spec, gpu_spec)
    w.wait(load_ids)
    results = w.get_finished()
    elapsed = time.perf_counter() - start
    if len(results) != len(store_ids) + len(load_ids) or not all(r.success for r in results):
        raise AssertionError("a data-path transfer failed")
    return elapsed


def _verify_sample(rig: _DataPathRig, tensors: Sequence[int]) -> None:
    """The loaded rows of the sampled tensors equal the stored rows' original bytes."""
    for t in tensors:
        if not np.array_equal(rig.gpu[t][rig.load_rows], rig.source[t][rig.store_rows]):
            raise AssertionError(f"data path: tensor {t} was not loaded back byte-exact")


def _time_data_path(rig: _DataPathRig, repeats: int) -> tuple[float, float]:
    """Best real times of a round trip and of its reference copy, measured alternately so that slow spells of
    the machine hit both; the sampled destination rows are cleared before and checked after each round trip.

    Returns:
        (round trip seconds, reference seconds).
    """
    sample = (0, LAYERS // 2, LAYERS - 1)
    moved = 2 * int(rig.store_rows.size) * int(rig.gpu[0].shape[1]) * LAYERS
    src, dst = np.ones(moved, dtype=np.uint8), np.ones(moved, dtype=np.uint8)
    best, reference = math.inf, math.inf
    for attempt in range(repeats + 1):  # the first is a warm-up (pools fill, pages fault in)
        for t in sample:
            rig.gpu[t][rig.load_rows] = 0  # the sim is idle: writing its arrays directly races nothing
        elapsed = _round_trip(rig)
        _verify_sample(rig, sample)
        start = time.perf_counter()
        np.copyto(dst, src)
        copied = time.perf_counter() - start
        if attempt:
            best, reference = min(best, elapsed), min(reference, copied)
    return best, reference


def bench_data_path(sizes: _Sizes) -> list[Result]:
    """Store + load bytes/s through a worker on the sim against one contiguous numpy copy of the same bytes."""
    results = []
    for page, goal in ((4 * KiB, 0.4), (64 * KiB, 0.8)):
        rig = _data_path_rig(page, sizes.datapath_bytes, sizes.job_blocks)
        try:
            seconds, reference = _time_data_path(rig, sizes.repeats)
        finally:
            rig.worker.shutdown()
        moved, jobs = 2 * int(rig.store_rows.size) * page * LAYERS, len(rig.stores)
        results.append(_result(
            f"datapath_{page // KiB}k", f"sim data path, {page // KiB} KiB pages, store+load {moved // MiB} MiB",
            (moved / seconds, "bytes/s"), (moved / reference, "bytes/s", "one np.copyto of the same bytes"),
            f">= {goal}x", [_Goal("ratio", ">=", goal)],
            note=f"{jobs} store(s) + {jobs} load(s) of {sizes.job_blocks} blocks x {LAYERS} layers"))
    return results


# ---------------------------------------------------------------------------------------------------- shutdown


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
        self.sleeps = 0  # sleeps so far: the polls of bounded waits, plus the bench's own clock advances

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
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
    return _gpu_spec(np.array([job % SMALL_BLOCKS], dtype=np.int64)), CPULoadStoreSpec([job % SMALL_CHUNKS])


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
        _result("shutdown_hung_virtual", f"hung shutdown, virtual elapsed (timeout {timeout:g} s)",
                (report.elapsed, "virtual s"), (timeout, "virtual s", "the policy timeout"),
                f"overshoot {goal}", [_Goal("value", "<=", timeout + GOAL_OVERSHOOT_S)],
                note=f"virtual overshoot {overshoot * 1e3:.3f} ms"),
        _result("shutdown_hung_wall", "hung shutdown, real wall time (whole shutdown)", (hung.wall, "s"),
                (clean, "s", "clean shutdown, same setup"), goal, [_Goal("value", "<=", GOAL_OVERSHOOT_S)],
                note=f"{hung.polls} polls through {timeout:g} virtual s; a real GPU sleeps those out before the "
                     "deadline"),
        _result("shutdown_hung_past_deadline", "hung shutdown, real time after the clock reached the deadline",
                (hung.past_deadline, "s"), (hung.wall, "s", "the whole hung shutdown"), goal,
                [_Goal("value", "<=", GOAL_OVERSHOOT_S)],
                note="the sim's analogue of the real overshoot: abandon, device proof, release, quarantine"),
    ]


def _completed_transfers(count: int) -> tuple[_WatchedSim, CPUOffloadingWorker, float]:
    """A worker with ``count`` one-block stores submitted and completed (clock advanced, nothing observed yet).

    Returns:
        The backend, the worker and the real time the submissions took.
    """
    be = _WatchedSim()
    w = _small_worker(be)
    start = time.perf_counter()
    for job in range(count):
        w.submit_store(job, *_one_block(job))
    submitted = time.perf_counter() - start
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


def bench_drain(sizes: _Sizes) -> tuple[list[Result], float, list[dict[str, object]]]:
    """Shutdown of many completed transfers: the drain phase and the whole, against submitting them.

    Returns:
        The results, the submit rate (transfers/s, the fuzz baseline) and the cProfile top cost centers.
    """
    count = sizes.drain_transfers
    runs = [_drain_shutdown(count) for _ in range(sizes.drain_runs)]
    best, _ = min(runs, key=lambda r: r[0].wall)
    submitted = min(s for _, s in runs)
    reference = (submitted, "s", f"submitting the {_label(count)} transfers")
    goal = f"<= {GOAL_DRAIN_S * 1e3:.0f} ms"
    results = [
        _result("shutdown_drain_phase", f"shutdown of {_label(count)} completed transfers, drain phase",
                (best.drain, "s"), reference, goal, [_Goal("value", "<=", GOAL_DRAIN_S)],
                note="until the handlers' release begins"),
        _result("shutdown_drain_total", f"shutdown of {_label(count)} completed transfers, whole",
                (best.wall, "s"), reference, goal, [_Goal("value", "<=", GOAL_DRAIN_S)],
                note=f"release: {(best.wall - best.drain) * 1e3:.1f} ms, {best.released} resources released "
                     "(streams, events, descriptor buffers, pin, mapping)"),
    ]
    return results, count / submitted, _profile(count)


# -------------------------------------------------------------------------------------------------------- fuzz


def _campaign() -> tuple[Callable[..., int] | None, str]:
    """``run_campaign`` from the conformance kit, or None and why it is not available."""
    try:
        module = importlib.import_module("kvoffload_ref.testing.campaign")
    except ImportError as exc:
        return None, f"not available ({exc})"
    run = getattr(module, "run_campaign", None)
    return (cast(Callable[..., int], run), "") if callable(run) else (None, "not available (no run_campaign)")


def bench_fuzz(sizes: _Sizes, submit_rate: float) -> Result:
    """Stateful fuzz steps/s (if the conformance kit exists), against the plain submit rate."""
    steps, goal = sizes.fuzz_steps, f">= {GOAL_FUZZ_RATE:.0f} steps/s"
    metric = f"stateful fuzz, {steps} steps"
    reference = (submit_rate, "transfers/s", "plain submits (drain setup)")
    run, why = _campaign()
    if run is None:
        return Result("fuzz", metric, None, "steps/s", submit_rate, reference[1], reference[2], None, goal, None,
                      why)
    start = time.perf_counter()
    status = run(steps, 0, None, out=io.StringIO())
    seconds = time.perf_counter() - start
    return _result("fuzz", metric, (steps / seconds, "steps/s"), reference, goal,
                   [_Goal("value", ">=", GOAL_FUZZ_RATE)],
                   note=f"seed 0, policy drawn; campaign exit status {status}")


# ------------------------------------------------------------------------------------------------ presentation


def _fmt(value: float | None, unit: str) -> str:
    """A value with its unit, human-scaled."""
    if value is None:
        return "n/a"
    if unit == "descriptors/s":
        return f"{value / 1e6:.3g} M desc/s"
    if unit == "bytes/s":
        return f"{value / 1e9:.2f} GB/s"
    if unit == "s":
        return f"{value * 1e3:.3g} ms"
    if unit == "virtual s":
        return f"{value:.4f} s (virtual)"
    return f"{value:,.0f} {unit}"


def _fmt_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "n/a"
    return f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.3f}x"


def render(doc: dict[str, object]) -> str:
    """The markdown report of a :func:`run_bench` result: the table, the notes and the drain profile."""
    results = cast(list[dict[str, object]], doc["results"])
    lines = ["| metric | measured | reference (same run) | ratio | goal | met |",
             "|---|---|---|---|---|---|"]
    for r in results:
        met = {True: "yes", False: "**no**", None: "n/a"}[cast(bool | None, r["met"])]
        reference = f"{_fmt(cast(float | None, r['reference']), str(r['reference_unit']))} " \
                    f"({r['reference_label']})"
        lines.append(f"| {r['metric']} | {_fmt(cast(float | None, r['value']), str(r['unit']))} | {reference} | "
                     f"{_fmt_ratio(cast(float | None, r['ratio']))} | {r['goal']} | {met} |")
    lines += ["", "Notes:", ""]
    lines += [f"- {r['metric']}: {r['note']}" for r in results if r["note"]]
    profile = cast(list[dict[str, object]], doc["drain_profile"])
    lines += ["", "Top cost centers of one drain shutdown under cProfile (own time; profiling inflates it):", "",
              "| function | calls | own ms | cumulative ms |", "|---|---|---|---|"]
    lines += [f"| `{p['function']}` | {p['calls']} | {cast(float, p['tottime_ms']):.1f} | "
              f"{cast(float, p['cumtime_ms']):.1f} |" for p in profile]
    lines += ["", f"run_bench took {cast(float, doc['elapsed_s']):.1f} s ({'quick' if doc['quick'] else 'full'})."]
    return "\n".join(lines) + "\n"


def _cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else what platform reports."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _machine() -> dict[str, object]:
    """Python, numpy, platform, CPU count and the date (UTC)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "python": platform.python_version(), "implementation": platform.python_implementation(),
        "numpy": np.__version__, "platform": platform.platform(), "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(), "usable_cpus": len(affinity(0)) if affinity is not None else os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _finite(value: object) -> object:
    """``value`` with non-finite floats (nested too) turned into None, so the JSON stays standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def run_bench(json_path: str | None = None, quick: bool = False, out: TextIO | None = None) -> dict[str, object]:
    """Run every measurement, print the markdown report to ``out`` and write the JSON to ``json_path``.

    Args:
        json_path: where to write the results as JSON (None: do not write).
        quick: small sizes, for a smoke test (a few seconds).
        out: where the report goes (default: ``sys.stdout`` at call time).

    Returns:
        ``{"quick", "elapsed_s", "machine", "results": [Result as dict, ...], "drain_profile": [...]}``, the same
        as the JSON.
    """
    sizes = QUICK if quick else FULL
    start = time.perf_counter()
    with _captured_logs():
        results = [*bench_planner(sizes, quick), *bench_data_path(sizes), *bench_hung_shutdown(sizes.repeats)]
        drain, submit_rate, profile = bench_drain(sizes)
        results += [*drain, bench_fuzz(sizes, submit_rate)]
    doc = cast(dict[str, object], _finite({
        "quick": quick, "elapsed_s": time.perf_counter() - start, "machine": _machine(),
        "results": [dataclasses.asdict(r) for r in results], "drain_profile": profile,
    }))
    (out or sys.stdout).write(render(doc))
    if json_path is not None:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return doc


