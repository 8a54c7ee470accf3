"""How a lifecycle table is read: its entries (:class:`Transition`, :class:`Refusal`) and :func:`step`.

The tables themselves, the rules, are in ``lifecycle.py``; this is only the mechanism that applies one.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Generic, TypeVar

from kvoffload_ref.errors import LifecycleError, OffloadError

__all__ = ["Moves", "Refusal", "Table", "Transition", "allows", "moves", "step"]


A = TypeVar("A", bound=enum.Enum)
S = TypeVar("S", bound=enum.Enum)


@dataclasses.dataclass(frozen=True)
class Transition(Generic[A]):
    """A legal step: the next state and the action the driver carries out (a ``lifecycle.Action``)."""

    next: enum.Enum
    action: A


@dataclasses.dataclass(frozen=True)
class Refusal:
    """An illegal step: the error type to raise and why. The state does not change."""

    error: type[OffloadError]
    reason: str


#: A machine's table: (state, input) -> what happens; total over its states and inputs.
Table = Mapping[tuple[enum.Enum, enum.Enum], Transition[A] | Refusal]


def step(table: Table[A], machine: str, state: S, event: enum.Enum) -> tuple[S, A]:
    """One transition of ``table`` (``machine`` names it in errors): ``(next_state, action)``.

    Raises:
        The refusal's error type (e.g. WorkerClosedError) when the pair is refused; LifecycleError when the pair
        is missing from the table (a bug: the tables are total and tested whole).
    """
    try:
        entry = table[(state, event)]
    except KeyError:
        raise LifecycleError(f"{machine}: no transition for input {event.name} in state {state.name}") from None
    if isinstance(entry, Refusal):
        raise entry.error(f"{machine} in state {state.name} refuses {event.name}: {entry.reason}")
    next_state: S = entry.next  # type: ignore[assignment]  # tables map a machine's states to its own states
    return next_state, entry.action


#: A table's legal steps alone, each as its ``(next_state, action)`` pair (see :func:`moves`).
Moves = dict[tuple[enum.Enum, enum.Enum], tuple[S, A]]


def moves(table: Table[A], states: type[S]) -> Moves[S, A]:
    """The legal steps of ``table`` (a machine over ``states``), keyed like it, as the pairs :func:`step` returns.

    A driver that steps on every call reads one entry of this instead of calling :func:`step` (~0.2 us less a step
    on CPython 3.11); a pair missing here is one :func:`step` refuses, so the driver calls it for that pair alone,
    and it raises the refusal's error (or the LifecycleError of a missing pair). The table stays the one statement
    of the rule: this is read from it once, when the driver's module is imported.
    """
    return {key: (_state(entry.next, states), entry.action) for key, entry in table.items()
            if isinstance(entry, Transition)}


def _state(value: enum.Enum, states: type[S]) -> S:
    if not isinstance(value, states):
        raise LifecycleError(f"a transition leads to {value!r}, not a {states.__name__}")  # a bug in a table
    return value


def allows(table: Table[A], state: enum.Enum, event: enum.Enum) -> bool:
    """Whether ``table`` takes ``event`` in ``state``: True exactly where :func:`step` would make a transition, False
    where it would refuse (a :class:`Refusal`, or a pair missing from the table); changes nothing."""
    return isinstance(table.get((state, event)), Transition)
