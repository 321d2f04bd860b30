"""Within one process, the news that a stage run ended: what an attempt deferred behind an equal run waits on.

An attempt whose cache key matches a run in flight stays pending until that run ends (`execution`).
In embedded mode that run is usually another job's thread of this very process (`bonsai serve`, or
two jobs of one checkpoint): the deferred attempt waits on this condition and starts again the
moment any run here ends, instead of on a timer. A run in another process (a second `bonsai convert`
on the same home) cannot signal here, so the wait has a timeout for it. The distributed dispatcher
keeps its countdown: its workers are other processes.
"""

from __future__ import annotations

import threading

__all__ = ["mark", "announce", "wait_after"]

_ended = threading.Condition()
_count = 0


def mark() -> int:
    """How many runs have ended in this process so far: take it before looking for an equal run."""
    with _ended:
        return _count


def announce() -> None:
    """A run of this process reached a final state: wake every attempt waiting behind one."""
    global _count
    with _ended:
        _count += 1
        _ended.notify_all()


def wait_after(seen: int, timeout_s: float) -> bool:
    """Wait until a run ends after ``seen`` (`mark`), at most ``timeout_s``; True when one did."""
    with _ended:
        return _ended.wait_for(lambda: _count != seen, timeout_s)
