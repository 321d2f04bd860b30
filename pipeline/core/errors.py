"""One exception tree; the type says whether a failed stage may be retried."""

from __future__ import annotations


class PipelineError(Exception):
    """Base of every error the pipeline raises on purpose."""

    is_retryable = False


class InputError(PipelineError):
    """The input cannot be converted as given (missing file, unsupported architecture)."""


class IntegrityError(PipelineError):
    """Bytes are not what they claim to be (checksum or format mismatch); keep the evidence."""


class TransientError(PipelineError):
    """A passing fault (network, hub 5xx, lost worker): retrying may succeed."""

    is_retryable = True


class UnreachableError(PipelineError):
    """A service cannot be reached at all (connection refused, unknown host, no route) and no local
    copy can stand in: waiting seconds and retrying will not change that, so the message names the
    fix (a cached copy, offline mode, a local folder) and the stage fails now."""


class OutgrowsWorker(PipelineError):
    """A stage would need more memory than this worker may use (BONSAI_WORKER_MEMORY_MB), refused
    before it starts; another attempt may land on a bigger worker of the same queue. ``metrics``
    (recorded on the attempt) holds both numbers, so the job can wait for such a worker."""

    is_retryable = True

    def __init__(self, message: str, need_bytes: int, cap_bytes: int) -> None:
        super().__init__(message)
        self.metrics = {"memory_need_bytes": int(need_bytes), "worker_cap_bytes": int(cap_bytes)}


class OverCap(PipelineError):
    """A team is at one of its caps (pending jobs, storage quota): nothing was recorded, and the same
    request may succeed after ``retry_after_s`` (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = int(retry_after_s)


class IllegalTransition(PipelineError):
    """A status change that the transition table does not allow."""


def error_kind(exc: BaseException) -> str:
    """'retryable' or 'permanent', as stored on a failed stage run."""
    return "retryable" if getattr(exc, "is_retryable", False) else "permanent"
