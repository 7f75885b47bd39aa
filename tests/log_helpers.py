"""What nanoflow logs in a block, for tests that call library functions directly (bin/* and train(out=...) are
tested through what they print)."""

from __future__ import annotations

import contextlib
import logging


class _Collect(logging.Handler):
    def __init__(self, into: list[str], level: int):
        super().__init__(level)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


@contextlib.contextmanager
def logged(level: int = logging.WARNING):
    """Yields a list that fills with the messages of nanoflow's log records of at least `level`."""
    messages, logger = [], logging.getLogger("nanoflow")
    handler, saved = _Collect(messages, level), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)
