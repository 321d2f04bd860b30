"""Inspect for an HF checkpoint: config.json, shard index and safetensors headers -> a model card.

Nothing here reads tensor data. Refused, with the reason: a missing or malformed config.json
or an architecture not in `SUPPORTED_ARCHITECTURES`; pickle-only checkpoints (never unpickled);
already-quantized "impostors" (``quantization_config``, GPTQ/AWQ files, packed-weight tensor
names, integer or FP8 weight matrices); a shard index whose weight map leaves the folder or
names missing shards or tensors; a config.json whose hyperparameters disagree
with the tensor shapes (`shape_check`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from pipeline.core.errors import InputError, IntegrityError
from pipeline.core.files import safe_relpath
from pipeline.formats.hf.architectures import HF_ARCHITECTURES
from pipeline.formats.jsonfile import load_json
from pipeline.formats.model_card import CardTensor, ModelCard, TokenizerInfo
from pipeline.formats.safetensors import TensorInfo, read_header
from pipeline.stages.base import InputFile
from pipeline.stages.inspect.shape_check import check_shapes

__all__ = ["SUPPORTED_ARCHITECTURES", "safetensors_card"]

_INDEX_NAME = "model.safetensors.index.json"
# HF class name -> our architecture name (the HF model_type). One table for the whole pipeline:
# an architecture is added as a row of formats.hf.architectures.ARCH_SPECS, which packaging reads too.
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


def safetensors_card(files: Mapping[str, InputFile], warnings: list[str]) -> ModelCard:
    """The card of an HF checkpoint: config.json, safetensors headers, tokenizer kind; refusals first."""
    config = _load_config(files)
    hf_architecture, architecture = _architecture(config)
    _refuse_quantized_config(config)
    _refuse_quantizer_files(files)
    shards, index_map = _select_shards(files, warnings)
    tensors = _read_tensors(files, shards, index_map)
    _refuse_quantized_tensors(tensors)
    check_shapes(HF_ARCHITECTURES[hf_architecture], config, ((t.name, tuple(t.shape)) for _, t in tensors))
    return ModelCard(
        architecture=architecture,
        hf_architecture=hf_architecture,
        config=config,
        format="safetensors",
        shards=tuple(shards),
        tensors=tuple(CardTensor(t.name, tuple(t.shape), t.dtype, shard) for shard, t in tensors),
        param_count=sum(t.numel for _, t in tensors),
        dtypes=dict(sorted(Counter(t.dtype for _, t in tensors).items())),
        tokenizer=_tokenizer(files, warnings),
    )


def _load_config(files: Mapping[str, InputFile]) -> dict[str, Any]:
    if "config.json" not in files:
        weights = sorted(n for n in files if n.endswith((".safetensors", *_PICKLE_SUFFIXES)))
        raise InputError(
            "config.json is missing: a Hugging Face checkpoint needs it to name its architecture "
            f"(files present: {', '.join(sorted(files)[:12]) or 'none'}"
            f"{'; weights: ' + ', '.join(weights[:5]) if weights else ''})"
        )
    config = load_json(files["config.json"].path, "config.json")
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
    index = load_json(files[_INDEX_NAME].path, _INDEX_NAME)
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


def _tokenizer(files: Mapping[str, InputFile], warnings: list[str]) -> TokenizerInfo:
    present = sorted(n for n in files if n in _TOKENIZER_FILES)
    kind: str | None = None
    if "tokenizer.model" in files:
        kind = "sentencepiece"
    elif "tokenizer.json" in files:
        document = load_json(files["tokenizer.json"].path, "tokenizer.json")
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
    return TokenizerInfo(kind, tuple(present))
