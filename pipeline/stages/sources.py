"""Source specs: what a job may name as its checkpoint, which files of it are taken, and where from.

Three forms (`parse_source`): a local folder, a single ``.gguf`` file, or a Hugging Face repo
``org/name[@revision]`` (``hf://`` forces the hub reading). `SourcePolicy` decides which local
paths a submitter may name: the API may name none unless ``BONSAI_SOURCE_ROOTS`` lists folders,
and then only paths that resolve (symlinks and ``..`` followed) inside one of them; the CLI on
the machine itself may name any path its user can read unless roots are set. Only checkpoint
files are ever taken from a source (`is_checkpoint_file`): weights, config, tokenizer,
checksums, model card and licence; everything else is listed as left out and never stored.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.core.errors import InputError

__all__ = [
    "ACCEPTED_FORMS",
    "SourceSpec",
    "SourcePolicy",
    "parse_source",
    "is_checkpoint_file",
    "CHECKPOINT_PATTERNS",
    "PICKLE_SUFFIXES",
]

ACCEPTED_FORMS = (
    "a local folder path, a single .gguf file path, or a Hugging Face repo "
    "'org/name' or 'org/name@revision' (branch, tag or commit sha)"
)
_HUB_ID = re.compile(
    r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95})(?:@(?P<rev>[^\s@]+))?"
)
_HUB_PREFIX = "hf://"

# Top-level file names a checkpoint is made of (the allow-list; matched case-insensitively).
CHECKPOINT_PATTERNS: tuple[str, ...] = (
    "*.safetensors", "*.safetensors.index.json", "*.gguf",
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja",
    # Quantizer configs are taken so that inspect can name the impostor it refuses.
    "quantize_config.json", "quant_config.json", "quantization_config.json",
    "SHA256SUMS", "README.md", "LICENSE", "LICENSE.*", "LICENCE", "LICENCE.*", "NOTICE", "NOTICE.*",
    "USE_POLICY.md",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class SourceSpec:
    """A parsed source spec: a local folder, a single .gguf file, or a hub repo."""

    kind: Literal["local", "gguf", "hub"]
    path: Path | None = None
    repo_id: str | None = None
    revision: str | None = None


def parse_source(source: str) -> SourceSpec:
    """Classify a source spec; raises InputError naming the spec and the accepted forms.

    An existing path always wins over a hub id, so a local folder named ``org/name`` works.
    """
    spec = source.strip()
    if not spec:
        raise InputError(f"empty source spec; expected {ACCEPTED_FORMS}")
    if spec.startswith(_HUB_PREFIX):
        return _parse_hub_id(spec[len(_HUB_PREFIX):], spec)
    if "\x00" in spec:
        raise InputError(f"source {spec!r} holds a NUL byte; expected {ACCEPTED_FORMS}")
    path = Path(spec).expanduser()
    if path.is_dir():
        return SourceSpec(kind="local", path=path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return SourceSpec(kind="gguf", path=path)
        raise InputError(f"source {spec!r} is a file but not a .gguf file; expected {ACCEPTED_FORMS}")
    if path.exists():
        raise InputError(f"source {spec!r} is neither a folder nor a regular file; expected {ACCEPTED_FORMS}")
    if _looks_like_path(spec):
        raise InputError(
            f"source {spec!r} does not exist (no such file or folder); expected {ACCEPTED_FORMS}"
        )
    return _parse_hub_id(spec, spec)


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~", ".")) or spec.lower().endswith(".gguf") or "\\" in spec


def _parse_hub_id(text: str, spec: str) -> SourceSpec:
    match = _HUB_ID.fullmatch(text)
    repo_id = match.group("repo") if match else ""
    # The hub forbids these in repo names; refusing early gives a clearer message than a 404.
    if not match or "--" in repo_id or ".." in repo_id or repo_id.endswith((".", "-")):
        raise InputError(
            f"source {spec!r} is not an existing path nor a hub repo id; expected {ACCEPTED_FORMS}"
        )
    return SourceSpec(kind="hub", repo_id=repo_id, revision=match.group("rev"))


def is_checkpoint_file(name: str) -> bool:
    """Whether a snapshot file (relative POSIX name) is one the pipeline takes: top level and allow-listed."""
    if "/" in name:
        return False
    lowered = name.lower()
    return any(fnmatch.fnmatchcase(lowered, pattern.lower()) for pattern in CHECKPOINT_PATTERNS)


@dataclass(frozen=True)
class SourcePolicy:
    """Which local paths a submitter may name.

    ``roots``: the folders local sources must resolve into (``BONSAI_SOURCE_ROOTS``), already
    resolved. ``allow_any_local``: with no roots, whether any readable path is allowed (the CLI
    on the machine itself) or none is (the API).
    """

    roots: tuple[Path, ...] = ()
    allow_any_local: bool = False

    @classmethod
    def from_roots(cls, roots: Iterable[str | Path], *, allow_any_local: bool) -> SourcePolicy:
        resolved = tuple(Path(os.path.expanduser(str(r))).resolve() for r in roots if str(r).strip())
        return cls(resolved, allow_any_local and not resolved)

    def check(self, source: str) -> SourceSpec:
        """The parsed spec when this submitter may name it; InputError with the fix otherwise."""
        spec = parse_source(source)
        if spec.kind == "hub" or spec.path is None:
            return spec
        if not self.roots:
            if self.allow_any_local:
                return spec
            raise InputError(
                f"source {source!r}: local paths are not accepted here; submit a hub repo id "
                "('org/name@revision'), or have the operator list the allowed model folders in "
                "BONSAI_SOURCE_ROOTS (for example BONSAI_SOURCE_ROOTS=/models)"
            )
        try:
            resolved = spec.path.resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            raise InputError(f"source {source!r}: cannot be resolved ({exc})") from exc
        if not any(resolved.is_relative_to(root) for root in self.roots):
            allowed = ", ".join(str(root) for root in self.roots)
            raise InputError(
                f"source {source!r} resolves to {resolved}, outside the allowed model folders "
                f"({allowed}); move the checkpoint under one of them or ask the operator to add its "
                "folder to BONSAI_SOURCE_ROOTS"
            )
        return spec
