"""Stage 3, inspect: validate the checkpoint's structure before any heavy work; write its card.

Inputs: every ``download/<name>`` file and ``checksum/manifest.json``. Nothing here reads
tensor data: only config.json, the safetensors headers (or a GGUF file's header) and the
tokenizer's type. The stage refuses, with the reason:

- a missing or malformed config.json, or an architecture not in `SUPPORTED_ARCHITECTURES`;
- pickle-only checkpoints (``.bin``/``.pt``/``.pth``/``.ckpt``): never unpickled here;
- already-quantized "impostors": ``quantization_config``, GPTQ/AWQ files, packed-weight tensor
  names (``qweight``, ``qzeros``, ``scales``, ``g_idx``...), integer or FP8 weight matrices;
- a shard index whose weight map leaves the folder, names missing shards or missing tensors.

Output ``model_card.json`` (kind ``model-card``), a shape later stages rely on::

    {"architecture": "llama", "hf_architecture": "LlamaForCausalLM", "config": {...},
     "format": "safetensors", "shards": ["model.safetensors"],
     "tensors": [{"name": ..., "shape": [...], "dtype": "BF16", "shard": ...}],
     "param_count": 123, "dtypes": {"BF16": 20},
     "tokenizer": {"kind": "bpe" | "sentencepiece" | None, "files": [...]}}
"""

from __future__ import annotations

import json
import mmap
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.hf.architectures import HF_ARCHITECTURES
from pipeline.formats.safetensors import TensorInfo, read_header
from pipeline.stages.base import InputFile, JobSpec, OutputFile, StageResult, inputs_of, safe_relpath

__all__ = [
    "NAME",
    "VERSION",
    "CARD_NAME",
    "SUPPORTED_ARCHITECTURES",
    "Params",
    "make_params",
    "run",
]

NAME = "inspect"
VERSION = "1"
CARD_NAME = "model_card.json"
_MANIFEST_KEY = "checksum/manifest.json"
_HUB_FILES_NAME = "hub_files.json"
_INDEX_NAME = "model.safetensors.index.json"
_MAX_JSON_BYTES = 256 * 1024 * 1024  # tokenizer.json of a 256k vocabulary is ~30 MB

# HF class name -> our architecture name (the HF model_type). One table for the whole pipeline:
# an architecture is added as a row of gguf_pack.names.ARCH_SPECS, which packaging reads too.
SUPPORTED_ARCHITECTURES: Mapping[str, str] = {cls: spec.name for cls, spec in HF_ARCHITECTURES.items()}
# quant_method values that are the *input* format of an architecture, not an impostor: BitNet
# b1.58 checkpoints declare quant_method "bitnet" over full-precision latent weights (the packed
# U8 variant is still refused by the tensor dtype and name checks below).
_NATIVE_QUANT_METHODS: frozenset[str] = frozenset({"bitnet"})

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_QUANTIZER_FILES = ("quantize_config.json", "quant_config.json", "quantization_config.json")
# Last dotted part of tensor names that only packed/quantized checkpoints carry
# (GPTQ/AWQ: qweight, qzeros, scales, g_idx; FP8: weight_scale(_inv); bitsandbytes: absmax...).
_QUANTIZED_TENSOR_PARTS = frozenset(
    {"qweight", "qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv", "absmax", "quant_map", "SCB"}
)
_QUANTIZED_DTYPE_PREFIXES = ("I", "U", "F8_")  # integer and FP8 storage; BOOL stays allowed
_TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json",
})


@dataclass(frozen=True)
class Params:
    """The inspect stage has no knobs: what to check follows from the files."""


def make_params(job: JobSpec) -> Params:
    """Inspect parameters from a job (none)."""
    return Params()


def run(
    params: Params,
    inputs: Mapping[str, InputFile],
    workdir: Path,
    **clients: Any,
) -> StageResult:
    """Validate the snapshot and write ``model_card.json``.

    Raises InputError (unsupported or refused checkpoint, missing config) and IntegrityError
    (corrupt headers, index/shard disagreement, inputs that differ from the manifest).
    """
    files = {name: item for name, item in inputs_of(inputs, "download").items() if name != _HUB_FILES_NAME}
    _check_against_manifest(files, inputs.get(_MANIFEST_KEY))
    warnings: list[str] = []
    gguf_files = sorted(name for name in files if name.lower().endswith(".gguf") and "/" not in name)
    if "config.json" not in files and gguf_files:
        card = _gguf_card(files, gguf_files, warnings)
    else:
        card = _safetensors_card(files, warnings)
    output = _write_card(workdir, card)
    metrics = {
        "architecture": card["architecture"],
        "format": card["format"],
        "param_count": card["param_count"],
        "n_tensors": len(card["tensors"]),
        "n_shards": len(card["shards"]),
        "dtypes": card["dtypes"],
    }
    return StageResult(outputs=(output,), metrics=metrics, warnings=tuple(warnings))


def _check_against_manifest(files: Mapping[str, InputFile], manifest_input: InputFile | None) -> None:
    """The files must be the ones the checksum stage verified (stored digests, no re-hash)."""
    if manifest_input is None:
        raise InputError(f"inspect needs {_MANIFEST_KEY} from the checksum stage; run checksum first")
    if not files:
        raise InputError("inspect: no download/<name> inputs; the download stage produced nothing")
    manifest = _load_json(manifest_input.path, "checksum manifest.json")
    try:
        recorded = {entry["name"]: entry["sha256"] for entry in manifest["files"]}
    except (KeyError, TypeError) as exc:
        raise IntegrityError(f"checksum manifest.json is malformed ({exc})") from exc
    for name, item in sorted(files.items()):
        if name not in recorded:
            raise IntegrityError(f"{name}: not in the checksum manifest; it was never verified")
        if item.sha256 and recorded[name] != item.sha256.lower():
            raise IntegrityError(
                f"{name}: differs from the checksum manifest: expected {recorded[name]}, "
                f"actual {item.sha256.lower()}"
            )


def _load_json(path: Path, label: str) -> Any:
    size_bytes = path.stat().st_size
    if size_bytes > _MAX_JSON_BYTES:
        raise InputError(f"{label}: {size_bytes} bytes is too large for a JSON file here")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{label}: not valid UTF-8 JSON ({exc})") from exc


def _safetensors_card(files: Mapping[str, InputFile], warnings: list[str]) -> dict[str, Any]:
    config = _load_config(files)
    hf_architecture, architecture = _architecture(config)
    _refuse_quantized_config(config)
    _refuse_quantizer_files(files)
    shards, index_map = _select_shards(files, warnings)
    tensors = _read_tensors(files, shards, index_map)
    _refuse_quantized_tensors(tensors)
    return {
        "architecture": architecture,
        "hf_architecture": hf_architecture,
        "config": config,
        "format": "safetensors",
        "shards": shards,
        "tensors": [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "shard": shard} for shard, t in tensors
        ],
        "param_count": sum(t.numel for _, t in tensors),
        "dtypes": dict(sorted(Counter(t.dtype for _, t in tensors).items())),
        "tokenizer": _tokenizer(files, warnings),
    }


def _load_config(files: Mapping[str, InputFile]) -> dict[str, Any]:
    if "config.json" not in files:
        weights = sorted(n for n in files if n.endswith((".safetensors", *_PICKLE_SUFFIXES)))
        raise InputError(
            "config.json is missing: a Hugging Face checkpoint needs it to name its architecture "
            f"(files present: {', '.join(sorted(files)[:12]) or 'none'}"
            f"{'; weights: ' + ', '.join(weights[:5]) if weights else ''})"
        )
    config = _load_json(files["config.json"].path, "config.json")
    if not isinstance(config, dict):
        raise InputError("config.json: expected a JSON object")
    return config


def _architecture(config: Mapping[str, Any]) -> tuple[str, str]:
    """(HF class name, our architecture name); InputError when unsupported or unnamed."""
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    names = config.get("architectures")
    model_type = config.get("model_type")
    if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
        hf_architecture = names[0]
    elif isinstance(model_type, str):
        by_type = {arch: hf for hf, arch in SUPPORTED_ARCHITECTURES.items()}
        if model_type not in by_type:
            raise InputError(
                f"config.json: model_type {model_type!r} is not supported (supported: {supported})"
            )
        hf_architecture = by_type[model_type]
    else:
        raise InputError("config.json has neither 'architectures' nor 'model_type'; cannot tell the model")
    if hf_architecture not in SUPPORTED_ARCHITECTURES:
        raise InputError(
            f"config.json: architecture {hf_architecture!r} is not supported (supported: {supported})"
        )
    return hf_architecture, SUPPORTED_ARCHITECTURES[hf_architecture]


def _refuse_quantized_config(config: Mapping[str, Any]) -> None:
    quant = config.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method in _NATIVE_QUANT_METHODS:
        return
    raise InputError(
        f"config.json has quantization_config (quant_method={method!r}): the checkpoint is already "
        "quantized; convert from the original F32/F16/BF16 weights instead"
    )


def _refuse_quantizer_files(files: Mapping[str, InputFile]) -> None:
    for name in sorted(files):
        base = name.rsplit("/", 1)[-1].lower()
        if base in _QUANTIZER_FILES or (
            base.endswith(".safetensors") and ("gptq" in base or "awq" in base)
        ):
            raise InputError(
                f"{name}: a GPTQ/AWQ quantizer file; the checkpoint is already quantized; "
                "convert from the original F32/F16/BF16 weights instead"
            )


def _select_shards(
    files: Mapping[str, InputFile], warnings: list[str]
) -> tuple[list[str], dict[str, str] | None]:
    """Sorted shard names, and the index's tensor -> shard map when there is an index."""
    top_level = sorted(n for n in files if n.endswith(".safetensors") and "/" not in n)
    if _INDEX_NAME in files:
        index_map = _load_index(files)
        shards = sorted(set(index_map.values()))
        unused = [n for n in top_level if n not in shards]
    elif top_level:
        index_map = None
        if "model.safetensors" in top_level:
            shards = ["model.safetensors"]
        elif len(top_level) == 1:
            shards = top_level
        else:
            raise InputError(
                f"{len(top_level)} safetensors files ({', '.join(top_level[:5])}) but no {_INDEX_NAME} "
                "saying which tensors live where"
            )
        unused = [n for n in top_level if n not in shards]
    else:
        _refuse_pickles(files)
        raise InputError("no .safetensors weights in the checkpoint (and no pickle files either)")
    if unused:
        warnings.append(f"safetensors files not part of the model, ignored: {', '.join(unused)}")
    pickles = sorted(n for n in files if n.lower().endswith(_PICKLE_SUFFIXES))
    if pickles:
        warnings.append(f"pickle files ignored (never unpickled): {', '.join(pickles[:5])}")
    return shards, index_map


def _refuse_pickles(files: Mapping[str, InputFile]) -> None:
    pickles = sorted(n for n in files if n.lower().endswith(_PICKLE_SUFFIXES))
    if pickles:
        raise InputError(
            f"pickle-only checkpoint ({', '.join(pickles[:5])}): pickle files can run arbitrary code when "
            "loaded and are never unpickled here; provide safetensors weights (convert them in an "
            "isolated sandbox, or use the repo's safetensors revision)"
        )


def _load_index(files: Mapping[str, InputFile]) -> dict[str, str]:
    index = _load_json(files[_INDEX_NAME].path, _INDEX_NAME)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise IntegrityError(f"{_INDEX_NAME}: no 'weight_map' object mapping tensor names to shard files")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            raise IntegrityError(f"{_INDEX_NAME}: tensor {tensor!r} maps to {shard!r}, not a file name")
        try:
            safe_relpath(shard)
        except InputError as exc:
            raise InputError(f"{_INDEX_NAME}: tensor {tensor!r}: {exc}") from exc
        if not shard.endswith(".safetensors"):
            raise InputError(f"{_INDEX_NAME}: tensor {tensor!r} maps to {shard!r}, not a .safetensors file")
        if shard not in files:
            raise IntegrityError(
                f"{_INDEX_NAME}: tensor {tensor!r} lives in shard {shard!r}, which is not in the snapshot "
                "(incomplete download?)"
            )
    return dict(weight_map)


def _read_tensors(
    files: Mapping[str, InputFile], shards: list[str], index_map: Mapping[str, str] | None
) -> list[tuple[str, TensorInfo]]:
    """(shard, tensor) for every tensor, shard by shard, names sorted within a shard."""
    found: dict[str, str] = {}
    result: list[tuple[str, TensorInfo]] = []
    for shard in shards:
        header = read_header(files[shard].path, name=shard)
        for tensor in sorted(header.tensors, key=lambda t: t.name):
            if tensor.name in found:
                raise IntegrityError(
                    f"tensor {tensor.name!r} appears in both {found[tensor.name]} and {shard}"
                )
            if index_map is not None and index_map.get(tensor.name) != shard:
                claim = f"maps it to {index_map[tensor.name]!r}" if tensor.name in index_map else "omits it"
                raise IntegrityError(f"{shard}: holds tensor {tensor.name!r} but {_INDEX_NAME} {claim}")
            found[tensor.name] = shard
            result.append((shard, tensor))
    if index_map is not None:
        missing = sorted(set(index_map) - set(found))
        if missing:
            raise IntegrityError(
                f"{_INDEX_NAME}: {len(missing)} tensor(s) not found in their shards, e.g. {missing[0]!r} "
                f"(expected in {index_map[missing[0]]})"
            )
    if not result:
        raise InputError(f"the checkpoint's safetensors files ({', '.join(shards)}) hold no tensors")
    return result


def _refuse_quantized_tensors(tensors: list[tuple[str, TensorInfo]]) -> None:
    for shard, tensor in tensors:
        last = tensor.name.rsplit(".", 1)[-1]
        if last in _QUANTIZED_TENSOR_PARTS or ".quant_state" in tensor.name:
            raise InputError(
                f"{shard}: tensor {tensor.name!r} is a quantizer's packed weight or scale "
                "(GPTQ/AWQ/FP8/bitsandbytes): the checkpoint is already quantized; convert from the "
                "original F32/F16/BF16 weights instead"
            )
        if len(tensor.shape) >= 2 and tensor.dtype.startswith(_QUANTIZED_DTYPE_PREFIXES):
            raise InputError(
                f"{shard}: weight matrix {tensor.name!r} is stored as {tensor.dtype}: the checkpoint is "
                "already quantized; convert from the original F32/F16/BF16 weights instead"
            )


def _tokenizer(files: Mapping[str, InputFile], warnings: list[str]) -> dict[str, Any]:
    present = sorted(n for n in files if n in _TOKENIZER_FILES)
    kind: str | None = None
    if "tokenizer.model" in files:
        kind = "sentencepiece"
    elif "tokenizer.json" in files:
        document = _load_json(files["tokenizer.json"].path, "tokenizer.json")
        model = document.get("model") if isinstance(document, dict) else None
        model_type = model.get("type") if isinstance(model, dict) else None
        if model_type == "BPE":
            kind = "bpe"
        else:
            warnings.append(f"tokenizer.json model type {model_type!r} is not BPE; tokenizer kind unknown")
    elif "vocab.json" in files and "merges.txt" in files:
        kind = "bpe"
    if kind is None and not present:
        warnings.append("no tokenizer files in the checkpoint; packaging will need one")
    return {"kind": kind, "files": present}


def _gguf_card(files: Mapping[str, InputFile], gguf_files: list[str], warnings: list[str]) -> dict[str, Any]:
    import gguf

    if len(gguf_files) > 1:
        raise InputError(f"{len(gguf_files)} .gguf files ({', '.join(gguf_files[:5])}); give exactly one")
    name = gguf_files[0]
    card = _gguf_card_from_file(files[name].path, name)
    # A GGUF source is repackaged with its own metadata, so any architecture llama.cpp knows
    # (gguf-py's table mirrors llama.cpp's) is accepted; HF checkpoints need a row per architecture.
    known = sorted(gguf.MODEL_ARCH_NAMES.values())
    if card["architecture"] not in known:
        raise InputError(
            f"{name}: GGUF architecture {card['architecture']!r} is not one llama.cpp knows "
            f"({len(known)} known, e.g. {', '.join(known[:8])}); update the gguf package if it is new"
        )
    return card


def _write_card(workdir: Path, card: Mapping[str, Any]) -> OutputFile:
    path = workdir / CARD_NAME
    tmp = path.with_name(path.name + ".partial")
    text = json.dumps(card, indent=2) + "\n"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    # Compare text, not parsed values: a NaN in config.json never equals itself.
    if path.read_text(encoding="utf-8") != text:
        raise IntegrityError(f"{path}: re-read model card differs from what was written")
    return OutputFile(name=CARD_NAME, path=path, kind="model-card", media_type="application/json")


# --- GGUF sources: bounded walk first, then gguf_pack.reader.GGUFFile -----------------------
# GGUFReader trusts the counts in the file: a crafted array length makes it loop forever on
# empty reads. `_walk_gguf` checks every count and length against the bytes that remain.

_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_UINT32, _GGUF_STRING, _GGUF_ARRAY = 4, 8, 9
_GGUF_DEFAULT_ALIGNMENT = 32
_GGUF_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type, smallest value
_GGUF_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims=0, type, offset
_GGML_MAX_DIMS = 4
_GGUF_CONFIG_MAX_ITEMS = 64  # arrays longer than this (vocabularies) stay out of the card's config
_GGUF_TOKENIZER_KINDS = {"gpt2": "bpe", "llama": "sentencepiece"}


class _Cursor:
    """Reads little-endian values from a buffer and refuses to step past its end."""

    def __init__(self, data: bytes | mmap.mmap, label: str) -> None:
        self.data = data
        self.label = label
        self.pos = 0

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def skip(self, n_bytes: int, what: str) -> int:
        if n_bytes > self.remaining():
            raise IntegrityError(
                f"{self.label}: {what} at byte {self.pos} needs {n_bytes} bytes but only "
                f"{self.remaining()} remain (truncated or corrupt GGUF)"
            )
        start = self.pos
        self.pos += n_bytes
        return start

    def uint(self, n_bytes: int, what: str) -> int:
        start = self.skip(n_bytes, what)
        return int.from_bytes(self.data[start : start + n_bytes], "little")

    def string(self, what: str) -> bytes:
        length = self.uint(8, f"{what} length")
        start = self.skip(length, what)
        return bytes(self.data[start : start + length])


def _walk_gguf(data: bytes | mmap.mmap, label: str) -> None:
    """Check the GGUF header's structure with every count bounded by the file size."""
    import gguf

    cur = _Cursor(data, label)
    if bytes(data[:4]) != _GGUF_MAGIC:
        raise InputError(f"{label}: not a GGUF file (magic {bytes(data[:4])!r}, expected b'GGUF')")
    cur.skip(4, "magic")
    version = cur.uint(4, "version")
    if version & 0xFFFF == 0:
        raise InputError(f"{label}: big-endian GGUF files are not supported")
    if version not in _GGUF_VERSIONS:
        raise InputError(f"{label}: GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors, n_kv = cur.uint(8, "tensor count"), cur.uint(8, "metadata count")
    if n_kv * _GGUF_MIN_KV_BYTES + n_tensors * _GGUF_MIN_TENSOR_INFO_BYTES > cur.remaining():
        raise IntegrityError(
            f"{label}: header claims {n_kv} metadata entries and {n_tensors} tensors, more than "
            f"{len(data)} bytes can hold (corrupt or hostile GGUF)"
        )
    alignment = _GGUF_DEFAULT_ALIGNMENT
    for index in range(n_kv):
        key = cur.string(f"metadata key #{index}")
        value_type = cur.uint(4, f"type of {key!r}")
        if key == b"general.alignment" and value_type == _GGUF_UINT32:
            alignment = cur.uint(4, "general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise IntegrityError(f"{label}: general.alignment {alignment} is not a power of two")
        else:
            _skip_gguf_value(cur, value_type, f"metadata {key!r}", is_array_item=False)
    spans: list[tuple[str, int, int]] = []
    for index in range(n_tensors):
        name = cur.string(f"tensor name #{index}").decode("utf-8", "replace")
        n_dims = cur.uint(4, f"dimension count of {name!r}")
        if n_dims > _GGML_MAX_DIMS:
            raise IntegrityError(f"{label}: tensor {name!r} claims {n_dims} dimensions (at most 4)")
        dims = [cur.uint(8, f"dimension of {name!r}") for _ in range(n_dims)]
        raw_type = cur.uint(4, f"type of {name!r}")
        offset = cur.uint(8, f"data offset of {name!r}")
        try:
            block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError) as exc:
            raise IntegrityError(f"{label}: tensor {name!r} has unknown ggml type {raw_type}") from exc
        n_elements = 1
        for dim in dims:
            n_elements *= dim
        if n_elements % block_size:
            raise IntegrityError(f"{label}: tensor {name!r} shape {dims} is not whole blocks of {block_size}")
        spans.append((name, offset, n_elements // block_size * type_size))
    data_start = -(-cur.pos // alignment) * alignment
    for name, offset, n_bytes in spans:
        if data_start + offset + n_bytes > len(data):
            raise IntegrityError(
                f"{label}: tensor {name!r} ends at byte {data_start + offset + n_bytes} but the file has "
                f"{len(data)} bytes (truncated?)"
            )


def _skip_gguf_value(cur: _Cursor, value_type: int, what: str, *, is_array_item: bool) -> None:
    if value_type in _GGUF_SCALAR_BYTES:
        cur.skip(_GGUF_SCALAR_BYTES[value_type], what)
    elif value_type == _GGUF_STRING:
        cur.string(what)
    elif value_type == _GGUF_ARRAY and not is_array_item:
        item_type = cur.uint(4, f"{what} item type")
        count = cur.uint(8, f"{what} length")
        if item_type in _GGUF_SCALAR_BYTES:
            cur.skip(count * _GGUF_SCALAR_BYTES[item_type], what)
        elif item_type == _GGUF_STRING:
            if count * 8 > cur.remaining():
                raise IntegrityError(f"{cur.label}: {what} claims {count} strings, more than the file holds")
            for _ in range(count):
                cur.string(f"{what} item")
        else:
            raise IntegrityError(f"{cur.label}: {what} is an array of unsupported type {item_type}")
    else:
        raise IntegrityError(f"{cur.label}: {what} has unknown or nested value type {value_type}")


def _gguf_card_from_file(path: Path, name: str) -> dict[str, Any]:
    """A model card for a single GGUF file: architecture, metadata, tensor list, tokenizer kind."""
    file_size = path.stat().st_size
    if file_size < 24:
        raise InputError(f"{name}: {file_size} bytes is too short for a GGUF file")
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        # Slicing an mmap copies bytes out (no buffer exports), so it closes cleanly on errors.
        _walk_gguf(data, name)
    from pipeline.formats.gguf.reader import GGUFFile
    from pipeline.formats.gguf.tensor_source import dequantizable_types

    source_types = dequantizable_types()
    try:
        reader = GGUFFile(path)  # gguf.GGUFReader takes ~16 s on a 262k-token vocabulary
        metadata = {
            key: field.contents()
            for key, field in reader.fields.items()
            if not key.startswith("GGUF.") and len(field.data) <= _GGUF_CONFIG_MAX_ITEMS
        }
    except Exception as exc:  # the reader raises bare ValueError/KeyError/IndexError on bad input
        raise IntegrityError(
            f"{name}: gguf could not read the file ({exc.__class__.__name__}: {exc})"
        ) from exc
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise InputError(f"{name}: GGUF metadata has no general.architecture string")
    tensors = []
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if tensor.data_offset + tensor.n_bytes > file_size:
            raise IntegrityError(
                f"{name}: tensor {tensor.name!r} ends at byte {tensor.data_offset + tensor.n_bytes} "
                f"but the file has {file_size} bytes (truncated?)"
            )
        # Any type gguf can dequantize is a source (re-quantizing a Q4_K file is the user's call);
        # integer or F64 storage is not a weight we can decompose.
        if type_name not in source_types:
            raise InputError(
                f"{name}: tensor {tensor.name!r} is {type_name}, which gguf cannot dequantize; a GGUF "
                f"source must hold {', '.join(sorted(source_types))} tensors"
            )
        # ggml lists dimensions fastest-first; reversed gives the row-major shape HF cards use.
        shape = [int(d) for d in reversed(tensor.shape.tolist())]
        tensors.append({"name": tensor.name, "shape": shape, "dtype": type_name, "shard": name})
    return {
        "architecture": architecture,
        "hf_architecture": None,
        "config": metadata,
        "format": "gguf",
        "shards": [name],
        "tensors": tensors,
        "param_count": sum(int(t.n_elements) for t in reader.tensors),
        # The source type histogram: a Q4_K_M file holds Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors.
        "dtypes": dict(sorted(Counter(t["dtype"] for t in tensors).items())),
        "file_type": _gguf_file_type(metadata.get("general.file_type")),
        "tokenizer": {
            "kind": _GGUF_TOKENIZER_KINDS.get(str(metadata.get("tokenizer.ggml.model"))),
            "files": [name] if "tokenizer.ggml.model" in metadata else [],
        },
    }


def _gguf_file_type(value: Any) -> str | None:
    """general.file_type as llama.cpp's name (MOSTLY_Q4_K_M), or None when absent or unknown."""
    import gguf

    try:
        return gguf.LlamaFileType(int(value)).name if value is not None else None
    except (ValueError, TypeError):
        return None
