"""Which llama.cpp backend runs which tensor type well: the facts a recipe is chosen by, and warned with.

Read from the llama.cpp that llama-cpp-python 0.3.36 vendors (ggml/src/ggml-cuda, ggml-metal,
ggml-vulkan, ggml-cpu/arch/{x86,arm}/quants.c):

- TQ2_0 / TQ1_0: fast on CPUs (x86 AVX2 and ARM), Vulkan and Metal (TQ1_0 only partly on
  Metal: no row gather); **no CUDA kernel**: on an NVIDIA card those tensors run on the CPU.
- Q2_0: CUDA, Metal, Vulkan and ARM NEON; on x86 CPUs only the generic scalar code (slow).
- Q1_0: CUDA, Metal, Vulkan, x86 AVX2 and ARM NEON.
- BF16 (the token embedding's GET_ROWS and the head's MUL_MAT): CPU, CUDA and Vulkan; on Metal only
  on GPUs with bfloat support (Apple6 or Metal 3 families: ``has_bfloat`` in ggml-metal-device.m),
  elsewhere those operations fall back to the CPU. So a ``source`` type (`policy.SOURCE_16`) is BF16
  for a BF16 checkpoint on cpu, cuda and vulkan, and F16 for metal.
- K-quants, Q8_0, F16, F32: everywhere.

`target` is where the user means to run the file: "cpu" (x86; ARM NEON differs for Q2_0, said in
the warning), "cuda", "metal" or "vulkan".
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from pipeline.formats.gguf.types import GGMLTypeName

__all__ = ["TARGETS", "Support", "support", "default_recipe", "backend_warnings"]

TARGETS = ("cpu", "cuda", "metal", "vulkan")


class Support(StrEnum):
    FAST = "fast"  # a vectorised or GPU kernel
    PARTIAL = "partial"  # some operations fall back to another backend
    SCALAR = "scalar"  # runs, through the generic scalar code: slow
    NONE = "none"  # no kernel on this backend: the tensors run on the CPU instead


_S = Support
_TABLE: dict[str, dict[str, Support]] = {
    GGMLTypeName.TQ2_0: {"cpu": _S.FAST, "cuda": _S.NONE, "metal": _S.FAST, "vulkan": _S.FAST},
    GGMLTypeName.TQ1_0: {"cpu": _S.FAST, "cuda": _S.NONE, "metal": _S.PARTIAL, "vulkan": _S.FAST},
    GGMLTypeName.Q2_0: {"cpu": _S.SCALAR, "cuda": _S.FAST, "metal": _S.FAST, "vulkan": _S.FAST},
    GGMLTypeName.Q1_0: {"cpu": _S.FAST, "cuda": _S.FAST, "metal": _S.FAST, "vulkan": _S.FAST},
    GGMLTypeName.BF16: {"cpu": _S.FAST, "cuda": _S.FAST, "metal": _S.PARTIAL, "vulkan": _S.FAST},
}
_DEFAULT_RECIPE = {"cpu": "tq2_0", "cuda": "q2_0", "metal": "q2_0", "vulkan": "q2_0"}
_WHY = {
    _S.NONE: "has no kernel on {target} in mainline llama.cpp: those tensors will run on the CPU",
    _S.SCALAR: "runs on {target} only through llama.cpp's generic scalar code (slow){arm}",
    _S.PARTIAL: "is only partly supported on {target}: some operations fall back to the CPU",
}


def support(ggml_type: str, target: str) -> Support:
    """How well llama.cpp runs `ggml_type` on `target` (types outside the table: everywhere fast)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {', '.join(TARGETS)}")
    return _TABLE.get(ggml_type.upper(), {}).get(target, Support.FAST)


def default_recipe(target: str) -> str:
    """The recipe whose ternary type runs fastest on `target`."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {', '.join(TARGETS)}")
    return _DEFAULT_RECIPE[target]


def backend_warnings(types: Iterable[str], target: str) -> list[str]:
    """One sentence per tensor type of a file that `target` runs badly, naming the better recipe."""
    better = default_recipe(target)
    found = []
    for ggml_type in sorted({t.upper() for t in types}):
        level = support(ggml_type, target)
        if level is Support.FAST:
            continue
        on_arm = ggml_type == GGMLTypeName.Q2_0 and target == "cpu"
        arm = "; ARM CPUs have a fast NEON kernel" if on_arm else ""
        why = _WHY[level].format(target=target, arm=arm)
        found.append(f"{ggml_type} {why}; for {target} the recipe {better!r} is the fast choice")
    return found
