"""Content-addressed artifact storage."""

from pipeline.artifacts.local import LocalStore
from pipeline.artifacts.memory import MemoryStore
from pipeline.artifacts.store import ArtifactStore, StoredArtifact

__all__ = ["ArtifactStore", "StoredArtifact", "LocalStore", "MemoryStore"]
