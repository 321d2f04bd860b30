"""Both collectors give the same statistics: llama.cpp's eval callback and the block-streaming torch forward.

A tiny demo checkpoint of each architecture is packaged as an all-F32 GGUF and llama.cpp runs it
with an F32 KV cache, so both sides compute in float32 and agree to float rounding. The torch
forward is also checked against the independent HF-layout forward of `tests/support`, and its
weight reader against the packager's `iter_tensors`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import card_for_checkpoint, package_inputs
from support.reference_forward import reference_logits

from pipeline.calibration.gram import GramFile
from pipeline.calibration.reference import ReferenceBuilder
from pipeline.calibration.sequences import TokenSequences, tokenize_texts
from pipeline.calibration.stats import ActivationStats
from pipeline.calibration.text import builtin_text
from pipeline.calibration.torch_collect import collect_with_torch
from pipeline.calibration.torch_model import (
    CheckpointTensors,
    block_forward,
    blocks_forward,
    head_logits,
    model_spec,
)
from pipeline.demo import write_demo_checkpoint
from pipeline.formats.hf.checkpoint import iter_tensors
from pipeline.formats.model_card import ModelCard

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "bitnet")
_TEXT_CHARS = 1500
_RTOL = 2e-6  # float32 on both sides, summed in different orders


def _files(checkpoint: Path, card: dict[str, Any]) -> dict[str, Path]:
    return {shard: checkpoint / shard for shard in card["shards"]}


def _f32_gguf(checkpoint: Path, card: dict[str, Any], tmp: Path) -> Path:
    from pipeline.stages import package
    from pipeline.stages.base import JobSpec

    inputs = package_inputs(checkpoint, card, tmp, ternary="F32")
    (tmp / "work").mkdir()
    return package.run(package.make_params(JobSpec(source="demo")), inputs, tmp / "work").outputs[0].path


@pytest.mark.parametrize("architecture", ["llama", "bitnet"])
def test_checkpoint_reader_equals_the_packagers_stream(architecture: str, tmp_path: Path) -> None:
    checkpoint = write_demo_checkpoint(tmp_path / "ck", architecture=architecture)
    card = card_for_checkpoint(checkpoint)
    with CheckpointTensors(ModelCard.from_dict(card), _files(checkpoint, card)) as ckpt:
        for shard in card["shards"]:
            for name, tensor in iter_tensors(ModelCard.from_dict(card), _files(checkpoint, card), shard):
                torch.testing.assert_close(ckpt.get(name), tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_torch_forward_equals_the_hf_layout_reference(architecture: str, tmp_path: Path) -> None:
    checkpoint = write_demo_checkpoint(tmp_path / "ck", architecture=architecture)
    card = card_for_checkpoint(checkpoint)
    ids = [3, 17, 250, 9, 400, 77, 5, 123]
    spec = model_spec(ModelCard.from_dict(card))
    # The graph's arithmetic in float32; what llama.cpp rounds a BF16 weight's inputs to is checked apart.
    assert spec.matmul_dtype is torch.bfloat16
    spec = dataclasses.replace(spec, matmul_dtype=None)
    model = ModelCard.from_dict(card)
    with torch.inference_mode(), CheckpointTensors(model, _files(checkpoint, card)) as ckpt:
        x = ckpt.get("token_embd.weight")[torch.tensor(ids)]
        for index in range(spec.n_layers):
            x = block_forward(spec, ckpt.block(index), x)
        head = ckpt.get("output.weight" if ckpt.has("output.weight") else "token_embd.weight")
        logits = head_logits(spec, ckpt.get("output_norm.weight"), head, x).numpy()
    np.testing.assert_allclose(logits, reference_logits(checkpoint, ids), rtol=1e-4, atol=1e-5)


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


@pytest.mark.llama
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_both_collectors_give_the_same_statistics(architecture: str, tmp_path: Path) -> None:
    from pipeline.calibration.llama_collect import collect_with_llama_cpp

    checkpoint = write_demo_checkpoint(tmp_path / "ck", architecture=architecture)
    card = card_for_checkpoint(checkpoint)
    gguf_path = _f32_gguf(checkpoint, card, tmp_path)
    seqs = tokenize_texts(gguf_path, {"calibration": builtin_text()[:_TEXT_CHARS]}, n_ctx=96)
    assert len(seqs.ids) >= 3 and all(len(s) <= 96 for s in seqs.ids)
    with_gram = architecture == "llama"  # Gram files once; the sums for every architecture
    sides = []
    for engine in ("llama.cpp", "torch"):
        stats = ActivationStats(gram_for=lambda name: with_gram)
        builder = ReferenceBuilder(seqs, top_k=16)
        gram_dir = tmp_path / f"gram-{engine}"
        if engine == "llama.cpp":
            report = collect_with_llama_cpp(
                gguf_path, seqs, stats, reference=builder, gram_dir=gram_dir, is_f32_cache=True
            )
        else:
            report = collect_with_torch(
                ModelCard.from_dict(card), _files(checkpoint, card), seqs, stats, reference=builder,
                gram_dir=gram_dir, as_stored=False,  # llama.cpp runs the F32 GGUF here
            )
        assert report.n_tokens == seqs.n_tokens and report.n_weights == 14  # 7 linears x 2 blocks
        sides.append((stats, builder.build(), gram_dir))
    (ours, ref_a, dir_a), (theirs, ref_b, dir_b) = sides
    assert ours.names() and sorted(ours.names()) == sorted(theirs.names())
    for name in ours.names():
        assert ours[name].counts.tolist() == theirs[name].counts.tolist() == [seqs.n_tokens]
        assert _relative_gap(ours[name].sum_sq, theirs[name].sum_sq) < _RTOL, name
    if with_gram:
        files = sorted(p.name for p in dir_a.iterdir())
        assert files == ["blk.0.safetensors", "blk.1.safetensors"] == sorted(p.name for p in dir_b.iterdir())
        for file_name in files:
            a, b = GramFile(dir_a / file_name), GramFile(dir_b / file_name)
            for name in a.names():
                assert _relative_gap(a.read(name)[0], b.read(name)[0]) < _RTOL, name
    # The reference answers agree too: same most likely tokens, log-probs to float32 rounding.
    assert (ref_a.topk_ids[:, 0] == ref_b.topk_ids[:, 0]).mean() > 0.99
    np.testing.assert_allclose(ref_a.entropy, ref_b.entropy, atol=1e-4)
    np.testing.assert_allclose(ref_a.target_logprob, ref_b.target_logprob, atol=1e-4)


def test_torch_collector_refuses_ids_outside_the_vocabulary(tmp_path: Path) -> None:
    from pipeline.core.errors import InputError

    checkpoint = write_demo_checkpoint(tmp_path / "ck")
    card = card_for_checkpoint(checkpoint)
    seqs = TokenSequences(("x",), ((1, 2, 10_000),))
    with pytest.raises(InputError, match="token id 10000 is outside the checkpoint's 512-token embedding"):
        collect_with_torch(ModelCard.from_dict(card), _files(checkpoint, card), seqs, ActivationStats())


@pytest.mark.llama
def test_a_run_for_some_weights_stops_early_and_gets_the_same_sums(tmp_path: Path) -> None:
    from pipeline.calibration.llama_collect import collect_with_llama_cpp

    checkpoint = write_demo_checkpoint(tmp_path / "ck")
    card = card_for_checkpoint(checkpoint)
    gguf_path = _f32_gguf(checkpoint, card, tmp_path)
    seqs = tokenize_texts(gguf_path, {"calibration": builtin_text()[:800]}, n_ctx=96)
    full, some = ActivationStats(), ActivationStats()
    collect_with_llama_cpp(gguf_path, seqs, full)
    wanted = ["blk.0.attn_output.weight", "blk.1.attn_q.weight"]
    collect_with_llama_cpp(gguf_path, seqs, some, weights=wanted)
    assert sorted(some.names()) == sorted(wanted)
    for name in wanted:
        torch.testing.assert_close(some[name].sum_sq, full[name].sum_sq, rtol=0, atol=0)
        assert some[name].counts.tolist() == full[name].counts.tolist()


@pytest.mark.llama
@pytest.mark.parametrize("architecture", ["llama", "mistral"])  # byte-level BPE and SentencePiece
def test_an_hf_source_tokenizes_through_its_vocab_only_gguf(architecture: str, tmp_path: Path) -> None:
    """Before any GGUF of an HF source exists, a vocabulary-only one gives the packaged file's ids."""
    from pipeline.calibration.sequences import write_vocab_gguf

    checkpoint = write_demo_checkpoint(tmp_path / "ck", architecture=architecture)
    card = card_for_checkpoint(checkpoint)
    files = {p.name: p for p in checkpoint.iterdir()}
    vocab_only = write_vocab_gguf(ModelCard.from_dict(card), files, tmp_path / "vocab.gguf")
    texts = {"calibration": builtin_text()[:1200], "other": "Zwei Sätze. 二つ目。"}
    packaged = _f32_gguf(checkpoint, card, tmp_path)
    assert tokenize_texts(vocab_only, texts, n_ctx=64) == tokenize_texts(packaged, texts, n_ctx=64)


def test_calibration_imports_no_orchestration() -> None:
    import subprocess
    import sys

    code = (
        "import sys, importlib\n"
        "for m in ('text', 'sequences', 'stats', 'gram', 'imatrix', 'llama_collect', 'torch_collect',"
        " 'reference', 'agreement'):\n"
        "    importlib.import_module('pipeline.calibration.' + m)\n"
        "import pipeline.ternary.gptq\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('celery', 'sqlalchemy', 'kombu', 'redis'))))\n"
    )
    root = Path(__file__).resolve().parents[3]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def _moe_gguf(dense: Path, dest: Path, n_expert: int = 4, n_used: int = 2) -> Path:
    """The dense F32 demo turned into a mixture of experts (llama.cpp's llama graph with experts):
    each block's feed-forward replaced by a router and ``n_expert`` random experts."""
    import gguf

    from pipeline.formats.gguf.reader import GGUFFile
    from pipeline.formats.gguf.writer import TensorToWrite, Typed, write_gguf

    source = GGUFFile(dense)
    meta = {k: f.typed() for k, f in source.fields.items() if not k.startswith("GGUF.") and len(f.data)}
    arch = str(meta.pop("general.architecture").value, "utf-8")
    meta["llama.expert_count"] = Typed(n_expert, gguf.GGUFValueType.UINT32)
    meta["llama.expert_used_count"] = Typed(n_used, gguf.GGUFValueType.UINT32)
    gen = torch.Generator().manual_seed(3)
    f32 = gguf.GGMLQuantizationType.F32
    tensors = []
    for tensor in source.tensors:
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if kind not in ("ffn_gate", "ffn_up", "ffn_down"):
            tensors.append(
                TensorToWrite(tensor.name, tensor.tensor_type, shape, lambda t=tensor: np.asarray(t.data))
            )
            continue
        prefix = tensor.name.rsplit(".", 2)[0]
        stacked = (torch.randn((n_expert, *shape), generator=gen) * 0.06).numpy()
        tensors.append(TensorToWrite(f"{prefix}.{kind}_exps.weight", f32, stacked.shape, lambda a=stacked: a))
        if kind == "ffn_gate":
            router = (torch.randn((n_expert, shape[1]), generator=gen) * 0.5).numpy()
            tensors.append(
                TensorToWrite(f"{prefix}.ffn_gate_inp.weight", f32, router.shape, lambda a=router: a)
            )
    return write_gguf(dest, arch, meta, tensors).path


@pytest.mark.llama
def test_expert_products_are_counted_per_routed_expert(tmp_path: Path) -> None:
    """MUL_MAT_ID: every token reaches ``n_used`` experts, and the experts' sums add up to ``n_used``
    times the router's (a plain product on the same input)."""
    from pipeline.calibration.imatrix import Imatrix, read_imatrix, write_imatrix
    from pipeline.calibration.llama_collect import collect_with_llama_cpp

    checkpoint = write_demo_checkpoint(tmp_path / "ck")
    card = card_for_checkpoint(checkpoint)
    moe = _moe_gguf(_f32_gguf(checkpoint, card, tmp_path), tmp_path / "moe.gguf")
    seqs = tokenize_texts(moe, {"calibration": builtin_text()[:800]}, n_ctx=96)
    stats = ActivationStats()
    collect_with_llama_cpp(moe, seqs, stats)
    n = seqs.n_tokens
    for block in (0, 1):
        router = stats[f"blk.{block}.ffn_gate_inp.weight"]
        assert router.counts.tolist() == [n]
        for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            entry = stats[f"blk.{block}.{kind}.weight"]
            assert entry.sum_sq.shape[0] == 4 and int(entry.counts.sum()) == 2 * n, kind
            assert int((entry.counts > 0).sum()) >= 2  # the router spreads tokens over experts
        for kind in ("ffn_gate_exps", "ffn_up_exps"):
            summed = stats[f"blk.{block}.{kind}.weight"].sum_sq.sum(dim=0)
            torch.testing.assert_close(summed, 2 * router.sum_sq[0], rtol=1e-5, atol=1e-6)
    back = read_imatrix(
        write_imatrix(tmp_path / "moe.imatrix.gguf", Imatrix.from_stats(stats, ("moe",), 96, 1))
    )
    sums, counts = back.entries["blk.0.ffn_down_exps.weight"]
    assert sums.shape == (4, 512) and counts.tolist() == stats["blk.0.ffn_down_exps.weight"].counts.tolist()


@pytest.mark.llama
def test_sequences_outside_stats_for_reach_the_reference_only(tmp_path: Path) -> None:
    """An agreement text must be in the reference and never in the statistics, on both engines."""
    from pipeline.calibration.llama_collect import collect_with_llama_cpp

    checkpoint = write_demo_checkpoint(tmp_path / "ck")
    card = card_for_checkpoint(checkpoint)
    gguf_path = _f32_gguf(checkpoint, card, tmp_path)
    texts = {"calibration": builtin_text()[:600], "agreement": "A short text to agree on."}
    seqs = tokenize_texts(gguf_path, texts, n_ctx=96)
    counted = seqs.select(["calibration"])
    n_counted = sum(len(seqs.ids[i]) for i in counted)
    assert 0 < n_counted < seqs.n_tokens
    for engine in ("llama.cpp", "torch"):
        stats, builder = ActivationStats(), ReferenceBuilder(seqs, top_k=8)
        if engine == "llama.cpp":
            collect_with_llama_cpp(gguf_path, seqs, stats, reference=builder, stats_for=counted)
        else:
            collect_with_torch(
                ModelCard.from_dict(card), _files(checkpoint, card), seqs, stats, reference=builder,
                stats_for=counted,
            )
        assert set(stats.token_counts().values()) == {n_counted}, engine
        assert builder.build().topk_ids.shape[0] == seqs.n_predicted


def test_several_sequences_at_once_equal_one_at_a_time_and_read_each_tensor_once(tmp_path: Path) -> None:
    checkpoint = write_demo_checkpoint(tmp_path / "ck")
    document = card_for_checkpoint(checkpoint)
    card = ModelCard.from_dict(document)
    spec = model_spec(card)
    seqs = [[3, 17, 250, 9], [400, 77], [5, 123, 6, 7, 8]]
    with torch.inference_mode(), CheckpointTensors(card, _files(checkpoint, document)) as ckpt:
        embedding = ckpt.get("token_embd.weight")
        xs = [embedding[torch.tensor(ids)] for ids in seqs]
        alone_stats, together_stats = ActivationStats(), ActivationStats()
        alone = [block_forward(spec, ckpt.block(0, as_stored=True), x, on_input=alone_stats.add)
                 for i, x in enumerate(xs) if i != 1] 
        reads: list[str] = []
        real_get = ckpt.get
        ckpt.get = lambda name, as_stored=False: reads.append(name) or real_get(name, as_stored)  # type: ignore[method-assign]
        together = blocks_forward(spec, ckpt.lazy_block(0), xs, on_input=together_stats.add,
                                  counted=[True, False, True])
    assert len(reads) == len(set(reads)) == len(list(ckpt.lazy_block(0))), "each tensor read once"
    for got, want in zip([together[0], together[2]], alone, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert together[1].shape == xs[1].shape
    for name in alone_stats.names():  # the uncounted sequence adds nothing to the statistics
        assert together_stats[name].counts.tolist() == alone_stats[name].counts.tolist()
        torch.testing.assert_close(together_stats[name].sum_sq, alone_stats[name].sum_sq, rtol=1e-6,
                                   atol=1e-9)
