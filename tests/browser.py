"""A real headless Chromium (Debian's `chromium` + `chromium-driver`) driven by Selenium, for the
dashboard's browser tests. Screenshots of each page go to ``artifacts/dashboard/`` (kept by CI)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts" / "dashboard"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


def require_browser() -> None:
    if not (CHROMIUM and DRIVER):
        if os.environ.get("CI"):
            pytest.fail("CI must run the dashboard's browser tests: scripts/bootstrap installs chromium")
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/bootstrap installs them)")
    pytest.importorskip("selenium")


@contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    require_browser()
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
    ):
        opts.add_argument(arg)
    # The explicit driver path keeps Selenium Manager from trying to download one (CI is offline).
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def open_page(driver: Any, url: str, route: str, timeout: float = 60.0) -> None:
    """Load ``url`` and wait until the page says it has drawn ``route`` (body[data-ready])."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, timeout).until(lambda d: d.execute_script("return document.body.dataset.ready") == route)


def shot(driver: Any, name: str) -> Path:
    """A full-page screenshot into the artifacts dir."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, max(800, min(int(height) + 40, 4000)))
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def texts(driver: Any, css: str) -> list[str]:
    return [str(e.text) for e in driver.find_elements("css selector", css)]


def column(driver: Any, table_id: str, index: int) -> list[str]:
    return texts(driver, f"table#{table_id} tbody tr td:nth-child({index + 1})")
