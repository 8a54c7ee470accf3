"""docs/failure-modes.md is what running the scenarios produces now."""

from __future__ import annotations

import pathlib

import pytest

from kvoffload_ref.docgen import failure_modes

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.rule("R12")
def test_failure_modes_committed_table_matches_a_fresh_run() -> None:
    assert failure_modes.check(ROOT), "run: kvoffload-ref failure-modes --write"


@pytest.mark.rule("R12")
def test_failure_modes_hung_transfer_quarantines_and_release_policy_shows_the_hazard() -> None:
    (row,) = [r for r in failure_modes.ROWS if r.fault.startswith("event never completes")]
    quarantine = failure_modes.run_scenario(row, "quarantine")
    release = failure_modes.run_scenario(row, "release")
    assert "region **quarantined**" in quarantine and quarantine.endswith("; 0 use-after-free")
    assert "region **released**" in release and not release.endswith("; 0 use-after-free")
