"""The one message channel: Python logging, under the "nanoflow" logger.

Every module that has something to say does `log = logging.getLogger(__name__)` and `log.info(...)`
for a normal line, `log.warning(...)` for a warning. Where the lines go is decided here, once:

- `installed()` (bin/*, through cli.guarded): each message one plain line on stdout, a warning prefixed "warning: ",
  written around a live tqdm bar, and nothing on ranks other than 0 under torchrun.
- `routed(out)` (train(config, out=...) and the like): for the call, every message to `out` alone;
  without `out`, where logging sends them, or plain lines on stdout when nothing is set up to receive them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import TextIO

from nanoflow.errors import without_credentials

ROOT = "nanoflow"


def _rank() -> int:
    """This process's rank under torchrun (which sets RANK before Python starts), 0 otherwise."""
    return int(os.environ.get("RANK", "0") or 0)


class LineFormatter(logging.Formatter):
    """The message alone; a warning prefixed "warning: " (an error "error: "): no level names, no module names."""

    def format(self, record: logging.LogRecord) -> str:
        text = without_credentials(record.getMessage())
        if record.levelno >= logging.ERROR:
            return f"error: {text}"
        if record.levelno >= logging.WARNING:
            return f"warning: {text}"
        return text


class LineHandler(logging.Handler):
    """Each message as lines on `stream` (None: sys.stdout as it is when the message comes). While a tqdm bar is
    open the lines go through tqdm.write, which clears the bar, writes, and draws the bar again below."""

    def __init__(self, stream: TextIO | None = None):
        super().__init__(logging.INFO)
        self.stream = stream
        self.setFormatter(LineFormatter())

    @property
    def target(self) -> TextIO:
        return sys.stdout if self.stream is None else self.stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text, stream = self.format(record), self.target
            tqdm = sys.modules.get("tqdm")  # a bar can be open only if tqdm was imported
            if tqdm is not None and getattr(tqdm.tqdm, "_instances", None):
                tqdm.tqdm.write(text, file=stream)
            else:
                stream.write(text + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: a message that cannot be written never stops the run
            self.handleError(record)


@contextlib.contextmanager
def _only(handler: logging.Handler):
    """For the block: `handler` alone receives nanoflow's messages (info and up); as before afterwards."""
    logger = logging.getLogger(ROOT)
    saved = logger.handlers[:], logger.propagate, logger.level
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.handlers, logger.propagate, logger.level = saved


def installed():
    """What bin/* run under (cli.guarded): nanoflow's messages as plain lines on stdout, on rank 0 only."""
    return _only(LineHandler() if _rank() == 0 else logging.NullHandler())


def routed(out: TextIO | None = None, *, enabled: bool = True):
    """For the `with` block: every nanoflow message to `out` alone, or to nowhere when not `enabled` (a rank other
    than 0). Without `out`: where logging sends them already (bin/*'s installed(), the caller's own logging setup,
    pytest's caplog), else — nothing set up, as in a notebook — plain lines on stdout."""
    if out is None and enabled and logging.getLogger(ROOT).hasHandlers():
        return contextlib.nullcontext()
    return _only(LineHandler(out) if enabled else logging.NullHandler())


def stream() -> TextIO:
    """The stream nanoflow's lines go to now (where a progress bar belongs): its LineHandler's, else stdout."""
    for handler in logging.getLogger(ROOT).handlers:
        if isinstance(handler, LineHandler):
            return handler.target
    return sys.stdout


@contextlib.contextmanager
def silenced(name: str):
    """No messages from logger `name` in the block: for a look whose warnings are not news (bin/report reading a
    run folder's metadata, bin/verify-resume counting commits among the saves it cut on purpose)."""
    logger = logging.getLogger(name)
    saved, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = saved
