"""API token configuration: hashed entries, scopes, and the errors that name a bad entry."""

from __future__ import annotations

import logging

import pytest

from pipeline.app.api.auth import (
    ApiToken,
    TokenRedactingFilter,
    hash_token,
    new_token,
    parse_tokens,
    redact_token_query,
)
from pipeline.core.errors import InputError


def test_new_token_entry_holds_only_the_hash() -> None:
    token, entry = new_token("ci", ("submit", "read"))
    name, scopes, digest = entry.split(":")
    assert (name, scopes) == ("ci", "read+submit")
    assert digest == hash_token(token)
    assert token not in entry
    [parsed] = parse_tokens(entry)
    assert parsed == ApiToken("ci", frozenset({"read", "submit"}), digest)


def test_scopes_and_submit_implies_read() -> None:
    reader, submitter = parse_tokens(f" dash:read:{'a' * 64} , ci:submit:{'B' * 64},")
    assert reader.allows("read") and not reader.allows("submit")
    assert submitter.allows("submit") and submitter.allows("read")
    assert submitter.sha256 == "b" * 64  # hex is normalised to lowercase


def test_an_entry_may_name_the_tokens_team() -> None:
    token, entry = new_token("ci", ("submit",), team="ml-infra")
    [parsed] = parse_tokens(entry)
    assert entry.endswith(":ml-infra") and parsed.team == "ml-infra" and parsed.team_name == "ml-infra"
    [alone] = parse_tokens(f"dash:read:{'a' * 64}")
    assert alone.team is None and alone.team_name == "api:dash"  # a team of its own


def test_empty_setting_means_no_tokens() -> None:
    assert parse_tokens("") == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("justatoken", "entry 1 must look like name:scopes:sha256hex"),
        (f"ok:read:{'a' * 64},bad:root:{'a' * 64}", r"entry 2 \(bad\): scopes 'root'"),
        ("dash:read:bonsai_plaintext-token", "never the token itself"),
        (f":read:{'a' * 64}", "entry 1 .no name."),
        (f"ci:read:{'a' * 64}: ", r"entry 1 \(ci\): the fourth field names the token's team"),
        (f"ci:read:{'a' * 64}:t:x", "got 5 field"),
    ],
)
def test_bad_entries_are_named(spec: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        parse_tokens(spec)


def test_token_query_values_are_redacted_from_access_log_lines() -> None:
    assert redact_token_query("/?token=bonsai_abc&x=1") == "/?token=***&x=1"
    assert redact_token_query("/web/app.js?v=1&TOKEN=s3cret#job=1") == "/web/app.js?v=1&TOKEN=***#job=1"
    assert redact_token_query("/?%74oken=s3cret&t%6Fken=x&tok=keep") == "/?%74oken=***&t%6Fken=***&tok=keep"
    assert redact_token_query("/api/jobs?status=failed") == "/api/jobs?status=failed"
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "GET", "/?token=bonsai_abc", "1.1", 200),
        None,
    )
    assert TokenRedactingFilter().filter(record)
    assert "bonsai_abc" not in record.getMessage() and "/?token=***" in record.getMessage()


def test_admin_changes_any_job_submit_only_its_own() -> None:
    alice = ApiToken("alice", frozenset({"submit"}), "a" * 64)
    admin = ApiToken("ops", frozenset({"admin"}), "b" * 64)
    reader = ApiToken("r", frozenset({"read"}), "c" * 64)
    assert alice.may_change("api:alice") and not alice.may_change("api:mallory")
    assert not alice.may_change(None)
    assert admin.may_change("api:mallory") and admin.may_change("cli:convert") and admin.allows("read")
    assert not reader.may_change("api:r")
