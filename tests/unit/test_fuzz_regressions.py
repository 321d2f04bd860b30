"""Every fuzzer finding (bench/fuzz.py), kept: each input must now be refused with the project's
own error type, naming the problem, instead of raising a Python error or running away.

Each case is the finding reduced to the bytes that matter, run through the same target the
fuzzer ran (bench/fuzz_targets.py), so the file, its companions and the call are the same.
"""

from __future__ import annotations

import json
import re
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.fuzz import make_context  # noqa: E402
from bench.fuzz_targets import TARGETS, Context  # noqa: E402
from pipeline.core.errors import InputError, IntegrityError, PipelineError  # noqa: E402


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Context:
    root = tmp_path_factory.mktemp("fuzz-regressions")
    return Context(make_context(root / "fixed"), root / "scratch")


def _gguf(kv: list[tuple[bytes, int, bytes]], tensors: Sequence[tuple[bytes, list[int], int]] = ()) -> bytes:
    """A GGUF v3 file: (key, value type, encoded value) entries and (name, dims, type) tensors."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for key, vtype, value in kv:
        out += struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype) + value
    for name, dims, ttype in tensors:
        out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ttype, 0)
    return out + b"\0" * 64


def _gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


_ARCH = (b"general.architecture", 8, _gguf_string(b"llama"))

# (target, input bytes, error type, what the message must say). The first byte of tokenizer,
# spm and manifest inputs picks the fuzzed file (see bench/fuzz_targets.py).
CASES = {
    # GGUF strings must be UTF-8: contents() raised UnicodeDecodeError.
    "gguf-string-not-utf8": ("gguf", _gguf([_ARCH, (b"general.name", 8, _gguf_string(b"\xff\xfe"))]),
                             IntegrityError, "'general.name': a string is not UTF-8"),
    # A dimension of 2^64 - 524256 beside a zero one: numpy's reshape raised ValueError.
    "gguf-dimension-over-int64": ("gguf", _gguf([_ARCH], [(b"t", [2**64 - 524256, 0], 0)]),
                                  IntegrityError, "over ggml's int64 limits"),
    # Dimensions whose product fits int64 but whose bytes (x 8 for F64) do not, beside a zero:
    # numpy's view raised "array is too big".
    "gguf-bytes-over-int64": ("gguf", _gguf([_ARCH], [(b"t", [2**61, 2, 0], 1)]),
                              IntegrityError, "over ggml's int64 limits"),
    # tokenizer.json is the number 1: AttributeError ('int' object has no attribute 'get').
    "tokenizer-json-not-object": ("tokenizer", b"\x001", InputError,
                                  "tokenizer.json is int, expected an object"),
    # tokenizer_config.json is the number 4: AttributeError again.
    "tokenizer-config-not-object": ("tokenizer", b"\x014", InputError, "tokenizer_config.json is int"),
    # tokenizer.json / tokenizer_config.json not UTF-8: UnicodeDecodeError.
    "tokenizer-json-not-utf8": ("tokenizer", b"\x00BBBB/\x9e\n", InputError, "tokenizer.json: not UTF-8"),
    "tokenizer-config-not-utf8": ("tokenizer", b"\x01{\"a\": \"\x85\"}", InputError,
                                  "tokenizer_config.json: not UTF-8"),
    # config.json vocab_size 10^12: the vocabulary loop would have padded a trillion rows.
    "tokenizer-huge-vocab-size": ("tokenizer", b"\x02" + json.dumps({"vocab_size": 10**12}).encode(),
                                  InputError, "vocab_size 1000000000000 is over"),
    # config.json's special ids past the vocabulary (tokenizer_config.json names no pad token, so
    # config.json's is used): a bos id out of range raised IndexError on tokens[bos_id].
    "tokenizer-pad-id-outside": ("tokenizer", b"\x02" + json.dumps({"pad_token_id": 10**6}).encode(),
                                 InputError, "config.json pad_token_id is 1000000"),
    # SentencePiece tokenizer_config.json not UTF-8: UnicodeDecodeError.
    "spm-config-not-utf8": ("spm", b"\x01{\"bos_token\": \"\x99\"}", InputError,
                            "tokenizer_config.json: not UTF-8"),
    # A piece whose score is a 64-bit varint: int.to_bytes(4) raised OverflowError.
    "spm-score-varint": ("spm", b"\x00\x0a\x0d\x0a\x01a\x10" + b"\xff" * 8 + b"\x01", InputError,
                         "score field that is not a float"),
    # added_tokens_decoder keyed by a non-number: int() raised ValueError.
    "spm-added-token-key": ("spm", b"\x01" + json.dumps({"added_tokens_decoder": {"x": {}}}).encode(),
                            InputError, "has id 'x', outside the vocabulary"),
    # Submit manifest not UTF-8: UnicodeDecodeError.
    "manifest-not-utf8": ("manifest", b"\x01[\"c/\xff\"]", InputError, "is not UTF-8 text"),
    # JSON integer over Python's 4300-digit limit: ValueError, not JSONDecodeError.
    "manifest-huge-int": ("manifest", b"\x01[" + b"1" * 5000 + b"]", InputError, "is not valid JSON"),
    # A source of 5000 hex digits (YAML parses those past the decimal limit): the error message's
    # repr raised ValueError (Python's 4300-digit limit for int to str).
    "manifest-huge-int-source": ("manifest", b"\x00- {source: 0x" + b"f" * 5000 + b"}", InputError,
                                 "<integer of 20000 bits>"),
    # An option keyed by an integer: redact() called .lower() on it (AttributeError).
    "manifest-int-option-key": ("manifest", b"\x00- {source: a/b, options: {1: x}}", InputError,
                                "option key 1 is not a string"),
    # A YAML timestamp cannot be stored as JSON.
    "manifest-date-option": ("manifest", b"\x00- {source: a/b, options: {when: 2026-12-03}}", InputError,
                             "is a date, not a JSON value"),
    # A recipe that is not a string went on to the job row.
    "manifest-recipe-list": ("manifest", b"\x00- {source: a/b, recipe: [x]}", InputError,
                             "recipe must be a string"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_finding_is_refused_with_the_projects_error(case: str, ctx: Context) -> None:
    target, data, error, says = CASES[case]
    with pytest.raises(error) as caught:
        TARGETS[target](data, ctx)
    assert says in str(caught.value)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"num_attention_heads": 0}, "'num_attention_heads' is 0; expected a positive number"),
        ({"hidden_size": float("inf")}, "'hidden_size' is inf"),
        ({"head_dim": 10**9}, "'head_dim' is 1000000000; expected a positive integer <= 65536"),
        ({"vocab_size": 2**40}, "'vocab_size' is 1099511627776"),
        ({"rms_norm_eps": -1e-5}, "'rms_norm_eps' is -1e-05"),
    ],
)
def test_config_hyperparameters_the_writer_refuses(change: dict[str, Any], says: str, ctx: Context) -> None:
    # Found through the config target: num_attention_heads 0 divided by zero in llama_metadata.
    import gguf

    from pipeline.formats.gguf.writer import llama_metadata

    config = {**json.loads((ctx.fixed / "llama" / "config.json").read_text()), **change}
    with pytest.raises(InputError, match=re.escape(says)):
        llama_metadata(config, gguf.LlamaFileType.MOSTLY_TQ2_0)


def test_yaml_alias_bomb_is_refused_quickly(ctx: Context) -> None:
    # Nine levels of nine aliases: a repr of the entry in the error message would be 9^9 items.
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for level in range(1, 10):
        prev = f"*a{level - 1}"
        lines.append(f"a{level}: &a{level} [{', '.join([prev] * 9)}]")
    lines.append("jobs: [*a9]")
    started = time.perf_counter()
    with pytest.raises(InputError, match="needs a `source` string"):
        TARGETS["manifest"](b"\x00" + "\n".join(lines).encode(), ctx)
    # The same bomb as options: redact() and the JSON column would walk all 9^9 values.
    lines[-1] = "jobs: [{source: a/b, options: {x: *a9}}]"
    with pytest.raises(InputError, match="options hold over 10000 values"):
        TARGETS["manifest"](b"\x00" + "\n".join(lines).encode(), ctx)
    assert time.perf_counter() - started < 1.0


def test_deeply_nested_pre_tokenizer_is_refused(ctx: Context) -> None:
    tokenizer = json.loads((ctx.fixed / "llama" / "tokenizer.json").read_text())
    nested: dict[str, object] = {"type": "ByteLevel"}
    for _ in range(50):
        nested = {"type": "Sequence", "pretokenizers": [nested]}
    tokenizer["pre_tokenizer"] = nested
    with pytest.raises(InputError, match="nests Sequences more than 8 deep"):
        TARGETS["tokenizer"](b"\x00" + json.dumps(tokenizer).encode(), ctx)


def test_seeds_pass_every_target(ctx: Context, tmp_path: Path) -> None:
    from bench.fuzz import make_seeds

    for target in TARGETS:
        for seed in sorted(make_seeds(target, ctx.fixed, tmp_path / target / "corpus").iterdir()):
            try:
                TARGETS[target](seed.read_bytes(), ctx)
            except PipelineError:
                pass  # a seed's companions may disagree (a Qwen config over the Llama weights)
