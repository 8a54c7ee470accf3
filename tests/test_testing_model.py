"""The kit's pure model: what it predicts (and refuses to predict) for races, failures and hangs."""

from __future__ import annotations

import numpy as np
import pytest

import kvoffload_ref as kv
from kvoffload_ref.testing import Model

PAGE, BPC = 8, 2


def _model() -> Model:
    layout = kv.KVCacheLayout((PAGE,), ((kv.LayerRef(0, PAGE),),))
    gpu = np.arange(6 * PAGE, dtype=np.uint8).reshape(6, PAGE)
    cpu = np.zeros((3, PAGE * BPC), np.uint8)
    return Model(layout, BPC, 6, 3, [gpu], [cpu])


def _g(*ids: int, skip: int = 0) -> kv.GPULoadStoreSpec:
    return kv.GPULoadStoreSpec(list(ids), group_sizes=(len(ids),), block_indices=(skip,))


def _c(*ids: int) -> kv.CPULoadStoreSpec:
    return kv.CPULoadStoreSpec(list(ids))


@pytest.mark.rule("R4")
def test_testing_model_round_trip_settles_what_was_stored() -> None:
    m = _model()
    store = m.submit("store", 1, _g(2, 3, skip=1), _c(1, 0), hung=False)
    cpu = m.sides["cpu"]
    assert not cpu.settled(0)[1, PAGE:].any(), "a pending store's bytes are not settled"
    m.resolve(store, True)
    assert cpu.settled(0)[1, PAGE:].all() and (cpu.value[0][1, PAGE:] == np.arange(16, 24)).all()
    assert (cpu.value[0][0, :PAGE] == np.arange(24, 32)).all()
    load = m.submit("load", 2, _g(5, 4, skip=1), _c(1, 0), hung=False)
    m.resolve(load, True)
    gpu = m.sides["gpu"]
    assert gpu.settled(0)[[4, 5]].all() and (gpu.value[0][5] == np.arange(16, 24)).all()


@pytest.mark.rule("R4")
def test_testing_model_unordered_store_and_load_make_bytes_unknown() -> None:
    m = _model()
    m.submit("store", 1, _g(0), _c(2), hung=False)
    load = m.submit("load", 2, _g(5), _c(2), hung=False)  # reads the chunk the pending store writes
    assert not load.certain[0].any()
    m.resolve(load, True)
    assert not m.sides["gpu"].settled(0)[5].any()
    later = m.submit("load", 3, _g(4), _c(1), hung=False)
    m.submit("store", 4, _g(1, 2), _c(1), hung=False)  # writes the chunk the pending load still reads
    assert not later.certain[0].any() and not m.sides["gpu"].known[0][4].any()


@pytest.mark.rule("R4")
def test_testing_model_compute_write_orders_before_later_transfers_only() -> None:
    m = _model()
    pending = m.submit("load", 1, _g(3), _c(0), hung=False)
    m.compute_write(0, [3], 7, 0.5, now=1.0)  # races with the pending load into row 3
    assert not m.sides["gpu"].known[0][3].any() and m.compute_busy_until == 1.5
    m.resolve(pending, True)
    store = m.submit("store", 2, _g(1), _c(2), hung=False)
    m.compute_write(0, [1], 9, 0.0, now=1.0)  # after the store was submitted: the store may read either
    assert not store.certain[0].any()
    m.compute_write(0, [0], 5, 0.0, now=2.0)
    after = m.submit("store", 3, _g(0), _c(1), hung=False)  # after the write: it reads 5s
    assert after.certain[0].all() and (after.data[0] == 5).all()


@pytest.mark.rule("R5")
@pytest.mark.rule("R27")
def test_testing_model_error_fails_the_job_and_those_behind_it_and_lingers_until_released() -> None:
    m = _model()
    first = m.submit("store", 1, _g(0), _c(0), hung=False, lane="s1")
    second = m.submit("store", 2, _g(1), _c(1), hung=False, lane="s1")
    third = m.submit("store", 3, _g(2), _c(2), hung=False, lane="s1")
    m.error_fired("store", 2)
    assert (first.must_fail, second.must_fail, third.must_fail) == (False, True, True)
    assert m.chain["store"] == [first] and m.retired_lanes == {"s1"} and m.next_lane("store") is None
    m.resolve(second, False)
    cpu = m.sides["cpu"]
    assert cpu.lingering[0][1, :PAGE].all() and not cpu.known[0][1, :PAGE].any()
    assert m.holding() == [second]
    racing = m.submit("store", 4, _g(3), _c(1), hung=False, lane="s2")  # (a worker that ignored the hold)
    m.resolve(racing, True)
    assert not cpu.settled(0)[1, :PAGE].any(), "a late copy may still write: unknown until its hold is released"
    m.release(second)
    assert m.holding() == [] and not cpu.lingering[0][1].any()
    assert not cpu.settled(0)[1, :PAGE].any(), "what the late copy wrote stays unknown until rewritten"
    again = m.submit("store", 5, _g(4), _c(1), hung=False, lane="s2")
    m.resolve(again, True)
    assert cpu.settled(0)[1, :PAGE].all() and (cpu.value[0][1, :PAGE] == np.arange(32, 40)).all()


@pytest.mark.rule("R27")
def test_testing_model_release_before_the_report_counts_once_reported() -> None:
    m = _model()
    load = m.submit("load", 1, _g(2), _c(0), hung=False, lane="s1")
    m.error_fired("load", 1)
    m.release(load)  # a wait() polled twice: the failure, then the late copy's end
    m.resolve(load, False)
    gpu = m.sides["gpu"]
    assert not gpu.lingering[0][2].any() and not gpu.known[0][2].any() and m.holding() == []


@pytest.mark.rule("R4")
@pytest.mark.rule("R5")
@pytest.mark.rule("R28")
def test_testing_model_hang_blocks_its_stream_only() -> None:
    m = _model()
    hung = m.submit("load", 1, _g(0), _c(0), hung=True, lane="s1")
    behind = m.submit("load", 2, _g(1), _c(1), hung=False, lane="s1")
    other = m.submit("store", 3, _g(2), _c(2), hung=False, lane="s2")
    assert hung.stuck and behind.blocked and not other.stuck
    assert not m.can_finish(behind) and m.can_finish(other)
    m.error_fired("load", 1)  # the hung transfer fails, and so does job 2 behind it (R5) ...
    assert hung.must_fail and behind.must_fail and not other.must_fail
    fresh = m.submit("load", 4, _g(3), _c(0), hung=False, lane="s3")
    assert not fresh.blocked and m.any_hung, "... and the direction goes on on a fresh stream (R28)"
    assert m.submit("load", 5, _g(4), _c(1), hung=False, lane="s1").blocked, "the retired stream is wedged"
    assert m.submit("load", 6, _g(5), _c(2), hung=False).blocked is False, "unknown stream: its direction's own"


@pytest.mark.rule("R29")
@pytest.mark.rule("R27")
def test_testing_model_a_released_late_copy_does_not_keep_the_region() -> None:
    """Found by a campaign: a late copy a shutdown's drain proved (its release handed out after the shutdown) is no
    reason to keep the region (R29); one never released is."""
    from kvoffload_ref.results import HandlerReport, ShutdownReport
    from kvoffload_ref.testing.shutdown import may_release_unproven

    m = _model()
    late = m.submit("load", 1, _g(2), _c(0), hung=False, lane="s1")
    m.error_fired("load", 1)
    m.resolve(late, False)
    report = ShutdownReport(HandlerReport(), HandlerReport(), "skipped", "released", {}, {}, (), 0.0, True)
    assert not may_release_unproven(report, m)
    m.release(late)
    assert may_release_unproven(report, m)
