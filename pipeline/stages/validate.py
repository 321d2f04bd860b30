"""Validate stage: load the packaged GGUF in llama.cpp, run a greedy "1+1=" and judge the result.

Inputs: ``package/model.gguf`` and, when present, ``decompose/report.json``. Output:
``validation.json`` with the generated text, timings, the backend that ran, and checks
each with a verdict (pass / warn / fail) and a reason:

- ``loads``: llama.cpp opens the file and generates (fail otherwise);
- ``answer``: the completion contains the expected answer (warn otherwise: tiny or
  heavily compressed models may not know arithmetic);
- ``repetition``: output collapsed into one token or a short loop (warn);
- ``sparsity``: ternary tensors are not all ±1 (0% zeros means the fit collapsed: fail);
- ``bits_per_weight``: block linear weights are stored at the recipe's ternary rate;
- ``tensor_types``: types in the file are the ones decompose decided.

llama.cpp runs in a child process: a broken file can abort the process that loads it,
and that must fail this stage, not kill the worker. Any failed check writes the report
(the evidence) and then raises IntegrityError naming the failed checks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import InputError, IntegrityError
from pipeline.stages.base import InputFile, JobSpec, OutputFile, StageResult

__all__ = ["NAME", "VERSION", "Params", "Check", "make_params", "run", "repetition_of", "first_answer"]

NAME = "validate"
VERSION = "1"
OUTPUT_NAME = "validation.json"

log = logging.getLogger(__name__)

_LINEAR = re.compile(
    r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|attn_qkv|ffn_gate|ffn_up|ffn_down)\.weight$"
)
_TERNARY_TYPES = ("TQ1_0", "TQ2_0")
_BPW_PASS_REL = 0.01  # linear weights within 1% of the recipe rate: all ternary
_BPW_WARN_REL = 0.25  # within 25%: some named fallbacks; beyond: the recipe was not applied
_SPARSITY_SAMPLE_ROWS = 64  # rows per tensor decoded to measure sparsity from the file itself
_STDERR_TAIL_CHARS = 2000
_MAX_TOKEN_RUN = 4  # the same token this many times in a row is a loop, not an answer
_MAX_LOOP_PERIOD = 8


@dataclass(frozen=True)
class Params:
    """llama.cpp settings and the sanity prompt. ``n_gpu_layers=0`` keeps everything on CPU
    (mainline CUDA has no TQ2_0 kernel); ``timeout_s`` bounds load + generation."""

    recipe: str = "tq2_0"
    n_ctx: int = 256
    n_threads: int = 2
    n_gpu_layers: int = 0
    seed: int = 0
    prompt: str = "1+1="
    expected: str = "2"
    max_tokens: int = 16
    timeout_s: float = 300.0


@dataclass(frozen=True)
class Check:
    """One judged sign: verdict is 'pass', 'warn' or 'fail'."""

    name: str
    verdict: str
    reason: str


def make_params(job: JobSpec) -> Params:
    """Params from the job's recipe and options: ``n_ctx``, ``n_threads``, ``n_gpu_layers``, ``timeout_s``."""
    opts = job.options
    try:
        return Params(
            recipe=job.recipe,
            n_ctx=int(opts.get("n_ctx", 256)),
            n_threads=int(opts.get("n_threads", min(4, os.cpu_count() or 1))),
            n_gpu_layers=int(opts.get("n_gpu_layers", 0)),
            timeout_s=float(opts.get("timeout_s", 300.0)),
        )
    except (TypeError, ValueError) as exc:
        raise InputError(f"validate options {dict(opts)} hold a non-numeric value: {exc}") from exc


# --- llama.cpp probe (runs in a child process) -------------------------------------------------


def _probe(request: Mapping[str, Any]) -> dict[str, Any]:
    """Load the model and generate greedily; the child process's whole job."""
    import llama_cpp

    started = time.perf_counter()
    model = llama_cpp.Llama(
        model_path=request["path"],
        n_ctx=request["n_ctx"],
        n_threads=request["n_threads"],
        n_gpu_layers=request["n_gpu_layers"],
        seed=request["seed"],
        verbose=False,
    )
    load_s = time.perf_counter() - started
    prompt_ids = model.tokenize(request["prompt"].encode("utf-8"), add_bos=True, special=False)
    generated: list[int] = []
    started = time.perf_counter()
    # temp=0 is greedy; repeat_penalty 1.0 so nothing but the logits picks the token.
    for token in model.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0):
        if token == model.token_eos():
            break
        generated.append(int(token))
        if len(generated) >= request["max_tokens"]:
            break
    gen_s = time.perf_counter() - started
    offload = bool(llama_cpp.llama_supports_gpu_offload())
    return {
        "text": model.detokenize(generated).decode("utf-8", errors="replace"),
        "tokens": generated,
        "prompt_tokens": len(prompt_ids),
        "load_s": round(load_s, 4),
        "gen_s": round(gen_s, 4),
        "tokens_per_s": round(len(generated) / gen_s, 2) if gen_s > 0 else None,
        "backend": {
            "llama_cpp_python": llama_cpp.__version__,
            "supports_gpu_offload": offload,
            "n_gpu_layers": request["n_gpu_layers"],
            "device": "gpu" if offload and request["n_gpu_layers"] != 0 else "cpu",
            "system_info": llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip(),
        },
    }


def _probe_main() -> None:
    """Child entry point: request JSON on stdin, result JSON written to the path it names."""
    request = json.loads(sys.stdin.read())
    result = _probe(request)
    Path(request["result_path"]).write_text(json.dumps(result), encoding="utf-8")


def _run_probe(path: Path, params: Params, workdir: Path) -> tuple[dict[str, Any] | None, str]:
    """(result, '') or (None, why it failed)."""
    result_path = workdir / ".validate-probe.json"
    request = {
        "path": str(path),
        "n_ctx": params.n_ctx,
        "n_threads": params.n_threads,
        "n_gpu_layers": params.n_gpu_layers,
        "seed": params.seed,
        "prompt": params.prompt,
        "max_tokens": params.max_tokens,
        "result_path": str(result_path),
    }
    # The child must import this same checkout even when it is not pip-installed.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    code = "from pipeline.stages.validate import _probe_main; _probe_main()"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=params.timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"llama.cpp did not load and generate within {params.timeout_s:g} s"
    try:
        if proc.returncode != 0 or not result_path.is_file():
            tail = proc.stderr.strip()[-_STDERR_TAIL_CHARS:]
            return None, f"llama.cpp could not load or run the file (exit {proc.returncode}): {tail}"
        return json.loads(result_path.read_text(encoding="utf-8")), ""
    finally:
        result_path.unlink(missing_ok=True)


# --- checks -------------------------------------------------------------------------------------


def repetition_of(tokens: list[int], text: str) -> str | None:
    """A description of a degenerate loop in generated output, or None.

    Flags a token repeated 4+ times in a row, one token making up half the output, a
    tail that cycles with a period of up to 8 tokens for 2+ full turns, and a character
    repeated 6+ times (like "111111").
    """
    run_token, run_len = None, 0
    for token in tokens:
        run_len = run_len + 1 if token == run_token else 1
        run_token = token
        if run_len >= _MAX_TOKEN_RUN:
            return f"token {token} repeats {run_len}+ times in a row"
    if len(tokens) >= 6:
        top = max(tokens.count(t) for t in set(tokens))
        if top * 2 >= len(tokens):
            return f"one token makes up {top} of {len(tokens)} generated tokens"
        tail = tokens[len(tokens) // 3 :]
        for period in range(1, _MAX_LOOP_PERIOD + 1):
            if len(tail) >= 2 * period + 1 and all(
                tail[i] == tail[i - period] for i in range(period, len(tail))
            ):
                return f"the output loops with period {period} token(s)"
    if re.search(r"(.)\1{5,}", text.replace(" ", "")):
        return f"a character repeats 6+ times in {text!r}"
    return None


def first_answer(text: str) -> str | None:
    """The first number in a completion ("2" in " 2, 2+1=3"), or None when there is none."""
    match = re.search(r"-?\d+(?:\.\d+)?", text)
    return match.group(0) if match else None


def _sampled_sparsity(path: Path) -> tuple[float | None, int]:
    """Fraction of zero weights in the file's ternary tensors (sampled rows), and their count."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    zeros = total = n_tensors = 0
    for tensor in reader.tensors:
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        if qtype.name not in _TERNARY_TYPES:
            continue
        n_tensors += 1
        data = np.asarray(tensor.data)
        rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
        pick = np.linspace(0, rows.shape[0] - 1, min(rows.shape[0], _SPARSITY_SAMPLE_ROWS)).astype(np.int64)
        values = gguf.quants.dequantize(np.ascontiguousarray(rows[pick]), qtype)
        zeros += int(np.count_nonzero(values == 0))
        total += int(values.size)
    return (zeros / total if total else None), n_tensors


def _check_sparsity(path: Path, report: Mapping[str, Any] | None) -> Check:
    measured, n_tensors = _sampled_sparsity(path)
    reported = (report or {}).get("totals", {}).get("sparsity")
    if n_tensors == 0:
        return Check(
            "sparsity", "warn", "the file has no ternary (TQ1_0/TQ2_0) tensors; sparsity not applicable"
        )
    detail = f"measured {measured:.1%} zeros over sampled rows of {n_tensors} ternary tensors"
    if reported is not None:
        detail += f"; decompose reported {reported:.1%}"
    if measured == 0.0 or reported == 0.0:
        return Check(
            "sparsity", "fail", f"0% sparsity: every ternary weight is ±1, the fit collapsed ({detail})"
        )
    if reported is not None and abs(measured - reported) > 0.05:
        return Check("sparsity", "warn", f"file and report disagree by more than 5 points ({detail})")
    return Check("sparsity", "pass", detail)


def _recipe_type(recipe: str, report: Mapping[str, Any] | None) -> str | None:
    from pipeline.ternary.policy import RECIPES

    if report and isinstance(report.get("ternary_type"), str):
        return str(report["ternary_type"])
    known = RECIPES.get(recipe)
    return known.ternary_type if known else None


def _check_bpw(summary: Any, ternary_type: str | None) -> Check:
    import gguf

    if ternary_type is None:
        return Check("bits_per_weight", "warn", "unknown recipe: no bits-per-weight target to compare with")
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ternary_type]]
    target = size * 8 / block
    linear = [n for n in summary.shapes if _LINEAR.match(n)]
    n_params = sum(_numel(summary.shapes[n]) for n in linear)
    n_bits = sum(_numel(summary.shapes[n]) * _type_bpw(summary.tensor_types[n]) for n in linear)
    if not n_params:
        return Check("bits_per_weight", "fail", "the file has no block linear weights to measure")
    bpw = n_bits / n_params
    rel = abs(bpw - target) / target
    detail = (
        f"block linear weights at {bpw:.4f} bpw, recipe {ternary_type} is {target:.4f}; "
        f"whole file {summary.bits_per_weight:.3f}"
    )
    verdict = "pass" if rel <= _BPW_PASS_REL else "warn" if rel <= _BPW_WARN_REL else "fail"
    return Check("bits_per_weight", verdict, detail)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _type_bpw(type_name: str) -> float:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return size * 8 / block


def _check_types(summary: Any, ternary_type: str | None, report: Mapping[str, Any] | None) -> Check:
    from pipeline.gguf_pack.names import GENERATED_TENSORS

    planned = {t["name"]: t["ggml_type"] for t in (report or {}).get("tensors", []) if "name" in t}
    if planned:
        wrong = [
            f"{n}: {summary.tensor_types.get(n)} (planned {t})"
            for n, t in planned.items()
            if summary.tensor_types.get(n) != t
        ]
        # Package computes some tensors from config.json; decompose never plans them.
        extra = sorted(set(summary.tensor_types) - set(planned) - set(GENERATED_TENSORS))
        if wrong or extra:
            return Check(
                "tensor_types",
                "fail",
                f"types differ from decompose's plan: {wrong[:5]}, unplanned {extra[:5]}",
            )
        return Check("tensor_types", "pass", f"all {len(planned)} tensors have the types decompose decided")
    if ternary_type is None:
        return Check("tensor_types", "warn", "no decompose report and unknown recipe: types not checked")
    off = [n for n, t in summary.tensor_types.items() if _LINEAR.match(n) and t != ternary_type]
    if off:
        return Check(
            "tensor_types",
            "warn",
            f"{len(off)} linear weights are not {ternary_type} and no report names why: {off[:5]}",
        )
    return Check("tensor_types", "pass", f"every block linear weight is {ternary_type}")


def _behaviour_checks(probe: Mapping[str, Any], params: Params) -> list[Check]:
    text = probe["text"]
    found = first_answer(text)
    # The first number must be the answer: "12" or "3, 2" contain "2" but are wrong.
    answer = (
        Check("answer", "pass", f"{params.prompt!r} -> {text!r} answers {params.expected!r}")
        if found == params.expected
        else Check(
            "answer",
            "warn",
            f"{params.prompt!r} -> {text!r}: first number {found!r}, expected {params.expected!r}",
        )
    )
    loop = repetition_of(list(probe["tokens"]), text)
    repetition = (
        Check("repetition", "warn", loop) if loop else Check("repetition", "pass", "no degenerate loop")
    )
    return [answer, repetition]


# --- stage -------------------------------------------------------------------------------------


def _load_report(inputs: Mapping[str, InputFile]) -> dict[str, Any] | None:
    item = inputs.get("decompose/report.json")
    if item is None:
        return None
    try:
        report = json.loads(item.path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"decompose/report.json is not readable JSON: {exc}") from exc
    return report if isinstance(report, dict) else None


def _verdict(checks: list[Check]) -> str:
    verdicts = {c.verdict for c in checks}
    return "fail" if "fail" in verdicts else "warn" if "warn" in verdicts else "pass"


def _write_report(workdir: Path, report: Mapping[str, Any]) -> Path:
    dest = workdir / OUTPUT_NAME
    tmp = workdir / f".{OUTPUT_NAME}.partial"
    tmp.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, dest)
    return dest


def run(params: Params, inputs: Mapping[str, InputFile], workdir: Path) -> StageResult:
    """Judge ``package/model.gguf``; writes validation.json, raises IntegrityError on any failed check."""
    from pipeline.gguf_pack.inspect import inspect_gguf

    item = inputs.get("package/model.gguf")
    if item is None:
        raise InputError(f"validate needs package/model.gguf; inputs were {sorted(inputs)}")
    workdir = Path(workdir)
    decompose_report = _load_report(inputs)
    checks: list[Check] = []
    probe: dict[str, Any] | None = None
    summary = None
    try:
        summary = inspect_gguf(item.path)
    except IntegrityError as exc:
        checks.append(Check("loads", "fail", f"the file's GGUF structure is broken: {exc}"))
    if summary is not None:
        probe, why = _run_probe(item.path, params, workdir)
        if probe is None:
            checks.append(Check("loads", "fail", why))
        else:
            checks.append(
                Check("loads", "pass", f"loaded in {probe['load_s']:.2f} s on {probe['backend']['device']}")
            )
            checks += _behaviour_checks(probe, params)
            ternary_type = _recipe_type(params.recipe, decompose_report)
            checks += [
                _check_sparsity(item.path, decompose_report),
                _check_bpw(summary, ternary_type),
                _check_types(summary, ternary_type, decompose_report),
            ]
    verdict = _verdict(checks)
    report = {
        "format": "validation-report/1",
        "verdict": verdict,
        "params": asdict(params),
        "model": {"name": item.name, "sha256": item.sha256, "size_bytes": item.size_bytes},
        "gguf": None
        if summary is None
        else {
            "tensor_count": summary.tensor_count,
            "types": dict(summary.types),
            "bits_per_weight": round(summary.bits_per_weight, 4),
            "n_params": summary.n_params,
        },
        "prompt": params.prompt,
        "probe": probe,
        "answer": None
        if probe is None
        else {
            "text": probe["text"],
            "first_number": first_answer(probe["text"]),
            "is_expected": first_answer(probe["text"]) == params.expected,
            "contains_expected": params.expected in probe["text"],
        },
        "checks": [asdict(c) for c in checks],
    }
    path = _write_report(workdir, report)
    failed = [c for c in checks if c.verdict == "fail"]
    log.info("validate: verdict %s; text %r", verdict, probe["text"] if probe else None)
    if failed:
        raise IntegrityError(
            "validation failed: "
            + "; ".join(f"{c.name}: {c.reason}" for c in failed)
            + f" (report kept at {path})"
        )
    metrics = {
        "verdict": verdict,
        "text": probe["text"] if probe else None,
        "n_tokens": len(probe["tokens"]) if probe else 0,
        "has_expected_answer": bool(probe and first_answer(probe["text"]) == params.expected),
        "contains_expected": bool(probe and params.expected in probe["text"]),
        "load_s": probe["load_s"] if probe else None,
        "tokens_per_s": probe["tokens_per_s"] if probe else None,
        "device": probe["backend"]["device"] if probe else None,
        "checks": {c.name: c.verdict for c in checks},
    }
    warnings = tuple(f"{c.name}: {c.reason}" for c in checks if c.verdict == "warn")
    return StageResult(
        outputs=(OutputFile(OUTPUT_NAME, path, "validation-report", "application/json"),),
        metrics=metrics,
        warnings=warnings,
    )
