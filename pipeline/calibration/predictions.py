"""How one model's next-token predictions compare with another's over the same text (pure numpy).

Used by validation (full logits of both models) and by the calibration reference (the source's
top-k stored once, `agreement`). See `AgreementStats` for the figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["AgreementStats", "agreement_stats"]

_KL_CHUNK_ROWS = 16  # rows of [n_vocab] float64 softmax at a time (262k vocab: 32 MB per chunk)


@dataclass(frozen=True)
class AgreementStats:
    """How a model's next-token predictions compare with its source's over one text.

    Over ``n_positions`` positions (each predicts the following token of the text):
    ``top1_agreement`` is the share where both pick the same most likely token; ``mean_kl``
    the mean KL(source || model) in nats (``max_kl``, ``p90_kl`` its spread);
    ``source_nll`` / ``candidate_nll`` the mean negative log-likelihood of the actual next
    token (log perplexity) under each; ``uniform_kl`` the mean KL(source || uniform), the
    divergence of a model that knows nothing, as a yardstick for ``mean_kl``.
    """

    n_positions: int
    top1_agreement: float
    mean_kl: float
    p90_kl: float
    max_kl: float
    source_nll: float
    candidate_nll: float
    uniform_kl: float


def _log_softmax(logits: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    shifted = logits - logits.max(axis=1, keepdims=True)
    out: npt.NDArray[np.float64] = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return out


def agreement_stats(
    source_logits: npt.NDArray[Any], candidate_logits: npt.NDArray[Any], tokens: list[int]
) -> AgreementStats:
    """Compare two ``[n_tokens, n_vocab]`` logit arrays computed over the same ``tokens``.

    Position ``i`` predicts ``tokens[i + 1]``; the last position has no target and is left
    out. Works in float64 on chunks of rows. Raises ValueError for mismatched shapes or
    fewer than two tokens.
    """
    if source_logits.shape != candidate_logits.shape or source_logits.ndim != 2:
        raise ValueError(f"logit shapes differ: {source_logits.shape} vs {candidate_logits.shape}")
    n = min(len(tokens), source_logits.shape[0]) - 1
    if n < 1:
        raise ValueError("agreement needs a text of at least two tokens")
    n_vocab = source_logits.shape[1]
    targets = np.asarray(tokens[1 : n + 1], dtype=np.int64)
    same, kls, src_nll, cand_nll, uni = [], [], [], [], []
    for r0 in range(0, n, _KL_CHUNK_ROWS):
        r1 = min(n, r0 + _KL_CHUNK_ROWS)
        src = _log_softmax(np.asarray(source_logits[r0:r1], dtype=np.float64))
        cand = _log_softmax(np.asarray(candidate_logits[r0:r1], dtype=np.float64))
        p = np.exp(src)
        kls.append((p * (src - cand)).sum(axis=1))
        same.append(src.argmax(axis=1) == cand.argmax(axis=1))
        rows = np.arange(r1 - r0)
        src_nll.append(-src[rows, targets[r0:r1]])
        cand_nll.append(-cand[rows, targets[r0:r1]])
        uni.append(np.log(n_vocab) + (p * src).sum(axis=1))  # log V - H(p)
    kl = np.maximum(np.concatenate(kls), 0.0)  # rounding can leave -1e-16
    return AgreementStats(
        n_positions=n,
        top1_agreement=float(np.concatenate(same).mean()),
        mean_kl=float(kl.mean()),
        p90_kl=float(np.quantile(kl, 0.9)),
        max_kl=float(kl.max()),
        source_nll=float(np.concatenate(src_nll).mean()),
        candidate_nll=float(np.concatenate(cand_nll).mean()),
        uniform_kl=float(np.concatenate(uni).mean()),
    )
