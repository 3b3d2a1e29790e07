"""Chromium, driven through Playwright, against pytest-django's ``live_server``.

Debian's Chromium (``apt-get install chromium``) is used through ``executable_path``:
Playwright's own browser downloads are not needed. The Playwright driver runs an asyncio
loop in this thread, which Django mistakes for async code calling the ORM; the browser
tests do call the ORM synchronously on purpose, hence ``DJANGO_ALLOW_ASYNC_UNSAFE``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"

CHROMIUM = os.environ.get("MONGOLOCK_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
# Bounded waits: a page that does not appear within this fails the test instead of hanging.
TIMEOUT_MS = 15_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless Chromium per module, so Playwright's loop never outlives the module."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            f"no Chromium at {CHROMIUM}: run `apt-get install -y chromium` (Debian), or point "
            "MONGOLOCK_CHROMIUM at one; deselect these tests with -m 'not browser'",
            pytrace=False,
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield chromium
        finally:
            chromium.close()


def new_page(browser: Browser, *, dark: bool = False) -> Page:
    context = browser.new_context(
        viewport={"width": 1440, "height": 900},
        locale="en-US",
        timezone_id="UTC",
        color_scheme="dark" if dark else "light",
    )
    context.set_default_timeout(TIMEOUT_MS)
    context.set_default_navigation_timeout(TIMEOUT_MS)
    return context.new_page()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh browser context (no cookies) with a 1440x900 window, light theme."""
    tab = new_page(browser)
    try:
        yield tab
    finally:
        tab.context.close()


@pytest.fixture
def screenshots() -> Path:
    """Where the tests save their screenshots (``artifacts/`` is git-ignored)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
