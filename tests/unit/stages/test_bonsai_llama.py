"""Q2_0 / Q1_0 against llama.cpp itself: its quantizer's bytes, its decoder, and a packed model's logits.

1. An F32 GGUF of a small Llama goes through llama.cpp's own ``llama_model_quantize`` to Q2_0
   and to Q1_0. Our packing of llama.cpp's rule (Q2_0: d = max|w|; Q1_0: d = mean|w|) applied
   to the same F32 weights gives its bytes exactly, our decoder reads its bytes as its own
   ``to_float`` does, and its ``general.file_type`` is the one our package stage writes.
2. The real decompose (q2_0 / q1_0 recipes) + package output loads in llama.cpp, and its
   logits match a plain-torch forward (`tests.support.reference_forward`) of the weights the
   file decodes to (read back with llama.cpp's decoder, q/k rows returned to the HF layout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import card_for_checkpoint, package_inputs
from safetensors.torch import load_file, save_file

from pipeline.core.files import sha256_file
from pipeline.demo import write_demo_checkpoint
from pipeline.formats.decompose_report import DecomposeReport
from pipeline.formats.gguf.keys import General
from pipeline.formats.gguf.readback import inspect_gguf
from pipeline.formats.gguf.reader import GGUFFile
from pipeline.formats.gguf.types import BONSAI_TYPES
from pipeline.formats.hf.checkpoint import rope_permute
from pipeline.stages import decompose, package
from pipeline.stages.base import InputFile, JobSpec
from pipeline.stages.inspect import SUPPORTED_ARCHITECTURES
from pipeline.stages.validate import file_checks
from pipeline.ternary.codecs import codec_for
from pipeline.ternary.fit_q import fit_q1_0, fit_q1_0_absmean, fit_q2_0, fit_q2_0_absmax
from tests.support import ggml_ref
from tests.support.reference_forward import reference_logits

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = [
    pytest.mark.llama,
    pytest.mark.skipif(not ggml_ref.available(), reason="llama-cpp-python's libggml-base is not loadable"),
]

_PROMPT = b"1+1=2, 2+2=4 and the quick brown fox jumps"
# llama.cpp multiplies Q2_0 / Q1_0 weights with activations rounded to 8 bits per 32 (Q8_0):
# measured ~1% of the largest logit on this model; a layout mistake costs tens of percent.
_TOLERANCE = 0.05
_HF_LINEARS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _input(key: str, path: Path) -> tuple[str, InputFile]:
    return key, InputFile(key.split("/", 1)[1], path, sha256_file(path), path.stat().st_size)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The demo Llama with Gaussian noise on its linears (so fits are lossy), its card and an F32 GGUF."""
    tmp = tmp_path_factory.mktemp("bonsai")
    checkpoint = write_demo_checkpoint(tmp / "checkpoint", architecture="llama")
    tensors = load_file(str(checkpoint / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if any(f".{hf}." in name for hf in _HF_LINEARS.values()):
            noise = torch.randn(t.shape, generator=gen) * t.float().abs().mean()
            tensors[name] = (t.float() + 0.5 * noise).to(t.dtype)
    (checkpoint / "model.safetensors").unlink()
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    card = card_for_checkpoint(checkpoint)
    card["architecture"] = SUPPORTED_ARCHITECTURES[card["hf_architecture"]]
    (tmp / "f32").mkdir()
    inputs = package_inputs(checkpoint, card, tmp / "f32", ternary="F32")
    (tmp / "f32" / "out").mkdir()
    f32 = package.run(package.make_params(JobSpec(source="local/noisy")), inputs, tmp / "f32" / "out")
    return {"tmp": tmp, "checkpoint": checkpoint, "card": card, "f32": f32.outputs[0].path}


def _quantize(src: Path, dst: Path, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) == 0


@pytest.mark.parametrize(("ggml_name", "ftype"), [("Q2_0", 41), ("Q1_0", 40)])
def test_llama_cpp_quantizer_bytes_are_our_packing_of_its_rule(
    model: dict[str, Any], ggml_name: str, ftype: int
) -> None:
    assert BONSAI_TYPES[ggml_name].file_type_id == ftype  # llama.h: LLAMA_FTYPE_MOSTLY_Q2_0 = 41, Q1_0 = 40
    dst = model["tmp"] / f"llama-{ggml_name}.gguf"
    _quantize(model["f32"], dst, ftype)
    source = {t.name: np.asarray(t.data, dtype=np.float32) for t in GGUFFile(model["f32"]).tensors}
    quantized = GGUFFile(dst)
    assert quantized.get_field(General.FILE_TYPE).contents() == ftype
    checked = []
    for tensor in quantized.tensors:
        if tensor.tensor_type.name != ggml_name:
            continue
        theirs = np.asarray(tensor.data).reshape(-1)
        w = torch.from_numpy(source[tensor.name].reshape(-1, BONSAI_TYPES[ggml_name].block_size).copy())
        fitted = fit_q2_0_absmax(w) if ggml_name == "Q2_0" else fit_q1_0_absmean(w)
        ours = codec_for(ggml_name).pack(*fitted)
        np.testing.assert_array_equal(ours, theirs, err_msg=tensor.name)
        decoded = codec_for(ggml_name).dequantize(theirs)
        reference = ggml_ref.dequantize(theirs, BONSAI_TYPES[ggml_name].type_id, decoded.size)
        np.testing.assert_array_equal(decoded.view(np.uint32), reference.view(np.uint32), err_msg=tensor.name)
        checked.append(tensor.name)
    linears = {f"blk.{i}.{kind}.weight" for i in range(2) for kind in _HF_LINEARS}
    assert linears <= set(checked)  # every block linear of the 2 layers (and what else it chose)


def _convert(model: dict[str, Any], recipe: str, options: dict[str, Any], tag: str) -> tuple[Path, Any]:
    tmp = model["tmp"] / tag
    tmp.mkdir()
    card_path = tmp / "model_card.json"
    card_path.write_text(json.dumps(model["card"]), encoding="utf-8")
    inputs = dict(_input(f"download/{p.name}", p) for p in sorted(model["checkpoint"].iterdir()))
    inputs.update([_input("inspect/model_card.json", card_path)])
    job = JobSpec(source="local/noisy", recipe=recipe, options={"device": "cpu", **options})
    (tmp / "decompose").mkdir()
    result = decompose.run(decompose.make_params(job), inputs, tmp / "decompose")
    parts = dict(_input(f"decompose/{o.name}", o.path) for o in result.outputs if o.kind == "ternary-part")
    (tmp / "package").mkdir()
    packaged = package.run(package.make_params(job), {**inputs, **parts}, tmp / "package")
    return packaged.outputs[0].path, packaged


def _decoded_checkpoint(path: Path, model: dict[str, Any], dest: Path) -> Path:
    """An HF checkpoint holding what the GGUF decodes to: linears by llama.cpp's decoder, rows of
    q/k put back in HF order, embeddings and head rounded as stored (F16), norms as they are."""
    config = json.loads((model["checkpoint"] / "config.json").read_text())
    tensors = {k: v.float() for k, v in load_file(str(model["checkpoint"] / "model.safetensors")).items()}
    for tensor in GGUFFile(path).tensors:
        parts = tensor.name.split(".")
        if parts[0] != "blk" or parts[2] not in _HF_LINEARS:
            continue
        hf_name = f"model.layers.{parts[1]}.{_HF_LINEARS[parts[2]]}.weight"
        shape = tensors[hf_name].shape
        raw = np.asarray(tensor.data).reshape(-1)
        decoded = ggml_ref.dequantize(raw, int(tensor.tensor_type), shape.numel())
        values = torch.from_numpy(decoded).reshape(shape)
        if parts[2] in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if parts[2] == "attn_q" else "num_key_value_heads"]
            unpermuted = torch.empty_like(values)
            unpermuted[rope_permute(torch.arange(shape[0]), heads)] = values
            values = unpermuted
        tensors[hf_name] = values
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = tensors[name].half().float()
    dest.mkdir()
    (dest / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _llama_logits(path: Path) -> tuple[list[int], np.ndarray]:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False, seed=0)
    ids = llm.tokenize(_PROMPT, add_bos=True)
    llm.eval(ids)
    return ids, np.asarray(llm.scores[: len(ids)])


@pytest.mark.parametrize(
    ("recipe", "options", "ggml_name"),
    [("q2_0", {}, "Q2_0"), ("q2_0", {"levels": 4}, "Q2_0"), ("q1_0", {}, "Q1_0")],
)
def test_packed_model_logits_match_torch_on_its_decoded_weights(
    model: dict[str, Any], recipe: str, options: dict[str, Any], ggml_name: str
) -> None:
    tag = f"{recipe}-{options.get('levels', 3)}"
    path, packaged = _convert(model, recipe, options, tag)
    assert packaged.metrics["types"][ggml_name] == 14
    assert packaged.metrics["file_type"] == BONSAI_TYPES[ggml_name].file_type_name
    assert GGUFFile(path).get_field(General.FILE_TYPE).contents() == BONSAI_TYPES[ggml_name].file_type_id
    report = DecomposeReport.load(path.parents[1] / "decompose" / "report.json")
    summary = inspect_gguf(path)
    assert file_checks.check_types(summary, ggml_name, report).verdict == "pass"
    assert file_checks.check_bits_per_weight(summary, ggml_name, report).verdict == "pass"
    sparsity = file_checks.check_sparsity(path, report)
    assert sparsity.verdict == ("pass" if ggml_name == "Q2_0" else "warn"), sparsity.reason  # Q1_0: binary
    decoded = _decoded_checkpoint(path, model, model["tmp"] / f"{tag}-decoded")
    # What llama.cpp decodes is what our fit chose, row by row, in the HF layout.
    fitted = load_file(str(decoded / "model.safetensors"))
    source = load_file(str(model["checkpoint"] / "model.safetensors"))
    block = BONSAI_TYPES[ggml_name].block_size
    for hf in (f"model.layers.{i}.{name}.weight" for i in range(2) for name in _HF_LINEARS.values()):
        blocks = source[hf].float().reshape(-1, block)
        if ggml_name == "Q1_0":
            codes, scales = fit_q1_0(blocks)
        else:
            codes, scales = fit_q2_0(blocks, levels=options.get("levels", 3))
        expected_values = (codes.float() * scales[:, None]).reshape(source[hf].shape)
        assert torch.equal(fitted[hf], expected_values), hf
    ids, got = _llama_logits(path)
    expected = reference_logits(decoded, ids)
    scale = np.abs(expected).max()
    diff = np.abs(got - expected).max() / scale
    original = np.abs(got - reference_logits(model["checkpoint"], ids)).max() / scale
    print(f"{tag}: max |llama.cpp - torch(decoded)| = {diff:.2%} of the largest logit; "
          f"against the unquantized weights {original:.1%}")
    assert diff < _TOLERANCE
    # The greedy token must agree wherever torch's top two are further apart than the difference.
    top2 = np.sort(expected, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * diff * scale
    assert clear.sum() >= 5
    np.testing.assert_array_equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
    assert original > 2 * diff  # the fit is lossy: the test compares against the decoded weights
