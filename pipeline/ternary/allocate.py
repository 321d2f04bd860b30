"""Mixed precision by sensitivity: which type each tensor gets so the file meets a size budget.

Each candidate tensor has a ladder of storage types, cheapest first (`ladder`): ternary Q2_0,
the 4-level Q2_0, then llama.cpp's K-quants (Q4_K, Q6_K) where rows are whole 256-blocks or its
legacy quants (Q4_0, Q5_0) where they are not, then Q8_0. Its *cost* on each rung is the
importance-weighted squared error Σⱼ impⱼ Σᵢ (wᵢⱼ − ŵᵢⱼ)² of that rung's bytes: the expected
squared change of the layer's output per token under the calibration activations (with no
importance recorded, imp = 1). `allocate` starts every tensor on its cheapest rung and then
buys upgrade steps in one fixed order, the largest cost drop per added byte first (steps that
are not on a tensor's lower convex hull are merged, so a rung that buys little is skipped over),
until the next step no longer fits. The result minimises the summed cost under the budget up
to the granularity of one step, and the allocations of increasing budgets are nested: more
bytes never move a tensor down a rung, so the size-quality curve has no cliff of the
allocator's making.

Example::

    rungs = [Rung("Q2_0", 3, 1800, 9.1), Rung("Q4_K", None, 3600, 0.8), Rung("Q8_0", None, 6800, 0.01)]
    allocate({"blk.0.ffn_up.weight": rungs}, budget_bytes=4000)   # {'blk.0.ffn_up.weight': 1} (Q4_K)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.formats.gguf.types import GGMLTypeName

__all__ = ["ALLOCATOR_VERSION", "Rung", "rung_label", "rung_rank", "ladder", "hull", "upgrades", "allocate"]

_QK_K, _Q2_0_BLOCK, _LEGACY_BLOCK = 256, 64, 32
# Changes when the same rungs and budget may give another allocation: part of decompose's cache key
# for the auto recipe, so a store never hands back an allocation an older allocator made.
ALLOCATOR_VERSION = "2-nested"
# A step adding more than this share of all upgrade bytes is a giant one (see `upgrades`).
_GIANT_SHARE = 1 / 32


@dataclass(frozen=True)
class Rung:
    """One storage choice for a tensor: its type (``levels`` for Q2_0), bytes, and weighted error."""

    ggml_type: str
    levels: int | None
    n_bytes: int
    cost: float

    @property
    def label(self) -> str:
        return rung_label(self.ggml_type, self.levels)


def rung_label(ggml_type: str, levels: int | None) -> str:
    """How a storage choice is named in reports: its type, with Q2_0's levels (``Q2_0/3``)."""
    return f"{ggml_type}/{levels}" if levels else ggml_type


def rung_rank(label: str) -> tuple[float, int]:
    """Where a `Rung.label` stands among storage choices: bits per weight, then Q2_0's levels (the
    4-level grid costs no more bytes than the ternary one and holds more). ValueError for a type
    with no known block size."""
    from pipeline.formats.gguf.types import block_geometry

    ggml_type, _, levels = label.partition("/")
    block, size = block_geometry(ggml_type)
    return size * 8 / block, int(levels or 0)


def ladder(cols: int, is_linear: bool) -> list[tuple[str, int | None]]:
    """The (type, levels) candidates for a tensor with rows of ``cols``, cheapest first.

    Block linear weights start ternary; the token embedding and output head start at 4 bits
    (a lookup table keeps no block structure a ternary fit could exploit). Empty: no
    quantized type fits these rows (the tensor stays 16-bit).
    """
    rungs: list[tuple[str, int | None]] = []
    if is_linear and cols % _Q2_0_BLOCK == 0:
        rungs += [(GGMLTypeName.Q2_0, 3), (GGMLTypeName.Q2_0, 4)]
    if cols % _QK_K == 0:
        rungs += [(GGMLTypeName.Q4_K, None), (GGMLTypeName.Q6_K, None)]
    elif cols % _LEGACY_BLOCK == 0:
        rungs += [(GGMLTypeName.Q4_0, None), (GGMLTypeName.Q5_0, None)]
    if cols % _LEGACY_BLOCK == 0:
        rungs.append((GGMLTypeName.Q8_0, None))
    return rungs


def hull(rungs: Sequence[Rung]) -> list[int]:
    """Indices of the rungs on the lower convex hull of (bytes, cost), cheapest first.

    A rung above the hull (dearer than the next one for what it saves, or no better than a
    cheaper one) is never worth stopping at: the greedy steps over it.
    """
    order = sorted(range(len(rungs)), key=lambda i: (rungs[i].n_bytes, rungs[i].cost))
    kept: list[int] = []
    for i in order:
        if kept and rungs[i].cost >= rungs[kept[-1]].cost:
            continue  # more bytes, no less error
        while len(kept) >= 2:
            a, b = rungs[kept[-2]], rungs[kept[-1]]
            c = rungs[i]
            # b is above the segment a-c: its drop per byte is worse than going straight to c.
            if (a.cost - b.cost) * (c.n_bytes - a.n_bytes) <= (a.cost - c.cost) * (b.n_bytes - a.n_bytes):
                kept.pop()
            else:
                break
        kept.append(i)
    return kept


@dataclass
class _Step:
    name: str
    index: int  # the rung this step reaches
    size: int  # bytes it adds
    gain: float  # cost drop per added byte
    wait: int = 0  # bytes of other steps still to buy before it (a giant step)


def _hull_steps(candidates: Mapping[str, Sequence[Rung]]) -> list[_Step]:
    steps: list[_Step] = []
    for name, rungs in candidates.items():
        path = hull(rungs) if rungs else []
        for here, there in zip(path, path[1:], strict=False):
            size = rungs[there].n_bytes - rungs[here].n_bytes
            steps.append(_Step(name, there, size, (rungs[here].cost - rungs[there].cost) / max(size, 1)))
    # A tensor's hull steps drop less per byte the higher they go, so each tensor's come bottom up.
    steps.sort(key=lambda step: (-step.gain, step.name, step.index))
    return steps


def upgrades(candidates: Mapping[str, Sequence[Rung]]) -> list[tuple[str, int]]:
    """Every upgrade step on every tensor's hull, in the one order the budget buys them,
    ``(name, rung index reached)``: the largest cost drop per added byte first, except that a giant
    step (over `_GIANT_SHARE` of all the upgrade bytes: a vocabulary-sized embedding's) waits until
    as many bytes of the steps after it have been bought.

    Without the wait a giant step would stand in the way of every step after it until the budget
    covers it; with it, the budgets below it buy small steps instead, and it is bought once the
    budget has grown by its size. A tensor's steps stay in their order.
    """
    steps = _hull_steps(candidates)
    giant = sum(step.size for step in steps) * _GIANT_SHARE
    order: list[tuple[str, int]] = []
    waiting: list[_Step] = []

    def buy(step: _Step) -> None:
        order.append((step.name, step.index))
        for other in waiting:
            other.wait -= step.size

    def release(everything: bool = False) -> None:
        while True:
            heads: dict[str, _Step] = {}  # each tensor's first waiting step
            for step in waiting:
                heads.setdefault(step.name, step)
            ready = next((s for s in heads.values() if s.wait <= 0 or everything), None)
            if ready is None:
                return
            waiting.remove(ready)
            buy(ready)

    for step in steps:
        if step.size > giant or any(other.name == step.name for other in waiting):
            step.wait = step.size if step.size > giant else 0
            waiting.append(step)
        else:
            buy(step)
        release()
    release(everything=True)
    return order


def allocate(candidates: Mapping[str, Sequence[Rung]], budget_bytes: int) -> dict[str, int]:
    """The rung index chosen for each tensor: cheapest rungs, then the upgrades in `upgrades` order
    until the next one does not fit.

    Stopping at the first step that does not fit (rather than skipping to smaller ones) makes
    the allocations nested: a larger budget buys every upgrade a smaller one bought, and more,
    so no tensor ever goes down a rung when the budget goes up. The price is at most one step's
    bytes of the budget left unspent (a giant step's, while it is the next one). Every tensor gets
    at least its cheapest rung even when those alone exceed the budget (the caller reports that
    the target was not reachable).
    """
    chosen = {name: hull(rungs)[0] for name, rungs in candidates.items() if rungs}
    spent = sum(candidates[name][index].n_bytes for name, index in chosen.items())
    for name, index in upgrades(candidates):
        step = candidates[name][index].n_bytes - candidates[name][chosen[name]].n_bytes
        if spent + step > budget_bytes:
            break
        spent += step
        chosen[name] = index
    return chosen
