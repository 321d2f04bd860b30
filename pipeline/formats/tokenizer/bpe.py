"""HF `tokenizer.json` (byte-level BPE) -> the GGUF vocabulary fields llama.cpp reads.

llama.cpp does not run the tokenizer.json pipeline; it re-implements a fixed set of
pre-tokenizers and picks one by the name in ``tokenizer.ggml.pre``. So the name must
describe *exactly* what the checkpoint's pre-tokenizer does. We recognise a
pre-tokenizer by its structure (regex, byte-level flags, normaliser, ignore_merges)
against `_PRE_TOKENIZERS` and refuse anything else with InputError, rather than
write a vocabulary that would tokenize differently from the original.

Example::

    vocab = load_vocab(Path("tokenizer.json"), Path("tokenizer_config.json"), config)
    metadata.update(vocab.metadata())
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from pipeline.core.errors import InputError
from pipeline.formats.jsonfile import load_json
from pipeline.formats.tokenizer.gguf_vocab import GGUFVocab, chat_template
from pipeline.formats.tokenizer.shapes import items, mapping, token_id, vocab_rows

__all__ = ["load_vocab", "detect_pre_tokenizer"]

# GPT-2's split regex: what HF's ByteLevel(use_regex=True) applies.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """One llama.cpp pre-tokenizer and the tokenizer.json shape that behaves like it."""

    gguf_name: str
    split_regex: str | None  # None: ByteLevel(use_regex=True) does the GPT-2 split itself
    normalizers: tuple[str | None, ...]
    ignore_merges: bool  # llama.cpp hard-wires this per pre-tokenizer


# Names are those llama.cpp's llama-vocab.cpp accepts for `tokenizer.ggml.pre`.
_PRE_TOKENIZERS: tuple[_PreTokenizer, ...] = (
    _PreTokenizer("gpt-2", None, (None,), False),
    _PreTokenizer("llama-bpe", _LLAMA3_REGEX, (None,), True),
    # Qwen2 checkpoints ship an NFC normaliser; llama.cpp skips it, which only matters
    # for input that is not already NFC.
    _PreTokenizer("qwen2", _QWEN2_REGEX, (None, "NFC"), False),
)

# Tokens that act as control tokens even when tokenizer.json forgets `special: true`
# (the same heuristic llama.cpp's converter uses for `<|...|>` tokens).
_CONTROL_LOOKALIKE = ("<|", "|>")


def _flatten(pre: Any, depth: int = 0) -> list[Mapping[str, Any]]:
    pre = mapping(pre, "tokenizer.json pre_tokenizer")
    if not pre:
        return []
    if pre.get("type") == "Sequence":
        if depth >= 8:  # real files nest one Sequence; a crafted one must not exhaust the stack
            raise InputError("tokenizer.json pre_tokenizer nests Sequences more than 8 deep")
        subs = items(pre.get("pretokenizers"), "tokenizer.json pre_tokenizer.pretokenizers")
        return [item for sub in subs for item in _flatten(sub, depth + 1)]
    return [pre]


def _normalizer_name(normalizer: Any) -> str | None:
    normalizer = mapping(normalizer, "tokenizer.json normalizer")
    if not normalizer:
        return None
    if normalizer.get("type") == "Sequence" and not normalizer.get("normalizers"):
        return None
    return str(normalizer.get("type"))


def _shape_of(steps: list[Mapping[str, Any]]) -> tuple[str | None, bool] | None:
    """(split regex or None, ok) for Split+ByteLevel or lone ByteLevel; None when neither."""
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True):
        return (None, not steps[0].get("add_prefix_space", False))
    if (
        len(steps) == 2
        and steps[0].get("type") == "Split"
        and steps[1].get("type") == "ByteLevel"
        and not steps[1].get("use_regex", True)
    ):
        split = steps[0]
        regex = mapping(split.get("pattern"), "tokenizer.json Split pattern").get("Regex")
        is_plain = split.get("behavior") == "Isolated" and not split.get("invert", False)
        return (regex, is_plain and not steps[1].get("add_prefix_space", False))
    return None


def detect_pre_tokenizer(tokenizer: Mapping[str, Any]) -> str:
    """llama.cpp's pre-tokenizer name for a parsed tokenizer.json; InputError when none fits."""
    steps = _flatten(tokenizer.get("pre_tokenizer"))
    normalizer = _normalizer_name(tokenizer.get("normalizer"))
    ignore_merges = bool(mapping(tokenizer.get("model"), "tokenizer.json model").get("ignore_merges", False))
    shape = _shape_of(steps)
    if shape is not None and shape[1]:
        regex = shape[0]
        for candidate in _PRE_TOKENIZERS:
            regex_fits = regex == candidate.split_regex or (
                candidate.split_regex is None and regex == _GPT2_REGEX
            )
            if (
                regex_fits
                and normalizer in candidate.normalizers
                and ignore_merges == candidate.ignore_merges
            ):
                return candidate.gguf_name
    described = [s.get("type") for s in steps] or None
    raise InputError(
        f"tokenizer.json pre-tokenizer {described} (normalizer {normalizer!r}, ignore_merges "
        f"{ignore_merges}) matches none of the llama.cpp pre-tokenizers Bonsai maps "
        f"({', '.join(p.gguf_name for p in _PRE_TOKENIZERS)}); llama.cpp would tokenize this model "
        "differently, so it is not packaged. Add a row to vocab._PRE_TOKENIZERS once the regex is checked."
    )


def _check_model(model: Mapping[str, Any]) -> None:
    if model.get("type") != "BPE":
        raise InputError(
            f"tokenizer.json model type is {model.get('type')!r}; only byte-level BPE is packaged"
        )
    if model.get("byte_fallback"):
        raise InputError(
            "tokenizer.json is a BPE with byte_fallback (SentencePiece style, GGUF tokenizer model 'llama') "
            "and the checkpoint has no tokenizer.model: its merge ranks do not give the piece scores "
            "llama.cpp merges by; include the original SentencePiece tokenizer.model to package it"
        )


def _merges(model: Mapping[str, Any]) -> tuple[str, ...]:
    out = []
    for merge in items(model.get("merges"), "tokenizer.json model.merges"):
        # tokenizers >= 0.20 writes pairs as lists; older files use "a b" strings.
        if isinstance(merge, list) and len(merge) == 2 and all(isinstance(m, str) for m in merge):
            out.append(" ".join(merge))
        elif isinstance(merge, str):
            out.append(merge)
        else:
            raise InputError(f"tokenizer.json merge {merge!r:.80} is neither 'a b' nor a pair of strings")
    return tuple(out)


def _token_table(tokenizer: Mapping[str, Any], vocab_size: int | None) -> tuple[list[str], list[int]]:
    model = mapping(tokenizer.get("model"), "tokenizer.json model")
    vocab = mapping(model.get("vocab"), "tokenizer.json model.vocab")
    by_id: dict[int, tuple[str, int]] = {
        token_id(i, f"tokenizer.json vocab id of {tok!r:.80}"): (tok, gguf.TokenType.NORMAL)
        for tok, i in vocab.items()
    }
    for added in items(tokenizer.get("added_tokens"), "tokenizer.json added_tokens"):
        added = mapping(added, "tokenizer.json added_tokens entry")
        content = added.get("content")
        if not isinstance(content, str):
            raise InputError(f"tokenizer.json added token {added!r:.80} has no string content")
        is_control = bool(added.get("special")) or (
            content.startswith(_CONTROL_LOOKALIKE[0]) and content.endswith(_CONTROL_LOOKALIKE[1])
        )
        by_id[token_id(added.get("id"), f"tokenizer.json added token {content!r:.80} id")] = (
            content,
            gguf.TokenType.CONTROL if is_control else gguf.TokenType.USER_DEFINED,
        )
    if not by_id:
        raise InputError("tokenizer.json has an empty vocabulary")
    n_tokens = max(by_id) + 1
    if vocab_size is not None and vocab_size < n_tokens:
        raise InputError(
            f"tokenizer.json has token id {n_tokens - 1} but config.json vocab_size is {vocab_size}"
        )
    size = vocab_rows(vocab_size, n_tokens, "tokenizer.json")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(size):
        # Embedding rows past the tokenizer's ids exist in padded checkpoints; llama.cpp
        # needs one entry per row, marked unused so it never emits them.
        token, kind = by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))
        tokens.append(token)
        types.append(int(kind))
    return tokens, types


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_id(
    name: str, tok_config: Mapping[str, Any], config: Mapping[str, Any], ids: Mapping[str, int], n_tokens: int
) -> int | None:
    text = _token_text(tok_config.get(f"{name}_token"))
    if text is not None:
        if text not in ids:
            raise InputError(
                f"tokenizer_config.json {name}_token {text!r} is not in tokenizer.json's vocabulary"
            )
        return ids[text]
    value = config.get(f"{name}_token_id")
    if isinstance(value, list):  # Llama 3.1 lists several EOS ids; llama.cpp takes one
        value = value[0] if value else None
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None  # absent, or negative: HF configs write -1 for "no such token"
    return token_id(value, f"config.json {name}_token_id", limit=n_tokens)


def _template_adds(tokenizer: Mapping[str, Any], token: str | None, first: bool) -> bool:
    post = mapping(tokenizer.get("post_processor"), "tokenizer.json post_processor")
    is_sequence = post.get("type") == "Sequence"
    steps = items(post.get("processors"), "post_processor.processors") if is_sequence else [post]
    for step in steps:
        step = mapping(step, "tokenizer.json post_processor step")
        single = step.get("single")
        if step.get("type") == "TemplateProcessing" and single and token is not None:
            piece = mapping(items(single, "TemplateProcessing.single")[0 if first else -1], "template piece")
            return bool(mapping(piece.get("SpecialToken"), "template SpecialToken").get("id") == token)
    return False


def load_vocab(
    tokenizer_json: Path, tokenizer_config: Path | None = None, config: Mapping[str, Any] | None = None
) -> GGUFVocab:
    """Read tokenizer.json (+ tokenizer_config.json, config.json values) into GGUF vocab fields.

    add_bos/add_eos come from tokenizer_config.json when it says, else from the
    tokenizer's post-processor template. Raises InputError for a non byte-level-BPE
    model, an unrecognised pre-tokenizer, or special tokens that are not in the vocabulary.
    """
    tokenizer = mapping(load_json(Path(tokenizer_json), "tokenizer.json"), "tokenizer.json")
    tok_config = (
        mapping(load_json(Path(tokenizer_config), "tokenizer_config.json"), "tokenizer_config.json")
        if tokenizer_config
        else {}
    )
    config = config or {}
    model = mapping(tokenizer.get("model"), "tokenizer.json model")
    _check_model(model)
    pre = detect_pre_tokenizer(tokenizer)
    vocab_size = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
    tokens, types = _token_table(tokenizer, vocab_size)
    ids = {tok: i for i, tok in enumerate(tokens)}
    bos_id = _special_id("bos", tok_config, config, ids, len(tokens))
    eos_id = _special_id("eos", tok_config, config, ids, len(tokens))
    pad_id = _special_id("pad", tok_config, config, ids, len(tokens))
    add_bos = tok_config.get("add_bos_token")
    add_eos = tok_config.get("add_eos_token")
    return GGUFVocab(
        pre=pre,
        tokens=tuple(tokens),
        token_types=tuple(types),
        merges=_merges(model),
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
        add_bos=add_bos
        if isinstance(add_bos, bool)
        else _template_adds(tokenizer, tokens[bos_id] if bos_id is not None else None, first=True),
        add_eos=add_eos
        if isinstance(add_eos, bool)
        else _template_adds(tokenizer, tokens[eos_id] if eos_id is not None else None, first=False),
        chat_template=chat_template(tok_config),
    )
