"""fenced_update across tables: multi-table inheritance refused, joins fenced on the row written.

Each test runs on SQLite, PostgreSQL and MariaDB.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext

from django_mongolock import LockManager, StaleTokenError
from django_mongolock.fencing import fenced_save, fenced_update
from django_mongolock.lock import Lock
from tests.fencingapp.models import ArchiveCopy, Entry, Memo, Team

WAIT = 20.0  # seconds: the bound on every wait below


def older_and_newer(manager: LockManager, key: str = "report") -> tuple[Lock, Lock]:
    older = manager.acquire(key, ttl=30)
    older.release()
    newer = manager.acquire(key, ttl=30)
    assert newer.token > older.token
    return older, newer


def test_a_child_whose_fence_is_on_the_parent_table_is_refused(
    db_alias: str, manager: LockManager
) -> None:
    copy = ArchiveCopy.objects.using(db_alias).create(name="d", body="old", extra="old")
    lk = manager.acquire("report", ttl=30)
    rows = ArchiveCopy.objects.using(db_alias).filter(name="d")
    with CaptureQueriesContext(connections[db_alias]) as queries:
        with pytest.raises(ValueError, match=r"fencingapp\.ArchiveCopy.*fencingapp\.Archive"):
            fenced_update(rows, lk, extra="new")
        with pytest.raises(ValueError, match="parent"):
            fenced_update(rows, lk, body="new")
        copy.body, copy.extra = "new", "new"
        with pytest.raises(ValueError, match=r"fencingapp\.ArchiveCopy"):
            fenced_save(copy, lk)
    assert len(queries) == 0
    row = ArchiveCopy.objects.using(db_alias).values_list("body", "extra", "fence").get(name="d")
    assert row[:2] == ("old", "old")
    assert row[2] is None


def test_a_child_fenced_on_its_own_table_writes_only_that_table(
    db_alias: str, manager: LockManager
) -> None:
    memo = Memo.objects.using(db_alias).create(title="t", body="old")
    older, newer = older_and_newer(manager)
    by_pk = Memo.objects.using(db_alias).filter(pk=memo.pk)
    with CaptureQueriesContext(connections[db_alias]) as queries:
        assert fenced_update(by_pk, newer, body="newer") == 1
    assert len(queries) == 1
    with pytest.raises(ValueError, match=r"fencingapp\.Note"):
        fenced_update(by_pk, newer, title="changed")
    memo.title, memo.body = "changed", "saved"
    with pytest.raises(ValueError, match=r"fencingapp\.Memo"):
        fenced_save(memo, newer)
    fenced_save(memo, newer, update_fields=["body"])
    assert Memo.objects.using(db_alias).values_list("title", "body").get() == ("t", "saved")
    # Filtered by the parent's column: a join, fenced on the child's row all the same.
    by_title = Memo.objects.using(db_alias).filter(title="t")
    with pytest.raises(StaleTokenError):
        fenced_update(by_title, older, body="older")
    assert fenced_update(by_title, newer, body="again") == 1
    row = Memo.objects.using(db_alias).values("title", "body", "fence").get(pk=memo.pk)
    assert row == {"title": "t", "body": "again", "fence": newer.token}


def test_a_join_filtered_update_sends_the_fence_in_the_update_itself(
    db_alias: str, manager: LockManager
) -> None:
    team = Team.objects.using(db_alias).create(name="acme")
    Entry.objects.using(db_alias).create(name="d", team=team)
    lk = manager.acquire("report", ttl=30)
    rows = Entry.objects.using(db_alias).filter(team__name="acme")
    with CaptureQueriesContext(connections[db_alias]) as queries:
        assert fenced_update(rows, lk, body="new") == 1
    update = [q["sql"] for q in queries if q["sql"].startswith("UPDATE")]
    assert len(update) == 1
    where = update[0].split("WHERE", 1)[1]
    assert "<=" in where, update[0]
    assert "SELECT" not in where, update[0]
    assert fenced_update(Entry.objects.using(db_alias).filter(team__name="none"), lk, body="x") == 0


def _blocked(alias: str) -> bool:
    """Whether a statement on the test's database waits for a row lock (server side)."""
    vendor = connections[alias].vendor
    if vendor == "postgresql":
        sql = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    elif vendor == "mysql":
        sql = "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
    else:
        raise AssertionError(vendor)
    with connections[alias].cursor() as cursor:
        cursor.execute(sql)
        return bool(cursor.fetchone()[0])


def test_a_join_filtered_stale_write_waiting_on_a_newer_one_is_refused(
    db_alias: str, manager: LockManager
) -> None:
    """A stale holder's join-filtered write, blocked on a newer holder's open transaction,
    is refused when that transaction commits: the fence is checked on the row written."""
    team = Team.objects.using(db_alias).create(name="acme")
    entry = Entry.objects.using(db_alias).create(name="d", team=team)
    older, newer = older_and_newer(manager)
    assert fenced_update(Entry.objects.using(db_alias).filter(pk=entry.pk), older, body="A1")
    newer_wrote, commit = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def newer_holder() -> None:
        try:
            with transaction.atomic(using=db_alias):
                rows = Entry.objects.using(db_alias).filter(pk=entry.pk)
                outcome["newer"] = fenced_update(rows, newer, body="B")
                newer_wrote.set()
                assert commit.wait(2 * WAIT)
        finally:
            newer_wrote.set()
            connections[db_alias].close()

    sending = threading.Event()

    def note_update(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.startswith("UPDATE"):
            sending.set()
        return execute(sql, params, many, context)

    def stale_holder() -> None:
        try:
            with connections[db_alias].execute_wrapper(note_update):
                rows = Entry.objects.using(db_alias).filter(team__name="acme")
                outcome["older"] = fenced_update(rows, older, body="A-stale")
        except Exception as error:  # the outcome under test
            outcome["older"] = error
        finally:
            sending.set()
            connections[db_alias].close()

    b = threading.Thread(target=newer_holder)
    b.start()
    assert newer_wrote.wait(WAIT)
    a = threading.Thread(target=stale_holder)
    a.start()
    try:
        assert sending.wait(WAIT)
        if connections[db_alias].vendor != "sqlite":
            deadline = time.monotonic() + WAIT
            while not _blocked(db_alias):
                assert time.monotonic() < deadline, f"the stale write never waited: {outcome}"
                # InnoDB refreshes its innodb_trx snapshot only when it was left unread for
                # 0.1 s: a faster poll would read the same stale snapshot for ever.
                time.sleep(0.25)
    finally:
        commit.set()
        b.join(WAIT)
        a.join(WAIT)
    assert not a.is_alive()
    assert not b.is_alive()
    assert outcome["newer"] == 1
    assert isinstance(outcome["older"], StaleTokenError), outcome["older"]
    row = Entry.objects.using(db_alias).values("body", "fence").get(pk=entry.pk)
    assert row == {"body": "B", "fence": newer.token}
