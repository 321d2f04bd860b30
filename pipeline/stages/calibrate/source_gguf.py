"""The source model as a GGUF llama.cpp can run: what calibrate runs to get the source's answers.

For a GGUF source the source file itself is run. For a Hugging Face checkpoint,
`write_source_gguf` writes one: the source's weights, in the layout llama.cpp expects (the
same `source.iter_tensors` decompose reads), at 16 bits (BF16 sources stay BF16, exactly;
others become F16; 1-D tensors F32), under the metadata the packager writes for the converted
file (architecture keys from config.json, the same vocabulary and tokenizer, the tensors it
computes from config such as Llama 3.1 rope factors), so the source and any conversion of it
differ in their weights and nothing else. It lives in calibrate's work folder only while the
source runs: once per source, never per job.

Example::

    files = {"config.json": cfg, "tokenizer.json": tok, "model.safetensors": shard}
    path = write_source_gguf(card, files, workdir / "src.gguf")
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.gguf.keys import General
from pipeline.formats.gguf.writer import TensorToWrite, llama3_rope_factors, llama_metadata, write_gguf
from pipeline.formats.jsonfile import load_json
from pipeline.formats.model_card import ModelCard

__all__ = ["write_source_gguf", "REFERENCE_KEY"]

REFERENCE_KEY = "bonsai.reference"  # true in a source GGUF written here: never mistaken for an artifact
_QT = gguf.GGMLQuantizationType
_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json")


def _reference_type(shape: tuple[int, ...], source_dtype: str) -> gguf.GGMLQuantizationType:
    if len(shape) <= 1:
        return _QT.F32
    return _QT.BF16 if source_dtype == "BF16" else _QT.F16


def _encode(tensor: Any, qtype: gguf.GGMLQuantizationType) -> np.ndarray[Any, Any]:
    """The tensor's bytes in ``qtype``; a tensor already stored in that 16-bit type is taken as it is
    (no pass through float32: a BF16 checkpoint's weights are copied, not converted)."""
    import torch

    if qtype is _QT.BF16 and tensor.dtype == torch.bfloat16:
        return np.asarray(tensor.contiguous().view(torch.int16).numpy())
    if qtype is _QT.F16 and tensor.dtype == torch.float16:
        return np.asarray(tensor.contiguous().numpy())
    values = tensor.to(torch.float32).numpy()
    if qtype is _QT.F32:
        return np.ascontiguousarray(values, dtype=np.float32)
    if qtype is _QT.F16:
        return np.ascontiguousarray(values, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)


class _Streams:
    """Hands out each shard's tensors in plan order, to loaders called in that same order; the
    ``copied`` ones (written file to file) are not read."""

    def __init__(self, card: ModelCard, files: Mapping[str, Path], copied: frozenset[str]) -> None:
        self._card, self._files, self._copied = card, files, copied
        self._open: dict[str, Iterator[tuple[str, Any]]] = {}

    def loader(self, shard: str, name: str, qtype: gguf.GGMLQuantizationType) -> Callable[[], Any]:
        def load() -> Any:
            from pipeline.formats.hf.checkpoint import iter_tensors

            stream = self._open.setdefault(
                shard, iter_tensors(self._card, self._files, shard, as_stored=True, skip=self._copied))
            got, tensor = next(stream)
            if got != name:
                raise IntegrityError(f"source GGUF: expected {name} next from {shard}, the source gave {got}")
            return _encode(tensor, qtype)

        return load


def _metadata(card: ModelCard, files: Mapping[str, Path], arch: str) -> tuple[dict[str, Any], Any]:
    from pipeline.formats.tokenizer import load_tokenizer

    if "config.json" not in files:
        raise InputError(f"calibrate needs download/config.json of an HF source; got {sorted(files)}")
    config = load_json(files["config.json"], "config.json")
    vocab = load_tokenizer({n: Path(files[n]) for n in _TOKENIZER_FILES if n in files}, config)
    meta: dict[str, Any] = {General.NAME: "source"}
    meta.update(llama_metadata(config, gguf.LlamaFileType.MOSTLY_F16, arch))
    meta.update(vocab.metadata())
    meta[REFERENCE_KEY] = True
    return meta, config


def _copy_ranges(card: ModelCard, files: Mapping[str, Path], plan: list[Any]) -> dict[str, tuple[Path, int]]:
    """Where each tensor that goes into the GGUF exactly as stored (its dtype, its row order) lies
    in its shard: those bytes are copied file to file, never through this process."""
    from pipeline.formats.hf.checkpoint import is_stored_as_is
    from pipeline.formats.safetensors import read_header

    ranges: dict[str, tuple[Path, int]] = {}
    for shard in card.shards:
        if shard not in files:
            continue  # the stream names the missing shard
        entries = {t.name: t for t in read_header(Path(files[shard])).tensors}
        for item in (p for p in plan if p.shard == shard):
            entry = entries.get(item.hf_name)
            if entry is None or entry.shape != item.shape:
                continue  # the stream names the mismatch
            same_type = entry.dtype == _reference_type(item.shape, item.source_dtype).name
            if same_type and is_stored_as_is(card, item.gguf_name, item.hf_name):
                ranges[item.gguf_name] = (Path(files[shard]), entry.begin)
    return ranges


def write_source_gguf(card: ModelCard, files: Mapping[str, Path], dest: Path) -> Path:
    """Write the 16-bit GGUF of an HF source at `dest`; returns `dest`.

    ``files`` maps the download's names (config.json, tokenizer files, shards) to paths. Raises
    InputError / IntegrityError from the tensor plan, the tokenizer and the shards (the same
    refusals as decompose and package).
    """
    from pipeline.formats.hf.architectures import ROPE_FREQS
    from pipeline.formats.hf.checkpoint import arch_spec, tensor_plan

    plan = tensor_plan(card)
    arch = arch_spec(card).gguf_name
    meta, config = _metadata(card, files, arch)
    copied = _copy_ranges(card, files, plan)
    streams = _Streams(card, files, frozenset(copied))
    tensors: list[TensorToWrite] = []
    for shard in card.shards:
        for item in (p for p in plan if p.shard == shard):
            qtype = _reference_type(item.shape, item.source_dtype)
            load = streams.loader(shard, item.gguf_name, qtype)
            tensors.append(TensorToWrite(item.gguf_name, qtype, item.shape, load, copied.get(item.gguf_name)))
    factors = llama3_rope_factors(config)
    if factors is not None:
        tensors.append(TensorToWrite(ROPE_FREQS, _QT.F32, tuple(factors.shape), lambda: factors))
    write_gguf(dest, arch, meta, tensors, durable=False)  # a scratch file, deleted after the run
    return dest
