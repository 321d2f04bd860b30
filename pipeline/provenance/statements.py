"""in-toto Statements with a SLSA-provenance-v1-shaped predicate, one per output artifact.

The statement names the artifact (subject), what was asked for (external parameters:
source, revision, recipe, stage parameters), every input by digest (resolved
dependencies), and who built it with what (builder versions, host, device, times).
Secrets never enter it: parameters pass through `redact` first.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from importlib import metadata
from typing import Any

__all__ = [
    "STATEMENT_TYPE",
    "PREDICATE_TYPE",
    "BuildFacts",
    "build_statement",
    "tool_versions",
    "redact",
]

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:bonsai-pipeline:stage:v1"

_VERSIONED_PACKAGES = ("bonsai-pipeline", "torch", "gguf", "llama-cpp-python", "safetensors", "numpy")
_SECRET_WORDS = ("token", "password", "secret", "authorization")


@dataclass(frozen=True)
class BuildFacts:
    """Who ran a stage attempt, where, and when."""

    stage: str
    stage_version: str
    stage_run_id: int
    job_id: int
    attempt: int
    worker_host: str
    device: str
    # The configured worker name (BONSAI_WORKER_NAME, else the host's): the builder's stable id.
    worker_name: str
    started_at: datetime
    finished_at: datetime
    cache_key: str | None


@cache
def tool_versions() -> dict[str, str]:
    """Installed versions of the packages that shape the bytes we write."""
    versions = {"python": platform.python_version()}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def redact(params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `params` with secret-looking keys removed, recursively."""
    clean: dict[str, Any] = {}
    for key, value in params.items():
        if any(word in key.lower() for word in _SECRET_WORDS):
            continue
        clean[key] = redact(value) if isinstance(value, Mapping) else value
    return clean


def build_statement(
    subject_name: str,
    subject_sha256: str,
    external: Mapping[str, Any],
    inputs: Iterable[tuple[str, str, str]],
    facts: BuildFacts,
) -> dict[str, Any]:
    """The statement for one output.

    `inputs` yields (name, sha256, uri) for every file the stage read.
    """
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": subject_name, "digest": {"sha256": subject_sha256}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": redact(external),
                "internalParameters": {
                    "stage": facts.stage,
                    "stageVersion": facts.stage_version,
                    "cacheKey": facts.cache_key,
                },
                "resolvedDependencies": [
                    {"name": name, "digest": {"sha256": sha256}, "uri": uri}
                    for name, sha256, uri in sorted(inputs)
                ],
            },
            "runDetails": {
                "builder": {
                    "id": f"urn:bonsai-pipeline:worker:{facts.worker_name}",
                    "version": tool_versions(),
                },
                "metadata": {
                    "invocationId": f"job/{facts.job_id}/stage/{facts.stage}/attempt/{facts.attempt}"
                    f"/run/{facts.stage_run_id}",
                    "startedOn": facts.started_at.isoformat(),
                    "finishedOn": facts.finished_at.isoformat(),
                },
                "byproducts": [{"name": "device", "content": facts.device},
                               {"name": "process", "content": facts.worker_host}],
            },
        },
    }
