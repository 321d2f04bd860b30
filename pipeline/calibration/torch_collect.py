"""Activation statistics from a plain-torch forward of an HF checkpoint, one transformer block at a time.

The loop runs blocks on the outside and sequences on the inside: every sequence's hidden
states (``n_tokens x hidden`` float32 in all) go through block 0, then block 1, and so on, so
only one block's weights are ever loaded and memory stays flat in model size (plus the token
embedding and the output head, one at a time, at the ends). A block's Gram matrices are
complete once it is done, so they are written and freed right then. Runs on the device the
`ActivationStats` accumulate on: CUDA when the caller picks it (`default_device`).

Same statistics as `llama_collect` on the same token ids, up to float rounding (a test
checks); the architectures are those `torch_model` computes (llama, mistral, qwen2, qwen3,
bitnet). With a `reference.ReferenceBuilder` the output head runs too, and the source's
reference answers come out of the same pass, with no 16-bit GGUF of the source ever written.

Example::

    stats = ActivationStats(device=default_device(), gram_for=lambda n: True)
    report = collect_with_torch(card, files, seqs, stats, gram_dir=workdir / "gram")
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline.calibration.llama_collect import CollectReport, write_grams
from pipeline.calibration.sequences import TokenSequences
from pipeline.calibration.stats import ActivationStats
from pipeline.calibration.torch_model import CheckpointTensors, blocks_forward, head_logits, model_spec
from pipeline.core.errors import InputError
from pipeline.formats.model_card import ModelCard

if TYPE_CHECKING:
    from pipeline.calibration.reference import ReferenceBuilder

__all__ = ["default_device", "collect_with_torch"]


def default_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@torch.inference_mode()
def collect_with_torch(
    card: ModelCard,
    files: Mapping[str, Path],
    sequences: TokenSequences,
    stats: ActivationStats,
    *,
    reference: ReferenceBuilder | None = None,
    gram_dir: Path | None = None,
    on_block: Callable[[int, int], None] | None = None,
    stats_for: Collection[int] | None = None,
    as_stored: bool = True,
) -> CollectReport:
    """Run ``sequences`` through the checkpoint block by block, adding each weight's inputs to ``stats``.

    ``files`` maps shard names to paths. ``gram_dir``: each block's Gram matrices (those
    ``stats.gram_for`` asks for) are written there as the block finishes. ``reference``: gets
    each sequence's logits. ``stats_for``: indices of the sequences whose inputs count (all when
    None); the others run for the reference only. ``on_block(done, total)`` reports progress.
    ``as_stored``: each weight's input is rounded to the weight's stored 16-bit type before the
    product, as llama.cpp does running the checkpoint's 16-bit GGUF (False: float32 throughout,
    as llama.cpp on an F32 GGUF).
    Raises InputError for an architecture or rope scaling the torch forward does not compute, or
    token ids outside the vocabulary; IntegrityError from the shards as decompose would.
    """
    if not sequences.ids:
        raise InputError("no sequences to calibrate on")
    spec = model_spec(card)
    if not as_stored:
        spec = replace(spec, matmul_dtype=None)
    device = stats.device
    started = time.perf_counter()
    paths: list[Path] = []
    with CheckpointTensors(card, files, device) as ckpt:
        embedding = ckpt.get("token_embd.weight", as_stored=True)  # 16-bit: only its rows are widened
        n_vocab = embedding.shape[0]
        worst = max(max(ids) for ids in sequences.ids)
        if worst >= n_vocab:
            raise InputError(f"token id {worst} is outside the checkpoint's {n_vocab}-token embedding")
        hidden = [embedding[torch.tensor(ids, device=device)].float() for ids in sequences.ids]
        del embedding
        counted = [stats_for is None or s in stats_for for s in range(len(hidden))]
        for index in range(spec.n_layers):
            weights = ckpt.lazy_block(index)  # every sequence at once: each tensor read once, then let go
            prefix = f"blk.{index}."
            hidden = blocks_forward(spec, weights, hidden, prefix=prefix, on_input=stats.add, counted=counted)
            if gram_dir is not None:
                paths += write_grams(stats, gram_dir, [prefix + name for name in weights])
            if on_block is not None:
                on_block(index + 1, spec.n_layers)
        if reference is not None:
            norm = ckpt.get("output_norm.weight")
            head_name = "output.weight" if ckpt.has("output.weight") else "token_embd.weight"
            head = ckpt.get(head_name, as_stored=True)
            for s, x in enumerate(hidden):
                reference.add(s, head_logits(spec, norm, head, x).float().cpu().numpy())
    return CollectReport(
        engine="torch",
        device=str(device),
        n_sequences=len(sequences.ids),
        n_tokens=sequences.n_tokens,
        seconds=time.perf_counter() - started,
        n_weights=len(stats.names()),
        gram_files=tuple(paths),
    )
