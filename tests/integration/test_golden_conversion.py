"""The same conversion gives the same GGUF bytes, before and after any refactoring.

The digests below were recorded with `bonsai convert` on the demo checkpoints before the
layout was reorganised into layer folders (issue 9). A change that alters them changes what
users get: it must be deliberate (a new recipe default, a new provenance key, a version bump)
and re-record them here in the same commit, saying why.

Issue 39 made the default embedding, head and fallback type the source's own 16-bit type (BF16 for
the demos): the default's digests were re-recorded then. The F16 ones, asked for explicitly, are the
digests recorded before it: a job with explicit types gets the same bytes as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.llama, pytest.mark.slow]

F16 = ("--option", "embed_type=f16", "--option", "output_type=f16", "--option", "fallback_type=f16")
GOLDEN_F16_SHA256 = {
    "llama": "71e1e52cc1c5763b17125154a3831080b99c6414c7943eaf9ebb1f7b377bbddd",
    "qwen2": "5b9860d4a1179e7337962524855527623c8bf4cf7090b955c2154a370683c4b0",
    "bitnet": "d20de76567fce401dc88864ab68b243231ff292e2f7fe4c976991f0eb9a00660",
}
GOLDEN_SHA256 = {
    "llama": "cf4a6ed12ded1bb92ad967a6a55d1119d773670f5c572ac17e5583eb2777342f",
    "qwen2": "03d0a00bc3c430c07d2bd75d5e0d4daed940cf309a4904bd68524644ca6d316f",
    "bitnet": "d343e9d4d57773965d21cb6833e8c85380fe138c307fd5d3e4e223b8f11a0a71",
}


def _bonsai(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("BONSAI_")}
    env["BONSAI_HOME"] = str(cwd / "home")
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("architecture", sorted(GOLDEN_SHA256))
def test_demo_conversion_bytes_are_unchanged(tmp_path: Path, architecture: str) -> None:
    made = _bonsai(tmp_path, "demo-checkpoint", architecture, "--architecture", architecture)
    assert made.returncode == 0, made.stderr
    # A relative source: the source spec is recorded in the file (bonsai.source).
    for options, golden in (((), GOLDEN_SHA256), (F16, GOLDEN_F16_SHA256)):
        result = _bonsai(tmp_path, "convert", architecture, "--json", "--force", *options)
        assert result.returncode == 0, result.stdout + result.stderr
        detail = json.loads(result.stdout)
        assert detail["gguf"]["sha256"] == golden[architecture], options
