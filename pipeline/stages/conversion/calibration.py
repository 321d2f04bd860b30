"""What the fitting stages (decompose, sensitivity) read from calibrate: importance and Gram matrices,
and the source's reference.

``importance=imatrix``: ``calibrate/imatrix.gguf`` (llama.cpp's imatrix format); each ternary
tensor's fit weights its columns by the mean x² of their inputs (the importance-weighted exact
optimum). ``method=gptq``: ``calibrate/gram/blk.<i>.safetensors``; each ternary tensor is fitted
against its input Gram matrix XᵀX (`ternary.decompose_gptq`). The source reference is read only
where candidate files are scored against it (the sensitivity stage, and decompose's search for
``min_top1`` / ``max_kl``); otherwise `select_inputs` keeps it out of the cache key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core.errors import InputError
from pipeline.formats.decompose_report import ImatrixUse
from pipeline.stages.base import InputFile

if TYPE_CHECKING:
    import torch  # imported where used: decompose's params must load without torch (a light start)

    from pipeline.calibration.gram import GramFile
    from pipeline.calibration.imatrix import Imatrix

__all__ = ["IMATRIX_INPUT", "GRAM_INPUT_PREFIX", "REFERENCE_INPUT", "CalibrationInputs", "wanted_input",
           "load_calibration", "load_reference"]

IMATRIX_INPUT = "calibrate/imatrix.gguf"
GRAM_INPUT_PREFIX = "calibrate/gram/"
REFERENCE_INPUT = "calibrate/reference.npz"
_FIX = "retry the job from calibrate (`bonsai retry JOB --from calibrate`)"


def wanted_input(key: str, importance: str, method: str, reference: bool = False) -> bool:
    """Whether a fitting stage reads upstream output ``key`` under these options (``reference``: it
    scores files against the source)."""
    if not key.startswith("calibrate/"):
        return True
    if key == REFERENCE_INPUT:
        return reference
    if key == IMATRIX_INPUT:
        return importance == "imatrix"
    return key.startswith(GRAM_INPUT_PREFIX) and method == "gptq"


@dataclass
class CalibrationInputs:
    """The importance matrix and the Gram files, opened lazily, one block file at a time."""

    imatrix: Imatrix | None = None
    gram_paths: Mapping[str, Path] = field(default_factory=dict)
    _open: dict[str, GramFile] = field(default_factory=dict)

    def importance(self, name: str, cols: int) -> torch.Tensor | None:
        """Mean x² per input column [cols] of weight ``name``; None without an imatrix or an entry."""
        if self.imatrix is None or name not in self.imatrix.entries:
            return None
        values = self.imatrix.importance(name)
        if values.shape != (1, cols):
            raise InputError(f"{name}: the importance matrix has shape {list(values.shape)}, the weight "
                             f"{cols} input columns; {_FIX}")
        import torch

        return torch.from_numpy(values[0].copy())

    def gram(self, name: str) -> torch.Tensor:
        """XᵀX [cols, cols] of weight ``name``; InputError naming the fix when calibrate made none."""
        from pipeline.calibration.gram import GramFile, gram_file_name

        file_name = gram_file_name(name)
        path = self.gram_paths.get(file_name)
        if path is None:
            raise InputError(f"{name}: method=gptq needs its input Gram matrix, but calibrate wrote no "
                             f"gram/{file_name}; {_FIX}")
        if file_name not in self._open:
            self._open = {file_name: GramFile(path)}  # one block's file open at a time
        handle = self._open[file_name]
        if name not in handle.weights:
            raise InputError(f"{name}: gram/{file_name} holds no Gram matrix for it; {_FIX}")
        return handle.read(name)[0]

    def describe(self) -> dict[str, Any]:
        return {"imatrix": self.imatrix is not None, "gram_files": len(self.gram_paths)}

    def imatrix_use(self) -> ImatrixUse | None:
        """What llama-quantize would record of this imatrix in the file it weighted; None without one."""
        if self.imatrix is None:
            return None
        datasets = self.imatrix.datasets
        return ImatrixUse(file=IMATRIX_INPUT.rsplit("/", 1)[-1], dataset=datasets[0] if datasets else "",
                          entries_count=len(self.imatrix.entries), chunks_count=self.imatrix.chunk_count)


def load_calibration(
    inputs: Mapping[str, InputFile], importance: str, method: str
) -> CalibrationInputs | None:
    """The calibration files these options need, checked present; None when they need none."""
    if importance != "imatrix" and method != "gptq":
        return None
    from pipeline.calibration.imatrix import read_imatrix

    matrix = None
    if importance == "imatrix":
        item = inputs.get(IMATRIX_INPUT)
        if item is None:
            raise InputError(f"importance=imatrix needs {IMATRIX_INPUT}; inputs were {sorted(inputs)}; "
                             f"{_FIX}")
        matrix = read_imatrix(item.path)
    grams = {key[len(GRAM_INPUT_PREFIX):]: item.path for key, item in inputs.items()
             if key.startswith(GRAM_INPUT_PREFIX)}
    if method == "gptq" and not grams:
        raise InputError(f"method=gptq needs calibrate's Gram matrices ({GRAM_INPUT_PREFIX}*); {_FIX}")
    return CalibrationInputs(matrix, grams)


def load_reference(inputs: Mapping[str, InputFile]) -> Any:
    """Calibrate's source reference (`calibration.reference.SourceReference`), checked present and
    covering the calibration text, which candidate files are scored on."""
    from pipeline.calibration.answers import CALIBRATION
    from pipeline.calibration.reference import read_reference

    item = inputs.get(REFERENCE_INPUT)
    if item is None:
        raise InputError(f"min_top1 / max_kl and sensitivity=measured need {REFERENCE_INPUT}; inputs were "
                         f"{sorted(inputs)}; {_FIX}")
    reference = read_reference(item.path)
    if CALIBRATION not in reference.sequences.names:
        held = sorted(set(reference.sequences.names))
        raise InputError("min_top1 / max_kl and sensitivity=measured score candidate files on the "
                         f"calibration text, but calibrate's reference holds only {held}; {_FIX}")
    return reference
