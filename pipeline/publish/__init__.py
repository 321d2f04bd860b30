"""A job's result as a bundle to hand on: the GGUF (split when asked), a model card, SHA256SUMS, provenance.

Pure functions over files and facts (no database, no store): `pipeline.app.publishing` gathers
a job's facts and calls `build_bundle`.
"""

from pipeline.formats.gguf.split import parse_size, split_gguf
from pipeline.publish.bundle import Bundle, JobFacts, build_bundle

__all__ = ["Bundle", "JobFacts", "build_bundle", "parse_size", "split_gguf"]
