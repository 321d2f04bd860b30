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
Python and llama.cpp load meanwhile. What the child does is `probe_child`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.calibration.gpu_offload import AUTO_LAYERS
from pipeline.core.errors import IntegrityError
from pipeline.core.option_fields import option, read_fields
from pipeline.formats.jsonfile import ShapeError, as_dataclass, load_json

__all__ = ["ProbeSpec", "ProbeRequest", "ProbeResult", "Generation", "Completion", "ChatReply", "TextRun",
           "Backend", "ProbeProcess", "run_probe", "DEFAULT_AGREEMENT_TEXT"]

# A few plain sentences: common words, no numbers or names a small model could not know.
DEFAULT_AGREEMENT_TEXT = (
    "The river runs through the old town and past the market square. Every morning the bakers "
    "open their doors, and the smell of fresh bread fills the street. Children walk to school "
    "while their parents hurry to work. In the evening the lamps are lit, and people meet their "
    "friends for dinner."
)

_STDERR_TAIL_CHARS = 2000
_MAX_RESULT_BYTES = 16 * 1024 * 1024
_TRACEBACK_HEAD = "Traceback (most recent call last):"


@dataclass(frozen=True)
class ProbeSpec:
    """What both sides of a validation ask llama.cpp: calibrate asks the source, validate the
    conversion, so the two answers and logits compare. Each field is a job option of the same name;
    ``timeout_s`` bounds each llama.cpp run, ``n_gpu_layers=0`` keeps it on the CPU (the default,
    `gpu_offload.AUTO_LAYERS`, offloads what the GPU's free memory holds)."""

    prompt: str = option("1+1=", help="greedy sanity prompt")
    max_tokens: int = option(16, help="tokens generated for `prompt`", low=1)
    chat_prompt: str = option("What is 1+1?", help="the same question through the chat template")
    chat_max_tokens: int = option(32, help="tokens generated for `chat_prompt`", low=1)
    agreement_text: str = option(DEFAULT_AGREEMENT_TEXT, shown_default=None,
                                 help="text the source and the GGUF predict side by side "
                                 "(default: a few built-in sentences)")
    n_ctx: int = option(256, help="llama.cpp context size", low=16)
    n_gpu_layers: int = option(AUTO_LAYERS, shown_default=None, low=AUTO_LAYERS,
                               help="layers llama.cpp offloads to a GPU (-1: all, 0: none; default -2: as "
                               "many as the GPU's free memory holds, none without a GPU)")
    seed: int = option(0, help="llama.cpp sampling seed", low=0)
    timeout_s: float = option(300.0, help="seconds one llama.cpp run may take", low=1)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ProbeSpec:
        """The spec a job's options ask for; InputError for a value of the wrong kind or range."""
        return cls(**read_fields(cls, options, "validate"))

    def request(self, path: Path, n_threads: int) -> ProbeRequest:
        """The request that runs this spec on the file at ``path``."""
        return ProbeRequest(
            path=str(path),
            prompts=(self.prompt,),
            max_tokens=self.max_tokens,
            chat_prompt=self.chat_prompt or None,
            chat_max_tokens=self.chat_max_tokens,
            text=self.agreement_text or None,
            n_ctx=self.n_ctx,
            n_threads=n_threads,
            n_gpu_layers=self.n_gpu_layers,
            seed=self.seed,
        )


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
class Generation:
    """What the model generated for one prompt: the text and its token ids."""

    prompt: str
    text: str
    tokens: tuple[int, ...]
    gen_s: float = 0.0


@dataclass(frozen=True)
class Completion(Generation):
    """A raw prompt's greedy completion (``1+1=``)."""

    prompt_tokens: int = 0
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class ChatReply(Generation):
    """The reply through the model's chat template. ``tokens_source``: 'sampled' (the ids the model
    chose) or 'retokenized' (the reply's text tokenized again, when the ids were not returned)."""

    tokens_source: str = "sampled"
    finish_reason: str | None = None


@dataclass(frozen=True)
class TextRun:
    """The agreement text's evaluation: its token ids (the logits went to ``logits_path``)."""

    tokens: tuple[int, ...]
    is_truncated: bool
    eval_s: float


@dataclass(frozen=True)
class Backend:
    """Where llama.cpp ran: the binding's version, GPU offload, and ggml's system line."""

    device: str
    llama_cpp_python: str = ""
    supports_gpu_offload: bool = False
    n_gpu_layers: int = 0
    system_info: str = ""
    offload_why: str = ""  # how n_gpu_layers was chosen (`gpu_offload`)


@dataclass(frozen=True)
class ProbeResult:
    """What llama.cpp did with one file: load time, vocabulary size, completions, chat, the text's
    tokens, the backend; ``logits_path``: where the text's logits (``.npy``) were left, if any."""

    load_s: float
    n_vocab: int
    has_chat_template: bool
    completions: tuple[Completion, ...]
    chat: ChatReply | None
    text: TextRun | None
    backend: Backend
    logits_path: str | None = None

    def write(self, path: Path) -> None:
        """Write the result as JSON (the child's side)."""
        path.write_text(json.dumps(self.to_document()), encoding="utf-8")

    def to_document(self) -> dict[str, Any]:
        """The result as plain JSON values (what `write` writes and `from_document` reads)."""
        return asdict(self)

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> ProbeResult:
        """The one reader of a probe result's document; ShapeError (a ValueError) when it is
        malformed (callers name the file)."""
        return as_dataclass(cls, document)

    @classmethod
    def load(cls, path: Path, label: str) -> ProbeResult:
        """Read a child's result; IntegrityError naming `label` when it is malformed."""
        document = load_json(path, f"{label} probe result", max_bytes=_MAX_RESULT_BYTES, error=IntegrityError)
        try:
            return cls.from_document(document)
        except ShapeError as exc:
            raise IntegrityError(f"{label} probe result is malformed ({exc})") from None


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
        code = "from pipeline.calibration.probe_child import main; main()"
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
