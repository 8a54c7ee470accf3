"""R27: the holds of many late copies taken in one vectorized update (an expiry of a long queue) are the holds of
each, ended one copy at a time."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvoffload_ref as kv
from kvoffload_ref.running import Holds


@dataclasses.dataclass
class _Late:
    job_id: int
    gpu_ids: np.ndarray
    cpu_ids: np.ndarray
    user_tag: object = None


def _ids(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


@pytest.mark.rule("R27")
def test_running_holds_of_many_copies_at_once_end_one_copy_at_a_time() -> None:
    first, second = _Late(1, _ids(1, 2), _ids(0)), _Late(2, _ids(2, 3), _ids(0, 4))
    many, one_by_one = Holds(8, 8), Holds(8, 8)
    many.hold_many("load", [first.gpu_ids, second.gpu_ids], [first.cpu_ids, second.cpu_ids])
    for late in (first, second):
        one_by_one.hold_many("load", [late.gpu_ids], [late.cpu_ids])
    assert many.held() == one_by_one.held() == kv.HeldBlocks((1, 2, 3), (0, 4), (), (0, 4))
    many.end("load", first)  # type: ignore[arg-type]  # end reads the ids, the job id and the tag only
    assert many.held() == kv.HeldBlocks((2, 3), (0, 4), (), (0, 4))  # block 2 still held by the second copy
    with pytest.raises(kv.BlocksHeldError, match=r"GPU blocks \[2\]"):
        many.check("load", 9, _ids(2), _ids(5))  # the second copy may still write block 2
    many.check("load", 9, _ids(1), _ids(0))  # block 1 is free again; chunk 0 is only read by a late load
    many.end("load", second)  # type: ignore[arg-type]
    assert many.held() == kv.HeldBlocks() and [r.job_id for r in many.take_released()] == [1, 2]
    many.check("store", 10, _ids(2), _ids(0))  # nothing held: a store may write chunk 0 again


@pytest.mark.rule("R27")
def test_running_holds_of_no_copies_change_nothing() -> None:
    holds = Holds(4, 4)
    holds.hold_many("store", [], [])
    assert holds.held() == kv.HeldBlocks() and holds.count == 0


@pytest.mark.rule("R27")
@pytest.mark.parametrize(("late", "direction", "gpu", "cpu", "refused"), [
    ("load", "store", [7], [1], "write CPU chunks [1]"),  # a late load reads chunk 1: a store may not write it
    ("load", "store", [1], [9], "read GPU blocks [1]"),  # a late load writes block 1: not even a read
    ("load", "load", [7], [1], None),  # two reads of chunk 1 never conflict
    ("store", "load", [7], [1], "read CPU chunks [1]"),  # a late store writes chunk 1: not even a read
    ("store", "load", [1], [9], "write GPU blocks [1]"),  # a late store reads block 1: a load may not write it
    ("store", "store", [1], [9], None),  # two reads of block 1 never conflict
])
def test_running_holds_check_each_access_against_each_hold(late: str, direction: str, gpu: list[int], cpu: list[int],
                                                           refused: str | None) -> None:
    holds = Holds(16, 16)
    holds.hold_many(late, [_ids(1)], [_ids(1)])  # type: ignore[arg-type]
    if refused is None:
        holds.check(direction, 5, _ids(*gpu), _ids(*cpu))  # type: ignore[arg-type]
    else:
        with pytest.raises(kv.BlocksHeldError, match=refused.replace("[", r"\[").replace("]", r"\]")):
            holds.check(direction, 5, _ids(*gpu), _ids(*cpu))  # type: ignore[arg-type]
