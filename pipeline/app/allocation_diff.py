"""Which tensors moved between two ``auto`` jobs' allocations, and which way: why one budget broke.

Read from the decompose attempts' metrics (``auto_types``: each candidate tensor's chosen rung),
so no artifact is fetched. Jobs on different sources can be compared; the answer says so.

Example::

    allocation_diff(job_5, job_4)
    # {"against": 4, "same_source": True, "up": [{"tensor": "blk.3.ffn_down.weight",
    #   "from": "Q2_0/4", "to": "Q4_K"}], "down": [...], "unchanged": 120, ...}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.core.states import StageName, StageState
from pipeline.db.models import Job
from pipeline.ternary.allocate import rung_rank

__all__ = ["allocation_diff", "auto_types"]


def auto_types(job: Job) -> dict[str, str] | None:
    """The rung each candidate tensor got in the job's newest successful decompose; None when it ran
    no ``auto`` allocation (another recipe, not run yet, or made before the metric existed)."""
    runs = [r for r in job.stage_runs if r.stage == StageName.DECOMPOSE and not r.shard
            and r.status == StageState.SUCCEEDED]
    if not runs:
        return None
    chosen = (max(runs, key=lambda r: r.attempt).metrics or {}).get("auto_types")
    return {str(k): str(v) for k, v in chosen.items()} if isinstance(chosen, Mapping) else None


def _rank(label: str) -> tuple[float, int]:
    try:
        return rung_rank(label)
    except ValueError:  # a type this version does not know: compared by name only
        return (0.0, 0)


def allocation_diff(job: Job, other: Job) -> dict[str, Any]:
    """How `job`'s allocation differs from `other`'s: tensors that went up or down a rung (``from``
    is `other`'s, ``to`` is `job`'s), how many stayed, and tensors only one of them allocated."""
    here, there = auto_types(job), auto_types(other)
    diff: dict[str, Any] = {"against": other.id, "same_source": job.source == other.source}
    missing = [f"job {j.id}" for j, types in ((job, here), (other, there)) if types is None]
    if here is None or there is None:
        diff["error"] = (f"{' and '.join(missing)} made no auto allocation (recipe auto, decompose "
                         "succeeded); nothing to compare")
        return diff
    both = sorted(set(here) & set(there))
    moved: dict[str, list[dict[str, str]]] = {"up": [], "down": []}
    for name in both:
        was, now = there[name], here[name]
        if was != now:
            way = "up" if _rank(now) > _rank(was) else "down"
            moved[way].append({"tensor": name, "from": was, "to": now})
    diff.update(
        up=moved["up"], down=moved["down"],
        unchanged=len(both) - len(moved["up"]) - len(moved["down"]),
        only_here=sorted(set(here) - set(there)), only_there=sorted(set(there) - set(here)),
    )
    return diff
