"""Activation statistics per linear weight, accumulated over calibration tokens.

For a weight ``W`` [rows, cols] applied as ``y = W x`` to input rows ``x`` [cols]:

- ``sum_sq`` [n_mat, cols]: the sum over tokens of ``x_j²`` per input column (float64); with
  ``counts`` [n_mat] (tokens seen) it gives the importance matrix ``sum_sq / count``, the mean
  of x² that llama.cpp's imatrix holds and the importance-weighted fits use. ``n_mat`` is 1 for
  a plain matrix and the expert count for stacked expert weights (MUL_MAT_ID), each expert
  counting only the tokens routed to it.
- ``gram`` [cols, cols], when asked for that weight: ``XᵀX`` over the same tokens (float64),
  what error-compensating fits (`pipeline.ternary.gptq`) need. Plain matrices only.

Accumulation is in float64 on the collector's device (CPU or CUDA). Several weights often read
the same input (q/k/v, gate/up): `add` with several names, or the same rows twice in a row,
computes the increments once.

Example::

    stats = ActivationStats(gram_for=lambda name: name.endswith("ffn_down.weight"))
    stats.add(["blk.0.attn_q.weight", "blk.0.attn_k.weight"], rows)      # rows [n, cols]
    stats.importance("blk.0.attn_q.weight")                              # float32 [1, cols]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from pipeline.core.errors import IntegrityError

__all__ = ["WeightStats", "ActivationStats", "NO_GRAM"]


def NO_GRAM(name: str) -> bool:  # noqa: N802 - a constant-like default predicate
    """The default `gram_for`: no Gram matrices."""
    return False


@dataclass
class WeightStats:
    """Sums for one weight: ``sum_sq`` float64 [n_mat, cols], ``counts`` int64 [n_mat], ``gram`` or None."""

    sum_sq: torch.Tensor
    counts: torch.Tensor
    gram: torch.Tensor | None = None

    @property
    def cols(self) -> int:
        """Input columns of the weight."""
        return int(self.sum_sq.shape[1])


class ActivationStats:
    """The statistics of one calibration run, keyed by GGUF weight name (``blk.0.attn_q.weight``)."""

    def __init__(self, device: str | torch.device = "cpu", gram_for: Callable[[str], bool] = NO_GRAM) -> None:
        self.device = torch.device(device)
        self.gram_for = gram_for
        self.entries: dict[str, WeightStats] = {}
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> WeightStats:
        return self.entries[name]

    def names(self) -> list[str]:
        """Weight names in the order they were first seen."""
        return list(self.entries)

    def _entry(self, name: str, cols: int, n_mat: int) -> WeightStats:
        entry = self.entries.get(name)
        if entry is None:
            entry = WeightStats(
                torch.zeros((n_mat, cols), dtype=torch.float64, device=self.device),
                torch.zeros(n_mat, dtype=torch.int64, device=self.device),
            )
            self.entries[name] = entry
        elif entry.sum_sq.shape != (n_mat, cols):
            raise IntegrityError(
                f"weight {name!r}: inputs of {n_mat} x {cols} columns after {tuple(entry.sum_sq.shape)} "
                "before; "
                "one weight must always see inputs of one width"
            )
        return entry

    def _increments(self, rows: torch.Tensor, is_gram: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        last = self._last
        same = last is not None and (
            last[0] is rows or (last[0].shape == rows.shape and bool(torch.equal(last[0], rows)))
        )
        if last is not None and same and (last[2] is not None or not is_gram):
            return last[1], last[2]
        x = rows.to(self.device, torch.float64)
        sum_sq = (x * x).sum(dim=0)
        gram = x.T @ x if is_gram else None
        self._last = (rows, sum_sq, gram)
        return sum_sq, gram

    def add(self, names: str | Sequence[str], rows: torch.Tensor) -> None:
        """Add input rows ``[n_tokens, cols]`` (any float dtype, any device) read by each named weight."""
        if isinstance(names, str):
            names = [names]
        if rows.ndim != 2:
            raise ValueError(f"rows must be [n_tokens, cols], got shape {tuple(rows.shape)}")
        is_gram = any(self.gram_for(n) for n in names)
        sum_sq, gram = self._increments(rows, is_gram)
        for name in names:
            entry = self._entry(name, rows.shape[1], 1)
            entry.sum_sq[0] += sum_sq
            entry.counts[0] += rows.shape[0]
            if gram is not None and self.gram_for(name):
                entry.gram = gram.clone() if entry.gram is None else entry.gram.add_(gram)

    def add_routed(self, name: str, rows: torch.Tensor, experts: torch.Tensor, n_expert: int) -> None:
        """Add rows ``[n, cols]`` that went to stacked expert ``experts[i]`` (int [n]) of ``n_expert``."""
        entry = self._entry(name, rows.shape[1], n_expert)
        x = rows.to(self.device, torch.float64)
        index = experts.to(self.device, torch.int64)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n_expert):
            raise IntegrityError(f"weight {name!r}: expert ids outside 0..{n_expert - 1}")
        entry.sum_sq.index_add_(0, index, x * x)
        entry.counts += torch.bincount(index, minlength=n_expert)

    def importance(self, name: str) -> npt.NDArray[np.float32]:
        """Mean x² per input column, float32 [n_mat, cols]; 1.0 where a matrix saw no token (as llama.cpp)."""
        entry = self.entries[name]
        counts = entry.counts.to(torch.float64).unsqueeze(1)
        mean = torch.where(counts > 0, entry.sum_sq / counts.clamp_min(1), torch.ones_like(entry.sum_sq))
        return mean.to(torch.float32).cpu().numpy()

    def sums_and_counts(self) -> dict[str, tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]]:
        """name -> (sum_sq float32 [n_mat, cols], counts float32 [n_mat]): what an imatrix file stores."""
        return {
            name: (e.sum_sq.to(torch.float32).cpu().numpy(), e.counts.to(torch.float32).cpu().numpy())
            for name, e in self.entries.items()
        }

    def take_grams(self, names: Iterable[str]) -> dict[str, tuple[torch.Tensor, int]]:
        """Remove and return name -> (gram float64 [cols, cols], token count) for the named weights that
        have one, so a streaming collector can write a block's matrices and free them."""
        taken: dict[str, tuple[torch.Tensor, int]] = {}
        for name in names:
            entry = self.entries.get(name)
            if entry is not None and entry.gram is not None:
                taken[name] = (entry.gram, int(entry.counts[0]))
                entry.gram = None
        self._last = None
        return taken

    def token_counts(self) -> Mapping[str, int]:
        """name -> tokens seen (summed over experts for stacked weights)."""
        return {name: int(e.counts.sum()) for name, e in self.entries.items()}
