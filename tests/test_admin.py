"""The lock dashboard in the admin, through Django's test client, against the real replica set."""

from __future__ import annotations

import itertools
import re
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission, User
from django.contrib.staticfiles import finders
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from pytest_django.fixtures import Settings as SettingsWrapper

import django_mongolock
from django_mongolock import LockInfo, LockManager
from django_mongolock.display import Moment, split_owner
from django_mongolock.display import duration as _duration
from django_mongolock.models import Lock as LockModel
from django_mongolock.releasing import parse_selection

pytestmark = pytest.mark.django_db

LIST_URL = "/admin/django_mongolock/lock/"
ODD_KEYS = [
    "reports/daily",
    "ключ/🔒 замок",
    "100%_done:1?x=y#z&w=1",
    "  spaced  key  ",
    "<script>alert(1)</script>",
    "a" * 300,
    ".",
    "..",
]
_increments = itertools.count(1)


# -- data ----------------------------------------------------------------------------------------


def lock_document(
    key: str,
    *,
    owner: str = "web-1:4242:0a1b2c3d4e5f",
    token: int | None = None,
    acquired_ago: float = 20.0,
    expires_in: float = 25.0,
    ttl: float = 30.0,
    now: datetime | None = None,
) -> dict[str, Any]:
    """A lock document as the store writes it, with times relative to ``now``.

    The test server runs on this machine, so this clock and the server's agree to within
    the few seconds that the tests leave as a margin.
    """
    now = now or datetime.now(UTC)
    acquired = now - timedelta(seconds=acquired_ago)
    return {
        "_id": key,
        "key": key,
        "owner": owner,
        # Shaped like the store's tokens: cluster time seconds * 2**31 + increment.
        "token": token
        if token is not None
        else (int(acquired.timestamp()) << 31) + next(_increments),
        "acquired_at": acquired,
        "refreshed_at": min(now, acquired + timedelta(seconds=ttl / 3)),
        "expires_at": now + timedelta(seconds=expires_in),
        "ttl": ttl,
    }


def put(manager: LockManager, key: str, **fields: Any) -> LockInfo:
    """Store one lock document and return it as the manager reads it."""
    manager.store.collection.insert_one(lock_document(key, **fields))
    info = manager.status(key)
    assert info is not None
    return info


@pytest.fixture
def locks(mongolock_settings: dict[str, Any], manager: LockManager) -> LockManager:
    """The admin's collection (the test's own database), with its indexes."""
    manager.ensure_indexes()
    return manager


@pytest.fixture
def sample(locks: LockManager) -> dict[str, LockInfo]:
    """Two live locks (one expiring within 10 s) and two expired ones, of three processes."""
    return {
        "reports/daily": put(locks, "reports/daily", owner="web-1:4242:aa11", expires_in=25),
        "reports/weekly": put(locks, "reports/weekly", owner="web-2:77:bb22", expires_in=8),
        "cron/cleanup": put(locks, "cron/cleanup", owner="worker-3:9:cc33", expires_in=-90),
        "invoices/42": put(locks, "invoices/42", owner="web-1:4242:dd44", expires_in=-5),
    }


# -- users ---------------------------------------------------------------------------------------


def make_user(name: str, *perms: str, staff: bool = True) -> User:
    # No password: the tests log in with force_login, and hashing one is slow.
    user = User.objects.create_user(username=name, password=None, is_staff=staff)
    for codename in perms:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="django_mongolock", codename=codename)
        )
    return user


@pytest.fixture
def client_for() -> Callable[..., Client]:
    """A logged-in client: ``client_for("viewer", "view_lock")``."""

    def login(name: str, *perms: str, staff: bool = True, csrf: bool = False) -> Client:
        user = make_user(name, *perms, staff=staff)
        client = Client(enforce_csrf_checks=csrf)
        client.force_login(user)
        return client

    return login


def keys_of(response: Any) -> list[str]:
    return [row.info.key for row in response.context["rows"]]


def messages_of(response: Any) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def lock_url(name: str, key: str) -> str:
    """What ``reverse()`` gives, but with ``.`` and ``..`` escaped so browsers keep them."""
    if key in {".", ".."}:
        return f"{LIST_URL}{'%2E' * len(key)}/{name}/"
    return reverse(f"admin:django_mongolock_lock_{name}", args=(quote(key),))


def change_url(key: str) -> str:
    return lock_url("change", key)


def release_url(key: str) -> str:
    return lock_url("release", key)


# -- the model -----------------------------------------------------------------------------------


def test_model_is_unmanaged_with_two_permissions_and_no_table() -> None:
    opts = LockModel._meta
    assert opts.managed is False
    assert opts.default_permissions == ()
    codenames = set(
        Permission.objects.filter(content_type__app_label="django_mongolock").values_list(
            "codename", flat=True
        )
    )
    assert codenames == {"view_lock", "release_lock"}
    assert "django_mongolock_lock" not in connection.introspection.table_names()


def test_model_is_not_the_lock_handle_nor_public() -> None:
    handle: object = django_mongolock.Lock
    assert handle is not LockModel
    assert "models" not in django_mongolock.__all__
    assert django_mongolock.Lock.__module__ == "django_mongolock.lock"


def test_static_files_are_found() -> None:
    for name in ("django_mongolock/admin.css", "django_mongolock/autorefresh.js"):
        assert finders.find(name), name


def test_migrations_match_the_model() -> None:
    call_command("makemigrations", "django_mongolock", "--check", "--dry-run", verbosity=0)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.05, "50 ms"),
        (0.9996, "1 s"),
        (1.04, "1 s"),
        (4.25, "4.2 s"),
        (-4.25, "4.2 s"),
        (59.6, "1 min"),
        (61, "1 min 1 s"),
        (3660, "1 h 1 min"),
        (90000, "1 d 1 h"),
    ],
)
def test_durations_read_short(seconds: float, text: str) -> None:
    assert _duration(seconds) == text


def test_moments_are_relative_to_the_server_clock() -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    ahead = Moment.of(now + timedelta(seconds=90), now)
    assert (ahead.relative, ahead.absolute) == ("in 1 min 30 s", "2026-01-02 03:05:35.678 UTC")
    assert Moment.of(now - timedelta(seconds=3), now).relative == "3 s ago"


def test_owners_split_into_host_and_pid() -> None:
    assert split_owner("web-1.example.com:4242:0a1b2c") == ("web-1.example.com", "4242")
    assert split_owner("ipv6:::1:77:ff") == ("ipv6:::1", "77")
    assert split_owner("custom-owner") == ("custom-owner", None)


def test_selections_carry_the_token_first() -> None:
    assert parse_selection(["12:a:b", "x:bad", "13:", "14:a:b", "15:c"]) == [("a:b", 12), ("c", 15)]


# -- the index and the list ----------------------------------------------------------------------


def test_admin_index_lists_locks_under_the_apps_section(admin_client: Client) -> None:
    page = admin_client.get("/admin/").content.decode()
    assert "MongoDB locks" in page
    assert f'href="{LIST_URL}"' in page


def test_list_shows_live_and_expired_locks_with_counts(
    admin_client: Client, sample: dict[str, LockInfo]
) -> None:
    response = admin_client.get(LIST_URL)
    assert response.status_code == 200
    assert response.context["counts"] == {"live": 2, "expired": 2, "expiring": 1}
    assert keys_of(response) == sorted(sample)
    rows = {row.info.key: row for row in response.context["rows"]}
    assert rows["reports/daily"].status == "live"
    assert rows["reports/weekly"].status == "expiring"
    assert rows["reports/weekly"].status_label == "live"
    assert rows["cron/cleanup"].status == "expired"
    assert (rows["reports/daily"].host, rows["reports/daily"].pid) == ("web-1", "4242")
    assert rows["reports/daily"].expires.relative.startswith("in ")
    assert rows["cron/cleanup"].expires.relative.endswith(" ago")
    assert rows["cron/cleanup"].expires.absolute.endswith(" UTC")
    page = response.content.decode()
    assert str(sample["reports/daily"].token) in page
    assert 'class="mongolock-state mongolock-state-expired"' in page
    assert f'title="{rows["cron/cleanup"].expires.absolute}"' in page
    assert "30 s" in page  # lease length
    assert "expiring within 10 s" in page
    assert 'title="The lease ends within 10 s">live</span>' in page
    assert f'href="{change_url("reports/daily")}"' in page
    assert "action-select" in page  # a superuser may release


def test_filter_by_state(admin_client: Client, sample: dict[str, LockInfo]) -> None:
    live = admin_client.get(LIST_URL, {"state": "live"})
    assert keys_of(live) == ["reports/daily", "reports/weekly"]
    expired = admin_client.get(LIST_URL, {"state": "expired"})
    assert keys_of(expired) == ["cron/cleanup", "invoices/42"]
    assert expired.context["matching"] == 2
    assert 'class="selected"><a href="?state=expired"' in expired.content.decode()


def test_search_by_key_prefix_and_by_owner(
    admin_client: Client, sample: dict[str, LockInfo], locks: LockManager
) -> None:
    put(locks, "reportsXdaily", owner="web-9:1:ee55")
    assert keys_of(admin_client.get(LIST_URL, {"q": "reports/"})) == [
        "reports/daily",
        "reports/weekly",
    ]
    # The prefix is literal text, not a pattern.
    assert keys_of(admin_client.get(LIST_URL, {"q": "reports."})) == []
    assert keys_of(admin_client.get(LIST_URL, {"owner": "web-1:4242:"})) == [
        "invoices/42",
        "reports/daily",
    ]
    both = admin_client.get(LIST_URL, {"q": "reports", "owner": "web-1", "state": "live"})
    assert keys_of(both) == ["reports/daily"]
    assert "1 result" in both.content.decode()


def test_owner_links_filter_by_that_process(
    admin_client: Client, sample: dict[str, LockInfo]
) -> None:
    page = admin_client.get(LIST_URL).content.decode()
    assert 'title="web-1:4242:aa11"><a href="?owner=web-1%3A4242%3A">web-1</a>' in page


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ("-key", ["reports/weekly", "reports/daily", "invoices/42", "cron/cleanup"]),
        ("expires", ["cron/cleanup", "invoices/42", "reports/weekly", "reports/daily"]),
        ("-expires", ["reports/daily", "reports/weekly", "invoices/42", "cron/cleanup"]),
    ],
)
def test_sort(
    admin_client: Client, sample: dict[str, LockInfo], order: str, expected: list[str]
) -> None:
    assert keys_of(admin_client.get(LIST_URL, {"o": order})) == expected


def test_sort_by_acquisition(admin_client: Client, locks: LockManager) -> None:
    put(locks, "b-oldest", acquired_ago=300)
    put(locks, "a-newest", acquired_ago=1)
    put(locks, "c-middle", acquired_ago=60)
    assert keys_of(admin_client.get(LIST_URL, {"o": "acquired"})) == [
        "b-oldest",
        "c-middle",
        "a-newest",
    ]
    response = admin_client.get(LIST_URL, {"o": "-acquired"})
    assert keys_of(response) == ["a-newest", "c-middle", "b-oldest"]
    header = next(h for h in response.context["headers"] if h["name"] == "acquired")
    assert header["sorted"]
    assert not header["ascending"]
    assert header["url_toggle"] == "?o=acquired"


def test_bad_parameters_fall_back_to_defaults(
    admin_client: Client, sample: dict[str, LockInfo]
) -> None:
    response = admin_client.get(
        LIST_URL, {"state": "zombie", "o": "owner", "p": "x", "refresh": "1"}
    )
    assert response.status_code == 200
    assert keys_of(response) == sorted(sample)
    assert response.context["params"].refresh is None


def test_pages_are_fetched_by_the_server(
    admin_client: Client, locks: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = datetime.now(UTC)
    locks.store.collection.insert_many(
        [lock_document(f"job-{i:04d}", now=now, expires_in=-30 + i % 60) for i in range(250)]
    )
    calls: list[dict[str, Any]] = []
    real_list = LockManager.list

    def spy(self: LockManager, *args: Any, **kwargs: Any) -> list[LockInfo]:
        calls.append(kwargs)
        return real_list(self, *args, **kwargs)

    monkeypatch.setattr(LockManager, "list", spy)
    first = admin_client.get(LIST_URL)
    assert keys_of(first)[0] == "job-0000"
    assert len(keys_of(first)) == 100
    assert calls[-1]["limit"] == 100
    assert calls[-1]["offset"] == 0
    last = admin_client.get(LIST_URL, {"p": "3"})
    assert keys_of(last) == [f"job-{i:04d}" for i in range(200, 250)]
    assert (calls[-1]["limit"], calls[-1]["offset"]) == (50, 200)
    # A page past the end shows the last one.
    assert keys_of(admin_client.get(LIST_URL, {"p": "99"})) == keys_of(last)
    page = first.content.decode()
    assert '<span class="this-page">1</span>' in page
    assert '<a href="?p=3" class="end">3</a>' in page
    assert "250 locks" in page


def test_ten_thousand_locks_are_paged_by_the_server(
    admin_client: Client, locks: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = datetime.now(UTC)
    hosts = ["web-1", "web-2", "worker-1", "worker-2", "cron"]
    locks.store.collection.insert_many(
        [
            lock_document(
                f"tenant-{i % 97:02d}/job-{i:05d}",
                owner=f"{hosts[i % 5]}:{1000 + i % 40}:{i:012x}",
                now=now,
                acquired_ago=i % 600,
                expires_in=(i % 120) - 60,
            )
            for i in range(10_000)
        ]
    )
    monkeypatch.setattr(
        LockManager,
        "iter_locks",
        lambda *args, **kwargs: pytest.fail("the admin must not stream the whole collection"),
    )
    response = admin_client.get(LIST_URL, {"state": "expired", "o": "-expires", "p": "40"})
    assert response.status_code == 200
    assert response.context["matching"] == response.context["counts"]["expired"]
    assert len(keys_of(response)) == 100
    assert response.context["page"].number == 40
    searched = admin_client.get(LIST_URL, {"q": "tenant-07/", "owner": "worker-1"})
    assert searched.context["matching"] == locks.count("all", "tenant-07/", "worker-1")
    assert all(key.startswith("tenant-07/") for key in keys_of(searched))


# -- one lock ------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ODD_KEYS)
def test_detail_page_of_any_key(admin_client: Client, locks: LockManager, key: str) -> None:
    info = put(locks, key, owner="web-1:4242:aa11")
    listed = admin_client.get(LIST_URL).content.decode()
    url = change_url(key)
    assert "/" not in url.removeprefix(LIST_URL).removesuffix("/change/")
    assert f'href="{url}"' in listed
    response = admin_client.get(url)
    assert response.status_code == 200
    assert (response.context["info"].key, response.context["info"].token) == (key, info.token)
    page = response.content.decode()
    for text in (str(info.token), info.owner, "web-1", "4242", "30 s", "Force release"):
        assert text in page
    assert "<script>alert(1)</script>" not in page
    row = response.context["row"]
    assert row.acquired.absolute in page
    assert row.expires.absolute in page


def test_bare_lock_url_redirects_to_its_page(admin_client: Client, locks: LockManager) -> None:
    put(locks, "a/b")
    response = admin_client.get(f"{LIST_URL}{quote('a/b')}/")
    assert response.status_code == 302
    assert response["Location"] == change_url("a/b")


def test_detail_of_a_missing_lock_goes_back_to_the_list(
    admin_client: Client, locks: LockManager
) -> None:
    response = admin_client.get(change_url("gone/key"), follow=True)
    assert response.redirect_chain[-1][0] == LIST_URL
    assert any("“gone/key” does not exist" in text for text in messages_of(response))


def test_detail_of_an_invalid_key_is_not_found(admin_client: Client, locks: LockManager) -> None:
    assert admin_client.get(change_url("x" * 2000)).status_code == 404


def test_detail_keeps_the_list_filters(admin_client: Client, sample: dict[str, LockInfo]) -> None:
    listed = admin_client.get(LIST_URL, {"state": "live", "q": "reports"})
    row = listed.context["rows"][0]
    assert row.url == change_url(row.info.key) + "?_changelist_filters=q%3Dreports%26state%3Dlive"
    detail = admin_client.get(row.url)
    assert detail.context["changelist_url"] == f"{LIST_URL}?q=reports&state=live"


# -- permissions ---------------------------------------------------------------------------------


def test_anonymous_users_are_sent_to_the_login(
    client: Client, sample: dict[str, LockInfo], locks: LockManager
) -> None:
    for url in (LIST_URL, change_url("reports/daily"), release_url("reports/daily")):
        response = client.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/?next=")
    token = sample["reports/daily"].token
    response = client.post(release_url("reports/daily"), {"token": token, "post": "yes"})
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")
    assert locks.status("reports/daily") is not None


def test_non_staff_users_are_sent_to_the_login(
    client_for: Callable[..., Client], sample: dict[str, LockInfo], locks: LockManager
) -> None:
    client = client_for("customer", "view_lock", "release_lock", staff=False)
    assert client.get(LIST_URL)["Location"].startswith("/admin/login/")
    token = sample["invoices/42"].token
    response = client.post(release_url("invoices/42"), {"token": token, "post": "yes"})
    assert response["Location"].startswith("/admin/login/")
    assert locks.status("invoices/42") is not None


def test_staff_without_the_permission_are_forbidden(
    client_for: Callable[..., Client], sample: dict[str, LockInfo], locks: LockManager
) -> None:
    client = client_for("staff")
    assert f'href="{LIST_URL}"' not in client.get("/admin/").content.decode()
    assert client.get(LIST_URL).status_code == 403
    assert client.get(change_url("reports/daily")).status_code == 403
    token = sample["reports/daily"].token
    assert client.post(release_url("reports/daily"), {"token": token}).status_code == 403
    assert locks.status("reports/daily") is not None


def test_viewers_see_the_dashboard_read_only(
    client_for: Callable[..., Client], sample: dict[str, LockInfo], locks: LockManager
) -> None:
    client = client_for("viewer", "view_lock")
    assert f'href="{LIST_URL}"' in client.get("/admin/").content.decode()
    listed = client.get(LIST_URL)
    assert listed.status_code == 200
    page = listed.content.decode()
    assert "action-select" not in page
    assert 'name="action"' not in page
    detail = client.get(change_url("reports/daily")).content.decode()
    assert "Force release" not in detail
    assert "You can view this lock but not release it." in detail
    token = sample["reports/daily"].token
    assert client.get(release_url("reports/daily")).status_code == 403
    assert client.post(release_url("reports/daily"), {"token": token}).status_code == 403
    bulk = {"action": "release_selected", "_selected_action": [f"{token}:reports/daily"]}
    assert client.post(LIST_URL, {**bulk, "post": "yes"}).status_code == 403
    assert locks.status("reports/daily") is not None
    assert not LogEntry.objects.exists()


def test_the_release_permission_alone_is_enough(
    client_for: Callable[..., Client], sample: dict[str, LockInfo], locks: LockManager
) -> None:
    client = client_for("operator", "release_lock")
    assert "action-select" in client.get(LIST_URL).content.decode()
    token = sample["cron/cleanup"].token
    response = client.post(release_url("cron/cleanup"), {"token": token})
    assert response.status_code == 302
    assert locks.status("cron/cleanup") is None


# -- force release -------------------------------------------------------------------------------


def test_force_release_from_the_detail_page(
    admin_client: Client,
    admin_user: User,
    sample: dict[str, LockInfo],
    locks: LockManager,
) -> None:
    info = sample["reports/daily"]
    detail = admin_client.get(change_url(info.key))
    confirm_url = detail.context["row"].release_url
    assert confirm_url == f"{release_url(info.key)}?token={info.token}"
    confirm = admin_client.get(confirm_url)
    assert confirm.status_code == 200
    page = confirm.content.decode()
    assert "Are you sure you want to force-release the lock “reports/daily”?" in page
    assert f'name="token" value="{info.token}"' in page
    # A live lease whose holder has sent no heartbeat may be running: the box is needed.
    assert f'name="confirm_alive" value="{info.token}:{info.key}" required' in page
    done = admin_client.post(
        confirm_url,
        {"token": info.token, "post": "yes", "confirm_alive": f"{info.token}:{info.key}"},
        follow=True,
    )
    assert done.redirect_chain[-1][0] == LIST_URL
    assert (
        f"The lock “reports/daily” was force-released (owner web-1:4242:aa11, fencing token "
        f"{info.token})." in messages_of(done)
    )
    assert "reports/daily" not in keys_of(done)
    assert locks.status(info.key) is None
    entry = LogEntry.objects.get()
    assert (entry.object_id, entry.object_repr, entry.action_flag) == (
        "reports/daily",
        "reports/daily",
        DELETION,
    )
    assert entry.user_id == admin_user.pk
    assert entry.content_type is not None
    assert entry.content_type.model_class() is LockModel
    assert "web-1:4242:aa11" in entry.change_message
    assert str(info.token) in entry.change_message
    # The index's recent actions list it; the key's page shows it once the key is taken again.
    assert "reports/daily" in admin_client.get("/admin/").content.decode()
    put(locks, "reports/daily", owner="web-3:5:gg77")
    history = admin_client.get(change_url("reports/daily")).content.decode()
    assert "Release history" in history
    assert f"Force-released; owner web-1:4242:aa11, fencing token {info.token}." in history


def test_release_by_a_stale_token_spares_the_new_holder(
    admin_client: Client, locks: LockManager, other: LockManager
) -> None:
    shown = put(locks, "billing", expires_in=-1)  # its holder died; an operator opens it
    confirm_url = admin_client.get(change_url("billing")).context["row"].release_url
    new = other.acquire("billing", ttl=60, blocking=False)  # meanwhile, a worker takes it
    try:
        assert new.token > shown.token
        # The confirmation shows what changed and offers nothing to release.
        confirm = admin_client.get(confirm_url).content.decode()
        assert "Changed hands since the page was shown" in confirm
        assert "I\u2019m sure" not in confirm
        # A release already on its way, at the old token, leaves the new lock alone.
        done = admin_client.post(confirm_url, {"token": shown.token, "post": "yes"}, follow=True)
        current = locks.status("billing")
        assert current is not None
        assert (current.owner, current.token) == (new.owner, new.token)
        assert new.valid
        assert (
            f"The lock “billing” was not released: it changed hands since the page was shown "
            f"(fencing token {shown.token}, now {new.token} held by {new.owner})."
        ) in messages_of(done)
        assert not LogEntry.objects.exists()
    finally:
        new.release()


def test_release_of_a_lock_already_gone(admin_client: Client, locks: LockManager) -> None:
    info = put(locks, "gone")
    locks.force_release("gone")
    done = admin_client.post(release_url("gone"), {"token": info.token}, follow=True)
    assert "The lock “gone” was not released: it no longer exists." in messages_of(done)


def test_bulk_release_confirms_then_releases_at_the_tokens_shown(
    admin_client: Client, sample: dict[str, LockInfo], locks: LockManager
) -> None:
    chosen = [sample["cron/cleanup"], sample["invoices/42"], sample["reports/weekly"]]
    picked = [f"{info.token}:{info.key}" for info in chosen]
    # The token of one changes before the operator confirms.
    locks.force_release("reports/weekly")
    retaken = put(locks, "reports/weekly", owner="web-7:1:ff66", token=chosen[2].token + 5)
    url = f"{LIST_URL}?state=expired"
    confirm = admin_client.post(url, {"action": "release_selected", "_selected_action": picked})
    assert confirm.status_code == 200
    page = confirm.content.decode()
    assert "Are you sure you want to force-release these 2 locks?" in page
    assert "Changed hands since the page was shown" in page
    assert [item["selection"] for item in confirm.context["releasable"]] == picked[:2]
    done = admin_client.post(
        url,
        {"action": "release_selected", "_selected_action": picked, "post": "yes"},
        follow=True,
    )
    assert done.redirect_chain[-1][0] == url
    assert "2 locks were force-released." in messages_of(done)
    assert locks.status("cron/cleanup") is None
    assert locks.status("invoices/42") is None
    current = locks.status("reports/weekly")
    assert current is not None
    assert current.token == retaken.token
    assert sorted(str(key) for key in LogEntry.objects.values_list("object_id", flat=True)) == [
        "cron/cleanup",
        "invoices/42",
    ]


def test_bulk_release_needs_an_action_and_a_selection(
    admin_client: Client, sample: dict[str, LockInfo]
) -> None:
    no_action = admin_client.post(LIST_URL, {"_selected_action": ["1:x"]}, follow=True)
    assert "No action selected." in messages_of(no_action)
    nothing = admin_client.post(
        LIST_URL, {"action": "release_selected", "_selected_action": ["nonsense"]}, follow=True
    )
    assert any(text.startswith("Items must be selected") for text in messages_of(nothing))


def test_release_is_csrf_protected(
    client_for: Callable[..., Client], sample: dict[str, LockInfo], locks: LockManager
) -> None:
    client = client_for("operator", "release_lock", csrf=True)
    info = sample["invoices/42"]
    forged = client.post(release_url(info.key), {"token": info.token, "post": "yes"})
    assert forged.status_code == 403
    bulk = {"action": "release_selected", "_selected_action": [f"{info.token}:{info.key}"]}
    assert client.post(LIST_URL, {**bulk, "post": "yes"}).status_code == 403
    assert locks.status(info.key) is not None
    confirm = client.get(f"{release_url(info.key)}?token={info.token}").content.decode()
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', confirm)
    assert match is not None
    response = client.post(
        release_url(info.key),
        {"token": info.token, "post": "yes", "csrfmiddlewaretoken": match[1]},
    )
    assert response.status_code == 302
    assert locks.status(info.key) is None


# -- auto-refresh --------------------------------------------------------------------------------


def test_auto_refresh_keeps_the_filters(admin_client: Client, sample: dict[str, LockInfo]) -> None:
    response = admin_client.get(LIST_URL, {"state": "expired", "q": "cron", "refresh": "15"})
    page = response.content.decode()
    assert 'id="mongolock-autorefresh" data-seconds="15"' in page
    assert "django_mongolock/autorefresh.js" in page
    assert 'name="refresh" value="15"' in page  # kept by the search form
    assert 'href="?q=cron&amp;refresh=15&amp;state=live"' in page  # and by the filters
    assert 'href="?q=cron&amp;state=expired">off</a>' in page
    assert "autorefresh.js" not in admin_client.get(LIST_URL).content.decode()


# -- MongoDB trouble -----------------------------------------------------------------------------


@pytest.fixture
def unreachable(settings: SettingsWrapper) -> str:
    """Settings pointing at a port where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"mongodb://127.0.0.1:{port}/?directConnection=true"
    settings.MONGOLOCK = {"URL": url, "SERVER_SELECTION_TIMEOUT": 0.3}
    return url


def test_an_unreachable_server_gets_a_page_not_a_500(
    admin_client: Client, unreachable: str
) -> None:
    for url in (LIST_URL, change_url("any"), f"{release_url('any')}?token=1"):
        response = admin_client.get(url)
        assert response.status_code == 503
        page = response.content.decode()
        assert "MongoDB cannot be reached" in page
        assert "MONGOLOCK_URL" in page
        assert "did not answer within 0.3s" in page
        assert '<div class="breadcrumbs">' in page


def test_missing_indexes_say_to_run_migrate_mongolock(
    admin_client: Client, mongolock_settings: dict[str, Any], manager: LockManager
) -> None:
    response = admin_client.get(LIST_URL)
    assert response.status_code == 503
    page = response.content.decode()
    assert "python manage.py migrate_mongolock" in page
    assert "unique index on key: missing" in page
    manager.ensure_indexes()
    assert admin_client.get(LIST_URL).status_code == 200


def test_a_changed_retention_is_pointed_out(
    admin_client: Client, locks: LockManager, settings: SettingsWrapper
) -> None:
    settings.MONGOLOCK = {**settings.MONGOLOCK, "RETENTION": 60}
    page = admin_client.get(LIST_URL).content.decode()
    assert "(was 600): run <code>python manage.py migrate_mongolock</code>" in page


def test_the_server_check_is_remembered_between_pages(
    admin_client: Client, locks: LockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list page asks for the server's kind and indexes once per interval, not per render."""
    from django.contrib import admin

    from django_mongolock.admin import LockAdmin

    asked: list[str] = []
    real_kind, real_indexes = LockManager.server_kind, LockManager.check_indexes

    def server_kind(self: LockManager) -> Any:
        asked.append("kind")
        return real_kind(self)

    def check_indexes(self: LockManager, **kwargs: Any) -> Any:
        asked.append("indexes")
        return real_indexes(self, **kwargs)

    monkeypatch.setattr(LockManager, "server_kind", server_kind)
    monkeypatch.setattr(LockManager, "check_indexes", check_indexes)
    admin.site._registry[LockModel].health_check.clear()  # type: ignore[attr-defined]
    for _ in range(3):
        assert admin_client.get(LIST_URL).status_code == 200
    assert asked == ["kind", "indexes"]
    monkeypatch.setattr(LockAdmin, "health_check_interval", 0.0)
    for _ in range(2):
        assert admin_client.get(LIST_URL).status_code == 200
    assert asked == ["kind", "indexes"] * 3


def test_a_standalone_server_gets_a_page(
    admin_client: Client, standalone: str, settings: SettingsWrapper
) -> None:
    settings.MONGOLOCK = {"URL": standalone}
    response = admin_client.get(LIST_URL)
    assert response.status_code == 503
    page = response.content.decode()
    assert "MongoDB runs as a standalone server" in page
    assert "--replSet" in page


def test_invalid_settings_get_a_page(admin_client: Client, settings: SettingsWrapper) -> None:
    settings.MONGOLOCK = {"URL": "http://not-mongo"}
    response = admin_client.get(LIST_URL)
    assert response.status_code == 503
    assert "python manage.py check" in response.content.decode()


def test_list_and_detail_show_the_waiters(
    admin_client: Client, locks: LockManager, other: LockManager
) -> None:
    """A real holder and a real waiter blocked in acquire() on another manager."""
    holder = locks.acquire("queue/nightly", ttl=30)
    got: list[int] = []

    def wait_in_line() -> None:
        with other.lock("queue/nightly", timeout=30) as lk:
            got.append(lk.token)

    waiter = threading.Thread(target=wait_in_line, daemon=True)
    waiter.start()
    try:
        deadline = time.monotonic() + 20
        while (info := locks.status("queue/nightly")) is None or info.waiting < 1:
            assert time.monotonic() < deadline, "the waiter never got in line"
            time.sleep(0.05)
        page = admin_client.get(LIST_URL)
        [row] = [row for row in page.context["rows"] if row.info.key == "queue/nightly"]
        assert row.waiting_label == "1 waiting"
        assert '<span class="quiet mongolock-waiting">· 1 waiting</span>' in page.content.decode()
        detail = admin_client.get(change_url("queue/nightly")).content.decode()
        assert "Waiting:" in detail
        assert '<div class="readonly mongolock-waiting">1 waiting</div>' in detail
    finally:
        holder.release()
        waiter.join(timeout=30)
    assert not waiter.is_alive()
    [token] = got
    assert token > holder.token
    # Nobody waits any more: the list says nothing, the key's page says so.
    again = locks.acquire("queue/nightly", ttl=30)
    try:
        page = admin_client.get(LIST_URL)
        [row] = [row for row in page.context["rows"] if row.info.key == "queue/nightly"]
        assert row.waiting_label == ""
        assert "mongolock-waiting" not in page.content.decode()
        detail = admin_client.get(change_url("queue/nightly")).content.decode()
        assert '<div class="readonly mongolock-waiting">nobody</div>' in detail
    finally:
        again.release()


# -- holder liveness and the audit trail ---------------------------------------------------------


def heartbeat(manager: LockManager, process: str, *, silent: float = 1.0) -> None:
    """A heartbeat of ``process`` (``host:pid``) sent ``silent`` seconds ago, alive for 20 s."""
    now = datetime.now(UTC)
    manager.store.processes.insert_one(
        {
            "_id": process,
            "seen_at": now - timedelta(seconds=silent),
            "alive_until": now - timedelta(seconds=silent - 20),
            "interval": 5.0,
        }
    )


@pytest.fixture
def alive(sample: dict[str, LockInfo], locks: LockManager) -> dict[str, LockInfo]:
    """``sample`` with web-1 (reports/daily, invoices/42) alive and worker-3 silent for 5 min."""
    heartbeat(locks, "web-1:4242")
    heartbeat(locks, "worker-3:9", silent=300)
    return sample


def test_list_and_detail_show_the_holder_process(admin_client: Client, alive: Any) -> None:
    page = admin_client.get(LIST_URL)
    rows = {row.info.key: row for row in page.context["rows"]}
    assert rows["reports/daily"].process == "alive"
    assert rows["invoices/42"].process == "alive"
    assert rows["cron/cleanup"].process == "silent"
    assert rows["cron/cleanup"].process_label == "process silent for 5 min"
    assert rows["reports/weekly"].process == "unknown"
    html = page.content.decode()
    assert html.count('class="mongolock-state mongolock-process mongolock-process-alive"') == 2
    assert html.count('class="mongolock-state mongolock-process mongolock-process-silent"') == 1
    detail = admin_client.get(change_url("reports/daily")).content.decode()
    assert "Process:" in detail
    assert "process alive (last heartbeat " in detail
    unknown = admin_client.get(change_url("reports/weekly")).content.decode()
    assert "unknown: no heartbeat on record" in unknown


def test_release_of_a_live_holder_needs_a_ticked_box(
    admin_client: Client, admin_user: User, alive: dict[str, LockInfo], locks: LockManager
) -> None:
    info = alive["reports/daily"]
    confirm_url = f"{release_url(info.key)}?token={info.token}"
    confirm = admin_client.get(confirm_url)
    page = confirm.content.decode()
    assert "The holder\u2019s process of one of these locks may be alive" in page
    assert f'name="confirm_alive" value="{info.token}:{info.key}" required' in page
    assert 'name="reason"' in page
    # Without the box: nothing released, the page asks again.
    again = admin_client.post(confirm_url, {"token": info.token, "post": "yes", "reason": "x"})
    assert again.status_code == 200
    assert "confirm each live holder with its box" in again.content.decode()
    assert any(
        "1 lock was not released: the process holding it may be alive" in text
        for text in messages_of(again)
    )
    assert 'value="x"' in again.content.decode()  # the reason typed is kept
    assert locks.status(info.key) is not None
    assert locks.history(info.key) == []
    # With it: released, and recorded with the user's name and the reason.
    done = admin_client.post(
        confirm_url,
        {
            "token": info.token,
            "post": "yes",
            "confirm_alive": f"{info.token}:{info.key}",
            "reason": "  stuck on <b>export</b>  ",
        },
        follow=True,
    )
    assert done.redirect_chain[-1][0] == LIST_URL
    assert locks.status(info.key) is None
    [entry] = locks.history(info.key)
    assert (entry.by, entry.owner, entry.token, entry.reason) == (
        admin_user.get_username(),
        "web-1:4242:aa11",
        info.token,
        "stuck on <b>export</b>",
    )
    # The key's page, though the lock is gone, shows its force releases (escaped).
    history = admin_client.get(change_url(info.key))
    assert history.status_code == 200
    html = history.content.decode()
    assert "Force releases (audit trail)" in html
    assert "is not held now" in html
    assert "stuck on &lt;b&gt;export&lt;/b&gt;" in html
    assert str(info.token) in html
    assert "Force release</a>" not in html


def test_an_ended_lease_needs_no_box_an_unknown_live_holder_does(
    admin_client: Client, alive: dict[str, LockInfo], locks: LockManager
) -> None:
    unknown = alive["reports/weekly"]  # live, and no heartbeat at all: it may be running
    page = admin_client.get(f"{release_url(unknown.key)}?token={unknown.token}").content.decode()
    assert f'name="confirm_alive" value="{unknown.token}:{unknown.key}" required' in page
    again = admin_client.post(release_url(unknown.key), {"token": unknown.token, "post": "yes"})
    assert again.status_code == 200
    assert any("may be alive" in text for text in messages_of(again))
    assert locks.status(unknown.key) is not None
    assert locks.history(unknown.key) == []
    for key in ("cron/cleanup", "invoices/42"):  # ended leases: silent, and alive
        info = alive[key]
        page = admin_client.get(f"{release_url(key)}?token={info.token}").content.decode()
        assert "confirm_alive" not in page
        done = admin_client.post(release_url(key), {"token": info.token, "post": "yes"})
        assert done.status_code == 302
        assert locks.status(key) is None
        [entry] = locks.history(key)
        assert (entry.token, entry.reason, entry.by) == (info.token, "", "admin")


def test_bulk_release_releases_the_dead_and_asks_again_for_the_live(
    admin_client: Client, alive: dict[str, LockInfo], locks: LockManager
) -> None:
    picked = [f"{alive[key].token}:{key}" for key in ("cron/cleanup", "reports/weekly")]
    bulk = {"action": "release_selected", "_selected_action": picked}
    confirm = admin_client.post(LIST_URL, bulk)
    assert [item["alive"] for item in confirm.context["items"]] == [False, True]
    again = admin_client.post(LIST_URL, {**bulk, "post": "yes", "reason": "cleanup"})
    assert again.status_code == 200
    assert [item["key"] for item in again.context["items"]] == ["reports/weekly"]
    assert "1 lock was force-released." in messages_of(again) or any(
        "“cron/cleanup” was force-released" in text for text in messages_of(again)
    )
    assert locks.status("cron/cleanup") is None
    assert locks.status("reports/weekly") is not None
    done = admin_client.post(
        LIST_URL, {**bulk, "post": "yes", "confirm_alive": picked[1]}, follow=True
    )
    assert done.redirect_chain
    assert locks.status("reports/weekly") is None
    assert [entry.reason for entry in locks.history("cron/cleanup")] == ["cleanup"]
    assert [entry.reason for entry in locks.history("reports/weekly")] == [""]


def test_viewers_see_the_audit_trail_but_cannot_release(
    client_for: Callable[..., Client], alive: dict[str, LockInfo], locks: LockManager
) -> None:
    info = alive["reports/daily"]
    locks.force_release(info.key, reason="nightly rebuild", by="ops@bastion")
    put(locks, info.key, owner="web-3:5:gg77")
    viewer = client_for("viewer", "view_lock")
    html = viewer.get(change_url(info.key)).content.decode()
    assert "Force releases (audit trail)" in html
    assert "nightly rebuild" in html
    assert "ops@bastion" in html
    current = locks.status(info.key)
    assert current is not None
    forbidden = viewer.post(
        release_url(info.key),
        {"token": current.token, "post": "yes", "confirm_alive": f"{current.token}:{info.key}"},
    )
    assert forbidden.status_code == 403
    assert len(locks.history(info.key)) == 1
    anonymous = Client().get(change_url(info.key))
    assert anonymous.status_code == 302


def test_the_confirmation_box_is_csrf_protected(
    client_for: Callable[..., Client], alive: dict[str, LockInfo], locks: LockManager
) -> None:
    client = client_for("operator", "release_lock", csrf=True)
    info = alive["reports/daily"]
    forged = client.post(
        release_url(info.key),
        {"token": info.token, "post": "yes", "confirm_alive": f"{info.token}:{info.key}"},
    )
    assert forged.status_code == 403
    assert locks.status(info.key) is not None
    assert locks.history(info.key) == []


def test_bulk_release_reads_and_releases_the_selection_at_once(
    admin_client: Client,
    sample: dict[str, LockInfo],
    locks: LockManager,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The confirmation page and the release read every picked lock in one go, and release
    them in one transaction: never a status or a force release per lock."""

    def one_by_one(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a lock at a time")

    monkeypatch.setattr(LockManager, "status", one_by_one)
    monkeypatch.setattr(LockManager, "force_release", one_by_one)
    chosen = [sample["cron/cleanup"], sample["invoices/42"]]
    picked = [f"{info.token}:{info.key}" for info in chosen]
    bulk = {"action": "release_selected", "_selected_action": picked}
    url = f"{LIST_URL}?state=expired"
    confirm = admin_client.post(url, bulk)
    assert [item["selection"] for item in confirm.context["releasable"]] == picked
    done = admin_client.post(url, {**bulk, "post": "yes"}, follow=True)
    assert "2 locks were force-released." in messages_of(done)
    assert locks.statuses(info.key for info in chosen) == {}
