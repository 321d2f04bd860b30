"""The GGUF a conversion writes, shared by the package stage and decompose's auto search.

Decompose's parts + the source's metadata and tokenizer -> one llama.cpp GGUF file. Before
writing, every tensor of the model card's plan must be in exactly one part, with the planned
shape and a byte count that fits its type. The file is streamed one tensor at a time, then
reopened and checked. The HF and GGUF halves live in `hf` and `gguf_source`. Not a stage: the
auto search scores each candidate allocation as exactly the file package would write.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pipeline.formats.decompose_report import REPORT_NAME, DecomposeReport
from pipeline.formats.model_card import CARD_NAME, ModelCard
from pipeline.stages.base import InputFile, StageResult, inputs_of
from pipeline.stages.gguf_build.common import OUTPUT_NAME, Params, imatrix_keys, require
from pipeline.stages.gguf_build.gguf_source import package_gguf_source
from pipeline.stages.gguf_build.hf import package_hf_source
from pipeline.stages.gguf_build.parts import PART_NAME, PartTensor, collect_parts, match_plan

__all__ = ["OUTPUT_NAME", "Params", "PartTensor", "build_gguf"]


def build_gguf(params: Params, inputs: Mapping[str, InputFile], workdir: Path) -> StageResult:
    """Write and verify ``model.gguf`` in ``workdir`` from the download, inspect and decompose inputs.

    Raises InputError / IntegrityError naming the culprit.
    """
    download, inspect = inputs_of(inputs, "download"), inputs_of(inputs, "inspect")
    card_file = inspect.get(CARD_NAME)
    card = ModelCard.load(require(inspect, CARD_NAME, "inspect"), f"inspect/{CARD_NAME}")
    decompose = inputs_of(inputs, "decompose")
    parts = {n: f for n, f in decompose.items() if PART_NAME.match(n)}
    ordered = match_plan(card, collect_parts(parts))
    # The report says whether an imatrix weighted the fits (a trial file of the auto search has none).
    report = decompose.get(REPORT_NAME)
    used = DecomposeReport.load_imatrix_use(report.path, f"decompose/{REPORT_NAME}") if report else None
    package = package_gguf_source if card.is_gguf else package_hf_source
    return package(params, download, card, card_file, ordered, Path(workdir), imatrix_keys(used))
