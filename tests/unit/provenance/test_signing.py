"""DSSE envelopes over statements: the PAE encoding, Ed25519 sign/verify, key files."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest

from pipeline.core.errors import InputError, IntegrityError
from pipeline.provenance.signing import PAYLOAD_TYPE, pae

if os.environ.get("CI") != "true":
    # Locally the signing extra may be missing; under CI it is installed and must not skip.
    pytest.importorskip("cryptography", reason="pip install '.[signing]' for the signing tests")

from pipeline.provenance.signing import (  # noqa: E402
    configured_public_key,
    generate_key,
    is_signed_by,
    key_id,
    load_private_key,
    load_public_key,
    sign_statement,
    verify_envelope,
)

STATEMENT = {
    "_type": "https://in-toto.io/Statement/v1",
    "subject": [{"name": "model.gguf", "digest": {"sha256": "ab" * 32}}],
    "predicateType": "https://slsa.dev/provenance/v1",
    "predicate": {"buildDefinition": {"resolvedDependencies": []}},
}


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return generate_key(tmp_path / "keys" / "signing.pem")


def test_pae_matches_the_dsse_spec_example() -> None:
    # The worked example of the DSSE v1 protocol document.
    assert pae("http://example.com/HelloWorld", b"hello world") == (
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )
    # Lengths count bytes, not characters.
    assert pae("t", "é".encode()) == b"DSSEv1 1 t 2 \xc3\xa9"


def test_signed_statement_verifies_and_round_trips(keys: tuple[Path, Path]) -> None:
    private_path, public_path = keys
    envelope = sign_statement(STATEMENT, load_private_key(private_path))

    assert envelope["payloadType"] == PAYLOAD_TYPE
    assert json.loads(base64.b64decode(envelope["payload"])) == STATEMENT
    public = load_public_key(public_path)
    assert envelope["signatures"][0]["keyid"] == key_id(public)
    assert is_signed_by(envelope, key_id(public))
    assert verify_envelope(envelope, public) == STATEMENT


def test_changed_payload_or_signature_is_refused(keys: tuple[Path, Path]) -> None:
    private_path, public_path = keys
    public = load_public_key(public_path)
    envelope = sign_statement(STATEMENT, load_private_key(private_path))

    forged = dict(STATEMENT, subject=[{"name": "model.gguf", "digest": {"sha256": "cd" * 32}}])
    changed = {**envelope, "payload": base64.b64encode(json.dumps(forged).encode()).decode()}
    with pytest.raises(IntegrityError, match="does not match its payload"):
        verify_envelope(changed, public)

    retyped = {**envelope, "payloadType": "application/json"}
    with pytest.raises(IntegrityError, match="payloadType"):
        verify_envelope(retyped, public)


def test_signature_by_another_key_is_refused(keys: tuple[Path, Path], tmp_path: Path) -> None:
    private_path, _ = keys
    _, other_public = generate_key(tmp_path / "other.pem")
    envelope = sign_statement(STATEMENT, load_private_key(private_path))
    other = load_public_key(other_public)

    assert not is_signed_by(envelope, key_id(other))
    with pytest.raises(IntegrityError, match="no signature by key"):
        verify_envelope(envelope, other)


def test_key_files_are_private_and_never_overwritten(keys: tuple[Path, Path]) -> None:
    private_path, public_path = keys
    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600
    assert public_path.name == "signing.pem.pub"
    # The public half derived from the private file is the published one.
    assert key_id(load_public_key(private_path)) == key_id(load_public_key(public_path))
    before = private_path.read_bytes()
    with pytest.raises(InputError, match="already exists"):
        generate_key(private_path)
    assert private_path.read_bytes() == before


def test_configured_public_key_prefers_the_public_file(keys: tuple[Path, Path], tmp_path: Path) -> None:
    private_path, public_path = keys
    assert configured_public_key(None, None) is None
    assert key_id(configured_public_key(None, private_path)) == key_id(load_public_key(public_path))
    _, other_public = generate_key(tmp_path / "other.pem")
    chosen = configured_public_key(other_public, private_path)
    assert key_id(chosen) == key_id(load_public_key(other_public))


def test_unreadable_or_wrong_key_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="missing.pem cannot be read"):
        load_private_key(tmp_path / "missing.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a key")
    with pytest.raises(InputError, match="garbage.pem is not"):
        load_public_key(garbage)
