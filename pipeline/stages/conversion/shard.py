"""One source shard of the decompose stage: fit each tensor as it streams in, into one part file.

The part's header (its index) is computed from the tensor plan first, then each tensor's
bytes are appended as soon as it is fitted, so peak memory is about one tensor, not the
model. The written part is reopened and checked before it counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt
import torch

from pipeline.core.errors import InputError, IntegrityError
from pipeline.core.files import atomic_path
from pipeline.formats.decompose_report import TensorReport
from pipeline.formats.gguf.ggml_quantize import LLAMA_QUANT_TYPES
from pipeline.formats.gguf.types import GGMLTypeName
from pipeline.formats.model_card import ModelCard
from pipeline.formats.parts import PartEntry, PartIndex
from pipeline.formats.rawio import pread_exact
from pipeline.stages.conversion.calibration import CalibrationInputs
from pipeline.stages.conversion.repack import TERNARY_SOURCE_TYPES, repack
from pipeline.ternary.codecs import decompose_packed
from pipeline.ternary.exactness import decodes_exactly
from pipeline.ternary.pack import PART_TYPES, bits_per_weight, decode_bytes, encode_plain, tensor_nbytes
from pipeline.ternary.packed import PackedMatrix
from pipeline.ternary.policy import GPTQ, Recipe, TensorDecision
from pipeline.ternary.rows import rows_per_block

__all__ = ["PART_TYPES", "Fetch", "read_part_index", "decompose_shard", "write_kept_part", "encode_tensor",
           "stream_options"]

_VERIFY_TOLERANCE = 1e-3  # relative slack between torch's error and numpy's dequantized error

log = logging.getLogger(__name__)


def read_part_index(path: Path, label: str | None = None) -> PartIndex:
    """The index of a part file, checked against its stored tensors; IntegrityError if it is not one."""
    return PartIndex.load(path, label or path.name, tensor_nbytes, PART_TYPES)


@dataclass
class _Probe:
    """The smallest ternary tensor of a part, kept to check the written bytes against its source."""

    name: str = ""
    weight: torch.Tensor | None = None
    rel_error: float = 0.0


def _fit_ternary(
    name: str, weight: torch.Tensor, decision: TensorDecision, recipe: Recipe, device: torch.device,
    out: npt.NDArray[np.uint8] | None, calibration: CalibrationInputs | None,
) -> tuple[PackedMatrix, str]:
    """The packed fit and what the report adds to the decision's reason (calibration used)."""
    if recipe.method == GPTQ:
        if calibration is None:
            raise InputError(f"{name}: method=gptq needs the calibrate stage's Gram matrices")
        from pipeline.ternary.decompose_gptq import decompose_gptq_packed

        gram = calibration.gram(name)
        return decompose_gptq_packed(weight, decision.ggml_type, gram, recipe.levels, device, out), (
            "; fitted against its input Gram matrix (calibration)")
    importance = calibration.importance(name, int(weight.shape[1])) if calibration else None
    note = "; importance-weighted by the calibration imatrix" if importance is not None else (
        "; no importance recorded for it: fitted unweighted" if calibration and calibration.imatrix else "")
    levels = decision.levels or recipe.levels
    return decompose_packed(weight, decision.ggml_type, recipe.method, importance=importance,
                            irls_iters=recipe.irls_iters, device=device, out=out, levels=levels), note


def _encode_plain_rows(
    weight: torch.Tensor, ggml_type: str, importance: npt.NDArray[np.float32] | None,
) -> tuple[npt.NDArray[np.uint8], float, float, bool]:
    """(bytes, squared error, sum w^2, decodes exactly) of ``weight`` in a plain type, by blocks of rows.

    Every plain type encodes rows independently, so encoding row blocks gives the whole tensor's
    bytes; only one block is ever widened to float32 and decoded, so the peak stays near the
    stored tensor plus its bytes (the whole-tensor way held four float32 copies of it).
    """
    cols = int(weight.shape[-1]) if weight.dim() else 1
    rows = weight.reshape(-1, cols)  # a norm or a bias is one row
    row_bytes = tensor_nbytes(ggml_type, (1, cols))
    raw = np.empty(rows.shape[0] * row_bytes, np.uint8)
    step = rows_per_block(cols)
    sq_error = sq_norm = 0.0
    exact = True
    for r0 in range(0, rows.shape[0], step):
        block = rows[r0:r0 + step].to(torch.float32)  # 16-bit sources arrive as stored
        part = encode_plain(block, ggml_type, importance)
        raw[r0 * row_bytes:r0 * row_bytes + part.size] = part
        back = torch.from_numpy(decode_bytes(part, ggml_type, tuple(block.shape)))
        exact = exact and bool(torch.equal(block, back))
        back.sub_(block)
        sq_error += float((back * back).sum(dtype=torch.float64))
        sq_norm += float((block * block).sum(dtype=torch.float64))
    return raw, sq_error, sq_norm, exact


def _encode(
    name: str, weight: torch.Tensor, decision: TensorDecision, recipe: Recipe, device: torch.device,
    out: npt.NDArray[np.uint8] | None = None, calibration: CalibrationInputs | None = None,
) -> tuple[npt.NDArray[np.uint8], TensorReport]:
    """Bytes in the decided type plus the tensor's report line; ternary bytes land in ``out`` if given."""
    shape = tuple(weight.shape)
    n_params = weight.numel()
    note = ""
    if decision.is_ternary:
        try:
            result, note = _fit_ternary(name, weight, decision, recipe, device, out, calibration)
        except ValueError as exc:
            raise InputError(f"{name}: cannot decompose into {decision.ggml_type}: {exc}") from exc
        raw = result.raw
        sq_error, absmean_sq, sq_norm = result.sq_error, result.absmean_sq_error, result.sq_norm
        sparsity, rel, absmean_rel = result.sparsity, result.rel_error, result.absmean_rel_error
        n_zero = result.n_zero
        # Only a fit with no error at all can be lossless; its bytes are then decoded and compared.
        exact = sq_error == 0.0 and decodes_exactly(raw, decision.ggml_type, weight)
        exact_in = None if exact else _finer_exact_type(weight, decision.ggml_type, device)
    else:
        # llama.cpp's quants weigh their rounding by the imatrix, as llama-quantize does.
        weights = calibration.importance(name, shape[-1]) if (
            calibration is not None and decision.ggml_type in LLAMA_QUANT_TYPES and len(shape) == 2) else None
        try:
            raw, sq_error, sq_norm, exact = _encode_plain_rows(
                weight, decision.ggml_type, weights.numpy() if weights is not None else None)
        except ValueError as exc:
            raise InputError(
                f"{name}: cannot store as {decision.ggml_type}: {exc}; choose another type for it "
                "(recipe options embed_type / output_type / fallback_type)"
            ) from exc
        exact_in = None
        rel = (sq_error / sq_norm) ** 0.5 if sq_norm > 0 else 0.0
        sparsity, absmean_rel, absmean_sq, n_zero = None, None, None, 0
    line = TensorReport(
        name=name, shape=list(shape), ggml_type=decision.ggml_type, is_ternary=decision.is_ternary,
        is_fallback=decision.is_fallback, reason=decision.reason + note, n_params=n_params,
        n_bytes=int(raw.size),
        bits_per_weight=bits_per_weight(decision.ggml_type), rel_error=rel, sparsity=sparsity,
        absmean_rel_error=absmean_rel, sq_error=sq_error, absmean_sq_error=absmean_sq, sq_norm=sq_norm,
        n_zero=n_zero, exact=exact, exact_in=exact_in,
    )
    return raw, line


# One scale per 256 inputs -> Q2_0's one per 64.
_FINER: dict[str, str] = {GGMLTypeName.TQ2_0: GGMLTypeName.Q2_0, GGMLTypeName.TQ1_0: GGMLTypeName.Q2_0}
_PEEK_ROWS = 16


def _finer_exact_type(weight: torch.Tensor, ggml_type: str, device: torch.device) -> str | None:
    """Q2_0 when a ternary tensor not exact in ``ggml_type`` (a 256-block type) decodes exactly in it.

    A cheap look first (a few rows: every 64-group's magnitudes are 0 or one value), so an ordinary
    lossy model pays almost nothing; only a tensor that looks ternary per group is fitted again."""
    finer = _FINER.get(ggml_type)
    if finer is None or weight.ndim != 2 or weight.shape[1] % 64:
        return None
    peek = weight[:_PEEK_ROWS].to(torch.float32).abs().reshape(-1, 64)
    top = peek.amax(dim=1, keepdim=True)
    if not bool(((peek == 0) | (peek == top)).all()):
        return None
    try:
        fitted = decompose_packed(weight, finer, "optimal", device=device)
    except ValueError:
        return None
    return finer if fitted.sq_error == 0.0 and decodes_exactly(fitted.raw, finer, weight) else None


def _write_tensor(handle: BinaryIO, name: str, raw: npt.NDArray[np.uint8], expected_bytes: int) -> None:
    if raw.size != expected_bytes:
        raise IntegrityError(f"{name}: encoded {raw.size} bytes but the plan reserved {expected_bytes}")
    handle.write(np.ascontiguousarray(raw).data)


def _plan_index(planned: list[Any], decisions: Mapping[str, TensorDecision]) -> PartIndex:
    entries = []
    for item in planned:
        ggml_type = decisions[item.gguf_name].ggml_type
        try:
            n_bytes = tensor_nbytes(ggml_type, item.shape)
        except ValueError as exc:
            raise InputError(
                f"{item.gguf_name}: shape {list(item.shape)} does not fit {ggml_type}: {exc}"
            ) from exc
        entries.append(PartEntry(item.gguf_name, ggml_type, tuple(item.shape), n_bytes))
    return PartIndex(tuple(entries))


def _verify_part(path: Path, planned: PartIndex, probe: _Probe) -> None:
    """Reopen a written part: size, index against the plan, and one ternary tensor's error."""
    if path.stat().st_size != planned.file_size_bytes:
        raise IntegrityError(
            f"{path.name}: {path.stat().st_size} bytes on disk, expected {planned.file_size_bytes}"
        )
    written = read_part_index(path)
    if [(e.gguf_name, e.ggml_type, e.shape, e.n_bytes) for e in written.entries] != [
        (e.gguf_name, e.ggml_type, e.shape, e.n_bytes) for e in planned.entries
    ]:
        raise IntegrityError(f"{path.name}: the index read back differs from the plan")
    if probe.weight is None:
        return
    entry = written.by_name()[probe.name]
    raw = np.empty(entry.n_bytes, np.uint8)
    with open(path, "rb") as handle:
        pread_exact(handle.fileno(), raw.data, int(entry.offset or 0))
    values = torch.from_numpy(decode_bytes(raw, entry.ggml_type, entry.shape))
    w = probe.weight
    norm = float(torch.linalg.vector_norm(w.double()))
    rel = float(torch.linalg.vector_norm((w - values).double())) / norm if norm > 0 else 0.0
    if abs(rel - probe.rel_error) > _VERIFY_TOLERANCE * max(probe.rel_error, 1e-3):
        raise IntegrityError(
            f"{path.name}: {probe.name} read back with relative error {rel:.6g}, "
            f"but decomposition reported {probe.rel_error:.6g}"
        )


Fetch = Callable[[str, TensorDecision], "npt.NDArray[np.uint8]"]


def write_kept_part(final: Path, planned: list[Any], decisions: Mapping[str, TensorDecision],
                    fetch: Fetch) -> None:
    """A part file of bytes made earlier (the auto search's kept rungs): ``fetch(name, decision)``
    gives each planned tensor's bytes in its decided type. Checked like a streamed part."""
    index = _plan_index(planned, decisions)
    final.parent.mkdir(parents=True, exist_ok=True)
    # Not flushed here: the store flushes what it keeps (a work folder dies with its attempt).
    with atomic_path(final, durable=False) as partial, open(partial, "wb") as handle:
        handle.write(index.header_bytes())
        for entry in index.entries:
            _write_tensor(handle, entry.gguf_name, fetch(entry.gguf_name, decisions[entry.gguf_name]),
                          entry.n_bytes)
    _verify_part(final, index, _Probe())


def encode_tensor(
    name: str, weight: torch.Tensor, decision: TensorDecision, recipe: Recipe, device: torch.device,
    calibration: CalibrationInputs | None = None,
) -> npt.NDArray[np.uint8]:
    """The bytes decompose writes for ``weight`` under ``decision``."""
    return _encode(name, weight, decision, recipe, device, None, calibration)[0]


def decompose_shard(
    source: Any, card: ModelCard, files: Mapping[str, Path], shard: str, final: Path,
    planned: list[Any], decisions: Mapping[str, TensorDecision], recipe: Recipe, device: torch.device,
    calibration: CalibrationInputs | None = None,
) -> list[TensorReport]:
    """Stream one source shard into one part file at ``final``; returns its report lines."""
    index = _plan_index(planned, decisions)
    ternary = [e for e in index.entries if decisions[e.gguf_name].is_ternary]
    probe = _Probe(name=min(ternary, key=lambda e: int(np.prod(e.shape))).gguf_name if ternary else "")
    final.parent.mkdir(parents=True, exist_ok=True)
    rows: list[TensorReport] = []
    # One buffer for every ternary tensor's bytes: the stream allocates nothing per tensor.
    out = np.empty(max((e.n_bytes for e in ternary), default=0), np.uint8)
    # Not flushed here: the store flushes what it keeps (a work folder dies with its attempt).
    with atomic_path(final, durable=False) as partial, open(partial, "wb") as handle:
        handle.write(index.header_bytes())
        stream = source.iter_tensors(card, files, shard, **stream_options(source))
        stored = _ternary_source_tensors(card, files, shard, decisions)
        planned_next = iter(index.entries)
        # Not zip(): it keeps the previous pair alive while fetching the next, so the source
        # could not reuse that tensor's memory.
        for got_name, weight in stream:
            planned_entry = next(planned_next, None)
            if planned_entry is None:
                raise IntegrityError(f"shard {shard!r}: the source gave {got_name} beyond the plan")
            name, shape, n_bytes = planned_entry.gguf_name, planned_entry.shape, planned_entry.n_bytes
            if got_name != name or tuple(weight.shape) != shape:
                raise IntegrityError(f"shard {shard!r}: expected {name} {list(shape)} next, "
                                     f"source gave {got_name} {list(weight.shape)}")
            raw, line = _encode_or_repack(name, weight, decisions[name], recipe, device, out,
                                          stored.get(name), calibration)
            _write_tensor(handle, name, raw, n_bytes)
            if name == probe.name:
                probe.weight, probe.rel_error = weight.clone(), line.rel_error
            rows.append(line)
            log.debug("stage decompose: %s %s -> %s rel_error=%.4f", name, list(shape), line.ggml_type,
                      line.rel_error)
            del weight, raw
        missing = next(planned_next, None)
        if missing is not None:
            raise IntegrityError(
                f"shard {shard!r}: the source ended before planned tensor {missing.gguf_name}"
            )
    _verify_part(final, index, probe)
    return rows


def _ternary_source_tensors(
    card: ModelCard, files: Mapping[str, Path], shard: str, decisions: Mapping[str, TensorDecision]
) -> dict[str, tuple[str, Any]]:
    """(source type, raw block bytes) of a GGUF source's ternary tensors that stay ternary."""
    if not card.is_gguf:
        return {}
    from pipeline.formats.gguf.tensor_source import open_reader

    wanted = {t.name for t in card.tensors_in(shard) if t.dtype in TERNARY_SOURCE_TYPES
              and decisions[t.name].is_ternary}
    if not wanted:
        return {}
    reader = open_reader(files[shard])
    return {t.name: (t.tensor_type.name, t.data) for t in reader.tensors if t.name in wanted}


def _encode_or_repack(
    name: str, weight: torch.Tensor, decision: TensorDecision, recipe: Recipe, device: torch.device,
    out: npt.NDArray[np.uint8], stored: tuple[str, Any] | None, calibration: CalibrationInputs | None = None,
) -> tuple[npt.NDArray[np.uint8], TensorReport]:
    """A stored ternary tensor moved to the target layout without loss when it can be; else fitted."""
    if stored is None:
        return _encode(name, weight, decision, recipe, device, out, calibration)
    moved = repack(np.asarray(stored[1]), stored[0], decision.ggml_type)
    if moved.raw is None:
        raw, line = _encode(name, weight, decision, recipe, device, out, calibration)
        return raw, replace(line, reason=f"{line.reason}; {moved.note}")
    values = decode_bytes(moved.raw, decision.ggml_type, tuple(weight.shape))
    if not np.array_equal(values, weight.numpy()):
        raise IntegrityError(f"{name}: re-packed {stored[0]} -> {decision.ggml_type} decodes differently "
                             "from the source; this is a bug in the re-packing, please report it")
    sq_norm = float(np.square(values, dtype=np.float64).sum())
    line = TensorReport(
        name=name, shape=list(weight.shape), ggml_type=decision.ggml_type, is_ternary=True,
        is_fallback=decision.is_fallback, reason=f"{decision.reason}; {moved.note}", n_params=weight.numel(),
        n_bytes=int(moved.raw.size), bits_per_weight=bits_per_weight(decision.ggml_type), rel_error=0.0,
        sparsity=float((values == 0).mean()) if values.size else 0.0, absmean_rel_error=None,
        sq_error=0.0, absmean_sq_error=None, sq_norm=sq_norm, n_zero=int((values == 0).sum()), exact=True,
    )
    return moved.raw, line


def stream_options(source: Any) -> dict[str, Any]:
    """16-bit safetensors weights as stored: the fit reads bfloat16 directly, so no float32 copy
    of each tensor is made (a pass over memory saved, and half the peak memory)."""
    from pipeline.formats.hf import checkpoint

    # A GGUF source may hold Q2_0 / Q1_0, whose maths gguf lacks: their codecs decode them.
    return {"as_stored": True} if source is checkpoint else {"decoder": _decode_low_bit}


def _decode_low_bit(raw: npt.NDArray[np.uint8], type_name: str) -> npt.NDArray[np.float32]:
    from pipeline.ternary.codecs import codec_for

    return codec_for(type_name).dequantize(raw)
