"""``@locked(key)``: run a function, a view or a management command while holding a lock.

Every call acquires a lock of its own (the decorator keeps no per-call state), makes it
reachable through ``current_lock()``, and releases it when the call ends, also when it
raises. A generator (or async generator) function holds its lock across the iteration:
from the first ``next()`` until it is exhausted, closed or collected. What "busy" means
depends on what was called: a function raises
LockNotAcquired, a view answers 423 Locked, a management command exits with
``BUSY_EXIT_CODE`` so that cron wrappers can tell "busy" from "failed". ``on_busy`` picks
another answer: ``"skip"``, ``"wait"`` (up to ``timeout``), ``"retry"`` (a bound Celery
task retries when the holder's lease ends), ``"coalesce"`` (the holder runs once more).

``on_lost="exit"`` stops the call when its lock is lost while it runs: the main thread
is interrupted (as by Ctrl+C) the moment the loss is known, and a management command
exits with ``LOST_EXIT_CODE``, a plain function raises LockLost.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncGenerator, Callable, Generator
from typing import Any, Final, TypeVar, cast

from asgiref.sync import iscoroutinefunction

from django_mongolock.context import holding
from django_mongolock.decorating.call import Call, OnBusy, OnLost
from django_mongolock.decorating.held import arelease, release
from django_mongolock.decorating.keys import KeyTemplate, template_fields
from django_mongolock.decorating.kinds import loaded_class
from django_mongolock.exitcodes import BUSY_EXIT_CODE, LOST_EXIT_CODE
from django_mongolock.manager import LockManager
from django_mongolock.validation import validate_key, validate_timeout, validate_ttl

__all__ = ["BUSY_EXIT_CODE", "LOST_EXIT_CODE", "OnBusy", "OnLost", "locked"]

_F = TypeVar("_F", bound=Callable[..., Any])
_POLICIES: Final = ("raise", "skip", "wait", "retry", "coalesce")
# Policies that run the call again later: only a plain (sync) call can be run again.
_SYNC_ONLY: Final = ("retry", "coalesce")


def locked(
    key: str,
    *,
    ttl: float | None = None,
    blocking: bool = False,
    timeout: float | None = None,
    on_busy: OnBusy = None,
    manager: LockManager | None = None,
    on_lost: OnLost = None,
    reentrant: bool = False,
) -> Callable[[_F], _F]:
    """Hold the lock ``key`` while the decorated function, view or command runs.

    ``key`` may be a template such as ``"invoice-{pk}"``, formatted from the arguments of
    each call. ``ttl``, ``blocking``, ``timeout`` and ``reentrant`` are passed to
    ``LockManager.acquire``; by default the call does not wait. ``manager`` defaults to
    ``django_mongolock.locks``, looked up at call time, so decorating opens no connection.
    ``on_lost="exit"`` stops a command (or sync function) whose lock is lost mid-run.
    """
    given: object = key  # checked at run time whatever the annotations say
    if not isinstance(given, str):
        if callable(given):
            raise TypeError("@locked needs the lock's key: write @locked('name'), not @locked")
        raise TypeError(f"lock key must be a str, not {type(given).__name__}: {given!r:.80}")
    fields = template_fields(key)
    if not fields:
        validate_key(key.format())
    if ttl is not None:
        validate_ttl(ttl)
    if on_busy is not None and on_busy not in _POLICIES and not callable(on_busy):
        raise ValueError(
            "on_busy must be None, 'raise', 'skip', 'wait', 'retry', 'coalesce' or a "
            f"callable, not {on_busy!r:.80}"
        )
    # "wait" blocks without blocking=True; any other blocking value is checked as given.
    validate_timeout(
        timeout, blocking=True if on_busy == "wait" and blocking is False else blocking
    )
    if manager is not None and not _is_manager(manager):
        raise TypeError(f"manager must be a LockManager, not {type(manager).__name__}")
    if on_lost is not None and on_lost != "exit" and not callable(on_lost):
        raise ValueError(f"on_lost must be None, 'exit' or a callable, not {on_lost!r:.80}")
    if type(reentrant) is not bool:
        raise TypeError(f"reentrant must be True or False, not {reentrant!r}")

    options: dict[str, Any] = {
        "ttl": ttl,
        "blocking": blocking,
        "timeout": timeout,
        "on_busy": on_busy,
        "manager": manager,
        "on_lost": on_lost,
        "reentrant": reentrant,
    }

    def decorate(target: _F) -> _F:
        if isinstance(target, type):
            return cast(_F, _decorate_class(target, key, fields, options))
        if not callable(target):
            raise TypeError(f"@locked() needs a function, view or command, not {target!r:.80}")
        if on_busy in _SYNC_ONLY and (
            iscoroutinefunction(target)
            or inspect.isgeneratorfunction(target)
            or inspect.isasyncgenfunction(target)
        ):
            raise TypeError(
                f"on_busy={on_busy!r} runs plain (sync) functions, tasks and commands; "
                f"{target!r:.80} is a coroutine or generator function"
            )
        if on_busy == "retry" and not _takes_an_argument(target):
            raise TypeError(
                f"on_busy='retry' needs a bound task: {target!r:.80} takes no argument for "
                "the task (decorate with @app.task(bind=True) above @locked and take self)"
            )
        if on_lost == "exit" and (
            iscoroutinefunction(target)
            or inspect.isgeneratorfunction(target)
            or inspect.isasyncgenfunction(target)
        ):
            raise TypeError(
                f"on_lost='exit' stops a sync call; {target!r:.80} is a coroutine or generator "
                "function: use 'async with locks.alock(key, cancel_on_loss=True)' or lk.check()"
            )
        template = KeyTemplate.for_callable(key, fields, target)
        return cast(_F, _wrap(target, Call(template, **options)))

    return decorate


def _takes_an_argument(target: Callable[..., Any]) -> bool:
    """Whether ``target`` can be passed a first positional argument (the bound task)."""
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # no signature to read: judged at the call
        return True
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
    )
    return any(parameter.kind in positional for parameter in parameters)


def _is_manager(value: object) -> bool:
    """A LockManager, judged by its type: ``isinstance`` on a lazy proxy (a Django
    ``LazyObject``) would build the manager it wraps, reading settings at decoration time.
    What a proxy wraps is checked at the call."""
    if issubclass(type(value), LockManager):
        return True
    lazy = loaded_class("django.utils.functional", "LazyObject")
    return lazy is not None and issubclass(type(value), lazy)


def _wrap(target: Callable[..., Any], call: Call, *, force_async: bool = False) -> Any:
    if inspect.isasyncgenfunction(target):
        return _wrap_async_generator(target, call)
    if inspect.isgeneratorfunction(target):

        @functools.wraps(target)
        def run_generator(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            return (yield from call.run_generator(target, args, kwargs))

        return run_generator
    if force_async or iscoroutinefunction(target):

        @functools.wraps(target)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            return await call.run_async(target, args, kwargs)

        return run_async

    @functools.wraps(target)
    def run(*args: Any, **kwargs: Any) -> Any:
        return call.run(target, args, kwargs)

    return run


def _wrap_async_generator(target: Callable[..., Any], call: Call) -> Any:
    @functools.wraps(target)
    async def run_async_generator(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
        lock, instead = await call.acquire_for_generator(args, kwargs)
        if lock is None:
            async for item in instead:
                yield item
            return
        closing = False
        try:
            inner = target(*args, **kwargs)
            sent: Any = None
            error: BaseException | None = None
            while True:
                # The lock is the current one while the body runs, not while the caller
                # holds an item: the body's context is the caller's between two steps.
                try:
                    with holding(lock):
                        if error is None:
                            item = await inner.asend(sent)
                        else:
                            item, error = await inner.athrow(error), None
                except StopAsyncIteration:
                    return
                try:
                    sent = yield item
                except GeneratorExit:
                    closing = True
                    with holding(lock):
                        await inner.aclose()
                    raise
                except BaseException as exc:  # thrown in by the caller: the body's to handle
                    error = exc
        finally:
            if closing:
                # Closed, maybe by the loop's shutdown, which closes the async client in
                # the same breath: release through the sync client, off the loop.
                await asyncio.to_thread(release, lock, call.key.name)
            else:
                await arelease(lock, call.key.name)

    return run_async_generator


def _decorate_class(
    cls: type[Any], text: str, fields: tuple[str, ...], options: dict[str, Any]
) -> type[Any]:
    """Wrap ``handle`` of a management command or ``dispatch`` of a class-based view, in place."""
    command_base = loaded_class("django.core.management.base", "BaseCommand")
    view_base = loaded_class("django.views.generic.base", "View")
    if command_base is not None and issubclass(cls, command_base):
        if options.get("on_busy") == "retry":
            raise TypeError(
                f"on_busy='retry' is for bound Celery tasks, not management commands "
                f"({cls.__qualname__}): use 'raise' (exit 75) and let cron retry"
            )
        name, force_async = "handle", False
    elif options.get("on_lost") == "exit":
        raise TypeError(
            f"on_lost='exit' on a class needs a management command (BaseCommand), "
            f"not {cls.__qualname__}"
        )
    elif (
        options.get("on_busy") in _SYNC_ONLY
        and view_base is not None
        and issubclass(cls, view_base)
    ):
        raise TypeError(
            f"on_busy={options['on_busy']!r} is not for views ({cls.__qualname__}): "
            "a busy view answers 423 Locked (or 'wait' up to a timeout)"
        )
    elif view_base is not None and issubclass(cls, view_base):
        # as_view() runs dispatch() in the event loop for async views: acquire off it.
        name, force_async = "dispatch", bool(cls.view_is_async)
    else:
        raise TypeError(
            f"@locked() on a class needs a management command (BaseCommand) or a class-based "
            f"view (View) subclass, not {cls.__qualname__}; decorate a method instead"
        )
    method = getattr(cls, name)
    template = KeyTemplate.for_callable(text, fields, method)
    setattr(cls, name, _wrap(method, Call(template, **options), force_async=force_async))
    return cls
