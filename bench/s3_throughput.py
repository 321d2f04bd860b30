"""S3 store throughput on loopback SeaweedFS, next to `cp` of the same file on the same disk.

    .venv/bin/python bench/s3_throughput.py [--size-mb 512] [--part-mb 64] [--concurrency 4]

Upload = `S3Store.put` (hash the file and its parts, multipart upload with per-part SHA-256,
adopt into the local cache); download = `S3Store.path` on an empty cache (stream, hash,
rename); reference = `cp` of the file to a new name (page cache warm, same as ours).
Last line: `upload_mb_s=… download_mb_s=… cp_mb_s=… upload_vs_cp=… download_vs_cp=…`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.artifacts.cache import LocalCache  # noqa: E402
from pipeline.artifacts.s3 import S3Location, S3Store, make_s3_client  # noqa: E402
from tests.support import seaweed  # noqa: E402


def _timed(action) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--part-mb", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds: CI runs it to prove the bench runs (figures meaningless)")
    args = parser.parse_args()
    if args.smoke:
        args.size_mb, args.part_mb, args.concurrency = 12, 5, 2
    os.environ.update(seaweed.AWS_ENV)
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="bonsai-s3-bench-") as tmp_name:
        tmp = Path(tmp_name)
        source = tmp / "source.bin"
        with open(source, "wb") as handle:
            for _ in range(args.size_mb):
                handle.write(os.urandom(1024 * 1024))
        size_mb = source.stat().st_size / 1e6
        cp_s = _timed(lambda: subprocess.run(["cp", str(source), str(tmp / "copy.bin")], check=True))
        (tmp / "copy.bin").unlink()
        server = seaweed.SeaweedServer(tmp / "seaweedfs").start()
        try:
            bucket = seaweed.new_bucket(server.endpoint_url)

            def store(cache: str) -> S3Store:
                return S3Store(S3Location(bucket, "bench"), make_s3_client(server.endpoint_url),
                               LocalCache(tmp / cache, 1 << 40), part_size_bytes=args.part_mb * 1024 * 1024,
                               max_concurrency=args.concurrency)

            writer = store("cache-writer")
            stored = None

            def upload() -> None:
                nonlocal stored
                stored = writer.put(source)

            up_s = _timed(upload)
            assert stored is not None
            reader = store("cache-reader")
            down_s = _timed(lambda: reader.path(stored.sha256))
            hit_s = _timed(lambda: reader.path(stored.sha256))
        finally:
            server.kill()
    up, down, cp = size_mb / up_s, size_mb / down_s, size_mb / cp_s
    print(f"{args.size_mb} MiB file, parts of {args.part_mb} MiB, {args.concurrency} at a time; "
          f"cache hit afterwards {hit_s * 1000:.1f} ms")
    print(f"{'':20}{'MB/s':>10}{'seconds':>10}{'vs cp':>8}")
    print(f"{'cp':20}{cp:>10.0f}{cp_s:>10.2f}{1:>8.2f}")
    print(f"{'S3Store.put':20}{up:>10.0f}{up_s:>10.2f}{up / cp:>8.2f}")
    print(f"{'S3Store.path':20}{down:>10.0f}{down_s:>10.2f}{down / cp:>8.2f}")
    print(f"load average after: {os.getloadavg()}")
    print(f"upload_mb_s={up:.0f} download_mb_s={down:.0f} cp_mb_s={cp:.0f} "
          f"upload_vs_cp={up / cp:.2f} download_vs_cp={down / cp:.2f}")


if __name__ == "__main__":
    main()
