"""The source model's next-token answers on given texts, computed once and stored compactly.

Per position ``i`` of each sequence (predicting token ``i + 1``; a sequence's last position
predicts nothing and is not kept), from the source's full distribution ``p``:

- ``topk_ids`` / ``topk_logprobs`` [P, k]: the ``k`` most likely tokens and their exact log p,
  most likely first (ties: lower id first, as numpy's argmax picks);
- ``tail_logprob`` [P]: log of the mass ``p_tail`` outside those ``k`` (-inf when none);
- ``tail_ids`` / ``tail_logprobs`` [P, m]: ``m`` tokens drawn (with replacement, seeded) from
  ``p`` restricted to the tail, and their exact log p;
- ``entropy`` [P] (nats) and ``target_logprob`` [P] (log p of the actual next token), exact.

That is enough for every figure of `predictions.AgreementStats` against a candidate's full
logits (`agreement.ReferenceScorer`): top-1 agreement, both log-perplexities and the uniform
yardstick exactly, and KL(p || q) split into its top-k part (exact) and its tail part
``Σ_tail p_j log(p_j / q_j) = p_tail · E_{j ~ p(.|tail)}[log(p_j / q_j)]``, estimated without
bias from the stored tail draws. The top-k part plus ``p_tail log(p_tail / q_tail)`` is also
reported: the KL of the two distributions coarsened to k + 1 outcomes, a lower bound of the KL
(log-sum inequality) whose gap is the divergence inside the tail; on Gemma 3 270M it misses
about a fifth of the KL at k = 64 (bench/calibration.py), which is why the draws exist.

Artifact: a ``.npz`` (no pickles) with those arrays, the sequences' token ids and a JSON header
(format, k, m, vocabulary size, text names, the caller's ``info`` such as the source digest).

Example::

    builder = ReferenceBuilder(seqs, top_k=64, tail_samples=64)
    collect_with_llama_cpp(source_gguf, seqs, stats, reference=builder)   # or any logits source
    write_reference(workdir / "reference.npz", builder.build({"source_sha256": digest}))
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pipeline.calibration.sequences import TokenSequences
from pipeline.core.errors import InputError, IntegrityError

__all__ = ["REFERENCE_FORMAT", "SourceReference", "ReferenceBuilder", "write_reference", "read_reference"]

REFERENCE_FORMAT = "bonsai-source-reference/2"
_CHUNK_ROWS = 32  # rows of [n_vocab] float32 at a time (262k vocabulary: 32 MB per array)
_ARRAYS = (
    "topk_ids",
    "topk_logprobs",
    "tail_logprob",
    "tail_ids",
    "tail_logprobs",
    "entropy",
    "target_logprob",
)
_WIDE = {
    "topk_ids": "top_k",
    "topk_logprobs": "top_k",
    "tail_ids": "tail_samples",
    "tail_logprobs": "tail_samples",
}
F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class SourceReference:
    """Reference answers for ``sequences``; rows ``offsets[s]:offsets[s + 1]`` belong to sequence ``s``."""

    sequences: TokenSequences
    n_vocab: int
    top_k: int
    tail_samples: int
    topk_ids: npt.NDArray[np.int32]
    topk_logprobs: F32
    tail_logprob: F32
    tail_ids: npt.NDArray[np.int32]
    tail_logprobs: F32
    entropy: F32
    target_logprob: F32
    info: Mapping[str, Any] = field(default_factory=dict)

    @property
    def offsets(self) -> npt.NDArray[np.int64]:
        """Row offsets per sequence, [n_sequences + 1]."""
        lengths = [max(len(s) - 1, 0) for s in self.sequences.ids]
        return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


@dataclass(frozen=True)
class ReducedRows:
    """One chunk of rows reduced: ``log p_j = logits_j - shift``; ``top`` the top-k ids (int64 [r, k]);
    ``tail_log`` log of the mass outside ``top``; ``entropy`` in nats (None unless asked); ``argmax``."""

    logits: torch.Tensor
    shift: npt.NDArray[np.float64]
    top: torch.Tensor
    tail_log: npt.NDArray[np.float64]
    entropy: npt.NDArray[np.float64] | None
    argmax: npt.NDArray[np.int64]
    tail_exp: torch.Tensor  # exp(l - max) with the top entries zeroed: the tail, unnormalised


class SoftmaxRows:
    """Softmax reductions over chunks of ``[r, n_vocab]`` logits in reused buffers (torch, all cores).

    One exp pass per chunk; sums in float32 (torch sums blockwise: ~1e-7 relative), turned into
    float64 for the logs. The tail mass is summed over the tail itself, not as 1 - sum(top).
    """

    def __init__(self) -> None:
        self._shifted: torch.Tensor | None = None
        self._exp: torch.Tensor | None = None

    def reduce(
        self, rows: npt.NDArray[Any], top_k: int = 0, top: torch.Tensor | None = None, entropy: bool = False
    ) -> ReducedRows:
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
        return ReducedRows(logits, shift, top, tail_log, ent, logits.argmax(dim=1).numpy(), exp)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64 [r, k]) of the k largest per row, largest first, ties to the lower index."""
    values, index = torch.topk(logits, k, dim=1, largest=True, sorted=True)
    # topk does not promise an order among equal values; numpy's argmax takes the lowest index.
    key = torch.from_numpy(np.lexsort((index.numpy(), -values.numpy()), axis=1))
    return torch.gather(index, 1, key)


def gather_rows(values: torch.Tensor, index: torch.Tensor) -> npt.NDArray[np.float64]:
    """``values[r, index[r, j]]`` as float64 numpy."""
    out: npt.NDArray[np.float64] = torch.gather(values, 1, index).double().numpy()
    return out


class ReferenceBuilder:
    """Collects the source's logits sequence by sequence (`add`), keeping only the reference figures.

    ``tail_samples`` draws per position from the tail; the draws are seeded by ``seed`` and the
    sequence index, so the same logits give the same reference.
    """

    def __init__(
        self, sequences: TokenSequences, top_k: int = 64, tail_samples: int = 64, seed: int = 0
    ) -> None:
        if top_k < 1 or tail_samples < 1:
            raise InputError(f"top_k ({top_k}) and tail_samples ({tail_samples}) must be at least 1")
        self.sequences, self.top_k, self.tail_samples, self.seed = (
            sequences,
            int(top_k),
            int(tail_samples),
            seed,
        )
        self.n_vocab: int | None = None
        self._parts: dict[int, dict[str, npt.NDArray[Any]]] = {}
        self._softmax = SoftmaxRows()

    def _check(self, index: int, logits: npt.NDArray[Any]) -> None:
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

    def _draw(self, red: ReducedRows, generator: torch.Generator) -> torch.Tensor:
        """``tail_samples`` ids per row from the tail's own distribution (the top token where it is empty)."""
        empty = ~np.isfinite(red.tail_log)
        weights = red.tail_exp
        if empty.any():
            weights = weights.clone()
            weights[torch.from_numpy(empty)] = 1.0  # any valid draw: its weight p_tail is 0
        drawn = torch.multinomial(weights, self.tail_samples, replacement=True, generator=generator)
        if empty.any():
            drawn[torch.from_numpy(empty)] = red.top[torch.from_numpy(empty), :1]
        return drawn

    def add(self, index: int, logits: npt.NDArray[Any]) -> None:
        """The source's logits ``[len(sequence), n_vocab]`` for sequence ``index``."""
        self._check(index, logits)
        parts: dict[str, list[npt.NDArray[Any]]] = {name: [] for name in _ARRAYS}
        targets = np.asarray(self.sequences.ids[index][1:], dtype=np.int64)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        for r0 in range(0, len(targets), _CHUNK_ROWS):
            r1 = min(len(targets), r0 + _CHUNK_ROWS)
            red = self._softmax.reduce(logits[r0:r1], top_k=self.top_k, entropy=True)
            assert red.entropy is not None
            drawn = self._draw(red, generator)
            parts["topk_ids"].append(red.top.numpy().astype(np.int32))
            parts["topk_logprobs"].append(gather_rows(red.logits, red.top) - red.shift[:, None])
            parts["tail_logprob"].append(red.tail_log)
            parts["tail_ids"].append(drawn.numpy().astype(np.int32))
            parts["tail_logprobs"].append(gather_rows(red.logits, drawn) - red.shift[:, None])
            parts["entropy"].append(red.entropy)
            parts["target_logprob"].append(red.logits.numpy()[np.arange(r1 - r0), targets[r0:r1]] - red.shift)
        self._parts[index] = {name: np.concatenate(chunks) for name, chunks in parts.items()}

    def build(self, info: Mapping[str, Any] | None = None) -> SourceReference:
        """The reference of every sequence; IntegrityError when one was never added."""
        missing = [i for i in range(len(self.sequences.ids)) if i not in self._parts]
        if missing or self.n_vocab is None:
            raise IntegrityError(
                f"no source logits for sequence(s) {missing[:5]} of {len(self.sequences.ids)}"
            )
        order = range(len(self.sequences.ids))
        joined = {name: np.concatenate([self._parts[i][name] for i in order]) for name in _ARRAYS}
        return SourceReference(
            sequences=self.sequences,
            n_vocab=self.n_vocab,
            top_k=self.top_k,
            tail_samples=self.tail_samples,
            info=dict(info or {}),
            **_typed(joined),
        )


def _typed(arrays: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
    return {name: arrays[name].astype(np.int32 if name.endswith("_ids") else np.float32) for name in _ARRAYS}


def write_reference(dest: Path, ref: SourceReference) -> Path:
    """Write ``ref`` as a compressed ``.npz`` at ``dest`` (atomically); returns ``dest``."""
    header = {
        "format": REFERENCE_FORMAT,
        "n_vocab": ref.n_vocab,
        "top_k": ref.top_k,
        "tail_samples": ref.tail_samples,
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
    n_rows = int(np.maximum(lengths - 1, 0).sum())
    for name in _ARRAYS:
        want = (n_rows, int(header[_WIDE[name]])) if name in _WIDE else (n_rows,)
        if arrays[name].shape != want:
            raise IntegrityError(f"{label}: {name} has shape {arrays[name].shape}, expected {want}")
    return SourceReference(
        sequences=TokenSequences(tuple(str(n) for n in names), ids),
        n_vocab=int(header["n_vocab"]),
        top_k=int(header["top_k"]),
        tail_samples=int(header["tail_samples"]),
        info=header.get("info") or {},
        **_typed(arrays),
    )
