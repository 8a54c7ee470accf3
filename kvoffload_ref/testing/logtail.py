"""The library's log lines during a machine run: kept (the last :data:`KEEP`), not shown, unless the run fails.

A conformance run makes the library log every injected failure it handles (hundreds of expected lines per run);
:class:`LogTail` takes the ``kvoffload_ref`` logger tree off the root logger for the duration of one run and keeps
only its last lines, which the machine prints with a failure (a note under pytest, the campaign's report). The
kit's own warnings (``kvoffload_ref.testing``) still go to the root logger's handlers.
"""

from __future__ import annotations

import collections
import logging
from typing import Final

__all__ = ["KEEP", "LogTail"]

#: Log lines a run keeps (the last ones) to print with a failure.
KEEP: Final = 50
#: Loggers whose records pass through to the root logger (the kit speaks to the user).
_PASS_THROUGH: Final = "kvoffload_ref.testing"
_FORMAT: Final = "%(levelname)s %(name)s: %(message)s"


class LogTail(logging.Handler):
    """Keeps the last ``keep`` records of a logger tree while installed (see :meth:`install`).

    Args:
        keep: how many records to keep (the oldest are dropped first).
    """

    def __init__(self, keep: int = KEEP) -> None:
        super().__init__()
        # Invariant: the last `keep` records emitted while installed, oldest first.
        self.records: collections.deque[logging.LogRecord] = collections.deque(maxlen=keep)
        # Invariant: every record emitted while installed (kept or dropped), the kit's own excepted.
        self.seen = 0
        self._logger: logging.Logger | None = None
        self._propagate = True
        self.setFormatter(logging.Formatter(_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the record (the kit's own pass through to the root logger's handlers)."""
        if record.name == _PASS_THROUGH or record.name.startswith(_PASS_THROUGH + "."):
            logging.getLogger().callHandlers(record)
            return
        self.seen += 1
        self.records.append(record)

    def install(self, name: str = "kvoffload_ref") -> LogTail:
        """Take the logger ``name`` off its parents and keep its records here (until :meth:`remove`).

        Args:
            name: the logger tree to quiet.

        Returns:
            This handler.
        """
        if self._logger is None:
            logger = self._logger = logging.getLogger(name)
            self._propagate = logger.propagate
            logger.addHandler(self)
            logger.propagate = False
        return self

    def remove(self) -> None:
        """Give the logger back as it was (idempotent)."""
        if self._logger is not None:
            self._logger.removeHandler(self)
            self._logger.propagate = self._propagate
            self._logger = None

    def lines(self) -> list[str]:
        """The kept records, formatted, oldest first."""
        return [self.format(record) for record in self.records]

    def summary(self) -> str:
        """The kept lines under a header saying how many were logged ("" when none were)."""
        if not self.seen:
            return ""
        lines = "line" if self.seen == 1 else "lines"
        head = (f"# the library logged {self.seen} {lines} during the failing run (its cleanup included); the last "
                f"{len(self.records)}:")
        return "\n".join([head, *(f"#   {line}" for line in self.lines())])
