"""fenced_update and fenced_save on SQLite and PostgreSQL (each test runs on both)."""

from __future__ import annotations

from typing import Any, cast

import pytest
from django.contrib.auth.models import Group
from django.core.management import call_command
from django.db import IntegrityError, connections, models
from django.test.utils import CaptureQueriesContext, isolate_apps

from django_mongolock import LockLost, LockManager, StaleTokenError
from django_mongolock.fencing import FenceField, FenceKeyConflict, fenced_save, fenced_update
from django_mongolock.lock import Lock
from tests.fencingapp.models import Report


def older_and_newer(manager: LockManager, key: str) -> tuple[Lock, Lock]:
    """Two handles of one key, the second acquired after the first was released."""
    older = manager.acquire(key, ttl=30)
    older.release()
    newer = manager.acquire(key, ttl=30)
    assert newer.token > older.token
    return older, newer


def stored(alias: str, name: str = "daily") -> tuple[str, int | None, str | None]:
    row = Report.objects.using(alias).get(name=name)
    return row.body, row.fence, row.fence_key


@pytest.mark.django_db
def test_the_field_is_a_nullable_bigint_with_a_companion_key_column() -> None:
    field = Report._meta.get_field("fence")
    assert isinstance(field, FenceField)
    assert (field.null, field.default, field.editable) == (True, None, False)
    assert field.get_internal_type() == "BigIntegerField"
    companion = Report._meta.get_field("fence_key")
    assert (companion.null, companion.max_length) == (True, 1024)
    call_command("makemigrations", "fencingapp", "--check", "--dry-run", verbosity=0)
    with pytest.raises(ValueError, match="null=False"):
        FenceField(null=False)


@isolate_apps("tests.fencingapp")
def test_an_abstract_base_gives_each_concrete_child_its_key_column() -> None:
    class Base(models.Model):
        fence = FenceField()

        class Meta:
            abstract = True
            app_label = "fencingapp"

    class Child(Base):  # noqa: DJ008
        class Meta:
            app_label = "fencingapp"

    assert [f.name for f in Base._meta.fields] == ["fence"]
    assert [f.name for f in Child._meta.fields] == ["id", "fence", "fence_key"]


@isolate_apps("tests.fencingapp")
def test_a_model_with_two_fences_is_refused_before_any_query(manager: LockManager) -> None:
    class Twice(models.Model):  # noqa: DJ008
        fence = FenceField()
        other = FenceField()

        class Meta:
            app_label = "fencingapp"

    assert {f.name for f in Twice._meta.fields} >= {"fence_key", "other_key"}
    with pytest.raises(ValueError, match="2 FenceField"):
        fenced_update(Twice._default_manager.all(), manager.acquire("k", ttl=30), x=1)


def test_a_first_write_sets_the_fence_and_key_in_one_update(
    db_alias: str, manager: LockManager
) -> None:
    Report.objects.using(db_alias).create(name="daily", body="old")
    lk = manager.acquire("report", ttl=30)
    with CaptureQueriesContext(connections[db_alias]) as queries:
        assert (
            fenced_update(Report.objects.using(db_alias).filter(name="daily"), lk, body="new") == 1
        )
    assert len(queries) == 1
    sql = queries[0]["sql"]
    assert sql.startswith("UPDATE"), sql
    assert "IS NULL" in sql, sql
    assert "<=" in sql, sql
    assert stored(db_alias) == ("new", lk.token, "report")
    # The same token may write again (several writes in one acquisition).
    assert fenced_update(Report.objects.using(db_alias).filter(name="daily"), lk, body="again") == 1
    assert stored(db_alias) == ("again", lk.token, "report")


def test_an_older_token_is_refused_and_changes_nothing(db_alias: str, manager: LockManager) -> None:
    Report.objects.using(db_alias).create(name="daily", body="old")
    older, newer = older_and_newer(manager, "report")
    rows = Report.objects.using(db_alias).filter(name="daily")
    assert fenced_update(rows, newer, body="newer") == 1
    with pytest.raises(StaleTokenError) as caught:
        fenced_update(rows, older, body="older", edits=5)
    error = caught.value
    assert isinstance(error, LockLost)
    assert (error.key, error.token, error.fence) == ("report", older.token, newer.token)
    assert str(newer.token) in str(error)
    assert stored(db_alias) == ("newer", newer.token, "report")
    assert Report.objects.using(db_alias).get(name="daily").edits == 0


def test_a_lock_of_another_key_is_refused_even_with_a_greater_token(
    db_alias: str, manager: LockManager
) -> None:
    Report.objects.using(db_alias).create(name="daily")
    first = manager.acquire("report", ttl=30)
    rows = Report.objects.using(db_alias).filter(name="daily")
    assert fenced_update(rows, first, body="by report") == 1
    other = manager.acquire("another-key", ttl=30)
    assert other.token > first.token
    with pytest.raises(FenceKeyConflict) as caught:
        fenced_update(rows, other, body="by another")
    assert (caught.value.fence_key, caught.value.fence) == ("report", first.token)
    assert not isinstance(caught.value, LockLost)
    assert stored(db_alias) == ("by report", first.token, "report")


@pytest.mark.parametrize("near", ["Report", "report ", "REPORT"])
def test_keys_are_compared_byte_for_byte(db_alias: str, manager: LockManager, near: str) -> None:
    """A case-insensitive or space-padding collation (MySQL's default) must not merge keys."""
    Report.objects.using(db_alias).create(name="daily")
    first = manager.acquire("report", ttl=30)
    rows = Report.objects.using(db_alias).filter(name="daily")
    assert fenced_update(rows, first, body="by report") == 1
    other = manager.acquire(near, ttl=30)
    assert other.token > first.token
    with pytest.raises(FenceKeyConflict):
        fenced_update(rows, other, body="by a near key")
    assert stored(db_alias) == ("by report", first.token, "report")


def test_a_fence_without_a_key_is_compared_by_token_and_claimed(
    db_alias: str, manager: LockManager
) -> None:
    """Rows fenced by the hand-written recipe (a token, no key column) keep working."""
    older, newer = older_and_newer(manager, "report")
    Report.objects.using(db_alias).create(name="daily", body="recipe")
    rows = Report.objects.using(db_alias).filter(name="daily")
    rows.update(fence=newer.token)  # as the recipe left it: fence_key NULL
    with pytest.raises(StaleTokenError):
        fenced_update(rows, older, body="older")
    assert stored(db_alias) == ("recipe", newer.token, None)
    assert fenced_update(rows, newer, body="newer") == 1
    assert stored(db_alias) == ("newer", newer.token, "report")


def test_no_matching_rows_is_zero_not_an_error(db_alias: str, manager: LockManager) -> None:
    lk = manager.acquire("report", ttl=30)
    assert fenced_update(Report.objects.using(db_alias).filter(name="missing"), lk, body="x") == 0


def test_rows_a_newer_holder_wrote_are_skipped_in_a_multi_row_update(
    db_alias: str, manager: LockManager
) -> None:
    for name in ("a", "b", "c"):
        Report.objects.using(db_alias).create(name=name)
    older, newer = older_and_newer(manager, "report")
    reports = Report.objects.using(db_alias)
    assert fenced_update(reports.filter(name="b"), newer, body="newer") == 1
    assert fenced_update(reports.all(), older, body="older") == 2
    assert [stored(db_alias, n) for n in "abc"] == [
        ("older", older.token, "report"),
        ("newer", newer.token, "report"),
        ("older", older.token, "report"),
    ]


def test_a_lost_lock_nobody_took_since_still_writes(db_alias: str, manager: LockManager) -> None:
    Report.objects.using(db_alias).create(name="daily")
    lk = manager.acquire("report", ttl=30)
    assert manager.force_release("report") is not None
    with pytest.raises(LockLost):
        lk.refresh()
    assert not lk.valid
    rows = Report.objects.using(db_alias).filter(name="daily")
    assert fenced_update(rows, lk, body="late but unsuperseded") == 1
    newer = manager.acquire("report", ttl=30)
    assert fenced_update(rows, newer, body="newer") == 1
    with pytest.raises(StaleTokenError):
        fenced_update(rows, lk, body="superseded")
    assert stored(db_alias) == ("newer", newer.token, "report")


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda rows, lk: fenced_update(cast(Any, [rows]), lk, body="x"), TypeError, "QuerySet"),
        (lambda rows, lk: fenced_update(rows, cast(Any, "report"), body="x"), TypeError, "Lock"),
        (lambda rows, lk: fenced_update(rows, lk, fence=1), ValueError, "'fence'"),
        (lambda rows, lk: fenced_update(rows, lk, fence_key="k"), ValueError, "'fence_key'"),
        (lambda rows, lk: fenced_update(Group.objects.all(), lk, name="x"), ValueError, "0 Fence"),
        (lambda rows, lk: fenced_save(rows, lk), TypeError, "model instance"),
        (lambda rows, lk: fenced_save(Report(name="n"), lk, ["body"]), ValueError, "whole"),
        (lambda rows, lk: fenced_save(Report(name="n"), cast(Any, 7)), TypeError, "Lock"),
    ],
)
def test_bad_arguments_are_refused_before_any_query(
    db_alias: str, manager: LockManager, call: Any, error: type[Exception], match: str
) -> None:
    lk = manager.acquire("report", ttl=30)
    rows = Report.objects.using(db_alias).filter(name="daily")
    with CaptureQueriesContext(connections[db_alias]) as queries, pytest.raises(error, match=match):
        call(rows, lk)
    assert len(queries) == 0


def test_a_shared_lock_cannot_fence(db_alias: str, manager: LockManager) -> None:
    slot = manager.acquire("report", ttl=30, shared=True, limit=3)
    assert slot.shared
    with pytest.raises(ValueError, match="shared"):
        fenced_update(Report.objects.using(db_alias).all(), slot, body="x")


def test_fenced_save_inserts_a_new_row_with_the_fence(db_alias: str, manager: LockManager) -> None:
    lk = manager.acquire("report", ttl=30)
    report = Report(name="daily", body="first")
    with CaptureQueriesContext(connections[db_alias]) as queries:
        fenced_save(report, lk, using=db_alias)
    assert [q["sql"].split()[0] for q in queries if "INSERT" in q["sql"]] == ["INSERT"]
    assert report.pk is not None
    assert report._state.db == db_alias
    assert stored(db_alias) == ("first", lk.token, "report")
    assert (report.fence, report.fence_key) == (lk.token, "report")


def test_fenced_save_on_an_alias(db_alias: str, manager: LockManager) -> None:
    older, newer = older_and_newer(manager, "report")
    mine = Report(name="daily", body="first")
    mine.save(using=db_alias)
    theirs = Report.objects.using(db_alias).get(name="daily")
    mine.body, mine.edits = "older's", 1
    fenced_save(mine, older, update_fields=["body"])
    assert stored(db_alias) == ("older's", older.token, "report")
    assert Report.objects.using(db_alias).get(name="daily").edits == 0  # not in update_fields
    theirs.body = "newer's"
    fenced_save(theirs, newer)
    assert (theirs.fence, theirs.fence_key) == (newer.token, "report")
    mine.body = "older's again"
    with pytest.raises(StaleTokenError):
        fenced_save(mine, older)
    assert mine.fence == older.token
    assert stored(db_alias) == ("newer's", newer.token, "report")
    with pytest.raises(ValueError, match="'fence'"):
        fenced_save(mine, newer, update_fields=["fence"])
    with pytest.raises(ValueError, match="'nope'"):
        fenced_save(mine, newer, update_fields=["nope"])
    Report.objects.using(db_alias).filter(name="daily").delete()
    with pytest.raises(Report.DoesNotExist):
        fenced_save(theirs, newer)


def test_two_creators_of_one_row_race_on_the_unique_constraint(
    db_alias: str, manager: LockManager
) -> None:
    older, newer = older_and_newer(manager, "report")
    winner = Report(name="daily", body="winner")
    fenced_save(winner, newer, using=db_alias)
    loser = Report(name="daily", body="loser")
    with pytest.raises(IntegrityError):
        fenced_save(loser, older, using=db_alias)
    assert loser.pk is None
    assert (loser.fence, loser.fence_key) == (None, None)
    rows = Report.objects.using(db_alias).filter(name="daily")
    with pytest.raises(StaleTokenError):
        fenced_update(rows, older, body="loser")
    assert stored(db_alias) == ("winner", newer.token, "report")
