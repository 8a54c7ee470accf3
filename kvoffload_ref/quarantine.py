"""The quarantine registry: what is kept alive on purpose until process exit because DMA may still touch it (R12).

The one home of :class:`QuarantinedItem`, :func:`quarantine` and :func:`quarantined`. A region quarantines itself
(:meth:`kvoffload_ref.region.HostRegion.quarantine_by_owner`); a direction handler registers the descriptor buffers
of its unproven transfers when it releases (:meth:`kvoffload_ref.handler.DirectionHandler.release`). Holding an
entry here is what keeps its object alive, so its finalizer never runs. This module imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["QuarantinedItem", "keeper", "quarantine", "quarantined"]


@dataclasses.dataclass(frozen=True)
class QuarantinedItem:
    """Something kept alive on purpose until process exit because DMA may still touch it (R12).

    Attributes:
        kind: "region" or "descriptor".
        description: what it is (addresses, sizes).
        reason: why it could not be released.
        obj: the object itself (holding it here is what keeps it alive).
        ranges: for a region, the ``(offset, length)`` ranges of it that are kept (R29: the registrations an
            unproven copy may still touch, or the whole region); () for anything else.
    """

    kind: str
    description: str
    reason: str
    obj: object = dataclasses.field(repr=False, compare=False)
    ranges: tuple[tuple[int, int], ...] = ()


# Invariant: only ever appended to; entries live until the interpreter exits.
_QUARANTINE: list[QuarantinedItem] = []
# Invariant: guards _QUARANTINE; a fresh one in every forked child (the fork may have copied it held, R21).
_QUARANTINE_LOCK = threading.Lock()


def _fresh_lock_in_child() -> None:  # a child's own regions may be quarantined too
    global _QUARANTINE_LOCK  # noqa: PLW0603  # one registry lock for the process
    _QUARANTINE_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_fresh_lock_in_child)


def quarantine(item: QuarantinedItem) -> None:
    """Keep ``item.obj`` alive until process exit and remember why."""
    with _QUARANTINE_LOCK:
        _QUARANTINE.append(item)


def quarantined() -> list[QuarantinedItem]:
    """Everything quarantined in this process so far (oldest first)."""
    with _QUARANTINE_LOCK:
        return list(_QUARANTINE)


def keeper(mark: Callable[[Any, int], object], kind: str, items: Sequence[object], reason: str) -> Callable[[], None]:
    """A release step that quarantines ``items`` (R12): each is marked in the ledger (``mark(kind, id(item))``,
    e.g. ``Ledger.quarantine``), then registered here, oldest first. An item leaves each list once done, so a retry
    of the step after an interrupt (``shield.Shield.run``) resumes where it stopped."""
    marked, registered = list(items), list(items)

    def keep() -> None:
        while marked:
            mark(kind, id(marked[0]))
            marked.pop(0)
        while registered:
            quarantine(QuarantinedItem(kind, repr(registered[0]), reason, registered[0]))
            registered.pop(0)

    return keep
