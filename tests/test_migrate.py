"""``manage.py migrate_mongolock`` against the real server."""

from __future__ import annotations

from typing import Any

from pytest_django.fixtures import Settings as SettingsWrapper

from django_mongolock import locks
from django_mongolock.store import KEY_INDEX, TTL_INDEX
from tests.utils import run_command


def _indexes() -> dict[str, Any]:
    return dict(locks.store.collection.index_information())


def test_fresh_then_repeated(mongolock_settings: dict[str, Any]) -> None:
    out, err, code = run_command("migrate_mongolock", "--check")
    assert code == 1
    assert "unique index on key" in out
    assert "missing" in out
    assert "migrate_mongolock" in err

    out, err, code = run_command("migrate_mongolock")
    assert (code, err) == (0, "")
    assert out.count("created") == 2
    indexes = _indexes()
    assert indexes[KEY_INDEX]["unique"] is True
    assert indexes[KEY_INDEX]["key"] == [("key", 1)]
    assert indexes[TTL_INDEX]["expireAfterSeconds"] == 600

    out, err, code = run_command("migrate_mongolock")
    assert (code, err) == (0, "")
    assert out.count("unchanged") == 2
    assert "created" not in out
    assert run_command("migrate_mongolock", "--check")[2] == 0


def test_changed_retention_is_updated_in_place(
    mongolock_settings: dict[str, Any], settings: SettingsWrapper
) -> None:
    run_command("migrate_mongolock")
    lock = locks.acquire("survives", ttl=60)
    settings.MONGOLOCK = {**mongolock_settings, "RETENTION": 120}
    out, _, code = run_command("migrate_mongolock", "--check")
    assert code == 1
    assert "differs" in out
    assert "was 600" in out
    out, _, code = run_command("migrate_mongolock")
    assert code == 0
    assert "updated (was 600)" in out
    assert _indexes()[TTL_INDEX]["expireAfterSeconds"] == 120
    assert run_command("migrate_mongolock", "--check")[2] == 0
    # Updating the index in place kept the lock documents.
    status = locks.status("survives")
    assert status is not None
    assert status.token == lock.token


def test_quiet_with_verbosity_zero(mongolock_settings: dict[str, Any]) -> None:
    out, err, code = run_command("migrate_mongolock", verbosity=0)
    assert (out, err, code) == ("", "", 0)


def test_unreachable_server(settings: SettingsWrapper) -> None:
    settings.MONGOLOCK = {"URL": "mongodb://127.0.0.1:9/", "SERVER_SELECTION_TIMEOUT": 0.2}
    _, err, code = run_command("migrate_mongolock")
    assert code == 2
    assert "127.0.0.1:9" in err


def test_standalone_server(settings: SettingsWrapper, standalone: str) -> None:
    settings.MONGOLOCK = {"URL": standalone, "DATABASE": "migrate_standalone"}
    _, err, code = run_command("migrate_mongolock", "--check")
    assert code == 1
    assert "replica set" in err
