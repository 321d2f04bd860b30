"""`bonsai publish`: a bundle from a real conversion, split in llama.cpp's format, loaded by llama.cpp."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.errors import InputError
from pipeline.formats.gguf.reader import GGUFFile
from pipeline.publish import JobFacts, build_bundle
from tests.support.lossy_demo import LOSSY_ARGS

pytestmark = [pytest.mark.llama, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _bonsai(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline", "--home", str(home), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ})


@pytest.fixture(scope="module")
def failed_job(tmp_path_factory: pytest.TempPathFactory, demo_checkpoint: Path) -> Path:
    """A converted demo whose validation failed (an agreement bar no conversion clears): its BONSAI_HOME."""
    home = tmp_path_factory.mktemp("publish-home")
    converted = _bonsai(home, "convert", str(demo_checkpoint), "--option", "agreement_pass_top1=1.0",
                        "--option", "agreement_fail_top1=0.999", *LOSSY_ARGS)
    assert converted.returncode == 1, converted.stdout + converted.stderr
    return home


def _greedy_tokens(path: Path) -> list[int]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=64, n_threads=2, verbose=False)
    try:
        out = llm("1+1=", max_tokens=8, temperature=0.0, logprobs=None)
        return list(llm.tokenize(out["choices"][0]["text"].encode(), add_bos=False, special=True))
    finally:
        llm.close()


def test_failed_validation_needs_force_and_the_card_says_so(failed_job: Path, tmp_path: Path) -> None:
    refused = _bonsai(failed_job, "publish", "1", "--to", str(tmp_path / "refused"))
    assert refused.returncode == 2
    assert "validation fail; publishing it anyway needs --force" in refused.stderr
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())

    dest = tmp_path / "bundle"
    published = _bonsai(failed_job, "publish", "1", "--to", str(dest), "--split-max-size", "300K", "--force")
    assert published.returncode == 0, published.stderr
    # The account has the publication, who made it and where it went; the refusal above left no row.
    account = json.loads(_bonsai(failed_job, "history", "--action", "publish", "--json").stdout)
    assert [row["detail"]["destination"] for row in account] == [str(dest.resolve())]
    assert account[0]["actor"].startswith("cli:") and account[0]["detail"]["forced"] is True
    card = (dest / "README.md").read_text(encoding="utf-8")
    lines = card.splitlines()
    assert lines[0] == "---" and lines[1].startswith("warning: 'WARNING: validation FAIL")
    body = card.split("\n---\n", 1)[1].lstrip("\n")
    assert body.startswith("> **WARNING: validation FAIL; published anyway with --force.**")
    front = yaml.safe_load(card.split("---\n")[1])
    assert "validation-failed" in front["tags"] and {"gguf", "ternary"} <= set(front["tags"])
    assert front["bonsai"]["tensor_types"]["attn_q.weight"] == {"TQ2_0": 2}
    assert front["bonsai"]["validation"] == "fail"
    assert "Agreement with the source model over" in card and "Greedy `1+1=`" in card

    # SHA256SUMS covers every file, and each line is right.
    sums = dict(reversed(line.split("  ", 1)) for line in (dest / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {p.name for p in dest.iterdir()} - {"SHA256SUMS"}
    for name, sha in sums.items():
        assert hashlib.sha256((dest / name).read_bytes()).hexdigest() == sha, name
    statements = [json.loads(line) for line in (dest / "provenance.intoto.jsonl").read_text().splitlines()]
    assert statements and all(s["_type"] == "https://in-toto.io/Statement/v1" for s in statements)
    assert front["bonsai"]["gguf_sha256"] in {s["subject"][0]["digest"]["sha256"] for s in statements}


def test_split_set_has_llama_cpps_keys_and_loads_like_the_whole_file(failed_job: Path,
                                                                     tmp_path: Path) -> None:
    dest = tmp_path / "bundle"
    assert _bonsai(failed_job, "publish", "1", "--to", str(dest), "--split-max-size", "300K",
                   "--force").returncode == 0
    splits = sorted(dest.glob("*.gguf"))
    assert [p.name.rsplit("-", 3)[1:] for p in splits] == [["00001", "of", "00003.gguf"],
                                                            ["00002", "of", "00003.gguf"],
                                                            ["00003", "of", "00003.gguf"]]
    readers = [GGUFFile(p) for p in splits]
    total = sum(len(r.tensors) for r in readers)
    for index, reader in enumerate(readers):
        assert reader.fields["split.no"].contents() == index
        assert reader.fields["split.no"].types[0].name == "UINT16"
        assert reader.fields["split.count"].contents() == 3
        assert reader.fields["split.tensors.count"].contents() == total
        assert reader.fields["split.tensors.count"].types[0].name == "INT32"
        assert sum(t.n_bytes for t in reader.tensors) <= 300_000 or len(reader.tensors) == 1
    assert "tokenizer.ggml.tokens" in readers[0].fields and "tokenizer.ggml.tokens" not in readers[1].fields

    whole = tmp_path / "whole"
    assert _bonsai(failed_job, "publish", "1", "--to", str(whole), "--force").returncode == 0
    (single,) = whole.glob("*.gguf")
    assert _greedy_tokens(splits[0]) == _greedy_tokens(single)


def test_a_passing_job_needs_no_force_and_a_bundle_is_never_written_over(failed_job: Path,
                                                                         tmp_path: Path) -> None:
    source = Path(json.loads(_bonsai(failed_job, "show", "1", "--json").stdout)["gguf"]["path"])
    facts = JobFacts(7, "acme/tiny@main", "a" * 40, "tq2_0", {}, "pass", {"verdict": "pass"})
    bundle = build_bundle(facts, source, tmp_path / "b")
    assert bundle.gguf_files == ["tiny-tq2_0.gguf"] and not bundle.is_split
    card = (tmp_path / "b" / "README.md").read_text()
    assert card.splitlines()[1] == "base_model: acme/tiny@main" and "WARNING" not in card
    with pytest.raises(InputError, match="is not empty"):
        build_bundle(facts, source, tmp_path / "b")


@pytest.mark.services
def test_publish_to_a_bucket_and_through_the_api(failed_job: Path, tmp_path: Path, s3_bucket: str,
                                                 s3_endpoint: str) -> None:
    from fastapi.testclient import TestClient

    from pipeline.app.api.app import create_app
    from pipeline.app.api.auth import new_token
    from pipeline.core.settings import Settings
    from tests.support import seaweed

    published = _bonsai(failed_job, "publish", "1", "--to", f"s3://{s3_bucket}/bundle", "--force")
    assert published.returncode == 0, published.stderr
    raw = seaweed.client(s3_endpoint)
    keys = {item["Key"] for item in raw.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert {"bundle/README.md", "bundle/SHA256SUMS", "bundle/provenance.intoto.jsonl"} <= keys
    sums = raw.get_object(Bucket=s3_bucket, Key="bundle/SHA256SUMS")["Body"].read().decode()
    card = raw.get_object(Bucket=s3_bucket, Key="bundle/README.md")["Body"].read()
    assert f"{hashlib.sha256(card).hexdigest()}  README.md" in sums
    again = _bonsai(failed_job, "publish", "1", "--to", f"s3://{s3_bucket}/bundle", "--force")
    assert again.returncode == 2 and "exists; publish to a new prefix" in again.stderr

    token, entry = new_token("ci", ("submit",))
    admin, admin_entry = new_token("ops", ("admin",))
    closed = TestClient(create_app(Settings(home=failed_job, api_tokens=f"{entry},{admin_entry}")))
    # Neither the job's submitter (the CLI) nor a place the operator allows: refused, nothing written.
    not_theirs = closed.post("/api/jobs/1/publish", json={"to": str(tmp_path / "api"), "force": True},
                             headers={"Authorization": f"Bearer {token}"})
    assert not_theirs.status_code == 403 and "only the token that submitted it" in not_theirs.json()["detail"]
    nowhere = closed.post("/api/jobs/1/publish", json={"to": str(tmp_path / "api"), "force": True},
                          headers={"Authorization": f"Bearer {admin}"})
    assert nowhere.status_code == 400 and "BONSAI_PUBLISH_ROOTS" in nowhere.json()["detail"]
    assert not (tmp_path / "api").exists()

    client = TestClient(create_app(Settings(home=failed_job, api_tokens=f"{entry},{admin_entry}",
                                            publish_roots=str(tmp_path))))
    headers = {"Authorization": f"Bearer {admin}"}
    outside = client.post("/api/jobs/1/publish", headers=headers,
                          json={"to": str(tmp_path / ".." / "elsewhere"), "force": True})
    assert outside.status_code == 400 and "outside the allowed places" in outside.json()["detail"]
    (tmp_path / "a-file").write_text("x")
    over_a_file = client.post("/api/jobs/1/publish", json={"to": str(tmp_path / "a-file"), "force": True},
                              headers=headers)
    assert over_a_file.status_code == 400 and (tmp_path / "a-file").read_text() == "x"
    refused = client.post("/api/jobs/1/publish", json={"to": str(tmp_path / "api")}, headers=headers)
    assert refused.status_code == 400 and "needs --force" in refused.json()["detail"]
    answer = client.post("/api/jobs/1/publish", headers=headers,
                         json={"to": str(tmp_path / "api"), "split_max_size": "300K", "force": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["is_split"] and len(answer.json()["gguf_files"]) == 3
    assert (tmp_path / "api" / "SHA256SUMS").is_file()
