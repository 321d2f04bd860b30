"""Calibrate stage: run the source model once, keep its answers and, when asked, its activation statistics.

Inputs: ``inspect/model_card.json`` and the ``download/*`` files. The source runs in llama.cpp: a
GGUF source as it is, an HF checkpoint as a 16-bit GGUF written into the work folder for the run
and deleted after (`source_gguf`). Outputs (`answers` names them):

- ``reference.npz`` always: the source's greedy answers to validate's prompts and its next-token
  log-probs (top-k and tail draws, `calibration.reference`) on the agreement text; validate scores
  the conversion against it and never runs the source itself;
- with ``importance=imatrix`` or ``method=gptq``: the source also runs over the calibration text
  (built-in, or the job's ``calibration_text``; never the agreement text, whose passages it must not
  contain), and ``imatrix.gguf`` (llama.cpp's imatrix format: per block weight the sums of x² per
  input column and the token counts) is written; the reference then covers the calibration text too;
- with ``method=gptq``: ``gram/blk.<i>.safetensors``, the input Gram matrices XᵀX of every block
  linear weight (`calibration.gram`).

The result depends on the source's bytes, the texts and these options only: the cache key covers
exactly those, so every job on the same source with the same options reuses one calibration.
The statistics come from llama.cpp's eval callback in this process (`calibration.llama_collect`);
the answers from validate's probe in a child process (a source that crashes llama.cpp fails this
stage, not the worker).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.calibration.answers import (
    AGREEMENT,
    CALIBRATION,
    GRAM_PREFIX,
    IMATRIX_NAME,
    REFERENCE_NAME,
    SourceAnswers,
    request_key,
)
from pipeline.calibration.probe import ProbeProcess, ProbeResult
from pipeline.calibration.sequences import TokenSequences
from pipeline.calibration.text import text_sha256
from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.model_card import CARD_NAME, ModelCard
from pipeline.stages.base import (
    NO_CLIENTS,
    InputFile,
    MemoryNeed,
    OutputFile,
    StageClients,
    StageResult,
    input_size,
    inputs_of,
)
from pipeline.stages.calibrate.engines import EngineChoice, choose_engine
from pipeline.stages.calibrate.params import Params, make_params
from pipeline.ternary.policy import LINEAR_KINDS

if TYPE_CHECKING:
    # torch-backed: imported after the source has started running, while a background warm-up
    # may still be loading torch (an embedded job's calibrate never waits for it up front).
    from pipeline.calibration.llama_collect import CollectReport
    from pipeline.calibration.reference import ReferenceBuilder, SourceReference
    from pipeline.calibration.stats import ActivationStats

__all__ = ["NAME", "VERSION", "Params", "make_params", "memory_need", "run"]

NAME = "calibrate"
VERSION = "1"

log = logging.getLogger(__name__)
_LINEAR = re.compile(r"^blk\.\d+\.(" + "|".join(LINEAR_KINDS) + r")\.weight$")


def memory_need(params: Params, inputs: Mapping[str, InputFile]) -> MemoryNeed | None:
    """The source's run: llama.cpp holds the whole source (a 16-bit copy of a safetensors one), torch
    one block at a time (`engines`); plus room for the context and Python."""
    card_item = inputs.get(f"inspect/{CARD_NAME}")
    if card_item is None:
        return None
    card = ModelCard.load(card_item.path, f"inspect/{CARD_NAME}")
    choice = choose_engine(card, params.engine, input_size(inputs, "download/"), _longest_sequence(params))
    return MemoryNeed(choice.need_bytes, choice.why)


def _longest_sequence(params: Params) -> int:
    return max(params.probe.n_ctx, params.calibration_ctx if params.is_statistics else 0)


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _source_path(card: ModelCard, download: Mapping[str, Path], workdir: Path) -> tuple[Path, str]:
    if card.is_gguf:
        shard = card.shards[0] if card.shards else ""
        if shard not in download:
            raise InputError(f"calibrate: the source file {shard!r} is not among the download's files")
        return download[shard], "gguf-source"
    from pipeline.stages.calibrate.source_gguf import write_source_gguf

    return write_source_gguf(card, download, workdir / ".source.gguf"), "hf-16bit"


def _empty_reference(n_vocab: int, params: Params) -> SourceReference:
    """A reference of no text (the agreement text option is empty and no statistics were asked)."""
    from pipeline.calibration.reference import SourceReference

    none_i, none_f = np.zeros((0, 0), np.int32), np.zeros((0, 0), np.float32)
    return SourceReference(
        sequences=TokenSequences((), ()), n_vocab=n_vocab, top_k=params.top_k,
        tail_samples=params.tail_samples,
        topk_ids=none_i.reshape(0, params.top_k), topk_logprobs=none_f.reshape(0, params.top_k),
        tail_logprob=np.zeros(0, np.float32), tail_ids=none_i.reshape(0, params.tail_samples),
        tail_logprobs=none_f.reshape(0, params.tail_samples), entropy=np.zeros(0, np.float32),
        target_logprob=np.zeros(0, np.float32),
    )


def _agreement_sequences(tokens: tuple[int, ...]) -> TokenSequences:
    return TokenSequences((AGREEMENT,), (tokens,)) if len(tokens) >= 2 else TokenSequences((), ())


@dataclass
class _SourceRun:
    """What one engine's run of the source gave: the reference's builder, the statistics files,
    metrics and notes, and the answers."""

    builder: ReferenceBuilder
    answers: SourceAnswers
    n_vocab: int
    outputs: list[OutputFile] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def _with_calibration(agreement: TokenSequences, params: Params, vocab: Path) -> tuple[TokenSequences, range]:
    """The agreement sequences followed by the calibration text's (tokenized with ``vocab``), and
    which of them count for the statistics (the calibration ones)."""
    from pipeline.calibration.sequences import tokenize_texts

    calibration = tokenize_texts(vocab, {CALIBRATION: params.text}, params.calibration_ctx)
    sequences = TokenSequences(agreement.names + calibration.names, agreement.ids + calibration.ids)
    return sequences, range(len(agreement.ids), len(sequences.ids))


def _statistics(params: Params, device: str = "cpu") -> ActivationStats:
    from pipeline.calibration.stats import NO_GRAM, ActivationStats

    return ActivationStats(device=device,
                           gram_for=(lambda name: bool(_LINEAR.match(name))) if params.is_gram else NO_GRAM)


def _statistics_files(
    stats: ActivationStats, params: Params, sequences: TokenSequences, counted: range, report: CollectReport,
    workdir: Path,
) -> tuple[list[OutputFile], dict[str, Any]]:
    """imatrix.gguf and the Gram files of a run over the calibration text, and its metrics."""
    from pipeline.calibration.imatrix import Imatrix, write_imatrix

    matrix = Imatrix.from_stats(stats, (params.dataset_name,), params.calibration_ctx, len(counted))
    outputs = [OutputFile(IMATRIX_NAME, write_imatrix(workdir / IMATRIX_NAME, matrix), "importance-matrix")]
    outputs += [
        OutputFile(f"{GRAM_PREFIX}{path.name}", path, "gram-matrix") for path in sorted(report.gram_files)
    ]
    metrics = {
        "engine": report.engine, "device": report.device, "calibration_sequences": len(counted),
        "calibration_tokens": sum(len(sequences.ids[i]) for i in counted),
        "collect_s": round(report.seconds, 3), "tokens_per_s": round(report.tokens_per_s, 1),
        "weights": report.n_weights, "gram_files": len(report.gram_files), "dataset": params.dataset_name,
    }
    return outputs, metrics


def _run_llama(card: ModelCard, download: Mapping[str, Path], params: Params, workdir: Path) -> _SourceRun:
    """The whole source in llama.cpp: the answers (a child process), then the statistics when asked."""
    from pipeline.calibration.gpu_offload import choose_offload
    from pipeline.calibration.llama_collect import collect_with_llama_cpp
    from pipeline.calibration.reference import ReferenceBuilder

    started = time.monotonic()
    n_threads = _threads()
    probe: ProbeResult | None = None
    source, kind = None, "none"
    try:
        with ProbeProcess(workdir, label="source") as child:  # llama.cpp loads while the source is written
            source, kind = _source_path(card, download, workdir)
            written_s = time.monotonic() - started
            request = params.probe.request(source, n_threads)
            probe, why = child.run(request, params.probe.timeout_s)
        if probe is None:
            raise IntegrityError(f"the source does not run in llama.cpp, so nothing can be compared "
                                 f"with it: {why}")
        agreement = _agreement_sequences(probe.text.tokens if probe.text else ())
        answers = SourceAnswers(kind, probe, request_key(request))
        if not params.is_statistics:
            builder = ReferenceBuilder(agreement, params.top_k, params.tail_samples, params.probe.seed)
            if agreement.ids:
                builder.add(0, np.load(str(probe.logits_path)))
            return _SourceRun(builder, answers, probe.n_vocab, metrics={
                "source_load_s": probe.load_s, "source_gguf_s": round(written_s, 3),
                "device": probe.backend.device, "n_gpu_layers": probe.backend.n_gpu_layers,
                "offload": probe.backend.offload_why})
        sequences, counted = _with_calibration(agreement, params, source)
        builder = ReferenceBuilder(sequences, params.top_k, params.tail_samples, params.probe.seed)
        stats = _statistics(params)
        offload = choose_offload(source, params.probe.n_gpu_layers)
        report = collect_with_llama_cpp(
            source, sequences, stats, reference=builder,
            gram_dir=workdir / GRAM_PREFIX.rstrip("/") if params.is_gram else None,
            n_threads=n_threads, stats_for=frozenset(counted), n_gpu_layers=offload.n_gpu_layers,
        )
        outputs, metrics = _statistics_files(stats, params, sequences, counted, report, workdir)
        metrics.update({"source_load_s": probe.load_s, "source_gguf_s": round(written_s, 3),
                        "n_gpu_layers": offload.n_gpu_layers, "offload": offload.why})
        return _SourceRun(builder, answers, probe.n_vocab, outputs, metrics, report.notes)
    finally:
        if probe is not None and probe.logits_path:
            Path(probe.logits_path).unlink(missing_ok=True)
        if kind == "hf-16bit" and source is not None:
            source.unlink(missing_ok=True)


def _run_torch(card: ModelCard, download: Mapping[str, Path], params: Params, workdir: Path) -> _SourceRun:
    """The checkpoint one block at a time in torch: the reference (and statistics), no answers. The
    texts are tokenized by llama.cpp from a vocabulary-only GGUF, as validate's probe tokenizes them."""
    from pipeline.calibration.llama_session import LlamaSession
    from pipeline.calibration.reference import ReferenceBuilder
    from pipeline.calibration.sequences import write_vocab_gguf
    from pipeline.calibration.torch_collect import collect_with_torch, default_device

    vocab = write_vocab_gguf(card, download, workdir / ".vocab.gguf")
    try:
        text = params.probe.agreement_text
        with LlamaSession(vocab, vocab_only=True) as session:
            tokens = tuple(session.tokenize(text)[: params.probe.n_ctx]) if text else ()
        agreement = _agreement_sequences(tokens)
        sequences, counted = (_with_calibration(agreement, params, vocab) if params.is_statistics
                              else (agreement, range(0)))
    finally:
        vocab.unlink(missing_ok=True)
    request = params.probe.request(vocab, _threads())
    answers = SourceAnswers("torch-blockwise", None, request_key(request))
    builder = ReferenceBuilder(sequences, params.top_k, params.tail_samples, params.probe.seed)
    shards = {name: path for name, path in download.items() if name in card.shards}
    if not sequences.ids:
        return _SourceRun(builder, answers, card.embedding_rows)
    stats = _statistics(params, default_device())
    report = collect_with_torch(
        card, shards, sequences, stats, reference=builder,
        gram_dir=workdir / GRAM_PREFIX.rstrip("/") if params.is_gram else None, stats_for=frozenset(counted),
    )
    if not params.is_statistics:
        metrics = {"engine": report.engine, "device": report.device, "collect_s": round(report.seconds, 3)}
        return _SourceRun(builder, answers, builder.n_vocab or card.embedding_rows, metrics=metrics)
    outputs, metrics = _statistics_files(stats, params, sequences, counted, report, workdir)
    return _SourceRun(builder, answers, builder.n_vocab or card.embedding_rows, outputs, metrics)


def run(
    params: Params, inputs: Mapping[str, InputFile], workdir: Path, clients: StageClients = NO_CLIENTS
) -> StageResult:
    """Run the source; write reference.npz (and imatrix.gguf, gram/*). Raises InputError for a source
    that cannot be written as GGUF, IntegrityError when llama.cpp cannot run it."""
    started = time.monotonic()
    workdir = Path(workdir)
    card_item = inputs.get(f"inspect/{CARD_NAME}")
    download = {name: item.path for name, item in inputs_of(inputs, "download").items()}
    if card_item is None or not download:
        raise InputError(f"calibrate needs inspect/{CARD_NAME} and the download's files; "
                         f"got {sorted(inputs)}")
    card = ModelCard.load(card_item.path, f"inspect/{CARD_NAME}")
    choice: EngineChoice = choose_engine(card, params.engine, input_size(inputs, "download/"),
                                         _longest_sequence(params))
    made = (_run_torch if choice.engine == "torch" else _run_llama)(card, download, params, workdir)
    from pipeline.calibration.reference import write_reference

    info = {
        "answers": made.answers.to_info(),
        "source_card_sha256": card_item.sha256,
        "agreement_text_sha256": text_sha256(params.probe.agreement_text),
        "calibration_text_sha256": text_sha256(params.text) if params.is_statistics else None,
        "engine": choice.engine,
    }
    reference = (made.builder.build(info) if made.builder.sequences.ids
                 else replace(_empty_reference(made.n_vocab, params), info=info))
    path = write_reference(workdir / REFERENCE_NAME, reference)
    metrics = {
        **made.metrics, "source_kind": made.answers.kind, "reference_engine": choice.engine,
        "reference_engine_why": choice.why, "reference_positions": int(reference.topk_ids.shape[0]),
        "reference_top_k": params.top_k, "importance": params.importance, "gram": params.is_gram,
        "elapsed_s": round(time.monotonic() - started, 3),
    }
    probe = made.answers.probe
    answered = repr(probe.completions[0].text) if probe else "nothing (made the reference only)"
    log.info("calibrate: source %s answered %s; reference of %d positions; %d statistics files",
             made.answers.kind, answered, metrics["reference_positions"], len(made.outputs))
    return StageResult(
        outputs=(OutputFile(REFERENCE_NAME, path, "source-reference"), *made.outputs),
        metrics=metrics,
        warnings=tuple(made.notes),
    )
