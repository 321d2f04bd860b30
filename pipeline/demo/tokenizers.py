"""Tiny tokenizers for the demo checkpoints, trained here on a built-in corpus (no downloads).

Four kinds, one per tokenizer family Bonsai packages:

- ``gpt2``: byte-level BPE with GPT-2's pre-tokenizer (the Llama demo's, unchanged);
- ``llama-bpe``: Llama 3 style (split regex with 1-3 digit groups, ignore_merges);
- ``qwen2``: Qwen2 style (single digits, NFC normaliser, ChatML special tokens);
- ``spm``: a SentencePiece BPE ``tokenizer.model`` with byte fallback, set up like Llama 2's.

Each trainer is deterministic: same corpus, same bytes.

Example::

    files = write_tokenizer("qwen2", folder)  # {"tokenizer.json": ..., "tokenizer_config.json": ...}
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "TOKENIZER_KINDS",
    "DemoTokenizer",
    "training_text",
    "train_gpt2",
    "write_tokenizer",
    "LLAMA3_SPLIT_REGEX",
    "QWEN2_SPLIT_REGEX",
]

TOKENIZER_KINDS = ("gpt2", "llama-bpe", "qwen2", "spm")

_VOCAB_SIZE_TARGET = 512
LLAMA3_BOS, LLAMA3_EOS = "<|begin_of_text|>", "<|end_of_text|>"
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The split regexes of Llama 3's and Qwen2's tokenizer.json, which llama.cpp knows by name.
LLAMA3_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT_REGEX = LLAMA3_SPLIT_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

_TEXT_LINES = (
    "The quick brown fox jumps over the lazy dog.",
    "A small model learns to add numbers one step at a time.",
    "Bonsai trees are small, but they are still trees.",
    "Ternary weights take the values minus one, zero and plus one.",
    "Café, naïve, résumé and jalapeño keep their accents.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 65536.",
    "    indented line with  double  spaces and\ttabs.",
    "What is 1+1? The answer is 2.",
    "Every layer holds attention, a gated feed forward block and two norms.",
    "Weights are packed into blocks of two hundred and fifty six values.",
    "Checksums prove that the files are the files that were published.",
    "Emoji 🙂 and symbols like €, ©, → are bytes too.",
)
# Only the newer tokenizers see these lines, so the gpt2 demo tokenizer keeps its bytes.
_EXTRA_LINES = (
    "盆栽は小さな木です。中文分词也需要测试。한국어 문장도 있습니다.",
    "Ünïcödé façade, crème brûlée, Ångström, smörgåsbord, ZAŻÓŁĆ GĘŚLĄ JAŹŃ.",
    "Tabs\tand\t\ttabs, newlines\n\nand  runs   of    spaces.",
    "Emoji 🚀👍🏽🎉 and more: 🙂🙂.",
    "user: What is 1+1?\nassistant: 2",
)


def training_text(extended: bool = False) -> list[str]:
    """Built-in corpus: prose plus every 'a+b=c' line for small a, b (so '1+1=2' exists)."""
    lines = list(_TEXT_LINES) + (list(_EXTRA_LINES) if extended else [])
    for a in range(10):
        for b in range(10):
            lines.append(f"{a}+{b}={a + b}")
            lines.append(f"{a} + {b} = {a + b}")
            lines.append(f"{a}*{b}={a * b} and {a}-{b}={a - b}")
    return lines


@dataclass(frozen=True)
class DemoTokenizer:
    """A trained demo tokenizer: its files' contents plus the ids config.json needs."""

    files: Mapping[str, bytes]
    vocab_size: int
    bos_id: int | None
    eos_id: int | None


def train_gpt2(bos: str = LLAMA3_BOS, eos: str = LLAMA3_EOS) -> Any:
    """Byte-level BPE (GPT-2 style pre-tokenizer) with BOS/EOS as special tokens; a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE_TARGET,
        min_frequency=1,
        special_tokens=[bos, eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    bos_id = tokenizer.token_to_id(bos)
    # Like Llama 3: the post-processor adds BOS, tokenizer_config says so too.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    return tokenizer


def _train_split_bpe(regex: str, specials: tuple[str, ...], ignore_merges: bool, nfc: bool) -> Any:
    """Byte-level BPE behind a Split(regex) pre-tokenizer: the Llama 3 / Qwen2 tokenizer.json shape."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE_TARGET,
        min_frequency=1,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(extended=True), trainer=trainer)
    return tokenizer


def _json_bytes(data: object) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _llama_bpe() -> DemoTokenizer:
    from tokenizers import processors

    tokenizer = _train_split_bpe(LLAMA3_SPLIT_REGEX, (LLAMA3_BOS, LLAMA3_EOS), ignore_merges=True, nfc=False)
    bos_id = tokenizer.token_to_id(LLAMA3_BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA3_BOS} $A",
        pair=f"{LLAMA3_BOS} $A {LLAMA3_BOS} $B",
        special_tokens=[(LLAMA3_BOS, bos_id)],
    )
    template = (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": LLAMA3_BOS,
        "eos_token": LLAMA3_EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": template,
    }
    return DemoTokenizer(
        {"tokenizer.json": tokenizer.to_str().encode("utf-8"), "tokenizer_config.json": _json_bytes(config)},
        tokenizer.get_vocab_size(),
        bos_id,
        tokenizer.token_to_id(LLAMA3_EOS),
    )


def _qwen2() -> DemoTokenizer:
    tokenizer = _train_split_bpe(QWEN2_SPLIT_REGEX, QWEN_SPECIALS, ignore_merges=False, nfc=True)
    # ChatML, as Qwen2 ships it (shortened): no BOS, turns framed by <|im_start|> / <|im_end|>.
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": template,
    }
    return DemoTokenizer(
        {"tokenizer.json": tokenizer.to_str().encode("utf-8"), "tokenizer_config.json": _json_bytes(config)},
        tokenizer.get_vocab_size(),
        tokenizer.token_to_id("<|endoftext|>"),
        tokenizer.token_to_id("<|im_end|>"),
    )


def _spm() -> DemoTokenizer:
    """SentencePiece BPE with byte fallback and an identity normaliser, as Llama 2 and Mistral ship it."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text(extended=True)),
        model_writer=model,
        model_type="bpe",
        vocab_size=_VOCAB_SIZE_TARGET,
        hard_vocab_limit=False,
        character_coverage=0.9995,  # rare characters go to byte tokens, as in Llama 2
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        num_threads=1,
        minloglevel=2,
    )
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    )
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "chat_template": template,
    }
    return DemoTokenizer(
        {"tokenizer.model": model.getvalue(), "tokenizer_config.json": _json_bytes(config)},
        processor.get_piece_size(),
        processor.bos_id(),
        processor.eos_id(),
    )


def make_tokenizer(kind: str) -> DemoTokenizer:
    """Train the demo tokenizer of `kind` (one of TOKENIZER_KINDS, not gpt2); ValueError otherwise."""
    builders = {"llama-bpe": _llama_bpe, "qwen2": _qwen2, "spm": _spm}
    if kind not in builders:
        raise ValueError(f"tokenizer kind {kind!r}; expected one of {', '.join(builders)}")
    return builders[kind]()


def write_tokenizer(kind: str, dest: Path) -> DemoTokenizer:
    """Train the `kind` tokenizer and write its files into `dest`."""
    trained = make_tokenizer(kind)
    for name, data in trained.files.items():
        (Path(dest) / name).write_bytes(data)
    return trained
