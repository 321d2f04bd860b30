"""A per-worker memory cap: a stage attempt that grows past it is recorded as "out of memory" and stopped.

The kernel's out-of-memory killer gives no reason and may take the whole machine's worst
process; this guard watches the attempt's own process (its resident set, read from /proc
every 0.1 s), records the failure with both numbers while it still can, and then kills the
process so the memory is given back at once. The attempt is retryable; the job fails once
the attempt limit is reached, with the reason.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

__all__ = ["MemoryGuard", "rss_bytes"]

log = logging.getLogger(__name__)

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident set size in bytes (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm", "rb") as handle:
            return int(handle.read().split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


class MemoryGuard:
    """Calls `on_exceeded(rss_bytes)` once when this process grows past `limit_bytes`; a context manager."""

    def __init__(self, limit_bytes: int, on_exceeded: Callable[[int], None], interval_s: float = 0.1) -> None:
        self.limit_bytes, self._on_exceeded, self._interval_s = limit_bytes, on_exceeded, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memory-guard", daemon=True)

    def __enter__(self) -> MemoryGuard:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            used = rss_bytes()
            if used > self.limit_bytes:
                log.error("stage process uses %d MB, over the %d MB cap", used >> 20, self.limit_bytes >> 20)
                self._on_exceeded(used)
                return
