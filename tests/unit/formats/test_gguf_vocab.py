"""tokenizer.json -> GGUF vocab: pre-tokenizer mapping, token table, and llama.cpp agreement."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import gguf
import pytest

from pipeline.core.errors import InputError
from pipeline.formats.gguf.keys import Tokenizer as TK
from pipeline.formats.gguf.writer import llama_metadata, write_gguf
from pipeline.formats.tokenizer.bpe import detect_pre_tokenizer, load_vocab

_LLAMA3_SPLIT = {
    "type": "Split",
    "pattern": {
        "Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
    },
    "behavior": "Isolated",
    "invert": False,
}
_BYTE_LEVEL_NO_REGEX = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": False,
}

TEXTS = (
    "Hello world, it's a test.",
    "1+1=2 and 12345+678=13023",
    "  leading, trailing   ",
    "runs    of\tspaces\n\n\nand newlines",
    "Café, naïve, jalapeño, Ünïcödé",
    "emoji 🙂🚀👍🏽 and ©→€",
)


@pytest.fixture(scope="module")
def demo_tokenizer(demo_checkpoint: Path) -> dict[str, Any]:
    return json.loads((demo_checkpoint / "tokenizer.json").read_text(encoding="utf-8"))


def test_demo_is_gpt2(demo_tokenizer: dict[str, Any]) -> None:
    assert detect_pre_tokenizer(demo_tokenizer) == "gpt-2"


def test_llama3_layout_is_llama_bpe(demo_tokenizer: dict[str, Any]) -> None:
    tok = copy.deepcopy(demo_tokenizer)
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [_LLAMA3_SPLIT, _BYTE_LEVEL_NO_REGEX]}
    tok["model"]["ignore_merges"] = True
    assert detect_pre_tokenizer(tok) == "llama-bpe"


def test_qwen2_layout_is_qwen2(demo_tokenizer: dict[str, Any]) -> None:
    tok = copy.deepcopy(demo_tokenizer)
    split = copy.deepcopy(_LLAMA3_SPLIT)
    split["pattern"]["Regex"] = split["pattern"]["Regex"].replace("\\p{N}{1,3}", "\\p{N}")
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, _BYTE_LEVEL_NO_REGEX]}
    tok["normalizer"] = {"type": "NFC"}
    assert detect_pre_tokenizer(tok) == "qwen2"


@pytest.mark.parametrize("change", ["regex", "prefix_space", "ignore_merges", "normalizer"])
def test_unknown_pre_tokenizer_is_refused(demo_tokenizer: dict[str, Any], change: str) -> None:
    tok = copy.deepcopy(demo_tokenizer)
    tok["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [copy.deepcopy(_LLAMA3_SPLIT), _BYTE_LEVEL_NO_REGEX],
    }
    tok["model"]["ignore_merges"] = True
    if change == "regex":
        tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{N}{1,2}|\\s+"
    elif change == "prefix_space":
        tok["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}
        tok["model"]["ignore_merges"] = False
    elif change == "ignore_merges":
        tok["model"]["ignore_merges"] = False
    else:
        tok["normalizer"] = {"type": "Lowercase"}
    with pytest.raises(InputError, match="pre-tokenizer"):
        detect_pre_tokenizer(tok)


def test_byte_fallback_bpe_is_refused(
    demo_checkpoint: Path, tmp_path: Path, demo_tokenizer: dict[str, Any]
) -> None:
    tok = copy.deepcopy(demo_tokenizer)
    tok["model"]["byte_fallback"] = True
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tok), encoding="utf-8")
    with pytest.raises(InputError, match="byte_fallback"):
        load_vocab(path)


def test_demo_vocab_fields(demo_checkpoint: Path) -> None:
    config = json.loads((demo_checkpoint / "config.json").read_text())
    vocab = load_vocab(demo_checkpoint / "tokenizer.json", demo_checkpoint / "tokenizer_config.json", config)
    assert len(vocab.tokens) == len(vocab.token_types) == config["vocab_size"]
    assert vocab.tokens[vocab.bos_id] == "<|begin_of_text|>" and vocab.bos_id == config["bos_token_id"]
    assert vocab.token_types[vocab.eos_id] == gguf.TokenType.CONTROL
    assert vocab.token_types.count(gguf.TokenType.NORMAL) == len(vocab.tokens) - 2
    assert (vocab.add_bos, vocab.add_eos, vocab.pad_id) == (True, False, None)
    assert all(len(m.split(" ")) == 2 for m in vocab.merges)
    meta = vocab.metadata()
    assert meta[TK.MODEL] == "gpt2" and meta[TK.PRE] == "gpt-2"


def test_padded_vocab_marks_unused(demo_checkpoint: Path) -> None:
    vocab = load_vocab(demo_checkpoint / "tokenizer.json", None, {"vocab_size": 520, "bos_token_id": 0})
    assert vocab.tokens[519] == "[PAD519]" and vocab.token_types[519] == gguf.TokenType.UNUSED
    assert vocab.add_bos is True  # from the post-processor template, no tokenizer_config given
    with pytest.raises(InputError, match="vocab_size"):
        load_vocab(demo_checkpoint / "tokenizer.json", None, {"vocab_size": 100})


@pytest.mark.llama
def test_llama_cpp_tokenizes_like_tokenizers(demo_checkpoint: Path, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    from tokenizers import Tokenizer

    config = json.loads((demo_checkpoint / "config.json").read_text())
    vocab = load_vocab(demo_checkpoint / "tokenizer.json", demo_checkpoint / "tokenizer_config.json", config)
    meta = llama_metadata(config, gguf.LlamaFileType.ALL_F32)
    meta.update(vocab.metadata())
    path = write_gguf(tmp_path / "vocab.gguf", "llama", meta, []).path
    model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    reference = Tokenizer.from_file(str(demo_checkpoint / "tokenizer.json"))
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert model.tokenize(text.encode("utf-8"), add_bos=False, special=False) == expected, text
    assert model.tokenize(b"1+1=", add_bos=True) == reference.encode("1+1=").ids
    assert model.detokenize(reference.encode(TEXTS[4], add_special_tokens=False).ids).decode() == TEXTS[4]
