"""What a call answers when its lock is busy: who holds it, for how long, and the reply
of a view (423 Locked with Retry-After)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from django_mongolock.exceptions import LockNotAcquired, MongoLockError
from django_mongolock.manager import LockManager
from django_mongolock.terminal import printable, timestamp

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponse

__all__ = ["BusyHolder", "describe_holder", "find_holder", "http_response", "locked_response"]


@dataclass(frozen=True, slots=True)
class BusyHolder:
    """Who holds a busy lock and for how long, by the server's clock when it could say."""

    owner: str | None
    expires_at: datetime | None
    remaining: float


def find_holder(manager: LockManager, error: LockNotAcquired) -> BusyHolder:
    """The current holder and its remaining lease, read from the server."""
    try:
        info = manager.status(error.key)
    except MongoLockError:
        # The server answered the acquire a moment ago but not this read: estimate by this
        # machine's clock; the result is advice for the caller, never a lock decision.
        left = 0.0
        if error.expires_at is not None:
            left = (error.expires_at - datetime.now(UTC)).total_seconds()
        return BusyHolder(error.holder, error.expires_at, max(left, 0.0))
    if info is None or not info.live:
        return BusyHolder(error.holder, error.expires_at, 0.0)  # released since
    return BusyHolder(info.owner, info.expires_at, max(info.remaining, 0.0))


def describe_holder(key: str, holder: BusyHolder) -> str:
    """``lock 'k' is held by host:pid:x until 2026-01-31 12:00:00 UTC (in 12s)``."""
    text = f"lock {key!r} is held"
    if holder.owner:
        text += f" by {printable(holder.owner)}"
    if holder.expires_at is not None:
        text += f" until {timestamp(holder.expires_at)}"
    return text + f" (in {math.ceil(holder.remaining)}s)"


def http_response(content: bytes | str, **kwargs: Any) -> HttpResponse:
    from django.http import HttpResponse

    return HttpResponse(content, **kwargs)


def locked_response(request: HttpRequest, key: str, holder: BusyHolder) -> HttpResponse:
    """423 Locked with Retry-After; the holder's id (host and pid) is not told to clients."""
    from django.http import JsonResponse
    from django.utils.cache import add_never_cache_headers

    retry_after = max(1, math.ceil(holder.remaining))
    detail = f"{key} is busy; retry in {retry_after}s."
    response: HttpResponse
    if request.get_preferred_type(["text/plain", "application/json"]) == "application/json":
        body = {"detail": detail, "key": key, "retry_after": retry_after}
        response = JsonResponse(body, status=423)
    else:
        response = http_response(
            detail + "\n", status=423, content_type="text/plain; charset=utf-8"
        )
    response["Retry-After"] = str(retry_after)
    add_never_cache_headers(response)
    return response
