"""Source specs: what a job may name as its checkpoint, which files of it are taken, and where from.

Three forms (`parse_source`): a local folder, a single ``.gguf`` file, or a Hugging Face repo
``org/name[@revision]`` (``hf://`` forces the hub reading). `SourcePolicy` decides which local
paths a submitter may name: the API may name none unless ``BONSAI_SOURCE_ROOTS`` lists folders,
and then only paths inside one of them, placed by their text first (nothing outside is
opened, so a refusal says nothing about what exists there) and then resolved; the CLI on
the machine itself may name any path its user can read unless roots are set. Only checkpoint
files are ever taken from a source (`is_checkpoint_file`): weights, config, tokenizer,
checksums, model card and licence; everything else is listed as left out and never stored.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.clients.hub_refs import repo_id_fault, revision_fault
from pipeline.core.confinement import confinement_roots, is_inside, placed
from pipeline.core.errors import InputError
from pipeline.core.text import escape_unprintable, first_unprintable

__all__ = [
    "ACCEPTED_FORMS",
    "SourceSpec",
    "SourcePolicy",
    "parse_source",
    "is_checkpoint_file",
    "CHECKPOINT_PATTERNS",
    "PICKLE_SUFFIXES",
    "escaped",
    "shown",
]

ACCEPTED_FORMS = (
    "a local folder path, a single .gguf file path, or a Hugging Face repo "
    "'org/name' or 'org/name@revision' (branch, tag or commit sha)"
)
MAX_SOURCE_CHARS = 1024
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


def _clipped(source: str) -> str:
    return source if len(source) <= 120 else source[:117] + "..."


def shown(source: str) -> str:
    """A source as messages and terminals may show it, quoted: escaped, and at most 120 characters."""
    text = _clipped(source)
    return ascii(text) if first_unprintable(text) is not None else repr(text)


def escaped(source: str) -> str:
    """`shown` without the quotes, for a source that has already passed the checks or is a label."""
    return escape_unprintable(_clipped(source))


def _checked_text(source: str) -> str:
    """The stripped spec; InputError when it is empty, too long or holds unprintable characters
    (a terminal escape in a source would be replayed by every `bonsai jobs`)."""
    spec = source.strip()
    if not spec:
        raise InputError(f"empty source spec; expected {ACCEPTED_FORMS}")
    if len(spec) > MAX_SOURCE_CHARS:
        raise InputError(f"source {shown(spec)} is {len(spec)} characters long, over the limit of "
                         f"{MAX_SOURCE_CHARS}; give a shorter path or a hub repo id")
    bad = first_unprintable(spec)
    if bad is not None:
        raise InputError(f"source {shown(spec)} holds the unprintable character U+{ord(bad):04X}; "
                         f"expected {ACCEPTED_FORMS}")
    return spec


def parse_source(source: str) -> SourceSpec:
    """Classify a source spec as its own user may name it (any path); InputError names the spec
    and the accepted forms. An existing path always wins over a hub id, so a local folder named
    ``org/name`` works. `SourcePolicy.check` is the form for a submitter limited to some folders.
    """
    spec = _checked_text(source)
    if spec.startswith(_HUB_PREFIX):
        return _parse_hub_id(spec[len(_HUB_PREFIX):], spec)
    path = Path(spec).expanduser()
    try:
        found = _local_spec(spec, path)
    except OSError as exc:  # a name too long, a folder it may not enter
        raise InputError(f"source {shown(spec)} cannot be read ({exc.strerror or type(exc).__name__}); "
                         f"expected {ACCEPTED_FORMS}") from exc
    if found is not None:
        return found
    if _looks_like_path(spec):
        raise InputError(
            f"source {shown(spec)} does not exist (no such file or folder); expected {ACCEPTED_FORMS}"
        )
    return _parse_hub_id(spec, spec)


def _local_spec(spec: str, path: Path) -> SourceSpec | None:
    """The local source at ``path``, None when nothing is there; raises OSError where it cannot look."""
    if path.is_dir():
        return SourceSpec(kind="local", path=path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return SourceSpec(kind="gguf", path=path)
        raise InputError(f"source {shown(spec)} is a file but not a .gguf file; expected {ACCEPTED_FORMS}")
    if os.path.lexists(path):
        raise InputError(f"source {shown(spec)} is neither a folder nor a regular file; "
                         f"expected {ACCEPTED_FORMS}")
    return None


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~", ".")) or spec.lower().endswith(".gguf") or "\\" in spec


def _parse_hub_id(text: str, spec: str) -> SourceSpec:
    repo_id, _, revision = text.partition("@")
    fault = repo_id_fault(repo_id)
    if fault is None and "@" in text:
        fault = revision_fault(revision)
        if fault is not None:
            fault = f"its revision is not a commit sha nor a git ref name: {fault}"
    if fault is not None:
        raise InputError(f"source {shown(spec)} is not an existing path nor a hub repo id ({fault}); "
                         f"expected {ACCEPTED_FORMS}")
    return SourceSpec(kind="hub", repo_id=repo_id, revision=revision if "@" in text else None)


def is_checkpoint_file(name: str) -> bool:
    """Whether a snapshot file (relative POSIX name) is one the pipeline takes: top level and allow-listed."""
    if "/" in name:
        return False
    lowered = name.lower()
    return any(fnmatch.fnmatchcase(lowered, pattern.lower()) for pattern in CHECKPOINT_PATTERNS)


@dataclass(frozen=True)
class SourcePolicy:
    """Which local paths a submitter may name.

    ``roots``: the folders local sources must lie in (``BONSAI_SOURCE_ROOTS``), each as written
    and resolved. ``allow_any_local``: with no roots, whether any readable path is allowed (the CLI
    on the machine itself) or none is (the API).
    """

    roots: tuple[Path, ...] = ()
    allow_any_local: bool = False

    @classmethod
    def from_roots(cls, roots: Iterable[str | Path], *, allow_any_local: bool) -> SourcePolicy:
        both = confinement_roots(roots)
        return cls(both, allow_any_local and not both)

    def check(self, source: str) -> SourceSpec:
        """The parsed spec when this submitter may name it; InputError with the fix otherwise.

        Limited to roots (or to none), a path is first placed lexically (``..`` and ``~`` applied,
        nothing opened): outside every root it is refused with one message whether or not it exists,
        so the answer tells nothing about the server's files. Inside, it is resolved (symlinks) and
        must still be inside.
        """
        if not self.roots and self.allow_any_local:
            return parse_source(source)
        spec = _checked_text(source)
        if spec.startswith(_HUB_PREFIX):
            return _parse_hub_id(spec[len(_HUB_PREFIX):], spec)
        lexical = placed(spec)
        if self._inside(lexical):
            try:
                resolved = lexical.resolve(strict=True)
            except (OSError, RuntimeError):
                resolved = None
            if resolved is not None:
                if not self._inside(resolved):
                    raise self._outside(spec)
                try:
                    found = _local_spec(spec, resolved)
                except OSError as exc:
                    raise InputError(f"source {shown(spec)} cannot be read "
                                     f"({exc.strerror or type(exc).__name__})") from exc
                if found is not None:
                    return found
            if _looks_like_path(spec):
                raise InputError(f"source {shown(spec)} does not exist inside the allowed model folders "
                                 f"({self._allowed()}); expected {ACCEPTED_FORMS}")
        elif _looks_like_path(spec):
            raise self._outside(spec)
        try:
            return _parse_hub_id(spec, spec)
        except InputError:
            raise self._outside(spec) from None

    def _inside(self, path: Path) -> bool:
        return is_inside(path, self.roots)

    def _allowed(self) -> str:
        return ", ".join(str(root) for root in self.roots)

    def _outside(self, spec: str) -> InputError:
        if not self.roots:
            return InputError(
                f"source {shown(spec)} is not a hub repo id ('org/name@revision', the revision a branch, "
                "tag or commit sha), and local paths are not accepted here; have the operator list the "
                "allowed model folders in BONSAI_SOURCE_ROOTS (for example BONSAI_SOURCE_ROOTS=/models)"
            )
        return InputError(
            f"source {shown(spec)} is outside the allowed model folders ({self._allowed()}) and not a hub "
            "repo id ('org/name@revision', the revision a branch, tag or commit sha); move the "
            "checkpoint under one of them or ask the operator to add its folder to BONSAI_SOURCE_ROOTS"
        )
