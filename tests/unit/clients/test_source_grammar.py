"""A source is a grammar: hub revisions by git's ref rules, bounded text, no unprintable characters,
and a limited submitter learns nothing about paths outside its folders (issue 24, findings 1, 4-6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.clients.hub import HfHubClient
from pipeline.clients.hub_refs import revision_fault
from pipeline.core.errors import InputError
from pipeline.stages.sources import MAX_SOURCE_CHARS, SourcePolicy, parse_source, shown
from tests.support.hub_cache import COMMIT, REPO, build_hub_cache

SECRET = "AWS_SECRET_ACCESS_KEY=planted-secret-4711"


@pytest.mark.parametrize("revision", [
    "main", "v1.0", "refs/pr/1", "release/2024-01", COMMIT, "feature_x", "a@b",
])
def test_ref_names_and_shas_pass(revision: str) -> None:
    assert revision_fault(revision) is None
    assert parse_source(f"org/name@{revision}").revision == revision


@pytest.mark.parametrize("revision", [
    "/proc/self/environ", "../../etc/passwd", "refs/../x", "a//b", "trailing/", "x.lock", ".hidden",
    "a/.b", "end.", "@", "a@{1}", "back\\slash", "sp ace", "tab\there", "ti~lde", "car^et", "co:lon",
    "qu?", "st*r", "br[ack", "\x1b]0;title\x07", "del\x7f", "x" * 201, "",
])
def test_revisions_outside_gits_grammar_are_refused(revision: str) -> None:
    assert revision_fault(revision) is not None
    refused = "not an existing path nor a hub repo id|does not exist|unprintable|too long|empty"
    with pytest.raises(InputError, match=refused):
        parse_source(f"org/name@{revision}")


def test_the_hub_client_refuses_a_path_revision_before_huggingface_hub_sees_it(tmp_path: Path) -> None:
    build_hub_cache(tmp_path, {"config.json": b"{}"})
    secret_file = tmp_path / "environ"
    secret_file.write_text(SECRET)
    hub = HfHubClient(cache_dir=tmp_path, is_offline=True)
    with pytest.raises(InputError) as caught:
        hub.resolve_revision(REPO, str(secret_file))
    assert "planted-secret" not in str(caught.value)


def test_a_ref_file_that_is_not_a_sha_is_never_echoed(tmp_path: Path) -> None:
    repo = build_hub_cache(tmp_path, {"config.json": b"{}"})
    (repo / "refs" / "main").write_text(SECRET)
    with pytest.raises(InputError, match="other than a 40-character commit sha") as caught:
        HfHubClient(cache_dir=tmp_path, is_offline=True).resolve_revision(REPO, "main")
    assert "planted-secret" not in str(caught.value)


@pytest.mark.parametrize("make_policy", [
    lambda: SourcePolicy.from_roots([], allow_any_local=True),
    lambda: SourcePolicy.from_roots([], allow_any_local=False),
])
def test_long_and_unprintable_sources_are_input_errors(make_policy: object) -> None:
    policy = make_policy()  # type: ignore[operator]
    with pytest.raises(InputError, match=f"over the limit of {MAX_SOURCE_CHARS}"):
        policy.check("/" + "a" * 5000)
    with pytest.raises(InputError, match="unprintable character U\\+001B") as caught:
        policy.check("org/name@\x1b]0;pwned\x07\x1b[2J")
    assert "\x1b" not in str(caught.value)


def test_a_name_too_long_for_the_file_system_is_an_input_error() -> None:
    with pytest.raises(InputError, match="cannot be read|does not exist"):
        parse_source("/tmp/" + "a" * 300)


def test_outside_the_roots_existing_or_not_gets_one_message(tmp_path: Path) -> None:
    models, outside = tmp_path / "models", tmp_path / "etc"
    (models / "llama").mkdir(parents=True)
    outside.mkdir()
    (outside / "shadow").write_text("root:x")
    (outside / "model.gguf").write_bytes(b"GGUF")
    policy = SourcePolicy.from_roots([str(models)], allow_any_local=False)
    messages = set()
    for probe in ("shadow", "nonexistent", "model.gguf", ""):
        path = str(outside / probe) if probe else str(outside)
        with pytest.raises(InputError) as caught:
            policy.check(path)
        messages.add(str(caught.value).replace(path, "PATH"))
    assert len(messages) == 1, messages
    assert "outside the allowed model folders" in messages.pop()


def test_the_refusal_never_opens_a_path_outside_the_roots(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    unreadable = tmp_path / "locked"
    unreadable.mkdir()
    (unreadable / "inner").mkdir()
    unreadable.chmod(0)
    try:
        with pytest.raises(InputError, match="outside the allowed model folders"):
            SourcePolicy.from_roots([str(models)], allow_any_local=False).check(str(unreadable / "inner"))
    finally:
        unreadable.chmod(0o700)


def test_a_hub_id_still_passes_a_limited_policy(tmp_path: Path) -> None:
    policy = SourcePolicy.from_roots([str(tmp_path)], allow_any_local=False)
    spec = policy.check(f"org/name@{COMMIT}")
    assert (spec.kind, spec.repo_id, spec.revision) == ("hub", "org/name", COMMIT)


def test_shown_escapes_what_it_cannot_print() -> None:
    assert "\x1b" not in shown("a\x1bb")
    assert len(shown("x" * 500)) < 130
