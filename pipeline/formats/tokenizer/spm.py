"""SentencePiece ``tokenizer.model`` -> the GGUF vocabulary llama.cpp reads as ``tokenizer.ggml.model=llama``.

llama.cpp's SPM tokenizer escapes spaces to "▁", optionally prepends one, then merges
adjacent pieces by score, falling back to ``<0xNN>`` byte tokens: that is SentencePiece's
BPE algorithm with an identity normaliser and nothing else. So the model proto is read
(with a small bounded protobuf reader: no protobuf runtime needed, and a hostile file
cannot make it allocate past its own size) and anything llama.cpp would tokenize
differently is refused with InputError: unigram models, other normalisers, extra-whitespace
removal, whitespace-as-suffix.

Example::

    vocab = load_spm_vocab(Path("tokenizer.model"), Path("tokenizer_config.json"), config)
    metadata.update(vocab.metadata())
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from pipeline.core.errors import InputError
from pipeline.formats.jsonfile import load_json
from pipeline.formats.tokenizer.gguf_vocab import GGUFVocab, chat_template
from pipeline.formats.tokenizer.shapes import mapping, token_id, vocab_rows

__all__ = ["SpmModel", "read_spm_model", "load_spm_vocab"]

_MAX_MODEL_BYTES = 64 * 1024 * 1024  # Gemma 3's 262k-piece model is 4.5 MB
# Field numbers of sentencepiece_model.proto (ModelProto, TrainerSpec, NormalizerSpec).
_MODEL_PIECES, _MODEL_TRAINER, _MODEL_NORMALIZER = 1, 2, 3
_PIECE_TEXT, _PIECE_SCORE, _PIECE_TYPE = 1, 2, 3
_TRAINER_FIELDS = {
    3: "model_type",
    24: "treat_whitespace_as_suffix",
    35: "byte_fallback",
    40: "unk_id",
    41: "bos_id",
    42: "eos_id",
    43: "pad_id",
}
_NORMALIZER_FIELDS = {3: "add_dummy_prefix", 4: "remove_extra_whitespaces", 5: "escape_whitespaces"}
_NORMALIZER_NAME = 1
_MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
# SentencePiece piece types -> GGUF token types (same meanings, stated rather than assumed).
_TOKEN_TYPES = {
    1: gguf.TokenType.NORMAL,
    2: gguf.TokenType.UNKNOWN,
    3: gguf.TokenType.CONTROL,
    4: gguf.TokenType.USER_DEFINED,
    5: gguf.TokenType.UNUSED,
    6: gguf.TokenType.BYTE,
}
_ADDED_TOKEN_SCORE = -1000.0  # what llama.cpp's converter gives added and padding tokens
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True)
class SpmModel:
    """What a tokenizer.model says: pieces with scores and types, trainer and normaliser settings.

    Settings absent from the file take sentencepiece_model.proto's defaults.
    """

    pieces: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]  # SentencePiece piece types (1 normal … 6 byte)
    trainer: Mapping[str, int] = field(default_factory=dict)
    normalizer: Mapping[str, Any] = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return _MODEL_TYPES.get(self.trainer.get("model_type", 1), "unknown")

    def special_id(self, name: str) -> int | None:
        """unk/bos/eos/pad id from the trainer spec (defaults 0/1/2/-1); None when unset (< 0)."""
        default = {"unk": 0, "bos": 1, "eos": 2, "pad": -1}[name]
        value = self.trainer.get(f"{name}_id", default)
        return value if 0 <= value < len(self.pieces) else None


class _Reader:
    """Protobuf wire-format fields of one message, every length bounded by the bytes left."""

    def __init__(self, data: bytes, label: str) -> None:
        self.data, self.pos, self.label = data, 0, label

    def _varint(self) -> int:
        result = 0
        for shift in range(0, 70, 7):
            if self.pos >= len(self.data):
                raise InputError(f"{self.label}: truncated varint at byte {self.pos}")
            byte = self.data[self.pos]
            self.pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
        raise InputError(f"{self.label}: varint longer than 10 bytes at byte {self.pos}")

    def _take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise InputError(f"{self.label}: field of {n} bytes at byte {self.pos} runs past the end")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def fields(self) -> Iterator[tuple[int, int | bytes]]:
        """(field number, int for varint/fixed fields or bytes for length-delimited ones)."""
        while self.pos < len(self.data):
            key = self._varint()
            number, wire = key >> 3, key & 7
            if wire == _VARINT:
                yield number, self._varint()
            elif wire == _LEN:
                yield number, self._take(self._varint())
            elif wire == _FIXED32:
                yield number, int.from_bytes(self._take(4), "little")
            elif wire == _FIXED64:
                yield number, int.from_bytes(self._take(8), "little")
            else:
                raise InputError(f"{self.label}: unsupported protobuf wire type {wire} at byte {self.pos}")


def _int32(value: int | bytes) -> int:
    """A varint as protobuf int32: negative numbers arrive as 64-bit two's complement."""
    if not isinstance(value, int):
        raise InputError(f"expected an integer field, got {len(value)} bytes")
    return value - (1 << 64) if value >= 1 << 63 else value


def _piece(raw: bytes, label: str) -> tuple[str, float, int]:
    text, score, kind = "", 0.0, 1
    for number, value in _Reader(raw, label).fields():
        if number == _PIECE_TEXT and isinstance(value, bytes):
            try:
                text = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{label}: a piece is not UTF-8 ({exc})") from exc
        elif number == _PIECE_SCORE and isinstance(value, int):
            if value >= 1 << 32:  # a float field is fixed32; a wider varint is not a score
                raise InputError(f"{label}: piece {text!r:.80} has a score field that is not a float")
            score = struct.unpack("<f", value.to_bytes(4, "little"))[0]
        elif number == _PIECE_TYPE:
            kind = _int32(value)
    if kind not in _TOKEN_TYPES:
        raise InputError(f"{label}: piece {text!r} has unknown type {kind}")
    return text, score, kind


def read_spm_model(path: Path) -> SpmModel:
    """Parse a SentencePiece model file; InputError when it is not one (or too large)."""
    path = Path(path)
    label = path.name
    size_bytes = path.stat().st_size
    if size_bytes > _MAX_MODEL_BYTES:
        raise InputError(f"{label}: {size_bytes} bytes is more than a SentencePiece model should be")
    pieces: list[tuple[str, float, int]] = []
    trainer: dict[str, int] = {}
    normalizer: dict[str, Any] = {}
    for number, value in _Reader(path.read_bytes(), label).fields():
        if not isinstance(value, bytes):
            continue
        if number == _MODEL_PIECES:
            pieces.append(_piece(value, label))
        elif number == _MODEL_TRAINER:
            for sub, item in _Reader(value, label).fields():
                if sub in _TRAINER_FIELDS:
                    trainer[_TRAINER_FIELDS[sub]] = _int32(item)
        elif number == _MODEL_NORMALIZER:
            for sub, item in _Reader(value, label).fields():
                if sub == _NORMALIZER_NAME and isinstance(item, bytes):
                    normalizer["name"] = item.decode("utf-8", errors="replace")
                elif sub in _NORMALIZER_FIELDS:
                    normalizer[_NORMALIZER_FIELDS[sub]] = bool(_int32(item))
    if not pieces:
        raise InputError(f"{label}: no pieces; not a SentencePiece model (a tiktoken file has this name too)")
    return SpmModel(
        pieces=tuple(p[0] for p in pieces),
        scores=tuple(p[1] for p in pieces),
        types=tuple(p[2] for p in pieces),
        trainer=trainer,
        normalizer=normalizer,
    )


def _check_llama_compatible(model: SpmModel, label: str) -> None:
    """Refuse settings under which llama.cpp's SPM tokenizer would give other ids."""
    problems = []
    if model.model_type != "bpe":
        problems.append(
            f"model type {model.model_type!r} (llama.cpp's 'llama' tokenizer merges pieces by score, "
            "which matches SentencePiece BPE only)"
        )
    name = model.normalizer.get("name", "nmt_nfkc")
    if name != "identity":
        problems.append(f"normaliser {name!r} (llama.cpp applies none; only 'identity' matches)")
    if model.normalizer.get("remove_extra_whitespaces", True):
        problems.append("remove_extra_whitespaces is on (llama.cpp's SPM tokenizer keeps every space)")
    if not model.normalizer.get("escape_whitespaces", True):
        problems.append("escape_whitespaces is off (llama.cpp always writes spaces as '▁')")
    if model.trainer.get("treat_whitespace_as_suffix", 0):
        problems.append("treat_whitespace_as_suffix is on")
    if problems:
        raise InputError(
            f"{label}: SentencePiece settings llama.cpp does not reproduce: {'; '.join(problems)}; "
            "the converted model would tokenize differently, so it is not packaged"
        )


def _read_config(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    data = load_json(Path(path), Path(path).name)
    return data if isinstance(data, dict) else {}


def _apply_added_tokens(
    tokens: list[str], scores: list[float], types: list[int], tok_config: Mapping[str, Any]
) -> None:
    """tokenizer_config.json's added_tokens_decoder: special ones become control tokens."""
    decoder = tok_config.get("added_tokens_decoder") or {}
    for key, entry in decoder.items() if isinstance(decoder, Mapping) else ():
        entry = mapping(entry, f"tokenizer_config.json added_tokens_decoder[{key!r:.40}]")
        content = str(entry.get("content", ""))
        try:
            index = token_id(key, "id")
        except InputError:
            index = -1
        if not 0 <= index < len(tokens):
            raise InputError(
                f"tokenizer_config.json added token {content!r:.80} has id {key!r:.40}, outside the "
                f"vocabulary of {len(tokens)} (config.json vocab_size)"
            )
        if (
            types[index] in (gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN)
            and tokens[index] == content
        ):
            continue  # the model's own <s>, </s>, <unk>: keep their scores and types
        is_control = bool(entry.get("special")) or (content.startswith("<|") and content.endswith("|>"))
        tokens[index] = content if is_control else content.replace("▁", " ")
        types[index] = int(gguf.TokenType.CONTROL if is_control else gguf.TokenType.USER_DEFINED)
        scores[index] = _ADDED_TOKEN_SCORE


def _special(name: str, model: SpmModel, tok_config: Mapping[str, Any], ids: Mapping[str, int]) -> int | None:
    value = tok_config.get(f"{name}_token")
    text = value.get("content") if isinstance(value, Mapping) else value
    if isinstance(text, str):
        if text not in ids:
            raise InputError(f"tokenizer_config.json {name}_token {text!r} is not in tokenizer.model")
        return ids[text]
    return model.special_id(name)


def load_spm_vocab(
    tokenizer_model: Path, tokenizer_config: Path | None = None, config: Mapping[str, Any] | None = None
) -> GGUFVocab:
    """GGUF vocab fields (tokens, scores, types, specials, chat template) from a SentencePiece model.

    Rows past the model's pieces up to config.json's vocab_size become unused ``[PADn]``
    tokens. add_bos / add_eos come from tokenizer_config.json, else LlamaTokenizer's
    defaults (True / False). Raises InputError for a file that is not a SentencePiece
    model, settings llama.cpp does not reproduce, or special tokens outside the vocabulary.
    """
    model = read_spm_model(tokenizer_model)
    label = Path(tokenizer_model).name
    _check_llama_compatible(model, label)
    config = config or {}
    tok_config = _read_config(tokenizer_config)
    size = vocab_rows(config.get("vocab_size"), len(model.pieces), label)
    n_pad = size - len(model.pieces)
    tokens = list(model.pieces) + [f"[PAD{i}]" for i in range(len(model.pieces), size)]
    scores = list(model.scores) + [_ADDED_TOKEN_SCORE] * n_pad
    types = [int(_TOKEN_TYPES[t]) for t in model.types] + [int(gguf.TokenType.UNUSED)] * n_pad
    _apply_added_tokens(tokens, scores, types, tok_config)
    ids = {tok: i for i, tok in enumerate(tokens)}
    add_bos, add_eos = tok_config.get("add_bos_token", True), tok_config.get("add_eos_token", False)
    return GGUFVocab(
        pre="default",
        tokens=tuple(tokens),
        token_types=tuple(types),
        merges=(),
        bos_id=_special("bos", model, tok_config, ids),
        eos_id=_special("eos", model, tok_config, ids),
        pad_id=_special("pad", model, tok_config, ids),
        add_bos=add_bos if isinstance(add_bos, bool) else True,
        add_eos=add_eos if isinstance(add_eos, bool) else False,
        chat_template=chat_template(tok_config),
        model="llama",
        scores=tuple(scores),
        unk_id=_special("unk", model, tok_config, ids),
        add_space_prefix=bool(model.normalizer.get("add_dummy_prefix", True)),
        remove_extra_whitespaces=False,
    )
