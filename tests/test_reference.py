"""The reference worker (kvoffload_ref/reference.py) held to the conformance machine: both policies, every optional
behaviour, built as the engine's machines are (tests/test_testing_machine.py) at a quarter of their examples.

Everything else the kit checks runs on both workers from the engine's tests, parametrized over them: the
call-point explorer and its swallowed-interrupt mutant (tests/test_testing_explorer.py), the campaign's
failures-reported-as-success mutant (tests/test_testing_campaign.py), the inherited worker in a forked child
(tests/test_fork.py); tests/test_reference_differential.py holds the two workers to each other.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_testing_machine import policy_machine, reference_settings

from kvoffload_ref.testing.adapter import reference_worker_factory
from kvoffload_ref.testing.campaign import quiet_logs


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


ReferenceQuarantine = policy_machine("ReferenceQuarantine", "quarantine", reference_worker_factory,
                                     reference_settings())
ReferenceRelease = policy_machine("ReferenceRelease", "release", reference_worker_factory, reference_settings())


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
