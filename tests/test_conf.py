"""Settings, the default manager and the system checks."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from django.core import checks
from django.test import override_settings
from pytest_django.fixtures import Settings as SettingsWrapper

import django_mongolock
from django_mongolock import (
    ConfigurationError,
    Election,
    LockGroup,
    LockManager,
    Semaphore,
    conf,
    locked,
    locks,
    stats,
)
from django_mongolock.checks import check_server, check_settings
from django_mongolock.refresher import get_refresher
from django_mongolock.signals import lock_acquired
from tests.utils import ROOT


def _ids(messages: list[checks.CheckMessage]) -> list[str]:
    return sorted(str(message.id) for message in messages)


def test_defaults(settings: SettingsWrapper, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MONGOLOCK_URL", raising=False)
    settings.MONGOLOCK = {}
    current = conf.get_settings()
    assert current.url == "mongodb://localhost:27017/"
    assert current.url_source == "the default"
    assert (current.database, current.collection) == ("mongolock", "locks")
    assert (current.ttl, current.retention, current.refresh) == (30.0, 600, True)
    assert current.owner is None
    assert current.server_selection_timeout == 5.0
    assert check_settings() == []


def test_url_from_the_environment(
    settings: SettingsWrapper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MONGOLOCK_URL", "mongodb://db.example:27018/?replicaSet=rs")
    settings.MONGOLOCK = {"TTL": 12}
    current = conf.get_settings()
    assert current.url == "mongodb://db.example:27018/?replicaSet=rs"
    assert "MONGOLOCK_URL" in current.url_source
    settings.MONGOLOCK = {"URL": "mongodb://other:27017/"}
    assert conf.get_settings().url == "mongodb://other:27017/"


def test_settings_are_reread_when_overridden(mongolock_settings: dict[str, Any]) -> None:
    first = conf.get_manager()
    assert locks.database == mongolock_settings["DATABASE"]
    with override_settings(MONGOLOCK={**mongolock_settings, "TTL": 7.5}):
        second = conf.get_manager()
        assert second is not first
        assert second.ttl == 7.5
        assert locks.ttl == 7.5
    assert conf.get_manager().ttl == 30.0


def test_default_manager_works(mongolock_settings: dict[str, Any]) -> None:
    lock = locks.acquire("from-settings", ttl=5)
    assert isinstance(conf.get_manager(), LockManager)
    assert locks.status("from-settings") is not None
    assert lock.release()
    assert "default LockManager" in repr(locks)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"TTL": 0}, ["mongolock.E005"]),
        ({"TTL": -3}, ["mongolock.E005"]),
        ({"TTL": "30"}, ["mongolock.E005"]),
        ({"TTL": float("inf")}, ["mongolock.E005"]),
        ({"URL": "postgres://x"}, ["mongolock.E003"]),
        ({"URL": "mongodb://"}, ["mongolock.E003"]),
        ({"URL": 5}, ["mongolock.E003"]),
        ({"TIMEOUT": 3}, ["mongolock.E002"]),
        ({"DATABASE": "a.b"}, ["mongolock.E004"]),
        ({"COLLECTION": ""}, ["mongolock.E004"]),
        ({"RETENTION": -1}, ["mongolock.E006"]),
        ({"REFRESH": "yes"}, ["mongolock.E007"]),
        ({"OWNER": 3}, ["mongolock.E008"]),
        ({"SERVER_SELECTION_TIMEOUT": 0}, ["mongolock.E009"]),
        ({"STATS": "no"}, ["mongolock.E015"]),
        ({"SHARED_STREAM": 1}, ["mongolock.E016"]),
        (
            {"TTL": 0, "RETENTION": 1.5, "URLS": "x"},
            ["mongolock.E002", "mongolock.E005", "mongolock.E006"],
        ),
        ("mongodb://x", ["mongolock.E001"]),
    ],
)
def test_invalid_settings_are_reported(
    settings: SettingsWrapper, value: Any, expected: list[str]
) -> None:
    settings.MONGOLOCK = value
    messages = check_settings()
    assert _ids(messages) == expected
    assert all(isinstance(m, checks.Error) for m in messages)
    assert all(m.hint for m in messages)
    with pytest.raises(ConfigurationError, match="invalid MONGOLOCK settings"):
        conf.get_manager()


def test_stats_false_stops_recording_and_true_starts_again(
    mongolock_settings: dict[str, Any],
) -> None:
    assert stats.installed()  # the admin is loaded: every such process records
    manager = conf.get_manager()
    with override_settings(MONGOLOCK={**mongolock_settings, "STATS": False}):
        assert not stats.installed()
        off = conf.get_manager()
        off.acquire("stats-off", ttl=5).release()
        assert stats.get_recorder().pending(off) == 0
    assert stats.installed()
    manager = conf.get_manager()
    manager.acquire("stats-on", ttl=5).release()
    assert stats.get_recorder().pending(manager) >= 1  # two when a minute began meanwhile


def test_a_setting_change_records_nothing_where_the_admin_did_not(
    mongolock_settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that never loaded the admin (a program, a test run without it) records
    nothing because ``MONGOLOCK`` changed; only the admin turns the statistics on."""
    stats.uninstall()
    monkeypatch.setattr(conf, "_stats_applied", False)
    try:
        with override_settings(MONGOLOCK={**mongolock_settings, "STATS": True}):
            assert not stats.installed()
        assert not stats.installed()
    finally:
        stats.install()  # as the admin, loaded in this process, left it


def test_unknown_key_suggests_the_right_one(settings: SettingsWrapper) -> None:
    settings.MONGOLOCK = {"TTTL": 5}
    (message,) = check_settings()
    assert "'TTTL'" in message.msg
    assert "Did you mean 'TTL'?" in message.msg


def test_url_with_credentials_is_not_shown(settings: SettingsWrapper) -> None:
    settings.MONGOLOCK = {"URL": "mongodb://alice:s3cret@"}
    messages = check_settings()
    assert _ids(messages) == ["mongolock.E003", "mongolock.W003"]
    assert all("s3cret" not in message.msg for message in messages)


def test_checks_are_registered() -> None:
    registered = checks.registry.registry.get_checks(include_deployment_checks=True)
    assert check_settings in registered
    assert check_server in registered
    assert checks.Tags.database in check_server.tags


def test_server_check_runs_only_for_databases(mongolock_settings: dict[str, Any]) -> None:
    assert check_server(databases=None) == []
    assert _ids(check_server(databases=["default"])) == ["mongolock.W001"]
    locks.ensure_indexes()
    assert check_server(databases=["default"]) == []


def test_server_check_reports_changed_retention(
    mongolock_settings: dict[str, Any], settings: SettingsWrapper
) -> None:
    locks.ensure_indexes()
    settings.MONGOLOCK = {**mongolock_settings, "RETENTION": 30}
    messages = check_server(databases=["default"])
    # The locks' TTL index, and those of the heartbeats and the audit trail, which
    # follow RETENTION unless AUDIT_RETENTION says otherwise.
    assert {message.id for message in messages} == {"mongolock.W002"}
    assert len(messages) >= 1
    assert all("was 600" in message.msg for message in messages), messages


def test_server_check_reports_an_unreachable_server(settings: SettingsWrapper) -> None:
    settings.MONGOLOCK = {"URL": "mongodb://127.0.0.1:9/", "SERVER_SELECTION_TIMEOUT": 0.2}
    (message,) = check_server(databases=["default"])
    assert message.id == "mongolock.E010"
    assert "127.0.0.1:9" in message.msg


def test_server_check_reports_a_standalone_server(
    settings: SettingsWrapper, standalone: str
) -> None:
    settings.MONGOLOCK = {"URL": standalone}
    (message,) = check_server(databases=["default"])
    assert message.id == "mongolock.E011"
    assert "replica set" in message.msg


# -- the package's version -------------------------------------------------------------------


def test_version_is_the_installed_metadata() -> None:
    assert django_mongolock.__version__ == metadata.version("django-mongolock")


def test_version_follows_the_metadata_not_the_source(tmp_path: Path) -> None:
    """Metadata found first on the path (as a newer install would be) sets the version."""
    info = tmp_path / "django_mongolock-9.8.7.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: django-mongolock\nVersion: 9.8.7\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", "import django_mongolock; print(django_mongolock.__version__)"],
        cwd=tmp_path,
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "9.8.7"), done.stderr


def test_version_of_a_package_that_is_not_installed() -> None:
    assert django_mongolock._installed_version("django-mongolock-not-installed") == "0+unknown"


# -- the default manager, wherever a manager goes -------------------------------------------------


def test_default_manager_is_a_lock_manager() -> None:
    assert isinstance(locks, LockManager)


def test_importing_the_package_touches_no_settings_and_no_server() -> None:
    """``import django_mongolock`` and ``isinstance(locks, ...)`` work with no settings at all."""
    code = (
        "import django_mongolock as m\n"
        "assert isinstance(m.locks, m.LockManager)\n"
        "from django.conf import settings\n"
        "assert not settings.configured\n"
        "import sys\n"
        "assert 'django_mongolock.conf' not in sys.modules, 'conf imported'\n"
        "print(repr(m.locks))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "default LockManager" in done.stdout


def test_locked_accepts_the_default_manager(mongolock_settings: dict[str, Any]) -> None:
    @locked("with-default", manager=locks)
    def job() -> Any:
        return locks.status("with-default")

    info = job()
    assert info is not None
    assert info.owner
    assert locks.status("with-default") is None


def test_default_manager_given_at_import_follows_overridden_settings(
    mongolock_settings: dict[str, Any], mongolock_database: str
) -> None:
    """A decorator and a semaphore built on ``locks`` before ``MONGOLOCK`` changes use the
    new settings after it, and closing the old manager does not break them."""

    @locked("follows", manager=locks)
    def job() -> str:
        return conf.get_manager().database

    semaphore = Semaphore(locks, "pool", 2)
    assert job() == mongolock_database
    other_database = mongolock_database + "_other"
    try:
        with override_settings(MONGOLOCK={**mongolock_settings, "DATABASE": other_database}):
            assert job() == other_database
            with semaphore.acquire() as slot:
                assert conf.get_manager().store.collection.find_one({"_id": "pool"}) is not None
                assert slot.valid
            assert locks.database == other_database
    finally:
        conf.get_manager().client.drop_database(other_database)
    assert job() == mongolock_database


def test_closing_the_default_manager_starts_afresh(mongolock_settings: dict[str, Any]) -> None:
    first = conf.get_manager()
    with locks as manager:
        assert manager is locks
        manager.acquire("closing", ttl=5).release()
    assert first.closed
    assert not locks.closed
    assert conf.get_manager() is not first
    with locks.lock("closing", ttl=5) as lock:
        assert lock.valid


def test_default_manager_attributes_come_from_settings(mongolock_settings: dict[str, Any]) -> None:
    with pytest.raises(AttributeError, match=r"settings\.MONGOLOCK"):
        locks.ttl = 3
    assert locks.ttl == 30.0


def test_recipes_given_the_default_manager_hold_locks_of_the_real_one(
    mongolock_settings: dict[str, Any],
) -> None:
    """A group, a semaphore or an election built on the lazy ``locks`` takes locks of the
    manager the settings describe: that manager sends their signals, refreshes and
    releases them, as for ``locks.acquire``."""
    real = conf.get_manager()
    senders: list[object] = []

    def acquired(sender: object, **named: Any) -> None:
        senders.append(sender)

    lock_acquired.connect(acquired)
    # Its term's lock_acquired is sent on the election's worker, just before on_elected.
    announced = threading.Event()
    election = Election(locks, "lazy-leader", ttl=10, on_elected=lambda e: announced.set())
    try:
        with LockGroup.acquire(locks, ["lazy-a", "lazy-b"], ttl=10) as group:
            assert all(lock.backend is real for lock in group.locks.values())
        with Semaphore(locks, "lazy-pool", 2).acquire() as slot:
            assert slot.backend is real
        election.start()
        deadline = time.monotonic() + 10
        while not election.is_leader and time.monotonic() < deadline:
            time.sleep(0.05)
        assert election.is_leader
        assert announced.wait(10)
        assert get_refresher().lane_of(real) is not None
        assert get_refresher().lane_of(locks) is None  # no second lane for the proxy
    finally:
        election.stop()
        lock_acquired.disconnect(acquired)
    assert senders == [real] * 4  # two group locks, the slot, the term
