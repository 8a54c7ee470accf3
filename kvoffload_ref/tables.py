"""How a lifecycle table is read: its entries (:class:`Transition`, :class:`Refusal`) and :func:`step`.

The tables themselves, the rules, are in ``lifecycle.py``; this is only the mechanism that applies one.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Generic, TypeVar

from kvoffload_ref.errors import LifecycleError, OffloadError

__all__ = ["Refusal", "Table", "Transition", "allows", "step"]


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


def allows(table: Table[A], state: enum.Enum, event: enum.Enum) -> bool:
    """Whether ``table`` takes ``event`` in ``state``: True exactly where :func:`step` would make a transition, False
    where it would refuse (a :class:`Refusal`, or a pair missing from the table); changes nothing."""
    return isinstance(table.get((state, event)), Transition)
