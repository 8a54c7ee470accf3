"""The runnable examples under docs/examples run on the simulated device (R23, R22, R20)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "docs" / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.rule("R23")
@pytest.mark.rule("R20")
def test_examples_layerwise_prefetch_hides_loads_under_compute_without_races(
        capsys: pytest.CaptureFixture[str]) -> None:
    example = _load("layerwise_prefetch")
    backend, gpu = example.sim_device()
    figures = example.run_step(backend, gpu)
    assert figures.violations == () and figures.poisoned == ()
    assert 0 < figures.step < figures.loads + figures.stores + figures.compute  # overlap, on the virtual clock
    assert figures.hidden > 0.5
    assert example.main([]) == 0
    assert "0 violation(s)" in capsys.readouterr().out


@pytest.mark.rule("R23")
@pytest.mark.rule("R20")
def test_examples_layerwise_prefetch_without_order_after_is_flagged_by_the_race_detector() -> None:
    example = _load("layerwise_prefetch")
    backend, gpu = example.sim_device()
    figures = example.run_step(backend, gpu, order=False)
    assert figures.violations and all(line.startswith("dma_race") for line in figures.violations)
    assert example.main(["--no-order"]) == 0  # the racy version exits 0 when the detector caught it
