"""A worker with a memory cap refuses, before starting, a stage whose estimated peak outgrows it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.core.errors import OutgrowsWorker
from pipeline.core.settings import Settings
from pipeline.core.states import StageName
from pipeline.formats.model_card import CARD_NAME, CardTensor, ModelCard
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.execution import _refuse_if_too_big
from pipeline.stages import calibrate, decompose, download, validate
from pipeline.stages.base import InputFile, JobSpec

GB = 1 << 30


def _inputs(tmp_path: Path) -> dict[str, InputFile]:
    # A 2.8B-parameter checkpoint's card: its largest tensor is the 128k x 3072 embedding.
    embedding = CardTensor("model.embed_tokens.weight", (128256, 3072), "BF16", "model.safetensors")
    layer = CardTensor("model.layers.0.mlp.up_proj.weight", (8192, 3072), "BF16", "model.safetensors")
    config = {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
              "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256}
    card = ModelCard(architecture="llama", hf_architecture="LlamaForCausalLM", config=config,
                     format="safetensors", shards=("model.safetensors",), tensors=(embedding, layer),
                     param_count=2_820_000_000, dtypes={"BF16": 2})
    path = tmp_path / CARD_NAME
    card.write(path)
    return {
        f"inspect/{CARD_NAME}": InputFile(CARD_NAME, path, "", path.stat().st_size),
        "download/model.safetensors": InputFile("model.safetensors", path, "", 5_640_000_000),
        "package/model.gguf": InputFile("model.gguf", path, "", 1_100_000_000),
    }


def test_stages_estimate_their_peak_from_the_card(tmp_path: Path) -> None:
    inputs = _inputs(tmp_path)
    job = JobSpec("acme/big", "tq2_0")
    llama = calibrate.make_params(JobSpec("acme/big", options={"reference_engine": "llama"}))
    whole = calibrate.memory_need(llama, inputs)
    assert whole is not None and 5.6e9 < whole.n_bytes < 6.3e9 and "2.82B parameters" in whole.why
    # auto: one block at a time, one tensor (the 128k x 3072 embedding) and a sequence's logits held.
    source = calibrate.memory_need(calibrate.make_params(job), inputs)
    assert source is not None and "one block at a time in torch" in source.why
    assert source.n_bytes == (768 << 20) + 4 * 128256 * 3072 + 4 * 128256 * 256
    fit = decompose.memory_need(decompose.make_params(job), inputs)
    assert fit is not None and fit.n_bytes == GB // 2 + 12 * 128256 * 3072
    assert "model.embed_tokens.weight" in fit.why
    run = validate.memory_need(validate.make_params(job), inputs)
    assert run is not None and run.n_bytes == 1_100_000_000 + GB // 2
    assert download.memory_need(download.make_params(job), inputs) is None, "does not grow with the model"


def test_a_capped_worker_refuses_what_it_cannot_hold_and_names_both_numbers(tmp_path: Path) -> None:
    inputs = _inputs(tmp_path)
    rt = build_runtime(Settings(home=tmp_path / "home"))
    params = calibrate.make_params(JobSpec("acme/big", "tq2_0", {"reference_engine": "llama"}))
    stage = StageName.CALIBRATE
    _refuse_if_too_big(rt, calibrate, params, inputs, stage)  # no cap: never refuses
    _refuse_if_too_big(replace(rt, memory_limit_bytes=8 * GB), calibrate, params, inputs, stage)
    with pytest.raises(OutgrowsWorker) as refused:
        _refuse_if_too_big(replace(rt, memory_limit_bytes=4 * GB), calibrate, params, inputs, stage)
    message = str(refused.value)
    assert "calibrate would need about 5,890 MB" in message and "cap of 4,096 MB" in message
    assert "BONSAI_WORKER_MEMORY_MB" in message and refused.value.is_retryable


def test_a_worker_records_its_cap_and_workers_shows_it(tmp_path: Path) -> None:
    from pipeline.app.views import worker_rows
    from pipeline.db.session import session_scope
    from pipeline.orchestration.distributed.beacon import WorkerBeacon

    rt = build_runtime(Settings(home=tmp_path / "home"))
    capped = WorkerBeacon(rt.sessions, "small@host", ["gpu"], 1, 60.0, memory_limit_mb=4096)
    uncapped = WorkerBeacon(rt.sessions, "big@host", ["gpu"], 1, 60.0)
    for beacon in (capped, uncapped):
        beacon.start()
    try:
        with session_scope(rt.sessions) as session:
            rows, _idle = worker_rows(session, 120.0)
    finally:
        for beacon in (capped, uncapped):
            beacon.stop()
    assert {row["name"]: row["memory_limit_mb"] for row in rows} == {"small@host": 4096, "big@host": None}
