"""``manage.py migrate_mongolock`` against the real server."""

from __future__ import annotations

from typing import Any

from pytest_django.fixtures import Settings as SettingsWrapper

from django_mongolock import conf, locks
from django_mongolock.queries import (
    AUDIT_KEY_INDEX,
    AUDIT_TTL_INDEX,
    KEY_INDEX,
    PROCESS_TTL_INDEX,
    TTL_INDEX,
    plan_locks,
)
from django_mongolock.queries.indexes import SHARDED_KEY_DESC
from tests.utils import run_command


def _indexes() -> dict[str, Any]:
    return dict(locks.store.collection.index_information())


def _row(out: str, description: str) -> str:
    """What migrate_mongolock said of the index ``description``."""
    [line] = [line for line in out.splitlines() if f".locks{description} " in line]
    return line.split(f".locks{description} ", 1)[1].strip()


def _side_ttls() -> tuple[int, int]:
    """expireAfterSeconds of the heartbeat and the audit TTL indexes."""
    processes = locks.store.processes.index_information()[PROCESS_TTL_INDEX]
    audit = locks.store.audit.index_information()[AUDIT_TTL_INDEX]
    return processes["expireAfterSeconds"], audit["expireAfterSeconds"]


def test_fresh_then_repeated(mongolock_settings: dict[str, Any]) -> None:
    out, err, code = run_command("migrate_mongolock", "--check")
    assert code == 1
    assert "unique index on key" in out
    assert "missing" in out
    assert "migrate_mongolock" in err

    out, err, code = run_command("migrate_mongolock")
    assert (code, err) == (0, "")
    assert out.count("created") == 6
    indexes = _indexes()
    assert indexes[KEY_INDEX]["unique"] is True
    assert indexes[KEY_INDEX]["key"] == [("key", 1)]
    assert indexes[TTL_INDEX]["expireAfterSeconds"] == 600

    out, err, code = run_command("migrate_mongolock")
    assert (code, err) == (0, "")
    assert out.count("unchanged") == 6
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
    # The heartbeats follow RETENTION too; the audit trail, without AUDIT_RETENTION, as well.
    assert out.count("updated (was 600)") == 3
    assert _indexes()[TTL_INDEX]["expireAfterSeconds"] == 120
    assert _side_ttls() == (120, 120)
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


def test_heartbeat_and_audit_indexes(mongolock_settings: dict[str, Any]) -> None:
    out, err, code = run_command("migrate_mongolock")
    assert (code, err) == (0, "")
    assert _row(out, ".processes: TTL index on alive_until (expireAfterSeconds=600)") == ("created")
    assert _row(out, ".audit: TTL index on at (expireAfterSeconds=600)") == "created"
    assert _row(out, ".audit: index on key, at") == "created"
    assert _row(out, ".requests: TTL index on expires_at (expireAfterSeconds=0)") == "created"
    assert _side_ttls() == (600, 600)
    assert locks.store.audit.index_information()[AUDIT_KEY_INDEX]["key"] == [
        ("key", 1),
        ("at", -1),
    ]


def test_audit_retention_of_its_own(
    mongolock_settings: dict[str, Any], settings: SettingsWrapper
) -> None:
    run_command("migrate_mongolock")
    locks.store.audit.insert_one({"key": "k", "by": "x", "token": 1})
    settings.MONGOLOCK = {**mongolock_settings, "AUDIT_RETENTION": 86400 * 90}
    out, _, code = run_command("migrate_mongolock", "--check")
    assert code == 1
    assert _row(out, ".audit: TTL index on at (expireAfterSeconds=7776000)") == (
        "differs (was 600)"
    )
    assert out.count("differs") == 1  # the locks and heartbeats follow RETENTION, unchanged
    out, _, code = run_command("migrate_mongolock")
    assert code == 0
    assert out.count("updated (was 600)") == 1
    assert _side_ttls() == (600, 86400 * 90)
    assert locks.store.audit.count_documents({}) == 1  # updated in place: records kept
    out, _, code = run_command("migrate_mongolock")
    assert (code, out.count("unchanged")) == (0, 6)


def test_audit_retention_is_checked(
    mongolock_settings: dict[str, Any], settings: SettingsWrapper
) -> None:
    settings.MONGOLOCK = {**mongolock_settings, "AUDIT_RETENTION": -5}
    _, err, code = run_command("migrate_mongolock")
    assert code != 0
    assert "AUDIT_RETENTION" in err
    problems = {problem.id: problem.msg for problem in conf.settings_problems()}
    assert "MONGOLOCK['AUDIT_RETENTION'] must be None or a whole number" in problems["E014"]


def test_a_sharded_collection_needs_no_unique_index_on_key() -> None:
    """Sharded on ``_id`` (see docs/scaling.md), a unique index on ``key`` would be refused
    by the cluster; ``_id`` is the key and stays unique. The TTL index is still planned."""
    plan = plan_locks(600, {}, sharded=True)
    assert [(a.name, a.action) for a in plan] == [(KEY_INDEX, "unchanged"), (TTL_INDEX, "missing")]
    assert plan[0].description == SHARDED_KEY_DESC
    # A key index made before the collection was sharded is left as it is.
    kept = plan_locks(600, {KEY_INDEX: {"key": [("key", 1)], "unique": True}}, sharded=True)
    assert kept[0].description == "unique index on key"
    # On a replica set the index is wanted.
    assert plan_locks(600, {})[0].action == "missing"
