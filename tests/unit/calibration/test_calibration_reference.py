"""The source reference (computed once) scores a candidate as `judge.agreement_stats` does.

Top-1 agreement, both log-perplexities and the uniform yardstick are exact; mean KL is the exact
top-k part plus an unbiased estimate of the tail part from stored draws, and the coarsened
top-k KL is a lower bound; both meet the exact KL when k covers the vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from pipeline.calibration.agreement import ReferenceScorer, score_gguf
from pipeline.calibration.reference import ReferenceBuilder, read_reference, write_reference
from pipeline.calibration.sequences import TokenSequences
from pipeline.core.errors import InputError, IntegrityError
from pipeline.stages.validate.judge import agreement_stats

_N_VOCAB = 300


def _logits(seed: int, n: int, sharpness: float) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, _N_VOCAB)) * sharpness).astype(np.float32)


def _case(top_k: int, n: int = 40) -> tuple[TokenSequences, np.ndarray, np.ndarray, ReferenceScorer]:
    rng = np.random.default_rng(7)
    ids = tuple(int(t) for t in rng.integers(0, _N_VOCAB, n))
    seqs = TokenSequences(("text",), (ids,))
    source = _logits(1, n, 3.0)
    candidate = source + _logits(2, n, 0.8)  # a perturbed model: KL around 0.3 nats
    builder = ReferenceBuilder(seqs, top_k=top_k, tail_samples=64)
    builder.add(0, source)
    scorer = ReferenceScorer(builder.build())
    scorer.add(0, candidate)
    return seqs, source, candidate, scorer


def test_estimate_matches_judge_and_the_coarse_kl_bounds_it() -> None:
    seqs, source, candidate, scorer = _case(top_k=16, n=400)
    exact = agreement_stats(source, candidate, list(seqs.ids[0]))
    got = scorer.result()
    assert got.stats.n_positions == exact.n_positions == 399
    assert got.stats.top1_agreement == exact.top1_agreement
    for field in ("source_nll", "candidate_nll", "uniform_kl"):
        assert getattr(got.stats, field) == pytest.approx(getattr(exact, field), abs=2e-5), field
    assert 0.0 < got.mean_kl_lower < exact.mean_kl  # a real gap: ~half the mass is outside the top 16
    assert 0.05 < got.mean_tail_mass < 0.5 and (got.top_k, got.tail_samples) == (16, 64)
    # The draws close it: unbiased, with noise that averages out over the positions.
    assert abs(got.stats.mean_kl - exact.mean_kl) < 4 * got.mean_kl_stderr + 1e-6
    assert got.mean_kl_stderr < 0.02 * exact.mean_kl
    assert abs(got.stats.mean_kl - exact.mean_kl) < 0.2 * (exact.mean_kl - got.mean_kl_lower)


def test_top_k_covering_the_vocabulary_is_exact() -> None:
    seqs, source, candidate, scorer = _case(top_k=_N_VOCAB)
    exact = agreement_stats(source, candidate, list(seqs.ids[0]))
    got = scorer.result()
    assert got.mean_tail_mass == 0.0
    assert got.mean_kl_lower == pytest.approx(exact.mean_kl, rel=1e-4, abs=1e-6)
    for key, value in asdict(exact).items():
        assert asdict(got.stats)[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_reference_round_trip_and_selection(tmp_path: Path) -> None:
    seqs = TokenSequences(
        ("calibration", "calibration", "agreement"), ((1, 5, 9, 4), (1, 7, 8), (1, 2, 3, 6, 6))
    )
    builder = ReferenceBuilder(seqs, top_k=8)
    for index, ids in enumerate(seqs.ids):
        builder.add(index, _logits(10 + index, len(ids), 2.0))
    ref = builder.build({"source_sha256": "ab" * 32})
    back = read_reference(write_reference(tmp_path / "reference.npz", ref))
    assert back.sequences == seqs and back.info == {"source_sha256": "ab" * 32}
    assert (back.n_vocab, back.top_k) == (_N_VOCAB, 8)
    for name in ("topk_ids", "topk_logprobs", "tail_logprob", "tail_ids", "tail_logprobs", "entropy"):
        np.testing.assert_array_equal(getattr(back, name), getattr(ref, name))
    assert back.topk_ids.shape == (3 + 2 + 4, 8) and back.tail_ids.shape == (9, 64)
    again = ReferenceBuilder(seqs, top_k=8)  # same logits, same seed: the same draws
    for index, ids in enumerate(seqs.ids):
        again.add(index, _logits(10 + index, len(ids), 2.0))
    np.testing.assert_array_equal(again.build().tail_ids, ref.tail_ids)
    scorer = ReferenceScorer(back, names=["agreement"])
    scorer.add(2, _logits(12, 5, 2.0))  # the source itself: full agreement, no divergence
    result = scorer.result()
    assert result.stats.n_positions == 4 and result.stats.top1_agreement == 1.0
    assert result.stats.mean_kl == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(InputError, match="no sequences of text"):
        ReferenceScorer(back, names=["held-out"])
    with pytest.raises(IntegrityError, match="no candidate logits for sequence"):
        ReferenceScorer(back).result()
    with pytest.raises(IntegrityError, match="logits"):
        builder.add(0, _logits(1, 3, 1.0))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(IntegrityError, match="not a readable source reference"):
        read_reference(tmp_path / "junk.npz")


@pytest.mark.llama
def test_scoring_a_llama_cpp_candidate_matches_judge(tmp_path: Path) -> None:
    """A Q4_0 requantization of the tiny llama, scored from the stored reference and from full logits."""
    from conftest import card_for_checkpoint, package_inputs
    from llama_cpp import llama_cpp as lib

    from pipeline.calibration.llama_session import LlamaSession
    from pipeline.calibration.sequences import tokenize_texts
    from pipeline.calibration.text import builtin_text
    from pipeline.demo import write_demo_checkpoint
    from pipeline.stages import package
    from pipeline.stages.base import JobSpec

    checkpoint = write_demo_checkpoint(tmp_path / "ck")
    card = card_for_checkpoint(checkpoint)
    inputs = package_inputs(checkpoint, card, tmp_path, ternary="F32")
    (tmp_path / "work").mkdir()
    source = (
        package.run(package.make_params(JobSpec(source="demo")), inputs, tmp_path / "work").outputs[0].path
    )
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.nthread = 2, 2  # LLAMA_FTYPE_MOSTLY_Q4_0
    candidate = tmp_path / "q4_0.gguf"
    assert lib.llama_model_quantize(str(source).encode(), str(candidate).encode(), params) == 0
    ids = list(tokenize_texts(source, {"text": builtin_text()}, n_ctx=256).ids[0])
    seqs = TokenSequences(("text",), (tuple(ids),))
    with LlamaSession(source, n_ctx=256) as session:
        source_logits = np.array(session.logits(ids))
    with LlamaSession(candidate, n_ctx=256) as session:
        candidate_logits = np.array(session.logits(ids))
    exact = agreement_stats(source_logits, candidate_logits, ids)
    for top_k in (32, 512):
        builder = ReferenceBuilder(seqs, top_k=top_k)
        builder.add(0, source_logits)
        got = score_gguf(candidate, builder.build())
        assert got.stats.top1_agreement == exact.top1_agreement
        assert got.stats.candidate_nll == pytest.approx(exact.candidate_nll, abs=1e-4)
        assert got.mean_kl_lower <= exact.mean_kl + 1e-6
        assert abs(got.stats.mean_kl - exact.mean_kl) < 4 * got.mean_kl_stderr + 1e-6
        if top_k == 512:  # the whole vocabulary: both are the KL
            assert got.mean_kl_lower == pytest.approx(exact.mean_kl, rel=1e-3, abs=1e-6)
