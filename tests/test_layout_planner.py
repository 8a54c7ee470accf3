"""kvoffload_ref.planner: a transfer that writes one destination twice is refused before any device work (R7);
a repeated source is legal. Both planning paths (Planner.prepare and plan_copies) are checked alike."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pytest
from _support import make_worker

import kvoffload_ref as kv
from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.planner import CopyPlan, Planner, plan_copies
from kvoffload_ref.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec, KVCacheLayout, LayerRef, TensorGeometry

PAGE = 256
ROWS = 512


def _rig(groups: Sequence[Sequence[int]], bpc: int,
         num_tensors: int = 2) -> tuple[KVCacheLayout, list[TensorGeometry], list[TensorGeometry]]:
    """``num_tensors`` tensors of PAGE-byte pages, ROWS rows a side; ``groups`` lists each group's tensors."""
    layout = KVCacheLayout([PAGE] * num_tensors, [[LayerRef(t, PAGE) for t in g] for g in groups])
    gpu = [TensorGeometry(0x100_0000 + t * 0x10_0000, ROWS, PAGE, PAGE) for t in range(num_tensors)]
    cpu = [TensorGeometry(0x900_0000 + t * 0x100_0000, ROWS, PAGE * bpc, PAGE * bpc) for t in range(num_tensors)]
    return layout, gpu, cpu


def _both(layout: KVCacheLayout, gpu: list[TensorGeometry], cpu: list[TensorGeometry], bpc: int,
          direction: Direction, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec) -> CopyPlan:
    """Plan with both paths; they must agree."""
    src, dst = (gpu_spec, cpu_spec) if direction == "store" else (cpu_spec, gpu_spec)
    plan = plan_copies(layout, direction, src, dst, gpu, cpu, bpc)
    assert Planner(layout, gpu, cpu, bpc).plan(direction, src, dst) == plan
    return plan


def _refused(layout: KVCacheLayout, gpu: list[TensorGeometry], cpu: list[TensorGeometry], bpc: int,
             direction: Direction, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec, message: str) -> None:
    """Both paths refuse the transfer with ``message`` (a regex)."""
    src, dst = (gpu_spec, cpu_spec) if direction == "store" else (cpu_spec, gpu_spec)
    with pytest.raises(InvalidTransferError, match=message):
        plan_copies(layout, direction, src, dst, gpu, cpu, bpc)
    with pytest.raises(InvalidTransferError, match=message):
        Planner(layout, gpu, cpu, bpc).prepare(direction, src, dst)


# --------------------------------------------------------------------------------------------- load: GPU


@pytest.mark.rule("R7")
@pytest.mark.parametrize("bpc", [1, 3])
def test_layout_planner_load_refuses_a_gpu_block_written_twice(bpc: int) -> None:
    layout, gpu, cpu = _rig([[0, 1]], bpc)
    chunks = CPULoadStoreSpec(list(range(-(-3 // bpc))))
    _refused(layout, gpu, cpu, bpc, "load", GPULoadStoreSpec([5, 9, 5], (3,), (0,)), chunks,
             r"^load: GPU block 5 of tensor 0 is a destination twice \(GPULoadStoreSpec\.block_ids\[0\] and "
             r"\[2\]\): expected each destination written once per transfer \(a repeated source is fine\)$")


@pytest.mark.rule("R7")
@pytest.mark.parametrize("bpc", [1, 2])
def test_layout_planner_load_from_a_repeated_source_is_legal(bpc: int) -> None:
    """One CPU chunk loaded into several GPU blocks: the source repeats, every destination is distinct."""
    layout, gpu, cpu = _rig([[0, 1]], bpc)
    size = 2 * bpc
    plan = _both(layout, gpu, cpu, bpc, "load", GPULoadStoreSpec(list(range(size)), (size,), (0,)),
                 CPULoadStoreSpec([7, 7]))
    assert len(set(plan.src.tolist())) == plan.num_ops // 2 and len(set(plan.dst.tolist())) == plan.num_ops


@pytest.mark.rule("R7")
def test_layout_planner_groups_on_different_tensors_may_name_one_gpu_block() -> None:
    layout, gpu, cpu = _rig([[0], [1]], 1)
    plan = _both(layout, gpu, cpu, 1, "load", GPULoadStoreSpec([5, 5], (1, 1), (0, 0)), CPULoadStoreSpec([1, 2]))
    assert plan.num_ops == 2 and len(set(plan.dst.tolist())) == 2


@pytest.mark.rule("R7")
def test_layout_planner_groups_sharing_a_tensor_may_not_name_one_gpu_block() -> None:
    """Hybrid layouts share a tensor between groups: the same block of it written by two groups collides."""
    layout, gpu, cpu = _rig([[0], [1, 0]], 1)
    _refused(layout, gpu, cpu, 1, "load", GPULoadStoreSpec([5, 5], (1, 1), (0, 0)), CPULoadStoreSpec([1, 2]),
             r"^load: GPU block 5 of tensor 0 is a destination twice \(GPULoadStoreSpec\.block_ids\[0\] and \[1\]\)")


@pytest.mark.rule("R7")
def test_layout_planner_two_refs_of_one_tensor_in_a_group_are_not_a_duplicate() -> None:
    """Both refs copy the same source bytes to the same place: one destination, not two."""
    layout = KVCacheLayout([PAGE], [[LayerRef(0, PAGE), LayerRef(0, PAGE // 2)]])
    gpu = [TensorGeometry(0x100_0000, ROWS, PAGE, PAGE)]
    cpu = [TensorGeometry(0x900_0000, ROWS, PAGE, PAGE)]
    for direction in ("store", "load"):
        plan = _both(layout, gpu, cpu, 1, direction, GPULoadStoreSpec([4, 6], (2,), (0,)), CPULoadStoreSpec([1, 3]))
        assert plan.num_ops == 4


# -------------------------------------------------------------------------------------------- store: CPU


@pytest.mark.rule("R7")
def test_layout_planner_store_refuses_a_cpu_chunk_written_twice_bpc_1() -> None:
    layout, gpu, cpu = _rig([[0, 1]], 1)
    _refused(layout, gpu, cpu, 1, "store", GPULoadStoreSpec([1, 2, 3], (3,), (0,)), CPULoadStoreSpec([4, 8, 4]),
             r"^store: CPU chunk 4 sub-block 0 of tensor 0 is a destination twice \(CPULoadStoreSpec\.block_ids"
             r"\[0\] and \[2\]\): expected each destination written once per transfer \(a repeated source is "
             r"fine\)$")


@pytest.mark.rule("R7")
@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_layout_planner_store_from_a_repeated_source_is_legal(bpc: int) -> None:
    """One GPU block stored into several CPU sub-blocks."""
    layout, gpu, cpu = _rig([[0, 1]], bpc)
    plan = _both(layout, gpu, cpu, bpc, "store", GPULoadStoreSpec([3] * bpc * 2, (bpc * 2,), (0,)),
                 CPULoadStoreSpec([10, 11]))
    assert len(set(plan.src.tolist())) == 2 and len(set(plan.dst.tolist())) == plan.num_ops


@pytest.mark.rule("R7")
def test_layout_planner_store_refuses_a_sub_block_written_twice_bpc_above_1() -> None:
    """bpc 2, skip 1: chunk ids [4, 4] give sub-blocks (4, 1), (4, 0), (4, 1): the third repeats the first."""
    layout, gpu, cpu = _rig([[0, 1]], 2)
    _refused(layout, gpu, cpu, 2, "store", GPULoadStoreSpec([1, 2, 3], (3,), (1,)), CPULoadStoreSpec([4, 4]),
             r"^store: CPU chunk 4 sub-block 1 of tensor 0 is a destination twice \(CPULoadStoreSpec\.block_ids"
             r"\[0\] and \[1\]\)")


@pytest.mark.rule("R7")
def test_layout_planner_a_repeated_chunk_whose_sub_blocks_differ_is_legal() -> None:
    """bpc 2, skip 1, two blocks: chunk ids [4, 4] give sub-blocks (4, 1) then (4, 0): distinct destinations."""
    layout, gpu, cpu = _rig([[0, 1]], 2)
    plan = _both(layout, gpu, cpu, 2, "store", GPULoadStoreSpec([1, 2], (2,), (1,)), CPULoadStoreSpec([4, 4]))
    assert plan.num_ops == 4 and len(set(plan.dst.tolist())) == 4


@pytest.mark.rule("R7")
def test_layout_planner_groups_sharing_a_chunk_collide_only_on_one_sub_block() -> None:
    """Two groups over the same tensors, one chunk id each (bpc 2): different sub-blocks are fine, the same one
    is refused; over different tensors even the same sub-block is fine."""
    shared, gpu, cpu = _rig([[0, 1], [0, 1]], 2)
    _both(shared, gpu, cpu, 2, "store", GPULoadStoreSpec([1, 2], (1, 1), (0, 1)), CPULoadStoreSpec([4, 4]))
    _refused(shared, gpu, cpu, 2, "store", GPULoadStoreSpec([1, 2], (1, 1), (1, 1)), CPULoadStoreSpec([4, 4]),
             r"^store: CPU chunk 4 sub-block 1 of tensor 0 is a destination twice")
    apart, gpu, cpu = _rig([[0], [1]], 2)
    _both(apart, gpu, cpu, 2, "store", GPULoadStoreSpec([1, 2], (1, 1), (1, 1)), CPULoadStoreSpec([4, 4]))


# ------------------------------------------------------------------------------------------- long id lists


@pytest.mark.rule("R7")
@pytest.mark.parametrize("direction", ["store", "load"])
def test_layout_planner_long_transfers_are_checked_too(direction: Direction) -> None:
    """Past the short-list path: 300 distinct ids pass, and one repeat among them is found and placed."""
    layout, gpu, cpu = _rig([[0, 1]], 1)
    planner = Planner(layout, gpu, cpu, 1)
    ids = np.random.default_rng(0).permutation(ROWS)[:300]
    other = np.arange(300)
    gpu_ids, cpu_ids = (other, ids) if direction == "store" else (ids, other)
    src, dst = (GPULoadStoreSpec(gpu_ids, (300,), (0,)), CPULoadStoreSpec(cpu_ids))
    args = (src, dst) if direction == "store" else (dst, src)
    for _ in range(2):  # the scratch array is reused: a second pass must not see the first one's marks
        assert planner.prepare(direction, *args).num_ops == 600  # type: ignore[arg-type]
    bad = ids.copy()
    bad[250] = bad[17]
    gpu_ids, cpu_ids = (other, bad) if direction == "store" else (bad, other)
    src, dst = (GPULoadStoreSpec(gpu_ids, (300,), (0,)), CPULoadStoreSpec(cpu_ids))
    args = (src, dst) if direction == "store" else (dst, src)
    with pytest.raises(InvalidTransferError, match=r"\[17\] and \[250\]\)"):
        planner.prepare(direction, *args)  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferError, match=r"\[17\] and \[250\]\)"):
        plan_copies(layout, direction, *args, gpu, cpu, 1)  # type: ignore[arg-type]


@pytest.mark.rule("R7")
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("side", ["gpu", "cpu"])
def test_layout_planner_a_one_block_transfer_checks_its_one_id_range(direction: Direction, side: str) -> None:
    """A one-block transfer (one id a side: the planner reads it without a reduction) is refused when its id is
    past the tensors' rows, on either side, and accepted at the last row."""
    layout, gpu, cpu = _rig([[0, 1]], 2)
    for gpu_id, cpu_id, ok in ((ROWS - 1, ROWS - 1, True), (ROWS if side == "gpu" else 0,
                                                           ROWS if side == "cpu" else 0, False)):
        gpu_spec, cpu_spec = GPULoadStoreSpec(np.array([gpu_id]), (1,), (1,)), CPULoadStoreSpec(np.array([cpu_id]))
        if ok:
            assert _both(layout, gpu, cpu, 2, direction, gpu_spec, cpu_spec).num_ops == 2
            continue
        name = "GPU" if side == "gpu" else "CPU"
        spec = "GPULoadStoreSpec" if side == "gpu" else "CPULoadStoreSpec"
        _refused(layout, gpu, cpu, 2, direction, gpu_spec, cpu_spec,
                 rf"^{name} block id {ROWS} \({spec}\.block_ids\[0\]\) is out of range")


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("pads", [(0, 0), (64, 0), (0, 128), (64, 128)], ids=["same", "gpu-differ", "cpu-differ",
                                                                             "both-differ"])
def test_layout_planner_a_one_block_slice_uses_each_refs_own_stride(direction: Direction, pads: tuple[int, int]
                                                                    ) -> None:
    """A one-block slice over refs whose tensors share a row stride (one stride for all: one addition) or not (one
    per ref): each descriptor is the block's page of its own tensor, the chunk's sub-block of its own view."""
    bpc, gpu_id, cpu_id, index = 2, 5, 7, 1
    layout, gpu, cpu = _rig([[0, 1]], bpc)
    gpu[1] = TensorGeometry(gpu[1].ptr, ROWS, PAGE, PAGE + pads[0])
    cpu[1] = TensorGeometry(cpu[1].ptr, ROWS, PAGE * bpc, PAGE * bpc + pads[1])
    plan = _both(layout, gpu, cpu, bpc, direction, GPULoadStoreSpec([gpu_id], (1,), (index,)),
                 CPULoadStoreSpec([cpu_id]))
    pages = [g.ptr + gpu_id * g.row_stride for g in gpu]
    subs = [c.ptr + cpu_id * c.row_stride + index * PAGE for c in cpu]
    src, dst = (pages, subs) if direction == "store" else (subs, pages)
    assert (plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()) == (src, dst, [PAGE, PAGE])


# -------------------------------------------------------------------------------------- through the worker


@pytest.mark.rule("R7")
def test_layout_planner_worker_refuses_duplicate_destinations_before_any_device_work() -> None:
    be, worker, _ = make_worker()  # bpc 3
    try:
        acquired = be.ledger.acquired()
        with pytest.raises(kv.InvalidTransferError, match=re.escape("GPU block 4 of tensor 0 is a destination")):
            worker.submit_load(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([4, 5, 4], (3,), (0,)))
        with pytest.raises(kv.InvalidTransferError, match=re.escape("CPU chunk 2 sub-block 0 of tensor 0 is a")):
            worker.submit_store(2, GPULoadStoreSpec([4, 5, 6, 7], (4,), (0,)), CPULoadStoreSpec([2, 2]))
        assert be.ledger.acquired() == acquired and worker.get_finished() == []
        worker.submit_load(3, CPULoadStoreSpec([0, 0]), GPULoadStoreSpec([4, 5, 6, 7, 8, 9], (6,), (0,)))  # legal
        worker.wait({3})
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(3, True)]
    finally:
        worker.shutdown()


# --------------------------------------------------------------------------------------------- remembered shapes


@pytest.mark.parametrize("kept", [256, 2])
def test_layout_planner_reused_across_spec_shapes_plans_each_as_a_fresh_one(kept: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A planner remembers each spec shape's group slicing; a reused planner plans every transfer exactly as a fresh
    one, whichever shapes came before (block index, group sizes, empty groups), also once it forgets (kept=2)."""
    monkeypatch.setattr("kvoffload_ref.planner.SLICE_SHAPES", kept)
    bpc = 4
    layout, gpu, cpu = _rig([[0], [1]], bpc)
    planner = Planner(layout, gpu, cpu, bpc)
    shapes = [((1, 0), (0, 0)), ((1, 0), (3, 0)), ((0, 1), (0, 2)), ((1, 1), (2, 1)), ((3, 2), (1, 3)),
              ((1, 0), (1, 0)), ((1, 0), (3, 0)), ((0, 1), (0, 2))]
    for direction in ("store", "load"):
        for turn, (sizes, indices) in enumerate(shapes):
            ids = [(7 * turn + k) % ROWS for k in range(sum(sizes))]
            chunks = sum(-(-(n + i) // bpc) for n, i in zip(sizes, indices, strict=True) if n)
            gpu_spec = GPULoadStoreSpec(ids, sizes, indices)
            cpu_spec = CPULoadStoreSpec([(3 * turn + k) % ROWS for k in range(chunks)])
            src, dst = (gpu_spec, cpu_spec) if direction == "store" else (cpu_spec, gpu_spec)
            assert planner.plan(direction, src, dst) == plan_copies(layout, direction, src, dst, gpu, cpu, bpc)


@pytest.mark.rule("R7")
def test_layout_planner_refused_shape_is_refused_again() -> None:
    """A shape that fails the slicing checks is never remembered: it is refused on every call, also after the
    same group sizes passed with another CPU id count."""
    layout, gpu, cpu = _rig([[0, 1]], 2)
    planner = Planner(layout, gpu, cpu, 2)
    planner.prepare("store", GPULoadStoreSpec([1, 2], (2,), (0,)), CPULoadStoreSpec([0]))
    for _ in range(2):
        with pytest.raises(InvalidTransferError, match=r"CPULoadStoreSpec has 2 block ids, expected 1"):
            planner.prepare("store", GPULoadStoreSpec([1, 2], (2,), (0,)), CPULoadStoreSpec([0, 1]))
        with pytest.raises(InvalidTransferError, match=r"block_indices\[0\] = 2 is out of range"):
            planner.prepare("store", GPULoadStoreSpec([1, 2], (2,), (2,)), CPULoadStoreSpec([0, 1]))
