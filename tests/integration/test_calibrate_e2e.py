"""`bonsai convert` with calibration: importance=imatrix and method=gptq end to end, a user's
calibration file, and one calibration per source reused by a second job (embedded mode, no servers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest

from pipeline.calibration.imatrix import read_imatrix
from pipeline.formats.gguf.keys import QuantizeImatrix

pytestmark = [pytest.mark.llama, pytest.mark.slow]

_TEXT = (
    "The lighthouse keeper wrote in his log every evening, noting the wind and the ships. "
    "for i in range(3):\n    print(i * i)\n"
    "Der Zug fährt um sieben Uhr ab. 9 - 4 = 5 and 6 / 3 = 2. "
) * 3


def _bonsai(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("BONSAI_")}
    env["BONSAI_HOME"] = str(cwd / "home")
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def _stage(detail: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in reversed(detail["stages"]) if s["stage"] == name)


def _convert(tmp: Path, *args: str) -> dict[str, Any]:
    result = _bonsai(tmp, "convert", "demo", "--json", *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    detail: dict[str, Any] = json.loads(result.stdout)
    return detail


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("calibrate-e2e")
    made = _bonsai(tmp, "demo-checkpoint", "demo")
    assert made.returncode == 0, made.stderr
    (tmp / "calibration.txt").write_text(_TEXT, encoding="utf-8")
    return tmp


def test_imatrix_and_gptq_conversion_then_a_second_job_reuses_the_calibration(workspace: Path) -> None:
    options = ("--option", "importance=imatrix", "--option", "method=gptq", "--option", "calibration_ctx=64",
               "--calibration", "calibration.txt")
    first = _convert(workspace, *options)
    assert first["status"] == "succeeded"
    calibrate = _stage(first, "calibrate")
    outputs = {o["name"]: o for o in calibrate["outputs"]}
    assert outputs["reference.npz"]["kind"] == "source-reference"
    assert outputs["imatrix.gguf"]["kind"] == "importance-matrix"
    grams = {n for n in outputs if n.startswith("gram/")}
    assert grams == {"gram/blk.0.safetensors", "gram/blk.1.safetensors"}
    assert calibrate["metrics"]["dataset"].startswith("user-calibration-")
    assert first["params"]["calibration_text"] == _TEXT  # the job records the text it was given
    # llama.cpp's own imatrix format, readable from the store.
    matrix = read_imatrix(Path(outputs["imatrix.gguf"]["path"]))
    assert len(matrix.entries) == 14
    # The file records the imatrix as llama-quantize --imatrix would, read back with gguf-py.
    package = _stage(first, "package")["outputs"]
    packaged = next(Path(o["path"]) for o in package if o["name"].endswith(".gguf"))
    reader = gguf.GGUFReader(packaged)
    assert reader.get_field(QuantizeImatrix.FILE).contents() == "imatrix.gguf"
    assert reader.get_field(QuantizeImatrix.DATASET).contents() == matrix.datasets[0]
    counts = ((QuantizeImatrix.ENTRIES_COUNT, 14), (QuantizeImatrix.CHUNKS_COUNT, matrix.chunk_count))
    for key, value in counts:
        assert reader.get_field(key).contents() == value > 0
        assert reader.get_field(key).types == [gguf.GGUFValueType.UINT32]
    decompose = _stage(first, "decompose")
    assert {i["name"] for i in decompose["inputs"] if i["name"].startswith("calibrate/")} == {
        "calibrate/imatrix.gguf", "calibrate/gram/blk.0.safetensors", "calibrate/gram/blk.1.safetensors"}
    validate = _stage(first, "validate")
    # Validate reads the stored reference, never the source's files.
    assert "calibrate/reference.npz" in {i["name"] for i in validate["inputs"]}
    assert not any(i["name"].startswith(("download/", "inspect/")) for i in validate["inputs"])
    assert validate["metrics"]["source"]["kind"] == "hf-16bit"
    assert validate["metrics"]["checks"]["agreement"] in ("pass", "warn")

    # Same source, same calibration options, another recipe: calibrate is not run again.
    second = _convert(workspace, "--recipe", "tq1_0", *options)
    assert second["status"] == "succeeded"
    reused = _stage(second, "calibrate")
    assert reused["status"] == "skipped-cached" and reused["cached_from_id"] == calibrate["id"]
    assert {o["sha256"] for o in reused["outputs"]} == {o["sha256"] for o in calibrate["outputs"]}
    assert _stage(second, "decompose")["status"] == "succeeded"


def test_a_calibration_file_that_is_not_text_is_refused(workspace: Path) -> None:
    (workspace / "binary.txt").write_bytes(b"calibration \xff\xfe text")
    result = _bonsai(workspace, "convert", "demo", "--option", "importance=imatrix",
                     "--calibration", "binary.txt")
    assert result.returncode != 0 and "is not UTF-8 text" in result.stderr
    assert "Traceback" not in result.stderr
