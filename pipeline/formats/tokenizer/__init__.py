"""Tokenizers to GGUF vocabularies: byte-level BPE (tokenizer.json) and SentencePiece (tokenizer.model)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError
from pipeline.formats.tokenizer.gguf_vocab import GGUFVocab

__all__ = ["GGUFVocab", "load_tokenizer"]


def load_tokenizer(files: Mapping[str, Path], config: Mapping[str, Any] | None = None) -> GGUFVocab:
    """The GGUF vocabulary of a checkpoint from its tokenizer files (file name -> local path).

    Like llama.cpp's converter, a SentencePiece ``tokenizer.model`` wins over ``tokenizer.json``
    (Llama 2 / Mistral checkpoints ship both; the .json is derived from the .model).
    ``tokenizer_config.json`` is read when present. InputError when neither file is there.
    """
    tok_config = files.get("tokenizer_config.json")
    if "tokenizer.model" in files:
        from pipeline.formats.tokenizer.spm import load_spm_vocab

        return load_spm_vocab(files["tokenizer.model"], tok_config, config)
    if "tokenizer.json" in files:
        from pipeline.formats.tokenizer.bpe import load_vocab

        return load_vocab(files["tokenizer.json"], tok_config, config)
    raise InputError(
        f"no tokenizer.model or tokenizer.json among the checkpoint files ({', '.join(sorted(files))}); "
        "a GGUF for llama.cpp needs the vocabulary"
    )
