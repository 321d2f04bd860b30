"""What the store did for one stage attempt: cache hits, bytes moved, and the cache entries it pinned.

The execution code opens one window per attempt (`store_activity()`); store backends add
to the window that is open in the current context (`current_activity()`), so no store
method grows a parameter and stage code never sees any of it. Outside a window (a CLI
command, the API) nothing is counted and nothing stays pinned.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

__all__ = ["StoreActivity", "store_activity", "current_activity"]


@dataclass
class StoreActivity:
    """Counters of one window; `pinned_fds` hold shared locks that keep cache entries from eviction."""

    cache_hits: int = 0
    cache_misses: int = 0
    downloaded_bytes: int = 0
    uploaded_bytes: int = 0
    pinned_fds: list[int] = field(default_factory=list)
    # Puts of one attempt run on several threads (`store.put_all`): counts go through `add`.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Add to the named counters, safely from any thread of the attempt."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_metrics(self) -> dict[str, int]:
        """Stage-metric entries; empty when the store did no counted work (a local folder store)."""
        if not (self.cache_hits or self.cache_misses or self.downloaded_bytes or self.uploaded_bytes):
            return {}
        return {
            "store_cache_hits": self.cache_hits,
            "store_cache_misses": self.cache_misses,
            "store_downloaded_bytes": self.downloaded_bytes,
            "store_uploaded_bytes": self.uploaded_bytes,
        }


_CURRENT: ContextVar[StoreActivity | None] = ContextVar("bonsai_store_activity", default=None)


def current_activity() -> StoreActivity | None:
    """The window open in this context, or None."""
    return _CURRENT.get()


@contextmanager
def store_activity() -> Iterator[StoreActivity]:
    """Open a window; on exit its pins are released (the entries may be evicted again)."""
    activity = StoreActivity()
    token = _CURRENT.set(activity)
    try:
        yield activity
    finally:
        _CURRENT.reset(token)
        for fd in activity.pinned_fds:
            os.close(fd)
        activity.pinned_fds.clear()
