"""The layout shapes the bench times (kvoffload_ref.bench.planner.SHAPES): each shape's plan is right, in both
directions and at every bench size. No wall-clock assertion: the rates (and their floors) are figures of
``kvoffload-ref bench`` (keys ``planner_shape_<shape>_<size>``; ``--check`` fails on a missed floor).

At a small size every copy is compared with the plain-Python planner of tests/test_layout.py; at the bench's sizes
(1k, 64k and 640k descriptors) the plan's counts, sizes and a few closed-form addresses are checked.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_layout import naive_plan, triples

from kvoffload_ref.bench.common import FULL
from kvoffload_ref.bench.planner import SHAPE_COPIED, SHAPE_PAGE, SHAPES, ShapeCase, shape_case
from kvoffload_ref.specs import Direction

SHAPE_IDS = list(SHAPES)
DIRECTIONS: list[Direction] = ["store", "load"]


def _case(shape: str, num_descriptors: int) -> tuple[ShapeCase, int, int, int]:
    _, refs, groups, bpc = SHAPES[shape]
    return shape_case(num_descriptors, refs, groups, bpc), refs, groups, bpc


def test_layout_bench_shapes_are_the_four_layouts_the_bench_reports() -> None:
    assert {k: v[1:] for k, v in SHAPES.items()} == {
        "8layers_bpc4": (8, 1, 4), "2layers_bpc16": (2, 1, 16), "64layers_bpc4": (64, 1, 4),
        "3groups_bpc1": (4, 3, 1)}
    assert FULL.planner == (1024, 65536, 655360)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("shape", SHAPE_IDS)
@pytest.mark.parametrize("num_descriptors", [1, 200, 1024])
def test_layout_bench_shape_plan_equals_the_plain_planner(shape: str, direction: Direction,
                                                          num_descriptors: int) -> None:
    case, _, _, _ = _case(shape, num_descriptors)
    src, dst = (case.gpu_spec, case.cpu_spec) if direction == "store" else (case.cpu_spec, case.gpu_spec)
    want = naive_plan(case.layout, direction, src, dst, gpu=case.gpu, cpu=case.cpu, bpc=case.bpc)
    plan = case.plan(direction)
    assert triples(plan) == want and len(want) == case.descriptors


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("shape", SHAPE_IDS)
@pytest.mark.parametrize("num_descriptors", FULL.planner)
def test_layout_bench_shape_plan_at_the_bench_sizes(shape: str, direction: Direction, num_descriptors: int) -> None:
    """Counts and closed-form addresses at full size: ref r of group g, block i (CPU sub-block k = skip + i)."""
    case, refs, groups, bpc = _case(shape, num_descriptors)
    blocks = num_descriptors // (refs * groups)
    assert case.descriptors == blocks * refs * groups > num_descriptors - refs * groups
    plan = case.plan(direction)
    assert plan.num_ops == case.descriptors and plan.nbytes == case.descriptors * SHAPE_COPIED
    assert (plan.sizes == SHAPE_COPIED).all()
    gpu_side, cpu_side = (plan.src, plan.dst) if direction == "store" else (plan.dst, plan.src)
    skip = min(1, bpc - 1)
    chunks = -(-(blocks + skip) // bpc)
    cpu_ids = case.cpu_spec.block_ids
    for g, r, i in [(0, 0, 0), (groups - 1, refs - 1, blocks - 1), (groups // 2, refs // 2, blocks // 2)]:
        t, k = g * refs + r, skip + i
        pos = (g * refs + r) * blocks + i   # group-major, then ref, then block
        gpu_geo, cpu_geo = case.gpu[t], case.cpu[t]
        assert int(gpu_side[pos]) == gpu_geo.ptr + (g * blocks + i) * SHAPE_PAGE
        chunk = int(cpu_ids[g * chunks + k // bpc])
        assert int(cpu_side[pos]) == cpu_geo.ptr + chunk * cpu_geo.row_stride + (k % bpc) * SHAPE_PAGE
    if num_descriptors <= 65536:   # (a sort of 640k addresses costs more than everything else here)
        destinations = cpu_side if direction == "store" else gpu_side
        assert np.unique(destinations).size == plan.num_ops, "every destination is written once"
