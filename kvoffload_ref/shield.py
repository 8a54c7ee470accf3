"""Release steps that no interrupt can leave half done (R14).

A ``BaseException`` that is not an ``Exception`` -- a ``KeyboardInterrupt`` from a Ctrl-C, or one a test injects at
a backend call -- asks the library to stop *waiting*, never to stop *releasing*: memory left neither released nor
quarantined could be unmapped by the garbage collector while a DMA still writes it. So every release step runs
under a :class:`Shield`: an interrupt that cuts a step short is remembered and the step is retried (the interrupt
arrived before the step did its work, or the step is idempotent), the remaining steps run, and the caller re-raises
the interrupt once everything is done.

A release call that fails with an ``Exception`` (a failed release step, R3/R10) is no reason to stop either:
:func:`each` hands the item to a ``leak`` callback and goes on, and :class:`Leaks` marks such items leaked in the
backend's ledger and counts them for the shutdown report (R16).

This module imports nothing of the package; the handler, the regions and the worker's core use it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Final, ParamSpec, Protocol, TypeVar

__all__ = ["ATTEMPTS", "Leaks", "Shield", "each", "finish_all"]

logger = logging.getLogger("kvoffload_ref.shield")

#: How often a step is tried when interrupts keep cutting it short.
ATTEMPTS: Final = 3

T = TypeVar("T")
P = ParamSpec("P")


class Shield:
    """Collects the interrupts that arrive while release steps run, so the steps can finish first."""

    __slots__ = ("interrupt",)

    def __init__(self) -> None:
        # Invariant: the first interrupting BaseException (not an Exception) seen by run(), or None.
        self.interrupt: BaseException | None = None

    def run(self, step: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``step(*args, **kwargs)``; retry it when an interrupt cuts it short (up to ATTEMPTS tries).

        Returns:
            What the step returned.

        Raises:
            Exception: what the step raised (not retried: a failed step is the caller's to log).
            BaseException: the interrupt, when the step was interrupted ATTEMPTS times in a row.
        """
        for attempt in range(ATTEMPTS):
            try:
                return step(*args, **kwargs)
            except Exception:
                raise
            except BaseException as exc:
                self.interrupt = self.interrupt or exc
                if attempt == ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def reraise(self) -> None:
        """Raise the remembered interrupt, if any (once everything is done)."""
        interrupt, self.interrupt = self.interrupt, None
        if interrupt is not None:
            raise interrupt


def finish_all(steps: Iterable[tuple[str, Callable[[], object]]],
               shield: Shield | None = None) -> tuple[list[str], BaseException | None]:
    """Run every step to its end, whatever any of them raises (R9, R14).

    A step that raises an ``Exception`` is logged ("Failed to <description>") and listed as failed; the next step
    runs. A step cut short by interrupts is retried (:meth:`Shield.run`).

    Args:
        steps: (description, zero-argument callable) pairs, run in order.
        shield: where interrupts are collected (a new one if None).

    Returns:
        (descriptions of the steps that failed, the first interrupting BaseException or None). The caller
        re-raises the interrupt once its own steps are done.
    """
    shield = shield or Shield()
    failed: list[str] = []
    for what, step in steps:
        try:
            shield.run(step)
        except Exception as exc:
            logger.error("Failed to %s", what, exc_info=True)
            failed.append(f"{what}: {exc!r}")
        except BaseException:
            failed.append(f"{what}: interrupted {ATTEMPTS} times")
    return failed, shield.interrupt


def each(release: Callable[[Any], object], items: list[Any], leak: Callable[[Any], object] | None = None) -> None:
    """Release ``items`` from the end; an item leaves the list only once released, so a retry after an interrupt
    (:meth:`Shield.run`) resumes where it stopped.

    With ``leak``: an item whose release raises an ``Exception`` (a failed release step, R3/R10) is handed to
    ``leak`` and leaves the list, and the next items are still released (R16); the first such failure is raised
    once every item was tried. Without it, the first failure is raised at once.
    """
    failed: Exception | None = None
    while items:
        try:
            release(items[-1])
        except Exception as exc:
            if leak is None:
                raise
            leak(items.pop())
            failed = failed or exc
            continue
        items.pop()
    if failed is not None:
        raise failed


class _Ledger(Protocol):
    def state_of(self, kind: Any, key: Hashable) -> str | None: ...

    def leak(self, kind: Any, key: Hashable) -> None: ...


class Leaks:
    """What one owner's release calls could not release (R16): each such resource is marked leaked in the backend's
    ledger and counted by kind, for the shutdown report to list.

    Args:
        ledger: the backend's ledger (resources are keyed by ``id()`` of their handle).
    """

    def __init__(self, ledger: _Ledger) -> None:
        self._ledger = ledger
        # Invariant: ledger kind -> how many resources this owner marked leaked; never decreases.
        self.counts: dict[str, int] = {}
        # Invariant: the release failures outside a shutdown's own steps (see release()), in order, each logged.
        self.errors: list[str] = []

    def leak(self, kind: str, item: object) -> None:
        """Mark ``item`` leaked -- unless its release call released it after all (it is not live any more)."""
        if self._ledger.state_of(kind, id(item)) != "live":
            return
        self._ledger.leak(kind, id(item))
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def of(self, kind: str) -> Callable[[object], None]:
        """``leak`` for one kind (an ``each`` callback)."""
        return functools.partial(self.leak, kind)

    def live_ones(self, kind: str, items: Iterable[object]) -> None:
        """Leak those of ``items`` still live: what a batched release call that raised could not release."""
        for item in items:
            self.leak(kind, item)

    def release(self, release: Callable[[Any], object], kind: str, item: object, what: str) -> None:
        """A release outside a shutdown's steps (a pooled buffer too small, a proven transfer's resources, a
        rollback): a failure is logged ("Failed to <what>"), the item leaked and the failure kept in ``errors`` for
        the shutdown report; it is never raised (an interrupt is: the caller's shield retries)."""
        try:
            release(item)
        except Exception as exc:
            logger.error("Failed to %s", what, exc_info=True)
            self.leak(kind, item)
            self.errors.append(f"{what}: {exc!r}")
