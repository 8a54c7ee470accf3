"""A deliberately wrong worker for HypoFuzz to find (``tests/test_testing_hypofuzz.py``); the suite never collects it.

``hypothesis fuzz -- tests/_hypofuzz_wrong_worker.py`` fuzzes the machine on
``kvoffload_ref.testing.mutants:failures_reported_as_success`` (it reports failed transfers as successful: R5).
Like the project's own machines (``tests/test_testing_machine.py``), its ``TestCase`` takes the loaded profile's
settings (the ``hypofuzz`` profile: an example database), as HypoFuzz requires.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

from kvoffload_ref.testing import make_machine
from kvoffload_ref.testing.campaign import quiet_logs
from kvoffload_ref.testing.mutants import failures_reported_as_success


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


WrongWorkerMachine = make_machine(failures_reported_as_success, name="FailuresReportedAsSuccess", settings=settings())
TestFailuresReportedAsSuccess = WrongWorkerMachine.TestCase
