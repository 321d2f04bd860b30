"""One contract, run against every ArtifactStore backend."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from pipeline.artifacts import LocalStore, MemoryStore
from pipeline.core.errors import InputError, IntegrityError


@pytest.fixture(params=["local", "memory", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    if request.param == "s3":
        from pipeline.artifacts.cache import LocalCache
        from pipeline.artifacts.s3 import S3Location, S3Store, make_s3_client

        bucket = request.getfixturevalue("s3_bucket")
        return S3Store(S3Location(bucket, "contract"), make_s3_client(os.environ["BONSAI_S3_ENDPOINT_URL"]),
                       LocalCache(tmp_path / "cache", 1 << 30))
    return MemoryStore()


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_put_returns_content_digest_and_bytes_round_trip(store, tmp_path: Path) -> None:
    data = os.urandom(100_000)
    stored = store.put(_file(tmp_path, "a", data))
    assert stored.sha256 == hashlib.sha256(data).hexdigest()
    assert stored.size_bytes == len(data)
    assert store.has(stored.sha256)
    assert store.path(stored.sha256).read_bytes() == data
    assert store.verify(stored.sha256)


def test_wrong_expected_digest_is_refused_and_nothing_stored(store, tmp_path: Path) -> None:
    data = b"payload"
    wrong = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(IntegrityError, match=wrong):
        store.put(_file(tmp_path, "a", data), expected_sha256=wrong)
    assert not store.has(hashlib.sha256(data).hexdigest())


def test_same_bytes_twice_is_one_entry_and_never_overwritten(store, tmp_path: Path) -> None:
    first = store.put(_file(tmp_path, "a", b"same"))
    second = store.put(_file(tmp_path, "b", b"same"))
    assert first == second
    assert store.path(first.sha256).read_bytes() == b"same"


def test_rehash_and_local_path(store, tmp_path: Path) -> None:
    data = os.urandom(5000)
    stored = store.put(_file(tmp_path, "a", data))
    assert store.rehash(stored.sha256) == (stored.sha256, len(data))
    local = store.local_path(stored.sha256)
    assert local is not None and local.read_bytes() == data
    with pytest.raises(KeyError):
        store.rehash("1" * 64)
    assert store.local_path("1" * 64) is None


def test_source_is_left_in_place(store, tmp_path: Path) -> None:
    source = _file(tmp_path, "a", b"keep me")
    store.put(source)
    assert source.read_bytes() == b"keep me"


def test_bad_keys_are_refused(store) -> None:
    with pytest.raises(InputError, match="not a sha256 digest"):
        store.has("../../etc/passwd")
    with pytest.raises(KeyError):
        store.path("0" * 64)


def test_local_store_detects_tampering_and_is_read_only(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    stored = store.put(_file(tmp_path, "a", b"original bytes"))
    path = store.path(stored.sha256)
    assert not os.access(path, os.W_OK) or os.geteuid() == 0  # root ignores mode bits
    os.chmod(path, 0o644)
    path.write_bytes(b"tampered bytes")
    assert not store.verify(stored.sha256)


def test_local_store_copies_files_with_other_names(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    original = _file(tmp_path, "user-file", b"user data")
    alias = tmp_path / "alias"
    os.link(original, alias)
    stored = store.put(alias)
    original.write_bytes(b"changed later by the user")
    assert store.path(stored.sha256).read_bytes() == b"user data"
    assert store.verify(stored.sha256)


def test_concurrent_puts_of_the_same_bytes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    data = os.urandom(1_000_000)
    sources = [_file(tmp_path, f"s{i}", data) for i in range(4)]
    results = []
    threads = [threading.Thread(target=lambda p=p: results.append(store.put(p))) for p in sources]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({r.sha256 for r in results}) == 1
    assert store.verify(results[0].sha256)
    assert list((store.root / "tmp").iterdir()) == []


def test_local_store_vouches_only_for_copies_it_wrote_and_that_are_unchanged(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    original = _file(tmp_path, "user-file", b"user data" * 1000)
    alias = tmp_path / "alias"
    os.link(original, alias)  # another name: the store copies it
    stored = store.put(alias)
    assert store.witnessed(store.path(stored.sha256)) == stored
    assert store.witnessed(original) is None  # the user's file is not the stored copy
    linked = store.put(_file(tmp_path, "single-name", b"work file"))  # hard-linked, not written by the store
    assert store.witnessed(store.path(linked.sha256)) is None
    path = store.path(stored.sha256)
    os.chmod(path, 0o644)
    path.write_bytes(b"tampered " * 1000)
    assert store.witnessed(path) is None
    assert store.witnessed(tmp_path / "no-such-file") is None


def test_put_all_keeps_order_and_raises_integrity_errors(store, tmp_path: Path) -> None:
    from pipeline.artifacts.store import put_all

    files = [_file(tmp_path, f"f{i}", os.urandom(50_000 + i)) for i in range(5)]
    stored = put_all(store, [(path, None) for path in files])
    assert [s.sha256 for s in stored] == [hashlib.sha256(p.read_bytes()).hexdigest() for p in files]
    wrong = "0" * 64
    with pytest.raises(IntegrityError, match=wrong):
        put_all(store, [(files[0], None), (_file(tmp_path, "g", b"other"), wrong)])
