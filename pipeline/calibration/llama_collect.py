"""Activation statistics from llama.cpp itself: its eval callback sees every matrix product's input.

Works for every architecture llama.cpp runs, from the GGUF file alone (a GGUF source as it is,
an HF source through a 16-bit GGUF of it). As ``llama-imatrix`` does (tools/imatrix), the
callback asks for the nodes that are MUL_MAT or MUL_MAT_ID products with a weight of a block
(``blk.*``) as source 0 and an F32 activation as source 1; source 1's rows are the weight's
inputs. A MUL_MAT_ID (stacked experts) row is counted for the expert ``ids`` (source 2) routed
it to. Every position of every sequence is an output whenever the last block's weights are
collected or a reference is built: with fewer outputs llama.cpp drops the other rows before the
last block's feed-forward (and skips most of the output head, the bulk of the work for a large
vocabulary, which is why a run for earlier blocks alone asks for the last position only).

The same pass can hand each sequence's logits to a `reference.ReferenceBuilder`, so the
source's reference answers cost no second run.

Example::

    stats = ActivationStats(gram_for=lambda n: n.endswith("attn_output.weight"))
    report = collect_with_llama_cpp(gguf_path, seqs, stats, gram_dir=workdir / "gram")
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pipeline.calibration.ggml_abi import (
    GGML_OP_MUL_MAT,
    GGML_OP_MUL_MAT_ID,
    GGML_TYPE_F32,
    GGMLTensor,
    ggml_library,
    tensor_array,
    weight_name,
)
from pipeline.calibration.sequences import TokenSequences
from pipeline.calibration.stats import ActivationStats
from pipeline.core.errors import IntegrityError, PipelineError

if TYPE_CHECKING:
    from pipeline.calibration.reference import ReferenceBuilder

__all__ = ["CollectReport", "collect_with_llama_cpp", "write_grams"]

_BLOCK_PREFIX = "blk."


@dataclass(frozen=True)
class CollectReport:
    """How a calibration run went: engine, device, sequences and tokens, wall time, weights seen."""

    engine: str
    device: str
    n_sequences: int
    n_tokens: int
    seconds: float
    n_weights: int
    gram_files: tuple[Path, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        """Calibration tokens per second of wall time."""
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0


class _Callback:
    """The eval callback: picks weight products, feeds their inputs to `stats`; never raises into C."""

    def __init__(self, stats: ActivationStats, weights: Collection[str] | None) -> None:
        from llama_cpp import llama_cpp as lib

        ggml_library()  # checks the struct mirror before any pointer is read through it
        self.stats, self.weights = stats, weights
        self.error: BaseException | None = None
        # With ``stop_when_done``, the weights still to be seen in the current decode: once none is
        # left the callback stops the graph (the rest would be computed for nothing).
        self.pending: set[str] | None = None
        self.is_active = True  # False while a sequence runs only for its logits
        self.notes: set[str] = set()
        self.function = lib.ggml_backend_sched_eval_callback(self._on_node)

    def _on_node(self, pointer: int, ask: bool, _user_data: Any) -> bool:
        try:
            return self._handle(GGMLTensor.from_address(pointer), bool(ask))
        except BaseException as exc:  # an exception must not unwind through llama.cpp's C frames
            self.error = exc
            return False  # cancels the graph; the caller re-raises

    def _wanted(self, node: GGMLTensor) -> str | None:
        if node.op not in (GGML_OP_MUL_MAT, GGML_OP_MUL_MAT_ID) or not node.src[0] or not node.src[1]:
            return None
        name = weight_name(node.src[0].contents.name)
        if not name.startswith(_BLOCK_PREFIX) or (self.weights is not None and name not in self.weights):
            return None
        if node.src[1].contents.type != GGML_TYPE_F32:
            self.notes.add(f"{name}: input is not F32 (ggml type {node.src[1].contents.type}); not collected")
            return None
        return name

    def _handle(self, node: GGMLTensor, ask: bool) -> bool:
        if not self.is_active:
            return not ask  # asks nothing, so the graph runs unsplit
        name = self._wanted(node)
        if ask:
            return name is not None
        if name is None:
            return True
        self._collect(node, name)
        if self.pending is not None:
            self.pending.discard(name)
            return bool(self.pending)  # False: the scheduler stops computing this graph
        return True

    def _collect(self, node: GGMLTensor, name: str) -> None:
        weight, x = node.src[0].contents, tensor_array(node.src[1].contents)  # x [ne3, ne2, ne1, ne0]
        if node.op == GGML_OP_MUL_MAT_ID:
            self._routed(name, weight, x, tensor_array(node.src[2].contents))
            return
        n2, n3 = int(weight.ne[2]), int(weight.ne[3])
        if n2 * n3 == 1:
            self.stats.add(name, torch.from_numpy(x.reshape(-1, x.shape[-1])))
            return
        # A stacked weight in a plain product: activation slice (i3, i2) meets matrix (i3 % n3, i2 % n2).
        for i3 in range(x.shape[0]):
            for i2 in range(x.shape[1]):
                rows = torch.from_numpy(np.ascontiguousarray(x[i3, i2]))
                mat = torch.full((rows.shape[0],), (i3 % n3) * n2 + (i2 % n2), dtype=torch.int64)
                self.stats.add_routed(name, rows, mat, n2 * n3)

    def _routed(
        self, name: str, weight: GGMLTensor, x: np.ndarray[Any, Any], ids: np.ndarray[Any, Any]
    ) -> None:
        # x [1, n_tokens, n_used or 1, cols]; ids [1, 1, n_tokens, n_used]: token t's idx-th expert.
        n_expert = int(weight.ne[2])
        experts = ids.reshape(ids.shape[-2], ids.shape[-1])
        rows_per_token = x.shape[-2]
        for idx in range(experts.shape[1]):
            rows = torch.from_numpy(np.ascontiguousarray(x[0, :, idx % rows_per_token, :]))
            self.stats.add_routed(name, rows, torch.from_numpy(experts[:, idx].astype(np.int64)), n_expert)
        if self.stats.gram_for(name):
            self.notes.add(f"{name}: Gram matrices of stacked experts are not collected")


def write_grams(stats: ActivationStats, gram_dir: Path, names: Collection[str] | None = None) -> list[Path]:
    """Write (and free) the Gram matrices in ``stats`` into ``gram_dir``, one file per block."""
    from pipeline.calibration.gram import gram_file_name, write_gram_file

    by_file: dict[str, list[str]] = defaultdict(list)
    for name in names if names is not None else stats.names():
        by_file[gram_file_name(name)].append(name)
    paths = []
    for file_name, group in sorted(by_file.items()):
        grams = stats.take_grams(group)
        if grams:
            paths.append(write_gram_file(Path(gram_dir) / file_name, grams))
    return paths


def collect_with_llama_cpp(
    gguf_path: Path,
    sequences: TokenSequences,
    stats: ActivationStats,
    *,
    reference: ReferenceBuilder | None = None,
    weights: Collection[str] | None = None,
    gram_dir: Path | None = None,
    n_threads: int = 2,
    n_gpu_layers: int = 0,
    is_f32_cache: bool = False,
    on_sequence: Callable[[int, int], None] | None = None,
    stats_for: Collection[int] | None = None,
) -> CollectReport:
    """Run every sequence through llama.cpp, adding each block weight's inputs to ``stats``.

    ``stats_for``: indices of the sequences whose inputs count (all when None); the others run for
    the ``reference`` only (an agreement text must reach the reference, never the statistics).

    ``weights``: only these weight names (all block weights when None); without a ``reference``
    each decode then stops as soon as they are all seen (a run for block 3 of 18 computes 4).
    ``reference``: gets each sequence's logits. ``gram_dir``: where the Gram matrices
    ``stats.gram_for`` asks for are written at the end (held in memory until then: ``cols²``
    float64 per weight).
    ``on_sequence(done, total)`` reports progress. Raises IntegrityError when llama.cpp cannot
    load or run the file, or its ggml differs from `ggml_abi`'s mirror.
    """
    if not sequences.ids:
        raise IntegrityError("no sequences to calibrate on")
    from pipeline.calibration.llama_session import LlamaSession

    callback = _Callback(stats, None if weights is None else frozenset(weights))
    n_ctx = max(len(ids) for ids in sequences.ids)
    started = time.perf_counter()
    with LlamaSession(
        gguf_path,
        n_ctx=n_ctx,
        n_threads=n_threads,
        n_gpu_layers=n_gpu_layers,
        eval_callback=callback.function,
        is_f32_cache=is_f32_cache,
    ) as session:
        last_block = f"{_BLOCK_PREFIX}{session.n_layer - 1}."
        all_positions = (
            reference is not None or weights is None or any(w.startswith(last_block) for w in weights)
        )
        # Only some weights and no logits wanted: stop each decode once they are all seen.
        stop_early = reference is None and weights is not None
        for index, ids in enumerate(sequences.ids):
            callback.is_active = stats_for is None or index in stats_for
            if not callback.is_active and reference is None:
                continue
            callback.pending = set(weights) if stop_early and weights is not None else None
            try:
                logits = session.logits(ids, all_positions)
            except PipelineError:
                if callback.error is not None:
                    raise callback.error from None
                raise
            if callback.error is not None:
                raise callback.error
            if reference is not None:
                reference.add(index, logits)
            if on_sequence is not None:
                on_sequence(index + 1, len(sequences.ids))
    seconds = time.perf_counter() - started
    paths = write_grams(stats, gram_dir) if gram_dir is not None else []
    return CollectReport(
        engine="llama.cpp",
        device="gpu" if n_gpu_layers else "cpu",
        n_sequences=len(sequences.ids),
        n_tokens=sequences.n_tokens,
        seconds=seconds,
        n_weights=len(stats.names()),
        gram_files=tuple(paths),
        notes=tuple(sorted(callback.notes)),
    )
