"""The explorer's checks (kvoffload_ref.testing.explorer_checks) each bite on their own: its R12 check (the region
released although the proof did not succeed) and its under-DMA hazard check (the device saw a release under a
pending copy) back each other up on most wrong workers; here each has a wrong worker only it can catch."""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from _support import FACTORIES, WORKERS

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.faults import Fault, FaultPlan
from kvoffload_ref.lifecycle import Fate, ProofOutcome
from kvoffload_ref.testing.adapter import Setup, WorkerLike
from kvoffload_ref.testing.explorer import Case, run_case

#: The tag each check gives what it finds (explorer_checks._report's R12 check, _violations' hazard check).
R12_CHECK, HAZARD_CHECK = "R12", "R3/R12/R20"


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def _released_after_a_proof_timeout(make: Any) -> Any:
    """A worker whose device-level proof times out -- a ``device_sync`` hang is armed on the device, though nothing
    is under DMA -- and that releases the region anyway (vLLM #51622's best effort under the quarantine policy).
    The device sees no hazard: nothing was pending. Only the R12 check can tell."""
    def factory(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
        plan = backend.faults  # type: ignore[attr-defined]  # the kit's SimBackend
        assert isinstance(plan, FaultPlan)
        plan.add(Fault("device_sync", "hang"))
        worker = make(backend, gpu, setup)
        core = worker._core
        release = core._release

        def release_anyway(run: Any, shield: Any) -> None:
            proof = run.proof
            if proof is ProofOutcome.TIMEOUT:
                run.proof = ProofOutcome.OK  # decide as if proven ...
            release(run, shield)
            run.proof = proof               # ... and report what the proof said
        core._release = release_anyway
        return worker  # type: ignore[no-any-return]
    return factory


def _descriptors_freed_while_quarantined(make: Any) -> Any:
    """A worker that frees an unproven transfer's descriptor buffers (a hung copy still reads them) while it
    quarantines the region and says so: the R12 check sees a correct report; only the hazard check can tell."""
    def factory(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
        worker = make(backend, gpu, setup)
        for handler in (worker._core.store, worker._core.load):
            def release(self: Any, fate: Fate, shield: Any = None, *, reason: str = "") -> tuple[int, int, list[str]]:
                return type(self).release(self, Fate.RELEASE, shield, reason=reason)  # type: ignore[no-any-return]
            handler.release = types.MethodType(release, handler)
        return worker  # type: ignore[no-any-return]
    return factory


#: An interrupted get_finished(), then the explorer's own shutdown, whose report the checks read.
FAILED = Case("failed", "get_finished", 0, "KeyboardInterrupt")
HUNG = Case("hung", "get_finished", 0, "KeyboardInterrupt")


@pytest.mark.rule("R12")
@pytest.mark.parametrize("worker", WORKERS)
def test_explorer_checks_r12_alone_catches_a_release_after_a_proof_timeout(worker: str) -> None:
    make, _ = FACTORIES[worker]
    assert not run_case(FAILED, make), "the right worker passes the case"
    found = run_case(FAILED, _released_after_a_proof_timeout(make))
    assert found and {f.rules for f in found} == {R12_CHECK}, [str(f) for f in found]
    assert "released with device_sync='timeout'" in found[0].message


@pytest.mark.rule("R10")
@pytest.mark.rule("R12")
@pytest.mark.parametrize("worker", WORKERS)
def test_explorer_checks_hazard_check_alone_catches_descriptors_freed_under_dma(worker: str) -> None:
    make, _ = FACTORIES[worker]
    assert not run_case(HUNG, make), "the right worker passes the case"
    found = run_case(HUNG, _descriptors_freed_while_quarantined(make))
    assert found and {f.rules for f in found} == {HAZARD_CHECK}, [str(f) for f in found]
    assert all("descriptor_freed_under_dma" in f.message for f in found)
