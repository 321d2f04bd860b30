"""The worker-local read-through cache: digest-checked fills, LRU eviction, pins that eviction respects."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from pipeline.artifacts.activity import store_activity
from pipeline.artifacts.cache import LocalCache
from pipeline.core.errors import IntegrityError


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fill(cache: LocalCache, data: bytes, mtime: float | None = None) -> str:
    sha = _sha(data)
    path = cache.fill(sha, [data[:10], data[10:]], "test")
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return sha


def test_fill_checks_the_digest_and_keeps_nothing_on_mismatch(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache", 1 << 20)
    wrong = _sha(b"something else")
    with pytest.raises(IntegrityError, match=f"s3://b/k.*expected {wrong}"):
        cache.fill(wrong, [b"the bytes that came"], "s3://b/k")
    assert cache.lookup(wrong) is None
    assert list((cache.root / "tmp").iterdir()) == []
    sha = _fill(cache, b"good bytes here")
    path = cache.lookup(sha)
    assert path is not None and path.read_bytes() == b"good bytes here"
    assert not os.access(path, os.W_OK) or os.geteuid() == 0  # root ignores mode bits
    assert path.stat().st_mode & 0o777 == 0o444


def test_least_recently_used_entry_goes_first(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache", 3000)
    a, b, c = (_fill(cache, bytes([n]) * 1000, mtime=1000.0 + n) for n in range(3))
    assert cache.lookup(a) is not None  # a is now the most recently used
    d = _fill(cache, b"d" * 1000)
    assert cache.lookup(b) is None, "b was the least recently used"
    assert all(cache.lookup(x) is not None for x in (a, c, d))
    assert cache.size_bytes() == 3000


def test_an_entry_in_use_is_not_evicted_until_its_window_closes(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache", 2000)
    old = _fill(cache, b"o" * 1000, mtime=1.0)
    with store_activity():
        held = cache.lookup(old)
        assert held is not None
        for n in range(3):
            _fill(cache, bytes([n]) * 1000)
        assert cache.lookup(old) == held, "the oldest entry is pinned by this window"
        assert held.read_bytes() == b"o" * 1000
    os.utime(held, (1.0, 1.0))
    cache.evict()
    assert cache.lookup(old) is None
    assert cache.size_bytes() <= 2000


def test_one_entry_larger_than_the_bound_is_still_served(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache", 100)
    sha = _fill(cache, b"x" * 1000)
    assert cache.lookup(sha) is not None


def test_adopt_links_a_lone_file_and_copies_one_with_other_names(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache", 1 << 20)
    lone = tmp_path / "lone"
    lone.write_bytes(b"stage output")
    adopted = cache.adopt(lone, _sha(b"stage output"))
    assert os.stat(adopted).st_ino == os.stat(lone).st_ino

    user = tmp_path / "user-file"
    user.write_bytes(b"user data")
    os.link(user, tmp_path / "alias")
    copied = cache.adopt(tmp_path / "alias", _sha(b"user data"))
    assert os.stat(copied).st_ino != os.stat(user).st_ino
    user.write_bytes(b"changed later by the user")
    assert copied.read_bytes() == b"user data"
    with pytest.raises(IntegrityError):
        cache.adopt(user, _sha(b"user data, but wrong now"))
