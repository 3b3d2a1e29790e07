"""``@locked(key)``: run a function, a view or a management command while holding a lock.

Every call acquires a lock of its own (the decorator keeps no per-call state), makes it
reachable through ``current_lock()``, and releases it when the call ends, also when it
raises. A generator (or async generator) function holds its lock across the iteration:
from the first ``next()`` until it is exhausted, closed or collected. What "busy" means
depends on what was called: a function raises
LockNotAcquired, a view answers 423 Locked, a management command exits with
``BUSY_EXIT_CODE`` so that cron wrappers can tell "busy" from "failed".

``on_lost="exit"`` stops the call when its lock is lost while it runs: the main thread
is interrupted (as by Ctrl+C) the moment the loss is known, and a management command
exits with ``LOST_EXIT_CODE``, a plain function raises LockLost.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import re
import signal
import string
import sys
import threading
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias, TypeVar, cast

from asgiref.sync import iscoroutinefunction

from django_mongolock.context import holding
from django_mongolock.exceptions import LockLost, LockNotAcquired, MongoLockError
from django_mongolock.manager import LockManager
from django_mongolock.terminal import printable
from django_mongolock.validation import validate_key, validate_timeout, validate_ttl

if TYPE_CHECKING:
    from django.core.management.base import BaseCommand
    from django.http import HttpRequest, HttpResponse

    from django_mongolock.lock import Lock

__all__ = ["BUSY_EXIT_CODE", "LOST_EXIT_CODE", "OnBusy", "OnLost", "locked"]

logger = logging.getLogger("django_mongolock.decorators")

BUSY_EXIT_CODE: Final = 75
"""Exit status of a ``@locked`` management command whose lock is busy (EX_TEMPFAIL)."""

LOST_EXIT_CODE: Final = 76
"""Exit status of a ``@locked(..., on_lost="exit")`` command whose lock was lost mid-run."""

_ERROR_EXIT_CODE: Final = 2  # MongoDB unreachable or refusing, or invalid settings

OnBusy: TypeAlias = Literal["raise", "skip"] | Callable[..., Any] | None
"""``None`` (what suits the kind of callable), ``"raise"``, ``"skip"``, or a callable
``on_busy(error, *args, **kwargs)`` whose return value becomes the call's result."""

OnLost: TypeAlias = Literal["exit"] | Callable[..., Any] | None
"""``None`` (the call learns through ``lk.lost`` or ``lk.check()``), ``"exit"`` (stop the
call), or a callable ``on_lost(lock)`` run on a notice worker thread."""

_F = TypeVar("_F", bound=Callable[..., Any])
_Kind: TypeAlias = Literal["function", "view", "command"]

_FIELD_ROOT: Final = re.compile(r"[^.\[]*")


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
    fields = _template_fields(key)
    if not fields:
        validate_key(key.format())
    if ttl is not None:
        validate_ttl(ttl)
    validate_timeout(timeout, blocking=blocking)
    if on_busy is not None and on_busy not in ("raise", "skip") and not callable(on_busy):
        raise ValueError(f"on_busy must be None, 'raise', 'skip' or a callable, not {on_busy!r}")
    if manager is not None and not isinstance(manager, LockManager):
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
        if on_lost == "exit" and (
            iscoroutinefunction(target)
            or inspect.isgeneratorfunction(target)
            or inspect.isasyncgenfunction(target)
        ):
            raise TypeError(
                f"on_lost='exit' stops a sync call; {target!r:.80} is a coroutine or generator "
                "function: use 'async with locks.alock(key, cancel_on_loss=True)' or lk.check()"
            )
        template = _KeyTemplate.for_callable(key, fields, target)
        return cast(_F, _wrap(target, _Call(template, **options)))

    return decorate


# -- key templates -------------------------------------------------------------------------


def _template_fields(template: str) -> tuple[str, ...]:
    """The argument names a key template uses, checked for what ``str.format`` accepts."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"invalid lock key template {template!r}: {exc}") from exc
    names: list[str] = []
    for _text, field, spec, _conversion in parsed:
        if field is None:
            continue
        match = _FIELD_ROOT.match(field)
        root = match.group() if match else ""
        if not root.isidentifier():
            raise ValueError(
                f"lock key template {template!r} has the field {{{field}}}; fields must name "
                "an argument of the call, as in 'invoice-{pk}'"
            )
        if spec and "{" in spec:
            raise ValueError(f"lock key template {template!r} nests fields in a format spec")
        if root not in names:
            names.append(root)
    return tuple(names)


def _signature(target: Callable[..., Any]) -> inspect.Signature | None:
    # Django's method_decorator hands over a partial of the bound method whose __wrapped__
    # is the unbound function: its own signature (without self) is what calls bind to.
    follow = not isinstance(target, functools.partial)
    try:
        return inspect.signature(target, follow_wrapped=follow)
    except (TypeError, ValueError):  # some builtins and C callables have none
        return None


@dataclass(frozen=True, slots=True)
class _KeyTemplate:
    """A lock key, or a template formatted from the bound arguments of each call."""

    text: str
    fields: tuple[str, ...]
    signature: inspect.Signature | None
    name: str

    @classmethod
    def for_callable(
        cls, text: str, fields: tuple[str, ...], target: Callable[..., Any]
    ) -> _KeyTemplate:
        """Check the template against ``target``'s parameters, when they are fixed."""
        signature = _signature(target) if fields else None
        name = getattr(target, "__qualname__", None) or repr(target)
        if signature is not None:
            params = signature.parameters
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                missing = [field for field in fields if field not in params]
                if missing:
                    raise TypeError(
                        f"lock key template {text!r} names {', '.join(missing)}, but "
                        f"{name}() has no such parameter (it has: {', '.join(params) or 'none'})"
                    )
        return cls(text, fields, signature, name)

    def format(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        if not self.fields:
            return self.text.format()
        values = self._arguments(args, kwargs)
        missing = [name for name in self.fields if name not in values]
        if missing:
            raise TypeError(
                f"lock key template {self.text!r} of {self.name}() names "
                f"{', '.join(missing)}, which this call does not pass "
                f"(it passes: {', '.join(values) or 'nothing'})"
            )
        try:
            key = self.text.format_map(values)
        except (AttributeError, LookupError, TypeError, ValueError) as exc:
            raise ValueError(f"cannot format lock key template {self.text!r}: {exc}") from exc
        return validate_key(key)

    def _arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, defaults included and ``**kwargs`` spread out."""
        if self.signature is None:
            return dict(kwargs)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                values.update(value)
            else:
                values[name] = value
        return values


# -- one call under the lock ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Holder:
    """Who holds a busy lock and for how long, by the server's clock when it could say."""

    owner: str | None
    expires_at: datetime | None
    remaining: float


@dataclass(frozen=True, slots=True)
class _Call:
    """The decorator's settings; everything that belongs to one call lives on the stack."""

    key: _KeyTemplate
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
            "blocking": self.blocking,
            "timeout": self.timeout,
            "on_lost": None if self.on_lost == "exit" else self.on_lost,
            "reentrant": self.reentrant,
        }

    def _manager(self) -> LockManager:
        if self.manager is not None:
            return self.manager
        from django_mongolock.conf import get_manager

        return get_manager()

    def run(self, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = self.key.format(args, kwargs)
        if self.on_lost == "exit":
            kind, subject = _call_kind(args)
            if kind == "view":
                raise TypeError(
                    f"on_lost='exit' is for management commands and functions, not views "
                    f"({self.key.name}): it would interrupt the server's main thread"
                )
        try:
            manager = self._manager()
            lock = manager.acquire(key, **self._acquire_options())
        except LockNotAcquired as error:
            return self._busy(manager, error, args, kwargs)
        except MongoLockError as error:
            if _call_kind(args)[0] != "command":
                raise
            # A server or settings problem is not "busy": exit 2, as `mongolock` does.
            from django.core.management.base import CommandError

            raise CommandError(str(error), returncode=_ERROR_EXIT_CODE) from error
        if self.on_lost == "exit":
            return _run_stopping(target, args, kwargs, lock, self.key.name, kind, subject)
        handed_off = False
        try:
            with holding(lock):
                result = target(*args, **kwargs)
            if inspect.isawaitable(result):
                # A sync callable that returns a coroutine (the dispatch() of an async
                # class-based view): the lock must outlive the work, not the call.
                handed_off = True
                return _finish(result, lock, self.key.name)
            return result
        finally:
            if not handed_off:
                _release(lock, self.key.name)

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
            await _arelease(lock, self.key.name)

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
            return (yield from _iterate(target(*args, **kwargs), lock))
        finally:
            _release(lock, self.key.name)

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
            return None, _as_async_iterable(() if result is None else result)
        return lock, _as_async_iterable(())

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
        kind, subject = _call_kind(args)
        logger.debug("%s() did not run: %s", self.key.name, error)
        if on_busy == "raise" or (kind == "function" and on_busy is None):
            raise error
        if kind == "function":
            return None
        holder = _holder(manager, error)
        if kind == "view":
            if on_busy == "skip":
                return _http_response(b"", status=204)
            return _locked_response(subject, error.key, holder)
        command = cast("BaseCommand", subject)
        name = type(command).__module__.rpartition(".")[2]
        held = _describe(error.key, holder)
        if on_busy == "skip":
            if kwargs.get("verbosity", 1) >= 1:
                command.stdout.write(command.style.WARNING(f"{name}: skipped; {held}."))
            return None
        from django.core.management.base import CommandError

        raise CommandError(
            f"{name}: not run; {held}. Exit status {BUSY_EXIT_CODE} means busy: try again later.",
            returncode=BUSY_EXIT_CODE,
        ) from error


def _wrap(target: Callable[..., Any], call: _Call, *, force_async: bool = False) -> Any:
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


def _wrap_async_generator(target: Callable[..., Any], call: _Call) -> Any:
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
                await asyncio.to_thread(_release, lock, call.key.name)
            else:
                await _arelease(lock, call.key.name)

    return run_async_generator


def _iterate(inner: Generator[Any, Any, Any], lock: Lock) -> Generator[Any, Any, Any]:
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


async def _as_async_iterable(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


def _decorate_class(
    cls: type[Any], text: str, fields: tuple[str, ...], options: dict[str, Any]
) -> type[Any]:
    """Wrap ``handle`` of a management command or ``dispatch`` of a class-based view, in place."""
    command_base = _loaded_class("django.core.management.base", "BaseCommand")
    view_base = _loaded_class("django.views.generic.base", "View")
    if command_base is not None and issubclass(cls, command_base):
        name, force_async = "handle", False
    elif options.get("on_lost") == "exit":
        raise TypeError(
            f"on_lost='exit' on a class needs a management command (BaseCommand), "
            f"not {cls.__qualname__}"
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
    template = _KeyTemplate.for_callable(text, fields, method)
    setattr(cls, name, _wrap(method, _Call(template, **options), force_async=force_async))
    return cls


# -- on_lost="exit" ----------------------------------------------------------------------------

# The signal that interrupts the main thread: SIGINT, whose default handler Python always
# installs, so that a loss wakes the main thread from a sleep or a blocking read as Ctrl+C
# does. While the call runs, a handler of this module takes it, and passes on the others.
_INTERRUPT: Final = signal.SIGINT
# How long leaving the call waits for an interrupt already sent to arrive (it is
# delivered within microseconds): it must be taken here, not by the restored handler.
_IN_FLIGHT: Final = 1.0


class _Interrupted(BaseException):
    """Raised in the main thread when the call's lock is lost: not an Exception, so that
    the usual ``except Exception`` in the work does not swallow it. Carries the watch
    that raised it, so that a nested call passes on an interrupt meant for an outer one."""

    def __init__(self, stop: _StopOnLoss) -> None:
        super().__init__(stop.lock.key)
        self.stop = stop


class _StopOnLoss:
    """Interrupt the main thread when ``lock`` is lost while the call runs.

    The lock's loss hook (the deadline watch, the refresher) sends the main thread the
    interrupt the moment ``lost`` is set; this module's signal handler turns it into
    ``_Interrupted``. Outside the main thread (or when the loss is found by the call
    itself, as a failed ``refresh()``), nothing is interrupted: the loss is reported
    when the call returns.
    """

    def __init__(self, lock: Lock) -> None:
        self.lock = lock
        self.lost = False
        self.closing = False
        self._mutex = threading.Lock()
        self._active = False
        self._sent = False
        self._delivered = False
        self._main = threading.current_thread() is threading.main_thread()
        self._previous: Any = None

    def start(self) -> None:
        if self._main:
            self._previous = signal.getsignal(_INTERRUPT)
            signal.signal(_INTERRUPT, self._handle)
        self._active = True
        if not self.lock.add_loss_hook(self._on_loss):
            self.lost = True  # lost between the acquire and here

    def _on_loss(self) -> None:
        """The loss hook: runs in the thread that found the loss; must not block."""
        with self._mutex:
            if not self._active:
                return
            self.lost = True
            if not self._main or threading.current_thread() is threading.main_thread():
                return
            self._sent = True
            main = threading.main_thread().ident
            if main is not None and hasattr(signal, "pthread_kill"):
                signal.pthread_kill(main, _INTERRUPT)
            else:  # pragma: no cover - platforms without pthread_kill
                import _thread

                _thread.interrupt_main(_INTERRUPT)

    def _handle(self, signum: int, frame: Any) -> Any:
        if self._sent and not self._delivered:
            self._delivered = True
            if not self.closing:
                raise _Interrupted(self)
            return None
        previous = self._previous
        if callable(previous):
            return previous(signum, frame)
        if previous == signal.SIG_IGN:
            return None
        raise KeyboardInterrupt

    def close(self) -> None:
        """Stop watching and put the previous handler back; never raises ``_Interrupted``."""
        self.closing = True
        with self._mutex:
            self._active = False
        self.lock.remove_loss_hook(self._on_loss)
        if not self._main:
            return
        ends = time.monotonic() + _IN_FLIGHT
        while self._sent and not self._delivered and time.monotonic() < ends:
            time.sleep(0.001)
        signal.signal(_INTERRUPT, self._previous)


def _run_stopping(
    target: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lock: Lock,
    caller: str,
    kind: _Kind,
    subject: Any,
) -> Any:
    """Run ``target`` holding ``lock``; stop it if the lock is lost (``on_lost="exit"``)."""
    stop = _StopOnLoss(lock)
    result: Any = None
    raised: LockLost | None = None
    try:
        try:
            with holding(lock):
                try:
                    stop.start()
                    if not stop.lost:  # a loss before the watch began: the work never starts
                        lock.check()  # and a lease that lapsed unnoticed (no I/O)
                        result = target(*args, **kwargs)
                finally:
                    stop.closing = True
        except _Interrupted as interrupt:
            if interrupt.stop is not stop:
                raise  # an outer call's lock was lost: it is that call's to stop
        except LockLost as error:
            if (error.key, error.token) != (lock.key, lock.token):
                raise
            raised = error  # the call found out itself: a failed refresh() or check()
        finally:
            stop.close()
    finally:
        if stop.lost or raised is not None:
            # Expected to be gone; released all the same in case the lease only lapsed here.
            with contextlib.suppress(MongoLockError):
                lock.release()
        else:
            _release(lock, caller)
    if not stop.lost and raised is None:
        return result
    lost = raised or _loss_of(lock)
    if kind != "command":
        raise lost
    command = cast("BaseCommand", subject)
    name = type(command).__module__.rpartition(".")[2]
    from django.core.management.base import CommandError

    raise CommandError(
        f"{name}: stopped; lost the lock {lock.key!r} (owner {printable(lock.owner)}, "
        f"fencing token {lock.token}): {lost.reason}. Exit status {LOST_EXIT_CODE} means the "
        "lock was lost while the command ran: another run may hold it now.",
        returncode=LOST_EXIT_CODE,
    ) from lost


def _loss_of(lock: Lock) -> LockLost:
    try:
        lock.check()
    except LockLost as lost:
        return lost
    return LockLost(lock.key, lock.owner, lock.token, "it was lost")


async def _finish(work: Awaitable[Any], lock: Lock, caller: str) -> Any:
    try:
        with holding(lock):
            return await work
    finally:
        await _arelease(lock, caller)


async def _arelease(lock: Lock, caller: str) -> None:
    """``_release`` for coroutines, through the async client."""
    try:
        held = await lock.arelease()
    except MongoLockError:
        _release_failed(lock, caller)
        return
    if not held:
        _not_held(lock, caller)


def _release(lock: Lock, caller: str) -> None:
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


# -- what kind of call: function, view or command -------------------------------------------


def _loaded_class(module: str, name: str) -> type[Any] | None:
    """A class of a module that is already imported, else None: no instance can exist yet.

    Keeps ``@locked`` on plain functions from importing Django's HTTP and command machinery.
    """
    loaded = sys.modules.get(module)
    found = getattr(loaded, name, None)
    return found if isinstance(found, type) else None


def _as_request(value: object) -> HttpRequest | None:
    request_class = _loaded_class("django.http.request", "HttpRequest")
    if request_class is None:
        return None
    if isinstance(value, request_class):
        return cast("HttpRequest", value)
    # Django REST framework's Request wraps Django's.
    wrapper_class = _loaded_class("rest_framework.request", "Request")
    if wrapper_class is not None and isinstance(value, wrapper_class):
        inner = getattr(value, "_request", None)
        return cast("HttpRequest", inner) if isinstance(inner, request_class) else None
    return None


def _call_kind(args: Sequence[Any]) -> tuple[_Kind, Any]:
    """A command when called with the command first; a view when a request comes first or
    second (after ``self``); a plain function otherwise."""
    if not args:
        return "function", None
    command_class = _loaded_class("django.core.management.base", "BaseCommand")
    if command_class is not None and isinstance(args[0], command_class):
        return "command", args[0]
    for value in args[:2]:
        request = _as_request(value)
        if request is not None:
            return "view", request
    return "function", None


# -- answers when busy -----------------------------------------------------------------------


def _holder(manager: LockManager, error: LockNotAcquired) -> _Holder:
    """The current holder and its remaining lease, read from the server."""
    try:
        info = manager.status(error.key)
    except MongoLockError:
        # The server answered the acquire a moment ago but not this read: estimate by this
        # machine's clock; the result is advice for the caller, never a lock decision.
        left = 0.0
        if error.expires_at is not None:
            left = (error.expires_at - datetime.now(UTC)).total_seconds()
        return _Holder(error.holder, error.expires_at, max(left, 0.0))
    if info is None or not info.live:
        return _Holder(error.holder, error.expires_at, 0.0)  # released since
    return _Holder(info.owner, info.expires_at, max(info.remaining, 0.0))


def _describe(key: str, holder: _Holder) -> str:
    text = f"lock {key!r} is held"
    if holder.owner:
        text += f" by {printable(holder.owner)}"
    if holder.expires_at is not None:
        text += f" until {holder.expires_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"
    return text + f" (in {math.ceil(holder.remaining)}s)"


def _http_response(content: bytes | str, **kwargs: Any) -> HttpResponse:
    from django.http import HttpResponse

    return HttpResponse(content, **kwargs)


def _locked_response(request: HttpRequest, key: str, holder: _Holder) -> HttpResponse:
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
        response = _http_response(
            detail + "\n", status=423, content_type="text/plain; charset=utf-8"
        )
    response["Retry-After"] = str(retry_after)
    add_never_cache_headers(response)
    return response
