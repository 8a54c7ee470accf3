"""The vectorized planner against the plain placement rule (``kvoffload_ref.placement``): over Hypothesis-drawn
layouts, geometries and specs, ``Planner``/``plan_copies`` give exactly the placement's byte moves, and refuse
(R7) exactly the transfers the rule refuses."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.placement import Move, check_transfer, plan_moves
from kvoffload_ref.planner import Planner, plan_copies
from kvoffload_ref.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec, KVCacheLayout, LayerRef, TensorGeometry
from kvoffload_ref.testing.strategies import layouts, transfer_specs

DIRECTIONS: list[Direction] = ["store", "load"]


def _geometry(draw: st.DrawFn, row_bytes: Sequence[int], rows: int, start: int) -> tuple[TensorGeometry, ...]:
    """One tensor per row size, laid out one after another from ``start``, rows padded by a random amount."""
    out, ptr = [], start
    for nbytes in row_bytes:
        stride = nbytes + draw(st.integers(0, 16))
        ptr += draw(st.integers(0, 64))
        out.append(TensorGeometry(ptr, rows, nbytes, stride))
        ptr += rows * stride
    return tuple(out)


@st.composite
def cases(draw: st.DrawFn) -> tuple[KVCacheLayout, int, tuple[TensorGeometry, ...], tuple[TensorGeometry, ...],
                                    GPULoadStoreSpec, CPULoadStoreSpec]:
    layout = draw(layouts())
    bpc = draw(st.integers(1, 4))
    gpu_rows, cpu_rows = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    gpu = _geometry(draw, layout.tensor_page_bytes, gpu_rows, 0x1000)
    cpu = _geometry(draw, [p * bpc for p in layout.tensor_page_bytes], cpu_rows, gpu[-1].ptr + gpu_rows * 4096)
    gpu_spec, cpu_spec = draw(transfer_specs(layout, bpc, gpu_rows, cpu_rows))
    return layout, bpc, gpu, cpu, gpu_spec, cpu_spec


def _addresses(moves: list[Move], direction: Direction, gpu: Sequence[TensorGeometry],
               cpu: Sequence[TensorGeometry]) -> list[tuple[int, int, int]]:
    return [m.addresses(direction, gpu, cpu) for m in moves]


@pytest.mark.rule("R7")
@settings(derandomize=True, max_examples=200)
@given(cases(), st.sampled_from(DIRECTIONS))
def test_placement_planner_moves_exactly_the_placement_bytes(case: tuple, direction: Direction) -> None:  # type: ignore[type-arg]
    layout, bpc, gpu, cpu, gpu_spec, cpu_spec = case
    src, dst = (gpu_spec, cpu_spec) if direction == "store" else (cpu_spec, gpu_spec)
    want = _addresses(plan_moves(layout, bpc, gpu_spec, cpu_spec), direction, gpu, cpu)
    checked = check_transfer(layout, direction, src, dst, [g.rows for g in gpu], [c.rows for c in cpu], bpc)
    assert _addresses(checked, direction, gpu, cpu) == want
    for plan in (plan_copies(layout, direction, src, dst, gpu, cpu, bpc), Planner(layout, gpu, cpu, bpc).plan(
            direction, src, dst)):
        got = list(zip(plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist(), strict=True))
        assert got == want
        assert plan.num_ops == len(want) and plan.nbytes == sum(n for _, _, n in want)


@pytest.mark.rule("R7")
@settings(derandomize=True, max_examples=200)
@given(cases(), st.sampled_from(DIRECTIONS), st.data())
def test_placement_refuses_exactly_what_the_planner_refuses(case: tuple, direction: Direction,  # type: ignore[type-arg]
                                                            data: st.DataObject) -> None:
    """Ids redrawn at random (repeats, out of range) and block indices anywhere: both accept, or both refuse."""
    layout, bpc, gpu, cpu, gpu_spec, cpu_spec = case
    top = max(gpu[0].rows, cpu[0].rows) + 2
    gpu_ids = data.draw(st.lists(st.integers(0, top), min_size=len(gpu_spec.block_ids),
                                 max_size=len(gpu_spec.block_ids)))
    indices = data.draw(st.lists(st.integers(0, bpc), min_size=len(gpu_spec.block_indices),
                                 max_size=len(gpu_spec.block_indices)))
    cpu_ids = data.draw(st.lists(st.integers(0, top), max_size=len(cpu_spec.block_ids) + 1))
    g, c = GPULoadStoreSpec(gpu_ids, gpu_spec.group_sizes, indices), CPULoadStoreSpec(cpu_ids)
    src, dst = (g, c) if direction == "store" else (c, g)
    try:
        moves = check_transfer(layout, direction, src, dst, [t.rows for t in gpu], [t.rows for t in cpu], bpc)
    except InvalidTransferError:
        with pytest.raises(InvalidTransferError):
            plan_copies(layout, direction, src, dst, gpu, cpu, bpc)
        return
    plan = plan_copies(layout, direction, src, dst, gpu, cpu, bpc)
    assert list(zip(plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist(), strict=True)) == \
        _addresses(moves, direction, gpu, cpu)


@pytest.mark.rule("R7")
def test_placement_refuses_wrong_spec_types_src_first() -> None:
    lay = KVCacheLayout([8], [[LayerRef(0, 8)]])
    with pytest.raises(InvalidTransferError, match="store: src_spec must be a GPULoadStoreSpec"):
        check_transfer(lay, "store", object(), object(), [4], [4], 1)
    with pytest.raises(InvalidTransferError, match="direction must be"):
        check_transfer(lay, "sideways", None, None, [4], [4], 1)
