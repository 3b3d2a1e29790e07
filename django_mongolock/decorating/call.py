"""One call under its lock: acquire, run (a function, coroutine or generator), release.

The decorator's settings are frozen in ``Call``; everything that belongs to one call
lives on the stack, so a decorated function may run in many threads at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
from collections.abc import AsyncIterable, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, cast

from django_mongolock.context import holding
from django_mongolock.decorating.busy import (
    describe_holder,
    find_holder,
    http_response,
    locked_response,
)
from django_mongolock.decorating.coalesce import Requests
from django_mongolock.decorating.held import arelease, as_async_iterable, finish, iterate, release
from django_mongolock.decorating.keys import KeyTemplate
from django_mongolock.decorating.kinds import Kind, call_kind
from django_mongolock.decorating.stopping import run_stopping
from django_mongolock.exceptions import LockNotAcquired, MongoLockError
from django_mongolock.exitcodes import BUSY_EXIT_CODE, EXIT_ERROR
from django_mongolock.lock import Lock
from django_mongolock.manager import LockManager

if TYPE_CHECKING:
    from django.core.management.base import BaseCommand

__all__ = ["Call", "OnBusy", "OnLost"]

logger = logging.getLogger("django_mongolock.decorators")

OnBusy: TypeAlias = (
    Literal["raise", "skip", "wait", "retry", "coalesce"] | Callable[..., Any] | None
)
"""``None`` (what suits the kind of callable), ``"raise"``, ``"skip"``, ``"wait"`` (up to
``timeout``, then as ``None``), ``"retry"`` (a bound Celery task retries later),
``"coalesce"`` (the holder runs once more), or a callable ``on_busy(error, *args,
**kwargs)`` whose return value becomes the call's result."""

OnLost: TypeAlias = Literal["exit"] | Callable[..., Any] | None
"""``None`` (the call learns through ``lk.lost`` or ``lk.check()``), ``"exit"`` (stop the
call), or a callable ``on_lost(lock)`` run on a notice worker thread."""


@dataclass(frozen=True, slots=True)
class Call:
    """The decorator's settings; everything that belongs to one call lives on the stack."""

    key: KeyTemplate
    ttl: float | None
    blocking: bool
    timeout: float | None
    on_busy: OnBusy
    manager: LockManager | None
    on_lost: OnLost = None
    reentrant: bool = False

    def _acquire_options(self) -> dict[str, Any]:
        """``acquire``/``aacquire`` arguments; ``"exit"`` is this module's, not a callback."""
        return {
            "ttl": self.ttl,
            "blocking": self.blocking or self.on_busy == "wait",
            "timeout": self.timeout,
            "on_lost": None if self.on_lost == "exit" else self.on_lost,
            "reentrant": self.reentrant,
        }

    def _manager(self) -> LockManager:
        if self.manager is not None:
            if not isinstance(self.manager, LockManager):  # a lazy proxy, set up by now
                raise TypeError(f"manager must be a LockManager, not {self.manager!r:.80}")
            return self.manager
        from django_mongolock.conf import get_manager

        return get_manager()

    def run(self, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = self.key.format(args, kwargs)
        kind, subject = call_kind(args)
        if self.on_lost == "exit" and kind == "view":
            raise TypeError(
                f"on_lost='exit' is for management commands and functions, not views "
                f"({self.key.name}): it would interrupt the server's main thread"
            )
        if self.on_busy == "retry":
            bound_task(args, self.key.name)
        if self.on_busy == "coalesce":
            if kind == "view":
                raise TypeError(
                    f"on_busy='coalesce' is for functions, tasks and management commands, "
                    f"not views ({self.key.name}): a request cannot be answered by another's run"
                )
            return self._run_coalescing(target, args, kwargs, key)
        try:
            manager = self._manager()
            lock = manager.acquire(key, **self._acquire_options())
        except LockNotAcquired as error:
            return self._busy(manager, error, args, kwargs)
        except MongoLockError as error:
            if kind != "command":
                raise
            # A server or settings problem is not "busy": exit 2, as `mongolock` does.
            from django.core.management.base import CommandError

            raise CommandError(str(error), returncode=EXIT_ERROR) from error
        return self._run_held(target, args, kwargs, lock, kind, subject)

    @staticmethod
    @contextlib.contextmanager
    def _server_problems(kind: Kind) -> Iterator[None]:
        """In a command, a server or settings problem of the lock's own work (not of the
        command's) exits 2, as ``mongolock`` does: it is not "busy"."""
        try:
            yield
        except LockNotAcquired:
            raise
        except MongoLockError as error:
            if kind != "command":
                raise
            from django.core.management.base import CommandError

            raise CommandError(str(error), returncode=EXIT_ERROR) from error

    def _run_coalescing(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: str,
    ) -> Any:
        """Run, then run again while requests came in during the run (see ``coalesce``)."""
        kind, subject = call_kind(args)
        options = self._acquire_options()
        with self._server_problems(kind):
            manager = self._manager()
            requests = Requests(manager)
            try:
                lock = manager.acquire(key, **options)
                own_run = True  # the call's own first run: it runs whatever the counts say
            except LockNotAcquired:
                number = requests.add(key)
                try:  # the holder may have looked for requests and released meanwhile
                    lock = manager.acquire(key, **options)
                except LockNotAcquired as again:
                    return self._coalesced(manager, again, kind, subject, kwargs)
                own_run = False
                logger.debug("%s(): got the lock after requesting run %d", self.key.name, number)
        result: Any = None
        ran = False
        while True:
            # Holding `lock`. Any run but the call's own first one runs only while a request
            # is pending: a run since (another's) may have covered them all.
            try:
                count = requests.count(key)
            except BaseException as error:
                release(lock, self.key.name)
                return self._extra_failed(error, ran, kind, key, result)
            if own_run or count.pending:
                own_run = False
                result = self._run_held(target, args, kwargs, lock, kind, subject)
                ran = True
                try:
                    requests.serve(key, count.requested)
                except MongoLockError as error:
                    return self._extra_failed(error, ran, kind, key, result)
            else:
                release(lock, self.key.name)
                logger.debug("%s(): the requests were covered by a run since", self.key.name)
            # Released: a request made while the lock was held found it busy and is left
            # to this call.
            try:
                if not requests.pending(key):
                    return self._finished(ran, result, kind, subject, kwargs)
                lock = manager.acquire(key, **options)
            except LockNotAcquired:
                # The holder started after the request, or finds it when done.
                return self._finished(ran, result, kind, subject, kwargs)
            except MongoLockError as error:
                return self._extra_failed(error, ran, kind, key, result)
            logger.debug("%s(): runs once more for a request made while it ran", self.key.name)

    def _extra_failed(
        self, error: BaseException, ran: bool, kind: Kind, key: str, result: Any
    ) -> Any:
        """A server error after the call's run: the run's result, not an error (what is
        left pending is served by the next run of the key). Before it: raised."""
        if ran and isinstance(error, MongoLockError):
            logger.warning(
                "%s(): ran, but could not look for or serve run requests of %r; the next "
                "run of the key serves any that are pending",
                self.key.name,
                key,
                exc_info=error,
            )
            return result
        with self._server_problems(kind):
            raise error

    def _finished(
        self, ran: bool, result: Any, kind: Kind, subject: Any, kwargs: dict[str, Any]
    ) -> Any:
        """The result of the call's run; a call that did not run (a run since covered its
        request) returns None, and a command says so in one line."""
        if ran:
            return result
        if kind == "command" and kwargs.get("verbosity", 1) >= 1:
            command = cast("BaseCommand", subject)
            name = type(command).__module__.rpartition(".")[2]
            command.stdout.write(
                command.style.WARNING(f"{name}: not run now; a run since covered this request.")
            )
        return None

    def _coalesced(
        self,
        manager: LockManager,
        error: LockNotAcquired,
        kind: Kind,
        subject: Any,
        kwargs: dict[str, Any],
    ) -> None:
        """A busy call whose request was recorded: None; a command says so in one line."""
        logger.debug("%s() did not run now, requested a run: %s", self.key.name, error)
        if kind != "command":
            return
        command = cast("BaseCommand", subject)
        if kwargs.get("verbosity", 1) >= 1:
            name = type(command).__module__.rpartition(".")[2]
            held = describe_holder(error.key, find_holder(manager, error))
            command.stdout.write(
                command.style.WARNING(f"{name}: not run now; {held}; it runs once more after.")
            )

    def _run_held(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        lock: Lock,
        kind: Kind,
        subject: Any,
    ) -> Any:
        """Run ``target`` holding ``lock``, and release it."""
        if self.on_lost == "exit":
            return run_stopping(target, args, kwargs, lock, self.key.name, kind, subject)
        handed_off = False
        try:
            with holding(lock):
                result = target(*args, **kwargs)
            if inspect.isawaitable(result):
                # A sync callable that returns a coroutine (the dispatch() of an async
                # class-based view): the lock must outlive the work, not the call.
                handed_off = True
                return finish(result, lock, self.key.name)
            return result
        finally:
            if not handed_off:
                release(lock, self.key.name)

    async def run_async(
        self, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        key = self.key.format(args, kwargs)
        manager = self._manager()
        try:
            lock = await manager.aacquire(key, **self._acquire_options())
        except LockNotAcquired as error:
            if callable(self.on_busy):
                result = self.on_busy(error, *args, **kwargs)
                return await result if inspect.isawaitable(result) else result
            return await asyncio.to_thread(self._busy, manager, error, args, kwargs)
        try:
            with holding(lock):
                result = target(*args, **kwargs)
                if inspect.isawaitable(result):
                    result = await result
            return result
        finally:
            await arelease(lock, self.key.name)

    def run_generator(
        self, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Generator[Any, Any, Any]:
        """Iterate ``target(*args, **kwargs)`` holding the lock from the first ``next()``
        until the iteration ends, also by ``close()`` (and so by garbage collection)."""
        key = self.key.format(args, kwargs)
        try:
            lock = self._manager().acquire(key, **self._acquire_options())
        except LockNotAcquired as error:
            return (yield from self._busy_items(error, args, kwargs))
        try:
            return (yield from iterate(target(*args, **kwargs), lock))
        finally:
            release(lock, self.key.name)

    async def acquire_for_generator(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Lock | None, AsyncIterable[Any]]:
        """The lock for one iteration of an async generator, or what to yield instead."""
        key = self.key.format(args, kwargs)
        manager = self._manager()
        try:
            lock = await manager.aacquire(key, **self._acquire_options())
        except LockNotAcquired as error:
            result = self._busy_items(error, args, kwargs)
            if inspect.isawaitable(result):
                result = await result
            return None, as_async_iterable(() if result is None else result)
        return lock, as_async_iterable(())

    def _busy_items(
        self, error: LockNotAcquired, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """What a generator whose lock is busy yields instead: nothing for ``"skip"``, what
        a callable ``on_busy`` returns (iterated); otherwise LockNotAcquired is raised."""
        on_busy = self.on_busy
        if callable(on_busy):
            result = on_busy(error, *args, **kwargs)
            return () if result is None else result
        logger.debug("%s() did not run: %s", self.key.name, error)
        if on_busy == "skip":
            return ()
        raise error

    def _busy(
        self,
        manager: LockManager,
        error: LockNotAcquired,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The result of a call that did not get its lock, by ``on_busy`` and the call's kind."""
        on_busy = self.on_busy
        if callable(on_busy):
            return on_busy(error, *args, **kwargs)
        kind, subject = call_kind(args)
        logger.debug("%s() did not run: %s", self.key.name, error)
        if on_busy == "retry":
            task = bound_task(args, self.key.name)
            countdown = max(1, math.ceil(find_holder(manager, error).remaining))
            # Celery's retry() raises Retry (or, when retries are exhausted, ``exc``).
            raise task.retry(countdown=countdown, exc=error)
        if on_busy == "raise" or (kind == "function" and on_busy in (None, "wait")):
            raise error
        if kind == "function":
            return None
        holder = find_holder(manager, error)
        if kind == "view":
            if on_busy == "skip":
                return http_response(b"", status=204)
            return locked_response(subject, error.key, holder)
        command = cast("BaseCommand", subject)
        name = type(command).__module__.rpartition(".")[2]
        held = describe_holder(error.key, holder)
        if on_busy == "skip":
            if kwargs.get("verbosity", 1) >= 1:
                command.stdout.write(command.style.WARNING(f"{name}: skipped; {held}."))
            return None
        from django.core.management.base import CommandError

        raise CommandError(
            f"{name}: not run; {held}. Exit status {BUSY_EXIT_CODE} means busy: try again later.",
            returncode=BUSY_EXIT_CODE,
        ) from error


def bound_task(args: tuple[Any, ...], name: str) -> Any:
    """The bound task a ``"retry"`` call runs as: its first argument, with ``retry`` and
    ``request`` (as ``@app.task(bind=True)`` passes). Duck-typed: no import of Celery."""
    task = args[0] if args else None
    if task is None or not (callable(getattr(task, "retry", None)) and hasattr(task, "request")):
        got = "no arguments" if not args else f"{type(task).__name__} {task!r:.60}"
        raise TypeError(
            f"on_busy='retry' needs a bound task as the first argument of {name}() "
            f"(decorate with @app.task(bind=True) above @locked), got {got}"
        )
    return task
