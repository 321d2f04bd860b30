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

Example::

    groups = groups_of(list(rungs))
    rises = {("ffn_down[0-5]", 1): 0.128, ("ffn_down[0-5]", 2): 0.9, ...}  # measured in llama.cpp
    costs = measured_rungs(rungs, groups, rises)
    allocate(costs, budget_bytes)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from pipeline.ternary.allocate import Rung, hull

__all__ = ["groups_of", "depths_of", "lowered", "measured_rungs", "predicted_kl", "SPANS"]

SPANS = 3  # layer spans per matrix kind: 3 x 7 kinds + the heads, about 22 files per depth


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
