"""Running under a held lock: iterating a generator's body, finishing a coroutine, and
releasing afterwards (a failure to release is logged, never raised)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Generator, Iterable
from typing import Any

from django_mongolock.context import holding
from django_mongolock.exceptions import MongoLockError
from django_mongolock.lock import Lock

__all__ = ["arelease", "as_async_iterable", "finish", "iterate", "release"]

logger = logging.getLogger("django_mongolock.decorators")


def iterate(inner: Generator[Any, Any, Any], lock: Lock) -> Generator[Any, Any, Any]:
    """``yield from inner``, with ``lock`` the current lock only while the body runs."""
    sent: Any = None
    error: BaseException | None = None
    while True:
        try:
            with holding(lock):
                if error is None:
                    item = inner.send(sent)
                else:
                    item, error = inner.throw(error), None
        except StopIteration as stop:
            return stop.value
        try:
            sent = yield item
        except GeneratorExit:
            with holding(lock):
                inner.close()
            raise
        except BaseException as exc:  # thrown in by the caller: the body's to handle
            error = exc


async def as_async_iterable(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


async def finish(work: Awaitable[Any], lock: Lock, caller: str) -> Any:
    try:
        with holding(lock):
            return await work
    finally:
        await arelease(lock, caller)


async def arelease(lock: Lock, caller: str) -> None:
    """``release`` for coroutines, through the async client."""
    try:
        held = await lock.arelease()
    except MongoLockError:
        _release_failed(lock, caller)
        return
    if not held:
        _not_held(lock, caller)


def release(lock: Lock, caller: str) -> None:
    """Release after the call; a failure is logged, not raised: the lease ends by itself."""
    try:
        held = lock.release()
    except MongoLockError:
        _release_failed(lock, caller)
        return
    if not held:
        _not_held(lock, caller)


def _release_failed(lock: Lock, caller: str) -> None:
    logger.exception(
        "could not release lock %r (token %s) after %s(); it stays held until its lease ends at %s",
        lock.key,
        lock.token,
        caller,
        lock.expires_at.isoformat(),
    )


def _not_held(lock: Lock, caller: str) -> None:
    logger.warning(
        "lock %r (token %s) was no longer held when %s() returned", lock.key, lock.token, caller
    )
