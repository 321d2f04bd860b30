"""Tokenizers to GGUF vocabularies: byte-level BPE (tokenizer.json) and SentencePiece (tokenizer.model)."""
