"""Package stage: decompose's ternary parts + config + tokenizer -> one llama.cpp GGUF file.

Inputs: ``download/config.json``, ``download/tokenizer.model`` (SentencePiece) or
``download/tokenizer.json`` (byte-level BPE), optional ``download/tokenizer_config.json``,
``inspect/model_card.json`` and every ``decompose/ternary/part-XXXXX.safetensors``. Each
part holds U8 tensors of raw GGML block bytes keyed by GGUF tensor name; its
``__metadata__["bonsai.tensors"]`` is JSON ``{gguf_name: {"ggml_type": "TQ2_0", "shape": [rows, cols]}}``.

Before writing, every tensor of the model card's plan must be in exactly one part, with
the planned shape and a byte count that fits its type. The file is streamed one tensor
at a time, then reopened: structure, types and shapes are checked, and every tensor's
bytes compared with its part.

A GGUF source (model card format "gguf") takes its metadata from the source file instead of
config.json and tokenizer.json: `package_gguf.package_gguf_source`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.errors import InputError, IntegrityError
from pipeline.stages.base import InputFile, JobSpec, OutputFile, StageResult, inputs_of

__all__ = ["NAME", "VERSION", "Params", "make_params", "run", "PartTensor"]

NAME = "package"
VERSION = "1"
OUTPUT_NAME = "model.gguf"

log = logging.getLogger(__name__)

_PART_NAME = re.compile(r"^ternary/part-\d{5}\.safetensors$")
# Types a part may carry: what llama.cpp's CPU backend runs and the policy may choose.
_ALLOWED_TYPES = ("TQ2_0", "TQ1_0", "Q2_0", "Q1_0", "F16", "BF16", "F32", "Q8_0")
_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json")
_GGML_QUANT_VERSION = 2  # gguf-py's GGML_QUANT_VERSION; llama.cpp checks it for block types


@dataclass(frozen=True)
class Params:
    """`model_name` becomes general.name; `source` and `recipe` are recorded as provenance keys."""

    model_name: str
    source: str
    recipe: str


@dataclass(frozen=True)
class PartTensor:
    """One tensor found in a decompose part; ``offset``: where its bytes start in the part file."""

    gguf_name: str
    ggml_type: str
    shape: tuple[int, ...]
    part: Path
    offset: int | None = None


def make_params(job: JobSpec) -> Params:
    """Name the model after its source (``org/name@rev`` -> ``name``) unless options give ``name``."""
    name = job.options.get("name")
    if not isinstance(name, str) or not name:
        tail = job.source.rstrip("/").split("@", 1)[0].rsplit("/", 1)[-1]
        name = tail.removesuffix(".gguf") or "model"
    return Params(model_name=name, source=job.source, recipe=job.recipe)


def _require(files: Mapping[str, InputFile], name: str, stage: str) -> Path:
    if name not in files:
        raise InputError(f"package needs input {stage}/{name}; got {sorted(files)}")
    return files[name].path


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{what} ({path.name}) is not readable JSON: {exc}") from exc


def _part_index(part_name: str, path: Path) -> list[PartTensor]:
    """The tensors one part declares, checked against what it actually stores."""
    from pipeline.gguf_pack.keys import PART_METADATA_TENSORS
    from pipeline.gguf_pack.rawio import read_safetensors_header
    from pipeline.gguf_pack.write import tensor_nbytes
    from pipeline.ternary.ggml_types import ggml_type

    entries, metadata = read_safetensors_header(path)  # header only: the data is never mapped
    declared_raw = metadata.get(PART_METADATA_TENSORS)
    if declared_raw is None:
        raise IntegrityError(f"part {part_name} has no {PART_METADATA_TENSORS!r} metadata")
    declared = json.loads(declared_raw)
    stored = set(entries)
    if stored != set(declared):
        raise IntegrityError(
            f"part {part_name}: stored tensors {sorted(stored - set(declared))[:5]} undeclared, "
            f"declared {sorted(set(declared) - stored)[:5]} absent"
        )
    out = []
    for name, info in declared.items():
        qtype, shape = str(info.get("ggml_type")), tuple(int(d) for d in info.get("shape", []))
        if qtype not in _ALLOWED_TYPES:
            raise IntegrityError(
                f"part {part_name}: tensor {name!r} has type {qtype!r}; allowed {_ALLOWED_TYPES}"
            )
        entry = entries[name]
        n_bytes = tensor_nbytes(ggml_type(qtype), shape)
        if entry.dtype != "U8" or list(entry.shape) != [n_bytes]:
            raise IntegrityError(
                f"part {part_name}: tensor {name!r} is {entry.dtype} {list(entry.shape)}; "
                f"{qtype} {list(shape)} needs U8 [{n_bytes}]"
            )
        out.append(PartTensor(name, qtype, shape, path, entry.offset))
    return out


def _collect_parts(parts: Mapping[str, InputFile]) -> dict[str, PartTensor]:
    found: dict[str, PartTensor] = {}
    for part_name in sorted(parts):
        for item in _part_index(part_name, parts[part_name].path):
            if item.gguf_name in found:
                raise IntegrityError(
                    f"tensor {item.gguf_name!r} is in two parts ({found[item.gguf_name].part.name}, "
                    f"{part_name})"
                )
            found[item.gguf_name] = item
    return found


def _match_plan(card: Mapping[str, Any], found: Mapping[str, PartTensor]) -> list[PartTensor]:
    """Parts' tensors in plan order; every planned tensor present with its planned shape."""
    from pipeline.gguf_pack import gguf_source, source

    plan = (gguf_source if gguf_source.is_gguf_card(card) else source).tensor_plan(card)
    planned = {p.gguf_name for p in plan}
    missing = [p.gguf_name for p in plan if p.gguf_name not in found]
    extra = sorted(set(found) - planned)
    if missing or extra:
        raise IntegrityError(
            f"decompose parts do not match the model card: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {extra[:5]} ({len(extra)}); rerun decompose for this model card"
        )
    for p in plan:
        if found[p.gguf_name].shape != p.shape:
            raise IntegrityError(
                f"tensor {p.gguf_name!r} is {list(found[p.gguf_name].shape)} in its part; "
                f"the model card says {list(p.shape)}"
            )
    return [found[p.gguf_name] for p in plan]


def _loader(item: PartTensor) -> Any:
    def load() -> Any:
        from safetensors import safe_open

        with safe_open(str(item.part), framework="numpy") as handle:
            return handle.get_tensor(item.gguf_name)

    return load


def _file_range(item: PartTensor) -> tuple[Path, int] | None:
    """Where a part tensor's bytes sit, for a file-to-file copy (no pass through this process)."""
    return None if item.offset is None else (item.part, item.offset)


def _metadata(
    params: Params,
    config: Mapping[str, Any],
    vocab_meta: Mapping[str, Any],
    types: set[str],
    card_sha256: str,
    arch: str = "llama",
) -> dict[str, Any]:
    from pipeline.gguf_pack.keys import General
    from pipeline.gguf_pack.write import file_type_for, llama_metadata
    from pipeline.ternary.ggml_types import ggml_type

    file_type = file_type_for(ggml_type(t) for t in types)
    meta: dict[str, Any] = {General.NAME: params.model_name}
    meta.update(llama_metadata(config, file_type, arch))
    meta[General.QUANTIZATION_VERSION] = _GGML_QUANT_VERSION
    meta.update(vocab_meta)
    meta.update(provenance_keys(params, card_sha256))
    return meta


def provenance_keys(params: Params, card_sha256: str) -> dict[str, Any]:
    """The bonsai.* keys every packaged file carries: where it came from and what made it."""
    from pipeline.gguf_pack.keys import Bonsai

    return {
        Bonsai.SOURCE: params.source,
        Bonsai.RECIPE: params.recipe,
        Bonsai.VERSION: __version__,
        Bonsai.SOURCE_CARD_SHA256: card_sha256,
    }


def _generated_tensors(config: Mapping[str, Any]) -> list[Any]:
    """Tensors computed from config.json rather than weights (Llama 3.1+ rope factors)."""
    import gguf

    from pipeline.gguf_pack.names import ROPE_FREQS
    from pipeline.gguf_pack.write import TensorToWrite, llama3_rope_factors

    factors = llama3_rope_factors(config)
    if factors is None:
        return []
    return [TensorToWrite(ROPE_FREQS, gguf.GGMLQuantizationType.F32, tuple(factors.shape), lambda: factors)]


_VERIFY_CHUNK_BYTES = 4 << 20


def _verify_bytes(path: Path, ordered: list[PartTensor]) -> None:
    """Compare every tensor's bytes in the written file with its part, both read in 4 MB chunks
    into two reused buffers: memory stays flat whatever the model size (a memory map would keep
    every page it touched)."""
    import numpy as np

    from pipeline.gguf_pack.rawio import pread_exact, read_safetensors_header
    from pipeline.gguf_pack.reader import GGUFFile

    reader = GGUFFile(path)  # not gguf.GGUFReader: ~16 s to open a 262k-token vocabulary
    by_name = {t.name: t for t in reader.tensors}
    starts: dict[Path, dict[str, int]] = {}
    ours, theirs = np.empty(_VERIFY_CHUNK_BYTES, np.uint8), np.empty(_VERIFY_CHUNK_BYTES, np.uint8)
    with open(path, "rb") as written_file:
        for item in ordered:
            if item.part not in starts:
                starts[item.part] = {n: e.offset for n, e in read_safetensors_header(item.part)[0].items()}
            written, start = by_name[item.gguf_name], starts[item.part][item.gguf_name]
            with open(item.part, "rb") as part_file:
                for done in range(0, written.n_bytes, _VERIFY_CHUNK_BYTES):
                    n = min(_VERIFY_CHUNK_BYTES, written.n_bytes - done)
                    pread_exact(written_file.fileno(), ours.data[:n], written.data_offset + done)
                    pread_exact(part_file.fileno(), theirs.data[:n], start + done)
                    if not np.array_equal(ours[:n], theirs[:n]):
                        raise IntegrityError(
                            f"{path.name}: bytes of tensor {item.gguf_name!r} differ from its decompose part"
                        )


def run(params: Params, inputs: Mapping[str, InputFile], workdir: Path) -> StageResult:
    """Write and verify ``model.gguf``; raises InputError / IntegrityError naming the culprit."""

    from pipeline.gguf_pack.inspect import inspect_gguf
    from pipeline.gguf_pack.keys import General
    from pipeline.gguf_pack.source import arch_spec
    from pipeline.gguf_pack.vocab import load_tokenizer
    from pipeline.gguf_pack.write import TensorToWrite, write_gguf
    from pipeline.ternary.ggml_types import file_type_name, ggml_type

    download, inspect = inputs_of(inputs, "download"), inputs_of(inputs, "inspect")
    card_file = inspect.get("model_card.json")
    card = _read_json(_require(inspect, "model_card.json", "inspect"), "model card")
    parts = {n: f for n, f in inputs_of(inputs, "decompose").items() if _PART_NAME.match(n)}
    if not parts:
        raise InputError("package needs decompose/ternary/part-XXXXX.safetensors inputs; got none")
    ordered = _match_plan(card, _collect_parts(parts))
    if card.get("format") == "gguf":
        from pipeline.stages.package_gguf import package_gguf_source

        return package_gguf_source(params, download, card, card_file, ordered, Path(workdir))
    config = _read_json(_require(download, "config.json", "download"), "config.json")
    # tokenizer.model (SentencePiece) wins over tokenizer.json, as in llama.cpp's converter.
    vocab = load_tokenizer({n: download[n].path for n in _TOKENIZER_FILES if n in download}, config)
    types = {t.ggml_type for t in ordered}
    arch = arch_spec(card).gguf_name
    meta = _metadata(params, config, vocab.metadata(), types, card_file.sha256 if card_file else "", arch)
    to_write = [
        TensorToWrite(
            t.gguf_name, ggml_type(t.ggml_type), t.shape, _loader(t), _file_range(t)
        )
        for t in ordered
    ]
    to_write += _generated_tensors(config)
    dest = Path(workdir) / OUTPUT_NAME
    written = write_gguf(dest, arch, meta, to_write)
    expected = {t.name: (t.ggml_type, t.shape) for t in to_write}
    summary = inspect_gguf(dest, expected)
    _verify_bytes(dest, ordered)
    log.info(
        "package: wrote %s (%d bytes, %d tensors, %.3f bpw)",
        dest.name,
        written.size_bytes,
        summary.tensor_count,
        summary.bits_per_weight,
    )
    metrics = {
        "size_bytes": summary.size_bytes,
        "tensor_count": summary.tensor_count,
        "types": dict(summary.types),
        "n_params": summary.n_params,
        "bits_per_weight": round(summary.bits_per_weight, 4),
        "file_type": file_type_name(meta[General.FILE_TYPE]),
        "tokenizer_model": vocab.model,
        "tokenizer_pre": vocab.pre,
    }
    return StageResult(
        outputs=(OutputFile(OUTPUT_NAME, dest, "gguf", "application/octet-stream"),), metrics=metrics
    )
