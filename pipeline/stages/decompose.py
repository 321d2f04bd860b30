"""Stage 4, decompose: every eligible weight matrix becomes ternary codes with fp16 block scales.

Inputs: ``inspect/model_card.json`` and the source shards ``download/<name>`` (safetensors, or one
``.gguf`` file whose tensors are dequantized: `gguf_pack.gguf_source`). For each
source shard (``card["shards"]``, 1-based index ``i``) the stage writes
``ternary/part-<i:05d>.safetensors``, a valid safetensors file in which every tensor is dtype
U8, shape ``[n_bytes]``, holding its bytes already in the GGUF layout of its chosen ggml type
(TQ2_0/TQ1_0 blocks, F16, F32, BF16 or Q8_0), keyed by GGUF name. Its ``__metadata__``::

    {"bonsai.format": "ternary-part/1",
     "bonsai.tensors": <JSON text: {"blk.0.attn_q.weight": {"ggml_type": "TQ2_0", "shape": [256, 256]}, ...}>}

(``shape`` in torch order, ``[rows, cols]``). The file is streamed: the header is computed
from the tensor plan, then each tensor's bytes are appended as soon as it is fitted, so
peak memory is about one tensor, not the model. Also ``report.json`` (`report.build_report`)
and ``sparsity.png``. Runs on CUDA when available (``device="auto"``).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt
import torch

from pipeline.errors import InputError, IntegrityError
from pipeline.stages.base import InputFile, JobSpec, OutputFile, StageResult, inputs_of
from pipeline.stages.decompose_merge import finish_report
from pipeline.ternary.decompose import decompose_packed
from pipeline.ternary.pack import bits_per_weight, decode_bytes, encode_plain, tensor_nbytes
from pipeline.ternary.policy import Recipe, TensorDecision, decide, get_recipe
from pipeline.ternary.report import TensorReport

__all__ = ["NAME", "VERSION", "PART_FORMAT", "Params", "make_params", "run", "read_part_index", "part_name"]

NAME = "decompose"
VERSION = "1"
PART_FORMAT = "ternary-part/1"
CARD_NAME = "model_card.json"
_VERIFY_TOLERANCE = 1e-3  # relative slack between torch's error and numpy's dequantized error
_MAX_CARD_BYTES = 64 * 1024 * 1024

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Params:
    """Decompose knobs: the recipe (see `policy.Recipe`), the device, and an optional shard subset.

    ``device``: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
    ``shards``: names of the source shards to process (fan-out across workers); empty = all.
    """

    recipe: Recipe
    device: str = "auto"
    shards: tuple[str, ...] = ()


def make_params(job: JobSpec) -> Params:
    """Params from the job's recipe name and options (``method``, ``irls_iters``, ``embed_type``, …,
    ``device``, ``shards``). Raises InputError for an unknown recipe or a bad option value."""
    options = dict(job.options)
    device = str(options.get("device", "auto"))
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise InputError(f"option device={device!r}; expected auto, cpu, cuda or cuda:N")
    shards = options.get("shards") or ()
    if isinstance(shards, str) or not all(isinstance(s, str) for s in shards):
        raise InputError(f"option shards={shards!r}; expected a list of shard file names")
    return Params(recipe=get_recipe(job.recipe, options), device=device, shards=tuple(shards))


def part_name(shard_index: int) -> str:
    """Logical output name of the part for 1-based source shard ``shard_index``."""
    return f"ternary/part-{shard_index:05d}.safetensors"


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device {device!r} requested but CUDA is not available on this worker")
    return torch.device(device)


def _load_card(inputs: Mapping[str, InputFile]) -> dict[str, Any]:
    item = inputs.get(f"inspect/{CARD_NAME}")
    if item is None:
        raise InputError(f"decompose needs inspect/{CARD_NAME}; inputs were {sorted(inputs)}")
    if item.path.stat().st_size > _MAX_CARD_BYTES:
        raise InputError(f"inspect/{CARD_NAME} is larger than {_MAX_CARD_BYTES} bytes; refusing to parse it")
    try:
        card = json.loads(item.path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"inspect/{CARD_NAME} is not readable JSON: {exc}") from exc
    if not isinstance(card, dict):
        raise IntegrityError(f"inspect/{CARD_NAME} holds {type(card).__name__}, expected an object")
    return card


def _header_bytes(entries: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """safetensors header (length prefix + JSON, space-padded to 8 bytes) for (name, type, shape, n_bytes)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, _, _, n_bytes in entries:
        header[name] = {"dtype": "U8", "shape": [n_bytes], "data_offsets": [offset, offset + n_bytes]}
        offset += n_bytes
    index = {name: {"ggml_type": t, "shape": list(shape)} for name, t, shape, _ in entries}
    header["__metadata__"] = {"bonsai.format": PART_FORMAT, "bonsai.tensors": json.dumps(index)}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def read_part_index(path: Path) -> dict[str, dict[str, Any]]:
    """``{gguf_name: {"ggml_type", "shape"}}`` of a part file; IntegrityError if it is not one."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        meta = handle.metadata() or {}
    if meta.get("bonsai.format") != PART_FORMAT:
        raise IntegrityError(f"{path.name}: format {meta.get('bonsai.format')!r}, expected {PART_FORMAT!r}")
    index: dict[str, dict[str, Any]] = json.loads(meta["bonsai.tensors"])
    return index


@dataclass
class _Probe:
    """The smallest ternary tensor of a part, kept to check the written bytes against its source."""

    name: str = ""
    weight: torch.Tensor | None = None
    rel_error: float = 0.0


def _encode(
    name: str, weight: torch.Tensor, decision: TensorDecision, recipe: Recipe, device: torch.device,
    out: npt.NDArray[np.uint8] | None = None,
) -> tuple[npt.NDArray[np.uint8], TensorReport]:
    """Bytes in the decided type plus the tensor's report line; ternary bytes land in ``out`` if given."""
    shape = tuple(weight.shape)
    n_params = weight.numel()
    if decision.is_ternary:
        try:
            result = decompose_packed(weight, decision.ggml_type, recipe.method, irls_iters=recipe.irls_iters,
                                      device=device, out=out, levels=recipe.levels)
        except ValueError as exc:
            raise InputError(f"{name}: cannot decompose into {decision.ggml_type}: {exc}") from exc
        raw = result.raw
        sq_error, absmean_sq, sq_norm = result.sq_error, result.absmean_sq_error, result.sq_norm
        sparsity, rel, absmean_rel = result.sparsity, result.rel_error, result.absmean_rel_error
        n_zero = result.n_zero
    else:
        weight = weight.to(torch.float32)  # 16-bit sources arrive as stored
        try:
            raw = encode_plain(weight, decision.ggml_type)
        except ValueError as exc:
            raise InputError(
                f"{name}: cannot store as {decision.ggml_type}: {exc}; choose another type for it "
                "(recipe options embed_type / output_type / fallback_type)"
            ) from exc
        back = torch.from_numpy(decode_bytes(raw, decision.ggml_type, shape))
        sq_error = float(((weight - back) ** 2).sum(dtype=torch.float64))
        sq_norm = float((weight * weight).sum(dtype=torch.float64))
        rel = (sq_error / sq_norm) ** 0.5 if sq_norm > 0 else 0.0
        sparsity, absmean_rel, absmean_sq, n_zero = None, None, None, 0
    line = TensorReport(
        name=name, shape=list(shape), ggml_type=decision.ggml_type, is_ternary=decision.is_ternary,
        is_fallback=decision.is_fallback, reason=decision.reason, n_params=n_params, n_bytes=int(raw.size),
        bits_per_weight=bits_per_weight(decision.ggml_type), rel_error=rel, sparsity=sparsity,
        absmean_rel_error=absmean_rel, sq_error=sq_error, absmean_sq_error=absmean_sq, sq_norm=sq_norm,
        n_zero=n_zero,
    )
    return raw, line


def _write_tensor(handle: BinaryIO, name: str, raw: npt.NDArray[np.uint8], expected_bytes: int) -> None:
    if raw.size != expected_bytes:
        raise IntegrityError(f"{name}: encoded {raw.size} bytes but the plan reserved {expected_bytes}")
    handle.write(np.ascontiguousarray(raw).data)


def _plan_entries(
    planned: list[Any], decisions: Mapping[str, TensorDecision]
) -> list[tuple[str, str, tuple[int, ...], int]]:
    entries = []
    for item in planned:
        ggml_type = decisions[item.gguf_name].ggml_type
        try:
            n_bytes = tensor_nbytes(ggml_type, item.shape)
        except ValueError as exc:
            raise InputError(
                f"{item.gguf_name}: shape {list(item.shape)} does not fit {ggml_type}: {exc}"
            ) from exc
        entries.append((item.gguf_name, ggml_type, tuple(item.shape), n_bytes))
    return entries


def _verify_part(path: Path, entries: list[tuple[str, str, tuple[int, ...], int]], probe: _Probe) -> None:
    """Reopen a written part: names, byte sizes, index, file size, and one ternary tensor's error."""
    from safetensors import safe_open

    header_len = len(_header_bytes(entries))
    expected_size = header_len + sum(e[3] for e in entries)
    if path.stat().st_size != expected_size:
        raise IntegrityError(f"{path.name}: {path.stat().st_size} bytes on disk, expected {expected_size}")
    index = read_part_index(path)
    with safe_open(str(path), framework="numpy") as handle:
        if set(handle.keys()) != {e[0] for e in entries}:
            raise IntegrityError(f"{path.name}: tensor names differ from the plan")
        for name, ggml_type, shape, n_bytes in entries:
            if handle.get_slice(name).get_shape() != [n_bytes]:
                raise IntegrityError(f"{path.name}: {name} holds {handle.get_slice(name).get_shape()} bytes, "
                                     f"expected [{n_bytes}]")
            if index.get(name) != {"ggml_type": ggml_type, "shape": list(shape)}:
                raise IntegrityError(f"{path.name}: index entry of {name} is {index.get(name)}")
        if probe.weight is None:
            return
        ggml_type, shape = index[probe.name]["ggml_type"], tuple(index[probe.name]["shape"])
        values = torch.from_numpy(decode_bytes(handle.get_tensor(probe.name), ggml_type, shape))
    w = probe.weight
    norm = float(torch.linalg.vector_norm(w.double()))
    rel = float(torch.linalg.vector_norm((w - values).double())) / norm if norm > 0 else 0.0
    if abs(rel - probe.rel_error) > _VERIFY_TOLERANCE * max(probe.rel_error, 1e-3):
        raise IntegrityError(
            f"{path.name}: {probe.name} read back with relative error {rel:.6g}, "
            f"but decomposition reported {probe.rel_error:.6g}"
        )


def _decompose_shard(
    card: Mapping[str, Any], files: Mapping[str, Path], shard: str, final: Path,
    planned: list[Any], decisions: Mapping[str, TensorDecision], recipe: Recipe, device: torch.device,
) -> list[TensorReport]:
    """Stream one source shard into one part file at ``final``; returns its report lines."""
    iter_tensors = _source_module(card).iter_tensors
    entries = _plan_entries(planned, decisions)
    ternary = [e for e in entries if decisions[e[0]].is_ternary]
    probe = _Probe(name=min(ternary, key=lambda e: int(np.prod(e[2])))[0] if ternary else "")
    if final.exists():
        raise InputError(f"{final} already exists; the work folder must start empty")
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    rows: list[TensorReport] = []
    # One buffer for every ternary tensor's bytes: the stream allocates nothing per tensor.
    out = np.empty(max((e[3] for e in ternary), default=0), np.uint8)
    with open(partial, "wb") as handle:
        handle.write(_header_bytes(entries))
        stream = iter_tensors(card, files, shard, **_stream_options(iter_tensors))
        planned_next = iter(entries)
        # Not zip(): it keeps the previous pair alive while fetching the next, so the source
        # could not reuse that tensor's memory.
        for got_name, weight in stream:
            planned_entry = next(planned_next, None)
            if planned_entry is None:
                raise IntegrityError(f"shard {shard!r}: the source gave {got_name} beyond the plan")
            name, _, shape, n_bytes = planned_entry
            if got_name != name or tuple(weight.shape) != shape:
                raise IntegrityError(f"shard {shard!r}: expected {name} {list(shape)} next, "
                                     f"source gave {got_name} {list(weight.shape)}")
            raw, line = _encode(name, weight, decisions[name], recipe, device, out)
            _write_tensor(handle, name, raw, n_bytes)
            if name == probe.name:
                probe.weight, probe.rel_error = weight.clone(), line.rel_error
            rows.append(line)
            log.debug("stage decompose: %s %s -> %s rel_error=%.4f", name, list(shape), line.ggml_type,
                      line.rel_error)
            del weight, raw
        missing = next(planned_next, None)
        if missing is not None:
            raise IntegrityError(f"shard {shard!r}: the source ended before planned tensor {missing[0]}")
    os.replace(partial, final)
    _verify_part(final, entries, probe)
    return rows


def _stream_options(iter_tensors: Any) -> dict[str, Any]:
    """16-bit safetensors weights as stored: the fit reads bfloat16 directly, so no float32 copy
    of each tensor is made (a pass over memory saved, and half the peak memory)."""
    from pipeline.gguf_pack import source

    return {"as_stored": True} if iter_tensors is source.iter_tensors else {}


def _source_module(card: Mapping[str, Any]) -> Any:
    """Where tensors come from: a GGUF file (names and llama.cpp layout as stored, dequantized)
    or an HF checkpoint (renamed, q/k permuted). Both offer tensor_plan(card) and iter_tensors."""
    from pipeline.gguf_pack import gguf_source

    if gguf_source.is_gguf_card(card):
        return gguf_source
    from pipeline.gguf_pack import source

    return source


def _fit_backend(recipe: Recipe, device: torch.device) -> str:
    """What fits the ternary tensors: the compiled CPU kernel (with its thread count) or torch."""
    from pipeline.ternary import kernel

    optimal_uniform = recipe.method == "optimal" and recipe.irls_iters == 0
    if device.type == "cpu" and optimal_uniform and kernel.is_available():
        return f"kernel ({kernel.thread_count()} threads)"
    return f"torch ({device.type}, {torch.get_num_threads()} threads)"


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux: the high-water mark of this whole process, not just this stage.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run(params: Params, inputs: Mapping[str, InputFile], workdir: Path) -> StageResult:
    """Decompose every shard (or ``params.shards``) into part files, then write the report and plot.

    Raises InputError for a missing card or shard, an unsupported model (from the tensor plan),
    a value that does not fit its type; IntegrityError when the source disagrees with the card
    or a written part does not read back as planned.
    """
    started = time.monotonic()
    device = _resolve_device(params.device)
    card = _load_card(inputs)
    files = {name: item.path for name, item in inputs_of(inputs, "download").items()}
    plan = _source_module(card).tensor_plan(card)
    shards = [str(s) for s in card.get("shards") or []]
    selected = list(params.shards) or shards
    unknown = [s for s in selected if s not in shards]
    missing = [s for s in selected if s not in files]
    if unknown or missing:
        raise InputError(f"shards {unknown or missing} are not in the card's shards {shards} or the inputs; "
                         "check the download and inspect outputs")
    recipe = params.recipe
    decisions = {p.gguf_name: decide(p.gguf_name, p.shape, recipe) for p in plan}
    outputs: list[OutputFile] = []
    rows: list[TensorReport] = []
    for shard in selected:
        name = part_name(shards.index(shard) + 1)
        planned = [p for p in plan if p.shard == shard]
        log.info("stage decompose: shard %s (%d tensors) -> %s on %s", shard, len(planned), name, device)
        rows += _decompose_shard(card, files, shard, workdir / name, planned, decisions, recipe, device)
        outputs.append(OutputFile(name, workdir / name, "ternary-part"))
    elapsed_s = time.monotonic() - started
    header = {
        "format": "decompose-report/1", "recipe": recipe.name, "ternary_type": recipe.ternary_type,
        "method": recipe.method, "irls_iters": recipe.irls_iters, "levels": recipe.levels,
        "device": str(device),
        "fit_backend": _fit_backend(recipe, device),
        "shards": selected, "elapsed_s": round(elapsed_s, 3), "peak_rss_bytes": _peak_rss_bytes(),
        "source_format": card.get("format"), "source_types": card.get("dtypes"),
    }
    report_outputs, metrics, warnings = finish_report(rows, header, workdir)
    return StageResult(outputs=(*outputs, *report_outputs), metrics=metrics, warnings=warnings)
