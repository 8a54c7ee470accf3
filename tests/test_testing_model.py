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
def test_testing_model_error_fails_the_job_and_those_behind_it_and_poisons() -> None:
    m = _model()
    first = m.submit("store", 1, _g(0), _c(0), hung=False)
    second = m.submit("store", 2, _g(1), _c(1), hung=False)
    third = m.submit("store", 3, _g(2), _c(2), hung=False)
    m.error_fired("store", 2)
    assert (first.must_fail, second.must_fail, third.must_fail) == (False, True, True)
    assert m.chain["store"] == [first]
    m.resolve(second, False)
    cpu = m.sides["cpu"]
    assert cpu.poison[0][1, :PAGE].all() and not cpu.known[0][1, :PAGE].any()
    again = m.submit("store", 4, _g(3), _c(1), hung=False)
    m.resolve(again, True)
    assert not cpu.settled(0)[1, :PAGE].any(), "a failed transfer may still write: never known again"


@pytest.mark.rule("R4")
@pytest.mark.rule("R5")
def test_testing_model_hang_blocks_its_direction_only() -> None:
    m = _model()
    hung = m.submit("load", 1, _g(0), _c(0), hung=True)
    behind = m.submit("load", 2, _g(1), _c(1), hung=False)
    other = m.submit("store", 3, _g(2), _c(2), hung=False)
    assert hung.stuck and behind.blocked and not other.stuck
    assert not m.can_finish(behind) and m.can_finish(other)
    m.error_fired("load", 1)  # the hung transfer fails, and so does job 2 behind it (R5) ...
    assert hung.must_fail and behind.must_fail and not other.must_fail
    fresh = m.submit("load", 4, _g(3), _c(0), hung=False)
    assert fresh.blocked and m.any_hung, "... but its work still blocks the handler's stream: R4 keeps the chain"
    assert not m.submit("store", 5, _g(3), _c(1), hung=False).stuck
