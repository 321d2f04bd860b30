"""Sensitivity: measured rung costs against the proxy, and the allocations each gives (issue 28).

On Gemma 3 270M (the PyPI GGUF, as bench/fidelity.py), inside one ``auto --option
sensitivity=measured`` job's sensitivity stage, where every rung's bytes are kept:

- the stage measures its sensitivity (`stages.conversion.sensitivity`): the base file (every
  candidate on the top of its hull), then one file per group (a matrix kind over a third of the
  layers, or the embedding) and hull depth, each run by llama.cpp over the first ``--positions``
  positions of the calibration text and scored against the source's reference;
- the bench prints every step (bytes saved, the proxy's cost rise, the measured KL rise) and the
  Spearman rank correlation between proxy and measurement: over all steps, over each group's first
  step, per byte saved, and within one matrix kind (the median over kinds);
- the stage then walks its measured chain (`ternary.sensitivity.descend`: each step measured on
  top of the steps before it), whose files cost ``chain_files``;
- then, for every ``target_bpw`` of ``--sweep``, three allocations are written (package's writer,
  from the kept bytes) and scored on bench/fidelity.py's held-out text (which no calibration saw):
  top-1 and KL against the source's own logits. ``proxy``: the allocator on the proxy's costs;
  ``single``: the allocator on the single-group measured costs (the previous measured mode);
  ``chain``: the chain's first point that fits (what ``sensitivity=measured`` does now). The
  measured ones also on the calibration text, beside their predicted KL (single: the base KL plus
  the rungs' measured costs; chain: the chain file's own measured KL);
- then a second job on the same source at ``--reuse-bpw``: its sensitivity stage is reused from the
  cache (measured once per source and ladder), and the bench prints what that job took.

    .venv/bin/python bench/sensitivity.py [--workdir DIR] [--positions 512] [--sweep 4.0:6.0:0.2]
        [--reuse-bpw 5.0]

Last line: ``sensitivity: groups=… points=… spearman=… spearman_depth1=… spearman_per_byte=…
spearman_within_kind_median=… base_kl=… measure_files=… measure_s=… reused=… later_job_s=…
chain_files=… {proxy,single,chain}_violations=… {proxy,single,chain}_rungs_down=… single_better=…
chain_better=… budgets=… {single,chain}_predicted_error_median=… seconds=…`` (reused: the second
job's sensitivity stage state; violations: sweep budgets whose held-out KL is more than 0.02
above the budget before; *_better: budgets where that allocation's held-out KL is below the
proxy's; predicted_error: |predicted - measured| KL on the calibration text over the measured KL).
Targets (issue 28): spearman >= 0.9 for the proxy to stand in for the measurement; otherwise the
measured allocation, with no violation.
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

from bench.fidelity import (  # noqa: E402
    _N_CTX,
    HELD_OUT,
    _check_held_out,
    _gemma,
    _sweep_targets,
    _threads,
    score_held_out,
)


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


@dataclass
class Point:
    """One budget of the sweep under one cost model."""

    bpw: float
    size: int
    top1: float
    kl: float
    chosen: dict[str, int]
    calibration_kl: float = float("nan")
    predicted_kl: float = float("nan")


def sweep(ctx: Any, measured_ctx: Any, summary: Any, weighted: bool, targets: list[float],
          held_out: tuple[list[int], Any], positions: int) -> dict[str, list[Point]]:
    """The three allocations at every target, scored on the held-out text (the measured ones also on
    the calibration text, beside their prediction)."""
    from pipeline.calibration.agreement import score_gguf
    from pipeline.calibration.answers import CALIBRATION
    from pipeline.stages.conversion.auto import choose
    from pipeline.stages.conversion.trial import assemble

    out: dict[str, list[Point]] = {"proxy": [], "single": [], "chain": []}
    models = (("proxy", ctx, None), ("single", measured_ctx, replace(summary, chain=())),
              ("chain", measured_ctx, summary))
    for bpw in targets:
        for model, here, sens in models:
            allocation = choose(here.candidates, here.plan, here.recipe, bpw, weighted, sens)
            folder = ctx.workdir / f".sweep-{model}-{bpw}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            try:
                path = assemble(here, allocation, folder)
                top1, kl = score_held_out(path, *held_out)
                point = Point(bpw, path.stat().st_size, top1, kl,
                              {n: c.chosen for n, c in allocation.summary.candidates.items()})
                if sens is not None:  # the same file on the measurement's own text
                    stats = score_gguf(path, here.reference, names=[CALIBRATION], n_threads=_threads(),
                                       max_positions=positions).stats
                    point.calibration_kl, point.predicted_kl = stats.mean_kl, allocation.summary.predicted_kl
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            out[model].append(point)
            print(f"  {model:8s} {bpw:4.1f} bpw: {point.size / 1e6:6.1f} MB, held-out top-1 {top1:.3f} "
                  f"KL {kl:.4f}"
                  + (f"; calibration KL {point.calibration_kl:.4f} predicted {point.predicted_kl:.4f}"
                     if sens is not None else ""), flush=True)
    return out


def _violations(points: list[Point]) -> int:
    return sum(1 for a, b in zip(points, points[1:], strict=False) if b.kl > a.kl + 0.02)


def _rungs_down(points: list[Point]) -> int:
    from pipeline.ternary.allocate import rung_rank

    return sum(1 for a, b in zip(points, points[1:], strict=False) for n, label in b.chosen.items()
               if rung_rank(str(label)) < rung_rank(str(a.chosen.get(n, label))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--positions", type=int, default=512, help="calibration positions scored per file")
    parser.add_argument("--sweep", default="4.0:6.0:0.2", help="LO:HI:STEP target_bpw values ('' for none)")
    parser.add_argument("--reuse-bpw", type=float, default=5.0, help="the second job's target_bpw")
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bonsai-sensitivity-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    _check_held_out()

    import numpy as np

    from pipeline.calibration.llama_session import LlamaSession
    from pipeline.core.settings import Settings
    from pipeline.core.states import StageName
    from pipeline.db import repo
    from pipeline.db.session import session_scope
    from pipeline.orchestration.bootstrap import build_runtime
    from pipeline.orchestration.embedded import run_job
    from pipeline.stages.conversion import sensitivity as sensitivity_module

    source = _gemma(work)
    with LlamaSession(source, n_ctx=_N_CTX, n_threads=_threads()) as session:
        ids = session.tokenize(HELD_OUT)[:_N_CTX]
        held_out = (ids, np.array(session.logits(ids)))
    targets = _sweep_targets(args.sweep) if args.sweep else []
    found: dict[str, Any] = {}
    real = sensitivity_module.measure_steps

    def measuring(ctx: Any, weighted: bool, positions: int = 0) -> Any:
        summary = real(ctx, weighted, args.positions)
        found["summary"] = summary
        measured_ctx = replace(ctx, candidates=sensitivity_module.apply_measured(ctx.candidates, summary))
        found["sweep"] = sweep(ctx, measured_ctx, summary, weighted, targets, held_out, args.positions)
        return summary

    sensitivity_module.measure_steps = measuring  # the stage imports it when it measures
    rt = build_runtime(Settings(home=work / "home"))
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, str(source), "auto", {"sensitivity": "measured"}).id
    run_job(rt, job_id)
    sensitivity_module.measure_steps = real
    if "summary" not in found:
        print("the sensitivity stage never measured", file=sys.stderr)
        return 1
    # A later job on the same source at another budget: the cache hands it the measurement.
    later_started = time.monotonic()
    with session_scope(rt.sessions) as session:
        later = repo.create_job(session, str(source), "auto",
                                {"sensitivity": "measured", "target_bpw": args.reuse_bpw}).id
    run_job(rt, later)
    later_s = time.monotonic() - later_started
    with session_scope(rt.sessions) as session:
        reused = repo.latest_runs(session, later)[StageName.SENSITIVITY].status
    print(f"  a later job at {args.reuse_bpw} bpw: sensitivity {reused}, the whole job {later_s:.0f} s")
    summary = found["summary"]
    steps = list(summary.steps)
    for step in steps:
        print(f"  {step.group:22s} -{step.depth} -> {','.join(step.types):14s} saves "
              f"{step.saved_bytes / 1e6:7.2f} MB  proxy {step.proxy:11.4g}  KL +{step.kl_rise:.5f}  "
              f"top-1 {step.top1:.4f}")
    first = [s for s in steps if s.depth == 1]
    per_byte = spearman([s.proxy / s.saved_bytes for s in steps], [s.kl_rise / s.saved_bytes for s in steps])
    kinds: dict[str, list[Any]] = {}
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
        "base_kl": f"{summary.base_kl:.5f}",
        "measure_files": summary.files,
        "measure_s": f"{summary.seconds:.0f}",
        "reused": reused,
        "later_job_s": f"{later_s:.0f}",
    }
    points = found["sweep"]
    if targets:
        print(f"\n{'target_bpw':>10} | {'proxy MB':>8} {'top-1':>6} {'KL':>7} | {'single MB':>9} "
              f"{'top-1':>6} {'KL':>7} {'calib KL':>8} {'predicted':>9} | {'chain MB':>8} {'top-1':>6} "
              f"{'KL':>7} {'calib KL':>8} {'predicted':>9}")
        for a, b, c in zip(points["proxy"], points["single"], points["chain"], strict=True):
            print(f"{a.bpw:>10.1f} | {a.size / 1e6:8.1f} {a.top1:6.3f} {a.kl:7.4f} | {b.size / 1e6:9.1f} "
                  f"{b.top1:6.3f} {b.kl:7.4f} {b.calibration_kl:8.4f} {b.predicted_kl:9.4f} | "
                  f"{c.size / 1e6:8.1f} {c.top1:6.3f} {c.kl:7.4f} {c.calibration_kl:8.4f} "
                  f"{c.predicted_kl:9.4f}")

        def error_median(model: str) -> str:
            errors = sorted(abs(b.predicted_kl - b.calibration_kl) / max(b.calibration_kl, 1e-9)
                            for b in points[model])
            return f"{errors[len(errors) // 2]:.2f}"

        def better(model: str) -> int:
            return sum(1 for a, b in zip(points["proxy"], points[model], strict=True) if b.kl < a.kl)

        figures.update({
            "chain_files": summary.files - 1 - len(steps),
            **{f"{model}_violations": _violations(points[model]) for model in points},
            **{f"{model}_rungs_down": _rungs_down(points[model]) for model in points},
            "single_better": better("single"),
            "chain_better": better("chain"),
            "budgets": len(targets),
            "single_predicted_error_median": error_median("single"),
            "chain_predicted_error_median": error_median("chain"),
        })
    figures["seconds"] = f"{time.monotonic() - started:.0f}"
    print("sensitivity: " + " ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
