"""The result values (R22): a failed result's blocks by KV group, its fast construction, the report's drained jobs
with their tags."""

from __future__ import annotations

import array
import dataclasses
from typing import Any

import numpy as np
import pytest
from _support import BPC, CPU_CHUNKS, cspec, gspec, patterned_gpu, small_layout

import kvoffload_ref as kv
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.results import JobOutcomes, TransferResult, by_group, destination_blocks, failure, proven


@dataclasses.dataclass
class _Record:
    job_id: int
    dst_blocks: Any
    dst_groups: tuple[int, ...] = ()
    user_tag: object = None


@pytest.mark.rule("R22")
def test_results_by_group_sorts_and_dedups_each_group() -> None:
    blocks = np.array([9, 7, 7, 3, 8, 3], np.int64)
    assert by_group(blocks, (2, 0, 4)) == ((7, 9), (), (3, 7, 8))
    assert by_group(blocks, ()) == ()


@pytest.mark.rule("R22")
def test_results_destination_blocks_of_an_array_matches_the_iterable_form() -> None:
    ids = np.array([5, 2, 5, 2**62], np.int64)
    assert destination_blocks(ids) == destination_blocks(ids.tolist()) == (2, 5, 2**62)
    assert all(type(i) is int for i in destination_blocks(ids))


@pytest.mark.rule("R22")
@pytest.mark.parametrize("groups", [(), (1, 2)])
def test_results_failure_equals_the_result_init_builds(groups: tuple[int, ...]) -> None:
    """``failure`` skips the frozen dataclass's ``__init__`` (an expiry builds thousands): the value is the same."""
    error = kv.DeviceError("boom")
    built = failure(("CPU", "GPU"), _Record(4, np.array([3, 1, 2], np.int64), groups, "tag"), error)
    expected = TransferResult(4, False, error=error, invalid_blocks=(1, 2, 3), transfer_type=("CPU", "GPU"),
                              tag="tag", invalid_blocks_by_group=((3,), (1, 2)) if groups else ())
    assert built == expected and hash(built) == hash(expected) and repr(built) == repr(expected)
    assert list(vars(built)) == [f.name for f in dataclasses.fields(TransferResult)]  # every field, in order
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.success = True  # type: ignore[misc]


@pytest.mark.rule("R5")
@pytest.mark.parametrize("seconds", [1.5e-5, None])
def test_results_proven_equals_the_result_init_builds(seconds: float | None) -> None:
    """``proven`` skips the frozen dataclass's ``__init__`` (one per proven job of the fast engine): same value."""
    built = proven(7, 4096, seconds, ("GPU", "CPU"), {"k": 1})
    expected = TransferResult(7, True, 4096, seconds, transfer_type=("GPU", "CPU"), tag={"k": 1})
    assert built == expected and repr(built) == repr(expected)
    assert built.error is None and built.invalid_blocks == () and built.invalid_blocks_by_group == ()
    assert list(vars(built)) == [f.name for f in dataclasses.fields(TransferResult)]  # every field, in order
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.success = False  # type: ignore[misc]


@pytest.mark.rule("R22")
def test_results_job_outcomes_carry_drained_tags_or_none() -> None:
    ids, nbytes = [7, 8], array.array("q", [10, 20])
    untagged = JobOutcomes((), ids, nbytes, ("GPU", "CPU"), ())
    tagged = JobOutcomes((), ids, nbytes, ("GPU", "CPU"), (), ["a", None])
    assert [o.result.tag for o in untagged] == [None, None] and [o.result.tag for o in tagged] == ["a", None]
    assert [(o.result.job_id, o.result.transfer_size, o.ended) for o in tagged] == [(7, 10, "drained"),
                                                                                     (8, 20, "drained")]


@pytest.mark.rule("R22")
@pytest.mark.parametrize("tagged", [False, True])
def test_worker_drain_keeps_tags_only_once_a_job_carried_one(tagged: bool) -> None:
    """The engine's drain keeps an id and a byte count per proven job; a tag per job only if some submission
    carried one (an untagged teardown of thousands allocates nothing more), and the report still says each tag."""
    be = SimBackend()
    layout = small_layout()
    w = kv.create_worker(be, patterned_gpu(be, layout), layout, blocks_per_chunk=BPC, num_cpu_chunks=CPU_CHUNKS)
    for job in range(4):
        w.submit_store(job, gspec([job]), cspec([job]), tag=("r", job) if tagged and job == 2 else None)
    report = w.shutdown()
    assert [(o.ended, o.result.tag) for o in report.unreported] == [
        ("drained", ("r", 2) if tagged and job == 2 else None) for job in range(4)]
    assert len(w._core.store._drained_tags) == (4 if tagged else 0)  # type: ignore[attr-defined]
