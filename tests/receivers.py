"""``lock_acquired`` receivers that end a lock before its acquisition is told."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import pytest

from django_mongolock import Lock, LockLost, LockManager
from django_mongolock.signals import lock_acquired

End = Literal["lost", "released"]


@contextlib.contextmanager
def ending_when_acquired(other: LockManager, key: str, end: End) -> Iterator[None]:
    """Inside, a receiver ends each lock of ``key`` as soon as it is taken: ``released``
    by its holder, or ``lost`` (force-released by ``other``, which the holder's refresh
    then learns). Receivers run before the acquisition's event, so the end comes first."""

    def receiver(sender: object, lock: Lock, **kwargs: object) -> None:
        if lock.key != key:
            return
        if end == "released":
            assert lock.release()
            return
        other.force_release(key)
        with pytest.raises(LockLost):
            lock.refresh()

    lock_acquired.connect(receiver)
    try:
        yield
    finally:
        lock_acquired.disconnect(receiver)
