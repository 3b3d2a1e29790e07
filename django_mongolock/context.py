"""The code a lock protects: which lock it holds, and stopping it when the lock is lost.

``current_lock()`` is the lock the running code holds through ``@locked``: a context
variable rather than a thread-local, so each coroutine (asyncio task) sees its own lock,
and code run through ``asgiref``'s ``sync_to_async``/``async_to_sync`` or
``asyncio.to_thread`` (which copy the context) sees the caller's.

``CancelOnLoss`` cancels the task running an ``async with locks.alock(key,
cancel_on_loss=True)`` block the moment its lock is lost, as ``asyncio.timeout`` does at
its deadline, and turns that cancellation into LockLost when the block ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Protocol

from django_mongolock.exceptions import LockLost, MongoLockError
from django_mongolock.lock import Lock

__all__ = ["CancelOnLoss", "LockContext", "current_lock", "holding"]

logger = logging.getLogger("django_mongolock.manager")


class _Acquires(Protocol):
    """Whoever a lock context takes its lock from (a ``LockManager``)."""

    def acquire(self, key: str, *args: Any, **kwargs: Any) -> Lock: ...

    async def aacquire(self, key: str, *args: Any, **kwargs: Any) -> Lock: ...


# A tuple, never mutated: nested @locked calls push a new tuple, so a context copied
# into another thread or task cannot be changed under it.
_held: ContextVar[tuple[Lock, ...]] = ContextVar("django_mongolock_held", default=())


def current_lock() -> Lock | None:
    """The innermost lock held by ``@locked`` code in this context, or None outside it.

    A thread started by ``threading.Thread`` begins with an empty context: pass the lock
    to it, or run it with ``contextvars.copy_context().run``.
    """
    held = _held.get()
    return held[-1] if held else None


@contextmanager
def holding(lock: Lock) -> Iterator[Lock]:
    """Make ``lock`` the current lock for the duration of the block."""
    reset = _held.set((*_held.get(), lock))
    try:
        yield lock
    finally:
        _held.reset(reset)


class CancelOnLoss:
    """Cancel the current task when ``lock`` is lost; ``exit()`` says whether that ended it.

    The lock's loss hook runs in whichever thread finds the loss (the deadline watch, the
    refresher) the moment ``lost`` is set; it only schedules the cancellation on the
    task's loop. The cancellation itself runs in the loop, and only while the block is
    still running, so it can never hit the code after the block. As in ``asyncio.timeout``,
    a CancelledError is turned into LockLost only when the cancellation was this guard's
    alone (``Task.uncancel()`` counts): a task also cancelled from outside stays cancelled.
    """

    __slots__ = ("_active", "_cancelled", "_cancelling", "_lock", "_loop", "_task")

    def __init__(self, lock: Lock) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("cancel_on_loss needs to run in an asyncio task")
        self._lock = lock
        self._task = task
        self._loop = task.get_loop()
        self._cancelling = task.cancelling()
        self._cancelled = False
        self._active = True
        if not lock.add_loss_hook(self._lost):
            self._lost()  # lost already, between the acquire and here

    def _lost(self) -> None:
        """The loss hook: any thread, so it only hands the cancellation to the loop."""
        with contextlib.suppress(RuntimeError):  # a closed loop: no task left to stop
            self._loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        if self._active and not self._cancelled:
            self._cancelled = True
            self._task.cancel(f"lock {self._lock.key!r} (token {self._lock.token}) was lost")

    def exit(self, exc: BaseException | None) -> LockLost | None:
        """Stop watching; the LockLost to raise instead of ``exc``, if the loss ended the block."""
        self._active = False
        self._lock.remove_loss_hook(self._lost)
        if not self._cancelled:
            return None
        if self._task.uncancel() > self._cancelling or not isinstance(exc, asyncio.CancelledError):
            return None
        try:
            self._lock.check()
        except LockLost as lost:
            return lost
        return LockLost(self._lock.key, self._lock.owner, self._lock.token, "it was lost")


class LockContext:
    """``with manager.lock(key) as lk:`` (or ``async with``): acquire on entry, release on exit.

    Leaving the block after the lock was lost does not raise: the loss was already
    signalled (``lk.lost``, ``lock_lost``) and is logged again here; unless
    ``cancel_on_loss`` cancelled the block, which then ends with LockLost.
    """

    __slots__ = ("_guard", "_kwargs", "_lock", "_manager", "cancel_on_loss", "key")

    def __init__(self, manager: _Acquires, key: str, **kwargs: Any) -> None:
        self._manager = manager
        self.key = key
        self._kwargs = kwargs
        self._lock: Lock | None = None
        self.cancel_on_loss = False
        self._guard: CancelOnLoss | None = None

    def __enter__(self) -> Lock:
        if self._lock is not None:
            raise RuntimeError(f"the lock context for {self.key!r} is already entered")
        if self.cancel_on_loss:
            raise TypeError(
                f"cancel_on_loss cancels an asyncio task: use 'async with' for {self.key!r}, "
                "or lk.check() and lk.lost in sync code"
            )
        self._lock = self._manager.acquire(self.key, **self._kwargs)
        return self._lock

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> Lock:
        if self._lock is not None:
            raise RuntimeError(f"the lock context for {self.key!r} is already entered")
        if self.cancel_on_loss and asyncio.current_task() is None:
            raise RuntimeError("cancel_on_loss needs to run in an asyncio task")
        lock = await self._manager.aacquire(self.key, **self._kwargs)
        self._lock = lock
        if self.cancel_on_loss:
            self._guard = CancelOnLoss(lock)
        return lock

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lock, self._lock = self._lock, None
        guard, self._guard = self._guard, None
        lost = None if guard is None else guard.exit(exc)
        if lock is None:
            return
        if lost is None:
            await lock.__aexit__(exc_type, exc, tb)
            return
        try:
            await lock.arelease()
        except MongoLockError as error:  # the lease ends by itself
            logger.warning("could not release lost lock %r: %s", lock.key, error)
        raise lost from exc
