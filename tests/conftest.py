"""Shared pytest configuration: Hypothesis profiles and the GPU skip."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# Stateful tests (tests/test_testing_machine.py) run 4x max_examples examples of stateful_step_count steps each:
# "ci" gives the conformance machine >= 20,000 steps (checked by test_testing_machine_ci_budget_of_stateful_steps).
settings.register_profile("dev", max_examples=50, stateful_step_count=50, deadline=None)
settings.register_profile("ci", max_examples=100, stateful_step_count=50, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=5000, stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _gpu_usable() -> bool:
    try:
        import cupy
    except Exception:
        return False
    try:
        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


GPU_USABLE = _gpu_usable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU_USABLE:
        return
    skip = pytest.mark.skip(reason="needs CuPy and a usable CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
