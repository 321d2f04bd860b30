"""SentencePiece tokenizer.model -> GGUF vocab: our proto reader against sentencepiece, refusals, fields."""

from __future__ import annotations

import io
import json
from pathlib import Path

import gguf
import pytest

from pipeline.core.errors import InputError
from pipeline.demo.tokenizers import training_text, write_tokenizer
from pipeline.formats.gguf.keys import Tokenizer as TK
from pipeline.formats.tokenizer.spm import load_spm_vocab, read_spm_model

sentencepiece = pytest.importorskip("sentencepiece")


@pytest.fixture(scope="module")
def spm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("spm")
    write_tokenizer("spm", folder)
    return folder


def _train(tmp: Path, **options: object) -> Path:
    model = io.BytesIO()
    settings = {"model_type": "bpe", "vocab_size": 400, "byte_fallback": True, "hard_vocab_limit": False}
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text()), model_writer=model, minloglevel=2, **{**settings, **options}
    )
    path = tmp / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


def test_reader_agrees_with_sentencepiece(spm_folder: Path) -> None:
    model = read_spm_model(spm_folder / "tokenizer.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_folder / "tokenizer.model"))
    assert len(model.pieces) == sp.get_piece_size()
    for i in range(sp.get_piece_size()):
        assert model.pieces[i] == sp.id_to_piece(i)
        assert model.scores[i] == pytest.approx(sp.get_score(i))
        assert (model.types[i] == 6) == sp.is_byte(i) and (model.types[i] == 3) == sp.is_control(i)
    assert (model.special_id("unk"), model.special_id("bos"), model.special_id("eos")) == (
        sp.unk_id(),
        sp.bos_id(),
        sp.eos_id(),
    )
    assert model.special_id("pad") is None  # pad_id -1: a negative int32 varint
    assert model.model_type == "bpe" and model.normalizer["name"] == "identity"


def test_vocab_fields(spm_folder: Path) -> None:
    vocab = load_spm_vocab(spm_folder / "tokenizer.model", spm_folder / "tokenizer_config.json")
    types = vocab.token_types
    assert vocab.model == "llama" and vocab.pre == "default" and not vocab.merges
    assert types.count(gguf.TokenType.BYTE) == 256 and vocab.tokens[3:5] == ("<0x00>", "<0x01>")
    assert types[vocab.unk_id] == gguf.TokenType.UNKNOWN and vocab.tokens[vocab.unk_id] == "<unk>"
    assert types[vocab.bos_id] == types[vocab.eos_id] == gguf.TokenType.CONTROL
    assert (vocab.add_bos, vocab.add_eos, vocab.add_space_prefix, vocab.remove_extra_whitespaces) == (
        True,
        False,
        True,
        False,
    )
    meta = vocab.metadata()
    assert len(meta[TK.SCORES]) == len(meta[TK.TOKENS]) == len(meta[TK.TOKEN_TYPE])
    assert TK.MERGES not in meta and meta[TK.UNK_ID] == 0 and "[INST]" in meta[TK.CHAT_TEMPLATE]


def test_padding_and_added_tokens(spm_folder: Path, tmp_path: Path) -> None:
    config_path = tmp_path / "tokenizer_config.json"
    config_path.write_text(
        json.dumps({"added_tokens_decoder": {"515": {"content": "<|tool|>", "special": True}}}),
        encoding="utf-8",
    )
    vocab = load_spm_vocab(spm_folder / "tokenizer.model", config_path, {"vocab_size": 520})
    assert len(vocab.tokens) == 520 and vocab.tokens[519] == "[PAD519]"
    assert vocab.token_types[519] == gguf.TokenType.UNUSED
    assert vocab.tokens[515] == "<|tool|>" and vocab.token_types[515] == gguf.TokenType.CONTROL
    with pytest.raises(InputError, match="vocab_size is 100"):
        load_spm_vocab(spm_folder / "tokenizer.model", None, {"vocab_size": 100})


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"model_type": "unigram"}, "model type 'unigram'"),
        ({"normalization_rule_name": "nmt_nfkc"}, "normaliser 'nmt_nfkc'"),
        (
            {"normalization_rule_name": "identity", "remove_extra_whitespaces": True},
            "remove_extra_whitespaces",
        ),
    ],
)
def test_settings_llama_cpp_cannot_follow_are_refused(tmp_path: Path, options: dict, reason: str) -> None:
    path = _train(
        tmp_path, **{"normalization_rule_name": "identity", "remove_extra_whitespaces": False, **options}
    )
    with pytest.raises(InputError, match=reason):
        load_spm_vocab(path)


@pytest.mark.parametrize(
    "data", [b"", b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x05abc", b"\x0b\x00", b"\xff" * 11]
)
def test_malformed_files_are_refused(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "tokenizer.model"
    path.write_bytes(data)
    with pytest.raises(InputError):
        read_spm_model(path)
