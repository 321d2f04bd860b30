"""Texts as token-id sequences: what every calibration run and every reference comparison evaluates.

Each text is tokenized once by llama.cpp (the tokenizer every candidate GGUF runs with) and cut
into sequences of at most ``n_ctx`` tokens, each starting with BOS when the vocabulary adds
one (as llama.cpp's imatrix tool starts every chunk). A text that fits stays one sequence,
tokenized exactly as the validate stage's probe tokenizes its agreement text. A leftover
piece shorter than two tokens predicts nothing and is dropped.

For an HF checkpoint, which has no GGUF yet at calibration time, `write_vocab_gguf` writes a
vocabulary-only GGUF from its tokenizer files (the same vocabulary the packager writes).

Example::

    seqs = tokenize_texts(gguf_path, {"calibration": builtin_text(), "agreement": text}, n_ctx=512)
    seqs.ids[0][:5], seqs.names[0], seqs.n_tokens
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import InputError
from pipeline.formats.model_card import ModelCard

__all__ = ["TokenSequences", "split_tokens", "tokenize_texts", "write_vocab_gguf"]


@dataclass(frozen=True)
class TokenSequences:
    """Sequences of token ids; ``names[i]`` is the text sequence ``i`` came from."""

    names: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.ids):
            raise ValueError(f"{len(self.names)} names for {len(self.ids)} sequences")

    @property
    def n_tokens(self) -> int:
        """Tokens over all sequences."""
        return sum(len(s) for s in self.ids)

    @property
    def n_predicted(self) -> int:
        """Positions that predict a following token (each sequence's last one does not)."""
        return sum(max(len(s) - 1, 0) for s in self.ids)

    def select(self, names: Sequence[str] | None) -> list[int]:
        """Indices of the sequences of the named texts (all when None); InputError for an unknown name."""
        if names is None:
            return list(range(len(self.ids)))
        unknown = sorted(set(names) - set(self.names))
        if unknown:
            raise InputError(f"no sequences of text(s) {unknown}; the texts are {sorted(set(self.names))}")
        return [i for i, name in enumerate(self.names) if name in names]


def split_tokens(ids: Sequence[int], n_ctx: int, bos: int | None) -> list[tuple[int, ...]]:
    """Cut one text's ids (BOS first when ``bos`` is given) into sequences of at most ``n_ctx`` tokens.

    With ``bos``, every sequence starts with it and carries up to ``n_ctx - 1`` text tokens;
    without, sequences are plain ``n_ctx``-token slices. Pieces of fewer than two tokens are dropped.
    """
    if n_ctx < 2:
        raise InputError(f"n_ctx must be at least 2 tokens, got {n_ctx}")
    body = list(ids[1:] if bos is not None and ids and ids[0] == bos else ids)
    step = n_ctx - 1 if bos is not None else n_ctx
    head = (bos,) if bos is not None else ()
    pieces = [head + tuple(body[i : i + step]) for i in range(0, len(body), step)]
    return [p for p in pieces if len(p) >= 2]


def tokenize_texts(gguf_path: Path, texts: Mapping[str, str], n_ctx: int) -> TokenSequences:
    """Tokenize each named text with the GGUF file's vocabulary and split it (see `split_tokens`).

    Raises InputError for an empty mapping or a text with no sequence left, IntegrityError when
    llama.cpp cannot load the vocabulary.
    """
    from pipeline.calibration.llama_session import LlamaSession

    if not texts:
        raise InputError("no texts to tokenize")
    names: list[str] = []
    ids: list[tuple[int, ...]] = []
    with LlamaSession(gguf_path, vocab_only=True) as session:
        bos = session.bos
        for name, text in texts.items():
            pieces = split_tokens(session.tokenize(text), n_ctx, bos)
            if not pieces:
                raise InputError(f"text {name!r} has fewer than two tokens; it predicts nothing")
            names += [name] * len(pieces)
            ids += pieces
    return TokenSequences(tuple(names), tuple(ids))


def write_vocab_gguf(card: ModelCard, files: Mapping[str, Path], dest: Path) -> Path:
    """A vocabulary-only GGUF of an HF checkpoint's tokenizer at ``dest``, for `tokenize_texts`.

    ``files`` maps the download's names (tokenizer.json, tokenizer.model, tokenizer_config.json)
    to paths. Raises InputError when the tokenizer cannot be packaged (the packager's refusals).
    """
    import gguf

    from pipeline.formats.gguf.writer import llama_metadata, write_gguf
    from pipeline.formats.tokenizer import load_tokenizer

    config = dict(card.config)
    names = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json")
    vocab = load_tokenizer({n: Path(files[n]) for n in names if n in files}, config)
    # Only the tokenizer is read from this file; the llama keys just make it loadable.
    meta = llama_metadata({**config, "vocab_size": len(vocab.tokens)}, gguf.LlamaFileType.ALL_F32)
    meta.update(vocab.metadata())
    return write_gguf(Path(dest), "llama", meta, []).path
