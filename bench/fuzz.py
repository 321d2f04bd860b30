"""Fuzz every parser of stranger-supplied files with atheris (coverage-guided libFuzzer).

    .venv/bin/python bench/fuzz.py [--target NAME ...] [--runs 1000000] [--seed 1] [--max-time-s S]

One target at a time (bench/fuzz_targets.py has one per parser), each in its own child
process, seeded from real files: demo checkpoints of every architecture, a small GGUF,
SHA256SUMS and manifests. A finding is

- any exception other than the project's own (`PipelineError` and its subclasses);
- an input that takes over 1 s (timed twice, so a busy machine alone does not count);
- an input that raises the process's peak memory by over 256 MiB, or any allocation past
  1 GiB above the start (the address-space limit turns it into a MemoryError);
- libFuzzer's own verdicts (a crash, a timeout past 10 s, RSS over 2 GiB).

Findings are written, with the input that caused them, under --out (default a temporary
folder) and each becomes a test in tests/unit/test_fuzz_regressions.py. Per target the child
prints how many inputs it ran; the last line is
`fuzz: <target>=<inputs>/<findings> ... total_findings=<n>`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SLOW_S = 1.0
MEMORY_GROWTH_BYTES = 256 * 1024 * 1024
ADDRESS_SPACE_HEADROOM_BYTES = 1024 * 1024 * 1024
MAX_LEN = {"safetensors": 4096, "config": 4096, "tokenizer": 32768, "spm": 16384, "gguf": 8192,
           "sha256sums": 4096, "manifest": 4096}
_DONE = re.compile(r"Done (\d+) runs in (\d+) second")
_EXECUTED = re.compile(r"stat::number_of_executed_units:\s*(\d+)")


# --- parent: fixed files and seeds ----------------------------------------------------------------


def make_context(fixed: Path) -> Path:
    """The companion files targets read (bench/fuzz_targets.py): demo Llama and SentencePiece sets."""
    from pipeline.demo.checkpoint import write_demo_checkpoint

    if not (fixed / "llama" / "config.json").is_file():
        write_demo_checkpoint(fixed / "llama", architecture="llama")
    if not (fixed / "spm" / "config.json").is_file():
        write_demo_checkpoint(fixed / "spm", architecture="mistral")
        _shrink_spm(fixed / "spm", keep_pieces=48)
    return fixed


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _shrink_spm(folder: Path, keep_pieces: int) -> None:
    """Keep the demo SentencePiece model's first pieces (and all its settings): each input parses
    ten times faster, and config.json's vocab_size follows."""
    from pipeline.formats.tokenizer.spm import _Reader

    path = folder / "tokenizer.model"
    kept, out = 0, bytearray()
    for number, value in _Reader(path.read_bytes(), path.name).fields():
        if not isinstance(value, bytes) or (number == 1 and kept >= keep_pieces):
            continue
        kept += number == 1
        out += _varint(number << 3 | 2) + _varint(len(value)) + value
    path.write_bytes(bytes(out))
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config["vocab_size"] = kept
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")


def _small_safetensors() -> list[bytes]:
    import numpy as np
    from safetensors.numpy import save

    tensors = {
        "model.embed_tokens.weight": np.zeros((4, 4), np.float16),
        "model.layers.0.self_attn.q_proj.weight": np.ones((4, 4), np.float32),
        "model.norm.weight": np.ones((4,), np.float32),
        "flag": np.zeros((2,), np.bool_),
        "ids": np.arange(3, dtype=np.int64),
        "empty": np.zeros((0, 3), np.uint8),
    }
    return [save(tensors, metadata={"format": "pt"}), save({"x": np.zeros((1,), np.int8)})]


def _small_gguf(folder: Path) -> bytes:
    import gguf
    import numpy as np

    from pipeline.formats.gguf.writer import TensorToWrite, Typed, write_gguf

    meta: dict[str, Any] = {
        "general.name": "fuzz",
        "general.file_type": 1,
        "llama.block_count": 1,
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "<s>"],
        "tokenizer.ggml.token_type": Typed([1, 1, 3], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32),
        "tokenizer.ggml.add_bos_token": True,
        "x.u64": Typed(2**40, gguf.GGUFValueType.UINT64),
    }
    q8 = np.zeros(34, np.uint8)
    tensors = [
        TensorToWrite("token_embd.weight", gguf.GGMLQuantizationType.F16, (3, 4),
                      lambda: np.ones((3, 4), np.float16)),
        TensorToWrite("output_norm.weight", gguf.GGMLQuantizationType.F32, (4,),
                      lambda: np.ones(4, np.float32)),
        TensorToWrite("blk.0.attn_q.weight", gguf.GGMLQuantizationType.Q8_0, (1, 32), lambda: q8),
    ]
    return write_gguf(folder / "seed.gguf", "llama", meta, tensors).path.read_bytes()


def make_seeds(target: str, fixed: Path, dest: Path) -> Path:
    """Seed inputs for `target` in `dest` (created); real files wherever the format has them."""
    from pipeline.demo.checkpoint import ARCHITECTURE_DEFAULTS, write_demo_checkpoint

    dest.mkdir(parents=True, exist_ok=True)
    llama, spm = fixed / "llama", fixed / "spm"
    seeds: list[bytes] = []
    if target == "safetensors":
        seeds = _small_safetensors()
    elif target == "config":
        for arch in ARCHITECTURE_DEFAULTS:
            folder = write_demo_checkpoint(dest.parent / f"demo-{arch}", architecture=arch)
            seeds.append((folder / "config.json").read_bytes())
    elif target == "tokenizer":
        seeds = [bytes([i]) + (llama / name).read_bytes()
                 for i, name in enumerate(("tokenizer.json", "tokenizer_config.json", "config.json"))]
    elif target == "spm":
        seeds = [b"\x00" + (spm / "tokenizer.model").read_bytes(),
                 b"\x01" + (spm / "tokenizer_config.json").read_bytes()]
    elif target == "gguf":
        seeds = [_small_gguf(dest.parent)]
    elif target == "sha256sums":
        sums = (llama / "SHA256SUMS").read_bytes()
        seeds = [sums, b"# comment\nSHA256 (config.json) = " + b"a" * 64 + b"\n", sums.replace(b"  ", b" *")]
    elif target == "manifest":
        seeds = [
            b"\x00jobs:\n  - source: org/model@main\n    recipe: tq2_0\n    priority: 3\n  - ./local\n",
            b"\x01" + json.dumps([{"source": "a/b", "options": {"device": "cpu"}}, "c/d"]).encode(),
        ]
    for data in seeds:
        (dest / hashlib.sha256(data).hexdigest()[:16]).write_bytes(data)
    return dest


# --- child: one target under atheris ---------------------------------------------------------------


class _Recorder:
    """Findings of one child: deduplicated by (kind, exception type, innermost project frame)."""

    def __init__(self, target: str, out: Path) -> None:
        self.target, self.out, self.seen = target, out, set()

    def record(self, kind: str, data: bytes, detail: str, where: str, error_type: str = "") -> None:
        key = (kind, error_type, where)
        if key in self.seen:
            return
        self.seen.add(key)
        name = f"{self.target}-{kind}-{hashlib.sha256(data).hexdigest()[:12]}.bin"
        (self.out / name).write_bytes(data)
        entry = {"target": self.target, "kind": kind, "type": error_type, "where": where,
                 "detail": detail[:500], "input": name}
        with open(self.out / "findings.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")


def _where(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/pipeline/" in f.filename]
    frame = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno}"


def _limit_address_space() -> None:
    with open("/proc/self/statm") as handle:
        vm_bytes = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = vm_bytes + ADDRESS_SPACE_HEADROOM_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run_child(target: str, fixed: Path, corpus: Path, out: Path, libfuzzer_args: list[str]) -> None:
    """Fuzz `target` until libFuzzer's -runs/-max_total_time ends it; findings go to `out`."""
    import atheris

    with atheris.instrument_imports(include=["pipeline"]):
        import pipeline.formats.gguf.reader  # noqa: F401
        import pipeline.formats.safetensors  # noqa: F401
        import pipeline.formats.sums  # noqa: F401
        import pipeline.formats.tokenizer.bpe  # noqa: F401
        import pipeline.formats.tokenizer.spm  # noqa: F401
        import pipeline.orchestration.job_control  # noqa: F401
        import pipeline.stages.checksum  # noqa: F401
        import pipeline.stages.inspect.gguf_card  # noqa: F401
        import pipeline.stages.inspect.safetensors_card  # noqa: F401
    from bench.fuzz_targets import TARGETS, Context
    from pipeline.core.errors import PipelineError

    function = TARGETS[target]
    ctx = Context(fixed, Path(tempfile.mkdtemp(prefix=f"fuzz-{target}-", dir="/dev/shm")))
    recorder = _Recorder(target, out)
    _limit_address_space()
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def one(data: bytes) -> float:
        started = time.perf_counter()
        try:
            function(data, ctx)
        except PipelineError:
            pass
        except Exception as exc:  # MemoryError and RecursionError included: findings
            recorder.record("exception", data, f"{type(exc).__name__}: {exc}"[:500], _where(exc),
                            type(exc).__name__)
        return time.perf_counter() - started

    def test_one_input(data: bytes) -> None:
        nonlocal peak_kb
        if one(data) > SLOW_S and one(data) > SLOW_S:
            recorder.record("slow", data, f"over {SLOW_S:g} s twice", "")
        now_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if (now_kb - peak_kb) * 1024 > MEMORY_GROWTH_BYTES:
            recorder.record("memory", data, f"peak RSS grew by {(now_kb - peak_kb) // 1024} MiB", "")
        peak_kb = max(peak_kb, now_kb)

    atheris.Setup([sys.argv[0], *libfuzzer_args, str(corpus)], test_one_input)
    atheris.Fuzz()


# --- parent: run each target, count -----------------------------------------------------------------


def fuzz_target(
    target: str, runs: int, seed: int, work: Path, out: Path, max_time_s: int | None
) -> dict[str, Any]:
    """Run one target's child; returns {inputs, findings, time_s, libfuzzer}."""
    fixed = make_context(work / "fixed")
    corpus = make_seeds(target, fixed, work / target / "corpus")
    out.mkdir(parents=True, exist_ok=True)
    args = [f"-runs={runs}", f"-seed={seed}", f"-max_len={MAX_LEN[target]}", "-timeout=10",
            "-rss_limit_mb=2048", "-print_final_stats=1", f"-artifact_prefix={out}/{target}-"]
    if max_time_s:
        args.append(f"-max_total_time={max_time_s}")
    before = _findings(out, target)
    started = time.perf_counter()
    command = [sys.executable, str(Path(__file__).resolve()), "--child", target, "--fixed", str(fixed),
               "--corpus", str(corpus), "--out", str(out), "--", *args]
    proc = subprocess.run(command, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    elapsed = time.perf_counter() - started
    executed = _EXECUTED.search(proc.stderr) or _DONE.search(proc.stderr)
    found = _findings(out, target)[len(before):]
    interrupted = "run interrupted" in proc.stderr  # stopped from outside: not a finding
    if proc.returncode != 0 and not interrupted:  # libFuzzer's own verdict: crash, timeout, OOM
        verdict = re.findall(r"ERROR: libFuzzer: [^\n]*|==\d+== ERROR: [^\n]*", proc.stderr)
        found.append({"target": target, "kind": "libfuzzer", "detail": (verdict or [proc.stderr[-500:]])[0]})
    return {"inputs": int(executed.group(1)) if executed else 0, "findings": found,
            "interrupted": interrupted, "time_s": round(elapsed, 1),
            "stderr_tail": proc.stderr[-1500:] if proc.returncode != 0 else ""}


def _findings(out: Path, target: str) -> list[dict[str, Any]]:
    path = out / "findings.jsonl"
    if not path.is_file():
        return []
    entries = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [e for e in entries if e["target"] == target]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=sorted(MAX_LEN), help="default: every target")
    parser.add_argument("--runs", type=int, default=1_000_000, help="inputs per target")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-time-s", type=int, default=None, help="stop each target after this long")
    parser.add_argument("--out", type=Path, default=None, help="findings folder (default: temporary)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds: CI runs it to prove the bench runs (figures meaningless)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fixed", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("libfuzzer", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.max_time_s = 200, 5
    if args.child:
        run_child(args.child, args.fixed, args.corpus, args.out, args.libfuzzer)
        return
    work = Path(tempfile.mkdtemp(prefix="bonsai-fuzz-"))
    out = args.out or work / "findings"
    results: dict[str, dict[str, Any]] = {}
    try:
        for target in args.target or list(MAX_LEN):
            result = fuzz_target(target, args.runs, args.seed, work, out, args.max_time_s)
            results[target] = result
            print(f"{target}: inputs={result['inputs']} findings={len(result['findings'])} "
                  f"time_s={result['time_s']}{' (interrupted)' if result['interrupted'] else ''}", flush=True)
            for finding in result["findings"]:
                print(f"  finding: {json.dumps(finding)}", flush=True)
            if result["stderr_tail"] and not result["interrupted"]:
                print(f"  libFuzzer said: {result['stderr_tail']}", flush=True)
    finally:
        shutil.rmtree(work / "fixed", ignore_errors=True)
    total = sum(len(r["findings"]) for r in results.values())
    figures = " ".join(f"{t}={r['inputs']}/{len(r['findings'])}" for t, r in results.items())
    print(f"findings folder: {out}")
    print(f"fuzz: {figures} total_findings={total}")


if __name__ == "__main__":
    main()
