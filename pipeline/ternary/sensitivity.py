"""Measured sensitivity: rung costs in nats of KL, from files llama.cpp ran, instead of the proxy.

The allocator's proxy (importance-weighted squared error, `allocate`) is not comparable across
matrix kinds: on Gemma 3 270M it ranks the KL that lowering a group adds with a Spearman
correlation of 0.11 to 0.16 (bench/sensitivity.py). So the cost of a step is measured instead:

- the *base* puts every candidate tensor on the dearest rung of its hull;
- a *group* is one matrix kind over a span of layers (`groups_of`), or a head tensor alone;
- lowering a group by *depth* d moves each of its tensors d hull rungs down from the base
  (`lowered`); the file with that group lowered and everything else on the base is run, and the
  KL it adds over the base is the step's measured rise.

`measured_rungs` turns those rises into per-tensor rung costs the allocator ranks on: each
group's rise between two depths is shared among the tensors that moved by their proxy
increments (the proxy ranks reasonably within one kind), so a group's tensor costs sum to its
measured rise at every depth and the base costs nothing. Rungs off a tensor's hull keep off it.
The allocator stays as it is, so allocations for increasing budgets stay nested; their predicted
KL (`predicted_kl`) assumes the groups' rises add up, which the search checks against llama.cpp.
They add up near the top (Gemma 3 270M at 4.8 bpw and above: within 0.03 nats) but not where
many groups are low at once (at 4.0 bpw: 0.96 predicted, 2.77 measured): the errors compound.
Measuring the bottom steps from an all-cheapest file instead does not help: that file is broken
(KL 3.2) and raising one group changes it by noise.

So the allocations follow a measured chain instead (`descend`): from the base, one group step at a
time, the step that adds least KL per byte *on top of the steps already taken*, each measured in
that context (lazily: a step's single-group rise is its estimate until it is the best one). A
budget takes the chain's first point that fits (`along_chain`): nested by construction, and the
KL of every point down to the one where the file breaks (`STOP_KL`) was measured, not summed.

Example::

    groups = groups_of(list(rungs))
    rises = {("ffn_down[0-5]", 1): 0.128, ("ffn_down[0-5]", 2): 0.9, ...}  # measured in llama.cpp
    costs = measured_rungs(rungs, groups, rises)
    chain = descend(rungs, groups, rises, base_kl, run_in_llama_cpp)
    chosen, _ = along_chain(rungs, groups, chain, budget_bytes)  # the fitted hulls, not costs
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from pipeline.formats.sensitivity import ChainStep
from pipeline.ternary.allocate import Rung, hull

__all__ = ["groups_of", "depths_of", "lowered", "measured_rungs", "predicted_kl", "descend", "along_chain",
           "step_bytes", "SPANS", "STOP_KL", "SLACK"]

SPANS = 3  # layer spans per matrix kind: 3 x 7 kinds + the heads, about 22 files per depth
# Past this KL over the source (nats) a file is broken (Gemma 3 270M fails validation from about 0.5):
# the chain below it is ordered by the single steps, not measured.
STOP_KL = 1.0
# A re-measured step is taken while its KL per byte is within this factor of the next step's estimate:
# a closer race is noise at a few hundred positions, and each re-measure is a file.
SLACK = 1.25


def groups_of(names: Sequence[str], spans: int = SPANS) -> dict[str, list[str]]:
    """The candidate tensors by group, ``kind[first-last]`` over ``spans`` runs of layers, a tensor
    outside the blocks (the embedding, the output head) a group of its own; sorted by key."""
    layers = sorted({int(name.split(".")[1]) for name in names if name.startswith("blk.")})
    span = max(1, -(-len(layers) // spans))
    groups: dict[str, list[str]] = {}
    for name in names:
        if name.startswith("blk."):
            index, kind = int(name.split(".")[1]), name.split(".")[2]
            first = layers[0] + (index - layers[0]) // span * span
            key = f"{kind}[{first}-{min(first + span, layers[-1] + 1) - 1}]"
        else:
            key = name.removesuffix(".weight")
        groups.setdefault(key, []).append(name)
    return dict(sorted(groups.items()))


def depths_of(rungs: Mapping[str, Sequence[Rung]], names: Sequence[str]) -> int:
    """How many hull rungs a group can go down from its base: its longest tensor hull's steps."""
    return max((len(hull(rungs[name])) - 1 for name in names), default=0)


def lowered(rungs: Mapping[str, Sequence[Rung]], names: Sequence[str], depth: int) -> dict[str, int]:
    """Each of ``names``'s rung index ``depth`` hull rungs below the top of its hull (a shorter hull
    stops at its cheapest rung); depth 0 is the base."""
    out = {}
    for name in names:
        path = hull(rungs[name])
        out[name] = path[max(0, len(path) - 1 - depth)]
    return out


def measured_rungs(
    rungs: Mapping[str, Sequence[Rung]], groups: Mapping[str, Sequence[str]],
    rises: Mapping[tuple[str, int], float],
) -> dict[str, list[Rung]]:
    """Every tensor's rungs with measured costs (nats): 0 on the base, and at each depth the group's
    measured rise (``rises[(group, depth)]``: the KL it added over the base; kept from falling with
    depth, a step down never counts as a gain) shared among the tensors that moved by their proxy
    increments. A rung off the hull costs a hair more than the hull rung below it in bytes, so it
    stays off. ValueError when a group has no measured rise at a depth its hull reaches (at every
    such depth some tensor moves: the one with the longest hull)."""
    out: dict[str, list[Rung]] = {}
    for group, names in groups.items():
        here = lowered(rungs, names, 0)
        cost = {name: {here[name]: 0.0} for name in names}
        rise = 0.0
        for depth in range(1, depths_of(rungs, names) + 1):
            there = lowered(rungs, names, depth)
            moved = [name for name in names if there[name] != here[name]]
            if (group, depth) not in rises:
                raise ValueError(f"no measured rise for group {group} at depth {depth}")
            added = max(0.0, rises[(group, depth)] - rise)
            rise += added
            proxy = {n: max(0.0, rungs[n][there[n]].cost - rungs[n][here[n]].cost) for n in moved}
            total = sum(proxy.values())
            for name in moved:
                share = proxy[name] / total if total > 0 else 1.0 / len(moved)
                cost[name][there[name]] = cost[name][here[name]] + added * share
            here = there
        for name in names:
            out[name] = _with_costs(rungs[name], cost[name])
    return out


def _with_costs(rungs: Sequence[Rung], on_hull: Mapping[int, float]) -> list[Rung]:
    by_bytes = sorted(on_hull, key=lambda i: rungs[i].n_bytes)
    out = []
    for index, rung in enumerate(rungs):
        if index in on_hull:
            out.append(replace(rung, cost=on_hull[index]))
            continue
        below = [i for i in by_bytes if rungs[i].n_bytes <= rung.n_bytes]
        # A hair dearer than that hull rung, so that a tie in bytes (Q2_0/3 beside Q2_0/4) is its.
        out.append(replace(rung, cost=math.nextafter(on_hull[below[-1] if below else by_bytes[0]], math.inf)))
    return out


def predicted_kl(base_kl: float, rungs: Mapping[str, Sequence[Rung]], chosen: Mapping[str, int]) -> float:
    """The KL an allocation should have if the groups' measured rises add up: the base's plus every
    chosen rung's measured cost."""
    return base_kl + sum(rungs[name][index].cost for name, index in chosen.items())


def step_bytes(rungs: Mapping[str, Sequence[Rung]], names: Sequence[str], depth: int) -> int:
    """Bytes a group saves going from ``depth - 1`` to ``depth``."""
    above, below = lowered(rungs, names, depth - 1), lowered(rungs, names, depth)
    return sum(rungs[n][above[n]].n_bytes - rungs[n][below[n]].n_bytes for n in names)


def descend(
    rungs: Mapping[str, Sequence[Rung]], groups: Mapping[str, Sequence[str]],
    rises: Mapping[tuple[str, int], float], base_kl: float,
    measure: Callable[[dict[str, int]], tuple[float, float]], stop_kl: float = STOP_KL, slack: float = SLACK,
) -> list[ChainStep]:
    """The chain from the base (depth 0 everywhere) to every group's deepest step, one group step at
    a time: each time, the step that adds least KL per byte saved *on top of the steps taken*.

    Lazy greedy: a step's estimate starts as its single-group rise (``rises``, from the base) per
    byte; the best estimate is measured in context (``measure(chosen)``: the file's KL and top-1)
    and taken if it is still within ``slack`` of the next estimate, else it goes back with its fresh
    figure. Lowering more makes each step dearer, so the estimates are mostly low and the fresh
    figures keep their order. Once a taken file's KL reaches ``stop_kl`` the file is broken and
    measuring stops: the rest of the chain follows the estimates, with no KL."""
    depth = {group: 0 for group in groups}
    chosen = lowered(rungs, [n for names in groups.values() for n in names], 0)
    kl_now, version, measuring = base_kl, 0, True

    def estimate(group: str, step: int) -> tuple[float, str, int, float, float]:
        rise = rises[(group, step)] - (rises[(group, step - 1)] if step > 1 else 0.0)
        return rise / max(1, step_bytes(rungs, groups[group], step)), group, -1, math.nan, math.nan

    heap = [estimate(group, 1) for group, names in groups.items() if depths_of(rungs, names) >= 1]
    heapq.heapify(heap)
    chain: list[ChainStep] = []
    while heap:
        key, group, seen, kl, top1 = heapq.heappop(heap)
        step = depth[group] + 1
        there = {**chosen, **lowered(rungs, groups[group], step)}
        saved = step_bytes(rungs, groups[group], step)
        if measuring and seen != version:
            kl, top1 = measure(there)
            key = (kl - kl_now) / max(1, saved)
            if heap and key > heap[0][0] + abs(heap[0][0]) * (slack - 1.0):
                heapq.heappush(heap, (key, group, version, kl, top1))
                continue
        chain.append(ChainStep(group, step, saved, round(kl, 6) if measuring else None,
                               round(top1, 6) if measuring else None))
        chosen, depth[group], version = there, step, version + 1
        if measuring:
            kl_now = kl
            measuring = kl_now < stop_kl
        if step < depths_of(rungs, groups[group]):
            heapq.heappush(heap, estimate(group, step + 1))
    return chain


def along_chain(rungs: Mapping[str, Sequence[Rung]], groups: Mapping[str, Sequence[str]],
                chain: Sequence[ChainStep], budget_bytes: int) -> tuple[dict[str, int], int]:
    """The first point of the chain (from the base down) whose tensors fit ``budget_bytes``: the rung
    index of each tensor, and how many chain steps it took (0: the base). A larger budget stops
    earlier, so it holds every rung a smaller one does and more: allocations are nested."""
    chosen = lowered(rungs, [n for names in groups.values() for n in names], 0)
    size = sum(rungs[name][index].n_bytes for name, index in chosen.items())
    taken = 0
    for step in chain:
        if size <= budget_bytes:
            break
        chosen.update(lowered(rungs, groups[step.group], step.depth))
        size -= step.saved_bytes
        taken += 1
    return chosen, taken
