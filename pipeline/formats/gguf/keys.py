"""GGUF metadata keys used by Bonsai, in one table (code never spells a key inline).

Standard keys come from gguf-py's `gguf.Keys` so they cannot drift from llama.cpp;
keys containing ``{arch}`` are formatted with `arch_key`. Bonsai's own provenance keys
live under the ``bonsai.`` prefix.
"""

from __future__ import annotations

import gguf

__all__ = [
    "General", "LLM", "Attention", "Rope", "Tokenizer", "QuantizeImatrix", "Bonsai", "arch_key",
    "PART_METADATA_TENSORS",
]


class General:
    ARCHITECTURE = gguf.Keys.General.ARCHITECTURE
    NAME = gguf.Keys.General.NAME
    FILE_TYPE = gguf.Keys.General.FILE_TYPE
    QUANTIZATION_VERSION = gguf.Keys.General.QUANTIZATION_VERSION
    ALIGNMENT = gguf.Keys.General.ALIGNMENT


class LLM:
    VOCAB_SIZE = gguf.Keys.LLM.VOCAB_SIZE
    CONTEXT_LENGTH = gguf.Keys.LLM.CONTEXT_LENGTH
    EMBEDDING_LENGTH = gguf.Keys.LLM.EMBEDDING_LENGTH
    BLOCK_COUNT = gguf.Keys.LLM.BLOCK_COUNT
    FEED_FORWARD_LENGTH = gguf.Keys.LLM.FEED_FORWARD_LENGTH


class Attention:
    HEAD_COUNT = gguf.Keys.Attention.HEAD_COUNT
    HEAD_COUNT_KV = gguf.Keys.Attention.HEAD_COUNT_KV
    LAYERNORM_RMS_EPS = gguf.Keys.Attention.LAYERNORM_RMS_EPS
    KEY_LENGTH = gguf.Keys.Attention.KEY_LENGTH
    VALUE_LENGTH = gguf.Keys.Attention.VALUE_LENGTH


class Rope:
    DIMENSION_COUNT = gguf.Keys.Rope.DIMENSION_COUNT
    FREQ_BASE = gguf.Keys.Rope.FREQ_BASE
    SCALING_TYPE = gguf.Keys.Rope.SCALING_TYPE
    SCALING_FACTOR = gguf.Keys.Rope.SCALING_FACTOR


class Tokenizer:
    MODEL = gguf.Keys.Tokenizer.MODEL
    PRE = gguf.Keys.Tokenizer.PRE
    TOKENS = gguf.Keys.Tokenizer.LIST
    TOKEN_TYPE = gguf.Keys.Tokenizer.TOKEN_TYPE
    SCORES = gguf.Keys.Tokenizer.SCORES
    MERGES = gguf.Keys.Tokenizer.MERGES
    BOS_ID = gguf.Keys.Tokenizer.BOS_ID
    EOS_ID = gguf.Keys.Tokenizer.EOS_ID
    PAD_ID = gguf.Keys.Tokenizer.PAD_ID
    UNK_ID = gguf.Keys.Tokenizer.UNK_ID
    ADD_BOS = gguf.Keys.Tokenizer.ADD_BOS
    ADD_EOS = gguf.Keys.Tokenizer.ADD_EOS
    CHAT_TEMPLATE = gguf.Keys.Tokenizer.CHAT_TEMPLATE
    ADD_SPACE_PREFIX = gguf.Keys.Tokenizer.ADD_PREFIX
    REMOVE_EXTRA_WS = gguf.Keys.Tokenizer.REMOVE_EXTRA_WS


class QuantizeImatrix:
    """What ``llama-quantize --imatrix`` records of the importance matrix it weighted the quants by
    (tools/quantize: the file as given, its first dataset, its entry and chunk counts as UINT32).
    gguf-py does not declare them."""

    FILE = "quantize.imatrix.file"
    DATASET = "quantize.imatrix.dataset"
    ENTRIES_COUNT = "quantize.imatrix.entries_count"
    CHUNKS_COUNT = "quantize.imatrix.chunks_count"
    PREFIX = "quantize.imatrix."


class Bonsai:
    """Provenance keys Bonsai adds; readers other than ours ignore them."""

    SOURCE = "bonsai.source"
    RECIPE = "bonsai.recipe"
    VERSION = "bonsai.version"
    SOURCE_CARD_SHA256 = "bonsai.source.model_card_sha256"


# `__metadata__` key of a decompose part file: JSON {gguf_name: {"ggml_type", "shape"}}.
PART_METADATA_TENSORS = "bonsai.tensors"


def arch_key(key: str, arch: str) -> str:
    """Format an ``{arch}.…`` key template, e.g. ``arch_key(LLM.BLOCK_COUNT, "llama")``."""
    return key.format(arch=arch)
