"""A candidate model's next-token predictions scored against a stored `reference.SourceReference`.

The figures are `predictions.AgreementStats`, computed as `agreement_stats` computes them
from two full logit arrays, except that the source side comes from the reference:

- ``top1_agreement``, ``source_nll``, ``candidate_nll``, ``uniform_kl``: exact;
- ``mean_kl``: the top-k part of KL(p || q) exactly, plus the tail part
  ``p_tail · mean_s log(p_s / q_s)`` over the stored draws ``s ~ p(.|tail)``: an unbiased estimate
  whose noise averages out over positions (`ReferenceAgreement.mean_kl_stderr` states it);
- ``p90_kl`` / ``max_kl``: over per-position values, each at least its coarsened lower bound.

`ReferenceAgreement.mean_kl_lower` is the coarsened KL (top-k tokens plus one "other" outcome),
a guaranteed lower bound of the exact mean KL.

Example::

    agreement = score_gguf(candidate_gguf, read_reference(path), names=["agreement"])
    agreement.stats.top1_agreement, agreement.stats.mean_kl, agreement.mean_kl_lower
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pipeline.calibration.predictions import AgreementStats
from pipeline.calibration.reference import SoftmaxRows, SourceReference, gather_rows
from pipeline.core.errors import InputError, IntegrityError

__all__ = ["ReferenceAgreement", "ReferenceScorer", "score_gguf"]

_CHUNK_ROWS = 32
# A candidate tail that underflows float32 (below e^-87 of its peak) counts as that small, not 0.
_LOG_FLOOR = float(np.log(np.finfo(np.float32).tiny))


@dataclass(frozen=True)
class ReferenceAgreement:
    """A candidate against the reference: judge's figures (``mean_kl`` estimated as the module says),
    the coarsened lower bound of the mean KL, the standard error the tail draws leave on ``mean_kl``
    (from their spread at each position), and the mean source mass outside the top k."""

    stats: AgreementStats
    mean_kl_lower: float
    mean_kl_stderr: float
    mean_tail_mass: float
    top_k: int
    tail_samples: int


class ReferenceScorer:
    """Scores a candidate's logits, sequence by sequence (`add`), against a `SourceReference`."""

    def __init__(self, ref: SourceReference, names: Sequence[str] | None = None) -> None:
        self.ref, self.indices = ref, ref.sequences.select(names)
        self._offsets = ref.offsets
        self._rows: dict[int, dict[str, npt.NDArray[Any]]] = {}
        self._softmax = SoftmaxRows()

    def add(self, index: int, logits: npt.NDArray[Any]) -> None:
        """The candidate's logits ``[len(sequence), n_vocab]`` for sequence ``index``."""
        ref, ids = self.ref, self.ref.sequences.ids[index]
        if logits.shape != (len(ids), ref.n_vocab):
            raise IntegrityError(
                f"sequence {index}: candidate logits {logits.shape}, expected {(len(ids), ref.n_vocab)}"
            )
        a = int(self._offsets[index])
        targets = np.asarray(ids[1:], dtype=np.int64)
        out: dict[str, list[npt.NDArray[Any]]] = {"same": [], "kl": [], "lower": [], "var": [], "nll": []}
        for r0 in range(0, len(targets), _CHUNK_ROWS):
            r1 = min(len(targets), r0 + _CHUNK_ROWS)
            rows = slice(a + r0, a + r1)
            top = torch.from_numpy(ref.topk_ids[rows].astype(np.int64))
            red = self._softmax.reduce(logits[r0:r1], top=top)
            shift = red.shift[:, None]
            lp = ref.topk_logprobs[rows].astype(np.float64)
            head = (np.exp(lp) * (lp - (gather_rows(red.logits, top) - shift))).sum(axis=1)
            tail_p = ref.tail_logprob[rows].astype(np.float64)
            has_tail = np.isfinite(tail_p)
            mass = np.where(has_tail, np.exp(np.where(has_tail, tail_p, 0.0)), 0.0)
            coarse = np.where(has_tail, tail_p - np.maximum(red.tail_log, _LOG_FLOOR), 0.0)
            drawn = torch.from_numpy(ref.tail_ids[rows].astype(np.int64))
            ratio = ref.tail_logprobs[rows].astype(np.float64) - (gather_rows(red.logits, drawn) - shift)
            out["lower"].append(np.maximum(head + mass * coarse, 0.0))
            out["kl"].append(head + mass * ratio.mean(axis=1))
            out["var"].append(
                mass * mass * ratio.var(axis=1, ddof=1) / ratio.shape[1]
                if ratio.shape[1] > 1
                else np.zeros(r1 - r0)
            )
            out["same"].append(red.argmax == top[:, 0].numpy())
            out["nll"].append(red.shift - red.logits.numpy()[np.arange(r1 - r0), targets[r0:r1]])
        self._rows[index] = {k: np.concatenate(v) for k, v in out.items()}

    def _joined(self, key: str) -> npt.NDArray[Any]:
        return np.concatenate([self._rows[i][key] for i in self.indices])

    def result(self) -> ReferenceAgreement:
        """Figures over the selected sequences; IntegrityError when one was not added."""
        missing = [i for i in self.indices if i not in self._rows]
        if missing:
            raise IntegrityError(f"no candidate logits for sequence(s) {missing[:5]}")
        rows = np.concatenate([np.arange(self._offsets[i], self._offsets[i + 1]) for i in self.indices])
        if rows.size == 0:
            raise InputError("the selected sequences predict no token")
        kl, lower = self._joined("kl"), self._joined("lower")
        spread = np.maximum(kl, lower)
        ref = self.ref
        stats = AgreementStats(
            n_positions=int(rows.size),
            top1_agreement=float(self._joined("same").mean()),
            mean_kl=float(max(kl.mean(), 0.0)),
            p90_kl=float(np.quantile(spread, 0.9)),
            max_kl=float(spread.max()),
            source_nll=float(-ref.target_logprob[rows].astype(np.float64).mean()),
            candidate_nll=float(self._joined("nll").mean()),
            uniform_kl=float((np.log(ref.n_vocab) - ref.entropy[rows].astype(np.float64)).mean()),
        )
        tail = np.exp(ref.tail_logprob[rows].astype(np.float64))
        stderr = float(np.sqrt(self._joined("var").sum()) / rows.size)
        return ReferenceAgreement(
            stats, float(lower.mean()), stderr, float(tail.mean()), ref.top_k, ref.tail_samples
        )


def _first_fitting(indices: Sequence[int], ref: SourceReference, max_positions: int) -> list[int]:
    kept: list[int] = []
    total = 0
    for index in indices:
        total += len(ref.sequences.ids[index]) - 1
        if kept and total > max_positions:
            break
        kept.append(index)
    return kept


def score_gguf(
    path: Path,
    ref: SourceReference,
    names: Sequence[str] | None = None,
    *,
    n_threads: int = 2,
    n_gpu_layers: int = 0,
    max_positions: int | None = None,
) -> ReferenceAgreement:
    """Run a candidate GGUF in llama.cpp on the reference's own token ids and score it.

    The candidate is not re-tokenized: it must share the source's vocabulary (IntegrityError
    when its vocabulary size differs). ``max_positions``: only the first selected sequences that
    fit in that many scored positions (always at least one).
    """
    from pipeline.calibration.llama_session import LlamaSession

    scorer = ReferenceScorer(ref, names)
    if max_positions is not None:
        scorer.indices = _first_fitting(scorer.indices, ref, max_positions)
    n_ctx = max(len(ref.sequences.ids[i]) for i in scorer.indices)
    with LlamaSession(path, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers) as session:
        if session.n_vocab != ref.n_vocab:
            raise IntegrityError(
                f"{Path(path).name} has a vocabulary of {session.n_vocab} tokens; "
                f"the reference has {ref.n_vocab}"
            )
        for index in scorer.indices:
            scorer.add(index, session.logits(ref.sequences.ids[index]))
    return scorer.result()
