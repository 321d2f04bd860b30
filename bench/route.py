"""A whole job against llama.cpp's own route, on a 379M-parameter ternary Llama (757 MB of bf16).

Generates a Llama checkpoint whose linear weights are exactly ternary per 256-block
(`pipeline.demo.checkpoint`, SentencePiece vocabulary, 15 layers of hidden 1536 / intermediate 4096),
then, in the same run and on the same files:

- llama.cpp: ``convert_hf_to_gguf.py --outtype f16`` (the script from the llama-cpp-python
  sdist's ``vendor/llama.cpp``, its ``gguf-py`` first on PYTHONPATH), then
  ``llama_model_quantize`` to TQ2_0 through llama_cpp's low-level API; each step is a process
  of its own, timed from outside;
- ours: ``bonsai convert`` in embedded mode (a fresh BONSAI_HOME), timed from outside; its
  stage breakdown comes from ``bonsai show --json``.

What it needs, and where it looks:

- the llama-cpp-python sdist of the installed version: ``BONSAI_LLAMA_CPP_SDIST`` (the
  ``.tar.gz`` or its unpacked folder), else ``<cache>/llama_cpp_python-<version>``, else
  ``pip download --no-deps --no-binary :all:`` into the cache;
- ``transformers`` for that script (it reads config.json through AutoConfig): the one
  installed, else ``<cache>/convert-deps``, else ``pip install --no-deps --target`` there.

``<cache>`` is ``BONSAI_BENCH_CACHE`` or ``~/.cache/bonsai-bench``. The checkpoint lives in a
temporary folder that is deleted at the end (``--keep`` keeps it).

    .venv/bin/python bench/route.py [--runs 1] [--workdir DIR] [--keep] [--option KEY=VALUE ...]

The default job keeps the BF16 embedding and head as stored (the ``source`` type): the conversion
is bit-exact, and calibrate is recorded as not needed (no source run). ``--option embed_type=f16
--option output_type=f16`` gives the older, lossy route, which runs the source for validate.

Last line: ``route: llama_s=… bonsai_no_validate_s=… bonsai_s=… ratio_no_validate=… ratio=… overlap_s=…
to_file_s=… to_file_ratio=… source_run=…`` (``overlap_s``: stage time that ran beside another stage;
``to_file_s``: launch to the packaged GGUF, package's end; ``source_run``: whether calibrate ran the
source). Targets for the default job: ratio ≤ 0.6, to_file_ratio ≤ 0.5, source_run=no.
``bonsai_no_validate_s`` is the whole job less its validation work: the validate stage, and the
calibrate stage when no stage but validate read its outputs (the recipe collected no statistics,
so calibrate only ran the source for validate's reference; with ``importance`` or ``method=gptq``
decompose reads it and it counts as conversion), less any of that time a conversion stage ran beside
(package beside calibrate). Which stages read calibrate's outputs comes from
the job's own input links (``show --json``), not from the recipe's name; the breakdown also
prints the job less its validate stage alone. Targets: ratio_no_validate ≤ 0.5, ratio ≤ 1.0.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

# 15 x (q, k, v, o, gate, up, down) + embeddings and output head of the demo SentencePiece vocab.
SHAPE = {"n_layers": 15, "hidden": 1536, "intermediate": 4096, "n_heads": 12, "n_kv_heads": 4}
# The demo's own tiny shape (a few MB): what the benches' smoke modes build instead.
SMOKE_SHAPE = {"n_layers": 2, "hidden": 256, "intermediate": 512, "n_heads": 4, "n_kv_heads": 2}
TRANSFORMERS_VERSION = "5.24.0"  # 4.x refuses the huggingface_hub 1.x+ this project installs
_SDIST_ENV = "BONSAI_LLAMA_CPP_SDIST"
_CACHE_ENV = "BONSAI_BENCH_CACHE"
_TREE_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def cache_dir() -> Path:
    return Path(os.environ.get(_CACHE_ENV) or Path.home() / ".cache" / "bonsai-bench")


def _llama_cpp_version() -> str:
    return importlib.metadata.version("llama_cpp_python")


def _tree_in(folder: Path) -> Path | None:
    tree = folder / "vendor" / "llama.cpp"
    return tree if (tree / "convert_hf_to_gguf.py").is_file() and (tree / "gguf-py").is_dir() else None


def _unpack_tree(archive: Path, dest: Path) -> Path:
    """Unpack only the converter, its `conversion` package and gguf-py from the sdist into `dest`."""
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/", 1)[0]
        prefix = f"{top}/vendor/llama.cpp/"
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix) and m.name[len(prefix):].startswith(_TREE_PARTS)]
        if not members:
            raise SystemExit(f"{archive}: no vendor/llama.cpp/convert_hf_to_gguf.py inside; is it the "
                             "llama-cpp-python sdist?")
        tar.extractall(dest.parent / f".{dest.name}.partial", members=members, filter="data")
    partial = dest.parent / f".{dest.name}.partial" / top
    partial.rename(dest)
    shutil.rmtree(dest.parent / f".{dest.name}.partial")
    tree = _tree_in(dest)
    assert tree is not None
    return tree


def locate_llama_cpp_tree() -> Path:
    """The sdist's vendor/llama.cpp folder: from the env var, the cache, or pip download."""
    version = _llama_cpp_version()
    given = os.environ.get(_SDIST_ENV)
    cached = cache_dir() / f"llama_cpp_python-{version}"
    if given:
        path = Path(given).expanduser()
        tree = _tree_in(path) if path.is_dir() else None
        if tree is None and path.is_file():
            if cached.exists():
                shutil.rmtree(cached)
            cached.parent.mkdir(parents=True, exist_ok=True)
            tree = _unpack_tree(path, cached)
        if tree is None:
            raise SystemExit(f"{_SDIST_ENV}={given}: neither the llama-cpp-python sdist (.tar.gz) nor its "
                             "unpacked folder (with vendor/llama.cpp/convert_hf_to_gguf.py)")
        return tree
    tree = _tree_in(cached)
    if tree is not None:
        return tree
    download = cache_dir() / "sdist"
    download.mkdir(parents=True, exist_ok=True)
    print(f"llama.cpp's converter: downloading the llama-cpp-python {version} sdist into {download}",
          flush=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={version}", "-d", str(download)]
    if subprocess.run(command, check=False).returncode != 0:
        raise SystemExit(
            f"could not download the llama-cpp-python {version} sdist. This bench runs llama.cpp's own "
            f"convert_hf_to_gguf.py from it: set {_SDIST_ENV} to the sdist (.tar.gz) or its unpacked "
            f"folder, or put the unpacked folder at {cached}"
        )
    archive = next(download.glob(f"llama_cpp_python-{version}.tar.gz"))
    return _unpack_tree(archive, cached)


def converter_pythonpath(tree: Path) -> str:
    """PYTHONPATH for the converter: its own gguf-py first, then transformers if not installed."""
    parts = [str(tree / "gguf-py")]
    if importlib.util.find_spec("transformers") is None:
        target = cache_dir() / "convert-deps"
        if not (target / "transformers").is_dir():
            print(f"llama.cpp's converter needs transformers; installing {TRANSFORMERS_VERSION} into "
                  f"{target} (not into this environment)", flush=True)
            command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                       f"transformers=={TRANSFORMERS_VERSION}", "regex"]
            if subprocess.run(command, check=False).returncode != 0:
                raise SystemExit(f"llama.cpp's convert_hf_to_gguf.py needs transformers: `pip install "
                                 f"transformers=={TRANSFORMERS_VERSION}` or put it under {target}")
        parts.append(str(target))
    return os.pathsep.join(parts)


def build_checkpoint(dest: Path, shape: dict[str, int] | None = None,
                     weights: str = "ternary") -> tuple[Path, int]:
    """A Llama with a SentencePiece vocabulary in `dest` (the 379M ternary one unless ``shape`` and
    ``weights`` say otherwise, as `write_demo_checkpoint` takes them); returns (folder, params)."""
    import math

    from safetensors import safe_open

    from pipeline.demo.checkpoint import write_demo_checkpoint

    folder = write_demo_checkpoint(dest, tokenizer="spm", weights=weights, **(shape or SHAPE))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        n_params = sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
    return folder, n_params


def _timed(command: list[str], env: dict[str, str], what: str) -> tuple[float, str]:
    os.sync()  # the previous step's dirty pages are not written back on this step's clock
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=_ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return seconds, proc.stdout


def run_llama_route(tree: Path, ckpt: Path, work: Path) -> dict[str, float]:
    """convert_hf_to_gguf --outtype f16, then llama_model_quantize to TQ2_0; seconds of each."""
    f16, tq2 = work / "llama-f16.gguf", work / "llama-tq2_0.gguf"
    env = {**os.environ, "PYTHONPATH": converter_pythonpath(tree)}
    convert_s, _ = _timed([sys.executable, str(tree / "convert_hf_to_gguf.py"), "--outtype", "f16",
                           "--outfile", str(f16), str(ckpt)], env, "convert_hf_to_gguf.py")
    quantize_s, out = _timed([sys.executable, __file__, "--child-quantize", str(f16), str(tq2)],
                             dict(os.environ), "llama_model_quantize")
    inner = json.loads(out.strip().splitlines()[-1])
    sizes = {"f16_bytes": f16.stat().st_size, "tq2_0_bytes": tq2.stat().st_size}
    f16.unlink()
    tq2.unlink()
    return {"convert_s": convert_s, "quantize_s": quantize_s, "quantize_inner_s": inner["seconds"],
            "total_s": convert_s + quantize_s, **sizes}


def child_quantize(src: Path, dst: Path) -> dict[str, Any]:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_TQ2_0
    params.nthread = os.cpu_count() or 0
    started = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")
    return {"seconds": time.perf_counter() - started}


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of ``spans`` (start, end)."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        covered += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return covered


def _utc(text: str) -> float:
    stamp = datetime.fromisoformat(text)
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()


def run_bonsai(ckpt: Path, home: Path, options: list[str] | None = None) -> dict[str, Any]:
    """`bonsai convert` in a fresh embedded home; wall time and the stage breakdown of `show --json`.
    ``options``: ``KEY=VALUE`` job options passed on (``--option``)."""
    env = {**os.environ, "BONSAI_HOME": str(home), "BONSAI_OUTPUT_DIR": str(home / "out")}
    for name in ("BONSAI_DATABASE_URL", "BONSAI_BROKER_URL", "BONSAI_ARTIFACT_ROOT"):
        env.pop(name, None)
    bonsai = [sys.executable, "-m", "pipeline"]
    os.sync()
    wall_started = time.time()
    extra = [arg for option in options or () for arg in ("--option", option)]
    seconds, _ = _timed([*bonsai, "convert", str(ckpt), *extra], env, "bonsai convert")
    wall_ended = wall_started + seconds
    show = subprocess.run([*bonsai, "show", "1", "--json"], env=env, cwd=_ROOT, capture_output=True,
                          text=True, check=True)
    detail = json.loads(show.stdout)
    stages = [(s["stage"], float(s["duration_s"] or 0.0), _utc(s["started_at"]), _utc(s["finished_at"]))
              for s in detail["stages"] if s["status"] in ("succeeded", "skipped-cached")]
    skipped = [s["stage"] for s in detail["stages"] if s["status"] == "not-needed"]
    if len(stages) + len(skipped) != len(detail["stages"]) or detail["status"] != "succeeded":
        raise SystemExit(f"bonsai convert did not succeed: {detail['status']}: {detail['error_message']}")
    readers = {s["stage"] for s in detail["stages"] if s["stage"] != "validate"
               and any(item["name"].startswith("calibrate/") for item in s.get("inputs") or ())}
    stage_s = {name: duration for name, duration, _, _ in stages}
    validating = {"validate"} | (set() if readers else {"calibrate"})
    # Validation work counts only where no conversion stage ran beside it (calibrate beside package).
    conversion = [(start, end) for name, _, start, end in stages if name not in validating]
    validation_s = _union_s([(start, end) for _, _, start, end in stages]) - _union_s(conversion)
    # Runs order by their start: stage time that overlapped another stage's (concurrent stages).
    spans = sorted((start, end) for _, _, start, end in stages)
    overlap_s = sum(max(0.0, min(end, later_end) - later_start) for i, (_, end) in enumerate(spans)
                    for later_start, later_end in spans[i + 1:])
    return {
        "wall_s": seconds,
        "stages": stage_s,
        "not_needed": skipped,
        "overlap_s": overlap_s,
        "exact": next((s["metrics"].get("exact") for s in detail["stages"] if s["stage"] == "decompose"),
                      None),
        "to_file_s": next(end for name, _, _, end in stages if name == "package") - wall_started,
        "source_run": "calibrate" in stage_s,
        "validation_s": validation_s,
        "calibrate_readers": sorted(readers),
        "before_first_s": stages[0][2] - wall_started,
        "between_s": sum(nxt[0] - prev[1] for prev, nxt in zip(spans, spans[1:], strict=False)
                         if nxt[0] > prev[1]),
        "after_last_s": wall_ended - stages[-1][3],
        "checksum_metrics": next(s["metrics"] for s in detail["stages"] if s["stage"] == "checksum"),
    }


def _print_breakdown(llama: dict[str, float], ours: dict[str, Any]) -> None:
    print(f"{'':40s} {'seconds':>8s}")
    print(f"{'llama.cpp: convert_hf_to_gguf --outtype f16':40s} {llama['convert_s']:8.2f}")
    print(f"{'llama.cpp: llama_model_quantize TQ2_0':40s} {llama['quantize_s']:8.2f}  "
          f"(inside the call {llama['quantize_inner_s']:.2f})")
    print(f"{'llama.cpp route':40s} {llama['total_s']:8.2f}  "
          f"(F16 {llama['f16_bytes'] / 1e6:.0f} MB, TQ2_0 {llama['tq2_0_bytes'] / 1e6:.0f} MB)")
    print(f"{'bonsai convert, whole job':40s} {ours['wall_s']:8.2f}")
    print(f"{'  start-up, to the first stage':40s} {ours['before_first_s']:8.2f}")
    for name, duration in ours["stages"].items():
        print(f"{'  ' + name:40s} {duration:8.2f}")
    print(f"{'  between stages':40s} {ours['between_s']:8.2f}")
    print(f"{'  after the last stage, to exit':40s} {ours['after_last_s']:8.2f}")
    for name in ours["not_needed"]:
        print(f"{'  ' + name:40s} {'skipped':>8s}  (not needed: decompose proved the conversion exact)")
    readers = ", ".join(ours["calibrate_readers"]) or "only validate"
    less_validate = ours["wall_s"] - ours["stages"].get("validate", 0.0)
    print(f"{'whole job less its validate stage':40s} {less_validate:8.2f}")
    print(f"{'whole job less its validation work':40s} {ours['wall_s'] - ours['validation_s']:8.2f}  "
          f"(calibrate's outputs read by {readers})")
    checksum = ours["checksum_metrics"]
    print(f"checksum stage: {checksum.get('total_bytes', 0) / 1e6:.0f} MB, "
          f"hashed {checksum.get('hashed_bytes', checksum.get('total_bytes', 0)) / 1e6:.0f} MB "
          f"in {checksum.get('hash_seconds')} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=1, help="timed runs of each side; medians are reported")
    parser.add_argument("--workdir", type=Path, default=None, help="where the temporary folder goes")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--option", dest="options", action="append", default=[],
                        help="job option KEY=VALUE for bonsai convert (repeatable), e.g. embed_type=f16")
    parser.add_argument("--child-quantize", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_quantize:
        print(json.dumps(child_quantize(*args.child_quantize)))
        return 0
    tree = locate_llama_cpp_tree()
    load_before = os.getloadavg()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)  # a folder not made yet is made
    root = Path(tempfile.mkdtemp(prefix="bench-route-", dir=args.workdir))
    try:
        ckpt, n_params = build_checkpoint(root / "ckpt")
        size_bytes = sum(p.stat().st_size for p in ckpt.iterdir())
        print(f"checkpoint: {n_params / 1e6:.0f}M parameters, {size_bytes / 1e6:.0f} MB, ternary Llama, "
              f"SentencePiece vocabulary; llama.cpp tree {tree}")
        llamas, ours = [], []
        for index in range(args.runs):
            llamas.append(run_llama_route(tree, ckpt, root))
            ours.append(run_bonsai(ckpt, root / f"home{index}", args.options))
            shutil.rmtree(root / f"home{index}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    llama = min(llamas, key=lambda r: abs(r["total_s"] - statistics.median(x["total_s"] for x in llamas)))
    mine = min(ours, key=lambda r: abs(r["wall_s"] - statistics.median(x["wall_s"] for x in ours)))
    _print_breakdown(llama, mine)
    if args.runs > 1:
        llama_runs = ", ".join(f"{r['total_s']:.2f}" for r in llamas)
        our_runs = ", ".join(f"{r['wall_s']:.2f}" for r in ours)
        print(f"runs: llama.cpp {llama_runs} s; bonsai {our_runs} s (the median run is shown)")
    print("load average (1, 5, 15 min): before " + " ".join(f"{x:.2f}" for x in load_before)
          + ", after " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores")
    llama_s = statistics.median(r["total_s"] for r in llamas)
    bonsai_s = statistics.median(r["wall_s"] for r in ours)
    no_validate_s = statistics.median(r["wall_s"] - r["validation_s"] for r in ours)
    overlap_s = statistics.median(r["overlap_s"] for r in ours)
    to_file_s = statistics.median(r["to_file_s"] for r in ours)
    source_run = "yes" if any(r["source_run"] for r in ours) else "no"
    print(f"route: llama_s={llama_s:.2f} bonsai_no_validate_s={no_validate_s:.2f} bonsai_s={bonsai_s:.2f} "
          f"ratio_no_validate={no_validate_s / llama_s:.3f} ratio={bonsai_s / llama_s:.3f} "
          f"overlap_s={overlap_s:.2f} to_file_s={to_file_s:.2f} to_file_ratio={to_file_s / llama_s:.3f} "
          f"source_run={source_run}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
