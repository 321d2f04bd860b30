"""The web page in real headless Chromium (Debian's chromium + chromedriver, driven by Selenium).

`bonsai serve` runs as a subprocess on 127.0.0.1 against PostgreSQL. The read-only test browses
a real `bonsai convert` of the demo checkpoint; the submit test submits, retries and cancels
through the page's own form and buttons. Screenshots are kept (tests/support/browser.py says
where). The test installs nothing: `make setup` brings chromium, chromium-driver and selenium.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.app.api.auth import new_token
from tests.support.browser import (
    Server,
    assert_no_policy_violations,
    chromium,
    css,
    require_browser,
    screenshot,
    serve,
    text_of,
    wait,
)
from tests.support.lossy_demo import LOSSY_ARGS

pytestmark = [pytest.mark.services, pytest.mark.llama, pytest.mark.slow]

READ_TOKEN, READ_ENTRY = new_token("browser", ("read",))
SUBMIT_TOKEN, SUBMIT_ENTRY = new_token("platform", ("submit",))
STAGES = ("download", "checksum", "inspect", "calibrate", "decompose", "package", "validate")


@pytest.fixture
def server(pg_url: str, tmp_path: Path, demo_checkpoint: Path) -> Iterator[Server]:
    """`bonsai serve` over a new database; local sources allowed under tmp_path and the demo's folder."""
    require_browser()
    env = {
        **os.environ,
        "BONSAI_HOME": str(tmp_path / "home"),
        "BONSAI_DATABASE_URL": pg_url,
        "BONSAI_API_TOKENS": f"{READ_ENTRY},{SUBMIT_ENTRY}",
        "BONSAI_SOURCE_ROOTS": os.pathsep.join([str(tmp_path / "sources"), str(demo_checkpoint.parent)]),
    }
    env.pop("BONSAI_BROKER_URL", None)
    with serve(env, tmp_path, READ_TOKEN) as running:
        yield running


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    with chromium(tmp_path / "chromium-profile") as driver:
        yield driver


def _log_in_with_the_form(browser: Any, base: str) -> None:
    browser.get(base)
    wait(browser, lambda d: css(d, "#login")[0].is_displayed(), "login box")
    assert not css(browser, "#app")[0].is_displayed()
    # How to get and pass a token is written on the page, not only in a script comment.
    help_text = text_of(browser, "#how-to-login")
    assert "bonsai api-token NAME" in help_text and "--scope submit" in help_text
    assert "BONSAI_API_TOKENS" in help_text and f"{base}/#token=TOKEN" in help_text
    css(browser, "#token-input")[0].send_keys("bonsai_wrong")
    css(browser, "#login-form button")[0].click()
    wait(browser, lambda d: "refused" in text_of(d, "#login-error"), "refusal message")
    css(browser, "#token-input")[0].send_keys(READ_TOKEN)
    css(browser, "#login-form button")[0].click()
    wait(browser, lambda d: css(d, '#jobs tbody tr[data-job-id="1"]'), "job list after login")
    assert browser.execute_script("return sessionStorage.getItem('bonsai.token')") == READ_TOKEN


def _check_validation_numbers(browser: Any, job: dict[str, Any]) -> None:
    validation = job["validation"]
    metrics = {m.get_attribute("data-metric"): m for m in css(browser, "#validation .metric")}
    agreement = validation["details"]["agreement"]
    assert metrics["top1_agreement"].find_element("css selector", ".value").text == (
        f"{agreement['top1_agreement'] * 100:.1f}%"
    )
    assert float(metrics["mean_kl"].get_attribute("data-value")) == agreement["mean_kl"]
    bpw = validation["details"]["bits_per_weight"]
    assert metrics["linear_bpw"].find_element("css selector", ".value").text == f"{bpw['linear_bpw']:.4f}"
    assert float(metrics["file_bpw"].get_attribute("data-value")) == bpw["file_bpw"]
    rows = {r.get_attribute("data-check"): r for r in css(browser, "#validation-checks tr[data-check]")}
    assert set(rows) == set(validation["checks"])
    for name, row in rows.items():
        assert row.find_element("css selector", ".reason").text == validation["details"][name]["reason"]
        assert row.find_element("css selector", ".badge").text == validation["checks"][name]
    assert f"top-1 {agreement['top1_agreement'] * 100:.1f}%" in rows["agreement"].text


def _check_time_axis(browser: Any) -> None:
    ticks = css(browser, "#timeline .axis-row .tick")
    assert len(ticks) >= 3, "a time axis with ticks under the stage bars"
    at = [float(t.get_attribute("data-seconds")) for t in ticks]
    assert at[0] == 0 and at == sorted(at) and len(set(at)) == len(at)
    assert all(t.text.endswith((" s", " min", " h")) for t in ticks)


def _check_sparsity_inside_its_box(browser: Any) -> None:
    layers = wait(browser, lambda d: css(d, "#sparsity svg rect.layer") or None, "sparsity bars")
    assert [bar.get_attribute("data-layer") for bar in layers] == ["0", "1"]
    assert all(0.2 < float(bar.get_attribute("data-sparsity")) < 0.5 for bar in layers)
    boxes, (width, height) = browser.execute_script(
        "const s = document.querySelector('#sparsity svg'); const v = s.viewBox.baseVal;"
        "return [[...s.querySelectorAll('rect, text')].map(e => { const b = e.getBBox();"
        " return [b.x, b.y, b.x + b.width, b.y + b.height]; }), [v.width, v.height]];"
    )
    assert len(boxes) > 4
    for x0, y0, x1, y1 in boxes:
        assert 0 <= x0 and x1 <= width and 0 <= y0 and y1 <= height, ((x0, y0, x1, y1), (width, height))
    image_width = browser.execute_script(
        "const i = document.querySelector('#sparsity img');return i && i.complete ? i.naturalWidth : 0;"
    )
    assert image_width > 0, "the decompose stage's sparsity.png loads through the authorised download"


def _check_lineage(browser: Any, server: Server, gguf_sha: str) -> None:
    gguf_row = next(r for r in css(browser, "#artifacts tbody tr") if "model.gguf" in r.text)
    gguf_row.find_element("css selector", "button.provenance").click()
    wait(browser, lambda d: "verified" in text_of(d, "#chain-status"), "lineage")
    report = server.get(f"/api/artifacts/{gguf_sha}/chain", READ_TOKEN)
    names = [n.get_attribute("data-name") for n in css(browser, "#chain .node")]
    assert len(names) == len(set(names)) == report["artifacts"], "every file once"
    assert (
        text_of(browser, "#chain .node.root")
        and css(browser, "#chain .node.root")[0].get_attribute("data-name") == "package/model.gguf"
    )
    sources = [n for n in names if n.startswith("download/")]
    assert {"download/config.json", "download/model.safetensors"} <= set(sources)
    assert {"checksum/manifest.json", "decompose/report.json"} <= set(names)
    edges = css(browser, "#chain path.edge")
    assert len(edges) == sum(len(node["inputs"]) for node in report["nodes"])
    config = next(
        n for n in css(browser, "#chain .node") if n.get_attribute("data-name") == "download/config.json"
    )
    browser.execute_script("arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", config)
    detail = wait(browser, lambda d: text_of(d, "#chain-detail") or None, "the file's record")
    assert "nothing (a source file)" in detail and "decompose/report.json" in detail


def test_read_token_browses_a_converted_job(
    server: Server, browser: Any, demo_checkpoint: Path, tmp_path: Path
) -> None:
    # A real conversion by the CLI, into the database the running server reads (lossy: validate scores it).
    convert = server.bonsai("convert", str(demo_checkpoint), *LOSSY_ARGS)
    assert convert.returncode == 0, convert.stdout + convert.stderr
    _log_in_with_the_form(browser, server.base)

    # A read token sees why it cannot submit, retry or cancel, and the controls are off.
    assert "token browser · read" in text_of(browser, "#who")
    reason = wait(browser, lambda d: text_of(d, "#submit-readonly") or None, "read-only reason")
    assert "read scope only" in reason and "bonsai api-token NAME --scope submit" in reason
    assert css(browser, "#submit-fields")[0].get_property("disabled") is True
    assert not css(browser, "#submit-source")[0].is_enabled()
    assert not css(browser, "#submit-button")[0].is_enabled()

    # A `?token=` link works too, and the token leaves the address bar.
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{server.base}/?token={READ_TOKEN}")
    row = wait(browser, lambda d: next(iter(css(d, '#jobs tbody tr[data-job-id="1"]')), None), "job 1 row")
    assert "succeeded" in row.text and "100%" in row.text
    assert "token=" not in browser.current_url
    row.click()
    wait(browser, lambda d: len(css(d, "#timeline .attempt[data-stage]")) == len(STAGES),
         "every stage attempt")
    attempts = [
        (a.get_attribute("data-stage"), a.get_attribute("data-status"))
        for a in css(browser, "#timeline .attempt[data-stage]")
    ]
    assert attempts == [(s, "succeeded") for s in STAGES]
    assert (
        not css(browser, "#retry-button")[0].is_enabled()
        and not css(browser, "#cancel-button")[0].is_enabled()
    )
    assert "read scope only" in text_of(browser, "#actions-readonly")

    job = server.get("/api/jobs/1", READ_TOKEN)
    assert text_of(browser, "#validation .verdict") == job["validation"]["verdict"]
    wait(browser, lambda d: css(d, "#validation-checks tr[data-check]"), "validation checks")
    _check_validation_numbers(browser, job)
    _check_time_axis(browser)
    _check_sparsity_inside_its_box(browser)
    _check_lineage(browser, server, job["gguf"]["sha256"])
    log = server.log.read_text()
    assert "GET /?token=*** " in log and READ_TOKEN not in log, "the page link's token stays out of the log"
    screenshot(browser, tmp_path, "web-read-only-job")
    assert_no_policy_violations(browser)

    # A fragment token never reaches the server at all, and opens the job named beside it.
    browser.execute_script("sessionStorage.clear()")
    browser.get("about:blank")
    browser.get(f"{server.base}/#token={READ_TOKEN}&job=1")
    wait(browser, lambda d: len(css(d, "#timeline .attempt[data-stage]")) == len(STAGES),
         "job 1 from the fragment")
    assert browser.current_url.endswith("#job=1")


def _fill_and_submit(browser: Any, source: str, priority: int = 0, options: str = "{}") -> None:
    field = css(browser, "#submit-source")[0]
    field.clear()
    field.send_keys(source)
    css(browser, "#submit-priority")[0].clear()
    css(browser, "#submit-priority")[0].send_keys(str(priority))
    css(browser, "#submit-options")[0].clear()
    css(browser, "#submit-options")[0].send_keys(options)
    css(browser, "#submit-button")[0].click()


def _job_status(browser: Any, job_id: int) -> str:
    panel = css(browser, "#job-panel")[0]
    return (
        str(panel.get_attribute("data-status")) if panel.get_attribute("data-job-id") == str(job_id) else ""
    )


def test_submit_token_submits_retries_and_cancels(
    server: Server, browser: Any, demo_checkpoint: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "sources" / "no-weights"  # runs download and checksum, then fails at inspect
    broken.mkdir(parents=True)
    (broken / "config.json").write_text('{"model_type": "llama"}\n')
    browser.get(f"{server.base}/#token={SUBMIT_TOKEN}")
    wait(browser, lambda d: "submit" in text_of(d, "#who"), "the token's scopes")
    assert (
        css(browser, "#submit-button")[0].is_enabled()
        and not css(browser, "#submit-readonly")[0].is_displayed()
    )
    assert str(tmp_path / "sources") in text_of(browser, "#submit-roots")

    # Refusals are shown on the page: bad options before sending, the server's reason after.
    _fill_and_submit(browser, str(broken), options="[1]")
    assert "Options must be a JSON object" in text_of(browser, "#submit-message")
    _fill_and_submit(browser, "/etc")
    wait(browser, lambda d: "outside the allowed model folders" in text_of(d, "#submit-message"), "refusal")

    # Submit through the form: the job shows up, with its recipe, priority and options; a long option
    # value (a calibration text) is its size, digest and first line until asked for.
    calibration = "The calibration text starts here.\n" + " ".join(f"word{i}" for i in range(400))
    options = json.dumps({"method": "absmean", "calibration_text": calibration})
    _fill_and_submit(browser, str(broken), priority=7, options=options)
    row = wait(browser, lambda d: next(iter(css(d, '#jobs tbody tr[data-job-id="1"]')), None), "job 1 row")
    assert "7" in row.text and "tq2_0" in row.text
    wait(browser, lambda d: _job_status(d, 1) == "failed", "job 1 failed")
    shown = text_of(browser, "#job-options")
    assert "method" in shown and "absmean" in shown
    assert "The calibration text starts here." in shown and "bytes, sha256" in shown
    assert "word399" not in browser.execute_script("return document.body.innerText")
    assert "word399" not in browser.page_source, "the whole value enters the page only when asked for"
    css(browser, '#job-options tr[data-key="calibration_text"] button.show-option')[0].click()
    wait(browser, lambda d: "word399" in text_of(d, "#job-options"), "the whole calibration text")
    job = server.get("/api/jobs/1", SUBMIT_TOKEN)
    assert job["priority"] == 7 and job["submitted_by"] == "api:platform"
    message = next(r["error_message"] for r in job["stages"] if r["error_message"])
    assert job["error_message"].endswith(message)

    def times_shown() -> int:
        return int(
            browser.execute_script("return document.body.innerText.split(arguments[0]).length - 1", message)
        )

    assert times_shown() == 1, "the job's and the attempt's error are shown once"

    # Retry from a chosen stage: a second inspect attempt, failing the same way; still one error.
    css(browser, '#retry-stage option[value="inspect"]')[0].click()
    css(browser, "#retry-button")[0].click()
    wait(
        browser,
        lambda d: css(d, '#timeline .attempt[data-stage="inspect"][data-status="failed"]')[1:],
        "inspect #2",
    )
    wait(browser, lambda d: _job_status(d, 1) == "failed", "job 1 failed again")
    assert "5 new attempt(s)" in text_of(browser, "#action-message")  # inspect and the four stages after it
    assert times_shown() == 1 and "inspect #1, inspect #2" in text_of(browser, "#job-error")
    assert not css(browser, "#cancel-button")[0].is_enabled(), "a finished job cannot be cancelled"
    screenshot(browser, tmp_path, "web-failed-job-retried")

    # Cancel a job the server is running.
    _fill_and_submit(browser, str(demo_checkpoint))
    wait(browser, lambda d: _job_status(d, 2) in ("pending", "running"), "job 2 started")
    wait(browser, lambda d: css(d, "#cancel-button")[0].is_enabled(), "cancel button on")
    css(browser, "#cancel-button")[0].click()
    wait(browser, lambda d: _job_status(d, 2) == "cancelled", "job 2 cancelled")
    assert "Job 2 cancelled" in text_of(browser, "#action-message")
    assert server.get("/api/jobs/2", SUBMIT_TOKEN)["status"] == "cancelled"
    wait(
        browser, lambda d: css(d, '#jobs tbody tr[data-job-id="2"][data-status="cancelled"]'), "list says so"
    )
    screenshot(browser, tmp_path, "web-submit-retry-cancel")
    assert_no_policy_violations(browser)


def test_the_page_shows_the_auto_search(server: Server, browser: Any, demo_checkpoint: Path) -> None:
    # A quality target: decompose tries files, and the page lists them with the chosen one marked.
    convert = server.bonsai("convert", str(demo_checkpoint), "--recipe", "auto", "--option", "min_top1=0.5")
    assert "decompose  ok" in convert.stdout, convert.stdout + convert.stderr
    browser.get(f"{server.base}/#token={READ_TOKEN}&job=1")
    rows = wait(browser, lambda d: css(d, "#sparsity table.search-trials tr") or None, "the search's trials")
    trials = rows[1:]  # below the header row
    assert len(trials) >= 2, "the largest budget and the smallest at least"
    chosen = [row for row in trials if "chosen" in (row.get_attribute("class") or "")]
    assert len(chosen) == 1 and "yes" in chosen[0].text
    assert "top-1 ≥ 0.5" in text_of(browser, "#sparsity .search h3")
    width = wait(browser, lambda d: d.execute_script(
        "const i = document.querySelector('#sparsity img[alt^=\"size against\"]');"
        "return i && i.complete ? i.naturalWidth : 0;") or None, "candidates.png")
    assert width == 760

    # A second budget, compared on the page with the first: the tensors that moved, each way.
    second = server.bonsai("convert", str(demo_checkpoint), "--recipe", "auto", "--option", "target_bpw=3.0")
    assert "decompose  ok" in second.stdout, second.stdout + second.stderr
    expected = server.get("/api/jobs/2?against=1", READ_TOKEN)["allocation_diff"]
    browser.get(f"{server.base}/#token={READ_TOKEN}&job=2")
    wait(browser, lambda d: css(d, '#job-panel[data-job-id="2"]'), "job 2 shown")
    css(browser, "#against-job")[0].send_keys("1")
    css(browser, '#against-form button[type="submit"]')[0].click()
    summary = wait(browser, lambda d: text_of(d, "#allocation-diff p") or None, "the allocation diff")
    assert summary.startswith(f"{len(expected['up'])} up, {len(expected['down'])} down, "
                              f"{expected['unchanged']} unchanged against job 1"), summary
    moved = css(browser, "#allocation-diff tr.up, #allocation-diff tr.down")
    assert len(moved) == len(expected["up"]) + len(expected["down"]) > 0, "a lower budget moves tensors down"
    assert {row.find_element("css selector", "code").text for row in moved} == {
        m["tensor"] for m in expected["up"] + expected["down"]}
    assert_no_policy_violations(browser)
