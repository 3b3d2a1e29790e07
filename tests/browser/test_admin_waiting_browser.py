"""The dashboard in a real browser: waiters next to the owner, and the process pill's style."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import pytest
from django.contrib.auth.models import User

from django_mongolock import LockManager
from django_mongolock.info import process_of
from tests.browser import test_admin_browser as base

if TYPE_CHECKING:
    from playwright.sync_api import Page
    from pytest_django.live_server_helper import LiveServer

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

operator = base.operator  # the superuser the pages log in as


def test_waiters_show_next_to_the_owner_and_on_the_keys_page(
    page: Page,
    live_server: LiveServer,
    operator: User,
    mongolock_settings: object,
    manager: LockManager,
    other: LockManager,
) -> None:
    manager.ensure_indexes()
    holder = manager.acquire("orders/sync", ttl=300)
    # Its process sends heartbeats, so the list shows the "process alive" pill too.
    manager.store.heartbeat({process_of(holder.owner)}, 100.0)
    waiter = threading.Thread(
        target=lambda: other.acquire("orders/sync", timeout=30).release(), daemon=True
    )
    waiter.start()
    try:
        deadline = time.monotonic() + 20
        while (info := manager.status("orders/sync")) is None or info.waiting < 1:
            assert time.monotonic() < deadline, "the waiter never got in line"
            time.sleep(0.05)
        base.log_in(page, live_server)
        page.goto(f"{live_server.url}/admin/django_mongolock/lock/")
        owner = page.locator("tr", has_text="orders/sync").locator("td.field-owner")
        assert owner.locator(".mongolock-waiting").inner_text() == "· 1 waiting"
        # The pill's rules live in admin.css: smaller than the state pill, set off by 4px.
        pill = owner.locator(".mongolock-process-alive")
        style = pill.evaluate(
            "el => { const s = getComputedStyle(el), p = getComputedStyle(el.parentElement);"
            " return [s.marginLeft, s.backgroundColor, parseFloat(s.fontSize),"
            " parseFloat(p.fontSize)]; }"
        )
        assert style[:2] == ["4px", "rgb(221, 255, 221)"]  # the admin's --message-success-bg
        assert style[2] == pytest.approx(style[3] * 0.85, abs=0.01)
        owner.locator("..").get_by_role("link", name="orders/sync").click()
        page.wait_for_url("**/orders_2Fsync/change/")
        assert page.locator(".field-waiting .readonly").inner_text() == "1 waiting"
        # The key's page uses the same class names on a plain line: no pill there.
        line = page.locator(".field-process .readonly")
        assert line.evaluate("el => getComputedStyle(el).backgroundColor") == "rgba(0, 0, 0, 0)"
    finally:
        holder.release()
        waiter.join(timeout=30)
    assert not waiter.is_alive()
