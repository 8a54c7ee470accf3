"""Deliberately wrong workers for the explore CLI's tests, importable on their own (no pytest): the tests run
``kvoffload-ref explore --factory _wrong_workers:...`` in a subprocess with this directory on ``PYTHONPATH``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.testing.adapter import Setup, WorkerLike, reference_factory

#: The job whose result :func:`drops_a_result` never hands over.
DROPPED = 3


def drops_a_result(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """kvoffload_ref's worker (built on ``reference.Core``, so the pair explorer can watch it), except that
    ``get_finished`` drops job 3's result (R5: every accepted job is reported exactly once)."""
    worker: Any = reference_factory(backend, gpu, setup)
    handed = worker.get_finished

    def get_finished() -> list[Any]:
        return [r for r in handed() if r.job_id != DROPPED]

    worker.get_finished = get_finished
    return worker  # type: ignore[no-any-return]
