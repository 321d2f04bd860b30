"""The web page in real headless Chromium (Debian's chromium + chromedriver, driven by Selenium).

`bonsai serve` runs as a subprocess on 127.0.0.1 against PostgreSQL; a real `bonsai convert`
of the demo checkpoint makes the job. The test installs nothing: `make setup` brings the
chromium and chromium-driver packages and the selenium wheel. Locally the test skips,
saying why, when they are missing; under CI (CI=true) it fails instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.app.api.auth import new_token

pytestmark = [pytest.mark.services, pytest.mark.llama, pytest.mark.slow]

CHROMIUM = os.environ.get("BONSAI_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("BONSAI_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")
READ_TOKEN, READ_ENTRY = new_token("browser", ("read",))
WAIT_S = 30


def _require_browser() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if not missing:
        return
    reason = f"{', '.join(missing)} not installed (make setup installs chromium, chromium-driver, selenium)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"the browser test must run under CI: {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(home: Path, db_url: str) -> dict[str, str]:
    env = {
        **os.environ,
        "BONSAI_HOME": str(home),
        "BONSAI_DATABASE_URL": db_url,
        "BONSAI_API_TOKENS": READ_ENTRY,
    }
    env.pop("BONSAI_BROKER_URL", None)
    return env


@dataclass(frozen=True)
class Server:
    base: str
    env: dict[str, str]

    def bonsai(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pipeline", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )


@pytest.fixture
def server(pg_url: str, tmp_path: Path) -> Iterator[Server]:
    """`bonsai serve` on a free port of 127.0.0.1, over a new PostgreSQL database."""
    _require_browser()
    env = _env(tmp_path / "home", pg_url)
    run = [sys.executable, "-m", "pipeline"]
    upgrade = subprocess.run([*run, "db", "upgrade"], env=env, capture_output=True, text=True, timeout=120)
    assert upgrade.returncode == 0, upgrade.stderr
    port = _free_port()
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen(
        [*run, "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_ready(f"http://127.0.0.1:{port}", process, tmp_path / "serve.log")
        yield Server(f"http://127.0.0.1:{port}", env)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _wait_ready(base: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"bonsai serve exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if (
                httpx.get(f"{base}/api/jobs", headers={"Authorization": f"Bearer {READ_TOKEN}"}).status_code
                == 200
            ):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"bonsai serve did not answer within {WAIT_S}s: {log.read_text()[-2000:]}")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1800",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: Any, condition: Any, what: str) -> Any:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(condition)
    except TimeoutException:
        logs = driver.get_log("browser") if hasattr(driver, "get_log") else []
        pytest.fail(f"timed out waiting for {what}; browser console: {logs}")


def _css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)  # type: ignore[no-any-return]


def test_user_logs_in_and_browses_a_converted_job(
    server: Server, browser: Any, demo_checkpoint: Path, tmp_path: Path
) -> None:
    # A real conversion by the CLI, into the database the running server reads.
    convert = server.bonsai("convert", str(demo_checkpoint))
    assert convert.returncode == 0, convert.stdout + convert.stderr

    # Without a token the page asks for one, and says so when the server refuses it.
    browser.get(server.base)
    _wait(browser, lambda d: _css(d, "#login")[0].is_displayed(), "login box")
    assert not _css(browser, "#app")[0].is_displayed()
    _css(browser, "#token-input")[0].send_keys("bonsai_wrong")
    _css(browser, "#login-form button")[0].click()
    _wait(browser, lambda d: "refused" in _css(d, "#login-error")[0].text, "refusal message")
    _css(browser, "#token-input")[0].send_keys(READ_TOKEN)
    _css(browser, "#login-form button")[0].click()
    _wait(browser, lambda d: _css(d, '#jobs tbody tr[data-job-id="1"]'), "job list after login")
    assert browser.execute_script("return sessionStorage.getItem('bonsai.token')") == READ_TOKEN

    # A `?token=` link works too, and the token leaves the address bar.
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{server.base}/?token={READ_TOKEN}")
    row = _wait(browser, lambda d: next(iter(_css(d, '#jobs tbody tr[data-job-id="1"]')), None), "job 1 row")
    assert "succeeded" in row.text and "100%" in row.text
    assert "token=" not in browser.current_url

    row.click()
    _wait(browser, lambda d: len(_css(d, "#timeline .attempt")) == 7, "seven stage attempts")
    attempts = [
        (a.get_attribute("data-stage"), a.get_attribute("data-status"))
        for a in _css(browser, "#timeline .attempt")
    ]
    assert attempts == [
        (s, "succeeded")
        for s in ("download", "checksum", "inspect", "calibrate", "decompose", "package", "validate")
    ]
    assert _css(browser, "#validation .verdict")[0].text in ("pass", "warn")

    layers = _wait(browser, lambda d: _css(d, "#sparsity svg rect.layer") or None, "sparsity bars")
    assert [bar.get_attribute("data-layer") for bar in layers] == ["0", "1"]
    assert all(0.2 < float(bar.get_attribute("data-sparsity")) < 0.5 for bar in layers)
    image_width = browser.execute_script(
        "const i = document.querySelector('#sparsity img');return i && i.complete ? i.naturalWidth : 0;"
    )
    assert image_width > 0, "the decompose stage's sparsity.png loads through the authorised download"

    gguf_row = next(r for r in _css(browser, "#artifacts tbody tr") if "model.gguf" in r.text)
    gguf_row.find_element("css selector", "button.provenance").click()
    _wait(browser, lambda d: "verified" in _css(d, "#chain-status")[0].text, "provenance chain")
    names = [n.get_attribute("data-name") for n in _css(browser, "#chain .node")]
    assert names[0] == "package/model.gguf"
    assert {"download/config.json", "checksum/manifest.json", "decompose/report.json"} <= set(names)
    log = (tmp_path / "serve.log").read_text()
    assert "GET /?token=*** " in log and READ_TOKEN not in log, "the page link's token stays out of the log"

    # A fragment token never reaches the server at all, and opens the job named beside it.
    browser.execute_script("sessionStorage.clear()")
    browser.get("about:blank")
    browser.get(f"{server.base}/#token={READ_TOKEN}&job=1")
    _wait(browser, lambda d: len(_css(d, "#timeline .attempt")) == 6, "job 1 from the fragment")
    assert browser.current_url.endswith("#job=1")

    shots = Path(os.environ.get("BONSAI_TEST_SCREENSHOT_DIR", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(shots / "web-job.png"))
