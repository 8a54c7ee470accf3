"""Shared pytest configuration: Hypothesis profiles (the conformance kit's settings) and the GPU skip."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

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
