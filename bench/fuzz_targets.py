"""Fuzz targets: one per parser of files that strangers hand us. Each takes raw bytes.

A target writes the bytes where the parser expects a file and calls the parser the way a
stage does. The project's own errors (`PipelineError`: InputError, IntegrityError...) are the
right answer to a bad file; anything else escaping a target is a finding (see bench/fuzz.py).

Targets read fixed companion files from a context folder (`make_context` in bench/fuzz.py
writes it): ``llama/`` (a demo checkpoint: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) and ``spm/`` (a SentencePiece demo: tokenizer.model, its
tokenizer_config.json and config.json). No torch here: the worker stays small and fast.

Targets:
- ``safetensors``: a .safetensors file through `formats.safetensors.read_header`.
- ``config``: config.json through inspect's `safetensors_card` (over the fixed demo weights and
  tokenizer), the GGUF writer's hyperparameter reading (`llama_metadata`, rope factors) and
  `ModelCard.from_dict` of the same document.
- ``tokenizer``: byte 0 picks which file is fuzzed (tokenizer.json, tokenizer_config.json or the
  config.json values the vocabulary reads); `formats.tokenizer.load_tokenizer` on the set.
- ``spm``: byte 0 picks tokenizer.model or tokenizer_config.json; `load_tokenizer` on the set.
- ``gguf``: a .gguf through `GGUFFile` (every field's contents and typed value) and inspect's
  `gguf_card`.
- ``sha256sums``: a SHA256SUMS file as the checksum stage reads and parses it.
- ``manifest``: a submit manifest (byte 0 picks YAML or JSON) through `read_manifest` and
  `check_request`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["TARGETS", "Context"]


class Context:
    """Where a target writes its input (a scratch folder) and finds the fixed companion files."""

    def __init__(self, fixed: Path, scratch: Path) -> None:
        self.fixed, self.scratch = fixed, scratch
        scratch.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, data: bytes) -> Path:
        path = self.scratch / name
        path.write_bytes(data)
        return path


def _input_file(name: str, path: Path) -> Any:
    from pipeline.stages.base import InputFile

    return InputFile(name, path, "", path.stat().st_size)


def fuzz_safetensors(data: bytes, ctx: Context) -> None:
    from pipeline.formats.safetensors import read_header

    header = read_header(ctx.write("model.safetensors", data))
    for tensor in header.tensors:
        _ = tensor.numel, tensor.size_bytes


def fuzz_config(data: bytes, ctx: Context) -> None:
    import gguf

    from pipeline.formats.gguf.writer import llama3_rope_factors, llama_metadata
    from pipeline.formats.jsonfile import load_json
    from pipeline.formats.model_card import ModelCard
    from pipeline.stages.inspect.safetensors_card import safetensors_card

    config_path = ctx.write("config.json", data)
    files = {name: _input_file(name, ctx.fixed / "llama" / name)
             for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json")}
    files["config.json"] = _input_file("config.json", config_path)
    card = _expected(safetensors_card, files, [])
    document = load_json(config_path, "config.json")
    if isinstance(document, dict):
        arch = card.architecture if card is not None else "llama"
        _expected(llama_metadata, document, gguf.LlamaFileType.MOSTLY_TQ2_0, arch)
        _expected(llama3_rope_factors, document)
    ModelCard.from_dict(document)


def _expected(function: Callable[..., Any], *args: Any) -> Any:
    """function(*args), or None when it refuses with one of the project's own errors."""
    from pipeline.core.errors import PipelineError

    try:
        return function(*args)
    except PipelineError:
        return None


_TOKENIZER_ROLES = ("tokenizer.json", "tokenizer_config.json", "config.json")


def fuzz_tokenizer(data: bytes, ctx: Context) -> None:
    from pipeline.formats.jsonfile import load_json
    from pipeline.formats.tokenizer import load_tokenizer

    role = _TOKENIZER_ROLES[data[0] % len(_TOKENIZER_ROLES)] if data else _TOKENIZER_ROLES[0]
    files = {name: ctx.fixed / "llama" / name for name in ("tokenizer.json", "tokenizer_config.json")}
    config_path = ctx.fixed / "llama" / "config.json"
    fuzzed = ctx.write(role, data[1:])
    if role == "config.json":
        config_path = fuzzed
    else:
        files[role] = fuzzed
    config = load_json(config_path, "config.json")
    load_tokenizer(files, config if isinstance(config, dict) else None)


_SPM_ROLES = ("tokenizer.model", "tokenizer_config.json")


def fuzz_spm(data: bytes, ctx: Context) -> None:
    from pipeline.formats.tokenizer import load_tokenizer

    role = _SPM_ROLES[data[0] % len(_SPM_ROLES)] if data else _SPM_ROLES[0]
    files = {name: ctx.fixed / "spm" / name for name in _SPM_ROLES}
    files[role] = ctx.write(role, data[1:])
    config = json.loads((ctx.fixed / "spm" / "config.json").read_text(encoding="utf-8"))
    load_tokenizer(files, config)


def fuzz_gguf(data: bytes, ctx: Context) -> None:
    from pipeline.formats.gguf.reader import GGUFFile
    from pipeline.stages.inspect.gguf_card import gguf_card

    path = ctx.write("model.gguf", data)
    reader = GGUFFile(path)
    for field in reader.fields.values():
        field.contents()
        field.typed()
    for tensor in reader.tensors:
        _ = tensor.data.shape
    gguf_card({"model.gguf": _input_file("model.gguf", path)}, ["model.gguf"])


def fuzz_sha256sums(data: bytes, ctx: Context) -> None:
    from pipeline.formats.sums import parse_sha256sums
    from pipeline.stages.checksum import _read_reference

    path = ctx.write("SHA256SUMS", data)
    parse_sha256sums(_read_reference(_input_file("SHA256SUMS", path)))


def fuzz_manifest(data: bytes, ctx: Context) -> None:
    from pipeline.orchestration.job_control import check_request, read_manifest

    suffix = ".json" if data[:1] and data[0] & 1 else ".yaml"
    path = ctx.write(f"jobs{suffix}", data[1:])
    for request in read_manifest(path, "tq2_0", 0):
        check_request(request)


TARGETS: dict[str, Callable[[bytes, Context], None]] = {
    "safetensors": fuzz_safetensors,
    "config": fuzz_config,
    "tokenizer": fuzz_tokenizer,
    "spm": fuzz_spm,
    "gguf": fuzz_gguf,
    "sha256sums": fuzz_sha256sums,
    "manifest": fuzz_manifest,
}
