"""The fast engine's pooled resources: what a submission takes from its pools (``handler_pools.Taken``)."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.handler_pools import Taken
from kvoffload_ref.shield import Leaks


def _made(log: list[Any]) -> Any:
    def create(*args: Any, tag: Any) -> str:
        log.append((args, tag))
        return f"new{len(log)}"
    return create


@pytest.mark.rule("R14")
@pytest.mark.parametrize("pooled", [0, 1, 2, 3, 5])
def test_taken_take_three_takes_as_three_takes_in_a_row(pooled: int) -> None:
    """A transfer's three events: popped newest first while the pool has some, then created with the tag -- the
    same items, in the same order, recorded the same way as three ``take`` calls (so ``undo`` gives the same back)."""
    made: list[Any] = []
    pool, one_by_one = [f"idle{i}" for i in range(pooled)], [f"idle{i}" for i in range(pooled)]
    taken, reference = Taken(), Taken()
    got = taken.take_three(pool, _made(made), ("store", 7))
    expected_made: list[Any] = []
    expected = tuple(reference.take(one_by_one, _made(expected_made), tag=("store", 7)) for _ in range(3))
    assert got == expected and pool == one_by_one and made == expected_made
    assert [(item, created) for _, item, created in taken.items] == [
        (item, created) for _, item, created in reference.items]
    assert all(p is pool for p, _, _ in taken.items)
    if pooled >= 3:  # nothing created: undo puts them back where they were
        taken.undo(SimBackend(), pool, Leaks(SimBackend().ledger), "store")
        assert pool == [f"idle{i}" for i in range(pooled)]


def test_taken_take_passes_its_arguments_and_tag_to_create() -> None:
    made: list[Any] = []
    taken = Taken()
    assert taken.take([], _made(made), 64, tag=("load", 3)) == "new1"
    assert made == [((64,), ("load", 3))] and taken.items[0][1:] == ("new1", True)
