"""Who can force-release a lock, through the admin and the command line, and who cannot.

``tests/test_admin.py`` covers the main roles: anonymous and non-staff users, staff without
the permission, viewers, operators, CSRF for operators, and a stale token. These are the
other ways in: GET requests, a token of another key, malformed tokens, inactive accounts,
CSRF-less posts by every role, and look-alike keys and tokens on the command line.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client

from django_mongolock import LockInfo, LockManager
from tests.test_admin import LIST_URL, make_user, put, release_url
from tests.utils import run_command

pytestmark = pytest.mark.django_db

Login = Callable[..., Client]
RELEASE = "release_selected"


@pytest.fixture
def locks(mongolock_settings: dict[str, object], manager: LockManager) -> LockManager:
    """The admin's collection (the test's own database), with its indexes."""
    manager.ensure_indexes()
    return manager


@pytest.fixture
def held(locks: LockManager) -> dict[str, LockInfo]:
    """Two live locks, and keys that look like patterns or operators."""
    keys = ["billing", "reports", "billing-2", "a.b", "$ne", ".*"]
    return {key: put(locks, key, owner=f"web-1:42:{n:04x}") for n, key in enumerate(keys)}


@pytest.fixture
def login() -> Login:
    """``login(name, *perms, staff=True, active=True, csrf=False)``: a logged-in client."""

    def log_in(
        name: str, *perms: str, staff: bool = True, active: bool = True, csrf: bool = False
    ) -> Client:
        user = make_user(name, *perms, staff=staff)
        if not active:
            user.is_active = False
            user.save()
        client = Client(enforce_csrf_checks=csrf)
        client.force_login(user)
        return client

    return log_in


def untouched(locks: LockManager, held: dict[str, LockInfo]) -> bool:
    """Every lock is still there, with the holder and token it had."""
    now = {key: locks.status(key) for key in held}
    return all(
        info is not None and (info.owner, info.token) == (held[key].owner, held[key].token)
        for key, info in now.items()
    )


def test_get_requests_never_release(
    login: Login, held: dict[str, LockInfo], locks: LockManager
) -> None:
    operator = login("operator", "release_lock")
    token = str(held["billing"].token)
    confirm = operator.get(release_url("billing"), {"token": token, "post": "yes"})
    assert confirm.status_code == 200
    assert "Are you sure" in confirm.content.decode()
    listed = operator.get(
        LIST_URL, {"action": RELEASE, "_selected_action": f"{token}:billing", "post": "yes"}
    )
    assert listed.status_code == 200
    assert untouched(locks, held)
    assert not LogEntry.objects.exists()


def test_a_token_releases_only_the_key_it_belongs_to(
    login: Login, held: dict[str, LockInfo], locks: LockManager
) -> None:
    operator = login("operator", "release_lock")
    billing = held["billing"].token
    operator.post(release_url("reports"), {"token": billing, "post": "yes"})
    bulk = {"action": RELEASE, "_selected_action": [f"{billing}:reports"], "post": "yes"}
    operator.post(LIST_URL, bulk)
    assert untouched(locks, held)
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize(
    "token",
    ["", " ", "abc", "-1", "0", "1e3", "0x10", "1.0", "+5", "12 34", "nan", "None"],
)
def test_malformed_tokens_release_nothing(
    login: Login, held: dict[str, LockInfo], locks: LockManager, token: str
) -> None:
    operator = login("operator", "release_lock")
    single = operator.post(release_url("billing"), {"token": token, "post": "yes"})
    assert single.status_code == 302
    bulk = {"action": RELEASE, "_selected_action": [f"{token}:billing"], "post": "yes"}
    assert operator.post(LIST_URL, bulk).status_code == 302
    assert untouched(locks, held)


@pytest.mark.parametrize(
    "token", ["²", "9" * 20, "-" + "9" * 20], ids=["superscript", "huge", "-huge"]
)
def test_odd_digits_and_tokens_beyond_int64_release_nothing_and_get_a_message(
    login: Login, held: dict[str, LockInfo], locks: LockManager, token: str
) -> None:
    operator = login("operator", "release_lock")
    single = operator.post(release_url("billing"), {"token": token, "post": "yes"}, follow=True)
    assert single.status_code == 200
    bulk = {"action": RELEASE, "_selected_action": [f"{token}:billing"], "post": "yes"}
    assert operator.post(LIST_URL, bulk, follow=True).status_code == 200
    assert untouched(locks, held)


def test_an_inactive_operator_is_sent_to_the_login(
    login: Login, held: dict[str, LockInfo], locks: LockManager
) -> None:
    retired = login("retired", "release_lock", active=False)
    token = held["billing"].token
    response = retired.post(release_url("billing"), {"token": token, "post": "yes"})
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")
    bulk = {"action": RELEASE, "_selected_action": [f"{token}:billing"], "post": "yes"}
    assert retired.post(LIST_URL, bulk)["Location"].startswith("/admin/login/")
    assert untouched(locks, held)


@pytest.mark.parametrize(
    ("role", "perms", "superuser"),
    [
        ("anonymous", (), False),
        ("staff", (), False),
        ("viewer", ("view_lock",), False),
        ("operator", ("release_lock",), False),
        ("superuser", (), True),
    ],
)
def test_posts_without_a_csrf_token_release_nothing(
    held: dict[str, LockInfo],
    locks: LockManager,
    role: str,
    perms: tuple[str, ...],
    superuser: bool,
) -> None:
    client = Client(enforce_csrf_checks=True)
    if role != "anonymous":
        user = make_user(role, *perms)
        if superuser:
            user.is_superuser = True
            user.save()
        client.force_login(user)
    token = held["billing"].token
    single = client.post(release_url("billing"), {"token": token, "post": "yes"})
    bulk = {"action": RELEASE, "_selected_action": [f"{token}:billing"], "post": "yes"}
    assert single.status_code == 403
    assert client.post(LIST_URL, bulk).status_code == 403
    assert untouched(locks, held)


def test_a_viewer_cannot_reach_the_bulk_confirmation(
    login: Login, held: dict[str, LockInfo], locks: LockManager
) -> None:
    viewer = login("viewer", "view_lock")
    picked = {"action": RELEASE, "_selected_action": [f"{held['billing'].token}:billing"]}
    assert viewer.post(LIST_URL, picked).status_code == 403
    assert untouched(locks, held)


def test_permissions_of_other_models_are_not_enough(
    login: Login, held: dict[str, LockInfo], locks: LockManager
) -> None:
    # Every permission of the auth app, including the power to edit users' permissions.
    from django.contrib.auth.models import Permission

    user = make_user("admin-of-users")
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="auth"))
    client = Client()
    client.force_login(user)
    token = held["billing"].token
    assert client.post(release_url("billing"), {"token": token, "post": "yes"}).status_code == 403
    assert untouched(locks, held)


# -- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", [".+", "billing.*", "^billing", "{'$ne': ''}", '{"$ne": ""}', "$gt"]
)
def test_release_from_the_command_line_matches_the_key_exactly(
    held: dict[str, LockInfo], locks: LockManager, key: str
) -> None:
    out, err, code = run_command("mongolock", "release", key)
    assert (out, code) == ("", 1)
    assert err == f"no lock {key!r}"
    assert untouched(locks, held)


def test_pattern_looking_keys_are_released_alone(
    held: dict[str, LockInfo], locks: LockManager
) -> None:
    for key in (".*", "$ne", "a.b"):
        token = str(held[key].token)
        _, err, code = run_command("mongolock", "release", key, "--token", token, "--force")
        assert (code, err) == (0, "")
        remaining = {name: info for name, info in held.items() if locks.status(name) is not None}
        assert key not in remaining
        assert untouched(locks, remaining)


@pytest.mark.parametrize("token", ["abc", "1.5", "", "0x10"])
def test_a_malformed_token_on_the_command_line_releases_nothing(
    held: dict[str, LockInfo], locks: LockManager, token: str
) -> None:
    _, err, code = run_command("mongolock", "release", "billing", "--token", token)
    assert code != 0
    assert "--token" in err
    assert untouched(locks, held)


def test_a_token_of_another_key_on_the_command_line_releases_nothing(
    held: dict[str, LockInfo], locks: LockManager
) -> None:
    other = str(held["reports"].token)
    _, err, code = run_command("mongolock", "release", "billing", "--token", other)
    assert code == 1
    assert f"now has token {held['billing'].token}, not {other}" in err
    assert untouched(locks, held)


def test_a_token_beyond_int64_on_the_command_line_is_an_argument_error(
    held: dict[str, LockInfo], locks: LockManager
) -> None:
    _, err, code = run_command("mongolock", "release", "billing", "--token", str(2**64))
    assert code == 2
    assert "token" in err
    assert untouched(locks, held)
