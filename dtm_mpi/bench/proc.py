"""What the benchmarks read of this process from ``/proc/self/status`` (Linux)."""

from __future__ import annotations

__all__ = ["status_kib"]


def status_kib(field: str) -> int:
    """The ``field`` of ``/proc/self/status`` in KiB (``VmRSS``: resident now, ``VmHWM``: the
    peak), 0 where it is not there."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0
