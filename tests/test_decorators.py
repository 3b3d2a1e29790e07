"""``@locked`` on functions, coroutines, views and management commands, against the real server."""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import itertools
import json
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from io import StringIO
from types import SimpleNamespace
from typing import Any

import pytest
from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client, RequestFactory
from django.utils.decorators import method_decorator
from django.utils.functional import SimpleLazyObject
from django.views import View
from pytest_django.fixtures import Settings

from django_mongolock import (
    BUSY_EXIT_CODE,
    Lock,
    LockLost,
    LockManager,
    LockNotAcquired,
    ServerUnavailable,
    conf,
    current_lock,
    locked,
    locks,
)
from django_mongolock.signals import lock_acquired

pytestmark = pytest.mark.usefixtures("mongolock_settings")

rf = RequestFactory()


@pytest.fixture
def hold(other: LockManager) -> Iterator[Any]:
    """``hold(key)``: take ``key`` through a second manager (another 'process') for the test."""
    held: list[Lock] = []

    def take(key: str, ttl: float = 30) -> Lock:
        lock = other.acquire(key, ttl=ttl)
        held.append(lock)
        return lock

    yield take
    for lock in held:
        lock.release()


def _run(command: BaseCommand, *args: str) -> tuple[str, str, int]:
    """Run a command object like ``manage.py`` would: (stdout, stderr, exit status)."""
    out, err = StringIO(), StringIO()
    try:
        call_command(command, *args, stdout=out, stderr=err, no_color=True)
    except CommandError as exc:
        return out.getvalue(), err.getvalue() + str(exc), exc.returncode
    return out.getvalue(), err.getvalue(), 0


def _respond(view: Callable[..., Any], request: HttpRequest, **kwargs: Any) -> HttpResponse:
    """Call a view as Django would, running an async one to its end."""
    result = view(request, **kwargs)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    assert isinstance(result, HttpResponse)
    return result


def _document(key: str) -> Any:
    return locks.status(key)


# -- plain functions -------------------------------------------------------------------------


def test_function_holds_the_lock_while_it_runs(lock_events: list[tuple[str, Any]]) -> None:
    seen: list[Lock | None] = []

    @locked("report")
    def work(x: int) -> int:
        lock = current_lock()
        seen.append(lock)
        assert lock is not None
        status = _document("report")
        assert status is not None
        assert (status.owner, status.token, status.live) == (lock.owner, lock.token, True)
        return x * 2

    assert current_lock() is None
    assert work(21) == 42
    assert current_lock() is None
    lock = seen[0]
    assert isinstance(lock, Lock)
    assert lock.key == "report"
    assert lock.released
    assert _document("report") is None
    assert [name for name, _ in lock_events] == ["acquired", "released"]
    assert all(event_lock is lock for _, event_lock in lock_events)
    # A fresh lock per call: the next call gets a greater fencing token.
    assert work(1) == 2
    assert seen[1] is not lock
    assert seen[1] is not None
    assert seen[1].token > lock.token


def test_function_busy_raises_without_running(hold: Any) -> None:
    holder = hold("report")
    calls: list[int] = []

    @locked("report")
    def work() -> None:
        calls.append(1)

    with pytest.raises(LockNotAcquired) as info:
        work()
    assert info.value.key == "report"
    assert info.value.holder == holder.owner
    assert calls == []
    status = _document("report")
    assert status is not None
    assert status.token == holder.token


def test_exception_inside_releases_the_lock(lock_events: list[tuple[str, Any]]) -> None:
    @locked("fragile")
    def work() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        work()
    assert _document("fragile") is None
    assert [name for name, _ in lock_events] == ["acquired", "released"]
    assert current_lock() is None


def test_blocking_waits_for_the_holder(other: LockManager) -> None:
    holder = other.acquire("queue", ttl=30)
    threading.Timer(0.2, holder.release).start()

    @locked("queue", blocking=True, timeout=10)
    def work() -> int:
        lock = current_lock()
        assert lock is not None
        return lock.token

    assert work() > holder.token


def test_blocking_gives_up_after_timeout(hold: Any) -> None:
    hold("queue")

    @locked("queue", blocking=True, timeout=0.2)
    def work() -> None:
        raise AssertionError("must not run")

    with pytest.raises(LockNotAcquired) as info:
        work()
    assert info.value.waited is not None


def test_ttl_is_the_lease_of_each_call() -> None:
    @locked("short", ttl=7)
    def work() -> float:
        lock = current_lock()
        assert lock is not None
        return (lock.expires_at - lock.acquired_at).total_seconds()

    assert work() == 7


def test_manager_argument(manager: LockManager, other: LockManager) -> None:
    second = LockManager(other.url, database=manager.database, collection="elsewhere")

    @locked("job", manager=second)
    def work() -> str:
        lock = current_lock()
        assert lock is not None
        assert second.status("job") is not None
        return lock.key

    try:
        with manager.lock("job"):  # the same key in the default collection does not matter
            assert work() == "job"
    finally:
        second.close()


def test_manager_argument_takes_the_default_locks(other: LockManager, settings: Settings) -> None:
    """``manager=locks``: the lazy default manager is a manager, looked up at each call."""

    @locked("job-{n}", manager=locks)
    def work(n: int) -> tuple[str, int]:
        lock = current_lock()
        assert lock is not None
        info = conf.get_manager().status(lock.key)
        assert info is not None
        assert info.token == lock.token
        return lock.key, lock.token

    key, _ = work(1)
    assert key == "job-1"
    assert conf.get_manager().status("job-1") is None  # released after the call
    held = other.acquire("job-2", ttl=30)
    try:
        with pytest.raises(LockNotAcquired):
            work(2)
    finally:
        held.release()
    assert work(2)[1] > held.token  # a new lock of job-2, after the one held above
    settings.MONGOLOCK = {"URL": "mongodb://127.0.0.1:9/", "SERVER_SELECTION_TIMEOUT": 0.3}
    with pytest.raises(ServerUnavailable, match=r"127\.0\.0\.1:9"):
        work(3)  # the settings of now, not of when it was decorated


def test_manager_argument_takes_a_lazy_manager() -> None:
    """A lazy proxy of a manager is not built by decorating, only by the first call."""
    built: list[LockManager] = []

    def build() -> LockManager:
        built.append(conf.get_manager())
        return built[-1]

    lazy = SimpleLazyObject(build)

    @locked("lazy-job", manager=lazy)  # type: ignore[arg-type]
    def work() -> str:
        lock = current_lock()
        assert lock is not None
        return lock.key

    assert not built
    assert work() == "lazy-job"
    assert built == [conf.get_manager()]

    @locked("lazy-job", manager=SimpleLazyObject(lambda: "not a manager"))  # type: ignore[arg-type]
    def wrong() -> None:
        raise AssertionError("must not run")

    with pytest.raises(TypeError, match="manager must be a LockManager"):
        wrong()


def test_nested_locks_current_is_the_innermost() -> None:
    @locked("inner")
    def inner() -> tuple[str | None, str | None]:
        lock = current_lock()
        return (lock.key if lock else None), None

    @locked("outer")
    def outer() -> list[str | None]:
        keys = []
        lock = current_lock()
        keys.append(lock.key if lock else None)
        keys.append(inner()[0])
        lock = current_lock()
        keys.append(lock.key if lock else None)
        return keys

    assert outer() == ["outer", "inner", "outer"]


def test_same_key_nested_is_busy_not_reentrant() -> None:
    @locked("once")
    def inner() -> None:
        raise AssertionError("must not run")

    @locked("once")
    def outer() -> None:
        inner()

    with pytest.raises(LockNotAcquired):
        outer()
    assert _document("once") is None


def test_threads_each_see_their_own_lock() -> None:
    barrier = threading.Barrier(2, timeout=10)
    seen: dict[int, tuple[str, tuple[str, int], tuple[str, int] | None]] = {}

    @locked("worker-{n}")
    def work(n: int) -> None:
        barrier.wait()  # both hold their lock at the same time
        lock = current_lock()
        assert lock is not None
        info = _document(lock.key)
        stored = None if info is None else (info.owner, info.token)
        seen[n] = (lock.key, (lock.owner, lock.token), stored)
        barrier.wait()

    threads = [threading.Thread(target=work, args=(n,)) for n in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert [seen[n][0] for n in (1, 2)] == ["worker-1", "worker-2"]
    # Each thread's lock is the stored holder of its own key, under its own owner id.
    # (Tokens grow per key only: two keys taken at one cluster time may share one.)
    assert seen[1][1][0] != seen[2][1][0]
    for n in (1, 2):
        assert seen[n][1] == seen[n][2], n


def test_decorating_connects_to_nothing(settings: Settings) -> None:
    settings.MONGOLOCK = {"URL": "mongodb://127.0.0.1:9/", "SERVER_SELECTION_TIMEOUT": 0.3}

    @locked("k-{x}")
    def work(x: int) -> None:
        raise AssertionError("must not run")

    assert conf._manager is None  # the default manager is not even built yet
    with pytest.raises(ServerUnavailable, match=r"127\.0\.0\.1:9"):
        work(1)


# -- key templates ---------------------------------------------------------------------------


def test_key_template_from_positional_keyword_and_default_arguments() -> None:
    @locked("invoice-{pk}-{fmt}-{user.id}-{{x}}")
    def render(pk: int, user: Any, fmt: str = "pdf") -> str:
        lock = current_lock()
        assert lock is not None
        return lock.key

    user = SimpleNamespace(id=5)
    assert render(7, user) == "invoice-7-pdf-5-{x}"
    assert render(pk=8, user=user, fmt="html") == "invoice-8-html-5-{x}"


def test_key_template_reads_var_keyword_arguments() -> None:
    @locked("page-{slug}")
    def view(*args: Any, **kwargs: Any) -> str:
        lock = current_lock()
        assert lock is not None
        return lock.key

    assert view(slug="home") == "page-home"


def test_template_naming_an_unknown_parameter_fails_at_decoration() -> None:
    def render(pk: int) -> None: ...

    with pytest.raises(TypeError, match=r"'invoice-\{id\}' names id, but .*render\(\) has no"):
        locked("invoice-{id}")(render)


def test_template_missing_at_call_time_is_an_error_not_a_wrong_key() -> None:
    calls = []

    @locked("page-{slug}")
    def view(**kwargs: Any) -> None:
        calls.append(kwargs)

    with pytest.raises(TypeError, match=r"names slug, which this call does not pass"):
        view(pk=1)
    assert calls == []
    assert locks.count() == 0


@pytest.mark.parametrize(
    ("key", "error", "match"),
    [
        (b"bytes", TypeError, "must be a str"),
        ("", ValueError, "must not be empty"),
        ("a\x00b", ValueError, "NUL"),
        ("x" * 1025, ValueError, "1025 bytes"),
        ("job-{}", ValueError, "must name an argument"),
        ("job-{0}", ValueError, "must name an argument"),
        ("job-{", ValueError, "invalid lock key template"),
        ("job-}", ValueError, "invalid lock key template"),
        ("job-{pk:{width}}", ValueError, "nests fields"),
    ],
)
def test_bad_keys_fail_at_decoration(key: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        locked(key)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"ttl": 0}, ValueError, "ttl must be > 0"),
        ({"ttl": "5"}, TypeError, "ttl must be a number"),
        ({"timeout": 5}, ValueError, "blocking=False"),
        ({"blocking": True, "timeout": -1}, ValueError, "timeout must be >= 0"),
        ({"on_busy": "ignore"}, ValueError, "on_busy must be"),
        ({"manager": "default"}, TypeError, "manager must be a LockManager"),
    ],
)
def test_bad_options_fail_at_decoration(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        locked("job", **options)


def test_formatted_key_goes_through_validation() -> None:
    @locked("job-{name}")
    def work(name: str) -> None:
        raise AssertionError("must not run")

    with pytest.raises(ValueError, match="NUL"):
        work("a\x00b")
    with pytest.raises(ValueError, match="bytes of UTF-8"):
        work("x" * 2000)
    with pytest.raises(ValueError, match="cannot format lock key template"):
        locked("job-{name.missing}")(lambda name: None)("x")
    assert locks.count() == 0


def test_bare_decorator_asks_for_a_key() -> None:
    def work() -> None: ...

    with pytest.raises(TypeError, match=r"write @locked\('name'\)"):
        locked(work)  # type: ignore[arg-type]


def test_not_callable_or_unsupported_class() -> None:
    with pytest.raises(TypeError, match="needs a function"):
        locked("job")(42)  # type: ignore[type-var]

    class Plain:
        pass

    with pytest.raises(TypeError, match=r"BaseCommand.*View"):
        locked("job")(Plain)


# -- on_busy ---------------------------------------------------------------------------------


def test_on_busy_skip_returns_none(hold: Any) -> None:
    hold("job")

    @locked("job", on_busy="skip")
    def work() -> int:
        raise AssertionError("must not run")

    assert work() is None


def test_on_busy_callable_gets_the_error_and_the_arguments(hold: Any) -> None:
    holder = hold("job-3")
    seen: list[Any] = []

    def fallback(error: LockNotAcquired, *args: Any, **kwargs: Any) -> str:
        seen.append((error, args, kwargs))
        return "later"

    @locked("job-{n}", on_busy=fallback)
    def work(n: int, *, flag: bool = False) -> str:
        raise AssertionError("must not run")

    assert work(3, flag=True) == "later"
    error, args, kwargs = seen[0]
    assert isinstance(error, LockNotAcquired)
    assert (error.key, error.holder) == ("job-3", holder.owner)
    assert (args, kwargs) == ((3,), {"flag": True})


def test_on_busy_raise_on_a_view(hold: Any) -> None:
    hold("page")

    @locked("page", on_busy="raise")
    def view(request: HttpRequest) -> HttpResponse:
        raise AssertionError("must not run")

    with pytest.raises(LockNotAcquired):
        view(rf.get("/"))


# -- coroutines ------------------------------------------------------------------------------


def test_async_function_free_and_acquired_on_the_event_loop(
    lock_events: list[tuple[str, Any]],
) -> None:
    acquiring_threads: list[int] = []

    def record(sender: Any, lock: Lock, **kwargs: Any) -> None:
        acquiring_threads.append(threading.get_ident())

    @locked("async-{n}")
    async def work(n: int) -> tuple[str, int]:
        await asyncio.sleep(0)
        lock = current_lock()
        assert lock is not None
        # Code run in a thread through the usual helpers sees the same lock.
        assert await asyncio.to_thread(current_lock) is lock
        assert await sync_to_async(current_lock)() is lock
        return lock.key, threading.get_ident()

    async def main() -> tuple[list[tuple[str, int]], int]:
        results = await asyncio.gather(work(1), work(2))
        return list(results), threading.get_ident()

    lock_acquired.connect(record)
    try:
        results, loop_thread = asyncio.run(main())
    finally:
        lock_acquired.disconnect(record)
    assert sorted(key for key, _ in results) == ["async-1", "async-2"]
    assert all(thread == loop_thread for _, thread in results)  # the body runs in the loop
    # Acquired through the async client, on the loop itself: no worker thread needed.
    assert acquiring_threads == [loop_thread, loop_thread]
    assert [name for name, _ in lock_events].count("released") == 2
    assert locks.count() == 0


def test_async_waiting_does_not_block_the_event_loop(hold: Any) -> None:
    hold("slow-async")
    ticks: list[float] = []

    @locked("slow-async", blocking=True, timeout=1.0)
    async def work() -> None:
        raise AssertionError("must not run")

    async def ticker() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.05)

    async def main() -> None:
        beat = asyncio.ensure_future(ticker())
        try:
            with pytest.raises(LockNotAcquired):
                await work()
        finally:
            beat.cancel()

    asyncio.run(main())
    # The loop kept running while the call waited a second for the lock.
    assert len(ticks) >= 10
    # A loop blocked by the call would show one gap of the whole second.
    assert max(b - a for a, b in itertools.pairwise(ticks)) < 0.9


def test_async_function_busy_and_on_busy_modes(hold: Any) -> None:
    holder = hold("async-job")

    @locked("async-job")
    async def default() -> None:
        raise AssertionError("must not run")

    @locked("async-job", on_busy="skip")
    async def skip() -> None:
        raise AssertionError("must not run")

    async def later(error: LockNotAcquired, n: int) -> str:
        await asyncio.sleep(0)
        return f"later {n} {error.holder}"

    @locked("async-job", on_busy=later)
    async def fallback(n: int) -> str:
        raise AssertionError("must not run")

    with pytest.raises(LockNotAcquired):
        asyncio.run(default())
    assert asyncio.run(skip()) is None
    assert asyncio.run(fallback(4)) == f"later 4 {holder.owner}"


def test_async_exception_and_cancellation_release_the_lock() -> None:
    @locked("async-fail")
    async def fail() -> None:
        raise RuntimeError("boom")

    @locked("async-slow")
    async def slow(ready: asyncio.Event) -> None:
        ready.set()
        await asyncio.sleep(30)

    async def main() -> None:
        ready = asyncio.Event()
        task = asyncio.create_task(slow(ready))
        await asyncio.wait_for(ready.wait(), 10)
        assert await asyncio.to_thread(_document, "async-slow") is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(fail())
    asyncio.run(main())
    assert locks.count() == 0


def test_cancelled_while_waiting_gives_a_late_lock_back(other: LockManager) -> None:
    holder = other.acquire("contended", ttl=30)

    @locked("contended", blocking=True, timeout=10)
    async def work() -> None:
        raise AssertionError("must not run")

    async def main() -> None:
        task = asyncio.create_task(work())
        await asyncio.sleep(0.2)  # the acquire now waits in its thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The waiting thread takes the lock once it is free, and gives it back at once.
        await asyncio.to_thread(holder.release)
        for _ in range(200):
            status = await asyncio.to_thread(_document, "contended")
            if status is None or status.token > holder.token:
                break
            await asyncio.sleep(0.02)
        for _ in range(200):
            if await asyncio.to_thread(_document, "contended") is None:
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the abandoned lock was not released")

    asyncio.run(main())


def test_introspection_is_kept() -> None:
    def plain(a: int, b: str = "x") -> str:
        """Plain docs."""
        return b * a

    async def coro(a: int) -> int:
        """Coroutine docs."""
        return a

    wrapped_plain = locked("p")(plain)
    wrapped_coro = locked("c")(coro)
    assert wrapped_plain.__name__ == "plain"
    assert wrapped_plain.__doc__ == "Plain docs."
    assert wrapped_plain.__wrapped__ is plain  # type: ignore[attr-defined]
    assert inspect.signature(wrapped_plain) == inspect.signature(plain)
    assert not inspect.iscoroutinefunction(wrapped_plain)
    assert not iscoroutinefunction(wrapped_plain)
    assert wrapped_coro.__name__ == "coro"
    assert inspect.signature(wrapped_coro) == inspect.signature(coro)
    assert inspect.iscoroutinefunction(wrapped_coro)
    assert iscoroutinefunction(wrapped_coro)


# -- function views --------------------------------------------------------------------------


def test_function_view_free() -> None:
    response = Client().get("/invoices/7/render/")
    assert response.status_code == 200
    text = response.content.decode()
    assert "invoice 7 rendered under lock 'invoice-7', fencing token " in text
    assert _document("invoice-7") is None


def test_function_view_busy_answers_423_with_retry_after(hold: Any) -> None:
    holder = hold("invoice-7", ttl=30)
    client = Client()
    response = client.get("/invoices/7/render/")
    assert response.status_code == 423
    assert response.reason_phrase == "Locked"
    assert holder.owner not in response.content.decode()  # no host names for clients
    retry_after = int(response["Retry-After"])
    assert 1 <= retry_after <= 30
    assert response["Content-Type"].startswith("text/plain")
    assert "invoice-7 is busy; retry in" in response.content.decode()
    assert "no-store" in response["Cache-Control"]
    # Other invoices are not affected.
    assert client.get("/invoices/8/render/").status_code == 200

    response = client.get("/invoices/7/render/", HTTP_ACCEPT="application/json")
    assert response.status_code == 423
    assert response["Content-Type"] == "application/json"
    body = json.loads(response.content)
    assert body["key"] == "invoice-7"
    assert body["retry_after"] == int(response["Retry-After"])
    assert "busy" in body["detail"]
    # A browser's Accept (*/* at a lower quality) gets text.
    browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
    response = client.get("/invoices/7/render/", HTTP_ACCEPT=browser)
    assert response["Content-Type"].startswith("text/plain")


def test_view_that_raises_releases_the_lock() -> None:
    @locked("broken-{pk}")
    def view(request: HttpRequest, pk: int) -> HttpResponse:
        raise ValueError("bad invoice")

    with pytest.raises(ValueError, match="bad invoice"):
        view(rf.get("/"), pk=1)
    assert _document("broken-1") is None


def test_retry_after_is_at_least_one_second(hold: Any) -> None:
    hold("tiny", ttl=0.9)  # kept alive by the refresher, never more than 0.9 s left

    @locked("tiny")
    def view(request: HttpRequest) -> HttpResponse:
        raise AssertionError("must not run")

    response = view(rf.get("/"))
    assert response.status_code == 423
    assert response["Retry-After"] == "1"


def test_view_on_busy_skip_and_callable(hold: Any) -> None:
    hold("page-1")

    @locked("page-{pk}", on_busy="skip")
    def skipping(request: HttpRequest, pk: int) -> HttpResponse:
        raise AssertionError("must not run")

    def busy_page(error: LockNotAcquired, request: HttpRequest, pk: int) -> HttpResponse:
        return HttpResponse(f"page {pk} is being rebuilt", status=503)

    @locked("page-{pk}", on_busy=busy_page)
    def custom(request: HttpRequest, pk: int) -> HttpResponse:
        raise AssertionError("must not run")

    response = skipping(rf.get("/"), pk=1)
    assert (response.status_code, response.content) == (204, b"")
    response = custom(rf.get("/"), pk=1)
    assert (response.status_code, response.content) == (503, b"page 1 is being rebuilt")


def test_async_function_view(hold: Any) -> None:
    @locked("feed-{name}")
    async def feed(request: HttpRequest, name: str) -> HttpResponse:
        lock = current_lock()
        assert lock is not None
        return HttpResponse(lock.key)

    response = asyncio.run(feed(rf.get("/"), name="news"))
    assert (response.status_code, response.content) == (200, b"feed-news")
    hold("feed-news")
    response = asyncio.run(feed(rf.get("/"), name="news"))
    assert response.status_code == 423
    assert int(response["Retry-After"]) >= 1


# -- class-based views -----------------------------------------------------------------------


@locked("report-{slug}")
class ReportView(View):
    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        lock = current_lock()
        assert lock is not None
        return HttpResponse(f"{lock.key} {lock.token}")


@locked("feed-{slug}")
class AsyncFeedView(View):
    async def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        await asyncio.sleep(0)
        lock = current_lock()
        assert lock is not None
        assert await asyncio.to_thread(_document, lock.key) is not None
        return JsonResponse({"key": lock.key})


@method_decorator(locked("export-{pk}"), name="dispatch")
class ExportView(View):
    def get(self, request: HttpRequest, pk: int) -> HttpResponse:
        lock = current_lock()
        assert lock is not None
        return HttpResponse(lock.key)


class HandlerView(View):
    @locked("archive-{pk}")
    def post(self, request: HttpRequest, pk: int) -> HttpResponse:
        lock = current_lock()
        assert lock is not None
        return HttpResponse(lock.key)

    @method_decorator(locked("archive-{pk}"))
    def put(self, request: HttpRequest, pk: int) -> HttpResponse:
        lock = current_lock()
        assert lock is not None
        return HttpResponse(lock.key)


def test_class_view_decorated_on_the_class(hold: Any) -> None:
    view = ReportView.as_view()
    response = _respond(view, rf.get("/"), slug="daily")
    assert response.status_code == 200
    assert response.content.decode().startswith("report-daily ")
    assert _document("report-daily") is None
    assert ReportView.dispatch.__wrapped__ is View.dispatch  # type: ignore[attr-defined]
    assert View.dispatch is not ReportView.dispatch  # the base class is left alone
    hold("report-daily")
    response = _respond(view, rf.get("/"), slug="daily")
    assert response.status_code == 423
    assert _respond(view, rf.get("/"), slug="weekly").status_code == 200


def test_async_class_view_decorated_on_the_class(hold: Any) -> None:
    view = AsyncFeedView.as_view()
    assert iscoroutinefunction(view)
    assert inspect.iscoroutinefunction(AsyncFeedView.dispatch)
    response = _respond(view, rf.get("/"), slug="news")
    assert (response.status_code, json.loads(response.content)) == (200, {"key": "feed-news"})
    assert _document("feed-news") is None
    hold("feed-news")
    response = _respond(view, rf.get("/"), slug="news")
    assert response.status_code == 423


def test_class_view_with_method_decorator_on_dispatch(hold: Any) -> None:
    view = ExportView.as_view()
    response = _respond(view, rf.get("/"), pk=3)
    assert (response.status_code, response.content) == (200, b"export-3")
    hold("export-3")
    assert _respond(view, rf.get("/"), pk=3).status_code == 423


def test_class_view_decorated_on_a_handler(hold: Any) -> None:
    view = HandlerView.as_view()
    assert _respond(view, rf.post("/"), pk=9).content == b"archive-9"
    assert _respond(view, rf.put("/"), pk=9).content == b"archive-9"
    hold("archive-9")
    for request in (rf.post("/"), rf.put("/")):
        response = _respond(view, request, pk=9)
        assert response.status_code == 423
        assert int(response["Retry-After"]) >= 1


def test_sync_dispatch_of_an_async_view_holds_the_lock_until_it_finished() -> None:
    class Slow(View):
        @locked("slow-view")
        def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return super().dispatch(request, *args, **kwargs)

        async def get(self, request: HttpRequest) -> HttpResponse:
            await asyncio.sleep(0.05)
            assert await asyncio.to_thread(_document, "slow-view") is not None
            lock = current_lock()
            return HttpResponse(lock.key if lock else "")

    response = _respond(Slow.as_view(), rf.get("/"))
    assert response.content == b"slow-view"
    assert _document("slow-view") is None


# -- management commands ---------------------------------------------------------------------


class HandleCommand(BaseCommand):
    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--source", default="crm")

    @locked("sync-{source}")
    def handle(self, *args: Any, **options: Any) -> None:
        lock = current_lock()
        assert lock is not None
        self.stdout.write(f"synced under {lock.key} token {lock.token}")


@locked("nightly")
class ClassCommand(BaseCommand):
    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--fail", action="store_true")

    def handle(self, *args: Any, fail: bool, **options: Any) -> None:
        lock = current_lock()
        assert lock is not None
        if fail:
            raise CommandError("the job failed")
        self.stdout.write(f"nightly token {lock.token}")


@locked("nightly", on_busy="skip")
class SkippingCommand(BaseCommand):
    def handle(self, *args: Any, **options: Any) -> None:
        raise AssertionError("must not run")


@pytest.mark.parametrize(
    ("command", "args", "key"),
    [
        (HandleCommand, ("--source", "erp"), "sync-erp"),
        (HandleCommand, (), "sync-crm"),
        (ClassCommand, (), "nightly"),
    ],
)
def test_command_free_then_busy(
    command: type[BaseCommand], args: tuple[str, ...], key: str, hold: Any
) -> None:
    out, err, code = _run(command(), *args)
    assert (code, err) == (0, "")
    assert "token" in out
    assert _document(key) is None
    holder = hold(key)
    out, err, code = _run(command(), *args)
    assert code == BUSY_EXIT_CODE == 75
    assert out == ""
    assert f"lock {key!r} is held by {holder.owner} until " in err
    assert holder.expires_at.strftime("%Y-%m-%d %H:%M:%S UTC") in err
    assert "not run" in err
    assert "75" in err


def test_command_class_keeps_its_identity() -> None:
    assert isinstance(ClassCommand(), BaseCommand)
    assert ClassCommand.handle.__name__ == "handle"
    assert "handle" in vars(ClassCommand)
    assert BaseCommand.handle is not ClassCommand.handle


def test_command_error_inside_releases_and_keeps_its_exit_status() -> None:
    _, err, code = _run(ClassCommand(), "--fail")
    assert (code, err) == (1, "the job failed")
    assert _document("nightly") is None


def test_command_on_busy_skip_exits_zero_with_a_notice(hold: Any) -> None:
    holder = hold("nightly")
    out, err, code = _run(SkippingCommand())
    assert (code, err) == (0, "")
    assert out.count("\n") == 1
    assert "skipped; lock 'nightly' is held by " + holder.owner in out
    out, err, code = _run(SkippingCommand(), "--verbosity", "0")
    assert (out, err, code) == ("", "", 0)


def test_command_server_error_is_not_busy(settings: Settings) -> None:
    settings.MONGOLOCK = {"URL": "mongodb://127.0.0.1:9/", "SERVER_SELECTION_TIMEOUT": 0.3}
    _, err, code = _run(ClassCommand())
    assert code == 2
    assert "127.0.0.1:9" in err


# -- signals ---------------------------------------------------------------------------------


def test_signals_when_force_released_while_running(
    lock_events: list[tuple[str, Any]], other: LockManager
) -> None:
    @locked("signalled")
    def work() -> None:
        lock = current_lock()
        assert lock is not None
        assert other.force_release("signalled") is not None
        lock.refresh()

    with pytest.raises(LockLost, match="signalled"):
        work()
    names = [name for name, _ in lock_events]
    assert names == ["acquired", "lost", "released"]
    lock = lock_events[0][1]
    assert all(event_lock is lock for _, event_lock in lock_events)
    assert not lock.valid
    assert lock.lost.is_set()


def test_signals_from_a_view_and_a_command(lock_events: list[tuple[str, Any]]) -> None:
    assert Client().get("/invoices/1/render/").status_code == 200
    _run(ClassCommand())
    assert [(name, lock.key) for name, lock in lock_events] == [
        ("acquired", "invoice-1"),
        ("released", "invoice-1"),
        ("acquired", "nightly"),
        ("released", "nightly"),
    ]


def test_wrapped_partial_binds_without_self() -> None:
    class Thing:
        def run(self, pk: int) -> str:
            lock = current_lock()
            assert lock is not None
            return lock.key

    thing = Thing()
    bound = functools.wraps(Thing.run)(functools.partial(thing.run))
    assert locked("thing-{pk}")(bound)(5) == "thing-5"


# -- generators and async generators ---------------------------------------------------------


def test_generator_holds_the_lock_across_the_iteration(other: LockManager) -> None:
    seen: list[Lock | None] = []

    @locked("stream-{n}")
    def stream(n: int) -> Iterator[int]:
        for i in range(n):
            lock = current_lock()
            seen.append(lock)
            yield i

    items = stream(3)
    assert inspect.isgeneratorfunction(stream)
    assert _document("stream-3") is None  # nothing is taken before the first next()
    assert next(items) == 0
    held = _document("stream-3")
    assert held is not None
    assert current_lock() is None  # the caller, between two steps, holds nothing
    with pytest.raises(LockNotAcquired):
        other.acquire("stream-3", blocking=False)
    assert list(items) == [1, 2]
    assert _document("stream-3") is None
    assert len({id(lock) for lock in seen}) == 1
    assert seen[0] is not None
    assert seen[0].token == held.token


def test_generator_passes_send_throw_and_its_return_value() -> None:
    @locked("echo")
    def echo() -> Generator[str, str, str]:
        received = ""
        while received != "stop":
            try:
                received = yield f"got {received}"
            except KeyError:
                received = yield "caught"
        return "done"

    gen = echo()
    assert next(gen) == "got "
    assert gen.send("a") == "got a"
    assert gen.throw(KeyError("x")) == "caught"
    assert _document("echo") is not None
    with pytest.raises(StopIteration) as stop:
        gen.send("stop")
    assert stop.value.value == "done"
    assert _document("echo") is None


def test_generator_releases_on_close_exception_and_garbage_collection() -> None:
    cleaned: list[str] = []

    @locked("gen-{name}")
    def numbers(name: str, fail: bool = False) -> Generator[int]:
        try:
            yield 1
            if fail:
                raise RuntimeError("boom")
            yield 2
        finally:
            cleaned.append(name)
            assert current_lock() is not None  # the body's cleanup still runs under it

    closed = numbers("closed")
    assert next(closed) == 1
    closed.close()
    assert _document("gen-closed") is None

    failing = numbers("failing", fail=True)
    assert next(failing) == 1
    with pytest.raises(RuntimeError, match="boom"):
        next(failing)
    assert _document("gen-failing") is None

    dropped = numbers("dropped")
    assert next(dropped) == 1
    assert _document("gen-dropped") is not None
    del dropped
    gc.collect()
    assert _document("gen-dropped") is None
    assert cleaned == ["closed", "failing", "dropped"]


def test_generator_busy(hold: Any) -> None:
    holder = hold("busy-stream")

    @locked("busy-stream")
    def default() -> Iterator[int]:
        raise AssertionError("must not run")
        yield 0

    @locked("busy-stream", on_busy="skip")
    def skip() -> Iterator[int]:
        raise AssertionError("must not run")
        yield 0

    @locked("busy-stream", on_busy=lambda error: ["cached", error.holder])
    def fallback() -> Iterator[str]:
        raise AssertionError("must not run")
        yield ""

    with pytest.raises(LockNotAcquired):
        next(default())
    assert list(skip()) == []
    assert list(fallback()) == ["cached", holder.owner]


def test_async_generator_holds_the_lock_across_the_iteration(other: LockManager) -> None:
    @locked("astream")
    async def astream() -> AsyncIterator[int]:
        for i in range(3):
            await asyncio.sleep(0)
            assert current_lock() is not None
            yield i

    async def main() -> list[int]:
        items = astream()
        first = await anext(items)
        assert current_lock() is None
        assert await asyncio.to_thread(_document, "astream") is not None
        with pytest.raises(LockNotAcquired):
            await asyncio.to_thread(other.acquire, "astream", blocking=False)
        return [first] + [item async for item in items]

    assert inspect.isasyncgenfunction(astream)
    assert asyncio.run(main()) == [0, 1, 2]
    assert _document("astream") is None


def test_async_generator_releases_on_aclose_exception_and_loop_shutdown() -> None:
    cleaned: list[str] = []

    @locked("agen-{name}")
    async def numbers(name: str, fail: bool = False) -> AsyncGenerator[int]:
        try:
            yield 1
            if fail:
                raise RuntimeError("boom")
            yield 2
        finally:
            cleaned.append(name)

    async def main() -> AsyncGenerator[int]:
        closed = numbers("closed")
        assert await anext(closed) == 1
        await closed.aclose()
        assert await asyncio.to_thread(_document, "agen-closed") is None

        failing = numbers("failing", fail=True)
        assert await anext(failing) == 1
        with pytest.raises(RuntimeError, match="boom"):
            await anext(failing)
        assert await asyncio.to_thread(_document, "agen-failing") is None

        abandoned = numbers("abandoned")
        assert await anext(abandoned) == 1
        assert await asyncio.to_thread(_document, "agen-abandoned") is not None
        return abandoned  # still suspended when the loop shuts down

    left = asyncio.run(main())
    assert _document("agen-abandoned") is None  # asyncio.run closed it, which released
    assert cleaned == ["closed", "failing", "abandoned"]
    del left


def test_async_generator_busy(hold: Any) -> None:
    holder = hold("busy-astream")

    @locked("busy-astream")
    async def default() -> AsyncIterator[int]:
        raise AssertionError("must not run")
        yield 0

    @locked("busy-astream", on_busy="skip")
    async def skip() -> AsyncIterator[int]:
        raise AssertionError("must not run")
        yield 0

    async def later(error: LockNotAcquired) -> list[str]:
        await asyncio.sleep(0)
        return ["cached", error.holder or ""]

    @locked("busy-astream", on_busy=later)
    async def fallback() -> AsyncIterator[str]:
        raise AssertionError("must not run")
        yield ""

    async def main() -> tuple[list[int], list[str]]:
        with pytest.raises(LockNotAcquired):
            await anext(default())
        return [i async for i in skip()], [s async for s in fallback()]

    assert asyncio.run(main()) == ([], ["cached", holder.owner])


# -- what a busy command prints ----------------------------------------------------------------

TERMINAL_CONTROLS = frozenset(
    map(chr, [*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)])
)


def test_busy_command_escapes_the_key_and_the_holder(mongolock_url: str) -> None:
    """A holder named to inject escape sequences, on a key built from a hostile option."""
    owner = "evil\x1b[2J\r\n\u202e\x9b"
    source = "\x1b]0;title\x07\n\u2067"
    with LockManager(mongolock_url, database=conf.get_manager().database, owner=owner) as evil:
        evil.acquire(f"sync-{source}", ttl=30)
        out, err, code = _run(HandleCommand(), "--source", source)
    assert code == BUSY_EXIT_CODE
    assert out == ""
    assert not set(err) & TERMINAL_CONTROLS
    assert r"lock 'sync-\x1b]0;title\x07\n\u2067' is held by evil\x1b[2J\r\n\u202e\x9b:" in err


def test_skipped_command_notice_escapes_the_holder(mongolock_url: str) -> None:
    owner = "evil\x1b[2J\n\u202e"
    with LockManager(mongolock_url, database=conf.get_manager().database, owner=owner) as evil:
        evil.acquire("nightly", ttl=30)
        out, err, code = _run(SkippingCommand())
    assert (code, err) == (0, "")
    assert not set(out.rstrip("\n")) & TERMINAL_CONTROLS
    assert r"skipped; lock 'nightly' is held by evil\x1b[2J\n\u202e:" in out
