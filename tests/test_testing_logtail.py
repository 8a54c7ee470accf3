"""LogTail: the library's log lines kept off the output during a machine run, the last KEEP shown on failure."""

from __future__ import annotations

import logging

import pytest

from kvoffload_ref.testing.logtail import KEEP, LogTail


def test_testing_logtail_keeps_the_last_lines_and_gives_the_logger_back(caplog: pytest.LogCaptureFixture) -> None:
    library = logging.getLogger("kvoffload_ref.worker")
    tail = LogTail().install()
    try:
        for i in range(KEEP + 70):
            library.warning("line %d", i)
    finally:
        tail.remove()
    assert [r.getMessage() for r in caplog.records] == []  # none reached the root logger
    assert tail.seen == KEEP + 70 and len(tail.lines()) == KEEP
    assert tail.lines()[0] == "WARNING kvoffload_ref.worker: line 70"
    assert tail.summary().startswith(f"# the library logged {KEEP + 70} lines")
    assert len(tail.summary().splitlines()) == KEEP + 1
    library.warning("after")
    assert [r.getMessage() for r in caplog.records] == ["after"] and tail.seen == KEEP + 70
    assert logging.getLogger("kvoffload_ref").propagate


def test_testing_logtail_lets_the_kits_own_warnings_through(caplog: pytest.LogCaptureFixture) -> None:
    tail = LogTail().install()
    try:
        logging.getLogger("kvoffload_ref.testing.machine_base").warning("the kit speaks")
    finally:
        tail.remove()
    assert [r.getMessage() for r in caplog.records] == ["the kit speaks"] and tail.seen == 0
    assert tail.summary() == ""


def test_testing_logtail_install_and_remove_are_idempotent() -> None:
    logger = logging.getLogger("kvoffload_ref")
    tail = LogTail().install()
    tail.install()
    assert logger.handlers.count(tail) == 1 and not logger.propagate
    tail.remove()
    tail.remove()
    assert tail not in logger.handlers and logger.propagate
