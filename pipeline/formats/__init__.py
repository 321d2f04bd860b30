"""File formats, one parser each: safetensors, GGUF, tokenizers, HF checkpoints. Imports only `core`."""
