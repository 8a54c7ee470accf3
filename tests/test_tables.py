"""How a lifecycle table is read: ``allows`` agrees with ``step`` on every pair of every table."""

from __future__ import annotations

import enum

import pytest

from kvoffload_ref import lifecycle, tables
from kvoffload_ref.errors import LifecycleError, WorkerClosedError
from kvoffload_ref.tables import Refusal, Transition

MACHINES = lifecycle.MACHINES


@pytest.mark.rule("R8")
@pytest.mark.rule("R14")
@pytest.mark.parametrize("name", sorted(MACHINES))
def test_tables_allows_exactly_the_pairs_the_table_maps_to_a_transition(name: str) -> None:
    """Every (state, input) of the table: ``allows`` is True for a Transition (and ``step`` takes it), False for a
    Refusal (and ``step`` raises its error). The handlers' ``abandon_undrained`` decides by it (R14)."""
    states, inputs, table = MACHINES[name]
    kinds = set()
    for state in states:
        for event in inputs:
            entry = table[(state, event)]
            kinds.add(type(entry))
            assert tables.allows(table, state, event) is isinstance(entry, Transition), (name, state, event, entry)
            if isinstance(entry, Refusal):
                with pytest.raises(entry.error):
                    tables.step(table, name, state, event)
            else:
                tables.step(table, name, state, event)
    assert kinds == {Transition, Refusal}, name  # each table has both kinds: the check above can tell them apart


@pytest.mark.rule("R8")
def test_tables_allows_is_false_for_a_pair_missing_from_the_table() -> None:
    class S(enum.Enum):
        A = "a"
        B = "b"

    class In(enum.Enum):
        GO = "go"
        STOP = "stop"

    sparse: tables.Table[lifecycle.Action] = {
        (S.A, In.GO): Transition(S.B, lifecycle.Action.PROCEED),
        (S.A, In.STOP): Refusal(WorkerClosedError, "stopped"),
    }
    assert tables.allows(sparse, S.A, In.GO)
    assert not tables.allows(sparse, S.A, In.STOP)
    assert not tables.allows(sparse, S.B, In.GO)  # missing: step would raise LifecycleError
    with pytest.raises(LifecycleError):
        tables.step(sparse, "sparse", S.B, In.GO)


@pytest.mark.rule("R8")
@pytest.mark.parametrize("name", sorted(MACHINES))
def test_tables_moves_are_exactly_the_steps_step_takes(name: str) -> None:
    """``moves`` (what the workers read on every call) holds each pair ``step`` takes, with the very pair it
    returns, and no pair it refuses: a driver that finds no move calls ``step``, which raises."""
    states, inputs, table = MACHINES[name]
    found = tables.moves(table, states)
    for state in states:
        for event in inputs:
            if tables.allows(table, state, event):
                assert found[(state, event)] == tables.step(table, name, state, event), (name, state, event)
            else:
                assert (state, event) not in found, (name, state, event)
    assert len(found) == sum(tables.allows(table, s, e) for s in states for e in inputs)
    with pytest.raises(LifecycleError, match="not a"):
        tables.moves(table, inputs)  # a table whose steps lead out of its states (a bug) is refused

