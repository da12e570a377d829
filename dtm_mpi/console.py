"""The lines dtm prints while it runs, each written whole.

Under ``mpirun`` or ``srun`` every rank's stdout and stderr reach the launcher through pipes,
and the launcher forwards each chunk as it reads it, merging ranks and streams into one
output. ``print(text)`` writes the text and then the newline: two system calls where the
stream writes through (``python -u``, ``PYTHONUNBUFFERED``, as in most job scripts), and
another rank's or stream's line can land between them (``...(after step 5)dtm run: stopped
by SIGUSR1...``), which breaks every log reader that matches at the start of a line. A line
written in one call arrives whole (a pipe delivers a write of up to 4,096 bytes unsplit).
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["say", "write_line"]


def _whole(stream: TextIO, text: str) -> None:
    stream.write(text + "\n")
    stream.flush()


def say(text: str) -> None:
    """Print ``text`` (one or more lines) to stdout in one write, then flush."""
    _whole(sys.stdout, text)


def write_line(text: str) -> None:
    """Print ``text`` (one or more lines) to stderr in one write, then flush."""
    _whole(sys.stderr, text)
