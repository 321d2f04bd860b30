"""The validate stage's parts: judging outputs (`judge`), running llama.cpp in a child process
(`probe`), the F16 reference of an HF source (`reference`) and checks on the file itself
(`file_checks`). Pure logic over files and numbers, like `ternary` and `gguf_pack`; the stage
module `pipeline.stages.validate` puts them together.
"""

from __future__ import annotations
