"""A real browser for the status page's tests: Debian's headless Chromium through Selenium, and a
wait on what the page shows (tests/ is not a package: `from browser import headless_chromium`)."""

from __future__ import annotations

import shutil
import time

import pytest


def headless_chromium():
    """A headless Chromium through Selenium, or skip saying what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install them)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1100"):  # fmt: skip
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def wait_until(predicate, what: str, timeout: float = 20.0):
    """The first truthy value of ``predicate()``, polled until ``timeout``: a page updates on its
    own schedule, so there is no event to wait on from outside the browser."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
