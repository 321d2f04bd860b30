"""llama.cpp tokenizes like the original tokenizer, for every tokenizer kind Bonsai packages.

For each kind (byte-level BPE with the gpt2, llama-bpe and qwen2 pre-tokenizers, and a
SentencePiece BPE tokenizer.model) a tiny tokenizer is trained, its GGUF vocabulary written
as a vocab-only file, and llama.cpp (through llama-cpp-python) must give the same ids as
Hugging Face `tokenizers` (or `sentencepiece` for tokenizer.model) on texts with ASCII,
accents, CJK, emoji, runs of spaces, digits, newlines and tabs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest

from pipeline.demo.checkpoint import write_demo_checkpoint
from pipeline.demo.tokenizers import TOKENIZER_KINDS, write_tokenizer
from pipeline.formats.gguf.writer import llama_metadata, write_gguf
from pipeline.formats.tokenizer import GGUFVocab, load_tokenizer

TEXTS = (
    "Hello world, it's a test. Don't STOP; we'll see!",
    "1+1=2 and 12345+678=13024, pi is 3.14159, 1,000,000 and 007",
    "  leading, trailing   ",
    "runs    of\tspaces\n\n\nand newlines\r\nand\t\ttabs",
    "Café, naïve, jalapeño, crème brûlée, Ångström, ZAŻÓŁĆ GĘŚLĄ JAŹŃ, Ünïcödé",
    "盆栽は小さな木です。中文分词也需要测试。한국어 문장도 있습니다.",
    "emoji 🙂🚀👍🏽🎉 and ©→€ and 🙂🙂",
    "x",
    " ",
    "\n",
    "What is 1+1?",
    "mixed: naïve 盆栽 🙂 42\tend",
)
_CONFIG = {
    "num_attention_heads": 4,
    "hidden_size": 256,
    "max_position_embeddings": 256,
    "num_hidden_layers": 1,
    "intermediate_size": 512,
}


def _tokenizer_folder(kind: str, dest: Path) -> Path:
    if kind == "gpt2":  # the Llama demo's own tokenizer files
        return write_demo_checkpoint(dest, n_layers=1)
    dest.mkdir(parents=True)
    write_tokenizer(kind, dest)
    return dest


def _vocab(folder: Path) -> GGUFVocab:
    names = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json")
    return load_tokenizer({n: folder / n for n in names if (folder / n).exists()})


def _reference(folder: Path) -> tuple[Callable[[str], list[int]], Callable[[str], list[int]]]:
    """(encode without specials, encode with the tokenizer's own special-token rules)."""
    if (folder / "tokenizer.model").exists():
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        return (lambda text: list(sp.encode(text))), (lambda text: [sp.bos_id(), *sp.encode(text)])
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return (
        lambda text: tok.encode(text, add_special_tokens=False).ids,
        lambda text: tok.encode(text).ids,
    )


@pytest.fixture(scope="module", params=TOKENIZER_KINDS)
def packaged_vocab(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(kind, tokenizer folder, GGUFVocab, vocab-only .gguf path) per tokenizer kind."""
    tmp = tmp_path_factory.mktemp(f"tok-{request.param}")
    folder = _tokenizer_folder(request.param, tmp / "files")
    vocab = _vocab(folder)
    meta = llama_metadata({**_CONFIG, "vocab_size": len(vocab.tokens)}, gguf.LlamaFileType.ALL_F32)
    meta.update(vocab.metadata())
    path = write_gguf(tmp / "vocab.gguf", "llama", meta, []).path
    return request.param, folder, vocab, path


def test_vocab_kind_and_chat_template(packaged_vocab: Any) -> None:
    kind, folder, vocab, _ = packaged_vocab
    expected = {"gpt2": ("gpt2", "gpt-2"), "llama-bpe": ("gpt2", "llama-bpe"), "qwen2": ("gpt2", "qwen2")}
    assert (vocab.model, vocab.pre) == expected.get(kind, ("llama", "default"))
    template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    assert vocab.chat_template == template
    assert (kind == "gpt2") == (template is None)


@pytest.mark.llama
def test_llama_cpp_ids_equal_reference(packaged_vocab: Any) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    kind, folder, vocab, path = packaged_vocab
    model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    plain, with_specials = _reference(folder)
    mismatches = []
    for text in TEXTS:
        got = model.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        if got != plain(text):
            mismatches.append((text, got, plain(text)))
        decoded = model.detokenize(got).decode("utf-8")
        # SentencePiece's dummy prefix comes back as a leading space, as in sentencepiece itself.
        assert (decoded.removeprefix(" ") if kind == "spm" else decoded) == text, (kind, text)
    assert not mismatches, f"{kind}: llama.cpp and the reference differ on {mismatches}"
    for text in ("1+1=", "What is 1+1?"):
        assert model.tokenize(text.encode(), add_bos=vocab.add_bos) == with_specials(text), (kind, text)


@pytest.mark.llama
def test_llama_cpp_parses_special_tokens(packaged_vocab: Any) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    kind, folder, vocab, path = packaged_vocab
    model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    plain, _ = _reference(folder)
    if vocab.eos_id is None:
        pytest.skip(f"{kind} has no EOS token")
    eos = vocab.tokens[vocab.eos_id]
    text = f"user: hi{eos}assistant: 2"
    ids = model.tokenize(text.encode(), add_bos=False, special=True)
    assert vocab.eos_id in ids
    if kind != "spm":  # `tokenizers` splits added special tokens out of the text as llama.cpp does
        assert ids == plain(text)
