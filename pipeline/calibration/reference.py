"""The source model's next-token answers on given texts, computed once, and a candidate's score against them.

Per position ``i`` of each sequence (predicting token ``i + 1``; a sequence's last position
predicts nothing and is not kept), from the source's full distribution ``p``:

- ``topk_ids`` / ``topk_logprobs`` [P, k]: the ``k`` most likely tokens and their exact log p,
  most likely first (ties: lower id first, as numpy's argmax picks);
- ``tail_logprob`` [P]: log of the mass ``p_tail`` outside those ``k`` (-inf when none);
- ``entropy`` [P] (nats) and ``target_logprob`` [P] (log p of the actual next token), exact.

That is enough for every figure of `validation.judge.AgreementStats` against a candidate's
full logits ``q``: top-1 agreement, the source's and candidate's log-perplexity and the
uniform yardstick exactly, and KL(p || q) estimated as the KL between the two distributions
coarsened to k + 1 outcomes (the top-k tokens and "any other token")::

    KL_k = sum_{j in top-k} p_j log(p_j / q_j) + p_tail log(p_tail / q_tail)

By the log-sum inequality KL_k <= KL, with equality when the tail is empty; the gap is
``p_tail * KL(p(.|tail) || q(.|tail))``, the divergence inside the tail weighted by its mass,
so it is small when the source puts little mass outside its top k. `tests` and `bench`
measure it against the exact KL of `agreement_stats`.

Artifact: a ``.npz`` (no pickles) with those arrays, the sequences' token ids, and a JSON
header (format, k, vocabulary size, text names, the caller's ``info`` such as the source digest).

Example::

    builder = ReferenceBuilder(seqs, top_k=64)
    collect_with_llama_cpp(source_gguf, seqs, stats, reference=builder)   # or any logits source
    write_reference(workdir / "reference.npz", builder.build({"source_sha256": digest}))
    agreement = score_gguf(candidate_gguf, read_reference(workdir / "reference.npz"), names=["agreement"])
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pipeline.calibration.sequences import TokenSequences
from pipeline.errors import InputError, IntegrityError
from pipeline.validation.judge import AgreementStats

__all__ = [
    "REFERENCE_FORMAT",
    "SourceReference",
    "ReferenceBuilder",
    "write_reference",
    "read_reference",
    "ReferenceAgreement",
    "ReferenceScorer",
    "score_gguf",
]

REFERENCE_FORMAT = "bonsai-source-reference/1"
_CHUNK_ROWS = 32  # rows of [n_vocab] float32 at a time (262k vocabulary: 32 MB per array)
_LOG_FLOOR = float(np.log(np.finfo(np.float32).tiny))
_ARRAYS = ("topk_ids", "topk_logprobs", "tail_logprob", "entropy", "target_logprob")
F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class SourceReference:
    """Reference answers for ``sequences``; rows ``offsets[s]:offsets[s + 1]`` belong to sequence ``s``."""

    sequences: TokenSequences
    n_vocab: int
    top_k: int
    topk_ids: npt.NDArray[np.int32]
    topk_logprobs: F32
    tail_logprob: F32
    entropy: F32
    target_logprob: F32
    info: Mapping[str, Any] = field(default_factory=dict)

    @property
    def offsets(self) -> npt.NDArray[np.int64]:
        """Row offsets per sequence, [n_sequences + 1]."""
        lengths = [max(len(s) - 1, 0) for s in self.sequences.ids]
        return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


@dataclass(frozen=True)
class _Reduced:
    """One chunk of rows reduced: ``log p_j = logits_j - shift``; ``top`` the top-k ids (int64 [r, k]);
    ``tail_log`` log of the mass outside ``top``; ``entropy`` in nats (None unless asked); ``argmax``."""

    logits: torch.Tensor
    shift: npt.NDArray[np.float64]
    top: torch.Tensor
    tail_log: npt.NDArray[np.float64]
    entropy: npt.NDArray[np.float64] | None
    argmax: npt.NDArray[np.int64]


class _Softmax:
    """Softmax reductions over chunks of ``[r, n_vocab]`` logits in reused buffers (torch, all cores).

    One exp pass per chunk; sums in float32 (torch sums blockwise: ~1e-7 relative), turned into
    float64 for the logs. The tail mass is summed over the tail itself, not as 1 - sum(top).
    """

    def __init__(self) -> None:
        self._shifted: torch.Tensor | None = None
        self._exp: torch.Tensor | None = None

    def reduce(
        self, rows: npt.NDArray[Any], top_k: int = 0, top: torch.Tensor | None = None, entropy: bool = False
    ) -> _Reduced:
        logits = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        if self._exp is None or self._exp.shape != logits.shape:
            self._shifted, self._exp = torch.empty_like(logits), torch.empty_like(logits)
        shifted, exp = self._shifted, self._exp
        assert shifted is not None
        peak = logits.amax(dim=1)
        torch.sub(logits, peak[:, None], out=shifted)
        torch.exp(shifted, out=exp)
        total = exp.sum(dim=1).double()
        shift = (peak.double() + total.log()).numpy()
        ent = None
        if entropy:
            # H = -sum p log p = log S - sum e (l - max) / S, with e = exp(l - max) and S = sum e.
            ent = (total.log() - torch.mul(shifted, exp, out=shifted).sum(dim=1).double() / total).numpy()
        if top is None:
            top = _top_k(logits, top_k)
        exp.scatter_(1, top, 0.0)
        with np.errstate(divide="ignore"):
            tail_log = np.log((exp.sum(dim=1).double() / total).numpy())
        return _Reduced(logits, shift, top, tail_log, ent, logits.argmax(dim=1).numpy())


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64 [r, k]) of the k largest per row, largest first, ties to the lower index."""
    values, index = torch.topk(logits, k, dim=1, largest=True, sorted=True)
    # topk does not promise an order among equal values; numpy's argmax takes the lowest index.
    key = torch.from_numpy(np.lexsort((index.numpy(), -values.numpy()), axis=1))
    return torch.gather(index, 1, key)


def _gather(values: torch.Tensor, index: torch.Tensor) -> npt.NDArray[np.float64]:
    """``values[r, index[r, j]]`` as float64 numpy."""
    out: npt.NDArray[np.float64] = torch.gather(values, 1, index).double().numpy()
    return out


class ReferenceBuilder:
    """Collects the source's logits sequence by sequence (`add`), keeping only the reference figures."""

    def __init__(self, sequences: TokenSequences, top_k: int = 64) -> None:
        if top_k < 1:
            raise InputError(f"top_k must be at least 1, got {top_k}")
        self.sequences, self.top_k = sequences, int(top_k)
        self.n_vocab: int | None = None
        self._parts: dict[int, dict[str, npt.NDArray[Any]]] = {}
        self._softmax = _Softmax()

    def add(self, index: int, logits: npt.NDArray[Any]) -> None:
        """The source's logits ``[len(sequence), n_vocab]`` for sequence ``index``."""
        ids = self.sequences.ids[index]
        if logits.ndim != 2 or logits.shape[0] != len(ids):
            raise IntegrityError(f"sequence {index}: logits {logits.shape} for {len(ids)} tokens")
        if self.n_vocab is None:
            self.n_vocab = int(logits.shape[1])
            if self.top_k > self.n_vocab:
                raise InputError(f"top_k {self.top_k} exceeds the vocabulary of {self.n_vocab} tokens")
        elif logits.shape[1] != self.n_vocab:
            raise IntegrityError(
                f"sequence {index}: {logits.shape[1]} logits per position, earlier {self.n_vocab}"
            )
        parts: dict[str, list[npt.NDArray[Any]]] = {name: [] for name in _ARRAYS}
        targets = np.asarray(ids[1:], dtype=np.int64)
        for r0 in range(0, len(targets), _CHUNK_ROWS):
            r1 = min(len(targets), r0 + _CHUNK_ROWS)
            red = self._softmax.reduce(logits[r0:r1], top_k=self.top_k, entropy=True)
            assert red.entropy is not None
            parts["topk_ids"].append(red.top.numpy().astype(np.int32))
            parts["topk_logprobs"].append(_gather(red.logits, red.top) - red.shift[:, None])
            parts["tail_logprob"].append(red.tail_log)
            parts["entropy"].append(red.entropy)
            parts["target_logprob"].append(red.logits.numpy()[np.arange(r1 - r0), targets[r0:r1]] - red.shift)
        self._parts[index] = {
            name: np.concatenate(chunks)
            if chunks
            else np.zeros((0, self.top_k) if name.startswith("topk") else 0)
            for name, chunks in parts.items()
        }

    def build(self, info: Mapping[str, Any] | None = None) -> SourceReference:
        """The reference of every sequence; IntegrityError when one was never added."""
        missing = [i for i in range(len(self.sequences.ids)) if i not in self._parts]
        if missing or self.n_vocab is None:
            raise IntegrityError(
                f"no source logits for sequence(s) {missing[:5]} of {len(self.sequences.ids)}"
            )
        joined = {
            name: np.concatenate([self._parts[i][name] for i in range(len(self.sequences.ids))])
            for name in _ARRAYS
        }
        return SourceReference(
            self.sequences,
            self.n_vocab,
            self.top_k,
            joined["topk_ids"].astype(np.int32).reshape(-1, self.top_k),
            joined["topk_logprobs"].astype(np.float32).reshape(-1, self.top_k),
            joined["tail_logprob"].astype(np.float32),
            joined["entropy"].astype(np.float32),
            joined["target_logprob"].astype(np.float32),
            dict(info or {}),
        )


def write_reference(dest: Path, ref: SourceReference) -> Path:
    """Write ``ref`` as a compressed ``.npz`` at ``dest`` (atomically); returns ``dest``."""
    header = {
        "format": REFERENCE_FORMAT,
        "n_vocab": ref.n_vocab,
        "top_k": ref.top_k,
        "names": list(ref.sequences.names),
        "info": dict(ref.info),
    }
    lengths = np.asarray([len(s) for s in ref.sequences.ids], dtype=np.int64)
    tokens = np.asarray([t for s in ref.sequences.ids for t in s], dtype=np.int32)
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.partial.npz")
    arrays = {name: getattr(ref, name) for name in _ARRAYS}
    header_bytes = np.frombuffer(json.dumps(header, sort_keys=True).encode("utf-8"), dtype=np.uint8)
    np.savez_compressed(tmp, header=header_bytes, tokens=tokens, lengths=lengths, **arrays)
    os.replace(tmp, dest)
    return dest


def read_reference(path: Path) -> SourceReference:
    """Read a reference artifact. Raises IntegrityError when it is not one or its arrays disagree."""
    label = Path(path).name
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in ("header", "tokens", "lengths", *_ARRAYS)}
        header = json.loads(arrays["header"].tobytes().decode("utf-8"))
    except (OSError, ValueError, KeyError) as exc:
        raise IntegrityError(f"{label} is not a readable source reference: {exc}") from exc
    if header.get("format") != REFERENCE_FORMAT:
        raise IntegrityError(f"{label} is {header.get('format')!r}, expected {REFERENCE_FORMAT!r}")
    lengths = arrays["lengths"].astype(np.int64)
    names = header.get("names") or []
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    if len(names) != len(lengths) or bounds[-1] != len(arrays["tokens"]):
        raise IntegrityError(
            f"{label}: {len(names)} names, {len(lengths)} sequences, {len(arrays['tokens'])} tokens"
        )
    ids = tuple(
        tuple(int(t) for t in arrays["tokens"][a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    )
    n_rows, k = int(np.maximum(lengths - 1, 0).sum()), int(header["top_k"])
    for name in _ARRAYS:
        want = (n_rows, k) if name.startswith("topk") else (n_rows,)
        if arrays[name].shape != want:
            raise IntegrityError(f"{label}: {name} has shape {arrays[name].shape}, expected {want}")
    return SourceReference(
        sequences=TokenSequences(tuple(str(n) for n in names), ids),
        n_vocab=int(header["n_vocab"]),
        top_k=k,
        topk_ids=arrays["topk_ids"].astype(np.int32),
        topk_logprobs=arrays["topk_logprobs"].astype(np.float32),
        tail_logprob=arrays["tail_logprob"].astype(np.float32),
        entropy=arrays["entropy"].astype(np.float32),
        target_logprob=arrays["target_logprob"].astype(np.float32),
        info=header.get("info") or {},
    )


@dataclass(frozen=True)
class ReferenceAgreement:
    """A candidate against the reference: judge's figures (``mean_kl`` is the top-k estimate, a lower
    bound of the exact mean KL) and the mean source mass outside the top k that bounds the gap's weight."""

    stats: AgreementStats
    mean_tail_mass: float
    top_k: int


class ReferenceScorer:
    """Scores a candidate's logits, sequence by sequence (`add`), against a `SourceReference`."""

    def __init__(self, ref: SourceReference, names: Sequence[str] | None = None) -> None:
        self.ref, self.indices = ref, ref.sequences.select(names)
        self._offsets = ref.offsets
        self._rows: dict[int, dict[str, npt.NDArray[Any]]] = {}
        self._softmax = _Softmax()

    def add(self, index: int, logits: npt.NDArray[Any]) -> None:
        """The candidate's logits ``[len(sequence), n_vocab]`` for sequence ``index``."""
        ref, ids = self.ref, self.ref.sequences.ids[index]
        if logits.shape != (len(ids), ref.n_vocab):
            raise IntegrityError(
                f"sequence {index}: candidate logits {logits.shape}, expected {(len(ids), ref.n_vocab)}"
            )
        a = int(self._offsets[index])
        targets = np.asarray(ids[1:], dtype=np.int64)
        out: dict[str, list[npt.NDArray[Any]]] = {"same": [], "kl": [], "nll": []}
        for r0 in range(0, len(targets), _CHUNK_ROWS):
            r1 = min(len(targets), r0 + _CHUNK_ROWS)
            top = torch.from_numpy(ref.topk_ids[a + r0 : a + r1].astype(np.int64))
            red = self._softmax.reduce(logits[r0:r1], top=top)
            lp = ref.topk_logprobs[a + r0 : a + r1].astype(np.float64)
            kl = (np.exp(lp) * (lp - (_gather(red.logits, top) - red.shift[:, None]))).sum(axis=1)
            tail_p = ref.tail_logprob[a + r0 : a + r1].astype(np.float64)
            has_tail = np.isfinite(tail_p)
            safe_p = np.where(has_tail, tail_p, 0.0)
            # A candidate tail that underflows float32 (below e^-87 of its peak) counts as that small, not 0.
            tail_q = np.maximum(red.tail_log, _LOG_FLOOR)
            kl += np.where(has_tail, np.exp(safe_p) * (safe_p - tail_q), 0.0)
            out["kl"].append(np.maximum(kl, 0.0))
            out["same"].append(red.argmax == top[:, 0].numpy())
            out["nll"].append(red.shift - red.logits.numpy()[np.arange(r1 - r0), targets[r0:r1]])
        self._rows[index] = {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}

    def result(self) -> ReferenceAgreement:
        """Figures over the selected sequences; IntegrityError when one was not added."""
        missing = [i for i in self.indices if i not in self._rows]
        if missing:
            raise IntegrityError(f"no candidate logits for sequence(s) {missing[:5]}")
        rows = np.concatenate([np.arange(self._offsets[i], self._offsets[i + 1]) for i in self.indices])
        if rows.size == 0:
            raise InputError("the selected sequences predict no token")
        kl = np.concatenate([self._rows[i]["kl"] for i in self.indices])
        ref = self.ref
        stats = AgreementStats(
            n_positions=int(rows.size),
            top1_agreement=float(np.concatenate([self._rows[i]["same"] for i in self.indices]).mean()),
            mean_kl=float(kl.mean()),
            p90_kl=float(np.quantile(kl, 0.9)),
            max_kl=float(kl.max()),
            source_nll=float(-ref.target_logprob[rows].astype(np.float64).mean()),
            candidate_nll=float(np.concatenate([self._rows[i]["nll"] for i in self.indices]).mean()),
            uniform_kl=float((np.log(ref.n_vocab) - ref.entropy[rows].astype(np.float64)).mean()),
        )
        tail = np.exp(ref.tail_logprob[rows].astype(np.float64))
        return ReferenceAgreement(stats, float(tail.mean()), ref.top_k)


def score_gguf(
    path: Path,
    ref: SourceReference,
    names: Sequence[str] | None = None,
    *,
    n_threads: int = 2,
    n_gpu_layers: int = 0,
) -> ReferenceAgreement:
    """Run a candidate GGUF in llama.cpp on the reference's own token ids and score it.

    The candidate is not re-tokenized: it must share the source's vocabulary (IntegrityError
    when its vocabulary size differs).
    """
    from pipeline.calibration.llama_session import LlamaSession

    scorer = ReferenceScorer(ref, names)
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
