"""Our layer over the `gguf` package: names, keys, vocab, writing and checking GGUF files.

Modules: `names`/`keys` (tables), `source` (HF tensor plan and streaming), `vocab`
(tokenizer.json -> GGUF vocab), `write` (streaming writer), `inspect` (read-back checks).
Import the submodules directly; this package imports nothing heavy on its own.
"""

from __future__ import annotations
