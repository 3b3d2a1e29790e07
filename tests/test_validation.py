"""Bad input is refused with a clear error before any query reaches the server."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from django_mongolock import LockManager
from django_mongolock.validation import MAX_KEY_BYTES


@pytest.fixture
def offline() -> Iterator[LockManager]:
    """A manager whose server does not exist: any query would raise ServerUnavailable."""
    with LockManager("mongodb://127.0.0.1:9/", server_selection_timeout=0.2) as manager:
        yield manager


BAD_KEYS: list[tuple[Any, type[Exception], str]] = [
    (None, TypeError, "must be a str"),
    (b"bytes", TypeError, "must be a str"),
    (42, TypeError, "must be a str"),
    ({"$ne": ""}, TypeError, "must be a str"),
    (["a"], TypeError, "must be a str"),
    ("", ValueError, "must not be empty"),
    ("a\x00b", ValueError, "NUL"),
    ("x" * (MAX_KEY_BYTES + 1), ValueError, "bytes of UTF-8"),
    ("é" * (MAX_KEY_BYTES // 2 + 1), ValueError, "bytes of UTF-8"),
    ("\ud800", ValueError, "UTF-8"),
]


@pytest.mark.parametrize(("key", "error", "message"), BAD_KEYS)
def test_bad_keys_are_refused_before_any_query(
    offline: LockManager, key: Any, error: type[Exception], message: str
) -> None:
    for call in (
        lambda: offline.acquire(key),
        lambda: offline.lock(key),
        lambda: offline.status(key),
        lambda: offline.force_release(key),
    ):
        with pytest.raises(error, match=message):
            call()


BAD_TTLS: list[tuple[Any, type[Exception]]] = [
    (0, ValueError),
    (-1, ValueError),
    (math.inf, ValueError),
    (math.nan, ValueError),
    (0.0001, ValueError),
    (1e12, ValueError),
    ("30", TypeError),
    (True, TypeError),
    (None, TypeError),
]


@pytest.mark.parametrize(("ttl", "error"), BAD_TTLS[:-1])
def test_bad_ttls_are_refused(offline: LockManager, ttl: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="ttl"):
        offline.acquire("k", ttl=ttl)
    with pytest.raises(error, match="ttl"):
        offline.lock("k", ttl=ttl)


@pytest.mark.parametrize(("ttl", "error"), BAD_TTLS)
def test_bad_manager_ttl_is_refused(ttl: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="ttl"):
        LockManager("mongodb://127.0.0.1:9/", ttl=ttl)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"timeout": -1}, ValueError, ">= 0"),
        ({"timeout": math.inf}, ValueError, "finite"),
        ({"timeout": math.nan}, ValueError, "finite"),
        ({"timeout": "5"}, TypeError, "number"),
        ({"timeout": 1, "blocking": False}, ValueError, "blocking=False"),
        ({"timeout": 0, "blocking": False}, ValueError, "blocking=False"),
        ({"blocking": "yes"}, TypeError, "blocking"),
        ({"blocking": None}, TypeError, "blocking"),
        ({"refresh": "yes"}, TypeError, "refresh"),
    ],
)
def test_bad_timeouts_are_refused(
    offline: LockManager, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        offline.acquire("k", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"retention": -1}, ValueError),
        ({"retention": 1.5}, ValueError),
        ({"refresh": "no"}, TypeError),
        ({"server_selection_timeout": 0}, ValueError),
        ({"database": "a.b"}, ValueError),
        ({"database": ""}, ValueError),
        ({"collection": "$x"}, ValueError),
        ({"owner": ""}, ValueError),
        ({"url": b"mongodb://x"}, TypeError),
    ],
)
def test_bad_manager_arguments(kwargs: dict[str, Any], error: type[Exception]) -> None:
    kwargs.setdefault("url", "mongodb://127.0.0.1:9/")
    with pytest.raises(error):
        LockManager(**kwargs)


def test_url_and_client_are_exclusive() -> None:
    from pymongo import MongoClient

    client: MongoClient[Any] = MongoClient("mongodb://127.0.0.1:9/", connect=False)
    try:
        with pytest.raises(ValueError, match="either url or client"):
            LockManager("mongodb://127.0.0.1:9/", client=client)
    finally:
        client.close()


def test_bad_listing_arguments(offline: LockManager) -> None:
    with pytest.raises(ValueError, match="limit"):
        offline.list(limit=-1)
    with pytest.raises(ValueError, match="offset"):
        offline.list(offset=-5)
    with pytest.raises(TypeError, match="token"):
        offline.force_release("k", token="7")  # type: ignore[arg-type]


def test_good_keys_at_the_limits_are_accepted(manager: LockManager) -> None:
    for key in ("x" * MAX_KEY_BYTES, "é" * (MAX_KEY_BYTES // 2), "$ne", "a.b", "🔒 ünïcode"):
        lock = manager.acquire(key, blocking=False)
        assert lock.key == key
        status = manager.status(key)
        assert status is not None
        assert status.key == key
        assert status.token == lock.token
        assert lock.release()
