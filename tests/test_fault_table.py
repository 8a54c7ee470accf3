"""kvoffload_ref.docgen.fault_table: docs/simulator.md's fault table is what the workers do now, and a few of its
claims checked directly on both workers (a refused submission says so; only event_query gives a failed result;
event_sync never fires under wait())."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from _support import CREATE, WORKERS, cspec, gspec, patterned_gpu, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends.base import CALL_POINTS, CONSULTED
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.docgen import fault_table
from kvoffload_ref.fault_plan import POINTS

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cells() -> list[fault_table.Cell]:
    return fault_table.measure()


@pytest.mark.rule("R5")
def test_fault_table_in_docs_is_current(cells: list[fault_table.Cell]) -> None:
    text = (ROOT / "docs" / "simulator.md").read_text()
    begin, end = text.index(fault_table.BEGIN), text.index(fault_table.END) + len(fault_table.END)
    assert text[begin:end] == fault_table.render(cells), (
        "docs/simulator.md's fault table is out of date: python -m kvoffload_ref.docgen.fault_table --write")


def _cell(cells: list[fault_table.Cell], point: str, kind: str, call: str, worker: str) -> str | None:
    return next((c.outcome for c in cells if (c.point, c.kind, c.call, c.worker) == (point, kind, call, worker)),
                None)


@pytest.mark.rule("R5")
@pytest.mark.parametrize("worker", WORKERS)
def test_fault_table_rows_agree_with_the_rules(cells: list[fault_table.Cell], worker: str) -> None:
    """The rows the doc's summary names: copy refuses the submission, event_query fails the result wherever it is
    polled, event_sync fires nowhere, a hang makes wait time out and shutdown quarantine."""
    for call in ("submit_store", "submit_load"):
        assert "was refused: nothing was queued" in str(_cell(cells, "copy", "error", call, worker))
    assert _cell(cells, "event_query", "error", "get_finished", worker) == "job 1 failed"
    assert "failed" in str(_cell(cells, "event_query", "error", "wait", worker))
    assert not [c for c in cells if (c.point, c.kind, c.worker) == ("event_sync", "error", worker)]
    assert "DeadlineExceeded" in str(_cell(cells, "copy", "hang", "wait", worker))
    assert "quarantined" in str(_cell(cells, "copy", "hang", "shutdown", worker))
    assert "succeeded" in str(_cell(cells, "copy", "slow", "wait", worker))


@pytest.mark.rule("R5")
@pytest.mark.parametrize("worker", WORKERS)
def test_fault_table_a_copy_error_refuses_the_job_and_says_so(worker: str) -> None:
    be = SimBackend(faults=kv.FaultPlan([kv.Fault("copy", "error", nth=1)]))
    layout = small_layout()
    with CREATE[worker](be, patterned_gpu(be, layout), layout, blocks_per_chunk=3, num_cpu_chunks=16) as w:
        with pytest.raises(kv.DeviceError, match=r"^store job 7 was refused: nothing was queued") as info:
            w.submit_store(7, gspec([1, 2, 3]), cspec([0]))
        assert info.value.status == kv.Fault("copy", "error").status and "injected copy failure" in str(info.value)
        assert w.get_finished() == []  # no result will come for it
        w.submit_store(7, gspec([1, 2, 3]), cspec([0]))  # the id stays free
        w.wait({7}, timeout=1.0)
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(7, True)]
    be = SimBackend(faults=kv.FaultPlan([kv.Fault("copy", "error", nth=1)]))
    with CREATE[worker](be, patterned_gpu(be, layout), layout, blocks_per_chunk=3, num_cpu_chunks=16) as w:
        with pytest.raises(kv.DeviceError, match=r"^load job 8 was refused: nothing was queued"):  # either way
            w.submit_load(8, cspec([0]), gspec([1, 2, 3]))
        assert w.get_finished() == []


@pytest.mark.rule("R6")
@pytest.mark.parametrize("worker", WORKERS)
def test_fault_table_event_sync_never_fires_under_wait(worker: str) -> None:
    """wait() polls with query: an event_sync error armed for every call never fires, the job is proven."""
    plan = kv.FaultPlan([kv.Fault("event_sync", "error")])
    be = SimBackend(faults=plan)
    layout = small_layout()
    calls: list[Any] = []
    be.on_call = lambda point, tag: calls.append(point)
    with CREATE[worker](be, patterned_gpu(be, layout), layout, blocks_per_chunk=3, num_cpu_chunks=16) as w:
        w.submit_store(1, gspec([1, 2, 3]), cspec([0]))
        w.wait({1}, timeout=1.0)
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    assert plan.fired == [] and "event_sync" not in calls and "event_query" in calls


def test_fault_table_consulted_points_name_real_points_and_cover_every_fault_point() -> None:
    """``backends.base.CONSULTED`` (which fault point each on_call point consults, what the table reads) maps
    reported points to fault points only, and every fault point is consulted by some call."""
    assert set(CONSULTED) <= set(CALL_POINTS.values())
    assert set(CONSULTED.values()) == set(POINTS)
