"""The lock dashboard in a real browser: log in, look, filter, open a lock, force-release it."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User

from django_mongolock import LockManager
from django_mongolock.info import process_of
from tests.browser.conftest import new_page
from tests.test_admin import put

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page
    from pytest_django.live_server_helper import LiveServer

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "a-browser-password"


@pytest.fixture
def operator() -> User:
    return User.objects.create_superuser(
        username="operator", email="ops@example.com", password=PASSWORD
    )


@pytest.fixture
def workers(
    mongolock_settings: dict[str, Any], mongolock_url: str, manager: LockManager
) -> Iterator[dict[str, LockManager]]:
    """Lock holders on three hosts, sharing the admin's collection."""
    manager.ensure_indexes()
    holders = {
        host: LockManager(mongolock_url, database=manager.database, owner=host, refresh=False)
        for host in ("web-1", "web-2", "worker-7")
    }
    yield holders
    for holder in holders.values():
        holder.close()


@pytest.fixture
def dashboard(workers: dict[str, LockManager], manager: LockManager) -> LockManager:
    """Live locks taken the way applications take them, and locks whose holders died."""
    for host, key, ttl in [
        ("web-1", "reports/daily", 300),
        ("web-1", "invoices/2026-11/42", 120),
        ("web-2", "search-index/rebuild", 600),
        ("worker-7", "exports/tenant-7", 90),
        ("worker-7", "ключ/замок", 45),
    ]:
        workers[host].acquire(key, ttl=ttl, blocking=False)
    for host, key in [("web-2", "cron/cleanup"), ("worker-7", "mail/digest")]:
        workers[host].acquire(key, ttl=0.05, blocking=False)
    put(
        manager,
        "cache/warmup",
        owner="web-2:311:5e1c0ffee0a1",
        acquired_ago=480,
        expires_in=-420,
        ttl=60,
    )
    time.sleep(0.1)  # the two short leases end
    return manager


def log_in(page: Page, live_server: LiveServer) -> None:
    page.goto(f"{live_server.url}/admin/login/?next=/admin/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"{live_server.url}/admin/")


def listed_keys(page: Page) -> list[str]:
    titles = page.locator("#result_list tbody th.field-key a").evaluate_all(
        "links => links.map(link => link.title)"
    )
    return [str(title) for title in titles]


def test_list_filter_open_and_force_release(
    page: Page,
    live_server: LiveServer,
    operator: User,
    dashboard: LockManager,
    workers: dict[str, LockManager],
    screenshots: Path,
) -> None:
    # Ends within seconds: counted as expiring (and as expired, should the test be slow).
    workers["web-2"].acquire("payments/settle", ttl=9, blocking=False)
    log_in(page, live_server)
    section = page.locator(".app-django_mongolock")
    assert (section.locator("caption").text_content() or "").strip() == "MongoDB locks"
    section.get_by_role("link", name="Locks", exact=True).click()
    page.wait_for_url(re.compile(r"/admin/django_mongolock/lock/$"))

    assert page.locator("h1").inner_text() == "Locks"
    assert listed_keys(page) == sorted(
        [
            "cache/warmup",
            "cron/cleanup",
            "exports/tenant-7",
            "invoices/2026-11/42",
            "mail/digest",
            "payments/settle",
            "reports/daily",
            "search-index/rebuild",
            "ключ/замок",
        ]
    )
    live = int(page.locator(".mongolock-count-live strong").inner_text())
    expired = int(page.locator(".mongolock-count-expired strong").inner_text())
    expiring = int(page.locator(".mongolock-count-expiring strong").inner_text())
    assert (live + expired, live - expiring) == (9, 5)
    assert page.locator(".mongolock-state-expired").count() == expired
    expires = page.locator("tr", has_text="reports/daily").locator("td.field-expires time")
    assert re.fullmatch(r"in (4 min \d+ s|5 min)", expires.inner_text())
    assert (expires.get_attribute("title") or "").endswith(" UTC")
    page.screenshot(path=screenshots / "admin-list.png", full_page=True)

    page.locator("#changelist-filter").get_by_role("link", name="Expired").click()
    page.wait_for_url(re.compile(r"\?state=expired$"))
    expired_keys = [key for key in listed_keys(page) if key != "payments/settle"]
    assert expired_keys == ["cache/warmup", "cron/cleanup", "mail/digest"]

    page.fill("#searchbar", "cron/")
    page.press("#searchbar", "Enter")
    page.wait_for_url(re.compile(r"q=cron"))
    assert listed_keys(page) == ["cron/cleanup"]
    page.locator("#changelist-filter").get_by_role("link", name="Clear all filters").click()
    page.wait_for_url(re.compile(r"/lock/\?$|/lock/$"))

    page.get_by_role("link", name="reports/daily").click()
    page.wait_for_url(re.compile(r"/reports_2Fdaily/change/"))
    info = dashboard.status("reports/daily")
    assert info is not None
    assert page.locator("h1").inner_text() == "Lock “reports/daily”"
    assert page.locator(".field-token .readonly").inner_text() == str(info.token)
    assert page.locator(".field-owner .readonly").inner_text() == info.owner
    assert page.locator(".field-host .readonly").inner_text() == "web-1"
    page.screenshot(path=screenshots / "admin-detail.png", full_page=True)

    page.get_by_role("link", name="Force release").click()
    page.wait_for_url(re.compile(rf"/reports_2Fdaily/release/\?token={info.token}"))
    assert "Are you sure you want to force-release the lock “reports/daily”?" in page.inner_text(
        "#content-main"
    )
    # A live lease whose holder has sent no heartbeat yet may be running: tick its box.
    page.locator("input[name=confirm_alive]").check()
    page.get_by_role("button", name="Yes, I\u2019m sure").click()
    page.wait_for_url(re.compile(r"/admin/django_mongolock/lock/$"))
    assert "was force-released" in page.locator(".messagelist .success").inner_text()
    assert "reports/daily" not in listed_keys(page)
    assert dashboard.status("reports/daily") is None
    assert LogEntry.objects.filter(object_id="reports/daily").count() == 1


def test_bulk_release_from_the_list(
    page: Page, live_server: LiveServer, operator: User, dashboard: LockManager
) -> None:
    log_in(page, live_server)
    page.goto(f"{live_server.url}/admin/django_mongolock/lock/?state=expired")
    for key in ("cron/cleanup", "mail/digest"):
        page.locator("tr", has_text=key).locator("input.action-select").check()
    assert page.locator(".action-counter").inner_text() == "2 of 3 selected"
    page.select_option("select[name=action]", "release_selected")
    page.get_by_role("button", name="Go").click()
    assert "Are you sure you want to force-release these 2 locks?" in page.inner_text(
        "#content-main"
    )
    page.get_by_role("button", name="Yes, I\u2019m sure").click()
    page.wait_for_url(re.compile(r"\?state=expired$"))
    assert "2 locks were force-released." in page.inner_text(".messagelist")
    assert listed_keys(page) == ["cache/warmup"]


def test_auto_refresh_reloads_with_the_filters(
    page: Page, live_server: LiveServer, operator: User, dashboard: LockManager
) -> None:
    log_in(page, live_server)
    page.goto(f"{live_server.url}/admin/django_mongolock/lock/?state=expired")
    page.locator(".mongolock-refresh").get_by_role("link", name="5 s", exact=True).click()
    page.wait_for_url(re.compile(r"\?refresh=5&state=expired$"))
    put(dashboard, "late/arrival", owner="web-9:1:abcdef", expires_in=-3)
    with page.expect_navigation(timeout=10_000):
        pass  # the page reloads itself after 5 s
    assert page.url.endswith("?refresh=5&state=expired")
    assert "late/arrival" in listed_keys(page)


def test_dark_mode_uses_the_admin_colours(
    browser: Browser,
    live_server: LiveServer,
    operator: User,
    dashboard: LockManager,
    screenshots: Path,
) -> None:
    page = new_page(browser, dark=True)
    try:
        log_in(page, live_server)
        page.goto(f"{live_server.url}/admin/django_mongolock/lock/")
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        pill = page.locator(".mongolock-state-live").first.evaluate(
            "el => getComputedStyle(el).backgroundColor"
        )
        assert background == "rgb(18, 18, 18)"  # the admin's dark --body-bg
        assert pill == "rgb(0, 107, 27)"  # its dark --message-success-bg
        page.screenshot(path=screenshots / "admin-list-dark.png", full_page=True)
    finally:
        page.context.close()


def test_a_live_holder_needs_a_ticked_box_and_the_release_is_in_the_history(
    page: Page,
    live_server: LiveServer,
    operator: User,
    dashboard: LockManager,
    screenshots: Path,
) -> None:
    info = dashboard.status("reports/daily")
    assert info is not None
    # web-1's process sends heartbeats (as its refresher would, every 100 s of a 300 s lease).
    dashboard.store.heartbeat({process_of(info.owner)}, 100.0)
    log_in(page, live_server)
    page.goto(f"{live_server.url}/admin/django_mongolock/lock/")
    row = page.locator("tr", has_text="reports/daily")
    assert row.locator(".mongolock-process-alive").inner_text() == "process alive"
    assert (
        page.locator("tr", has_text="exports/tenant-7").locator(".mongolock-process").count() == 0
    )

    row.get_by_role("link", name="reports/daily").click()
    page.wait_for_url(re.compile(r"/reports_2Fdaily/change/"))
    assert (
        page.locator(".field-process .readonly")
        .inner_text()
        .startswith("process alive (last heartbeat ")
    )
    page.get_by_role("link", name="Force release").click()
    page.wait_for_url(re.compile(rf"/reports_2Fdaily/release/\?token={info.token}"))
    warning = page.locator(".mongolock-alive-warning").inner_text()
    assert "The holder\u2019s process of one of these locks may be alive" in warning
    page.fill("#mongolock-reason", "export stuck since 02:00")
    page.screenshot(path=screenshots / "admin-release-alive.png", full_page=True)
    # The box is required: the browser does not send the form without it.
    page.get_by_role("button", name="Yes, I\u2019m sure").click()
    box = page.locator("input[name=confirm_alive]")
    assert box.evaluate("el => el.validity.valueMissing") is True
    assert "/release/" in page.url
    assert dashboard.status("reports/daily") is not None
    box.check()
    page.get_by_role("button", name="Yes, I\u2019m sure").click()
    page.wait_for_url(re.compile(r"/admin/django_mongolock/lock/$"))
    assert "was force-released" in page.locator(".messagelist .success").inner_text()
    assert dashboard.status("reports/daily") is None

    # The key's page, though the lock is gone, shows who released it, when and why.
    page.goto(f"{live_server.url}/admin/django_mongolock/lock/reports_2Fdaily/change/")
    assert "is not held now" in page.inner_text("#content-main")
    cells = page.locator("#mongolock-audit tbody tr").first.locator("th, td").all_inner_texts()
    assert cells[0].endswith(" UTC")
    assert cells[1:] == ["operator", info.owner, str(info.token), "export stuck since 02:00"]
    page.screenshot(path=screenshots / "admin-audit.png", full_page=True)
