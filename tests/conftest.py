"""Shared pytest configuration: Hypothesis profiles (the conformance kit's settings), the GPU skip and the lock
check (on in every test, no violation left behind)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

from kvoffload_ref import lockcheck
from kvoffload_ref.testing import settings_for_ci, settings_for_dev, settings_for_fuzz, settings_for_hypofuzz

# The kit's settings (no explain phase, bounded shrinking), under the names HYPOTHESIS_PROFILE selects.
# Stateful tests (tests/test_testing_machine.py) run 4x max_examples examples of stateful_step_count steps each:
# "ci" gives the conformance machine >= 20,000 steps (checked by test_testing_machine_ci_budget_of_stateful_steps).
settings.register_profile("dev", settings_for_dev())
settings.register_profile("ci", settings_for_ci())
settings.register_profile("fuzz", settings_for_fuzz())
# HypoFuzz (docs/conformance.md): the fuzz profile with an example database ($KVOFFLOAD_REF_EXAMPLE_DATABASE, else
# .hypothesis/examples), which `hypothesis fuzz` needs; `HYPOTHESIS_PROFILE=hypofuzz hypothesis fuzz -- tests/...`.
settings.register_profile("hypofuzz", settings_for_hypofuzz())
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _gpu_usable() -> bool:
    """The CuPy backend's own probe; False when the backend (or CuPy) cannot be imported."""
    try:
        from kvoffload_ref.backends.cupy import gpu_usable
    except ImportError:
        return False
    usable, _reason = gpu_usable()
    return usable


GPU_USABLE = _gpu_usable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU_USABLE:
        return
    skip = pytest.mark.skip(reason="needs CuPy and a usable CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_lock_check_violation() -> Iterator[None]:
    """R19: the lock check is on in every test (importing the kit switched it on), and no test may leave a
    violation behind -- not even one the code under test swallowed (a release step's error list, a finalizer's log).
    A test that plants one takes it with ``lockcheck.take_violations()``."""
    assert lockcheck.enabled()
    assert lockcheck.take_violations() == [], "left behind by a thread of an earlier test"
    yield
    left = lockcheck.take_violations()
    assert not left, f"{len(left)} lock-check violation(s) (R19), the first: {left[0]}"
