"""The runnable examples under docs/examples run on the simulated device (R23, R22, R20; R26-R28)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

import pytest
from _support import CREATE

import kvoffload_ref as kv

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


@pytest.mark.rule("R26")
@pytest.mark.rule("R27")
@pytest.mark.rule("R28")
@pytest.mark.parametrize("kind", list(CREATE))
def test_examples_running_engine_survives_a_hung_load_on_a_fresh_stream(kind: str) -> None:
    example = _load("running_engine")
    one = example.hung_load(CREATE[kind])
    steps = {(what, job): step for step, what, _, job, _ in one.events}
    # R26: the deadline (4.5 ms) counts from the poll that first saw job 11 start (step 1): it expires at step 6
    assert steps[("deadline", 11)] == 6 and steps[("behind", 12)] == 6
    # R28: the retry of the job behind it and a new request load while job 11's copy still hangs
    assert (steps[("loaded", 13)], steps[("loaded", 14)]) == (7, 8)
    assert one.correct and one.violations == ()
    # R27: the hung load's and the behind load's GPU blocks held for any access, their CPU chunks against writes
    assert one.held == kv.HeldBlocks(tuple(range(20, 28)), tuple(range(4, 12)), (), tuple(range(4, 12)))
    assert "would write GPU blocks [20, 21, 22, 23]" in one.refused
    assert one.report.region == "quarantined" and one.report.load.retired_streams == 1
    assert one.events == example.HUNG_EVENTS


@pytest.mark.rule("R26")
@pytest.mark.rule("R27")
@pytest.mark.parametrize("kind", list(CREATE))
def test_examples_running_engine_reuses_a_late_copys_blocks_once_it_lands(kind: str) -> None:
    example = _load("running_engine")
    two = example.slow_copy(CREATE[kind])
    blocks = (16, 17, 18, 19)
    # the load expires at step 3 (1.5 ms after step 1's poll saw it start), its 4.1 ms copy lands before step 5
    assert [(step, what, job) for step, what, _, job, b in two.events if b == blocks] == [
        (0, "queued", 10), (3, "deadline", 10), (5, "released", 10), (5, "queued", 11), (10, "loaded", 11)]
    assert two.held == kv.HeldBlocks(blocks, (0, 1, 2, 3), (), (0, 1, 2, 3))
    assert two.correct and two.violations == ()  # request b's bytes, in the blocks job 10's late copy wrote
    assert two.report.region == "released"
    assert two.events == example.SLOW_EVENTS


@pytest.mark.rule("R27")
@pytest.mark.rule("R20")
def test_examples_running_engine_recomputing_into_held_blocks_is_flagged_by_the_race_detector() -> None:
    example = _load("running_engine")
    wrong = example.slow_copy(kv.create_worker, in_place=True)
    # the late copy of job 10 lands after the recompute wrote its blocks: the request's KV is the late copy's
    assert not wrong.correct
    assert wrong.violations and all(v.startswith("dma_race") and "load job 10" in v for v in wrong.violations)
    assert example.main(["--in-place"]) == 0  # exits 0 when the race detector caught it


@pytest.mark.rule("R26")
@pytest.mark.rule("R27")
def test_examples_running_engine_prints_what_it_checks(capsys: pytest.CaptureFixture[str]) -> None:
    example = _load("running_engine")
    assert example.main([]) == 0
    out = capsys.readouterr().out
    assert "b (job 11) failed (deadline): GPU [20, 21, 22, 23] parked" in out
    assert "a (job 10) hold released (its late copy landed): GPU [16, 17, 18, 19] free again" in out
    assert "shutdown: region quarantined" in out and "shutdown: region released" in out
    doc = (EXAMPLES.parent / "results-and-ordering.md").read_text()
    shown = doc.split("$ python docs/examples/running_engine.py\n")
    assert len(shown) == 2 and shown[1].startswith(out), "docs/results-and-ordering.md shows another output"
    assert example.main(["--reference"]) == 0
    assert capsys.readouterr().out == out  # the normative reference worker does the same, step for step
