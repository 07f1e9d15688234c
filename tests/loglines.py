"""Capture the messages a logger emits, for tests that check what a user is told."""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    """Every message logged at INFO or above, in ``lines``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def capture(name: str = "commpress") -> LogLines:
    """A :class:`LogLines` attached to logger ``name``, set to INFO (for the rest of the process:
    the tests call it inside their spawned workers)."""
    lines = LogLines()
    logger = logging.getLogger(name)
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    return lines
