"""``DTM_LOG``: what each rank says about itself while it runs (the ``dtm_mpi`` logger).

The logger's level is ``DTM_LOG`` (default ``warning``). ``info`` adds each rank's phases as it
enters them (``[rank 1] dtm: phase load``; a run's steps are phases too) and the failures
``DTM_FAULT`` injects, as they happen; ``debug`` adds each agreement a rank starts waiting in.
With a level other than the default, records go to stderr, one line each, written whole (see
:mod:`dtm_mpi.console`); a job's log then shows where every rank is, which is how to find the
rank a hung job waits for, and how a test waits for a moment of a run instead of sleeping.
"""

from __future__ import annotations

import logging
from functools import cache

from dtm_mpi.config import get_config
from dtm_mpi.console import write_line

__all__ = ["debug_enabled", "info_enabled", "log_debug", "log_info", "logger", "reset"]


class _WholeLines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_line(self.format(record))
        except Exception:  # pragma: no cover  (stderr closed)
            self.handleError(record)


@cache
def logger() -> logging.Logger:
    """The ``dtm_mpi`` logger at ``DTM_LOG``'s level (a handler of its own only when a level
    other than the default was asked for: otherwise the application's logging decides)."""
    log = logging.getLogger("dtm_mpi")
    for handler in [h for h in log.handlers if isinstance(h, _WholeLines)]:
        log.removeHandler(handler)  # (configured again after reset())
    level = get_config().log_level
    log.setLevel(level.upper())
    mine = level != "warning"
    if mine:
        log.addHandler(_WholeLines())
    log.propagate = not mine
    return log


def reset() -> None:
    """Read ``DTM_LOG`` again on next use (after ``get_config.cache_clear()``, in tests)."""
    for cached in (logger, info_enabled, debug_enabled):
        cached.cache_clear()


@cache
def info_enabled() -> bool:
    return logger().isEnabledFor(logging.INFO)


@cache
def debug_enabled() -> bool:
    return logger().isEnabledFor(logging.DEBUG)


def log_info(rank: int, text: str) -> None:
    """``[rank R] dtm: text`` at level info."""
    if info_enabled():
        logger().info("[rank %d] dtm: %s", rank, text)


def log_debug(rank: int, text: str) -> None:
    """``[rank R] dtm: text`` at level debug."""
    if debug_enabled():
        logger().debug("[rank %d] dtm: %s", rank, text)
