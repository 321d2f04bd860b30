"""Shape checks shared by the tokenizer readers: tokenizer files come from strangers.

Every value a reader indexes or iterates is checked for its JSON type first, and every size
that turns into a loop or an allocation (ids, vocab_size) is bounded, so a crafted file is
refused with InputError naming the key instead of raising a Python error or allocating.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.core.errors import InputError

__all__ = ["MAX_VOCAB", "mapping", "items", "token_id", "vocab_rows"]

# Gemma 3 has 262,144 tokens; the largest published vocabularies stay well under this.
MAX_VOCAB = 1 << 22


def mapping(value: Any, what: str) -> Mapping[str, Any]:
    """`value` as a JSON object ({} for null); InputError naming `what` otherwise."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InputError(f"{what} is {type(value).__name__}, expected an object")
    return value


def items(value: Any, what: str) -> list[Any]:
    """`value` as a JSON array ([] for null); InputError naming `what` otherwise."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InputError(f"{what} is {type(value).__name__}, expected a list")
    return value


def token_id(value: Any, what: str, limit: int = MAX_VOCAB) -> int:
    """A token id: an integer (not a bool) in [0, limit); InputError naming `what` otherwise."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 12:
        value = int(value)  # tokenizer_config.json keys its added tokens by decimal strings
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise InputError(f"{what} is {value!r}, expected a token id in [0, {limit})")
    return value


def vocab_rows(declared: Any, n_tokens: int, label: str) -> int:
    """The GGUF vocabulary's row count: config.json's vocab_size when it is an int, else `n_tokens`."""
    if not isinstance(declared, int) or isinstance(declared, bool):
        return n_tokens
    if declared < n_tokens:
        raise InputError(f"{label} has {n_tokens} tokens but config.json vocab_size is {declared}")
    if declared > MAX_VOCAB:
        raise InputError(f"config.json vocab_size {declared} is over {MAX_VOCAB}; not a real vocabulary")
    return declared
