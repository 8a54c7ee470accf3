"""Shared pytest configuration: Hypothesis profiles and the GPU skip."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=5000, deadline=None,
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
