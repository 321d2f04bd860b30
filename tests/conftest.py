"""Shared fixtures: a tiny deterministic Llama checkpoint, written once per test session."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

# The checkout may not be pip-installed (no editable install in every venv): make
# `import pipeline` resolve to this tree whichever way pytest was started.
_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from pipeline.demo import write_demo_checkpoint  # noqa: E402


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
                tensors.append({"name": name, "shape": list(view.get_shape()),
                                "dtype": view.get_dtype(), "shard": shard})
    return {
        "architecture": config["model_type"],
        "hf_architecture": config["architectures"][0],
        "config": config,
        "format": "safetensors",
        "shards": shards,
        "tensors": tensors,
        "tokenizer": {"kind": "bpe", "files": ["tokenizer.json", "tokenizer_config.json"]},
    }


@pytest.fixture(scope="session")
def demo_card(demo_checkpoint: Path) -> dict[str, Any]:
    """Model card (inspect-stage shape) of `demo_checkpoint`."""
    return card_for_checkpoint(demo_checkpoint)
