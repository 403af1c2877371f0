"""What gridtrain logs at WARNING and above while a block runs (its own ``gridtrain`` logger)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def gridtrain_warnings() -> Iterator[list[str]]:
    """The messages of the ``gridtrain`` logger's warnings, in order, collected into the list
    this yields (it keeps filling until the block ends)."""
    lines: list[str] = []
    handler = _Lines(lines)
    logger = logging.getLogger("gridtrain")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
