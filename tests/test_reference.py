"""The reference worker (kvoffload_ref/reference.py) held to the conformance kit: the machine (both policies,
every optional behaviour), the call-point explorer (every configuration), and a deliberately wrong reference
that the kit must catch."""

from __future__ import annotations

import gc
import io
import os
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import settings
from test_testing_machine import stateful_settings

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.testing import make_machine, mutants, policies, setups
from kvoffload_ref.testing.adapter import Setup, WorkerLike, reference_worker_factory
from kvoffload_ref.testing.campaign import quiet_logs, run_campaign
from kvoffload_ref.testing.explorer import CONFIGS, METHODS, explore

FACTORY = "kvoffload_ref.testing.adapter:reference_worker_factory"


def reference_settings() -> settings:
    """The engine's machine settings (tests/test_testing_machine.py) at a quarter of its examples (100 per policy
    under the ``ci`` profile, up to 5,000 steps each): the reference shares the kit with the engine, not its budget."""
    current = stateful_settings()
    return settings(current, max_examples=max(10, current.max_examples // 4))


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


ReferenceQuarantine = make_machine(reference_worker_factory, name="ReferenceQuarantine",
                                   setup_strategy=setups(policy=policies(on_unproven=("quarantine",))),
                                   settings=reference_settings())
ReferenceRelease = make_machine(reference_worker_factory, name="ReferenceRelease",
                                setup_strategy=setups(policy=policies(on_unproven=("release",))),
                                settings=reference_settings())


@pytest.mark.rule("R4")
@pytest.mark.rule("R5")
@pytest.mark.rule("R6")
@pytest.mark.rule("R7")
@pytest.mark.rule("R8")
@pytest.mark.rule("R9")
@pytest.mark.rule("R10")
@pytest.mark.rule("R11")
@pytest.mark.rule("R12")
@pytest.mark.rule("R13")
@pytest.mark.rule("R14")
@pytest.mark.rule("R15")
@pytest.mark.rule("R16")
@pytest.mark.rule("R19")
class TestReferenceWorkerQuarantine(ReferenceQuarantine.TestCase):
    """The machine on the reference worker under the "quarantine" policy."""


@pytest.mark.rule("R2")
@pytest.mark.rule("R12")
@pytest.mark.rule("R14")
@pytest.mark.rule("R16")
class TestReferenceWorkerRelease(ReferenceRelease.TestCase):
    """The machine on the reference worker under the "release" policy (vLLM #51622)."""


@pytest.mark.rule("R5")
@pytest.mark.rule("R8")
@pytest.mark.rule("R12")
@pytest.mark.rule("R14")
@pytest.mark.rule("R16")
@pytest.mark.rule("R19")
@pytest.mark.rule("R21")
@pytest.mark.parametrize("config", list(CONFIGS))
def test_reference_explorer_every_call_point_breaks_no_rule(config: str) -> None:
    """The call-point explorer on the reference: every backend call of every public method, interrupted every
    way, in each configuration."""
    result = explore(reference_worker_factory, configs=[config], name=FACTORY)
    assert all(result.points[(m, config)] > 0 for m in METHODS)  # every method reaches the device
    assert not result.failures, "\n".join(map(str, result.failures[:10]))


def _swallowing_reference(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """A deliberately wrong reference: the kit's ``interrupts_swallowed`` mutant applied to it."""
    return mutants._Swallower(reference_worker_factory(backend, gpu, setup))


def _success_only_reference(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """A deliberately wrong reference: the kit's ``failures_reported_as_success`` mutant applied to it."""
    return mutants._SuccessOnly(reference_worker_factory(backend, gpu, setup))


@pytest.mark.rule("R14")
def test_reference_with_a_swallowed_interrupt_is_caught_by_the_explorer() -> None:
    result = explore(_swallowing_reference, configs=["clean"], methods=["submit_store"],
                     injections=["KeyboardInterrupt"], name="tests.test_reference:_swallowing_reference")
    assert result.failures and all(f.rules.startswith("R14") for f in result.failures)


@pytest.mark.rule("R5")
def test_reference_reporting_failures_as_success_is_caught_by_the_machine() -> None:
    out = io.StringIO()
    assert run_campaign(2_000, 1, None, out, factory=_success_only_reference, shrink_seconds=5.0) == 1
    assert "R5" in out.getvalue()


@pytest.mark.rule("R21")
def test_reference_inherited_worker_is_inert_in_a_forked_child() -> None:
    """Every public call of an inherited reference worker refuses in a child, naming the parent; its finalizer and
    shutdown touch nothing of the parent's; the parent is unaffected."""
    from test_fork import _in_child, _outcome

    from kvoffload_ref.testing.adapter import SimDevice
    from kvoffload_ref.testing.explorer import CONFIGS as SETUPS

    setup = SETUPS["clean"]
    device = SimDevice(setup)
    worker = reference_worker_factory(device.backend, device.gpu, setup)
    parent = os.getpid()

    def child() -> list[str]:
        calls = [worker.get_finished, lambda: worker.wait([1], 0.0), worker.cpu_snapshot, worker.stats,
                 worker.shutdown]
        outcomes = [_outcome(call, parent) for call in calls]
        live = dict(device.ledger.live())
        del calls
        gc.collect()
        return [*outcomes, str(dict(device.ledger.live()) == live)]

    found, _ = _in_child(child)
    assert found == ["closed"] * 5 + ["True"]
    assert worker.shutdown().region == "released"
    assert device.ledger.live() == {}
