"""The contention view and a key's history in a real browser: charts drawn, tables readable
with JavaScript off, the list's link, and screenshots for the docs.

The last hour's counts of most keys are written through the real recorder and store (a
test cannot wait an hour for past minutes); the current minute's come from real locks
contended by real threads, counted by the installed recorder and flushed in a real
refresher tick.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from django.contrib.auth.models import User

from django_mongolock import LockManager, stats
from django_mongolock.notices import get_notices
from django_mongolock.refresher import get_refresher
from tests.browser import test_admin_browser as base

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page
    from pytest_django.live_server_helper import LiveServer

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

operator = base.operator
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


def _history(manager: LockManager) -> None:
    """An hour of counts for a few keys, shaped like a busy service's."""
    recorder = stats.Recorder()
    rng = random.Random(19)
    now = time.time()
    for minute in range(60):
        t = now - minute * 60
        burst = 3 if 20 <= minute <= 28 else 1  # a contended stretch half an hour ago
        for _ in range(rng.randint(20, 30)):
            recorder.acquire(manager, "reports/daily", "acquired", at=t)
        for _ in range(rng.randint(4, 8) * burst):
            recorder.acquire(
                manager, "orders/sync", "acquired", wait=rng.uniform(0.05, 2.5 * burst), at=t
            )
        for _ in range(rng.randint(0, 3) * burst):
            recorder.acquire(manager, "orders/sync", "busy", at=t)
        if minute in (22, 26):
            recorder.acquire(
                manager, "orders/sync", "timeout", wait=10.0, owner="web-3:88:f1", at=t
            )
        for _ in range(rng.randint(1, 3)):
            recorder.acquire(manager, "invoices/2026-11", "acquired", wait=0.2, at=t)
        recorder.acquire(manager, "search-index/rebuild", "acquired", at=t)
    recorder.lost(
        manager, "orders/sync", "expired", owner="web-1:4242:9f3a", token=7311, at=now - 1500
    )
    recorder.lost(
        manager,
        "search-index/rebuild",
        "server-unreachable",
        owner="worker-7:31:0c1d",
        token=7290,
        at=now - 2400,
    )
    recorder.handoff(manager, "orders/sync", owner="web-2:77:2b8e", token=7320, at=now - 1400)
    stats.stats_store(manager.store).add(recorder.take(manager))


def test_contention_view_and_key_history(
    browser: Browser,
    page: Page,
    live_server: LiveServer,
    operator: User,
    mongolock_settings: object,
    manager: LockManager,
    other: LockManager,
    screenshots: Path,
) -> None:
    manager.ensure_indexes()
    stats.install()
    _history(manager)
    # Now: a holder and two waiters in line, counted and flushed for real.
    holder = manager.acquire("orders/sync", ttl=300)
    waiters = [
        threading.Thread(target=lambda: other.acquire("orders/sync", timeout=60).release())
        for _ in range(2)
    ]
    for waiter in waiters:
        waiter.start()
    try:
        deadline = time.monotonic() + 20
        while (info := manager.status("orders/sync")) is None or info.waiting < 2:
            assert time.monotonic() < deadline, "the waiters never got in line"
            time.sleep(0.05)
        get_refresher().tick()  # flushes the holder's acquisition into the statistics
        assert get_notices().drain(5.0)  # (on a notice worker, after the tick)

        base.log_in(page, live_server)
        page.goto(f"{live_server.url}/admin/django_mongolock/lock/")
        page.get_by_role("link", name="Contention over the last hour").click()
        page.wait_for_url("**/lock/contention/")
        assert page.locator("h1").inner_text() == "Lock contention"
        charts = page.locator("svg.mongolock-chart")
        assert charts.count() == 3
        box = charts.first.bounding_box()
        assert box is not None
        assert box["width"] > 300
        assert box["height"] > 80
        # Bars are drawn, one per minute with counts, coloured by the admin's variables.
        bars = charts.first.locator("rect.mongolock-bar-quick")
        assert bars.count() >= 59
        fill = bars.first.evaluate("el => getComputedStyle(el).fill")
        assert fill == "rgb(65, 118, 144)"  # --secondary
        keys = page.locator("#mongolock-busiest tbody th a").all_inner_texts()
        assert keys[0] == "orders/sync"
        assert set(keys) == {
            "orders/sync",
            "reports/daily",
            "invoices/2026-11",
            "search-index/rebuild",
        }
        waiting = page.locator("#mongolock-waiting-now tbody tr").first
        assert waiting.locator("td").inner_text() == "2"
        page.screenshot(path=screenshots / "admin-contention.png", full_page=True)

        page.locator("#mongolock-busiest").get_by_role("link", name="orders/sync").click()
        page.wait_for_url("**/orders_2Fsync/change/")
        line = page.locator("#mongolock-line tbody tr")
        assert line.count() == 2
        assert line.first.locator("th").inner_text() == "1"
        kinds = page.locator("#mongolock-events tbody tr").evaluate_all(
            "rows => rows.map(row => row.className)"
        )
        assert kinds == [
            "mongolock-event-timeout",
            "mongolock-event-handoff",
            "mongolock-event-lost",
            "mongolock-event-timeout",
        ]
        assert page.locator(".mongolock-key-hour svg.mongolock-chart").count() == 3
        page.screenshot(path=screenshots / "admin-key-history.png", full_page=True)
    finally:
        holder.release()
        for waiter in waiters:
            waiter.join(timeout=60)
    assert not any(waiter.is_alive() for waiter in waiters)

    # With JavaScript off, the numbers are all there in plain tables.
    context = browser.new_context(
        java_script_enabled=False, viewport={"width": 1440, "height": 900}
    )
    try:
        plain = context.new_page()
        plain.goto(f"{live_server.url}/admin/login/?next=/admin/")
        plain.fill("#id_username", "operator")
        plain.fill("#id_password", base.PASSWORD)
        plain.click("input[type=submit]")
        plain.goto(f"{live_server.url}/admin/django_mongolock/lock/contention/")
        first = plain.locator("#mongolock-busiest tbody tr").first
        assert first.locator("th").inner_text() == "orders/sync"
        plain.locator(".mongolock-minutes summary").click()
        minutes = plain.locator(".mongolock-minute-table tbody tr")
        # The hour seeded above, less its oldest minute if a minute has begun since: the
        # window is the hour up to the page's own minute.
        assert minutes.count() in (59, 60)
        assert minutes.first.locator("td").first.inner_text().isdigit()
    finally:
        context.close()
    for name in ("admin-contention.png", "admin-key-history.png"):
        if (screenshots / name).exists() and DOCS_IMG.is_dir() and _refresh_docs():
            shutil.copyfile(screenshots / name, DOCS_IMG / name)


def _refresh_docs() -> bool:
    """Copy the screenshots into docs/img only when asked (MONGOLOCK_DOCS_IMG=1)."""
    return os.environ.get("MONGOLOCK_DOCS_IMG") == "1"
