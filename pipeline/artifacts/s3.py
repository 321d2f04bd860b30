"""Artifact store in an S3-compatible object store (`BONSAI_ARTIFACT_ROOT=s3://bucket/prefix`).

Objects live at `<prefix>/sha256/ab/<digest>`. Integrity, end to end:

- upload: the file is read once to get its sha256 and, for a multipart upload, the sha256
  of each part; every request carries its SHA-256 (`x-amz-checksum-sha256`), so the server
  refuses bytes that changed on the way (`BadDigest`). Whole-object SHA-256 exists only
  for single-part uploads; a multipart object gets a composite checksum over the part
  checksums, each of which the server checked. The key itself is the whole-file digest.
- never overwrite: uploads are conditional (`If-None-Match: *`); an existing key is left
  alone (equal key, equal bytes).
- a failed multipart upload is aborted, so no partial object is ever visible; one that
  could not be aborted (the server died) is aborted by the next upload of that key.
- download: `path()` streams the object into the worker's `LocalCache`, hashing on the
  way; bytes that do not hash to their key are refused before any stage sees them.

Errors: unreachable endpoint, 5xx and throttling are `TransientError` (the stage is
retried); a missing bucket, bad credentials or a refused request are `InputError`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pipeline.artifacts.activity import current_activity
from pipeline.artifacts.cache import LocalCache
from pipeline.artifacts.s3_io import FileRange, b64, code_of, hash_file, status_of, translate
from pipeline.artifacts.store import StoredArtifact, check_digest
from pipeline.core.errors import InputError, IntegrityError, PipelineError

__all__ = ["S3Location", "S3Store", "make_s3_client"]

log = logging.getLogger(__name__)

_HASH_CHUNK_BYTES = 8 * 1024 * 1024
_DEFAULT_PART_BYTES = 64 * 1024 * 1024
# S3's smallest allowed part (all but the last).
_MIN_PART_BYTES = 5 * 1024 * 1024
_MAX_PARTS = 10_000
@dataclass(frozen=True)
class S3Location:
    """Bucket and key prefix of a store; `parse("s3://bucket/some/prefix")`."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """Split an s3:// URL; InputError when it has no bucket."""
        if not url.startswith("s3://"):
            raise InputError(f"artifact root {url!r} is not an s3:// URL (expected s3://bucket/prefix)")
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise InputError(f"artifact root {url!r} names no bucket (expected s3://bucket/prefix)")
        return cls(bucket, prefix.strip("/"))

    def key(self, sha256: str) -> str:
        check_digest(sha256)
        tail = f"sha256/{sha256[:2]}/{sha256}"
        return f"{self.prefix}/{tail}" if self.prefix else tail

    def uri(self, sha256: str) -> str:
        return f"s3://{self.bucket}/{self.key(sha256)}"

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def make_s3_client(endpoint_url: str | None = None, max_pool_connections: int = 16) -> Any:
    """A boto3 S3 client; region and credentials come from the standard AWS variables or profile.

    A custom endpoint (SeaweedFS, MinIO, Ceph) gets path-style addressing. Checksums are
    sent only where this module computes them itself (no CRC trailers added by botocore).
    """
    import boto3
    from botocore.config import Config

    config = Config(
        s3={"addressing_style": "path" if endpoint_url else "auto"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        retries={"max_attempts": 4, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
        max_pool_connections=max_pool_connections,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url or None, config=config)


class S3Store:
    """The ArtifactStore contract over one bucket/prefix, with a local read-through cache.

    `part_size_bytes`: files larger than this go up in parts of this size, `max_concurrency`
    parts at a time. `stale_upload_s`: an unfinished multipart upload of the same key older
    than this is taken to be a dead attempt's and aborted.
    """

    def __init__(
        self,
        location: S3Location,
        client: Any,
        cache: LocalCache,
        *,
        part_size_bytes: int = _DEFAULT_PART_BYTES,
        max_concurrency: int = 4,
        stale_upload_s: float = 3600.0,
    ) -> None:
        if part_size_bytes < _MIN_PART_BYTES:
            raise InputError(
                f"S3 part size {part_size_bytes} bytes is below S3's minimum of {_MIN_PART_BYTES}; "
                "raise BONSAI_S3_PART_SIZE_BYTES"
            )
        self.location, self.cache = location, cache
        self._client = client
        self._part_size_bytes = part_size_bytes
        self._max_concurrency = max_concurrency
        self._stale_upload_s = stale_upload_s
        self._is_bucket_checked = False

    # --- the ArtifactStore contract ------------------------------------------------------------

    def put(self, source: Path, expected_sha256: str | None = None) -> StoredArtifact:
        source = Path(source)
        if expected_sha256 is not None:
            size = self._size_of(expected_sha256)
            if size is not None:
                self.cache.adopt(source, expected_sha256)
                return StoredArtifact(expected_sha256, size, self.uri(expected_sha256))
        size = source.stat().st_size
        part_size = self._part_size_for(size)
        sha256, part_checksums = hash_file(source, part_size if size > part_size else None)
        if expected_sha256 is not None and sha256 != expected_sha256:
            raise IntegrityError(
                f"{source}: stored bytes hash to {sha256}, expected {expected_sha256}; not stored"
            )
        if self._size_of(sha256) is None:
            with self._errors(f"uploading {source} to {self.uri(sha256)}"):
                if part_checksums is None:
                    self._put_single(source, sha256, size)
                else:
                    self._put_multipart(source, sha256, part_size, part_checksums)
        self.cache.adopt(source, sha256)
        return StoredArtifact(sha256, size, self.uri(sha256))

    def has(self, sha256: str) -> bool:
        return self._size_of(sha256) is not None

    def path(self, sha256: str) -> Path:
        activity = current_activity()
        hit = self.cache.lookup(sha256)
        if hit is not None:
            if activity is not None:
                activity.add(cache_hits=1)
            return hit
        uri = self.uri(sha256)
        with self._errors(f"downloading {uri}"):
            body = self._get_body(sha256)
            path = self.cache.fill(sha256, body.iter_chunks(_HASH_CHUNK_BYTES), uri)
        if activity is not None:
            activity.add(cache_misses=1)
            activity.add(downloaded_bytes=path.stat().st_size)
        return path

    def rehash(self, sha256: str) -> tuple[str, int]:
        """sha256 and size of the object in the bucket (never the cache); KeyError when absent."""
        digest, size = hashlib.sha256(), 0
        with self._errors(f"re-reading {self.uri(sha256)}"):
            for chunk in self._get_body(sha256).iter_chunks(_HASH_CHUNK_BYTES):
                digest.update(chunk)
                size += len(chunk)
        activity = current_activity()
        if activity is not None:
            activity.add(downloaded_bytes=size)
        return digest.hexdigest(), size

    def verify(self, sha256: str) -> bool:
        return self.rehash(sha256)[0] == sha256

    def uri(self, sha256: str) -> str:
        return self.location.uri(sha256)

    def local_path(self, sha256: str) -> Path | None:
        path = self.cache.entry_path(sha256)
        return path if path.is_file() else None

    def remove(self, sha256: str) -> int:
        size = self._size_of(sha256)
        self.cache.discard(sha256)
        if size is None:
            return 0
        with self._errors(f"deleting {self.uri(sha256)}"):
            self._client.delete_object(Bucket=self.location.bucket, Key=self.location.key(sha256))
        return size

    # --- requests ------------------------------------------------------------------------------

    def _size_of(self, sha256: str) -> int | None:
        """ContentLength of the stored object, None when there is none."""
        key = self.location.key(sha256)
        with self._errors(f"looking up {self.uri(sha256)}"):
            self._check_bucket()
            try:
                head = self._client.head_object(Bucket=self.location.bucket, Key=key)
            except Exception as exc:
                if status_of(exc) == 404:
                    return None
                raise
        return int(head["ContentLength"])

    def _get_body(self, sha256: str) -> Any:
        self._check_bucket()
        try:
            response = self._client.get_object(Bucket=self.location.bucket, Key=self.location.key(sha256))
        except Exception as exc:
            if status_of(exc) == 404:
                raise KeyError(f"artifact {sha256} is not in the store at {self.location}") from exc
            raise
        return response["Body"]

    def _check_bucket(self) -> None:
        if self._is_bucket_checked:
            return
        try:
            self._client.head_bucket(Bucket=self.location.bucket)
        except Exception as exc:
            if status_of(exc) == 404:
                raise InputError(
                    f"bucket {self.location.bucket!r} does not exist at the S3 endpoint "
                    f"({self._client.meta.endpoint_url}); create it or fix BONSAI_ARTIFACT_ROOT"
                ) from exc
            raise
        self._is_bucket_checked = True

    def _put_single(self, source: Path, sha256: str, size: int) -> None:
        with open(source, "rb") as body:
            try:
                self._client.put_object(
                    Bucket=self.location.bucket, Key=self.location.key(sha256), Body=body, ContentLength=size,
                    ChecksumSHA256=b64(bytes.fromhex(sha256)), IfNoneMatch="*", Metadata={"sha256": sha256},
                )
            except Exception as exc:
                if not self._lost_race(exc, sha256):
                    raise
        self._count_upload(size)

    def _put_multipart(self, source: Path, sha256: str, part_size: int, checksums: list[str]) -> None:
        bucket, key = self.location.bucket, self.location.key(sha256)
        self._abort_stale_uploads(key)
        upload_id = self._client.create_multipart_upload(
            Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256", Metadata={"sha256": sha256}
        )["UploadId"]
        size = source.stat().st_size

        def upload_part(number: int) -> dict[str, Any]:
            start = (number - 1) * part_size
            with FileRange(source, start, min(part_size, size - start)) as body:
                answer = self._client.upload_part(
                    Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body,
                    ContentLength=len(body), ChecksumSHA256=checksums[number - 1],
                )
            return {"PartNumber": number, "ETag": answer["ETag"], "ChecksumSHA256": checksums[number - 1]}

        try:
            with ThreadPoolExecutor(self._max_concurrency, thread_name_prefix="s3-part") as pool:
                parts = list(pool.map(upload_part, range(1, len(checksums) + 1)))
            # Counted here: the pool's threads do not see this context's activity window.
            self._count_upload(size)
            try:
                self._client.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts},
                    IfNoneMatch="*",
                )
            except Exception as exc:
                if not self._lost_race(exc, sha256):
                    raise
                self._abort(key, upload_id)
        except BaseException:
            self._abort(key, upload_id)
            raise

    def _lost_race(self, exc: Exception, sha256: str) -> bool:
        """Whether a refused conditional write means another writer stored these bytes first."""
        if code_of(exc) not in ("PreconditionFailed", "ConditionalRequestConflict"):
            return False
        return self._size_of(sha256) is not None

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.location.bucket, Key=key, UploadId=upload_id)
        except Exception:  # noqa: BLE001 - the next upload of this key aborts it (see _abort_stale_uploads)
            log.warning("multipart upload %s of %s could not be aborted now", upload_id, key, exc_info=True)

    def _abort_stale_uploads(self, key: str) -> None:
        cutoff = datetime.now(UTC) - timedelta(seconds=self._stale_upload_s)
        listing = self._client.list_multipart_uploads(Bucket=self.location.bucket, Prefix=key)
        for upload in listing.get("Uploads", []):
            if upload["Key"] == key and upload["Initiated"] <= cutoff:
                log.info("aborting unfinished upload %s of %s from %s",
                         upload["UploadId"], key, upload["Initiated"])
                self._abort(key, upload["UploadId"])

    def _part_size_for(self, size: int) -> int:
        # Keep within S3's 10,000-part limit for very large files.
        needed = -(-size // _MAX_PARTS)
        return max(self._part_size_bytes, needed)

    @staticmethod
    def _count_upload(size: int) -> None:
        activity = current_activity()
        if activity is not None:
            activity.add(uploaded_bytes=size)

    @contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """Turn botocore errors into the pipeline's tree (retryable or not), naming what failed."""
        try:
            yield
        except (PipelineError, KeyError):
            raise
        except Exception as exc:
            translated = translate(exc, doing, self._client.meta.endpoint_url)
            if translated is None:
                raise
            raise translated from exc
