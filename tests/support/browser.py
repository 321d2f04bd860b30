"""Helpers for the web page tests: `bonsai serve` on a free port, headless Chromium, waits, screenshots.

Chromium and chromedriver are Debian's packages, driven by Selenium; nothing here installs them.
Locally a missing browser skips the test saying why; under CI (CI=true) it fails instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

CHROMIUM = os.environ.get("BONSAI_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("BONSAI_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")
WAIT_S = 30
# Screenshots are kept as test artifacts: under BONSAI_TEST_ARTIFACTS when set, else the
# git-ignored .artifacts/ folder at the repository root (and always in the test's tmp_path).
ARTIFACTS = Path(
    os.environ.get("BONSAI_TEST_ARTIFACTS") or Path(__file__).resolve().parents[2] / ".artifacts"
)


def require_browser() -> None:
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


@dataclass(frozen=True)
class Server:
    base: str
    env: dict[str, str]
    log: Path

    def bonsai(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pipeline", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    def get(self, path: str, token: str) -> Any:
        response = httpx.get(f"{self.base}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        response.raise_for_status()
        return response.json()


@contextmanager
def serve(env: dict[str, str], workdir: Path, probe_token: str) -> Iterator[Server]:
    """`bonsai serve` on a free port of 127.0.0.1 (database migrated first), stopped afterwards."""
    run = [sys.executable, "-m", "pipeline"]
    upgrade = subprocess.run([*run, "db", "upgrade"], env=env, capture_output=True, text=True, timeout=120)
    assert upgrade.returncode == 0, upgrade.stderr
    port = _free_port()
    log_path = workdir / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*run, "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_ready(f"http://127.0.0.1:{port}", process, log_path, probe_token)
            yield Server(f"http://127.0.0.1:{port}", env, log_path)
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


def _wait_ready(base: str, process: subprocess.Popen[bytes], log: Path, token: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"bonsai serve exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/api/jobs", headers={"Authorization": f"Bearer {token}"}).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"bonsai serve did not answer within {WAIT_S}s: {log.read_text()[-2000:]}")


@contextmanager
def chromium(profile: Path) -> Iterator[Any]:
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
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver: Any, condition: Any, what: str) -> Any:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(condition)
    except TimeoutException:
        logs = driver.get_log("browser") if hasattr(driver, "get_log") else []
        pytest.fail(f"timed out waiting for {what}; browser console: {logs}")


def css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)  # type: ignore[no-any-return]


def text_of(driver: Any, selector: str) -> str:
    found = css(driver, selector)
    return str(found[0].text) if found else ""


def screenshot(driver: Any, tmp_path: Path, name: str) -> Path:
    """A full-page PNG in tmp_path, copied to ARTIFACTS/screens/; returns the kept copy."""
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(1400, min(max(height, 900), 6000))
    shot = tmp_path / f"{name}.png"
    assert driver.save_screenshot(str(shot)), f"screenshot {name} not written"
    kept = ARTIFACTS / "screens" / shot.name
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, kept)
    driver.set_window_size(1400, 1800)
    return kept


def assert_no_policy_violations(driver: Any) -> None:
    """The page broke none of its Content-Security-Policy rules (no inline style or script)."""
    logs = driver.get_log("browser") if hasattr(driver, "get_log") else []
    violations = [entry["message"] for entry in logs if "Content Security Policy" in entry["message"]]
    assert not violations, violations
