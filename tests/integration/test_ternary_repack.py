"""A ternary GGUF source moves between layouts without a re-fit: TQ2_0 -> Q2_0 (runs on CUDA) and back,
with bit-identical decoded weights, through the real pipeline (`bonsai convert`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.formats.gguf.reader import GGUFFile
from pipeline.ternary.pack import decode_bytes

pytestmark = [pytest.mark.llama, pytest.mark.slow]


def _convert(home: Path, source: Path, recipe: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BONSAI_")}
    env |= {"BONSAI_HOME": str(home), "BONSAI_OUTPUT_DIR": str(home / "out")}  # the GGUF copy: not the clone
    command = [sys.executable, "-m", "pipeline", "convert", str(source), "--recipe", recipe, "--json"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.stdout.strip(), result.stderr[-3000:]
    detail: dict[str, object] = json.loads(result.stdout)
    stages = {s["stage"]: s for s in detail["stages"]}  # type: ignore[index, union-attr]
    assert stages["package"]["status"] == "succeeded", result.stderr
    return detail


def _gguf(detail: dict[str, object], dest: Path) -> Path:
    """The job's GGUF under a .gguf name, as a user keeps it (the store names files by digest)."""
    shutil.copyfile(detail["gguf"]["path"], dest)  # type: ignore[index]
    return dest


def _linear(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    out = {}
    for tensor in GGUFFile(path).tensors:
        if tensor.name.startswith("blk.") and tensor.tensor_type.name in ("TQ2_0", "Q2_0"):
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
            out[tensor.name] = (tensor.tensor_type.name, decode_bytes(raw, tensor.tensor_type.name, shape))
    return out


def test_tq2_0_source_becomes_q2_0_and_back_without_loss(tmp_path: Path, demo_checkpoint: Path) -> None:
    tq2 = _gguf(_convert(tmp_path / "h1", demo_checkpoint, "tq2_0"), tmp_path / "tq2.gguf")
    as_q2 = _convert(tmp_path / "h2", tq2, "q2_0")
    q2 = _gguf(as_q2, tmp_path / "q2.gguf")
    back = _gguf(_convert(tmp_path / "h3", q2, "tq2_0"), tmp_path / "back.gguf")

    source, moved, returned = _linear(tq2), _linear(q2), _linear(back)
    assert source and set(source) == set(moved) == set(returned)
    for name, (kind, values) in source.items():
        assert kind == "TQ2_0" and moved[name][0] == "Q2_0" and returned[name][0] == "TQ2_0"
        assert np.array_equal(values.view(np.uint32), moved[name][1].view(np.uint32)), name  # bit for bit
        assert np.array_equal(values.view(np.uint32), returned[name][1].view(np.uint32)), name
    decompose = next(s for s in as_q2["stages"] if s["stage"] == "decompose")  # type: ignore[union-attr]
    assert decompose["metrics"]["rel_error"] == 0.0
    report_file = next(a["path"] for a in decompose["outputs"] if a["name"] == "report.json")
    reasons = {t["name"]: t["reason"] for t in json.loads(Path(report_file).read_text())["tensors"]}
    assert all("re-packed losslessly from TQ2_0" in reasons[name] for name in source)  # no re-fit
