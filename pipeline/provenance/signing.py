"""DSSE envelopes over provenance statements, signed with a local Ed25519 key.

The envelope follows the DSSE v1 protocol: the signature covers the pre-authentication
encoding PAE(payloadType, payload), never the bare JSON, so a signature over one payload
type cannot be replayed as another. Envelopes are stored as ordinary content-addressed
artifacts (kind ``dsse-envelope``, made by the statement's stage run), so no schema
change is needed and the envelope bytes are themselves hashed and immutable.

`cryptography` is imported lazily: auditing without signatures needs nothing extra.

Example::

    private_path, public_path = generate_key(Path("keys/bonsai.pem"))
    envelope = sign_statement(statement, load_private_key(private_path))
    assert verify_envelope(envelope, load_public_key(public_path)) == statement
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.artifacts.store import ArtifactStore
from pipeline.core.errors import InputError, IntegrityError
from pipeline.db import repo
from pipeline.db.models import Artifact, Provenance, StageRun

__all__ = [
    "PAYLOAD_TYPE",
    "ENVELOPE_KIND",
    "ENVELOPE_MEDIA_TYPE",
    "pae",
    "generate_key",
    "load_private_key",
    "load_public_key",
    "key_id",
    "sign_statement",
    "verify_envelope",
    "envelopes_for",
    "sign_pending",
    "store_envelope",
    "StoredEnvelope",
    "configured_public_key",
    "is_signed_by",
]

PAYLOAD_TYPE = "application/vnd.in-toto+json"
ENVELOPE_KIND = "dsse-envelope"
ENVELOPE_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: "DSSEv1 <len> <type> <len> <body>" (lengths in ASCII)."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(kind), kind, len(payload), payload)


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise InputError(
            "signing needs the `cryptography` package: pip install 'bonsai-pipeline[signing]'"
        ) from exc
    return ed25519


def generate_key(private_path: Path) -> tuple[Path, Path]:
    """Write a new Ed25519 key pair: PEM private key (mode 0600) and `<name>.pub` beside it.

    Raises InputError when either file exists: a key is never overwritten.
    """
    from cryptography.hazmat.primitives import serialization

    ed25519 = _crypto()
    public_path = private_path.with_name(private_path.name + ".pub")
    for path in (private_path, public_path):
        if path.exists():
            raise InputError(f"{path} already exists; keys are never overwritten (choose another --out)")
    private_path.parent.mkdir(parents=True, exist_ok=True)
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # Created with 0600 from the start: the key is never readable by others, not even briefly.
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private_path, public_path


def _read_pem(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InputError(
            f"{what} {path} cannot be read: {exc.strerror}; make one with `bonsai keygen`"
        ) from exc


def load_private_key(path: Path) -> Any:
    """The Ed25519 private key in PEM file `path` (BONSAI_SIGNING_KEY)."""
    from cryptography.hazmat.primitives import serialization

    ed25519 = _crypto()
    try:
        key = serialization.load_pem_private_key(_read_pem(path, "signing key"), password=None)
    except ValueError as exc:
        raise InputError(f"signing key {path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise InputError(f"signing key {path} is a {type(key).__name__}, expected an Ed25519 key")
    return key


def load_public_key(path: Path) -> Any:
    """The Ed25519 public key in PEM file `path`; a private key file yields its public half."""
    from cryptography.hazmat.primitives import serialization

    ed25519 = _crypto()
    data = _read_pem(path, "public key")
    if b"PRIVATE KEY" in data:
        return load_private_key(path).public_key()
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise InputError(f"public key {path} is not a PEM public key: {exc}") from exc
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise InputError(f"public key {path} is a {type(key).__name__}, expected an Ed25519 key")
    return key


def key_id(public_key: Any) -> str:
    """sha256 of the raw 32-byte public key, hex: names the key inside envelopes."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def _canonical(statement: Mapping[str, Any]) -> bytes:
    # Sorted keys, no spaces: the same statement always yields the same payload bytes.
    return json.dumps(statement, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sign_statement(statement: Mapping[str, Any], private_key: Any) -> dict[str, Any]:
    """A DSSE envelope carrying `statement`, signed by `private_key` (Ed25519)."""
    payload = _canonical(statement)
    signature = private_key.sign(pae(PAYLOAD_TYPE, payload))
    return {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode("ascii"),
        "signatures": [
            {"keyid": key_id(private_key.public_key()), "sig": base64.b64encode(signature).decode("ascii")}
        ],
    }


def is_signed_by(envelope: Mapping[str, Any], wanted_key_id: str) -> bool:
    """Whether the envelope carries a signature naming this key (or naming no key at all)."""
    return any(sig.get("keyid") in (wanted_key_id, None, "") for sig in envelope.get("signatures", []))


def verify_envelope(envelope: Mapping[str, Any], public_key: Any) -> dict[str, Any]:
    """The statement inside `envelope` once a signature by `public_key` checks out.

    Raises IntegrityError naming what is wrong: the payload type, a missing signature by
    this key, or a signature that does not match the payload.
    """
    from cryptography.exceptions import InvalidSignature

    if envelope.get("payloadType") != PAYLOAD_TYPE:
        raise IntegrityError(
            f"envelope payloadType is {envelope.get('payloadType')!r}, expected {PAYLOAD_TYPE}"
        )
    try:
        payload = base64.b64decode(envelope["payload"], validate=True)
    except (KeyError, ValueError) as exc:
        raise IntegrityError("envelope payload is missing or not base64") from exc
    wanted = key_id(public_key)
    signatures = [s for s in envelope.get("signatures", []) if s.get("keyid") in (wanted, None, "")]
    if not signatures:
        raise IntegrityError(f"envelope has no signature by key {wanted[:16]}")
    for entry in signatures:
        try:
            public_key.verify(
                base64.b64decode(entry.get("sig", ""), validate=True), pae(PAYLOAD_TYPE, payload)
            )
        except (InvalidSignature, ValueError):
            continue
        statement: dict[str, Any] = json.loads(payload)
        return statement
    raise IntegrityError(f"envelope signature by key {wanted[:16]} does not match its payload")


@dataclass(frozen=True)
class StoredEnvelope:
    """An envelope read back from the store, with the artifact that holds it."""

    sha256: str
    envelope: dict[str, Any]
    subject_sha256: str | None


def _subject_of(envelope: Mapping[str, Any]) -> str | None:
    try:
        statement = json.loads(base64.b64decode(envelope["payload"]))
        return str(statement["subject"][0]["digest"]["sha256"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def envelopes_for(session: Session, store: ArtifactStore, provenance: Provenance) -> list[StoredEnvelope]:
    """Stored envelopes whose statement is about this provenance row's artifact and run."""
    rows = session.scalars(
        select(Artifact)
        .where(Artifact.kind == ENVELOPE_KIND, Artifact.created_by_run_id == provenance.stage_run_id)
        .order_by(Artifact.created_at)
    ).all()
    found = []
    for row in rows:
        if not store.has(row.sha256):
            continue
        try:
            envelope = json.loads(store.path(row.sha256).read_bytes())
        except ValueError:
            continue
        subject = _subject_of(envelope)
        if subject == provenance.artifact_sha256:
            found.append(StoredEnvelope(row.sha256, envelope, subject))
    return found


def store_envelope(session: Session, store: ArtifactStore, run: StageRun, envelope: dict[str, Any]) -> str:
    """Store a DSSE envelope as an artifact written by `run`; returns its digest."""
    data = json.dumps(envelope, sort_keys=True, indent=2).encode("utf-8")
    with tempfile.TemporaryDirectory(prefix="dsse-") as tmp:
        path = Path(tmp) / "envelope.dsse.json"
        path.write_bytes(data)
        stored = store.put(path)
    repo.record_artifact(
        session, stored.sha256, stored.size_bytes, stored.uri, ENVELOPE_KIND, ENVELOPE_MEDIA_TYPE, run
    )
    return stored.sha256


def _pending(session: Session, job_id: int | None) -> Iterator[Provenance]:
    query = select(Provenance).order_by(Provenance.id)
    if job_id is not None:
        query = query.join(StageRun, StageRun.id == Provenance.stage_run_id).where(StageRun.job_id == job_id)
    yield from session.scalars(query)


def sign_pending(session: Session, store: ArtifactStore, private_key: Any, job_id: int | None = None) -> int:
    """Sign every stored statement (of one job, or all) that this key has not signed yet.

    Returns how many envelopes were written. Ed25519 signatures are deterministic, so
    signing twice would store the same bytes; the check just avoids the work.
    """
    wanted = key_id(private_key.public_key())
    count = 0
    for row in _pending(session, job_id):
        signed = envelopes_for(session, store, row)
        if any(is_signed_by(item.envelope, wanted) for item in signed):
            continue
        store_envelope(
            session,
            store,
            session.get_one(StageRun, row.stage_run_id),
            sign_statement(row.statement, private_key),
        )
        count += 1
    return count


def configured_public_key(public_path: Path | None, private_path: Path | None) -> Any | None:
    """The key `audit` verifies with: the public key file, else the signing key's public half, else None."""
    if public_path is not None:
        return load_public_key(public_path)
    if private_path is not None:
        return load_public_key(private_path)
    return None
