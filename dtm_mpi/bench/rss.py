"""Resident memory while something runs: a thread samples this process's RSS
(``/proc/self/statm``) every millisecond or so, and :class:`RssPeak` reports the highest
sample above the RSS at the start (what a step takes on top of what the process held).

glibc keeps freed memory in the process once its mmap threshold has grown (it grows with the
largest block freed, up to 32 MiB), so a warm process's RSS hides what a step allocates:
:func:`return_freed_memory` fixes the threshold low, so blocks of 64 KiB and more are mapped
on their own and go back to the system when freed."""

from __future__ import annotations

import os
import threading
import time
from types import TracebackType
from typing import Any

__all__ = ["RssPeak", "return_freed_memory", "rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name is not None else None
    except OSError:
        return None


def return_freed_memory(threshold: int = 64 << 10) -> bool:
    """Make glibc map blocks of ``threshold`` bytes and more on their own (returned to the
    system when freed) and give back the free memory it holds now; False where the C
    library is not glibc. (Mapping every large block costs page faults: measure time
    before.)"""
    libc = _libc()
    try:
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, threshold) == 1
        ok = ok and libc.mallopt(m_trim_threshold, threshold) == 1
        libc.malloc_trim(0)
        return bool(ok)
    except AttributeError:  # (no libc, or not glibc)
        return False


def rss_bytes() -> int:
    """This process's resident set now (0 where ``/proc`` is absent)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


class RssPeak:
    """``with RssPeak() as peak: ...``; then ``peak.above`` is the highest RSS seen inside the
    block minus the RSS at its start (after the allocator's free memory went back to the
    system), in bytes (sampled every ``period_s``)."""

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s = period_s
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.period_s)

    def __enter__(self) -> RssPeak:
        libc = _libc()
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)  # the free memory the allocator holds back to the system
        self.base = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, name="rss-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def above(self) -> int:
        return max(0, self.peak - self.base)
