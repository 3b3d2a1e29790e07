"""Errors cross processes whole: process pools pickle them, Celery stores their args."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime

import pytest
from celery import Celery
from celery.backends.base import Backend
from kombu.utils.json import dumps, loads

from django_mongolock.exceptions import (
    ConfigurationError,
    FenceKeyConflict,
    LimitConflict,
    LineFull,
    LockLost,
    LockNotAcquired,
    MongoLockError,
    ReplicaSetRequired,
    ServerUnavailable,
    StaleTokenError,
)

ERRORS = [
    MongoLockError("plain"),
    ConfigurationError("bad settings"),
    LockNotAcquired("k", "web-1:42:7", datetime(2026, 1, 2, tzinfo=UTC), waited=1.5, waiting=3),
    LineFull("k", 1000, "waiters"),
    LimitConflict("k", 3, 4),
    LockLost("k", "web-1:42:7", 17, "it was force-released"),
    StaleTokenError("k", "web-1:42:7", 17, 18),
    FenceKeyConflict("k", 17, "other", 5),
    ReplicaSetRequired(["db1:27017"]),
    ServerUnavailable(["db1:27017"], 5.0, "timed out"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_an_error_survives_pickling_with_its_class_message_and_attributes(
    error: MongoLockError,
) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.args == error.args
    assert vars(copy) == vars(error)


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_an_error_is_rebuilt_from_its_args(error: MongoLockError) -> None:
    copy = type(error)(*error.args)
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_celery_json_results_bring_an_error_back_whole(error: MongoLockError) -> None:
    """Celery's JSON result keeps an error's class and args; it rebuilds it as ``cls(*args)``."""
    backend = Backend(Celery(set_as_current=False), serializer="json")
    stored = backend.prepare_exception(error)
    stored = loads(dumps(stored))  # type: ignore[no-untyped-call]  # kombu's JSON, as stored
    copy = backend.exception_to_python(stored)
    assert type(copy) is type(error)
    assert str(copy) == str(error)
