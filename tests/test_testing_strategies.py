"""The kit's strategies draw what they promise, and its naive placement rule agrees with the planner."""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from _support import catch_budget
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.faults import HANG_POINTS, RELEASE_POINTS
from kvoffload_ref.planner import plan_copies
from kvoffload_ref.specs import TensorGeometry
from kvoffload_ref.testing import (
    INVALID_CASES,
    ConformanceError,
    Setup,
    SimDevice,
    fault_plans,
    faults,
    invalid_transfers,
    layouts,
    make_machine,
    plan_moves,
    policies,
    reference_factory,
    setups,
    transfer_specs,
)
from kvoffload_ref.testing.adapter import WorkerLike
from kvoffload_ref.testing.campaign import quiet_logs
from kvoffload_ref.testing.strategies import (
    COMPLETION_POINTS,
    JOB_ID_STARTS,
    SUBMIT_POINTS,
    completion_faults,
    first_job_ids,
)
from kvoffload_ref.worker import CPUOffloadingWorker

GPU_BLOCKS, CPU_CHUNKS = 12, 6


def _geometries(layout: kv.KVCacheLayout, bpc: int) -> tuple[list[TensorGeometry], list[TensorGeometry]]:
    """Fake, non-overlapping geometries with padded row strides on both sides."""
    gpu, cpu, base = [], [], 1 << 20
    for page in layout.tensor_page_bytes:
        gpu.append(TensorGeometry(base, GPU_BLOCKS, page, page + 8))
        base += GPU_BLOCKS * (page + 8) + 4096
        cpu.append(TensorGeometry(base, CPU_CHUNKS, page * bpc, page * bpc + 16))
        base += CPU_CHUNKS * (page * bpc + 16) + 4096
    return gpu, cpu


@st.composite
def _layout_and_specs(draw: st.DrawFn) -> tuple[kv.KVCacheLayout, int, kv.GPULoadStoreSpec, kv.CPULoadStoreSpec]:
    layout = draw(layouts())
    bpc = draw(st.integers(1, 4))
    gpu, cpu = draw(transfer_specs(layout, bpc, GPU_BLOCKS, CPU_CHUNKS))
    return layout, bpc, gpu, cpu


@pytest.mark.rule("R4")
@given(_layout_and_specs(), st.sampled_from(["store", "load"]))
def test_testing_strategies_valid_specs_plan_as_the_naive_rule_says(
        drawn: tuple[kv.KVCacheLayout, int, kv.GPULoadStoreSpec, kv.CPULoadStoreSpec], direction: str) -> None:
    layout, bpc, gpu_spec, cpu_spec = drawn
    gpu, cpu = _geometries(layout, bpc)
    src, dst = (gpu_spec, cpu_spec) if direction == "store" else (cpu_spec, gpu_spec)
    plan = plan_copies(layout, direction, src, dst, gpu, cpu, bpc)  # type: ignore[arg-type]
    moves = plan_moves(layout, bpc, gpu_spec, cpu_spec)
    gpu_addr = [gpu[m.tensor].ptr + m.gpu_row * gpu[m.tensor].row_stride for m in moves]
    cpu_addr = [cpu[m.tensor].ptr + m.cpu_row * cpu[m.tensor].row_stride + m.cpu_col for m in moves]
    want_src, want_dst = (gpu_addr, cpu_addr) if direction == "store" else (cpu_addr, gpu_addr)
    assert plan.src.tolist() == want_src and plan.dst.tolist() == want_dst
    assert plan.sizes.tolist() == [m.size for m in moves] and plan.nbytes == sum(m.size for m in moves)
    assert len(set(gpu_addr)) == len(gpu_addr) and len(set(cpu_addr)) == len(cpu_addr), "distinct ids"


def _shared_tensor(layout: kv.KVCacheLayout) -> bool:
    used = [ref.tensor_idx for group in layout.groups for ref in group]
    return len(used) != len(set(used))


@pytest.mark.rule("R7")
@pytest.mark.parametrize("case", [c for c in INVALID_CASES if c != "job id in flight"])
@given(data=st.data())
def test_testing_strategies_invalid_transfers_are_refused_by_the_worker(case: str, data: st.DataObject) -> None:
    layout = data.draw(layouts(max_tensors=2, max_groups=2))
    bpc = data.draw(st.integers(1, 3))
    bad = data.draw(invalid_transfers(layout, bpc, GPU_BLOCKS, CPU_CHUNKS, cases=[case]))
    assert bad.case == case
    be = SimBackend()
    worker = kv.create_worker(be, [be.empty_device((GPU_BLOCKS, p)) for p in layout.tensor_page_bytes], layout,
                              blocks_per_chunk=bpc, num_cpu_chunks=CPU_CHUNKS)
    before = worker.stats()
    job: object = 7 if bad.job == "fresh" else bad.job
    with pytest.raises(kv.InvalidTransferError):
        src, dst = bad.build()
        (worker.submit_store if bad.direction == "store" else worker.submit_load)(job, src, dst)  # type: ignore[arg-type]
    assert worker.stats() == before
    assert eval(repr(bad), vars(kv) | {"InvalidTransfer": type(bad)}) == bad
    src_text, dst_text = bad.specs_text()
    with pytest.raises(kv.InvalidTransferError):
        namespace = vars(kv) | {"w": worker}
        exec(f"w.submit_{bad.direction}({job!r}, {src_text}, {dst_text})", namespace)
    worker.shutdown()


@given(faults(range(1, 5)))
def test_testing_strategies_faults_are_well_formed(fault: kv.Fault) -> None:
    assert fault.kind == "error" or fault.point in HANG_POINTS
    assert fault.job_id in (None, 1, 2, 3, 4)
    assert eval(repr(fault), vars(kv)) == fault


@given(fault_plans(range(1, 4)), policies())
def test_testing_strategies_plans_and_policies(plan: tuple[kv.Fault, ...], policy: kv.ShutdownPolicy) -> None:
    assert len(plan) <= 3 and all(isinstance(f, kv.Fault) for f in plan)
    assert policy.on_unproven in ("quarantine", "release") and policy.timeout >= 0


@pytest.mark.rule("R5")
@given(completion_faults(range(1, 5)), completion_faults())
def test_testing_strategies_completion_faults_fail_a_transfer(aimed: kv.Fault, anywhere: kv.Fault) -> None:
    for fault in (aimed, anywhere):
        assert fault.point in COMPLETION_POINTS and fault.kind == "error" and not fault.sticky
        assert eval(repr(fault), vars(kv)) == fault
    assert aimed.job_id in (1, 2, 3, 4) and aimed.direction is None
    assert anywhere.job_id is None


@pytest.mark.rule("R5")
def test_testing_strategies_plans_often_fail_a_transfer_and_keep_every_other_fault() -> None:
    """Half the plans or more arm an error at a transfer's completion (what a worker reporting failures as
    successes gets wrong); the others still bring hangs, submission faults, device_sync, the release steps'
    errors (host_unregister, destroy, free, unmap) and sticky errors, and some plans are empty."""
    plans: list[tuple[kv.Fault, ...]] = []

    @settings(max_examples=400, database=None, derandomize=True)
    @given(fault_plans(range(1, 7)))
    def look(plan: tuple[kv.Fault, ...]) -> None:
        plans.append(plan)

    look()
    drawn = [f for plan in plans for f in plan]
    failing = sum(any(f.point in COMPLETION_POINTS and f.kind == "error" for f in plan) for plan in plans)
    assert failing >= len(plans) // 2, (failing, len(plans))
    assert any(not plan for plan in plans)
    assert any(f.kind == "hang" for f in drawn) and any(f.sticky for f in drawn)
    assert {"device_sync", "host_unregister", *RELEASE_POINTS} <= {f.point for f in drawn}
    assert any(f.point in SUBMIT_POINTS and f.kind == "error" for f in drawn)


@pytest.mark.rule("R7")
@given(setups())
def test_testing_strategies_setups_build_and_refuse_wrong_tensors(setup: Setup) -> None:
    namespace = vars(kv) | {"Setup": Setup}
    assert eval(repr(setup), namespace) == setup
    dev = SimDevice(setup)
    for t, gpu in enumerate(dev.gpu):
        info = dev.backend.array_info(gpu)
        assert info.row_bytes == setup.layout.tensor_page_bytes[t]
        assert info.row_stride == info.row_bytes + setup.gpu_row_pad[t]
    wrong = [dev.backend.empty_device((setup.num_gpu_blocks, p + 1)) for p in setup.layout.tensor_page_bytes]
    with pytest.raises(kv.InvalidTransferError):
        kv.create_worker(dev.backend, wrong, setup.layout, blocks_per_chunk=setup.blocks_per_chunk,
                         num_cpu_chunks=setup.num_cpu_chunks)
    assert dev.ledger.live() == {}


def test_testing_strategies_layouts_pad_and_share_tensors() -> None:
    padded, shared = [], []

    @given(layouts())
    def look(layout: kv.KVCacheLayout) -> None:
        refs = [r for g in layout.groups for r in g]
        padded.append(any(r.page_size_bytes < layout.tensor_page_bytes[r.tensor_idx] for r in refs))
        shared.append(_shared_tensor(layout))
        for group in layout.groups:
            assert len({r.tensor_idx for r in group}) == len(group)

    look()
    assert any(padded) and any(shared)


def test_testing_strategies_specs_skip_at_both_ends_and_leave_groups_empty() -> None:
    layout = kv.KVCacheLayout((8, 8), ((kv.LayerRef(0, 8),), (kv.LayerRef(1, 8),)))
    kinds: set[str] = set()

    @given(transfer_specs(layout, 3, GPU_BLOCKS, CPU_CHUNKS))
    def look(specs: tuple[kv.GPULoadStoreSpec, kv.CPULoadStoreSpec]) -> None:
        gpu, _ = specs
        for n, skip in zip(gpu.group_sizes, gpu.block_indices, strict=True):
            kinds.add("empty" if n == 0 else "head" if skip else "aligned")
            if n and (n + skip) % 3:
                kinds.add("tail")
        assert len(set(gpu.block_ids.tolist())) == len(gpu.block_ids)

    look()
    assert kinds == {"empty", "head", "aligned", "tail"}
    assert np.array_equal(kv.CPULoadStoreSpec([1]).block_ids, [1])


def test_testing_strategies_are_built_once_per_arguments_and_draw_the_same() -> None:
    """The strategies a fuzz step draws from are built once per set of arguments (a new strategy is validated
    before its first draw, which cost more than the draw): equal arguments give the same object, and a cached
    strategy draws what a freshly built one draws."""
    from kvoffload_ref.testing.strategies import invalid_for, specs_for

    assert fault_plans(range(1, 7)) is fault_plans((1, 2, 3, 4, 5, 6))
    assert policies() is policies(on_unproven=["quarantine", "release"])
    assert policies(timeouts=(0, 1)) is not policies(timeouts=(0.0, 1.0))  # equal keys, but ints draw ints
    assert faults([1, 2]) is faults((1, 2)) and completion_faults([3]) is completion_faults((3,))
    layout = kv.KVCacheLayout(tensor_page_bytes=(16, 8), groups=((kv.LayerRef(0, 16),), (kv.LayerRef(1, 4),)))
    assert specs_for(layout, 2, 8, 4) is specs_for(layout, 2, 8, 4)
    assert invalid_for(layout, 2, 8, 4, INVALID_CASES) is invalid_for(layout, 2, 8, 4, tuple(INVALID_CASES))

    def draws(strategy: st.SearchStrategy[object]) -> list[str]:
        seen: list[str] = []

        @settings(max_examples=30, derandomize=True, database=None)
        @given(strategy)
        def collect(value: object) -> None:
            seen.append(repr(value))

        collect()
        return seen

    assert draws(specs_for(layout, 2, 8, 4)) == draws(transfer_specs(layout, 2, 8, 4))
    assert draws(setups()) == draws(setups())


def _int64_drained_ids(backend: Any, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """The engine as it was: its shutdown drain kept the ids it proved in an int64 array (``array("q")``)."""
    worker = reference_factory(backend, gpu, setup)
    assert isinstance(worker, CPUOffloadingWorker)
    for handler in (worker._core.store, worker._core.load):
        handler._drained_ids = array.array("q")
    return worker


@pytest.mark.rule("R7")
@given(first_job_ids())
def test_testing_strategies_first_job_ids_are_ints_small_and_at_the_int64_edges(first: int) -> None:
    assert type(first) is int and first in JOB_ID_STARTS and JOB_ID_STARTS[0] == 1  # shrinks to id 1
    run = range(first, first + 4)  # the ids of a run's first four jobs: small, or across an int64 edge
    assert first == 1 or any(j in run and j - 1 in run for j in (2**63, -2**63)), first
    assert {2**63 - 2, -2**63 - 2} <= set(JOB_ID_STARTS)  # both edges, and negative ids, are reached


@pytest.mark.rule("R7")
@pytest.mark.rule("R22")
def test_testing_strategies_job_ids_catch_a_worker_that_packs_ids_into_int64() -> None:
    """The machine's ids reach the int64 edges: a worker whose drain packs ids into int64 (the engine's own bug,
    once) fails R7's "any int" contract there, and the machine says so within the CI budget."""
    machine = make_machine(_int64_drained_ids, name="Mutant_int64_job_ids")
    with quiet_logs(), pytest.raises(ConformanceError) as info:
        run_state_machine_as_test(machine, settings=catch_budget())
    print(f"caught after {machine.counters.steps} steps: {info.value}")
