"""Headless Chromium (Debian's `chromium` + `chromium-driver`) driven by selenium, for the dashboard
and report tests; the tests skip with the reason when either is missing."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
MISSING = None if CHROMIUM and CHROMEDRIVER else \
    "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"


def artifacts_dir() -> str:
    """Where screenshots go: $STALWART_ARTIFACTS, else a fresh temp dir (printed by the tests)."""
    d = os.environ.get("STALWART_ARTIFACTS") or os.path.join(tempfile.gettempdir(), "stalwart-artifacts")
    os.makedirs(d, exist_ok=True)
    return d


def start_browser(width: int = 1400, height: int = 1100):
    if MISSING:
        pytest.skip(MISSING)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def console_errors(driver) -> list[dict]:
    """The browser console's errors since the last call (JavaScript errors, failed loads)."""
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def screenshot(driver, name: str) -> str:
    path = os.path.join(artifacts_dir(), name)
    driver.save_screenshot(path)
    print(f"screenshot: {path}")
    return path
