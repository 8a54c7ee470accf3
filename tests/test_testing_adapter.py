"""The kit checks another implementation plugged in through a worker factory: the worked adapter.

The implementation is the normative reference worker (``kvoffload_ref/reference.py``): written against the Backend
protocol from the lifecycle tables, the placement rule, the shield and the region, with no pools and no batching.
``my_factory`` below is the whole adapter, as docs/conformance.md shows it (the kit's own
``reference_worker_factory`` is the same, plus a shared region when the setup asks for one).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.reference import ReferenceWorker, create_reference_worker
from kvoffload_ref.testing import Setup, make_machine
from kvoffload_ref.testing.campaign import quiet_logs


def my_factory(backend: Backend, gpu: Sequence[object], setup: Setup) -> ReferenceWorker:
    """The adapter: how the kit builds the implementation under test."""
    return create_reference_worker(backend, gpu, setup.layout, blocks_per_chunk=setup.blocks_per_chunk,
                                   num_cpu_chunks=setup.num_cpu_chunks, policy=setup.policy,
                                   pin_chunk_bytes=setup.pin_chunk_bytes)


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
