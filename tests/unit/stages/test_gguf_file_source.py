"""A .gguf file as a job source: fast reader, tensor plan, dequantized tensors, metadata copy, and
the inspect -> decompose -> package chain on a mixed-type GGUF made from the demo checkpoint."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from conftest import package_inputs

from pipeline.core.errors import InputError, IntegrityError
from pipeline.core.files import sha256_file
from pipeline.formats.gguf import tensor_source as gguf_source
from pipeline.formats.gguf.keys import QuantizeImatrix
from pipeline.formats.gguf.reader import GGUFFile
from pipeline.formats.gguf.writer import TensorToWrite, Typed, write_gguf
from pipeline.formats.model_card import ModelCard
from pipeline.stages import decompose, inspect, package
from pipeline.stages.base import InputFile, JobSpec

QT = gguf.GGMLQuantizationType
# Source types by tensor kind: a little of everything gguf's numpy code can write.
_MIX = {"token_embd": QT.Q8_0, "attn_q": QT.BF16, "attn_k": QT.F16, "ffn_up": QT.Q5_0, "ffn_down": QT.Q4_0}


def _input(key: str, path: Path) -> InputFile:
    return InputFile(key.split("/", 1)[1], path, sha256_file(path), path.stat().st_size)


def _workdir(tmp: Path, name: str) -> Path:
    path = tmp / name
    path.mkdir(parents=True)
    return path


def _source_type(name: str, ndim: int) -> gguf.GGMLQuantizationType:
    if ndim == 1:
        return QT.F32
    kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    return _MIX.get(kind, QT.F16)


def _requantize(src: Path, dest: Path) -> Path:
    """`src` rewritten with its metadata as-is and each tensor stored as `_source_type` says, plus the
    record of an imatrix, as a source that llama-quantize made with one carries."""
    reader = GGUFFile(src)
    meta = {k: f.typed() for k, f in reader.fields.items() if k != "general.architecture"}
    meta[QuantizeImatrix.FILE] = "imatrix-of-the-source.gguf"
    meta[QuantizeImatrix.ENTRIES_COUNT] = Typed(14, gguf.GGUFValueType.UINT32)
    tensors = []
    for tensor in reader.tensors:
        values = gguf_source.dequantize_tensor(tensor)
        qtype = _source_type(tensor.name, values.ndim)
        tensors.append(
            TensorToWrite(
                tensor.name, qtype, values.shape, lambda v=values, q=qtype: gguf.quants.quantize(v, q)
            )
        )
    arch = reader.fields["general.architecture"].contents()
    write_gguf(dest, arch, meta, tensors)
    return dest


@pytest.fixture(scope="module")
def mixed_gguf(
    demo_checkpoint: Path, demo_card: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The demo model as a GGUF file with Q8_0, BF16, F16, Q5_0, Q4_0 and F32 tensors."""
    tmp = tmp_path_factory.mktemp("gguf_source")
    inputs = package_inputs(demo_checkpoint, demo_card, tmp, ternary="F32")
    f32 = (
        package.run(package.make_params(JobSpec(source="demo")), inputs, _workdir(tmp, "f32")).outputs[0].path
    )
    folder = _workdir(tmp, "source")
    return _requantize(f32, folder / "demo-mixed.gguf")


def _card(path: Path, tmp: Path) -> dict[str, Any]:
    """The inspect stage's card for a single .gguf file (through the real stage)."""
    from pipeline.stages import checksum

    download = {f"download/{path.name}": _input(f"download/{path.name}", path)}
    manifest = checksum.run(
        checksum.make_params(JobSpec(source=str(path))), download, _workdir(tmp, "checksum")
    )
    inputs = {
        **download,
        **{f"checksum/{o.name}": _input(f"checksum/{o.name}", o.path) for o in manifest.outputs},
    }
    result = inspect.run(inspect.Params(), inputs, _workdir(tmp, "inspect"))
    return json.loads(result.outputs[0].path.read_text())


# --- reader -------------------------------------------------------------------------------------


def test_reader_matches_gguf_reader(mixed_gguf: Path) -> None:
    ours, theirs = GGUFFile(mixed_gguf), gguf.GGUFReader(mixed_gguf)
    assert set(ours.fields) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in ours.fields.items():
        assert field.contents() == theirs.fields[key].contents(), key
        assert list(field.types) == [gguf.GGUFValueType(t) for t in theirs.fields[key].types], key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.shape.tolist(), a.n_bytes, a.data_offset) == (
            b.tensor_type,
            b.shape.tolist(),
            b.n_bytes,
            b.data_offset,
        )
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize(
    "body, counts, message",
    [
        (b"", {"n_kv": 1 << 40}, "more than"),
        # key "k", array of 2**60 uint8: must fail on the length, not try to read it
        (struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 0, 1 << 60), {}, "needs"),
        (struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99), {}, "unknown value type"),
    ],
)
def test_reader_refuses_hostile_headers(
    tmp_path: Path, body: bytes, counts: dict[str, int], message: str
) -> None:
    n_kv = counts.get("n_kv", 1)
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + body + b"\0" * 64)
    with pytest.raises(IntegrityError, match=message):
        GGUFFile(path)


def test_dequantizable_types_cover_k_quants() -> None:
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K", "Q5_0"} <= gguf_source.dequantizable_types()
    assert "I32" not in gguf_source.dequantizable_types()


# --- plan, tensors, metadata --------------------------------------------------------------------


def test_card_records_source_types(mixed_gguf: Path, tmp_path: Path) -> None:
    card = _card(mixed_gguf, tmp_path)
    assert card["format"] == "gguf" and card["architecture"] == "llama"
    assert card["dtypes"] == {"BF16": 2, "F16": 9, "F32": 5, "Q4_0": 2, "Q5_0": 2, "Q8_0": 1}
    assert card["file_type"] == "ALL_F32"  # the F32 file's own key, copied as-is by _requantize


def test_plan_and_tensors(mixed_gguf: Path, tmp_path: Path) -> None:
    card = _card(mixed_gguf, tmp_path)
    plan = gguf_source.tensor_plan(ModelCard.from_dict(card))
    assert [p.gguf_name for p in plan] == [t["name"] for t in card["tensors"]]
    reader = gguf.GGUFReader(mixed_gguf)
    expected = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    files = {mixed_gguf.name: mixed_gguf}
    streamed = list(gguf_source.iter_tensors(ModelCard.from_dict(card), files, mixed_gguf.name))
    assert [name for name, _ in streamed] == [p.gguf_name for p in plan]
    for (name, tensor), item in zip(streamed, plan, strict=True):
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == item.shape
        np.testing.assert_array_equal(tensor.numpy(), expected[name].reshape(item.shape))


def test_card_that_disagrees_with_the_file(mixed_gguf: Path, tmp_path: Path) -> None:
    card = _card(mixed_gguf, tmp_path)
    card["tensors"][1]["dtype"] = "F16" if card["tensors"][1]["dtype"] != "F16" else "F32"
    with pytest.raises(IntegrityError, match="the model card says"):
        list(gguf_source.iter_tensors(ModelCard.from_dict(card), {mixed_gguf.name: mixed_gguf},
                                      mixed_gguf.name))
    card["tensors"][1]["dtype"] = "I32"
    with pytest.raises(InputError, match="gguf cannot dequantize"):
        gguf_source.tensor_plan(ModelCard.from_dict(card))


def test_source_metadata_skips_rewritten_keys(mixed_gguf: Path) -> None:
    copied, dropped = gguf_source.source_metadata(mixed_gguf)
    assert not dropped
    assert not set(copied) & gguf_source.REWRITTEN_KEYS
    assert not any(k.startswith("bonsai.") for k in copied)
    # The source's imatrix record says how the source was quantized, not how the conversion is.
    assert gguf.GGUFReader(mixed_gguf).get_field(QuantizeImatrix.FILE) is not None
    assert not any(k.startswith(QuantizeImatrix.PREFIX) for k in copied)
    tokens = copied["tokenizer.ggml.tokens"]
    assert tokens.sub_type is gguf.GGUFValueType.STRING and all(isinstance(t, bytes) for t in tokens.value)
    assert "llama.block_count" in copied


# --- the chain ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ternary_from_gguf(mixed_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """inspect -> decompose -> package on the mixed GGUF source; returns paths and results."""
    tmp = tmp_path_factory.mktemp("gguf_chain")
    card = _card(mixed_gguf, tmp)
    card_path = tmp / "model_card.json"
    card_path.write_text(json.dumps(card))
    inputs = {
        f"download/{mixed_gguf.name}": _input(f"download/{mixed_gguf.name}", mixed_gguf),
        "inspect/model_card.json": _input("inspect/model_card.json", card_path),
    }
    job = JobSpec(source=str(mixed_gguf), options={"device": "cpu"})
    dec = decompose.run(decompose.make_params(job), inputs, _workdir(tmp, "dec"))
    dec_inputs = {f"decompose/{o.name}": _input(f"decompose/{o.name}", o.path) for o in dec.outputs}
    pkg = package.run(package.make_params(job), {**inputs, **dec_inputs}, _workdir(tmp, "pkg"))
    return {
        "inputs": {**inputs, **dec_inputs},
        "decompose": dec,
        "package": pkg,
        "card": card,
        "gguf": pkg.outputs[0].path,
        "job": job,
    }


def test_decompose_records_source_types(ternary_from_gguf: dict[str, Any]) -> None:
    metrics = ternary_from_gguf["decompose"].metrics
    assert metrics["source_format"] == "gguf"
    assert metrics["source_types"]["Q4_0"] == 2 and metrics["n_ternary"] == 14
    report = json.loads(ternary_from_gguf["inputs"]["decompose/report.json"].path.read_text())
    assert report["source_types"] == metrics["source_types"]
    # Dequantized Q4_0/Q5_0/BF16 is no longer exactly ternary, but close to it.
    assert 0 < metrics["rel_error"] < 0.5


def test_package_keeps_source_metadata(ternary_from_gguf: dict[str, Any], mixed_gguf: Path) -> None:
    out, src = GGUFFile(ternary_from_gguf["gguf"]), GGUFFile(mixed_gguf)
    for key, field in src.fields.items():
        if key in gguf_source.REWRITTEN_KEYS or key.startswith(("bonsai.", QuantizeImatrix.PREFIX)):
            continue  # the source's own provenance keys describe the source, ours the new file
        assert out.fields[key].typed() == field.typed(), key
    # This conversion read no imatrix: the source's record of one is not carried over.
    assert not any(key.startswith(QuantizeImatrix.PREFIX) for key in out.fields)
    assert out.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_TQ2_0)
    assert out.fields["bonsai.source"].contents() == str(mixed_gguf)
    types = {t.name: t.tensor_type.name for t in out.tensors}
    assert types["blk.0.attn_q.weight"] == "TQ2_0" and types["token_embd.weight"] == "F16"
    metrics = ternary_from_gguf["package"].metrics
    assert metrics["source_format"] == "gguf" and metrics["source_types"]["Q8_0"] == 1
    assert metrics["file_type"] == "MOSTLY_TQ2_0"


def test_package_refuses_missing_source_file(ternary_from_gguf: dict[str, Any], tmp_path: Path) -> None:
    inputs = {k: v for k, v in ternary_from_gguf["inputs"].items() if not k.endswith(".gguf")}
    with pytest.raises(InputError, match="package needs input download/demo-mixed.gguf"):
        package.run(package.make_params(ternary_from_gguf["job"]), inputs, tmp_path)


@pytest.mark.llama
def test_validate_compares_with_the_source_file(ternary_from_gguf: dict[str, Any], tmp_path: Path) -> None:
    from pipeline.stages import calibrate, validate

    # calibrate runs the GGUF source itself (no 16-bit copy is written) and keeps its answers.
    cal = calibrate.run(calibrate.make_params(ternary_from_gguf["job"]), ternary_from_gguf["inputs"],
                        _workdir(tmp_path, "cal"))
    assert cal.metrics["source_kind"] == "gguf-source"
    inputs = {
        **ternary_from_gguf["inputs"],
        **{f"calibrate/{o.name}": _input(f"calibrate/{o.name}", o.path) for o in cal.outputs},
        "package/model.gguf": _input("package/model.gguf", ternary_from_gguf["gguf"]),
    }
    try:
        metrics = validate.run(validate.make_params(ternary_from_gguf["job"]), inputs,
                               _workdir(tmp_path, "val")).metrics
    except validate.ValidationFailed as exc:
        metrics = exc.metrics
    assert metrics["source"]["kind"] == "gguf-source" and metrics["source"]["error"] is None
    agreement = metrics["details"]["agreement"]
    assert 0.0 <= agreement["top1_agreement"] <= 1.0 and agreement["mean_kl"] >= 0.0
    assert metrics["checks"]["loads"] == "pass" and metrics["checks"]["tensor_types"] == "pass"
