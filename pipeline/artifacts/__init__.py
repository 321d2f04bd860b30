"""Content-addressed artifact storage: a local folder, memory (tests), or an S3 bucket (`s3.py`).

`pipeline.artifacts.s3` is imported only where an s3:// root is configured, so boto3 stays
out of processes that do not need it.
"""

from pipeline.artifacts.activity import StoreActivity, current_activity, store_activity
from pipeline.artifacts.cache import LocalCache
from pipeline.artifacts.local import LocalStore
from pipeline.artifacts.memory import MemoryStore
from pipeline.artifacts.store import ArtifactStore, StoredArtifact

__all__ = [
    "ArtifactStore",
    "StoredArtifact",
    "LocalStore",
    "MemoryStore",
    "LocalCache",
    "StoreActivity",
    "store_activity",
    "current_activity",
]
