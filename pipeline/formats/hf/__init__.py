"""Hugging Face checkpoints: the architecture table and the HF -> GGUF tensor plan and stream."""
