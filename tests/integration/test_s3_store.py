"""S3Store on a real SeaweedFS server: what the server checks, multipart, never overwriting, the cache."""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from pipeline.artifacts.activity import store_activity
from pipeline.artifacts.cache import LocalCache
from pipeline.artifacts.s3 import S3Location, S3Store, make_s3_client
from pipeline.core.errors import InputError, IntegrityError, TransientError
from tests.integration.conftest import free_port
from tests.support import seaweed

pytestmark = pytest.mark.services

PART = 5 * 1024 * 1024


def _store(bucket: str, cache_dir: Path, part_size_bytes: int = PART) -> S3Store:
    return S3Store(S3Location(bucket, "p"), make_s3_client(os.environ["BONSAI_S3_ENDPOINT_URL"]),
                   LocalCache(cache_dir, 1 << 30), part_size_bytes=part_size_bytes)


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _b64(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def test_server_refuses_bytes_that_do_not_match_the_sha256_sent(s3_bucket: str, s3_endpoint: str) -> None:
    # The fact the store's integrity rests on: SeaweedFS checks x-amz-checksum-sha256 itself.
    raw = seaweed.client(s3_endpoint)
    data = os.urandom(1000)
    with pytest.raises(ClientError, match="BadDigest"):
        raw.put_object(Bucket=s3_bucket, Key="k", Body=data, ChecksumSHA256=_b64(b"other"))
    upload = raw.create_multipart_upload(Bucket=s3_bucket, Key="m", ChecksumAlgorithm="SHA256")
    with pytest.raises(ClientError, match="BadDigest"):
        raw.upload_part(Bucket=s3_bucket, Key="m", UploadId=upload["UploadId"], PartNumber=1, Body=data,
                        ChecksumSHA256=_b64(b"other"))
    raw.abort_multipart_upload(Bucket=s3_bucket, Key="m", UploadId=upload["UploadId"])
    assert "Contents" not in raw.list_objects_v2(Bucket=s3_bucket)


def test_large_file_goes_up_in_checked_parts_and_comes_back(s3_bucket: str, s3_endpoint: str,
                                                             tmp_path: Path) -> None:
    data = os.urandom(2 * PART + 12345)
    store = _store(s3_bucket, tmp_path / "cache")
    with store_activity() as activity:
        stored = store.put(_file(tmp_path, "big", data))
    assert stored.sha256 == hashlib.sha256(data).hexdigest()
    assert activity.uploaded_bytes == len(data)
    head = seaweed.client(s3_endpoint).head_object(Bucket=s3_bucket, Key=S3Location(s3_bucket, "p").key(
        stored.sha256), ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"].endswith("-3"), "a composite of three part checksums"
    assert head["Metadata"]["sha256"] == stored.sha256
    assert seaweed.client(s3_endpoint).list_multipart_uploads(Bucket=s3_bucket).get("Uploads") is None

    elsewhere = _store(s3_bucket, tmp_path / "other-cache")  # another worker: nothing cached
    with store_activity() as activity:
        assert elsewhere.path(stored.sha256).read_bytes() == data
        assert elsewhere.path(stored.sha256).read_bytes() == data
    assert activity.as_metrics() == {"store_cache_hits": 1, "store_cache_misses": 1,
                                     "store_downloaded_bytes": len(data), "store_uploaded_bytes": 0}


def test_the_writer_reads_its_own_output_from_its_cache(s3_bucket: str, tmp_path: Path) -> None:
    store = _store(s3_bucket, tmp_path / "cache")
    stored = store.put(_file(tmp_path, "a", b"written here"))
    with store_activity() as activity:
        assert store.path(stored.sha256).read_bytes() == b"written here"
    assert (activity.cache_hits, activity.downloaded_bytes) == (1, 0)


def test_an_existing_key_is_never_overwritten(s3_bucket: str, s3_endpoint: str, tmp_path: Path) -> None:
    data = b"the real bytes"
    sha = hashlib.sha256(data).hexdigest()
    key = S3Location(s3_bucket, "p").key(sha)
    seaweed.client(s3_endpoint).put_object(Bucket=s3_bucket, Key=key, Body=b"something already there")
    store = _store(s3_bucket, tmp_path / "cache")
    with store_activity() as activity:
        store.put(_file(tmp_path, "a", data))
    assert activity.uploaded_bytes == 0
    body = seaweed.client(s3_endpoint).get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    assert body == b"something already there"
    assert not store.verify(sha)


def test_a_corrupted_object_is_refused_before_anyone_reads_it(s3_bucket: str, s3_endpoint: str,
                                                              tmp_path: Path) -> None:
    store = _store(s3_bucket, tmp_path / "cache")
    stored = store.put(_file(tmp_path, "a", b"original bytes"))
    key = S3Location(s3_bucket, "p").key(stored.sha256)
    seaweed.client(s3_endpoint).put_object(Bucket=s3_bucket, Key=key, Body=b"damaged bytes!")
    reader = _store(s3_bucket, tmp_path / "reader-cache")
    damaged = hashlib.sha256(b"damaged bytes!").hexdigest()
    with pytest.raises(IntegrityError, match=f"s3://{s3_bucket}/{key}.*{damaged}, expected {stored.sha256}"):
        reader.path(stored.sha256)
    assert reader.local_path(stored.sha256) is None
    assert reader.rehash(stored.sha256) == (damaged, len(b"damaged bytes!"))


def test_concurrent_multipart_puts_of_the_same_bytes(s3_bucket: str, s3_endpoint: str,
                                                     tmp_path: Path) -> None:
    data = os.urandom(PART + 1000)
    stores = [_store(s3_bucket, tmp_path / f"cache{i}") for i in range(3)]
    sources = [_file(tmp_path, f"s{i}", data) for i in range(3)]
    results, errors = [], []

    def put(index: int) -> None:
        try:
            results.append(stores[index].put(sources[index]))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len({r.sha256 for r in results}) == 1
    assert stores[0].verify(results[0].sha256)
    raw = seaweed.client(s3_endpoint)
    assert len(raw.list_objects_v2(Bucket=s3_bucket)["Contents"]) == 1
    assert raw.list_multipart_uploads(Bucket=s3_bucket).get("Uploads") is None


def test_configuration_errors_say_what_to_fix(s3_bucket: str, s3_endpoint: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    missing = _store("no-such-bucket-here", tmp_path / "c1")
    with pytest.raises(InputError, match="bucket 'no-such-bucket-here' does not exist"):
        missing.has("0" * 64)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    refused = _store(s3_bucket, tmp_path / "c2")
    with pytest.raises(InputError, match="check the bucket in BONSAI_ARTIFACT_ROOT and the AWS credentials"):
        refused.put(_file(tmp_path, "a", b"x"))


def test_an_unreachable_endpoint_is_retryable(s3_bucket: str, tmp_path: Path) -> None:
    store = S3Store(S3Location(s3_bucket, "p"), make_s3_client(f"http://127.0.0.1:{free_port()}"),
                    LocalCache(tmp_path / "c", 1 << 20))
    with pytest.raises(TransientError, match="unreachable") as caught:
        store.put(_file(tmp_path, "a", b"x"))
    assert caught.value.is_retryable


def test_remove_deletes_the_object_and_the_cached_copy(s3_bucket: str, tmp_path: Path) -> None:
    store = _store(s3_bucket, tmp_path / "cache")
    data = b"bytes gc will take\n" * 100
    stored = store.put(_file(tmp_path, "kept.bin", data))
    assert store.has(stored.sha256) and store.local_path(stored.sha256) is not None
    assert store.remove(stored.sha256) == len(data)
    assert not store.has(stored.sha256)
    assert store.local_path(stored.sha256) is None
    assert store.remove(stored.sha256) == 0, "removing what is gone frees nothing and does not fail"
    with pytest.raises(KeyError):
        store.path(stored.sha256)
