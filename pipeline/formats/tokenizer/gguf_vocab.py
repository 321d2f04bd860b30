"""The GGUF vocabulary fields llama.cpp reads, whichever tokenizer file they came from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.formats.gguf.keys import Tokenizer as TK

__all__ = ["GGUFVocab", "chat_template"]


@dataclass(frozen=True)
class GGUFVocab:
    """Vocabulary fields of a GGUF file; ids index `tokens`, `token_types` (and `scores`).

    ``model`` is llama.cpp's tokenizer family: "gpt2" (byte-level BPE, with `merges`) or
    "llama" (SentencePiece BPE, with `scores`; see `spm.load_spm_vocab`).
    """

    pre: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None = None
    model: str = "gpt2"  # llama.cpp's name for byte-level BPE, whatever the model family
    scores: tuple[float, ...] = ()
    unk_id: int | None = None
    add_space_prefix: bool | None = None  # None: llama.cpp's default for the tokenizer family
    remove_extra_whitespaces: bool | None = None

    def metadata(self) -> dict[str, Any]:
        """Key -> value for the writer (ints are uint32, token types int32, as llama.cpp reads them)."""
        meta: dict[str, Any] = {
            TK.MODEL: self.model,
            TK.PRE: self.pre,
            TK.TOKENS: list(self.tokens),
            TK.TOKEN_TYPE: list(self.token_types),
            TK.ADD_BOS: self.add_bos,
            TK.ADD_EOS: self.add_eos,
        }
        if self.merges:
            meta[TK.MERGES] = list(self.merges)
        if self.scores:
            meta[TK.SCORES] = [float(x) for x in self.scores]
        ids = (
            (TK.BOS_ID, self.bos_id),
            (TK.EOS_ID, self.eos_id),
            (TK.PAD_ID, self.pad_id),
            (TK.UNK_ID, self.unk_id),
        )
        for key, value in ids:
            if value is not None:
                meta[key] = value
        for key, flag in (
            (TK.ADD_SPACE_PREFIX, self.add_space_prefix),
            (TK.REMOVE_EXTRA_WS, self.remove_extra_whitespaces),
        ):
            if flag is not None:
                meta[key] = flag
        if self.chat_template:
            meta[TK.CHAT_TEMPLATE] = self.chat_template
        return meta


def chat_template(tok_config: Mapping[str, Any]) -> str | None:
    """tokenizer_config.json's chat template: a string, or the entry named "default" of a list."""
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
