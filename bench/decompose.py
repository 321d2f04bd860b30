"""Ternary decomposition against llama.cpp's own TQ2_0 route: time, memory, error, bits per weight.

Generates Llama checkpoints with ordinary Gaussian (not ternary-trained) bf16 weights, then

- ours: decompose + package stages, HF safetensors -> TQ2_0 GGUF, in a child process;
- llama.cpp: F16 GGUF -> TQ2_0 through ``llama_model_quantize`` (llama-cpp-python), in a
  child process, with as many threads as the machine has cores. The F16 GGUF is made
  beforehand by our package stage (same tensors, same rope layout) and its making is not
  timed: llama.cpp's route is timed from the F16 file.

Library start-up is not timed on either side: importing torch / llama_cpp, and loading our
compiled kernel from numba's cache (``kernel.warm_up``, ~0.5 s once per process, as a
long-lived worker does at start); both are printed. Each side's threads are printed too.

Relative errors are ``||w - w_hat||_F / ||w||_F`` over all block linear weights (blk.*),
read back from each GGUF with gguf-py and compared with the source. Peak RSS is each child's
high-water mark (VmHWM). The 2B checkpoint is decomposed by our route only, for the memory check.

Each side runs ``--runs`` times (default 3), each in a fresh child process after ``sync``;
the median is reported with every run's time and the spread.

    .venv/bin/python bench/decompose.py [--sizes 0.5b,2b] [--runs 3] [--workdir DIR] [--keep]

Last line: ``time_ratio=… error_ratio=… rss_growth=…`` (ours / llama.cpp time and error at
0.5B; our peak RSS at 2B over 0.5B). Targets: ≤ 1.0, ≤ 0.6, ≤ 1.2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
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


def child_ours(ckpt: Path, card_path: Path, out: Path) -> dict[str, Any]:
    """Decompose + package in this process; timings, peak RSS and the GGUF path."""
    import torch

    from pipeline.stages import decompose, package
    from pipeline.stages.base import InputFile, JobSpec
    from pipeline.ternary import kernel

    inputs = _stage_inputs(ckpt, card_path)
    warm_up_s = kernel.warm_up()
    started = time.perf_counter()
    (out / "decompose").mkdir(parents=True)
    result = decompose.run(decompose.make_params(JobSpec("bench", "tq2_0")), inputs, out / "decompose")
    decompose_s = time.perf_counter() - started
    for item in result.outputs:
        inputs[f"decompose/{item.name}"] = InputFile(item.name, item.path, "", item.path.stat().st_size)
    (out / "package").mkdir()
    packaged = package.run(package.make_params(JobSpec("bench", "tq2_0")), inputs, out / "package")
    total_s = time.perf_counter() - started
    return {"decompose_s": decompose_s, "total_s": total_s, "peak_rss_bytes": _peak_rss_bytes(),
            "gguf": str(packaged.outputs[0].path), "device": result.metrics["device"],
            "report_rel_error": result.metrics["rel_error"], "warm_up_s": warm_up_s,
            "threads": f"kernel {kernel.thread_count()}, torch {torch.get_num_threads()}"}


def child_llama(src: Path, dst: Path) -> dict[str, Any]:
    """llama.cpp's quantizer, F16 GGUF -> TQ2_0 (its default tensor-type choices), timed."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_TQ2_0
    params.nthread = os.cpu_count() or 0  # 0 would mean std::thread::hardware_concurrency(): the same
    started = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    seconds = time.perf_counter() - started
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return {"total_s": seconds, "peak_rss_bytes": _peak_rss_bytes(), "gguf": str(dst),
            "threads": f"nthread {params.nthread}"}


_RUNS = 3  # timed runs per side (--runs); each is a fresh child process


def _run_child(*args: str) -> dict[str, Any]:
    """The median of `_RUNS` runs of one child, by total_s, with every run's time and the spread.

    Each run starts from a clean output path and with no dirty pages pending (the outputs are
    deterministic: the last run's are kept for the error figures).
    """
    return median_of_runs(_RUNS, lambda: _run_child_once(*args), before_each=lambda: _clear_output(args))


def median_of_runs(runs: int, once: Callable[[], dict[str, Any]],
                   before_each: Callable[[], None] | None = None) -> dict[str, Any]:
    """Call `once()` (a dict with ``total_s``) `runs` times; the median run plus ``runs_s``, ``spread_s``."""
    results = []
    for _ in range(max(1, runs)):
        if before_each is not None:
            before_each()
        results.append(once())
    times = [float(r["total_s"]) for r in results]
    median = statistics.median(times)
    middle = min(results, key=lambda r: abs(float(r["total_s"]) - median))
    return middle | {"total_s": median, "runs_s": times, "spread_s": max(times) - min(times)}


def _set_runs(runs: int) -> None:
    global _RUNS
    _RUNS = runs


def _clear_output(args: tuple[str, ...]) -> None:
    # Written-back pages only: the just-written checkpoint or F16 GGUF would otherwise be
    # flushed to disk on the first run's clock (the first llama.cpp run took up to 2x longer).
    os.sync()
    out = Path(args[-1])
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()


def _run_child_once(*args: str) -> dict[str, Any]:
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
    from pipeline.stages import package
    from pipeline.stages.base import InputFile, JobSpec
    from pipeline.ternary.pack import encode_plain

    inputs = _stage_inputs(ckpt, card_path)
    files = {s: ckpt / s for s in card["shards"]}
    work.mkdir(parents=True)
    for i, shard in enumerate(card["shards"]):
        data: dict[str, np.ndarray] = {}
        index: dict[str, Any] = {}
        for name, weight in iter_tensors(card, files, shard):
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
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from pipeline.formats.hf.checkpoint import iter_tensors

    reader = GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    files = {s: ckpt / s for s in card["shards"]}
    err = norm = 0.0
    linear_bytes = linear_params = all_params = 0
    types: dict[str, int] = {}
    for shard in card["shards"]:
        for name, weight in iter_tensors(card, files, shard):
            tensor = by_name[name]
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
            all_params += weight.numel()
            if not _LINEAR.match(name):
                continue
            values = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(weight.shape)
            w = weight.numpy().astype(np.float64)
            err += float(((w - values) ** 2).sum())
            norm += float((w * w).sum())
            linear_bytes += int(tensor.n_bytes)
            linear_params += weight.numel()
    size = path.stat().st_size
    return {"rel_error": (err / norm) ** 0.5, "linear_bpw": linear_bytes * 8 / linear_params,
            "file_bpw": size * 8 / all_params, "size_bytes": size, "types": types}


def _bench_size(size: str, root: Path, with_llama: bool) -> dict[str, Any]:
    root = root / f"{size}-{'compare' if with_llama else 'memory'}"
    root.mkdir()
    ckpt = build_checkpoint(root / f"ckpt-{size}", size)
    card = model_card(ckpt)
    card_path = root / f"card-{size}.json"
    card_path.write_text(json.dumps(card))
    n_params = sum(int(math.prod(t["shape"])) for t in card["tensors"])
    out: dict[str, Any] = {"size": size, "n_params": n_params}
    ours = _run_child("ours", str(ckpt), str(card_path), str(root / f"ours-{size}"))
    out["ours"] = ours | gguf_error(Path(ours["gguf"]), card, ckpt)
    if with_llama:
        f16 = make_f16_gguf(ckpt, card, card_path, root / f"f16-{size}")
        llama = _run_child("llama", str(f16), str(root / f"llama-{size}.gguf"))
        out["llama"] = llama | gguf_error(Path(llama["gguf"]), card, ckpt)
        f16.unlink()
    shutil.rmtree(ckpt)
    return out


def _print_table(first: dict[str, Any], second: dict[str, Any] | None) -> None:
    ours, llama = first["ours"], first.get("llama")
    rows = [("wall time (s)", "total_s", "{:.2f}"), ("peak RSS (MB)", "peak_rss_bytes", "{:.0f}"),
            ("rel. error, linear weights", "rel_error", "{:.4f}"),
            ("bpw, linear weights", "linear_bpw", "{:.4f}"),
            ("bpw, whole file", "file_bpw", "{:.4f}"), ("file size (MB)", "size_bytes", "{:.1f}")]
    print(f"checkpoint {first['size']}: {first['n_params'] / 1e6:.0f}M parameters, Gaussian bf16")
    print(f"{'':28s} {'ours (decompose+package)':>26s} {'llama.cpp (quantize)':>22s}")
    for label, key, fmt in rows:
        scale = 1e6 if key in ("peak_rss_bytes", "size_bytes") else 1
        a = fmt.format(ours[key] / scale)
        b = fmt.format(llama[key] / scale) if llama else "-"
        print(f"{label:28s} {a:>26s} {b:>22s}")
    llama_types = json.dumps(llama["types"]) if llama else "-"
    print(f"{'tensor types':28s} {json.dumps(ours['types']):>26s} {llama_types:>22s}")
    print(f"{'threads':28s} {ours['threads']:>26s} {llama['threads'] if llama else '-':>22s}")
    print(f"ours: decompose {ours['decompose_s']:.2f} s on {ours['device']}, "
          f"{first['n_params'] / ours['decompose_s'] / 1e6:.1f} M params/s; kernel load before timing "
          f"{ours['warm_up_s']:.2f} s (once per process)")
    if second:
        print(f"checkpoint {second['size']}: {second['n_params'] / 1e6:.0f}M parameters: ours "
              f"{second['ours']['total_s']:.1f} s, peak RSS {second['ours']['peak_rss_bytes'] / 1e6:.0f} MB, "
              f"rel. error {second['ours']['rel_error']:.4f}")


def _print_runs(first: dict[str, Any]) -> None:
    for side in ("ours", "llama"):
        if side in first and "runs_s" in first[side]:
            result = first[side]
            runs = ", ".join(f"{t:.2f}" for t in result["runs_s"])
            print(f"{side} at {first['size']}: median {result['total_s']:.2f} s of "
                  f"{len(result['runs_s'])} runs ({runs}; spread {result['spread_s']:.2f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="0.5b,2b", help="comparison size, then the memory-check size")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--runs", type=int, default=_RUNS, help="timed runs per side; the median is reported")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        result = child_ours(*map(Path, rest)) if kind == "ours" else child_llama(*map(Path, rest))
        print(json.dumps(result))
        return 0
    _set_runs(args.runs)
    sizes = args.sizes.split(",")
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="bench-decompose-", dir=args.workdir))
    try:
        first = _bench_size(sizes[0], root, with_llama=True)
        second = _bench_size(sizes[1], root, with_llama=False) if len(sizes) > 1 else None
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    _print_table(first, second)
    _print_runs(first)
    print("load average (1, 5, 15 min): before " + " ".join(f"{x:.2f}" for x in load_before)
          + ", after " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores")
    time_ratio = first["ours"]["total_s"] / first["llama"]["total_s"]
    error_ratio = first["ours"]["rel_error"] / first["llama"]["rel_error"]
    growth = second["ours"]["peak_rss_bytes"] / first["ours"]["peak_rss_bytes"] if second else float("nan")
    print(f"time_ratio={time_ratio:.3f} error_ratio={error_ratio:.3f} rss_growth={growth:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
