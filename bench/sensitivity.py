"""Sensitivity: does auto's cost proxy rank group steps the way llama.cpp's measured KL does? (issue 28)

On Gemma 3 270M (the PyPI GGUF, as bench/fidelity.py), inside one `auto` job's decompose stage
(run with ``min_top1`` so that calibrate's reference of the calibration text is there and every
rung's bytes are kept, exactly as the quality search has them):

- base: every candidate tensor on the dearest rung of its hull (the high-precision end);
- a group is one matrix kind over a third of the layers (7 kinds x 3 spans), or the token
  embedding; for each group and each depth d in 1..``--depth``, the file with that group's
  tensors d hull rungs below the base and everything else on the base;
- every file is written by the package stage's writer (`stages.gguf_build`) and run by llama.cpp
  over the first ``--positions`` positions of the calibration text, scored against the source's
  reference: mean KL(source || file) and top-1, as the search scores its trials;
- the proxy of a step is what the allocator ranks by: the sum over the group's tensors of the
  rung cost increase (`auto._cost`, importance-weighted when calibrate made an imatrix).

It prints one row per step (bytes saved, proxy, measured KL rise, top-1) and the Spearman rank
correlation between the proxy and the measured rise, over all steps and over the first step of
each group. The job then goes on (search, package, validate) as usual.

    .venv/bin/python bench/sensitivity.py [--workdir DIR] [--depth 2] [--positions 1024]

Last line: ``sensitivity: groups=… points=… spearman=… spearman_depth1=… spearman_per_byte=…
spearman_within_kind_median=… base_kl=… seconds=…`` (within kind: the correlation over one matrix
kind's steps, the median over kinds). Target (issue 28): spearman >= 0.9 for the proxy to stand in for the
measurement; below that, the allocator needs the measured sensitivity itself.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench.fidelity import _gemma, _threads  # noqa: E402

_SPANS = 3


@dataclass(frozen=True)
class Step:
    group: str
    depth: int
    saved_bytes: int
    proxy: float
    kl_rise: float
    top1: float


def ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (Pearson's on the ranks); nan for fewer than 3 points."""
    if len(xs) < 3:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx and vy else float("nan")


def _groups(names: list[str]) -> dict[str, list[str]]:
    layers = sorted({int(n.split(".")[1]) for n in names if n.startswith("blk.")})
    span = max(1, -(-len(layers) // _SPANS))
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


def measure_steps(ctx: Any, weighted: bool, depth: int, positions: int) -> tuple[float, list[Step]]:
    """(the base file's KL, every group step) for one decompose stage's search inputs."""
    from pipeline.calibration.agreement import score_gguf
    from pipeline.calibration.answers import CALIBRATION
    from pipeline.stages.decompose.auto import choose
    from pipeline.stages.decompose.search import _assemble
    from pipeline.ternary.allocate import hull
    from pipeline.ternary.policy import TensorDecision

    rungs = ctx.candidates.rungs
    top = choose(ctx.candidates, ctx.plan, ctx.recipe, 1e6, weighted)  # every upgrade bought
    hulls = {name: hull(r) for name, r in rungs.items()}
    base = {name: h[-1] for name, h in hulls.items()}
    counter = [0]

    def score(chosen: dict[str, int]) -> tuple[float, float]:
        decisions = dict(top.decisions)
        for name, index in chosen.items():
            rung = rungs[name][index]
            decisions[name] = TensorDecision(rung.ggml_type, rung.ggml_type == "Q2_0",
                                             f"{name}: sensitivity {rung.label}", levels=rung.levels)
        counter[0] += 1
        folder = ctx.workdir / f".sensitivity-{counter[0]}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        try:
            path = _assemble(ctx, replace(top, decisions=decisions), folder)
            stats = score_gguf(path, ctx.reference, names=[CALIBRATION], n_threads=_threads(),
                               max_positions=positions).stats
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return stats.mean_kl, stats.top1_agreement

    base_kl, base_top1 = score(base)
    print(f"base: KL {base_kl:.5f}, top-1 {base_top1:.4f}", flush=True)
    steps = []
    for group, names in _groups(list(rungs)).items():
        previous = dict.fromkeys(names, -1)
        for d in range(1, depth + 1):
            lowered = {n: hulls[n][max(0, hulls[n].index(base[n]) - d)] for n in names}
            if lowered == previous or all(lowered[n] == base[n] for n in names):
                continue  # the hull ends above this depth: no new step
            previous = lowered
            proxy = sum(rungs[n][lowered[n]].cost - rungs[n][base[n]].cost for n in names)
            saved = sum(rungs[n][base[n]].n_bytes - rungs[n][lowered[n]].n_bytes for n in names)
            kl, top1 = score({**base, **lowered})
            step = Step(group, d, saved, proxy, kl - base_kl, top1)
            labels = sorted({rungs[n][lowered[n]].label for n in names})
            print(f"  {group:22s} -{d} -> {','.join(labels):14s} saves {saved / 1e6:7.2f} MB  proxy "
                  f"{proxy:11.4g}  KL +{step.kl_rise:.5f}  top-1 {top1:.4f}", flush=True)
            steps.append(step)
    return base_kl, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--depth", type=int, default=2, help="hull rungs below the base per group")
    parser.add_argument("--positions", type=int, default=1024, help="calibration positions scored per file")
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bonsai-sensitivity-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    from pipeline.core.settings import Settings
    from pipeline.db import repo
    from pipeline.db.session import session_scope
    from pipeline.orchestration.bootstrap import build_runtime
    from pipeline.orchestration.embedded import run_job
    from pipeline.stages.decompose import search as search_module

    source = _gemma(work)
    found: dict[str, Any] = {}
    real_search = search_module.search

    def measuring_search(ctx: Any, weighted: bool) -> Any:
        found["base_kl"], found["steps"] = measure_steps(ctx, weighted, args.depth, args.positions)
        return real_search(ctx, weighted)

    search_module.search = measuring_search  # the stage imports it when it searches
    rt = build_runtime(Settings(home=work / "home"))
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, str(source), "auto", {"min_top1": 0.6}).id
    run_job(rt, job_id)
    if "steps" not in found:
        print("the decompose stage never searched: no steps measured", file=sys.stderr)
        return 1
    steps: list[Step] = found["steps"]
    first = [s for s in steps if s.depth == 1]
    per_byte = spearman([s.proxy / s.saved_bytes for s in steps], [s.kl_rise / s.saved_bytes for s in steps])
    kinds: dict[str, list[Step]] = {}
    for s in steps:
        kinds.setdefault(s.group.split("[")[0], []).append(s)
    within = sorted(spearman([s.proxy for s in kind], [s.kl_rise for s in kind])
                    for kind in kinds.values() if len(kind) >= 3)
    figures = {
        "groups": len({s.group for s in steps}),
        "points": len(steps),
        "spearman": f"{spearman([s.proxy for s in steps], [s.kl_rise for s in steps]):.3f}",
        "spearman_depth1": f"{spearman([s.proxy for s in first], [s.kl_rise for s in first]):.3f}",
        "spearman_per_byte": f"{per_byte:.3f}",
        "spearman_within_kind_median": f"{within[len(within) // 2]:.3f}" if within else "nan",
        "base_kl": f"{found['base_kl']:.5f}",
        "seconds": f"{time.monotonic() - started:.0f}",
    }
    print("sensitivity: " + " ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
