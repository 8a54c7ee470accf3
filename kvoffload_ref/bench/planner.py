"""Bench figures of the copy planner: its rate at three sizes against a naive loop, and its scaling.

The planner is measured the way the handler runs it on every submission: a :class:`~kvoffload_ref.layout.Planner`
built once over the geometry (as each handler builds one), then per transfer ``Planner.prepare`` (validates the
specs completely, R7) and ``PreparedPlan.write`` into three int64 arrays allocated once and reused (as the handler
writes into its pooled descriptor buffers). On a realistic layout: 32 layer tensors in one KV-cache group, 16 KiB
pages, ``blocks_per_chunk = 4``, scattered GPU block ids, the first CPU chunk half used (block index 1), store
direction. Descriptors = blocks x 32 refs, for [1k, 64k, 640k / quick: 1k, 8k, 80k] descriptors. Reference: a
naive per-(ref, block) Python loop computing the same descriptors (no validation), then turning its three lists
into int64 arrays, measured on the *same* sizes (not extrapolated); its output is checked equal to the planner's.
The one-call :func:`~kvoffload_ref.layout.plan_copies` (validates the geometry too, returns new arrays) is timed
as well and reported in the notes. Plus the scaling figure: planner time at the largest size over the middle one.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Final

import numpy as np

from kvoffload_ref.bench.common import (
    BPC,
    I64,
    LAYERS,
    BenchRun,
    Goal,
    KiB,
    Result,
    Sizes,
    best_of,
    label,
    result,
)
from kvoffload_ref.layout import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    KVCacheLayout,
    LayerRef,
    Planner,
    TensorGeometry,
    plan_copies,
)

__all__ = ["GOAL_PLANNER_RATE", "GOAL_PLANNER_VS_LOOP", "GOAL_SCALING", "bench_planner", "figures"]

PLANNER_PAGE: Final = 16 * KiB
#: Goals (issue 6, item 4).
GOAL_PLANNER_RATE: Final = 20e6
GOAL_PLANNER_VS_LOOP: Final = 50.0
GOAL_SCALING: Final = 11.0



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
    best = best_of(run, repeats)
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
    slow = best_of(lambda: _naive_plan(case), loop_runs)
    return _PlannerTiming(case.descriptors, fast, slow, faults, one_call, one_call_faults)


def _planner_goal(which: str) -> tuple[str, list[Goal]]:
    """The goal of one planner size: none at the small size (the fixed per-call cost dominates there)."""
    if which == "small":
        return "none (fixed per-call cost dominates)", []
    loop = f">= {GOAL_PLANNER_VS_LOOP:.0f}x loop"
    if which == "large":
        return loop, [Goal("ratio", ">=", GOAL_PLANNER_VS_LOOP)]
    return (f">= {GOAL_PLANNER_RATE / 1e6:.0f} M/s and {loop}",
            [Goal("ratio", ">=", GOAL_PLANNER_VS_LOOP), Goal("value", ">=", GOAL_PLANNER_RATE)])


def bench_planner(sizes: Sizes, quick: bool) -> list[Result]:
    """Planner rate at three sizes against the naive loop, and the scaling from the middle to the largest size."""
    timings = [_time_planner(n, quick) for n in sizes.planner]
    results: list[Result] = []
    for which, t in zip(("small", "medium", "large"), timings, strict=True):
        goal, conditions = _planner_goal(which)
        results.append(result(
            f"planner_{which}", f"planner, {label(t.descriptors)} descriptors",
            (t.descriptors / t.planner, "descriptors/s"),
            (t.descriptors / t.loop, "descriptors/s", "naive per-block Python loop, same descriptors"), goal,
            conditions, note=f"planner (prepare + write into reused arrays) {t.planner * 1e3:.3f} ms "
                             f"({t.faults_per_call:.0f} minor page faults per call); plan_copies (new arrays) "
                             f"{t.one_call * 1e3:.3f} ms ({t.one_call_faults:.0f} faults per call, "
                             f"{t.descriptors / t.one_call / 1e6:.3g} M desc/s, {t.loop / t.one_call:.1f}x loop); "
                             f"loop {t.loop * 1e3:.1f} ms"))
    medium, large = timings[1], timings[2]
    results.append(result(
        "planner_scaling", f"planner time, {label(large.descriptors)} vs {label(medium.descriptors)} descriptors",
        (large.planner, "s"), (medium.planner, "s", f"planner time at {label(medium.descriptors)}"),
        f"<= {GOAL_SCALING:.0f}x", [Goal("ratio", "<=", GOAL_SCALING)],
        note=f"{large.descriptors // medium.descriptors}x the descriptors"))
    return results



def figures(run: BenchRun) -> list[Result]:
    """The planner figure group: ``planner_small``, ``planner_medium``, ``planner_large``, ``planner_scaling``."""
    return bench_planner(run.sizes, run.quick)
