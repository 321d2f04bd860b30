"""Calibration: run a source model over text and keep what later stages need from that run.

Pure stage logic (files, tensors and numbers; no database, broker or environment), like
`pipeline.ternary` and `pipeline.formats`:

- `text`: the built-in calibration text (``data/calibration.txt``, its licence in
  ``data/README.md``) and reading a user's file;
- `sequences`: texts as token-id sequences of at most ``n_ctx`` tokens (llama.cpp's tokenizer);
- `stats`: per linear weight, the sum of x² per input column, the token count and, when
  asked, the input Gram matrix XᵀX (float64 accumulation); `gram` writes and reads those;
- `imatrix`: the importance matrix in llama.cpp's own imatrix GGUF format, and the
  ``llama_model_imatrix_data`` array llama.cpp's quantizer takes;
- `llama_collect` (with `ggml_abi` and `llama_session`): statistics from llama.cpp's eval
  callback, for every architecture llama.cpp runs, GGUF sources included;
- `torch_model` / `torch_collect`: the same statistics from a plain-torch forward of the HF
  architectures we package, one transformer block at a time (memory flat in model size);
- `reference`: the source's next-token answers on given texts (top-k log-probs, tail mass,
  draws from the tail), computed once and stored; `agreement`: a candidate's logits scored
  against them (top-1 agreement and log-perplexities exactly, KL without bias).
"""

from __future__ import annotations
