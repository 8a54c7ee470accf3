"""Deliberately wrong workers for the explore CLI's tests, importable on their own (no pytest): the tests run
``kvoffload-ref explore --factory _wrong_workers:...`` in a subprocess with this directory on ``PYTHONPATH``."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.testing.adapter import Setup, WorkerLike, reference_factory

#: The job whose result :func:`drops_a_result` never hands over.
DROPPED = 3


def _reaping(worker: Any, change: Callable[[list[Any]], list[Any]]) -> WorkerLike:
    """``worker`` with ``get_finished`` changed by ``change``; the patch holds the worker weakly (no reference
    cycle: dropping the last reference still runs its finalizer at once, in the dropping thread)."""
    ref, handed = weakref.ref(worker), type(worker).get_finished

    def get_finished() -> list[Any]:
        return change(handed(ref()))

    worker.get_finished = get_finished
    return worker  # type: ignore[no-any-return]


def drops_a_result(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """kvoffload_ref's worker (built on ``reference.Core``, so the pair explorer can watch it), except that
    ``get_finished`` drops job 3's result (R5: every accepted job is reported exactly once)."""
    return _reaping(reference_factory(backend, gpu, setup), lambda rs: [r for r in rs if r.job_id != DROPPED])


def forgets_what_failures_poisoned(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """kvoffload_ref's worker, except that a failed result lists no ``invalid_blocks`` (R22: it lists the
    destination blocks whose contents are now undefined)."""
    return _reaping(reference_factory(backend, gpu, setup),
                    lambda rs: [r if r.success else dataclasses.replace(r, invalid_blocks=()) for r in rs])
