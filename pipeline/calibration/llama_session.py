"""One GGUF model and one context in llama.cpp (llama-cpp-python's low-level API), run sequence by sequence.

The high-level ``llama_cpp.Llama`` hides the context parameters calibration needs: the eval
callback (``cb_eval``, how `llama_collect` sees every matrix product's input), an F32 KV cache
(so a comparison with a float32 torch forward is not blurred by F16 rounding), and logits for
every position of a batch. This wraps the C API and frees what it allocates.

llama.cpp's own log lines go to this module's logger at debug level; its error lines are kept
and quoted in the message when loading or decoding fails.

Example::

    with LlamaSession(path, n_ctx=512) as session:
        ids = session.tokenize("Some text.")
        logits = session.logits(ids)      # float32 [len(ids), n_vocab], valid until the next call
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline.core.errors import InputError, IntegrityError

__all__ = ["LlamaSession", "llama_errors"]

log = logging.getLogger(__name__)

_GGML_TYPE_F32 = 0
_FLASH_ATTN_DISABLED = 0  # llama_flash_attn_type: what llama_cpp.Llama uses by default
_GGML_LOG_LEVEL_ERROR, _GGML_LOG_LEVEL_CONT = 4, 5  # enum ggml_log_level
_ERROR_LINES_KEPT = 8
_recent_errors: deque[str] = deque(maxlen=_ERROR_LINES_KEPT)
_state: dict[str, Any] = {}


def llama_errors() -> str:
    """llama.cpp's most recent error lines, joined (empty when there are none)."""
    return " | ".join(line.strip() for line in _recent_errors if line.strip())


def _llama() -> Any:
    """The llama_cpp module, initialised once, with llama.cpp's log routed to Python logging."""
    if "lib" in _state:
        return _state["lib"]
    try:
        from llama_cpp import llama_cpp as lib
    except ImportError as exc:  # pragma: no cover - a dependency of the project
        raise InputError(f"llama-cpp-python is not installed: {exc}") from exc

    @lib.llama_log_callback  # type: ignore[untyped-decorator]
    def on_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
        line = text.decode("utf-8", errors="replace")
        if level == _GGML_LOG_LEVEL_CONT:
            level = _state.get("last_level", 0)
        _state["last_level"] = level
        if level == _GGML_LOG_LEVEL_ERROR:
            _recent_errors.append(line)
        log.debug("llama.cpp: %s", line.rstrip())

    lib.llama_backend_init()
    lib.llama_log_set(on_log, ctypes.c_void_p(0))
    _state["lib"], _state["on_log"] = lib, on_log  # the callback must outlive every call into C
    return lib


class LlamaSession:
    """A loaded model (and, unless ``vocab_only``, one context of ``n_ctx`` tokens); a context manager.

    ``eval_callback``: a ``ggml_backend_sched_eval_callback`` (kept alive by this object).
    ``is_f32_cache``: K and V cached as F32 instead of F16. Raises IntegrityError when llama.cpp
    cannot load the file or make the context.
    """

    def __init__(
        self,
        path: Path,
        *,
        n_ctx: int = 512,
        n_threads: int = 2,
        n_gpu_layers: int = 0,
        eval_callback: Any = None,
        is_f32_cache: bool = False,
        vocab_only: bool = False,
    ) -> None:
        self.path, self.n_ctx = Path(path), int(n_ctx)
        self._lib = lib = _llama()
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = int(n_gpu_layers)
        model_params.vocab_only = bool(vocab_only)
        _recent_errors.clear()
        self._model = lib.llama_model_load_from_file(str(self.path).encode("utf-8"), model_params)
        if not self._model:
            raise IntegrityError(
                f"llama.cpp could not load {self.path.name}: {llama_errors() or 'no reason given'}"
            )
        self._vocab = lib.llama_model_get_vocab(self._model)
        self._ctx: Any = None
        self._batch: Any = None
        self._callback = eval_callback
        if not vocab_only:
            self._open_context(n_threads, eval_callback, is_f32_cache)

    def _open_context(self, n_threads: int, eval_callback: Any, is_f32_cache: bool) -> None:
        lib = self._lib
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = self.n_ctx
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = int(n_threads)
        params.flash_attn_type = _FLASH_ATTN_DISABLED
        if is_f32_cache:
            params.type_k = params.type_v = _GGML_TYPE_F32
        if eval_callback is not None:
            params.cb_eval = eval_callback
            params.cb_eval_user_data = None
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            self.close()
            raise IntegrityError(
                f"llama.cpp could not make a {self.n_ctx}-token context for {self.path.name}: "
                f"{llama_errors() or 'no reason given'}"
            )
        self._batch = lib.llama_batch_init(self.n_ctx, 0, 1)

    def __enter__(self) -> LlamaSession:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Free the batch, the context and the model (idempotent)."""
        lib = self._lib
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None

    @property
    def n_vocab(self) -> int:
        """Tokens in the model's vocabulary (= logits per position)."""
        return int(self._lib.llama_vocab_n_tokens(self._vocab))

    @property
    def bos(self) -> int | None:
        """The id llama.cpp puts first when it adds BOS, or None when this vocabulary adds none."""
        if not self._lib.llama_vocab_get_add_bos(self._vocab):
            return None
        return int(self._lib.llama_vocab_bos(self._vocab))

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text`` (BOS first when the vocabulary adds it); special-token text is not parsed."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (self._lib.llama_token * capacity)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, False)
        if n < 0:  # pragma: no cover - a token per byte plus specials always fits
            raise IntegrityError(f"{self.path.name}: tokenizing needs {-n} tokens, more than {capacity}")
        return [int(t) for t in buf[:n]]

    @property
    def n_layer(self) -> int:
        """Transformer blocks of the model."""
        return int(self._lib.llama_model_n_layer(self._model))

    def logits(self, ids: list[int] | tuple[int, ...], all_positions: bool = True) -> npt.NDArray[np.float32]:
        """Logits ``[len(ids), n_vocab]`` of one sequence decoded from an empty cache in one batch.

        ``all_positions=False``: only the last position's, ``[1, n_vocab]``; llama.cpp then also
        skips the other positions in the last block's feed-forward and output head (much faster
        for a large vocabulary). A view of llama.cpp's buffer: valid until the next call.
        Raises InputError for a sequence longer than ``n_ctx`` or empty, IntegrityError when
        decoding fails (or the eval callback stopped it).
        """
        if self._ctx is None:
            raise InputError(f"{self.path.name} was opened vocab-only; it cannot be run")
        n = len(ids)
        if not 0 < n <= self.n_ctx:
            raise InputError(f"a sequence of {n} tokens does not fit a {self.n_ctx}-token context")
        lib, batch = self._lib, self._batch
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)
        for i, token in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(token), i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if all_positions or i == n - 1 else 0
        batch.n_tokens = n
        _recent_errors.clear()
        status = lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise IntegrityError(
                f"llama.cpp could not decode {n} tokens with {self.path.name} (status {status}): "
                f"{llama_errors() or 'no reason given'}"
            )
        pointer = lib.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(pointer, shape=(n if all_positions else 1, self.n_vocab))
