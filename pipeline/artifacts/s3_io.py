"""S3 plumbing the store needs: error translation, part checksums, and a file range as a request body."""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError, IntegrityError, PipelineError, TransientError

__all__ = ["translate", "status_of", "code_of", "b64", "hash_file", "FileRange"]

_HASH_CHUNK_BYTES = 8 * 1024 * 1024
TRANSIENT_CODES = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                    "RequestTimeTooSkewed", "OperationAborted"}
CONFIG_CODES = {"NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                 "InvalidBucketName", "AllAccessDisabled", "ExpiredToken", "InvalidToken"}




def translate(exc: Exception, doing: str, endpoint: str) -> PipelineError | None:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return InputError(f"{doing}: no S3 credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                          "(or AWS_PROFILE)")
    if isinstance(exc, ClientError):
        code, status = code_of(exc), status_of(exc)
        message = exc.response.get("Error", {}).get("Message", "")
        if code == "BadDigest":
            return IntegrityError(f"{doing}: the server received bytes that do not match their SHA-256 "
                                  f"({message}); the file changed while it was sent")
        if code in CONFIG_CODES or status == 403:
            return InputError(f"{doing}: {endpoint} refused the request ({status} {code}: {message}); check "
                              "the bucket in BONSAI_ARTIFACT_ROOT and the AWS credentials")
        if status >= 500 or code in TRANSIENT_CODES or code == "NoSuchUpload":
            return TransientError(
                f"{doing}: {endpoint} answered {status} {code} ({message}); retrying may succeed"
            )
        return InputError(f"{doing}: {endpoint} answered {status} {code} ({message})")
    if isinstance(exc, BotoCoreError | ConnectionError | TimeoutError):
        return TransientError(f"{doing}: the object store at {endpoint} is unreachable or dropped the "
                              f"connection ({exc}); retrying may succeed")
    return None


def status_of(exc: Exception) -> int:
    response = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def code_of(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


def hash_file(path: Path, part_size: int | None) -> tuple[str, list[str] | None]:
    """Hex sha256 of the file and, with `part_size`, the base64 sha256 of each part; one read."""
    if part_size is None:
        with open(path, "rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest(), None
    whole, parts = hashlib.sha256(), []
    with open(path, "rb") as handle:
        while True:
            part, left = hashlib.sha256(), part_size
            while left and (chunk := handle.read(min(_HASH_CHUNK_BYTES, left))):
                whole.update(chunk)
                part.update(chunk)
                left -= len(chunk)
            if left == part_size:
                break
            parts.append(b64(part.digest()))
            if left:
                break
    return whole.hexdigest(), parts


class FileRange(io.RawIOBase):
    """A read-only, seekable view of `length` bytes of a file from `start` (one part's request body)."""

    def __init__(self, path: Path, start: int, length: int) -> None:
        super().__init__()
        self._handle = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._start, self._length, self._position = start, length, 0
        self._handle.seek(start)

    def __len__(self) -> int:
        return self._length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = min(max(base + offset, 0), self._length)
        self._handle.seek(self._start + self._position)
        return self._position

    def read(self, size: int | None = -1) -> bytes:
        left = self._length - self._position
        wanted = left if size is None or size < 0 else min(size, left)
        data = self._handle.read(wanted)
        self._position += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._handle.close()
        super().close()
