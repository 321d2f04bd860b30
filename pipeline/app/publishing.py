"""`bonsai publish`: gather a job's facts from the database and hand them to the bundle builder.

The bundle itself is made by `pipeline.publish` (pure functions over files and facts).
An `s3://bucket/prefix` destination is built in a scratch folder, then uploaded file by
file with SHA-256 checksums; nothing already under that prefix is overwritten.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from pipeline.artifacts.store import ArtifactStore
from pipeline.core.errors import InputError
from pipeline.core.states import StageName, StageState
from pipeline.db import actions, repo, retention
from pipeline.provenance.audit import job_gguf
from pipeline.provenance.export import chain_statements
from pipeline.publish import Bundle, JobFacts, build_bundle

__all__ = ["job_facts", "publish_job"]


def job_facts(session: Session, store: ArtifactStore, job_id: int) -> tuple[JobFacts, str]:
    """The card's facts about `job_id` and the sha256 of its GGUF; InputError when it has none."""
    job = repo.get_job(session, job_id)
    gguf = job_gguf(session, job_id)
    validate = repo.latest_runs(session, job_id).get(StageName.VALIDATE)
    metrics = dict(validate.metrics or {}) if validate is not None else {}
    finished = (StageState.SUCCEEDED, StageState.SKIPPED_CACHED, StageState.FAILED)
    if validate is None or validate.status not in finished:
        verdict = "missing"
    elif validate.status == StageState.FAILED:
        verdict = "fail"
    else:
        verdict = str(metrics.get("verdict", "pass"))
    items = chain_statements(session, store, gguf.sha256)
    facts = JobFacts(
        job_id=job.id, source=job.source, resolved_revision=job.resolved_revision, recipe=job.recipe,
        recipe_options=dict(job.params or {}), validation_verdict=verdict, validation=metrics or None,
        statements=tuple(item["statement"] for item in items),
        envelopes=tuple(envelope for item in items for envelope in item["envelopes"]),
    )
    return facts, gguf.sha256


def publish_job(session: Session, store: ArtifactStore, job_id: int, dest: str, *,
                split_max_bytes: int | None = None, is_forced: bool = False,
                s3_client: Any = None, actor: str | None = None) -> tuple[Bundle, str]:
    """Publish `job_id` to a folder or an s3:// prefix; returns the bundle and where it went.

    The GGUF is recorded as published there (`bonsai gc --keep-published` keeps it), and the publication
    as ``actor``'s action with its destination, when the caller commits.
    """
    facts, sha256 = job_facts(session, store, job_id)
    gguf = repo.artifacts_by_digest(session, {sha256})[sha256]
    if gguf.released_at is not None:
        raise InputError(f"job {job_id}: `bonsai gc` removed its GGUF's bytes; remake them with "
                         f"`bonsai retry {job_id} --from package`, then publish")
    where = str(Path(dest).resolve()) if not dest.startswith("s3://") else dest
    retention.pin(session, gguf, retention.PUBLISHED, where)
    actions.record(session, actor, "publish", f"job {job_id}", job_id=job_id,
                   detail={"destination": where, "gguf_sha256": sha256, "forced": is_forced})
    if not dest.startswith("s3://"):
        bundle = build_bundle(facts, store.path(sha256), Path(dest), split_max_bytes=split_max_bytes,
                              is_forced=is_forced)
        return bundle, where
    from pipeline.artifacts.s3 import S3Location

    location = S3Location.parse(dest)
    with tempfile.TemporaryDirectory(prefix="bonsai-publish-") as scratch:
        bundle = build_bundle(facts, store.path(sha256), Path(scratch) / "bundle",
                              split_max_bytes=split_max_bytes, is_forced=is_forced)
        _upload(bundle, location, s3_client)
    return bundle, str(location)


def _upload(bundle: Bundle, location: Any, client: Any) -> None:
    from botocore.exceptions import ClientError

    names = [*bundle.files, "SHA256SUMS"]
    keys = {name: f"{location.prefix}/{name}" if location.prefix else name for name in names}
    for key in keys.values():
        try:
            client.head_object(Bucket=location.bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                continue
            raise
        raise InputError(f"s3://{location.bucket}/{key} exists; publish to a new prefix (never overwritten)")
    for name, key in keys.items():
        # The transfer manager sends a SHA-256 with each part, which the server checks.
        client.upload_file(str(bundle.folder / name), location.bucket, key,
                           ExtraArgs={"ChecksumAlgorithm": "SHA256"})
