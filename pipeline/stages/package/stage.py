"""Package stage: decompose's parts + the source's metadata and tokenizer -> one llama.cpp GGUF file.

Inputs: ``download/config.json`` and the tokenizer files (HF sources) or the source ``.gguf``
(GGUF sources), ``inspect/model_card.json`` and every ``decompose/ternary/part-XXXXX.safetensors``
(`formats.parts`). The writing itself is `stages.gguf_build`, which decompose's auto search
shares, so a scored candidate is byte for byte what this stage writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pipeline.stages.base import NO_CLIENTS, InputFile, JobSpec, StageClients, StageResult
from pipeline.stages.gguf_build import OUTPUT_NAME, Params, PartTensor, build_gguf

__all__ = ["NAME", "VERSION", "OUTPUT_NAME", "Params", "make_params", "run", "PartTensor"]

NAME = "package"
VERSION = "1"


def make_params(job: JobSpec) -> Params:
    """Name the model after its source (``org/name@rev`` -> ``name``) unless options give ``name``."""
    name = job.options.get("name")
    if not isinstance(name, str) or not name:
        tail = job.source.rstrip("/").split("@", 1)[0].rsplit("/", 1)[-1]
        name = tail.removesuffix(".gguf") or "model"
    return Params(model_name=name, source=job.source, recipe=job.recipe)


def run(
    params: Params, inputs: Mapping[str, InputFile], workdir: Path, clients: StageClients = NO_CLIENTS
) -> StageResult:
    """Write and verify ``model.gguf``; raises InputError / IntegrityError naming the culprit."""
    return build_gguf(params, inputs, workdir)
