"""A job's result as a bundle to hand on: the GGUF (split when asked), a model card, SHA256SUMS, provenance.

Pure functions over files and facts (no database, no store): `pipeline.publishing` gathers
a job's facts and calls `build_bundle`.
"""

from pipeline.publish.bundle import Bundle, JobFacts, build_bundle
from pipeline.publish.split import parse_size, split_gguf

__all__ = ["Bundle", "JobFacts", "build_bundle", "parse_size", "split_gguf"]
