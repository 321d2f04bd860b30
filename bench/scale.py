"""Model size: time, peak memory per stage and store size of a whole job at three sizes, beside llama.cpp.

Generates Llama checkpoints of about 0.5B, 1.4B and 2.8B parameters (one bf16 shard each,
SentencePiece vocabulary, `pipeline.demo.checkpoint`), with ternary linear weights (an exact
conversion: calibrate is not needed) and with ordinary Gaussian ones (a lossy conversion:
calibrate runs the source for validate's reference, one block at a time in torch above ~1B
parameters). On each, in the same run:

- llama.cpp's route: ``convert_hf_to_gguf.py --outtype f16`` then ``llama_model_quantize`` TQ2_0
  (`bench.route`), timed from outside, peak RSS of each step's process tree;
- ``bonsai convert`` (recipe tq2_0, embedded, a fresh home), while a sampler reads the RSS of the
  whole process tree (the convert process and every child it starts) every 50 ms; each stage's
  peak is the highest sample inside that stage's start and end (`bonsai show --json`), so a stage
  that ran beside another shares its samples (``--stage-threads 1`` runs one stage at a time, for
  each stage's own peak); with ``--runs`` above 1, every time and peak shown is the median over
  the runs;
- the store's size after the job, and after ``bonsai pin`` of the GGUF and ``bonsai gc``.

A ternary fit of random Gaussian weights predicts nothing like its source, so the lossy jobs fail
validation; every stage has run by then, and the job is timed and measured all the same, then
cancelled (given up) so that gc may take its bytes. bench/fidelity.py measures quality.

``--parts reference`` also measures the bounded reference against the full one on the 379M
checkpoint of bench/route.py (dense weights): calibrate's torch engine (one block at a time)
and its llama engine (the whole bf16 source in llama.cpp) over the same tokens, the torch logits
scored against the llama reference: top-1 agreement and mean KL.

    .venv/bin/python bench/scale.py [--sizes 0.5,1.4,2.8] [--kinds ternary,dense]
                                    [--parts reference,scale] [--runs 1] [--workdir DIR]

Last line: ``scale: params=… ratio=… peak_rss_gb=… rss_growth=… rss_growth_with_validate=… store_gb=…
store_after_gc_gb=… ref_top1=… ref_kl=…`` for the largest ternary checkpoint (ratio: bonsai's wall
time over llama.cpp's route; rss_growth: peak RSS of every stage but validate at the largest size
over the smallest; validate maps the converted file, as the user's llama.cpp will, and grows with
it). Targets: rss_growth ≤ 1.3,
peak_rss_gb ≤ 3, ratio ≤ 1.0 at 2.8B; ref_top1 ≥ 0.99 and ref_kl ≤ 1e-3.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench.route import _utc, build_checkpoint, converter_pythonpath, locate_llama_cpp_tree  # noqa: E402

# hidden / heads = 128; every width a multiple of 256 (the demo's ternary blocks).
SIZES = {
    "0.5": {"n_layers": 20, "hidden": 1536, "intermediate": 4096, "n_heads": 12, "n_kv_heads": 4},
    "1.4": {"n_layers": 30, "hidden": 2048, "intermediate": 5632, "n_heads": 16, "n_kv_heads": 8},
    "2.8": {"n_layers": 28, "hidden": 3072, "intermediate": 8192, "n_heads": 24, "n_kv_heads": 8},
}
_PAGE = os.sysconf("SC_PAGE_SIZE")


class TreeSampler:
    """Samples the resident memory of a process and all its descendants until stopped."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.pid, self.every_s = pid, every_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), tree_rss_bytes(self.pid)))
            self._stop.wait(self.every_s)

    def peak(self, start: float = float("-inf"), end: float = float("inf")) -> int:
        inside = [rss for at, rss in self.samples if start <= at <= end]
        return max(inside, default=0)


def tree_rss_bytes(root: int) -> int:
    """RSS of ``root`` and every descendant, from /proc (0 once it has exited)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)  # field 4: ppid
        rss[pid] = int(fields[21]) * _PAGE  # field 24: rss in pages
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        total += rss.get(pid, 0)
        pending.extend(children.get(pid, ()))
    return total


def _run_sampled(
    command: list[str], env: dict[str, str], what: str, may_fail: bool = False
) -> tuple[float, TreeSampler, str]:
    os.sync()
    started = time.perf_counter()
    proc = subprocess.Popen(
        command, env=env, cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    with TreeSampler(proc.pid) as sampler:
        out, err = proc.communicate()
    seconds = time.perf_counter() - started
    if proc.returncode != 0 and not may_fail:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{err[-4000:]}")
    return seconds, sampler, out


def llama_route(tree: Path, ckpt: Path, work: Path) -> dict[str, float]:
    f16, tq2 = work / "llama-f16.gguf", work / "llama-tq2_0.gguf"
    env = {**os.environ, "PYTHONPATH": converter_pythonpath(tree)}
    convert_s, convert, _ = _run_sampled(
        [
            sys.executable,
            str(tree / "convert_hf_to_gguf.py"),
            "--outtype",
            "f16",
            "--outfile",
            str(f16),
            str(ckpt),
        ],
        env,
        "convert_hf_to_gguf",
    )
    quantize_s, quantize, _ = _run_sampled(
        [sys.executable, str(_ROOT / "bench" / "route.py"), "--child-quantize", str(f16), str(tq2)],
        dict(os.environ),
        "llama_model_quantize",
    )
    f16.unlink()
    tq2.unlink()
    return {
        "total_s": convert_s + quantize_s,
        "convert_s": convert_s,
        "quantize_s": quantize_s,
        "peak_rss": max(convert.peak(), quantize.peak()),
    }


def _bonsai(home: Path, stage_threads: int = 2) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "BONSAI_HOME": str(home), "BONSAI_OUTPUT_DIR": str(home / "out"),
           "BONSAI_STAGE_THREADS": str(stage_threads)}
    for name in ("BONSAI_DATABASE_URL", "BONSAI_BROKER_URL", "BONSAI_ARTIFACT_ROOT"):
        env.pop(name, None)
    return [sys.executable, "-m", "pipeline"], env


def _store_bytes(home: Path) -> int:
    return sum(p.stat().st_size for p in (home / "artifacts").rglob("*") if p.is_file())


def bonsai_job(ckpt: Path, home: Path, lossy: bool, stage_threads: int) -> dict[str, Any]:
    """One ``bonsai convert``; a lossy job on random weights may fail validation (its stages all ran:
    it is timed and measured the same, then given up so that gc may take its bytes)."""
    bonsai, env = _bonsai(home, stage_threads)
    wall_s, sampler, _ = _run_sampled([*bonsai, "convert", str(ckpt)], env, "bonsai convert", may_fail=lossy)
    show = subprocess.run(
        [*bonsai, "show", "1", "--json"], env=env, cwd=_ROOT, capture_output=True, text=True, check=True
    )
    detail = json.loads(show.stdout)
    stages: dict[str, dict[str, Any]] = {}
    for run in detail["stages"]:
        if not run["started_at"] or not run["finished_at"]:
            stages[run["stage"]] = {"status": run["status"]}
            continue
        start, end = _utc(run["started_at"]), _utc(run["finished_at"])
        stages[run["stage"]] = {
            "status": run["status"],
            "seconds": end - start,
            "peak_rss": sampler.peak(start, end),
            "engine": (run.get("metrics") or {}).get("reference_engine"),
        }
    if detail["status"] == "failed" and lossy:
        subprocess.run([*bonsai, "cancel", "1"], env=env, cwd=_ROOT, capture_output=True, check=True)
    store_job = _store_bytes(home)
    gguf = next(
        o["sha256"]
        for run in detail["stages"]
        if run["stage"] == "package"
        for o in run["outputs"]
        if o["kind"] == "gguf"
    )
    subprocess.run([*bonsai, "pin", gguf], env=env, cwd=_ROOT, capture_output=True, check=True)
    subprocess.run([*bonsai, "gc"], env=env, cwd=_ROOT, capture_output=True, check=True)
    return {
        "status": detail["status"],
        "wall_s": wall_s,
        "peak_rss": sampler.peak(),
        "stages": stages,
        "store": store_job,
        "store_after_gc": _store_bytes(home),
    }


def median_job(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The last run's job with every peak and stage time the median over ``jobs`` (a stage's peak
    in one run swings with what else the process held in that instant: a warm-up, a freed heap)."""
    last = jobs[-1]
    stages = {}
    for name, stage in last["stages"].items():
        runs = [job["stages"].get(name, {}) for job in jobs]
        stages[name] = {**stage, **{key: statistics.median(run[key] for run in runs if key in run)
                                    for key in ("seconds", "peak_rss") if key in stage}}
    peaks = [job["peak_rss"] for job in jobs]
    return {**last, "stages": stages, "peak_rss": statistics.median(peaks), "peak_rss_runs": peaks}


def reference_agreement(work: Path) -> dict[str, float]:
    """The torch engine's logits scored against the llama engine's reference, on the 379M checkpoint."""
    import numpy as np

    from pipeline.calibration.agreement import ReferenceScorer
    from pipeline.calibration.answers import AGREEMENT
    from pipeline.calibration.llama_collect import collect_with_llama_cpp
    from pipeline.calibration.reference import ReferenceBuilder
    from pipeline.calibration.sequences import TokenSequences, tokenize_texts
    from pipeline.calibration.stats import ActivationStats
    from pipeline.calibration.text import builtin_text
    from pipeline.calibration.torch_collect import collect_with_torch
    from pipeline.stages.base import InputFile
    from pipeline.stages.calibrate.source_gguf import write_source_gguf
    from pipeline.stages.inspect.safetensors_card import safetensors_card
    from pipeline.stages.validate.params import DEFAULT_AGREEMENT_TEXT

    ckpt, _ = build_checkpoint(work / "ref-ckpt", weights="dense")
    files = {p.name: p for p in ckpt.iterdir()}
    card = safetensors_card({n: InputFile(n, p, "0" * 64, p.stat().st_size) for n, p in files.items()}, [])
    source = write_source_gguf(card, files, work / "ref-source.gguf")
    texts = {AGREEMENT: DEFAULT_AGREEMENT_TEXT, "calibration": builtin_text()[:3000]}
    seqs = tokenize_texts(source, texts, n_ctx=256)
    seqs = TokenSequences(seqs.names[:3], seqs.ids[:3])
    full = ReferenceBuilder(seqs)
    started = time.perf_counter()
    collect_with_llama_cpp(source, seqs, ActivationStats(), reference=full, n_threads=os.cpu_count() or 1)
    llama_s = time.perf_counter() - started

    class Logits:
        def __init__(self) -> None:
            self.rows: dict[int, Any] = {}

        def add(self, index: int, logits: Any) -> None:
            self.rows[index] = np.asarray(logits, dtype=np.float32)

    blockwise = Logits()
    started = time.perf_counter()
    collect_with_torch(card, {s: files[s] for s in card.shards}, seqs, ActivationStats(), reference=blockwise)  # type: ignore[arg-type]
    torch_s = time.perf_counter() - started
    scorer = ReferenceScorer(full.build({}), list(dict.fromkeys(seqs.names)))
    for index in scorer.indices:
        scorer.add(index, blockwise.rows[index])
    result = scorer.result()
    source.unlink()
    shutil.rmtree(ckpt)
    return {
        "top1": result.stats.top1_agreement,
        "kl": result.stats.mean_kl,
        "positions": result.stats.n_positions,
        "llama_s": llama_s,
        "torch_s": torch_s,
    }


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--kinds", default="ternary,dense")
    parser.add_argument("--parts", default="reference,scale")
    parser.add_argument("--runs", type=int, default=1, help="runs of each side per checkpoint; medians shown")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--stage-threads", type=int, default=2,
                        help="BONSAI_STAGE_THREADS of the job (1: one stage at a time, so that each stage's "
                        "peak is its own; 2: the default, calibrate beside decompose and package)")
    args = parser.parse_args(argv)
    sizes, kinds, parts = args.sizes.split(","), args.kinds.split(","), args.parts.split(",")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.workdir))
    ref: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    try:
        if "reference" in parts:
            ref = reference_agreement(root)
            print(
                f"reference, 379M dense: torch block-wise vs llama.cpp whole bf16 over {ref['positions']} "
                f"positions: top-1 {ref['top1']:.4f}, mean KL {ref['kl']:.2e}; llama {ref['llama_s']:.1f} s, "
                f"torch {ref['torch_s']:.1f} s",
                flush=True,
            )
        if "scale" in parts:
            tree = locate_llama_cpp_tree()
            for size in sizes:
                for kind in kinds:
                    ckpt, n_params = build_checkpoint(root / f"ckpt-{size}-{kind}", SIZES[size], kind)
                    llamas, ours = [], []
                    for index in range(args.runs):
                        llamas.append(llama_route(tree, ckpt, root))
                        home = root / f"home-{index}"
                        ours.append(bonsai_job(ckpt, home, kind == "dense", args.stage_threads))
                        shutil.rmtree(root / f"home-{index}")
                    shutil.rmtree(ckpt)
                    row = {
                        "size": size,
                        "kind": kind,
                        "params": n_params,
                        "llama_s": statistics.median(r["total_s"] for r in llamas),
                        "llama_rss": max(r["peak_rss"] for r in llamas),
                        "bonsai_s": statistics.median(r["wall_s"] for r in ours),
                        "bonsai_runs": [round(r["wall_s"], 1) for r in ours],
                        "job": median_job(ours),
                    }
                    rows.append(row)
                    _print_row(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if rows:
        _print_table(rows)
    _print_last_line(rows, ref)
    return 0


def _print_row(row: dict[str, Any]) -> None:
    job = row["job"]
    stages = ", ".join(
        f"{name} {s['seconds']:.1f}s/{_gb(s['peak_rss'])}GB"
        + (f" ({s['engine']})" if s.get("engine") else "")
        if "seconds" in s
        else f"{name} {s['status']}"
        for name, s in job["stages"].items()
    )
    print(
        f"{row['size']}B {row['kind']} ({row['params'] / 1e9:.2f}B params): llama.cpp {row['llama_s']:.1f} s "
        f"peak {_gb(row['llama_rss'])} GB; bonsai {row['bonsai_s']:.1f} s (runs {row['bonsai_runs']}) peak "
        f"{_gb(job['peak_rss'])} GB (runs {[_gb(p) for p in job['peak_rss_runs']]}), job {job['status']}; "
        f"store {_gb(job['store'])} GB, after gc "
        f"{_gb(job['store_after_gc'])} GB; {stages}",
        flush=True,
    )


def _print_table(rows: list[dict[str, Any]]) -> None:
    print()
    print(
        "| checkpoint | params | llama.cpp route | bonsai convert | ratio | llama.cpp peak RSS "
        "| bonsai peak RSS | worst stage (peak) | store after job | after gc |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        job = row["job"]
        measured = {n: s for n, s in job["stages"].items() if "peak_rss" in s}
        worst = max(measured, key=lambda n: measured[n]["peak_rss"]) if measured else "-"
        worst_gb = _gb(measured[worst]["peak_rss"]) if measured else "-"
        print(
            f"| {row['size']}B {row['kind']} | {row['params'] / 1e9:.2f}B | {row['llama_s']:.1f} s | "
            f"{row['bonsai_s']:.1f} s | {row['bonsai_s'] / row['llama_s']:.2f} | "
            f"{_gb(row['llama_rss'])} GB | "
            f"{_gb(job['peak_rss'])} GB | {worst} {worst_gb} GB | {_gb(job['store'])} GB | "
            f"{_gb(job['store_after_gc'])} GB |"
        )


def _stage_peak(row: dict[str, Any], but: str = "") -> int:
    """The row's peak RSS over its stages (less stage ``but``)."""
    return max((s["peak_rss"] for name, s in row["job"]["stages"].items() if "peak_rss" in s and name != but),
               default=0)


def _print_last_line(rows: list[dict[str, Any]], ref: dict[str, float]) -> None:
    figures: dict[str, str] = {}
    ternary = [r for r in rows if r["kind"] == "ternary"] or rows
    if ternary:
        largest = max(ternary, key=lambda r: r["params"])
        smallest = min(ternary, key=lambda r: r["params"])
        # Validate maps the converted file, as the user's llama.cpp will: its growth is the file's.
        growth_all = largest["job"]["peak_rss"] / max(1, smallest["job"]["peak_rss"])
        growth = _stage_peak(largest, but="validate") / max(1, _stage_peak(smallest, but="validate"))
        figures.update({
            "params": f"{largest['params'] / 1e9:.2f}B",
            "ratio": f"{largest['bonsai_s'] / largest['llama_s']:.3f}",
            "peak_rss_gb": _gb(largest["job"]["peak_rss"]),
            "rss_growth": f"{growth:.2f}",
            "rss_growth_with_validate": f"{growth_all:.2f}",
            "store_gb": _gb(largest["job"]["store"]),
            "store_after_gc_gb": _gb(largest["job"]["store_after_gc"]),
        })
    if ref:
        figures.update({"ref_top1": f"{ref['top1']:.4f}", "ref_kl": f"{ref['kl']:.2e}"})
    print("scale: " + " ".join(f"{key}={value}" for key, value in figures.items()))


if __name__ == "__main__":
    raise SystemExit(main())
