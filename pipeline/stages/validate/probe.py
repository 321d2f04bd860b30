"""Run one GGUF file in llama.cpp (llama-cpp-python) in a child process and collect what it does.

A broken file can abort the process that loads it; running it in a child turns that into
a failed check instead of a dead worker. The child loads the model once and, greedily
(temperature 0, repeat penalty 1, so only the logits choose):

- completes each raw prompt (``1+1=``) for up to ``max_tokens`` tokens;
- answers ``chat_prompt`` through the model's own chat template (``tokenizer.chat_template``,
  which llama-cpp-python's ``create_chat_completion`` applies) when the file has one;
- evaluates ``text`` with logits for every position and saves them, float32
  ``[n_tokens, n_vocab]``, as ``.npy`` at ``logits_path`` for the parent to compare.

When llama.cpp refuses the file, the failure names what llama.cpp itself said: the child
captures llama.cpp's warning and error log lines through ``llama_log_set`` (llama-cpp-python
silences them when not verbose and raises only "Failed to load model from file") and hands
them back with the exception's one-line text; no Python traceback reaches the message.

Example::

    result, why = run_probe(ProbeRequest(path=gguf, prompts=("1+1=",), text="The sun rises."), workdir)

A caller that still has to write or check the file starts the child first (`ProbeProcess`), so
Python and llama.cpp load meanwhile.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import IntegrityError
from pipeline.formats.jsonfile import load_json

__all__ = ["ProbeRequest", "ProbeResult", "ProbeProcess", "run_probe", "main"]

_STDERR_TAIL_CHARS = 2000
_MAX_RESULT_BYTES = 16 * 1024 * 1024
_MAX_LOG_LINES = 40
_MAX_LOG_LINE_CHARS = 400
# ggml.h's ggml_log_level: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous
# line's level). llama-cpp-python's own logger still maps 3 to ERROR, so it hides real errors.
_LOG_WARN, _LOG_ERROR, _LOG_CONT = 3, 4, 5
_TRACEBACK_HEAD = "Traceback (most recent call last):"


@dataclass(frozen=True)
class ProbeRequest:
    """What to run; see the module docstring. ``n_gpu_layers=0`` keeps everything on the CPU."""

    path: str
    prompts: tuple[str, ...] = ("1+1=",)
    max_tokens: int = 16
    chat_prompt: str | None = None
    chat_max_tokens: int = 32
    text: str | None = None
    n_ctx: int = 256
    n_threads: int = 2
    n_gpu_layers: int = 0
    seed: int = 0


@dataclass(frozen=True)
class ProbeResult:
    """What llama.cpp did with one file: load time, vocabulary size, completions, chat, the text's
    tokens, the backend; ``logits_path``: where the text's logits (``.npy``) were left, if any.

    Each completion is ``{"prompt", "text", "tokens", "prompt_tokens", "gen_s", "tokens_per_s"}``;
    ``tokens`` are the generated token ids (the chat's too: ``tokens_source`` 'sampled').
    """

    load_s: float
    n_vocab: int
    has_chat_template: bool
    completions: tuple[dict[str, Any], ...]
    chat: dict[str, Any] | None
    text: dict[str, Any] | None
    backend: dict[str, Any]
    logits_path: str | None = None

    def write(self, path: Path) -> None:
        """Write the result as JSON (the child's side)."""
        document = asdict(self)
        document["completions"] = list(self.completions)
        path.write_text(json.dumps(document), encoding="utf-8")

    @classmethod
    def load(cls, path: Path, label: str) -> ProbeResult:
        """Read a child's result; IntegrityError naming `label` when it is malformed."""
        document = load_json(path, f"{label} probe result", max_bytes=_MAX_RESULT_BYTES, error=IntegrityError)
        try:
            return cls(
                load_s=float(document["load_s"]),
                n_vocab=int(document["n_vocab"]),
                has_chat_template=bool(document["has_chat_template"]),
                completions=tuple(dict(c) for c in document["completions"]),
                chat=dict(document["chat"]) if document.get("chat") else None,
                text=dict(document["text"]) if document.get("text") else None,
                backend=dict(document["backend"]),
                logits_path=document.get("logits_path"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"{label} probe result is malformed ({exc!r})") from exc


def _greedy(model: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
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
    return {
        "prompt": prompt,
        "text": model.detokenize(generated).decode("utf-8", errors="replace"),
        "tokens": generated,
        "prompt_tokens": len(prompt_ids),
        "gen_s": round(gen_s, 4),
        "tokens_per_s": round(len(generated) / gen_s, 2) if gen_s > 0 and generated else None,
    }


def _chat(model: Any, prompt: str, max_tokens: int, seed: int) -> dict[str, Any]:
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
    return {
        "prompt": prompt,
        "text": text,
        "tokens": tokens,
        "tokens_source": "sampled" if is_sampled else "retokenized",
        "finish_reason": reply["choices"][0].get("finish_reason"),
        "gen_s": round(time.perf_counter() - started, 4),
    }


def _text_logits(model: Any, text: str, n_ctx: int, logits_path: str) -> dict[str, Any]:
    import numpy as np

    tokens = model.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    is_truncated = len(tokens) > n_ctx
    tokens = tokens[:n_ctx]
    started = time.perf_counter()
    model.reset()
    model.eval(tokens)
    np.save(logits_path, np.asarray(model.scores[: len(tokens)], dtype=np.float32))
    return {"tokens": tokens, "is_truncated": is_truncated, "eval_s": round(time.perf_counter() - started, 4)}


def _backend(llama_cpp: Any, n_gpu_layers: int) -> dict[str, Any]:
    offload = bool(llama_cpp.llama_supports_gpu_offload())
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "supports_gpu_offload": offload,
        "n_gpu_layers": n_gpu_layers,
        "device": "gpu" if offload and n_gpu_layers != 0 else "cpu",
        "system_info": llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip(),
    }


def _probe(request: dict[str, Any], logits_path: str) -> ProbeResult:
    """Load the model and run everything requested; the child process's whole job."""
    import llama_cpp

    started = time.perf_counter()
    model = llama_cpp.Llama(
        model_path=request["path"],
        n_ctx=request["n_ctx"],
        n_threads=request["n_threads"],
        n_gpu_layers=request["n_gpu_layers"],
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
        backend=_backend(llama_cpp, request["n_gpu_layers"]),
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


def _without_traceback(stderr: str) -> str:
    """stderr with any Python traceback reduced to its last line (the exception's own text)."""
    kept: list[str] = []
    in_traceback = False
    for line in stderr.splitlines():
        if line.startswith(_TRACEBACK_HEAD):
            in_traceback = True
            continue
        if in_traceback and (line.startswith(" ") or not line.strip()):
            continue
        in_traceback = False
        kept.append(line)
    return "\n".join(kept).strip()[-_STDERR_TAIL_CHARS:]


def _failure(label: str, returncode: int, stderr: str, error_path: Path) -> str:
    """Why the child failed, in llama.cpp's words where it said anything."""
    head = f"llama.cpp could not load or run the {label} file"
    if not error_path.is_file():
        # The child died before it could write (an abort in ggml, a signal): llama.cpp's own
        # stderr lines, with any Python traceback cut down to its last line.
        return f"{head} (exit {returncode}): {_without_traceback(stderr) or 'no output'}"
    try:
        document = load_json(
            error_path, f"{label} probe error", max_bytes=_MAX_RESULT_BYTES, error=IntegrityError
        )
    except IntegrityError:  # a garbled error file must not hide the failure itself
        document = {}
    if not isinstance(document, dict):
        document = {}
    said = [str(line) for line in document.get("llama_errors") or []]
    said = said or [str(line) for line in (document.get("llama_warnings") or [])[-3:]]
    python = str(document.get("error") or f"exit {returncode}")
    if said:
        return f"{head}; llama.cpp said: {'; '.join(said)}"[: 2 * _STDERR_TAIL_CHARS] + f" ({python})"
    return f"{head}: {python} (llama.cpp logged no error)"


class ProbeProcess:
    """A probe child started before its request: Python and llama.cpp load (~0.25 s) while the caller
    still writes or checks the file. `run` sends the request once; leaving the ``with`` block ends a
    child that was never used.

        with ProbeProcess(workdir, "source") as child:
            path = write_the_file()
            result, why = child.run(ProbeRequest(path=str(path)), timeout_s=120)
    """

    def __init__(self, workdir: Path, label: str = "model") -> None:
        self.label = label
        self.result_path = workdir / f".probe-{label}.json"
        self.logits_path = workdir / f".probe-{label}-logits.npy"
        self.error_path = workdir / f".probe-{label}-error.json"
        # The child must import this same checkout even when it is not pip-installed.
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        code = "from pipeline.stages.validate.probe import main; main()"
        self._proc: subprocess.Popen[str] | None = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env,
        )

    def __enter__(self) -> ProbeProcess:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the child if it is still there (never sent a request, or timed out)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.communicate()

    def run(self, request: ProbeRequest, timeout_s: float) -> tuple[ProbeResult | None, str]:
        """(result, '') or (None, why it failed); see `run_probe`. Only one request per child."""
        proc, self._proc = self._proc, None
        if proc is None:
            raise RuntimeError("a ProbeProcess runs one request")
        payload = {
            "request": asdict(request),
            "result_path": str(self.result_path),
            "logits_path": str(self.logits_path),
            "error_path": str(self.error_path),
        }
        try:
            _, stderr = proc.communicate(input=json.dumps(payload), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            self.logits_path.unlink(missing_ok=True)
            return None, f"llama.cpp did not load and run {self.label} within {timeout_s:g} s"
        try:
            if proc.returncode != 0 or not self.result_path.is_file():
                self.logits_path.unlink(missing_ok=True)
                return None, _failure(self.label, proc.returncode, stderr, self.error_path)
            result = ProbeResult.load(self.result_path, self.label)
        finally:
            self.result_path.unlink(missing_ok=True)
            self.error_path.unlink(missing_ok=True)
        return result, ""


def run_probe(
    request: ProbeRequest, workdir: Path, timeout_s: float, label: str = "model"
) -> tuple[ProbeResult | None, str]:
    """(result, '') or (None, why it failed). The text's logits are left at ``result.logits_path``;
    the caller deletes them. Nothing else stays in ``workdir``."""
    with ProbeProcess(workdir, label) as child:
        return child.run(request, timeout_s)
