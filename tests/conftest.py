"""Shared fixtures: a tiny deterministic Llama checkpoint, written once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

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
