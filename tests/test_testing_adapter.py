"""The kit checks another implementation plugged in through a worker factory: the worked adapter.

The implementation is the normative reference worker (``kvoffload_ref/reference.py``): written against the Backend
protocol from the lifecycle tables, the placement rule, the shield and the region, with no pools and no batching.
``my_factory`` below is the whole adapter, as docs/conformance.md shows it (the kit's own
``reference_worker_factory`` is the same, plus a shared region when the setup asks for one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.reference import ReferenceWorker, create_reference_worker
from kvoffload_ref.results import ShutdownPolicy
from kvoffload_ref.specs import KVCacheLayout, LayerRef
from kvoffload_ref.testing import Setup, adapter, make_machine
from kvoffload_ref.testing.campaign import quiet_logs
from kvoffload_ref.testing.strategies import setups


def my_factory(backend: Backend, gpu: Sequence[object], setup: Setup) -> ReferenceWorker:
    """The adapter: how the kit builds the implementation under test."""
    return create_reference_worker(backend, gpu, setup.layout, blocks_per_chunk=setup.blocks_per_chunk,
                                   num_cpu_chunks=setup.num_cpu_chunks, policy=setup.policy,
                                   pin_chunk_bytes=setup.pin_chunk_bytes)


def small() -> KVCacheLayout:
    return KVCacheLayout(tensor_page_bytes=(256,), groups=((LayerRef(0, 256),),))


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


@pytest.mark.rule("R4")
@pytest.mark.rule("R5")
@pytest.mark.rule("R6")
@pytest.mark.rule("R8")
@pytest.mark.rule("R11")
@pytest.mark.rule("R12")
@pytest.mark.rule("R16")
def test_testing_adapter_worked_adapter_conforms() -> None:
    machine = make_machine(my_factory, name="WorkedAdapterMachine")
    budget = settings(settings(), stateful_step_count=50, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    run_state_machine_as_test(machine, settings=budget)
    print(f"\nworked adapter: {machine.counters.line()}")
    assert machine.counters.succeeded and machine.counters.shutdowns and machine.counters.violations == 0


@pytest.mark.rule("R3")
@pytest.mark.rule("R12")
@pytest.mark.rule("R16")
@pytest.mark.parametrize("factory", ["reference_factory", "reference_worker_factory"])
def test_testing_adapter_machine_on_a_platform_that_refuses_registration(factory: str) -> None:
    """The machine's checks hold for both workers where host registration is refused (``setup.refuse_registration``:
    the region is a pinned allocation, ``pinning="auto"``'s fallback; no shared region there, it cannot be one)."""
    refusing = setups().map(lambda s: dataclasses.replace(s, refuse_registration=True))
    machine = make_machine(getattr(adapter, factory), name=f"Refusing{factory}", setup_strategy=refusing)
    budget = settings(settings(), stateful_step_count=30, max_examples=40, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    run_state_machine_as_test(machine, settings=budget)
    assert machine.counters.workers and machine.counters.shutdowns and machine.counters.violations == 0


def test_testing_adapter_refusing_setup_builds_allocated_regions() -> None:
    setup = Setup(layout=small(), blocks_per_chunk=2, num_gpu_blocks=8, num_cpu_chunks=4, gpu_row_pad=(0,),
                  policy=ShutdownPolicy(timeout=0.01), refuse_registration=True)
    for factory in (adapter.reference_factory, adapter.reference_worker_factory):
        device = adapter.SimDevice(setup)
        worker = factory(device.backend, device.gpu, setup)
        assert worker.stats().pinning == "allocated" and device.sim.refuses_registration
        assert worker.shutdown().region == "released" and device.sim.ledger.live() == {}
