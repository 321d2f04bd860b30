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

__all__ = ["Rung", "rung_label", "rung_rank", "ladder", "hull", "upgrades", "allocate"]

_QK_K, _Q2_0_BLOCK, _LEGACY_BLOCK = 256, 64, 32


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
        rungs += [("Q2_0", 3), ("Q2_0", 4)]
    if cols % _QK_K == 0:
        rungs += [("Q4_K", None), ("Q6_K", None)]
    elif cols % _LEGACY_BLOCK == 0:
        rungs += [("Q4_0", None), ("Q5_0", None)]
    if cols % _LEGACY_BLOCK == 0:
        rungs.append(("Q8_0", None))
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


def upgrades(candidates: Mapping[str, Sequence[Rung]]) -> list[tuple[str, int]]:
    """Every upgrade step on every tensor's hull, in the one order the budget buys them: the
    largest cost drop per added byte first; ``(name, rung index reached)``.

    A tensor's hull steps drop less per byte the higher they go (that is what the hull is), so
    this order takes each tensor's steps bottom up.
    """
    steps: list[tuple[float, str, int, int]] = []
    for name, rungs in candidates.items():
        path = hull(rungs) if rungs else []
        for at in range(len(path) - 1):
            here, there = rungs[path[at]], rungs[path[at + 1]]
            gain = (here.cost - there.cost) / max(there.n_bytes - here.n_bytes, 1)
            steps.append((-gain, name, at + 1, path[at + 1]))
    steps.sort(key=lambda step: step[:3])
    return [(name, index) for _gain, name, _at, index in steps]


def allocate(candidates: Mapping[str, Sequence[Rung]], budget_bytes: int) -> dict[str, int]:
    """The rung index chosen for each tensor: cheapest rungs, then the upgrades in `upgrades` order
    until the next one does not fit.

    Stopping at the first step that does not fit (rather than skipping to smaller ones) makes
    the allocations nested: a larger budget buys every upgrade a smaller one bought, and more,
    so no tensor ever goes down a rung when the budget goes up. The price is at most one step's
    bytes of the budget left unspent. Every tensor gets at least its cheapest rung even when
    those alone exceed the budget (the caller reports that the target was not reachable).
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
