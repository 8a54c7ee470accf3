"""R22: a failed result names the destination blocks it poisoned; the report accounts for every job once -- on both
workers (the engine and the reference)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _support import CREATE, cspec, gspec, make_worker

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.testing.campaign import quiet_logs


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


def _worker(kind: str, faults: list[kv.Fault], timeout: float = 0.01) -> tuple[SimBackend, Any]:
    be, worker, _ = make_worker(SimBackend(faults=kv.FaultPlan(faults)), kind=kind, timeout=timeout)
    return be, worker


@pytest.mark.rule("R22")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_failed_load_names_its_gpu_blocks_and_those_behind_it_theirs(kind: str) -> None:
    be, w = _worker(kind, [kv.Fault("event_query", "error", direction="load", job_id=2)])
    w.submit_store(1, gspec([0, 1, 2]), cspec([0]))
    w.wait([1])
    w.submit_load(2, cspec([0]), gspec([9, 7, 8]))
    w.submit_load(3, cspec([0]), gspec([5, 4, 3]))
    w.wait([2, 3])
    results = {r.job_id: r for r in w.get_finished()}
    assert results[1].success and results[1].invalid_blocks == () and results[1].transfer_type == ("GPU", "CPU")
    assert not results[2].success and results[2].invalid_blocks == (7, 8, 9)
    assert not results[3].success and results[3].invalid_blocks == (3, 4, 5)  # queued behind the failed head
    assert results[2].transfer_type == results[3].transfer_type == ("CPU", "GPU")
    assert kv.poisoned_gpu_blocks(results.values()) == (3, 4, 5, 7, 8, 9)
    assert kv.poisoned_cpu_chunks(results.values()) == ()
    w.shutdown()


@pytest.mark.rule("R22")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_failed_store_names_its_cpu_chunks(kind: str) -> None:
    be, w = _worker(kind, [kv.Fault("event_query", "error", direction="store", job_id=1)])
    w.submit_store(1, gspec([0, 1, 2, 3, 4, 5]), cspec([4, 2]))
    w.wait([1])
    (result,) = w.get_finished()
    assert not result.success and result.invalid_blocks == (2, 4) and result.transfer_type == ("GPU", "CPU")
    assert kv.poisoned_cpu_chunks([result]) == (2, 4) and kv.poisoned_gpu_blocks([result]) == ()
    w.shutdown()


@pytest.mark.rule("R22")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_report_lists_every_unhanded_job_once_with_its_blocks(kind: str) -> None:
    """Proven but unreaped, failed at the drain's head, abandoned behind it: each once, the unproven with blocks."""
    be, w = _worker(kind, [kv.Fault("event_query", "error", direction="load", job_id=4)])
    w.submit_store(1, gspec([0]), cspec([0]))
    w.wait([1])  # proven, never reaped
    w.submit_store(2, gspec([1]), cspec([1]))  # proven by the drain
    w.submit_load(4, cspec([0]), gspec([10, 11]))  # its end event fails in the drain
    w.submit_load(5, cspec([1]), gspec([12]))  # queued behind it: abandoned
    report = w.shutdown()
    ended = {o.result.job_id: (o.ended, o.result.success, o.result.invalid_blocks) for o in report.unreported}
    assert ended == {1: ("unreaped", True, ()), 2: ("drained", True, ()), 4: ("failed", False, (10, 11)),
                     5: ("abandoned", False, (12,))}
    assert report.load.abandoned == 2 and report.store.drained == 1
    assert kv.poisoned_gpu_blocks(report) == (10, 11, 12) and kv.poisoned_cpu_chunks(report) == ()


@pytest.mark.rule("R22")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_hung_transfer_at_shutdown_is_abandoned_with_its_blocks(kind: str) -> None:
    be, w = _worker(kind, [kv.Fault("event_query", "hang", direction="store", job_id=3)])
    w.submit_store(3, gspec([0, 1]), cspec([5]))
    w.submit_store(6, gspec([2]), cspec([6]))
    report = w.shutdown()
    assert [(o.result.job_id, o.ended, o.result.invalid_blocks) for o in report.unreported] == [
        (3, "abandoned", (5,)), (6, "abandoned", (6,))]
    assert kv.poisoned_cpu_chunks(report) == (5, 6)


# -- by KV-cache group and by tag (engine-shaped failure reports) ---------------------------------------------------
def _two_groups(kind: str, faults: list[kv.Fault], timeout: float = 0.01) -> tuple[SimBackend, Any]:
    """Two KV-cache groups over two tensors (a model with, e.g., full and sliding-window attention)."""
    page = 512
    layout = kv.KVCacheLayout((page, page), [[kv.LayerRef(0, page)], [kv.LayerRef(1, page)]])
    be, worker, _ = make_worker(SimBackend(faults=kv.FaultPlan(faults)), kind=kind, layout=layout, timeout=timeout)
    return be, worker


def _groups(ids: list[int], sizes: tuple[int, ...]) -> kv.GPULoadStoreSpec:
    return kv.GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=(0,) * len(sizes))


@pytest.mark.rule("R22")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_failed_load_names_its_gpu_blocks_per_kv_group(kind: str) -> None:
    be, w = _two_groups(kind, [kv.Fault("event_query", "error", direction="load", job_id=2)])
    w.submit_load(2, cspec([0, 1]), _groups([9, 7, 7, 3, 8], (2, 3)), tag="request-a")  # group 1 names 7 and 3 too
    w.submit_load(3, cspec([2]), _groups([5, 4], (0, 2)), tag="request-b")  # behind it; its group 0 is empty
    w.submit_store(4, _groups([1, 2], (1, 1)), cspec([3, 4]))
    w.wait([2, 3, 4])
    results = {r.job_id: r for r in w.get_finished()}
    assert results[2].invalid_blocks == (3, 7, 8, 9) and results[2].invalid_blocks_by_group == ((7, 9), (3, 7, 8))
    assert results[3].invalid_blocks_by_group == ((), (4, 5))
    assert results[4].success and results[4].invalid_blocks_by_group == ()
    assert kv.poisoned_gpu_blocks_by_group(results.values()) == {0: (7, 9), 1: (3, 4, 5, 7, 8)}
    w.shutdown()


@pytest.mark.rule("R22")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_failed_store_has_no_blocks_by_group(kind: str) -> None:
    """A store's CPU chunks hold every group's pages: its poisoned chunks are not per group."""
    be, w = _two_groups(kind, [kv.Fault("event_query", "error", direction="store", job_id=1)])
    w.submit_store(1, _groups([1, 2], (1, 1)), cspec([2, 3]), tag="r")  # a chunk per group
    w.wait([1])
    (result,) = w.get_finished()
    assert not result.success and result.invalid_blocks == (2, 3) and result.invalid_blocks_by_group == ()
    assert kv.poisoned_gpu_blocks_by_group([result]) == {}
    assert kv.poisoned_by_tag([result]) == {"r": kv.PoisonedBlocks((), (2, 3), {})}
    w.shutdown()


@pytest.mark.rule("R22")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_poisoned_by_tag_groups_each_requests_blocks(kind: str) -> None:
    be, w = _two_groups(kind, [kv.Fault("event_query", "error", direction="load", job_id=2),
                               kv.Fault("event_query", "error", direction="store", job_id=6)])
    w.submit_store(6, _groups([0, 1], (1, 1)), cspec([3, 4]), tag="b")
    w.submit_load(2, cspec([0, 1]), _groups([9, 8], (1, 1)), tag="a")
    w.submit_load(3, cspec([5, 6]), _groups([5, 4], (1, 1)), tag="b")  # behind job 2: fails too
    w.submit_load(5, cspec([7]), _groups([10, 11], (2, 0)))  # behind too, untagged
    w.wait([2, 3, 5, 6])
    results = w.get_finished()
    by_tag = kv.poisoned_by_tag(results)
    assert by_tag == {"b": kv.PoisonedBlocks((4, 5), (3, 4), {0: (5,), 1: (4,)}),
                      "a": kv.PoisonedBlocks((8, 9), (), {0: (9,), 1: (8,)}),
                      None: kv.PoisonedBlocks((10, 11), (), {0: (10, 11)})}
    assert kv.poisoned_by_tag([r for r in results if r.success]) == {}
    w.shutdown()


@pytest.mark.rule("R22")
def test_poisoned_by_tag_refuses_an_unhashable_tag() -> None:
    result = kv.TransferResult(1, False, invalid_blocks=(1,), transfer_type=("CPU", "GPU"), tag=["not", "hashable"])
    with pytest.raises(TypeError, match="hashable tags; job 1 has a list"):
        kv.poisoned_by_tag([result])


@pytest.mark.rule("R22")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_report_carries_tags_and_groups_of_every_unhanded_job(kind: str) -> None:
    """The shutdown report's entries carry their tags -- unreaped, drained, failed, abandoned -- and a failed load's
    blocks by group; a report is a source for the per-group and per-tag forms."""
    be, w = _two_groups(kind, [kv.Fault("event_query", "error", direction="load", job_id=4)])
    w.submit_store(1, _groups([0, 1], (1, 1)), cspec([0, 1]), tag=("req", 1))
    w.wait([1])  # proven, never reaped
    w.submit_store(2, _groups([2, 3], (1, 1)), cspec([2, 3]), tag=("req", 2))  # proven by the drain
    w.submit_store(3, _groups([4, 5], (1, 1)), cspec([4, 5]))  # proven by the drain, untagged
    w.submit_load(4, cspec([0, 1]), _groups([10, 11], (1, 1)), tag=("req", 4))  # fails in the drain
    w.submit_load(5, cspec([6]), _groups([12, 13], (2, 0)), tag=("req", 5))  # abandoned behind it
    report = w.shutdown()
    ended = {o.result.job_id: (o.ended, o.result.tag, o.result.invalid_blocks_by_group) for o in report.unreported}
    assert ended == {1: ("unreaped", ("req", 1), ()), 2: ("drained", ("req", 2), ()), 3: ("drained", None, ()),
                     4: ("failed", ("req", 4), ((10,), (11,))), 5: ("abandoned", ("req", 5), ((12, 13), ()))}
    assert kv.poisoned_gpu_blocks_by_group(report) == {0: (10, 12, 13), 1: (11,)}
    assert set(kv.poisoned_by_tag(report)) == {("req", 4), ("req", 5)}


@pytest.mark.rule("R22")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_expired_load_names_its_blocks_by_group(kind: str) -> None:
    be, w = _two_groups(kind, [kv.Fault("copy", "hang", direction="load", job_id=2)])
    w.submit_load(2, cspec([0, 1]), _groups([9, 8], (1, 1)), deadline=0.5, tag="a")
    w.get_finished()  # sees it start
    be.clock_advance(0.5)
    (result,) = w.get_finished()
    assert isinstance(result.error, kv.TransferExpired) and result.invalid_blocks_by_group == ((9,), (8,))
    assert result.tag == "a"
    w.shutdown()


@pytest.mark.rule("R10")
@pytest.mark.rule("R22")
@pytest.mark.rule("R28")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_drain_names_the_failed_head_of_the_current_stream_not_a_retired_one(kind: str) -> None:
    # Job 1 hangs and stays live on the stream the cancel of job 2 retired; job 3 goes to a fresh stream and its
    # end event's second query (the drain's) fails: job 3 is the failed head, job 1 only abandoned.
    be, w = _worker(kind, [kv.Fault("copy", "hang", job_id=1), kv.Fault("event_query", "error", job_id=3, nth=2)])
    w.submit_store(1, gspec([0]), cspec([0]))
    w.submit_store(2, gspec([1]), cspec([1]))
    w.cancel([2])
    w.submit_store(3, gspec([2]), cspec([2]))
    assert [(r.job_id, r.error.reason) for r in w.get_finished()] == [(2, "cancel")]
    report = w.shutdown()
    assert sorted((o.result.job_id, o.ended) for o in report.unreported) == [(1, "abandoned"), (3, "failed")]
    assert report.store.abandoned == 2


@pytest.mark.rule("R10")
@pytest.mark.rule("R22")
@pytest.mark.rule("R28")
@pytest.mark.parametrize("kind", list(CREATE))
def test_worker_drain_names_the_failed_head_of_the_retired_stream_it_failed_on(kind: str) -> None:
    # Two retired streams each keep a live hung job (1 and 3; the cancels of 2 and 4 retired them). In the drain,
    # stream A's job 1 is pending at the deadline and stream B's job 3 fails when observed: the report names job 3
    # "failed" (its own end event's error) and job 1 only "abandoned".
    be, w = _worker(kind, [kv.Fault("copy", "hang", job_id=1), kv.Fault("copy", "hang", job_id=3)])
    w.submit_store(1, gspec([0]), cspec([0]))
    w.submit_store(2, gspec([1]), cspec([1]))
    w.cancel([2])
    w.submit_store(3, gspec([2]), cspec([2]))
    w.submit_store(4, gspec([3]), cspec([3]))
    w.cancel([4])
    assert [(r.job_id, r.error.reason) for r in w.get_finished()] == [(2, "cancel"), (4, "cancel")]

    def job_3_fails(point: str, tag: object) -> None:
        if point == "event_query" and tag == ("store", 3):
            raise kv.DeviceError("job 3's end event reports an error", 719)

    be.on_call = job_3_fails
    report = w.shutdown()
    be.on_call = None
    assert sorted((o.result.job_id, o.ended) for o in report.unreported) == [(1, "abandoned"), (3, "failed")]
