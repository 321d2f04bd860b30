"""The model card (README.md) of a published bundle: front matter a hub reads, and a body a person reads.

Front matter (YAML): base model and its revision, `gguf`/`ternary` tags, recipe, tensor
types per kind, bits per weight, file sizes. Body: the validation verdict with the
agreement figures and the `1+1` answers, how to run the files with llama.cpp, and the
provenance digest. A card for a bundle published despite a failed validation says so
first: in the first front-matter key and in the first line of the body (line 1 of the file
must stay `---` for hubs to read the front matter).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.core.verdicts import Verdict
from pipeline.formats.gguf.reader import GGUFFile
from pipeline.formats.gguf.types import GGMLTypeName

__all__ = ["GGUFSummary", "summarise_gguf", "render_card", "CardFile"]

_BLOCK = re.compile(r"^blk\.\d+\.")
_TERNARY_TYPES = {GGMLTypeName.TQ1_0, GGMLTypeName.TQ2_0, GGMLTypeName.Q1_0, GGMLTypeName.Q2_0}


@dataclass(frozen=True)
class GGUFSummary:
    """Tensor types per tensor kind (`blk.N.` dropped), bits per weight over all tensors, parameters."""

    types_by_kind: Mapping[str, Mapping[str, int]]
    bits_per_weight: float
    n_params: int
    architecture: str


@dataclass(frozen=True)
class CardFile:
    name: str
    size_bytes: int
    sha256: str


def summarise_gguf(path: Path) -> GGUFSummary:
    """Read the GGUF's tensor table (no tensor data) and summarise it."""
    reader = GGUFFile(path)
    kinds: dict[str, Counter[str]] = defaultdict(Counter)
    n_bytes = n_params = 0
    for tensor in reader.tensors:
        kinds[_BLOCK.sub("", tensor.name)][tensor.tensor_type.name] += 1
        n_bytes += tensor.n_bytes
        n_params += tensor.n_elements
    arch = reader.get_field("general.architecture")
    return GGUFSummary(
        types_by_kind={kind: dict(sorted(counts.items())) for kind, counts in sorted(kinds.items())},
        bits_per_weight=round(8 * n_bytes / max(n_params, 1), 4),
        n_params=n_params,
        architecture=str(arch.contents()) if arch is not None else "unknown",
    )


def render_card(facts: Any, summary: GGUFSummary, files: Sequence[CardFile], gguf_sha256: str,
                provenance_sha256: str, is_forced: bool) -> str:
    """README.md text for `facts` (a JobFacts), the summary of its GGUF and the bundle's files."""
    failed = facts.validation_verdict not in (Verdict.PASS, Verdict.WARN)
    warning = (f"WARNING: validation {facts.validation_verdict.upper()}; published anyway with --force"
               if failed and is_forced else None)
    types = sorted({t for counts in summary.types_by_kind.values() for t in counts})
    front: dict[str, Any] = {}
    if warning:
        front["warning"] = warning
    front.update({
        "base_model": facts.source,
        "base_model_revision": facts.resolved_revision or "unrecorded (local source)",
        "tags": ["gguf", *(["ternary"] if _TERNARY_TYPES & set(types) else []), facts.recipe,
                 *(["validation-failed"] if warning else [])],
        "library_name": "gguf",
        "bonsai": {
            "job_id": facts.job_id,
            "recipe": facts.recipe,
            "recipe_options": dict(facts.recipe_options),
            "architecture": summary.architecture,
            "parameters": summary.n_params,
            "bits_per_weight": summary.bits_per_weight,
            "tensor_types": {kind: dict(counts) for kind, counts in summary.types_by_kind.items()},
            "validation": facts.validation_verdict,
            "gguf_sha256": gguf_sha256,
            "provenance_sha256": provenance_sha256,
            "files": [{"name": f.name, "size_bytes": f.size_bytes, "sha256": f.sha256} for f in files],
        },
    })
    lines = ["---", yaml.safe_dump(front, sort_keys=False, allow_unicode=True).rstrip(), "---", ""]
    if warning:
        lines += [f"> **{warning}.** Read the validation section before using these files.", ""]
    title = facts.source.rstrip("/").rsplit("/", 1)[-1]
    lines += [f"# {title} ({facts.recipe}, GGUF)", ""]
    lines += [f"Converted by Bonsai Pipeline (job {facts.job_id}) from `{facts.source}` at revision "
              f"`{facts.resolved_revision or 'unrecorded (local source)'}` with recipe `{facts.recipe}`: "
              f"{summary.n_params:,} parameters at {summary.bits_per_weight} bits per weight.", ""]
    lines += _validation_section(facts)
    lines += _files_section(files, summary)
    lines += _run_section(files)
    lines += ["## Provenance", "",
              f"The GGUF these files make up has sha256 `{gguf_sha256}`. `provenance.intoto.jsonl` holds the "
              "in-toto statements (SLSA provenance) of it and of every input down to the source files; its "
              f"sha256 is `{provenance_sha256}`. `SHA256SUMS` lists every file of this bundle "
              "(`sha256sum -c SHA256SUMS`).", ""]
    return "\n".join(lines)


def _validation_section(facts: Any) -> list[str]:
    metrics: Mapping[str, Any] = facts.validation or {}
    lines = ["## Validation", "", f"Verdict: **{facts.validation_verdict}**.", ""]
    checks = metrics.get("checks") or {}
    if checks:
        rows = [f"| {name} | {verdict} |" for name, verdict in sorted(checks.items())]
        lines += ["| check | verdict |", "|---|---|", *rows, ""]
    agreement = metrics.get("agreement") or {}
    if "top1_agreement" in agreement:
        lines += [f"Agreement with the source model over {agreement.get('n_positions')} positions: top-1 "
                  f"{agreement['top1_agreement']:.1%}, mean KL {agreement.get('mean_kl')} nats "
                  f"(p90 {agreement.get('p90_kl')}, max {agreement.get('max_kl')}).", ""]
    answer = (metrics.get("details") or {}).get("answer") or {}
    prompt = answer.get("prompt") or (metrics.get("completion") or {}).get("prompt") or "1+1="
    converted = answer.get("text", metrics.get("text"))
    if converted is not None:
        lines += [f"Greedy `{prompt}`, this file: `{converted!r}`"
                  + (f"; the source model: `{answer['source_text']!r}`" if "source_text" in answer else "")
                  + (f" (expected `{answer['expected']}`)." if "expected" in answer else "."), ""]
    if not metrics:
        lines += ["No validation report was recorded for this job.", ""]
    return lines


def _files_section(files: Sequence[CardFile], summary: GGUFSummary) -> list[str]:
    lines = ["## Files", "", "| file | bytes | sha256 |", "|---|---|---|"]
    lines += [f"| {f.name} | {f.size_bytes:,} | `{f.sha256}` |" for f in files]
    lines += ["", "Tensor types by kind:", "", "| tensor | types |", "|---|---|"]
    lines += [f"| {kind} | {', '.join(f'{t} ×{n}' for t, n in counts.items())} |"
              for kind, counts in summary.types_by_kind.items()]
    return [*lines, ""]


def _run_section(files: Sequence[CardFile]) -> list[str]:
    ggufs = [f.name for f in files if f.name.endswith(".gguf")]
    first = ggufs[0]
    lines = ["## Run it with llama.cpp", ""]
    if len(ggufs) > 1:
        lines += [f"The model is split in {len(ggufs)} files in llama.cpp's split format; keep them in one "
                  "folder and point llama.cpp at the first one (it loads the rest). "
                  f"`llama-gguf-split --merge {first} model.gguf` joins them into one file.", ""]
    lines += ["```sh", f"llama-cli -m {first} -p '1+1=' -n 16 --temp 0", "```", "",
              "From Python (llama-cpp-python):", "", "```python", "from llama_cpp import Llama",
              f"llm = Llama(model_path={first!r})", "print(llm('1+1=', max_tokens=16, temperature=0))",
              "```", ""]
    return lines
