"""Stage 3, inspect: validate the checkpoint's structure before any heavy work; write its card.

Inputs: every ``download/<name>`` file and ``checksum/manifest.json``. Nothing here reads
tensor data: only config.json, the safetensors headers (or a GGUF file's header) and the
tokenizer's type. The stage refuses, with the reason:

- a missing or malformed config.json, or an architecture not in `SUPPORTED_ARCHITECTURES`;
- pickle-only checkpoints (``.bin``/``.pt``/``.pth``/``.ckpt``): never unpickled here;
- already-quantized "impostors": ``quantization_config``, GPTQ/AWQ files, packed-weight tensor
  names (``qweight``, ``qzeros``, ``scales``, ``g_idx``...), integer or FP8 weight matrices;
- a shard index whose weight map leaves the folder, names missing shards or missing tensors;
- a config.json whose hidden size, head counts, head size, feed-forward size, vocabulary or
  layer count disagrees with the tensor shapes (`shape_check`: the tensor, expected and found).

Output ``model_card.json`` (kind ``model-card``), a shape later stages rely on::

    {"architecture": "llama", "hf_architecture": "LlamaForCausalLM", "config": {...},
     "format": "safetensors", "shards": ["model.safetensors"],
     "tensors": [{"name": ..., "shape": [...], "dtype": "BF16", "shard": ...}],
     "param_count": 123, "dtypes": {"BF16": 20},
     "tokenizer": {"kind": "bpe" | "sentencepiece" | None, "files": [...]}}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.manifest import Manifest
from pipeline.formats.model_card import CARD_NAME
from pipeline.stages.base import (
    NO_CLIENTS,
    InputFile,
    JobSpec,
    OutputFile,
    StageClients,
    StageResult,
    inputs_of,
)
from pipeline.stages.inspect.gguf_card import gguf_card
from pipeline.stages.inspect.safetensors_card import SUPPORTED_ARCHITECTURES, safetensors_card

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
_MANIFEST_KEY = "checksum/manifest.json"
_HUB_FILES_NAME = "hub_files.json"


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
    clients: StageClients = NO_CLIENTS,
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
        card = gguf_card(files, gguf_files)
    else:
        card = safetensors_card(files, warnings)
    card.write(workdir / CARD_NAME)
    output = OutputFile(CARD_NAME, workdir / CARD_NAME, kind="model-card", media_type="application/json")
    metrics = {
        "architecture": card.architecture,
        "format": card.format,
        "param_count": card.param_count,
        "n_tensors": len(card.tensors),
        "n_shards": len(card.shards),
        "dtypes": dict(card.dtypes),
    }
    return StageResult(outputs=(output,), metrics=metrics, warnings=tuple(warnings))


def _check_against_manifest(files: Mapping[str, InputFile], manifest_input: InputFile | None) -> None:
    """The files must be the ones the checksum stage verified (stored digests, no re-hash)."""
    if manifest_input is None:
        raise InputError(f"inspect needs {_MANIFEST_KEY} from the checksum stage; run checksum first")
    if not files:
        raise InputError("inspect: no download/<name> inputs; the download stage produced nothing")
    recorded = Manifest.load(manifest_input.path, _MANIFEST_KEY).digests()
    for name, item in sorted(files.items()):
        if name not in recorded:
            raise IntegrityError(f"{name}: not in the checksum manifest; it was never verified")
        if item.sha256 and recorded[name] != item.sha256.lower():
            raise IntegrityError(
                f"{name}: differs from the checksum manifest: expected {recorded[name]}, "
                f"actual {item.sha256.lower()}"
            )
