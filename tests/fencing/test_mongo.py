"""fenced_update_one on the session's MongoDB replica set."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, cast

import pytest
from pymongo import MongoClient
from pymongo.collection import Collection
from pymongo.errors import DuplicateKeyError

from django_mongolock import LockLost, LockManager, StaleTokenError
from django_mongolock.fencing import FenceKeyConflict, fenced_update_one
from django_mongolock.lock import Lock


@pytest.fixture
def reports(mongolock_url: str, manager: LockManager) -> Iterator[Collection[dict[str, Any]]]:
    """A collection beside the test's locks, with its own client (the resource's)."""
    client: MongoClient[dict[str, Any]] = MongoClient(mongolock_url, serverSelectionTimeoutMS=10000)
    with client:
        yield client[manager.database]["reports"]


def older_and_newer(manager: LockManager, key: str = "report") -> tuple[Lock, Lock]:
    older = manager.acquire(key, ttl=30)
    older.release()
    newer = manager.acquire(key, ttl=30)
    assert newer.token > older.token
    return older, newer


def test_a_first_write_sets_the_fence_and_a_newer_token_wins(
    reports: Collection[dict[str, Any]], manager: LockManager
) -> None:
    reports.insert_one({"_id": "daily", "body": "old"})
    older, newer = older_and_newer(manager)
    result = fenced_update_one(reports, {"_id": "daily"}, {"$set": {"body": "older"}}, older)
    assert (result.matched_count, result.modified_count) == (1, 1)
    assert fenced_update_one(reports, {"_id": "daily"}, {"$set": {"body": "again"}}, older)
    result = fenced_update_one(
        reports, {"_id": "daily"}, {"$set": {"body": "newer"}, "$inc": {"edits": 1}}, newer
    )
    assert result.modified_count == 1
    with pytest.raises(StaleTokenError) as caught:
        fenced_update_one(reports, {"_id": "daily"}, {"$set": {"body": "late"}}, older)
    assert isinstance(caught.value, LockLost)
    assert (caught.value.token, caught.value.fence) == (older.token, newer.token)
    assert reports.find_one({"_id": "daily"}) == {
        "_id": "daily",
        "body": "newer",
        "edits": 1,
        "fence": newer.token,
        "fence_key": "report",
    }


def test_an_upsert_creates_once_and_a_refused_one_adds_no_duplicate(
    reports: Collection[dict[str, Any]], manager: LockManager
) -> None:
    older, newer = older_and_newer(manager)
    result = fenced_update_one(
        reports, {"_id": "daily"}, {"$set": {"body": "newer"}}, newer, upsert=True
    )
    assert result.upserted_id == "daily"
    with pytest.raises(StaleTokenError) as caught:
        fenced_update_one(
            reports, {"_id": "daily"}, {"$set": {"body": "older"}}, older, upsert=True
        )
    assert isinstance(caught.value.__context__, DuplicateKeyError)
    assert list(reports.find()) == [
        {"_id": "daily", "body": "newer", "fence": newer.token, "fence_key": "report"}
    ]


def test_a_custom_field_and_a_missing_document(
    reports: Collection[dict[str, Any]], manager: LockManager
) -> None:
    lk = manager.acquire("report", ttl=30)
    missing = fenced_update_one(reports, {"_id": "none"}, {"$set": {"body": "x"}}, lk)
    assert (missing.matched_count, missing.upserted_id) == (0, None)
    reports.insert_one({"_id": "daily", "body": "old", "fence": None})
    fenced_update_one(reports, {"_id": "daily"}, {"$set": {"body": "new"}}, lk, field="ver")
    doc = reports.find_one({"_id": "daily"})
    assert doc is not None
    assert (doc["body"], doc["ver"], doc["ver_key"], doc["fence"]) == (
        "new",
        lk.token,
        "report",
        None,
    )


def test_a_lock_of_another_key_is_refused(
    reports: Collection[dict[str, Any]], manager: LockManager
) -> None:
    first = manager.acquire("report", ttl=30)
    fenced_update_one(reports, {"_id": "daily"}, {"$set": {"body": "one"}}, first, upsert=True)
    other = manager.acquire("another-key", ttl=30)
    with pytest.raises(FenceKeyConflict) as caught:
        fenced_update_one(reports, {"_id": "daily"}, {"$set": {"body": "two"}}, other)
    assert (caught.value.fence_key, caught.value.fence) == ("report", first.token)
    with pytest.raises(FenceKeyConflict):
        fenced_update_one(reports, {"_id": "daily"}, {"$set": {"body": "two"}}, other, upsert=True)
    assert reports.count_documents({}) == 1
    assert reports.find_one({"_id": "daily"}, {"_id": 0, "body": 1}) == {"body": "one"}


def test_a_fence_without_a_key_is_compared_by_token_and_claimed(
    reports: Collection[dict[str, Any]], manager: LockManager
) -> None:
    older, newer = older_and_newer(manager)
    reports.insert_one({"_id": "daily", "body": "recipe", "fence": newer.token})
    with pytest.raises(StaleTokenError):
        fenced_update_one(reports, {"_id": "daily"}, {"$set": {"body": "older"}}, older)
    with pytest.raises(StaleTokenError):
        fenced_update_one(
            reports, {"_id": "daily"}, {"$set": {"body": "older"}}, older, upsert=True
        )
    fenced_update_one(reports, {"_id": "daily"}, {"$set": {"body": "newer"}}, newer)
    assert list(reports.find()) == [
        {"_id": "daily", "body": "newer", "fence": newer.token, "fence_key": "report"}
    ]


def test_a_lost_lock_nobody_took_since_still_writes(
    reports: Collection[dict[str, Any]], manager: LockManager
) -> None:
    lk = manager.acquire("report", ttl=30)
    assert manager.force_release("report") is not None
    with pytest.raises(LockLost):
        lk.refresh()
    result = fenced_update_one(reports, {"_id": "d"}, {"$set": {"b": 1}}, lk, upsert=True)
    assert result.upserted_id == "d"


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("reports", {"_id": 1}, {"$set": {"b": 1}}), {}, TypeError, "Collection"),
        ((None, [("_id", 1)], {"$set": {"b": 1}}), {}, TypeError, "filter"),
        ((None, {"_id": 1}, [{"$set": {"b": 1}}]), {}, TypeError, "pipeline"),
        ((None, {"_id": 1}, {"b": 1}), {}, ValueError, "replacement"),
        ((None, {"_id": 1}, {}), {}, ValueError, "empty"),
        ((None, {"_id": 1}, {"$set": {"fence": 1}}), {}, ValueError, "'fence'"),
        ((None, {"_id": 1}, {"$unset": {"fence_key": ""}}), {}, ValueError, "'fence_key'"),
        ((None, {"_id": 1}, {"$set": {"fence.x": 1}}), {}, ValueError, "'fence.x'"),
        ((None, {"name": "d"}, {"$set": {"b": 1}}), {"upsert": True}, ValueError, "_id"),
        ((None, {"_id": {"$in": ["d"]}}, {"$set": {"b": 1}}), {"upsert": True}, ValueError, "_id"),
        ((None, {"_id": {"$gte": "d"}}, {"$set": {"b": 1}}), {"upsert": True}, ValueError, "_id"),
        (
            (None, {"_id": {"$eq": {"$in": [1]}}}, {"$set": {"b": 1}}),
            {"upsert": True},
            ValueError,
            "_id",
        ),
        (
            (None, {"_id": {"$eq": 1, "$ne": 2}}, {"$set": {"b": 1}}),
            {"upsert": True},
            ValueError,
            "_id",
        ),
        ((None, {"_id": re.compile("d")}, {"$set": {"b": 1}}), {"upsert": True}, ValueError, "_id"),
        ((None, {"_id": 1}, {"$set": {"b": 1}}), {"upsert": 1}, TypeError, "upsert"),
        ((None, {"_id": 1}, {"$set": {"b": 1}}), {"field": "$f"}, ValueError, "field"),
        ((None, {"_id": 1}, {"$set": {"b": 1}}), {"field": 3}, TypeError, "field"),
        ((None, {"_id": 1}, {"$set": 5}), {}, TypeError, r"\$set"),
    ],
)
def test_bad_arguments_are_refused_and_nothing_is_written(
    reports: Collection[dict[str, Any]],
    manager: LockManager,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    lk = manager.acquire("report", ttl=30)
    collection = args[0] if args[0] is not None else reports
    call = cast(Any, fenced_update_one)
    with pytest.raises(error, match=match):
        call(collection, args[1], args[2], lk, **kwargs)
    with pytest.raises(TypeError, match="Lock"):
        call(reports, {"_id": 1}, {"$set": {"b": 1}}, "report")
    assert reports.count_documents({}) == 0


@pytest.mark.parametrize("match", [{"$in": ["daily", "other"]}, {"$gte": "daily"}])
def test_an_upsert_by_a_non_equality_id_is_refused_before_any_write(
    reports: Collection[dict[str, Any]], manager: LockManager, match: dict[str, Any]
) -> None:
    """A refused match must not fall through to an insert of a new document."""
    older, newer = older_and_newer(manager)
    fenced_update_one(reports, {"_id": "daily"}, {"$set": {"body": "newer"}}, newer, upsert=True)
    with pytest.raises(ValueError, match="equality"):
        fenced_update_one(reports, {"_id": match}, {"$set": {"body": "older"}}, older, upsert=True)
    assert list(reports.find()) == [
        {"_id": "daily", "body": "newer", "fence": newer.token, "fence_key": "report"}
    ]


def test_an_upsert_by_an_eq_id_inserts_once_and_is_fenced(
    reports: Collection[dict[str, Any]], manager: LockManager
) -> None:
    older, newer = older_and_newer(manager)
    by_eq = {"_id": {"$eq": "daily"}}
    result = fenced_update_one(reports, by_eq, {"$set": {"body": "newer"}}, newer, upsert=True)
    assert result.upserted_id == "daily"
    with pytest.raises(StaleTokenError):
        fenced_update_one(reports, by_eq, {"$set": {"body": "older"}}, older, upsert=True)
    assert reports.count_documents({}) == 1


@pytest.mark.parametrize("odd", [[0, 10**18], [None], "1", {"t": 1}])
@pytest.mark.parametrize("upsert", [False, True])
def test_a_fence_that_is_not_a_number_is_never_written(
    reports: Collection[dict[str, Any]], manager: LockManager, odd: Any, upsert: bool
) -> None:
    """An array passed ``$lte`` (and ``null``) on one element: only a number is compared."""
    reports.insert_one({"_id": "daily", "body": "old", "fence": odd})
    lk = manager.acquire("report", ttl=30)
    with pytest.raises(ValueError, match="not a number"):
        fenced_update_one(reports, {"_id": "daily"}, {"$set": {"body": "x"}}, lk, upsert=upsert)
    assert list(reports.find()) == [{"_id": "daily", "body": "old", "fence": odd}]
