"""GGUF: one bounded reader, a streaming writer, key and type tables, read-back checks, tensor source."""
