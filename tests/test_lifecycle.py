"""The lifecycle tables are total, their refusals are typed, and the decisions match R12-R14."""

from __future__ import annotations

import copy
import enum
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload_ref import lifecycle, tables
from kvoffload_ref.errors import LifecycleError, OffloadError, OwnershipError, WorkerClosedError
from kvoffload_ref.lifecycle import (
    Action,
    Fate,
    HandlerInput,
    HandlerState,
    Policy,
    ProofOutcome,
    RegionInput,
    RegionState,
    WorkerInput,
    WorkerState,
)
from kvoffload_ref.tables import Refusal, Transition

MACHINES = lifecycle.MACHINES


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_lifecycle_table_is_total(name: str) -> None:
    states, inputs, table = MACHINES[name]
    assert set(table) == {(s, i) for s in states for i in inputs}
    for (state, _event), entry in table.items():
        assert isinstance(entry, (Transition, Refusal))
        if isinstance(entry, Transition):
            assert type(entry.next) is states, (state, entry)
        else:
            assert issubclass(entry.error, OffloadError)


@given(st.sampled_from(sorted(MACHINES)), st.data())
def test_lifecycle_every_pair_is_a_transition_or_one_typed_error(name: str, data: st.DataObject) -> None:
    states, inputs, table = MACHINES[name]
    state = data.draw(st.sampled_from(list(states)))
    event = data.draw(st.sampled_from(list(inputs)))
    entry = table[(state, event)]
    if isinstance(entry, Transition):
        assert tables.step(table, name, state, event) == (entry.next, entry.action)
    else:
        with pytest.raises(entry.error, match=rf"^{name} in state {state.name} refuses {event.name}: "):
            tables.step(table, name, state, event)


def test_lifecycle_missing_pair_raises_lifecycle_error() -> None:
    class Other(enum.Enum):
        X = "x"

    with pytest.raises(LifecycleError, match=r"^worker: no transition for input X in state OPEN$"):
        tables.step(lifecycle.WORKER_TABLE, "worker", WorkerState.OPEN, Other.X)


def test_lifecycle_tables_are_keyed_by_plain_enum_members() -> None:
    """The enums are plain enums (they pickle and copy as themselves), and every table key is a member."""
    enums = [Action, ProofOutcome, Policy, Fate, *(c for m in MACHINES.values() for c in m[:2])]
    for cls in enums:
        assert issubclass(cls, enum.Enum)
        for member in cls:
            assert cls(member.value) is member and cls[member.name] is member
            assert pickle.loads(pickle.dumps(member)) is member and copy.deepcopy(member) is member
    for _, _, table in MACHINES.values():
        rebuilt = {(type(s)[s.name], type(e)[e.name]): entry for (s, e), entry in table.items()}
        assert rebuilt == dict(table) and all(rebuilt[key] is table[key] for key in table)


@pytest.mark.rule("R8")
@pytest.mark.parametrize("state", [WorkerState.SHUTTING_DOWN, WorkerState.CLOSED])
def test_lifecycle_worker_refuses_submit_once_shutdown_began(state: WorkerState) -> None:
    with pytest.raises(WorkerClosedError):
        tables.step(lifecycle.WORKER_TABLE, "worker", state, WorkerInput.SUBMIT)
    assert tables.step(lifecycle.WORKER_TABLE, "worker", state, WorkerInput.GET_FINISHED) == (
        state, Action.RETURN_EMPTY)


@pytest.mark.rule("R8")
def test_lifecycle_second_shutdown_returns_the_report() -> None:
    assert tables.step(lifecycle.WORKER_TABLE, "worker", WorkerState.CLOSED, WorkerInput.SHUTDOWN) == (
        WorkerState.CLOSED, Action.RETURN_REPORT)
    assert tables.step(lifecycle.WORKER_TABLE, "worker", WorkerState.OPEN, WorkerInput.SHUTDOWN) == (
        WorkerState.SHUTTING_DOWN, Action.RUN_SHUTDOWN)


@pytest.mark.rule("R1")
def test_lifecycle_region_release_by_caller_refused_once_a_worker_owns_it() -> None:
    table = lifecycle.REGION_TABLE
    state, _ = tables.step(table, "region", RegionState.CALLER_OWNED, RegionInput.ADOPT)
    assert state is RegionState.WORKER_OWNED
    with pytest.raises(OwnershipError):
        tables.step(table, "region", state, RegionInput.CALLER_RELEASE)


@pytest.mark.rule("R3")
@pytest.mark.parametrize("event", [RegionInput.CALLER_RELEASE, RegionInput.WORKER_RELEASE])
def test_lifecycle_region_released_at_most_once(event: RegionInput) -> None:
    assert tables.step(lifecycle.REGION_TABLE, "region", RegionState.RELEASED, event) == (
        RegionState.RELEASED, Action.NOTHING)


@pytest.mark.rule("R10")
@pytest.mark.parametrize("event", [HandlerInput.HEAD_FAILED, HandlerInput.DEADLINE, HandlerInput.INTERRUPT])
def test_lifecycle_handler_drain_stops_at_first_failure(event: HandlerInput) -> None:
    state, _ = tables.step(lifecycle.HANDLER_TABLE, "handler", HandlerState.DRAINING, event)
    assert state is HandlerState.ABANDONED
    with pytest.raises(LifecycleError):
        tables.step(lifecycle.HANDLER_TABLE, "handler", state, HandlerInput.HEAD_PROVEN)


@pytest.mark.rule("R13")
def test_lifecycle_proof_never_on_the_clean_path() -> None:
    assert lifecycle.PROOF_DECISION[(True, False)] is ProofOutcome.NOT_NEEDED
    assert lifecycle.PROOF_DECISION[(False, False)] is None  # attempt the proof


@pytest.mark.rule("R14")
def test_lifecycle_proof_skipped_after_interrupt_and_quarantines() -> None:
    assert lifecycle.PROOF_DECISION[(False, True)] is ProofOutcome.SKIPPED
    for policy in Policy:
        assert lifecycle.FATE[(ProofOutcome.SKIPPED, policy)] is Fate.QUARANTINE


@pytest.mark.rule("R12")
@pytest.mark.parametrize("outcome", list(ProofOutcome))
def test_lifecycle_fate_releases_only_what_is_proven_under_quarantine(outcome: ProofOutcome) -> None:
    proven = outcome in (ProofOutcome.NOT_NEEDED, ProofOutcome.OK)
    expected = Fate.RELEASE if proven else Fate.QUARANTINE
    assert lifecycle.FATE[(outcome, Policy.QUARANTINE)] is expected
    if outcome is not ProofOutcome.SKIPPED:
        assert lifecycle.FATE[(outcome, Policy.RELEASE)] is Fate.RELEASE


def test_lifecycle_proof_outcome_is_the_reports_device_sync_spelling() -> None:
    from typing import get_args

    from kvoffload_ref.results import DeviceSync

    assert list(get_args(DeviceSync)) == [outcome.value for outcome in ProofOutcome]


def test_lifecycle_shutdown_policy_takes_a_policy_or_its_string() -> None:
    from kvoffload_ref.errors import InvalidTransferError
    from kvoffload_ref.results import ShutdownPolicy

    for policy in Policy:
        by_enum, by_str = ShutdownPolicy(1.0, policy), ShutdownPolicy(timeout=1.0, on_unproven=policy.value)
        assert by_enum == by_str and hash(by_enum) == hash(by_str)
        assert by_str.policy is policy and by_str.on_unproven == policy.value
        assert repr(by_str) == f"ShutdownPolicy(timeout=1.0, on_unproven={policy.value!r})"
        assert eval(repr(by_str), {"ShutdownPolicy": ShutdownPolicy}) == by_str
        assert pickle.loads(pickle.dumps(by_str)) == by_str
    assert ShutdownPolicy().policy is Policy.QUARANTINE
    for bad in ("QUARANTINE", "drop", None, 1):
        with pytest.raises(InvalidTransferError, match=r"^on_unproven must be 'quarantine' or 'release', got "):
            ShutdownPolicy(on_unproven=bad)  # type: ignore[arg-type]
