"""What a recipe needs of the manager that hands it out: its defaults and public calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from django_mongolock import acquiring
from django_mongolock.acquirer import Request
from django_mongolock.context import LockContext
from django_mongolock.lock import Lock
from django_mongolock.validation import validate_key, validate_ttl

__all__ = ["LockSource", "tagged_request"]


class LockSource(acquiring.Source, Protocol):
    """What the recipes need of a ``LockManager``: its defaults and its public calls."""

    @property
    def ttl(self) -> float: ...
    @property
    def refresh(self) -> bool: ...

    def new_owner(self) -> str: ...

    def _resolved(self) -> LockSource: ...

    def acquire(
        self,
        key: str,
        *,
        ttl: float | None = ...,
        blocking: bool = ...,
        timeout: float | None = ...,
        shared: bool = ...,
        limit: int | None = ...,
        on_lost: Callable[[Lock], object] | None = ...,
        refresh: bool | None = ...,
    ) -> Lock: ...

    def lock(
        self,
        key: str,
        *,
        ttl: float | None = ...,
        blocking: bool = ...,
        timeout: float | None = ...,
        shared: bool = ...,
        limit: int | None = ...,
    ) -> LockContext: ...

    def leader(self, key: str) -> str | None: ...


def tagged_request(
    source: LockSource, key: str, ttl: float | None, tag: str, value: str
) -> Request:
    """An exclusive request of a recipe, tagged with what it belongs to (shown to operators)."""
    lease = source.ttl if ttl is None else validate_ttl(ttl)
    return Request(validate_key(key), source.new_owner(), lease, tags={tag: value})
