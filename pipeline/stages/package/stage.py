"""Package stage: decompose's parts + the source's metadata and tokenizer -> one llama.cpp GGUF file.

Inputs: ``download/config.json`` and the tokenizer files (HF sources) or the source ``.gguf``
(GGUF sources), ``inspect/model_card.json`` and every ``decompose/ternary/part-XXXXX.safetensors``
(`formats.parts`). Before writing, every tensor of the model card's plan must be in exactly one
part, with the planned shape and a byte count that fits its type. The file is streamed one
tensor at a time, then reopened and checked. The HF and GGUF halves live in `hf` and
`gguf_source`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pipeline.formats.model_card import CARD_NAME, ModelCard
from pipeline.stages.base import NO_CLIENTS, InputFile, JobSpec, StageClients, StageResult, inputs_of
from pipeline.stages.package.common import OUTPUT_NAME, Params, require
from pipeline.stages.package.gguf_source import package_gguf_source
from pipeline.stages.package.hf import package_hf_source
from pipeline.stages.package.parts import PART_NAME, PartTensor, collect_parts, match_plan

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
    download, inspect = inputs_of(inputs, "download"), inputs_of(inputs, "inspect")
    card_file = inspect.get(CARD_NAME)
    card = ModelCard.load(require(inspect, CARD_NAME, "inspect"), f"inspect/{CARD_NAME}")
    parts = {n: f for n, f in inputs_of(inputs, "decompose").items() if PART_NAME.match(n)}
    ordered = match_plan(card, collect_parts(parts))
    package = package_gguf_source if card.is_gguf else package_hf_source
    return package(params, download, card, card_file, ordered, Path(workdir))
