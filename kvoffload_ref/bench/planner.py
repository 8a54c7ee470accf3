"""Bench figures of the copy planner: its rate at three sizes against the plain placement rule, and its scaling.

The planner is measured the way the handler runs it on every submission: a :class:`~kvoffload_ref.planner.Planner`
built once over the geometry (as each handler builds one), then per transfer ``Planner.prepare`` (validates the
specs completely, R7) and ``PreparedPlan.write`` into three int64 arrays allocated once and reused (as the handler
writes into its pooled descriptor buffers). On a realistic layout: 32 layer tensors in one KV-cache group, 16 KiB
pages, ``blocks_per_chunk = 4``, scattered GPU block ids, the first CPU chunk half used (block index 1), store
direction. Descriptors = blocks x 32 refs, for [1k, 64k, 640k / quick: 1k, 8k, 80k] descriptors. Reference: the
plain-Python placement rule, :func:`~kvoffload_ref.placement.plan_moves` (one ``Move`` per ref and block) with
``Move.addresses`` per move, as the reference worker builds its descriptors (no validation), then its three columns
turned into int64 arrays, measured on the *same* sizes (not extrapolated); its output is checked equal to the
planner's.
The one-call :func:`~kvoffload_ref.planner.plan_copies` (validates the geometry too, returns new arrays) is timed
as well and reported in the notes. Plus the scaling figure: planner time at the largest size over the middle one.

*Layout shapes.* :data:`SHAPES` are four more layouts -- 8 layers at ``blocks_per_chunk`` 4, 2 layers at 16, 64
layers at 4, 3 groups of 4 layers at 1 -- with 2 KiB pages (1984 bytes copied per layer), GPU blocks in order, CPU
chunks in reverse, each group entering its first chunk at sub-block 1 when ``blocks_per_chunk > 1``. Each is timed
through :func:`~kvoffload_ref.planner.plan_copies` in both directions at the same three sizes (best of 7 runs, 3
from 100k descriptors on, after a warm-up); a figure is the slower direction's rate, and its reference is the
realistic layout's ``plan_copies`` rate at the same size, measured above in the same run (the ratio says whether
a shape is a slow path). Goals: >= 2 M/s at the small size (a sanity floor: the fixed per-call cost dominates),
>= 20 M/s from the middle size on. (These were the floors of a wall-clock unit test; absolute speed belongs here.)
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
from kvoffload_ref.bench.planner_canonical import bench_planner_canonical
from kvoffload_ref.placement import plan_moves
from kvoffload_ref.planner import CopyPlan, Planner, plan_copies
from kvoffload_ref.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec, KVCacheLayout, LayerRef, TensorGeometry

__all__ = [
    "GOAL_PLANNER_RATE", "GOAL_PLANNER_VS_LOOP", "GOAL_SCALING", "GOAL_SHAPE_SMALL_RATE", "SHAPES", "ShapeCase",
    "bench_planner", "bench_planner_shapes", "figures", "shape_case",
]

PLANNER_PAGE: Final = 16 * KiB
#: Goals (issue 6, item 4).
GOAL_PLANNER_RATE: Final = 20e6
GOAL_PLANNER_VS_LOOP: Final = 50.0
GOAL_SCALING: Final = 11.0
#: The layout shapes' floor at the small size (at the larger sizes: GOAL_PLANNER_RATE).
GOAL_SHAPE_SMALL_RATE: Final = 2e6

#: The layout shapes: key -> (words for the table, refs per group, groups, blocks_per_chunk).
SHAPES: Final[dict[str, tuple[str, int, int, int]]] = {
    "8layers_bpc4": ("8 layers, bpc 4", 8, 1, 4),
    "2layers_bpc16": ("2 layers, bpc 16", 2, 1, 16),
    "64layers_bpc4": ("64 layers, bpc 4", 64, 1, 4),
    "3groups_bpc1": ("3 groups x 4 layers, bpc 1", 4, 3, 1),
}
SHAPE_PAGE: Final = 2 * KiB
#: Bytes of each page a shape's refs copy (the rest is padding).
SHAPE_COPIED: Final = SHAPE_PAGE - 64



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


def _placement_plan(case: _PlannerCase) -> tuple[I64, I64, I64]:
    """The same descriptors as :func:`_plan` by the plain placement rule: :func:`~kvoffload_ref.placement.plan_moves`
    (one move per ref and block, in Python) turned into copies with ``Move.addresses``, as the reference worker
    builds its descriptors; no validation."""
    moves = plan_moves(case.layout, BPC, case.gpu_spec, case.cpu_spec)
    src, dst, sizes = zip(*(move.addresses("store", case.gpu, case.cpu) for move in moves), strict=True)
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
    """Best real times of the planner (the handler's path), of plan_copies and of the placement loop on one case,
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
    """Check the loop against both planner paths once (the loop's warm-up), then time them (planner paths first, as
    the sizes come)."""
    case = _planner_case(num_descriptors)
    want = _placement_plan(case)
    for path in (_plan, _plan_copies):
        if not all(np.array_equal(a, b) for a, b in zip(path(case), want, strict=True)):
            raise AssertionError(f"placement.plan_moves and {path.__name__} disagree at {num_descriptors} descriptors")
    fast_runs, loop_runs = _planner_repeats(num_descriptors, quick)
    fast, faults = _timed_with_faults(lambda: _plan(case), fast_runs)
    one_call, one_call_faults = _timed_with_faults(lambda: _plan_copies(case), fast_runs)
    slow = best_of(lambda: _placement_plan(case), loop_runs, warmup=0)  # warmed up by the check above
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


@dataclasses.dataclass(frozen=True)
class ShapeCase:
    """One layout shape's transfer: the arguments of :func:`~kvoffload_ref.planner.plan_copies` but the direction.

    Attributes:
        layout: ``groups`` groups of ``refs`` layers, one tensor each, 2 KiB pages.
        gpu: one synthetic geometry per tensor (no memory behind it).
        cpu: likewise, one CPU view per tensor.
        gpu_spec: blocks ``0..n-1`` (``n`` per group), each group entering its first chunk at sub-block
            ``min(1, bpc - 1)``.
        cpu_spec: every chunk the groups need, in reverse order.
        bpc: blocks per chunk.
        descriptors: the plan's number of copies (``n`` x refs x groups; at most the size asked for).
    """

    layout: KVCacheLayout
    gpu: tuple[TensorGeometry, ...]
    cpu: tuple[TensorGeometry, ...]
    gpu_spec: GPULoadStoreSpec
    cpu_spec: CPULoadStoreSpec
    bpc: int
    descriptors: int

    def plan(self, direction: Direction) -> CopyPlan:
        """``plan_copies`` of this transfer in ``direction``."""
        src, dst = (self.gpu_spec, self.cpu_spec) if direction == "store" else (self.cpu_spec, self.gpu_spec)
        return plan_copies(self.layout, direction, src, dst, self.gpu, self.cpu, self.bpc)


def shape_case(num_descriptors: int, refs: int, groups: int, bpc: int) -> ShapeCase:
    """The transfer of one layout shape (see the module docstring) of about ``num_descriptors`` copies.

    Args:
        num_descriptors: the size; each group gets ``num_descriptors // (refs * groups)`` blocks (>= 1).
        refs: layers (tensors) per group.
        groups: KV-cache groups.
        bpc: blocks per chunk.

    Returns:
        The case.
    """
    skip = min(1, bpc - 1)
    blocks = max(1, num_descriptors // (refs * groups))
    chunks = -(-(blocks + skip) // bpc)
    tensors = refs * groups
    layout = KVCacheLayout([SHAPE_PAGE] * tensors,
                           [[LayerRef(g * refs + r, SHAPE_COPIED) for r in range(refs)] for g in range(groups)])
    gpu = tuple(TensorGeometry(0x7000_0000_0000 + t * 2**36, blocks * groups, SHAPE_PAGE, SHAPE_PAGE)
                for t in range(tensors))
    row = SHAPE_PAGE * bpc
    cpu = tuple(TensorGeometry(0x1000_0000 + t * row, chunks * groups, row, row * tensors) for t in range(tensors))
    gpu_spec = GPULoadStoreSpec(np.arange(blocks * groups), [blocks] * groups, [skip] * groups)
    cpu_spec = CPULoadStoreSpec(np.arange(chunks * groups)[::-1])
    return ShapeCase(layout, gpu, cpu, gpu_spec, cpu_spec, bpc, blocks * refs * groups)


def _shape_rate(case: ShapeCase, direction: Direction, quick: bool) -> float:
    """Best-of-N descriptors per second of ``plan_copies`` on one shape and direction, after a warm-up."""
    runs = 2 if quick else (3 if case.descriptors > 100_000 else 7)
    best = best_of(lambda: case.plan(direction), runs)
    got = case.plan(direction).num_ops
    if got != case.descriptors:
        raise AssertionError(f"plan_copies made {got} copies of a {case.descriptors}-copy transfer")
    return case.descriptors / best


def bench_planner_shapes(sizes: Sizes, quick: bool, baseline: list[float]) -> list[Result]:
    """``plan_copies`` on each layout shape, both directions, at the three planner sizes.

    Args:
        sizes: the run's sizes (``sizes.planner``).
        quick: the smoke run (fewer repeats).
        baseline: per size, the realistic layout's ``plan_copies`` rate in descriptors/s (the reference).

    Returns:
        One result per (shape, size), keyed ``planner_shape_<shape>_<small|medium|large>``: the slower
        direction's rate, both directions in the note.
    """
    results: list[Result] = []
    for key, (words, refs, groups, bpc) in SHAPES.items():
        for which, size, reference in zip(("small", "medium", "large"), sizes.planner, baseline, strict=True):
            case = shape_case(size, refs, groups, bpc)
            store, load = (_shape_rate(case, direction, quick) for direction in ("store", "load"))
            floor = GOAL_SHAPE_SMALL_RATE if which == "small" else GOAL_PLANNER_RATE
            results.append(result(
                f"planner_shape_{key}_{which}", f"plan_copies, {words}, {label(size)} descriptors",
                (min(store, load), "descriptors/s"),
                (reference, "descriptors/s", f"plan_copies on the realistic layout, {label(size)} descriptors"),
                f">= {floor / 1e6:.0f} M/s", [Goal("value", ">=", floor)],
                note=f"slower direction of store {store / 1e6:.3g} M desc/s and load {load / 1e6:.3g} M desc/s; "
                     f"{case.descriptors} descriptors"))
    return results


def bench_planner(sizes: Sizes, quick: bool) -> list[Result]:
    """Planner rate at three sizes against the placement loop, the scaling from the middle to the largest size, the
    canonical mode's rate against the plain one's (``planner_canonical``), and ``plan_copies`` on the layout shapes
    (:func:`bench_planner_shapes`)."""
    timings = [_time_planner(n, quick) for n in sizes.planner]
    results: list[Result] = []
    for which, t in zip(("small", "medium", "large"), timings, strict=True):
        goal, conditions = _planner_goal(which)
        results.append(result(
            f"planner_{which}", f"planner, {label(t.descriptors)} descriptors",
            (t.descriptors / t.planner, "descriptors/s"),
            (t.descriptors / t.loop, "descriptors/s", "placement.plan_moves, plain Python, same descriptors"), goal,
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
    baseline = [t.descriptors / t.one_call for t in timings]
    canonical = bench_planner_canonical(sizes, quick, [t.descriptors / t.planner for t in timings])
    return results + canonical + bench_planner_shapes(sizes, quick, baseline)


def figures(run: BenchRun) -> list[Result]:
    """The planner figure group: ``planner_small``, ``planner_medium``, ``planner_large``, ``planner_scaling``,
    ``planner_canonical_<small|medium|large>`` (canonical mode, R24: ``planner_canonical``), then
    ``planner_shape_<shape>_<small|medium|large>`` for each of :data:`SHAPES`."""
    return bench_planner(run.sizes, run.quick)
