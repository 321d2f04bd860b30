"""The probe's child process: load one GGUF in llama.cpp, run what the request asks, write the result.

`probe.ProbeProcess` starts it as ``python -c "...probe_child import main; main()"``; the
request arrives on stdin once the file is ready (see `probe` for what is run and why in a child).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.calibration.probe import Backend, ChatReply, Completion, ProbeResult, TextRun

__all__ = ["main"]

_MAX_LOG_LINES = 40
_MAX_LOG_LINE_CHARS = 400
# ggml.h's ggml_log_level: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous
# line's level). llama-cpp-python's own logger still maps 3 to ERROR, so it hides real errors.
_LOG_WARN, _LOG_ERROR, _LOG_CONT = 3, 4, 5


def _greedy(model: Any, prompt: str, max_tokens: int) -> Completion:
    prompt_ids = model.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
    generated: list[int] = []
    started = time.perf_counter()
    model.reset()
    for token in model.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0):
        if token == model.token_eos():
            break
        generated.append(int(token))
        if len(generated) >= max_tokens:
            break
    gen_s = time.perf_counter() - started
    return Completion(
        prompt=prompt,
        text=model.detokenize(generated).decode("utf-8", errors="replace"),
        tokens=tuple(generated),
        prompt_tokens=len(prompt_ids),
        gen_s=round(gen_s, 4),
        tokens_per_s=round(len(generated) / gen_s, 2) if gen_s > 0 and generated else None,
    )


def _chat(model: Any, prompt: str, max_tokens: int, seed: int) -> ChatReply:
    import numpy as np

    # The chat API returns text only. Greedy sampling takes the arg-max of the logits, and a logits
    # processor sees them at every step (first in the sampler chain, indexed by token id), so it
    # records the ids actually generated: re-tokenizing the text would turn distinct byte tokens
    # rendered as U+FFFD into one repeated token.
    sampled: list[int] = []

    def record(_input_ids: Any, logits: Any) -> Any:
        sampled.append(int(np.argmax(logits)))
        return logits

    started = time.perf_counter()
    reply = model.create_chat_completion(
        messages=[{"role": "user", "content": prompt}],
        temperature=0.0,
        top_k=1,
        top_p=1.0,
        min_p=0.0,
        repeat_penalty=1.0,
        max_tokens=max_tokens,
        seed=seed,
        logits_processor=[record],
    )
    text = reply["choices"][0]["message"]["content"] or ""
    n_generated = min(int((reply.get("usage") or {}).get("completion_tokens") or 0), max_tokens)
    tokens = sampled[:n_generated]
    is_sampled = bool(tokens) and len(sampled) >= n_generated
    if not is_sampled:
        tokens = model.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    return ChatReply(
        prompt=prompt,
        text=text,
        tokens=tuple(int(t) for t in tokens),
        tokens_source="sampled" if is_sampled else "retokenized",
        finish_reason=reply["choices"][0].get("finish_reason"),
        gen_s=round(time.perf_counter() - started, 4),
    )


def _text_logits(model: Any, text: str, n_ctx: int, logits_path: str) -> TextRun:
    import numpy as np

    tokens = model.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    is_truncated = len(tokens) > n_ctx
    tokens = tokens[:n_ctx]
    started = time.perf_counter()
    model.reset()
    model.eval(tokens)
    np.save(logits_path, np.asarray(model.scores[: len(tokens)], dtype=np.float32))
    return TextRun(tokens=tuple(int(t) for t in tokens), is_truncated=is_truncated,
                   eval_s=round(time.perf_counter() - started, 4))


def _backend(llama_cpp: Any, n_gpu_layers: int, offload_why: str) -> Backend:
    offload = bool(llama_cpp.llama_supports_gpu_offload())
    return Backend(
        llama_cpp_python=llama_cpp.__version__,
        supports_gpu_offload=offload,
        n_gpu_layers=n_gpu_layers,
        offload_why=offload_why,
        device="gpu" if offload and n_gpu_layers != 0 else "cpu",
        system_info=llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip(),
    )


def _probe(request: dict[str, Any], logits_path: str) -> ProbeResult:
    """Load the model and run everything requested; the child process's whole job."""
    import llama_cpp

    from pipeline.calibration.gpu_offload import choose_offload

    offload = choose_offload(Path(request["path"]), request["n_gpu_layers"])
    started = time.perf_counter()
    model = llama_cpp.Llama(
        model_path=request["path"],
        n_ctx=request["n_ctx"],
        n_threads=request["n_threads"],
        n_gpu_layers=offload.n_gpu_layers,
        seed=request["seed"],
        logits_all=request["text"] is not None,
        verbose=False,
    )
    load_s = time.perf_counter() - started
    has_template = bool(model.metadata.get("tokenizer.chat_template"))
    completions = tuple(_greedy(model, p, request["max_tokens"]) for p in request["prompts"])
    chat = None
    if request["chat_prompt"] and has_template:
        chat = _chat(model, request["chat_prompt"], request["chat_max_tokens"], request["seed"])
    text = _text_logits(model, request["text"], request["n_ctx"], logits_path) if request["text"] else None
    return ProbeResult(
        load_s=round(load_s, 4),
        n_vocab=model.n_vocab(),
        has_chat_template=has_template,
        completions=completions,
        chat=chat,
        text=text,
        backend=_backend(llama_cpp, offload.n_gpu_layers, offload.why),
        logits_path=logits_path if text is not None else None,
    )


class _LlamaLog:
    """llama.cpp's warning and error lines, captured in the child through ``llama_log_set``."""

    def __init__(self, llama_cpp: Any) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self._last = 0
        self._pending = {_LOG_WARN: "", _LOG_ERROR: ""}
        # Held on the instance: ctypes must keep the callback alive as long as llama.cpp may call it.
        self._callback = llama_cpp.llama_log_callback(self._on_log)
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes | None, user_data: Any) -> None:
        level = self._last if level == _LOG_CONT else level
        self._last = level
        if level not in self._pending or text is None:
            return
        pending = self._pending[level] + text.decode("utf-8", errors="replace")
        *lines, self._pending[level] = pending.split("\n")
        for line in lines:
            self._keep(level, line)

    def _keep(self, level: int, line: str) -> None:
        target = self.errors if level == _LOG_ERROR else self.warnings
        line = " ".join(line.split())  # llama.cpp pads numbers into columns
        if line and len(target) < _MAX_LOG_LINES:
            target.append(line[:_MAX_LOG_LINE_CHARS])

    def document(self) -> dict[str, list[str]]:
        for level, rest in self._pending.items():
            self._keep(level, rest)
            self._pending[level] = ""
        return {"llama_errors": self.errors, "llama_warnings": self.warnings}


def main() -> None:
    """Child entry point: request JSON on stdin; result JSON (and logits) written where it says.

    On failure the child writes ``error_path`` (the exception's one line and llama.cpp's own
    warning and error lines) and exits 2, so the parent never has to show a traceback. Once the
    result is written the child leaves at once: tearing down llama.cpp's model and the
    interpreter would only make the parent wait (its files are closed by then).
    """
    import llama_cpp  # loaded before the request arrives: the parent may still be writing the file

    text = sys.stdin.read()
    if not text.strip():
        return  # the parent closed without a request (it failed before the file was ready)
    request = json.loads(text)
    log = _LlamaLog(llama_cpp)
    try:
        _probe(request["request"], request["logits_path"]).write(Path(request["result_path"]))
    except Exception as exc:  # every failure becomes a message for the parent, not a traceback
        error = {"error": f"{type(exc).__name__}: {exc}"[:_MAX_LOG_LINE_CHARS], **log.document()}
        Path(request["error_path"]).write_text(json.dumps(error), encoding="utf-8")
        sys.exit(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
