"""Ternary decomposition against llama.cpp's own quantizer: time, memory, error, bits per weight.

Generates Llama checkpoints with ordinary Gaussian (not ternary-trained) bf16 weights, then, for
each layout (TQ2_0; the Bonsai layouts Q2_0 and Q1_0 that run on CUDA/Metal/Vulkan):

- ours: decompose + package stages, HF safetensors -> GGUF with the tq2_0 / q2_0 / q1_0
  recipe, in a child process (q2_0 also with ``levels=4``, shown for information);
- llama.cpp: F16 GGUF -> the same type through ``llama_model_quantize`` (llama-cpp-python;
  file types MOSTLY_TQ2_0, MOSTLY_Q2_0 = 41, MOSTLY_Q1_0 = 40), in a child process, with as
  many threads as the machine has cores. The F16 GGUF is made beforehand by our package stage
  (same tensors, same rope layout) and its making is not timed: llama.cpp's route is timed
  from the F16 file.

Library start-up is not timed on either side: importing torch / llama_cpp, and loading our
compiled kernel from numba's cache (``kernel_cache.warm_up``, ~0.5 s once per process, as a
long-lived worker does at start); both are printed. Each side's threads are printed too.

Relative errors are ``||w - w_hat||_F / ||w||_F`` over all block linear weights (blk.*),
read back from each GGUF with gguf-py and compared with the source. Peak RSS is each child's
high-water mark (VmHWM). The 2B checkpoint is decomposed by our route only, for the memory check.

    .venv/bin/python bench/decompose.py [--sizes 0.5b,2b] [--types tq2_0,q2_0,q2_0_l4,q1_0] [--repeat N]
                                        [--workdir DIR] [--keep]

``--repeat N`` (default 3) times each side N times, ours and llama.cpp's alternately, each in a
fresh child process after ``sync``, and reports each side's median run with every run's time
and the spread.

Last line: ``time_ratio=… error_ratio=… rss_growth=… q2_0: time_ratio=… error_ratio=… q1_0:
time_ratio=… error_ratio=…`` (ours / llama.cpp time and error at 0.5B, TQ2_0 first; our peak
RSS at 2B over 0.5B, TQ2_0). Targets: TQ2_0 ≤ 1.0, ≤ 0.6, ≤ 1.2; Q2_0 (levels=3) ≤ 1.0, ≤ 0.6;
Q1_0 ≤ 1.0, ≤ 1.0 (llama.cpp's Q1_0 rule, d = mean|w|, is already the optimum for signs, so
equal errors are the expectation there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

# name -> (layers, hidden, intermediate, heads, kv_heads); vocab comes from the demo tokenizer.
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (2, 512, 1024, 8, 4),
    "0.5b": (20, 1536, 4096, 12, 4),
    "2b": (28, 2560, 6912, 20, 4),
}
_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
_LINEAR = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
# Layout -> (our recipe, its options, llama.cpp's LLAMA_FTYPE_* for the same type).
LAYOUTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "tq2_0": ("tq2_0", {}, "LLAMA_FTYPE_MOSTLY_TQ2_0"),
    "q2_0": ("q2_0", {}, "LLAMA_FTYPE_MOSTLY_Q2_0"),
    "q2_0_l4": ("q2_0", {"levels": 4}, "LLAMA_FTYPE_MOSTLY_Q2_0"),
    "q1_0": ("q1_0", {}, "LLAMA_FTYPE_MOSTLY_Q1_0"),
}
_LLAMA_FTYPE_VALUES = {"LLAMA_FTYPE_MOSTLY_Q2_0": 41, "LLAMA_FTYPE_MOSTLY_Q1_0": 40}  # llama.h


def _tensor_shapes(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int,
                   ) -> Iterator[tuple[str, tuple[int, ...]]]:
    kv_dim = hidden // heads * kv
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (hidden,)
        yield f"{p}.self_attn.q_proj.weight", (hidden, hidden)
        yield f"{p}.self_attn.k_proj.weight", (kv_dim, hidden)
        yield f"{p}.self_attn.v_proj.weight", (kv_dim, hidden)
        yield f"{p}.self_attn.o_proj.weight", (hidden, hidden)
        yield f"{p}.post_attention_layernorm.weight", (hidden,)
        yield f"{p}.mlp.gate_proj.weight", (inter, hidden)
        yield f"{p}.mlp.up_proj.weight", (inter, hidden)
        yield f"{p}.mlp.down_proj.weight", (hidden, inter)
    yield "model.norm.weight", (hidden,)
    yield "lm_head.weight", (vocab, hidden)


def build_checkpoint(dest: Path, size: str, seed: int = 0) -> Path:
    """A Gaussian bf16 Llama checkpoint (config, shards of at most 5 GB, the demo tokenizer) in ``dest``."""
    import torch
    from safetensors.torch import save_file

    from pipeline.demo import write_demo_checkpoint

    layers, hidden, inter, heads, kv = SIZES[size]
    tok = write_demo_checkpoint(dest / "_tokenizer")
    config = json.loads((tok / "config.json").read_text())
    vocab = int(config["vocab_size"])
    config.update(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads)
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, dest / name)
    shutil.rmtree(tok)
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, shape in _tensor_shapes(layers, hidden, inter, heads, kv, vocab):
        if len(shape) == 1:
            tensor = (1.0 + 0.05 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if shard_bytes + tensor.numel() * 2 > _MAX_SHARD_BYTES and shards[-1]:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += tensor.numel() * 2
    for i, tensors in enumerate(shards):
        save_file(tensors, str(dest / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"),
                  metadata={"format": "pt"})
    return dest


def model_card(folder: Path) -> dict[str, Any]:
    """A model card shaped like the inspect stage's, from the checkpoint's safetensors headers."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    tensors = []
    for shard in shards:
        with safe_open(str(folder / shard), framework="pt") as handle:
            for name in handle.keys():
                view = handle.get_slice(name)
                tensors.append({"name": name, "shape": list(view.get_shape()), "dtype": view.get_dtype(),
                                "shard": shard})
    return {"architecture": config["model_type"], "hf_architecture": config["architectures"][0],
            "config": config, "format": "safetensors", "shards": shards, "tensors": tensors,
            "tokenizer": {"kind": "bpe", "files": ["tokenizer.json", "tokenizer_config.json"]}}


def _stage_inputs(ckpt: Path, card_path: Path) -> dict[str, Any]:
    from pipeline.core.files import sha256_file
    from pipeline.stages.base import InputFile

    inputs = {f"download/{p.name}": InputFile(p.name, p, "", p.stat().st_size)
              for p in ckpt.iterdir() if p.is_file()}
    inputs["inspect/model_card.json"] = InputFile("model_card.json", card_path, sha256_file(card_path),
                                                  card_path.stat().st_size)
    return inputs


def _peak_rss_bytes() -> int:
    """This process's resident-memory high-water mark (VmHWM).

    Not ``ru_maxrss``: after fork + exec Linux reports there the larger of the child's peak and
    the parent's RSS at fork time, and the parent holds the checkpoint it just generated.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def child_ours(ckpt: Path, card_path: Path, out: Path, layout: str = "tq2_0") -> dict[str, Any]:
    """Decompose + package in this process with the layout's recipe; timings, peak RSS and the GGUF path."""
    import torch

    from pipeline.stages import decompose, package
    from pipeline.stages.base import InputFile, JobSpec
    from pipeline.ternary import kernel, kernel_cache

    recipe, options, _ = LAYOUTS[layout]
    job = JobSpec("bench", recipe, options=options)
    inputs = _stage_inputs(ckpt, card_path)
    warm_up_s = kernel_cache.warm_up("TQ2_0") + (kernel_cache.warm_up("Q2_0") if recipe != "tq2_0" else 0.0)
    started = time.perf_counter()
    (out / "decompose").mkdir(parents=True)
    result = decompose.run(decompose.make_params(job), inputs, out / "decompose")
    decompose_s = time.perf_counter() - started
    for item in result.outputs:
        inputs[f"decompose/{item.name}"] = InputFile(item.name, item.path, "", item.path.stat().st_size)
    (out / "package").mkdir()
    packaged = package.run(package.make_params(job), inputs, out / "package")
    total_s = time.perf_counter() - started
    return {"decompose_s": decompose_s, "total_s": total_s, "peak_rss_bytes": _peak_rss_bytes(),
            "gguf": str(packaged.outputs[0].path), "device": result.metrics["device"],
            "report_rel_error": result.metrics["rel_error"], "warm_up_s": warm_up_s,
            "threads": f"kernel {kernel.thread_count()}, torch {torch.get_num_threads()}"}


def child_llama(src: Path, dst: Path, layout: str = "tq2_0") -> dict[str, Any]:
    """llama.cpp's quantizer, F16 GGUF -> the layout's type (its default tensor-type choices), timed."""
    import llama_cpp

    name = LAYOUTS[layout][2]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, name, None) or _LLAMA_FTYPE_VALUES[name]
    params.nthread = os.cpu_count() or 0  # 0 would mean std::thread::hardware_concurrency(): the same
    started = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    seconds = time.perf_counter() - started
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return {"total_s": seconds, "peak_rss_bytes": _peak_rss_bytes(), "gguf": str(dst),
            "threads": f"nthread {params.nthread}"}


def _run_child(*args: str) -> dict[str, Any]:
    os.sync()  # the previous run's GGUF is flushed now, not during this run's timing
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def make_f16_gguf(ckpt: Path, card: dict[str, Any], card_path: Path, work: Path) -> Path:
    """The same checkpoint as an F16 GGUF (1-D tensors F32), through F16 parts and our package stage."""
    import numpy as np
    from safetensors.numpy import save_file

    from pipeline.formats.hf.checkpoint import iter_tensors
    from pipeline.formats.model_card import ModelCard
    from pipeline.stages import package
    from pipeline.stages.base import InputFile, JobSpec
    from pipeline.ternary.pack import encode_plain

    inputs = _stage_inputs(ckpt, card_path)
    files = {s: ckpt / s for s in card["shards"]}
    work.mkdir(parents=True)
    for i, shard in enumerate(card["shards"]):
        data: dict[str, np.ndarray] = {}
        index: dict[str, Any] = {}
        for name, weight in iter_tensors(ModelCard.from_dict(card), files, shard):
            ggml_type = "F32" if weight.dim() == 1 else "F16"
            data[name] = encode_plain(weight, ggml_type)
            index[name] = {"ggml_type": ggml_type, "shape": list(weight.shape)}
        part = work / f"f16-part-{i + 1:05d}.safetensors"
        save_file(data, str(part), metadata={"bonsai.format": "ternary-part/1",
                                             "bonsai.tensors": json.dumps(index)})
        del data
        name = f"ternary/part-{i + 1:05d}.safetensors"
        inputs[f"decompose/{name}"] = InputFile(name, part, "", part.stat().st_size)
    (work / "f16").mkdir()
    result = package.run(package.make_params(JobSpec("bench-f16", "f16")), inputs, work / "f16")
    return Path(result.outputs[0].path)


def gguf_error(path: Path, card: dict[str, Any], ckpt: Path) -> dict[str, Any]:
    """Relative error of the linear weights in a GGUF against the source, and bits per weight."""
    import numpy as np

    from pipeline.formats.gguf.reader import GGUFFile
    from pipeline.formats.hf.checkpoint import iter_tensors
    from pipeline.formats.model_card import ModelCard
    from pipeline.ternary.pack import decode_bytes

    reader = GGUFFile(path)  # gguf-py's reader does not know Q2_0
    by_name = {t.name: t for t in reader.tensors}
    files = {s: ckpt / s for s in card["shards"]}
    err = norm = 0.0
    linear_bytes = linear_params = all_params = 0
    types: dict[str, int] = {}
    for shard in card["shards"]:
        for name, weight in iter_tensors(ModelCard.from_dict(card), files, shard):
            tensor = by_name[name]
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
            all_params += weight.numel()
            if not _LINEAR.match(name):
                continue
            values = decode_bytes(np.asarray(tensor.data).reshape(-1).view(np.uint8), tensor.tensor_type.name,
                                  tuple(weight.shape))
            w = weight.numpy().astype(np.float64)
            err += float(((w - values) ** 2).sum())
            norm += float((w * w).sum())
            linear_bytes += int(tensor.n_bytes)
            linear_params += weight.numel()
    size = path.stat().st_size
    return {"rel_error": (err / norm) ** 0.5, "linear_bpw": linear_bytes * 8 / linear_params,
            "file_bpw": size * 8 / all_params, "size_bytes": size, "types": types}


def _merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run's errors and sizes with the median run's timings; every run's wall time and the
    spread (max - min), so a figure taken on a busy machine says so."""
    ordered = sorted(runs, key=lambda r: r["total_s"])
    median = ordered[(len(ordered) - 1) // 2]
    merged = runs[0] | {k: v for k, v in median.items() if k.endswith("_s") or k == "peak_rss_bytes"}
    merged["runs_s"] = [round(r["total_s"], 2) for r in runs]
    merged["spread_s"] = round(ordered[-1]["total_s"] - ordered[0]["total_s"], 2)
    return merged


def _bench_size(size: str, root: Path, layouts: list[str] | None, repeat: int = 1) -> dict[str, Any]:
    """One checkpoint: ours for each layout (tq2_0 only when ``layouts`` is None: the memory check),
    and llama.cpp's quantizer for each distinct type, each from the same F16 GGUF; each timed
    ``repeat`` times, ours and llama.cpp's alternately, keeping the median."""
    root = root / f"{size}-{'compare' if layouts else 'memory'}"
    root.mkdir()
    ckpt = build_checkpoint(root / f"ckpt-{size}", size)
    card = model_card(ckpt)
    card_path = root / f"card-{size}.json"
    card_path.write_text(json.dumps(card))
    n_params = sum(int(math.prod(t["shape"])) for t in card["tensors"])
    out: dict[str, Any] = {"size": size, "n_params": n_params, "layouts": {}}
    f16 = make_f16_gguf(ckpt, card, card_path, root / f"f16-{size}") if layouts else None
    llama_runs: dict[str, dict[str, Any]] = {}
    for layout in layouts or ["tq2_0"]:
        ftype = LAYOUTS[layout][2]
        fresh_llama = f16 is not None and ftype not in llama_runs
        timings: dict[str, list[dict[str, Any]]] = {"ours": [], "llama": []}
        for i in range(repeat):
            dest = root / f"ours-{size}-{layout}-{i}"
            ours = _run_child("ours", layout, str(ckpt), str(card_path), str(dest))
            if i == 0:
                ours |= gguf_error(Path(ours["gguf"]), card, ckpt)
            Path(ours["gguf"]).unlink()
            timings["ours"].append(ours)
            if fresh_llama:
                dst = root / f"llama-{size}-{layout}-{i}.gguf"
                llama = _run_child("llama", layout, str(f16), str(dst))
                if i == 0:
                    llama |= gguf_error(dst, card, ckpt)
                dst.unlink()
                timings["llama"].append(llama)
        row: dict[str, Any] = {"ours": _merge_runs(timings["ours"])}
        if fresh_llama:
            llama_runs[ftype] = _merge_runs(timings["llama"])
        if f16 is not None:
            row["llama"] = llama_runs[ftype]
        out["layouts"][layout] = row
    if f16 is not None:
        f16.unlink()
    shutil.rmtree(ckpt)
    return out


def _print_layout(first: dict[str, Any], layout: str) -> None:
    ours, llama = first["layouts"][layout]["ours"], first["layouts"][layout].get("llama")
    rows = [("wall time (s)", "total_s", "{:.2f}"), ("peak RSS (MB)", "peak_rss_bytes", "{:.0f}"),
            ("rel. error, linear weights", "rel_error", "{:.4f}"),
            ("bpw, linear weights", "linear_bpw", "{:.4f}"),
            ("bpw, whole file", "file_bpw", "{:.4f}"), ("file size (MB)", "size_bytes", "{:.1f}")]
    recipe, options, ftype = LAYOUTS[layout]
    knobs = "".join(f", {k}={v}" for k, v in options.items())
    print(f"--- {layout}: ours recipe {recipe}{knobs}; llama.cpp {ftype}")
    print(f"{'':28s} {'ours (decompose+package)':>26s} {'llama.cpp (quantize)':>22s}")
    for label, key, fmt in rows:
        scale = 1e6 if key in ("peak_rss_bytes", "size_bytes") else 1
        a = fmt.format(ours[key] / scale)
        b = fmt.format(llama[key] / scale) if llama else "-"
        print(f"{label:28s} {a:>26s} {b:>22s}")
    llama_types = json.dumps(llama["types"]) if llama else "-"
    print(f"{'tensor types':28s} {json.dumps(ours['types']):>26s} {llama_types:>22s}")
    print(f"{'threads':28s} {ours['threads']:>26s} {llama['threads'] if llama else '-':>22s}")
    llama_runs = " ".join(map(str, llama["runs_s"])) if llama else "-"
    print(f"{'every run (s), median kept':28s} {' '.join(map(str, ours['runs_s'])):>26s} {llama_runs:>22s}")
    llama_spread = f"{llama['spread_s']:.2f}" if llama else "-"
    print(f"{'spread (s)':28s} {ours['spread_s']:>26.2f} {llama_spread:>22s}")
    print(f"ours: decompose {ours['decompose_s']:.2f} s on {ours['device']}, "
          f"{first['n_params'] / ours['decompose_s'] / 1e6:.1f} M params/s; kernel load before timing "
          f"{ours['warm_up_s']:.2f} s (once per process)")
    if llama:
        print(f"ours / llama.cpp: time {ours['total_s'] / llama['total_s']:.3f}, "
              f"rel. error {ours['rel_error'] / llama['rel_error']:.6f}")


def _print_table(first: dict[str, Any], second: dict[str, Any] | None) -> None:
    print(f"checkpoint {first['size']}: {first['n_params'] / 1e6:.0f}M parameters, Gaussian bf16")
    for layout in first["layouts"]:
        _print_layout(first, layout)
    if second:
        mem = second["layouts"]["tq2_0"]["ours"]
        print(f"checkpoint {second['size']}: {second['n_params'] / 1e6:.0f}M parameters: ours (tq2_0) "
              f"{mem['total_s']:.1f} s, peak RSS {mem['peak_rss_bytes'] / 1e6:.0f} MB, "
              f"rel. error {mem['rel_error']:.4f}")


def _ratios(first: dict[str, Any], layout: str) -> str:
    row = first["layouts"].get(layout)
    if row is None or "llama" not in row:
        return "time_ratio=nan error_ratio=nan"
    time_ratio = row["ours"]["total_s"] / row["llama"]["total_s"]
    error_ratio = row["ours"]["rel_error"] / row["llama"]["rel_error"]
    return f"time_ratio={time_ratio:.3f} error_ratio={error_ratio:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="0.5b,2b", help="comparison size, then the memory-check size")
    parser.add_argument("--types", default="tq2_0,q2_0,q2_0_l4,q1_0",
                        help=f"layouts to compare, from {', '.join(LAYOUTS)}")
    parser.add_argument("--repeat", type=int, default=3,
                        help="time each side this many times, alternately, and keep the fastest")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds: CI runs it to prove the bench runs (figures meaningless)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.types, args.repeat = "tiny", "tq2_0,q2_0,q1_0", 1
    if args.child:
        kind, layout, *rest = args.child
        paths = [Path(p) for p in rest]
        result = child_ours(*paths, layout=layout) if kind == "ours" else child_llama(*paths, layout=layout)
        print(json.dumps(result))
        return 0
    sizes = args.sizes.split(",")
    layouts = args.types.split(",")
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown layouts {unknown}; expected some of {', '.join(LAYOUTS)}")
    load_before = os.getloadavg()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)  # a folder not made yet is made
    root = Path(tempfile.mkdtemp(prefix="bench-decompose-", dir=args.workdir))
    try:
        first = _bench_size(sizes[0], root, layouts, args.repeat)
        second = _bench_size(sizes[1], root, None) if len(sizes) > 1 else None
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    _print_table(first, second)
    print("load average (1, 5, 15 min): before " + " ".join(f"{x:.2f}" for x in load_before)
          + ", after " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores")
    growth = float("nan")
    if second and "tq2_0" in first["layouts"]:
        growth = (second["layouts"]["tq2_0"]["ours"]["peak_rss_bytes"]
                  / first["layouts"]["tq2_0"]["ours"]["peak_rss_bytes"])
    print(f"{_ratios(first, 'tq2_0')} rss_growth={growth:.3f} q2_0: {_ratios(first, 'q2_0')} "
          f"q1_0: {_ratios(first, 'q1_0')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
