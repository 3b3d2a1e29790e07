"""The async API: the same locks through pymongo's async client, without blocking the loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from django_mongolock import Lock, LockLost, LockManager, LockNotAcquired


def test_aacquire_and_arelease(manager: LockManager, other: LockManager) -> None:
    async def main() -> tuple[Lock, bool]:
        lock = await manager.aacquire("async-job", ttl=10)
        assert lock.valid
        with pytest.raises(LockNotAcquired, match=lock.owner):
            await other.aacquire("async-job", blocking=False)
        # The sync API sees the same lock.
        with pytest.raises(LockNotAcquired):
            other.acquire("async-job", blocking=False)
        await lock.arefresh(ttl=20)
        assert lock.ttl == 20
        return lock, await lock.arelease()

    lock, held = asyncio.run(main())
    assert held is True
    assert not lock.valid
    assert manager.status("async-job") is None


def test_alock_releases_on_error_and_tokens_grow(manager: LockManager) -> None:
    tokens: list[int] = []

    async def fail() -> None:
        async with manager.alock("ctx", ttl=10) as lock:
            tokens.append(lock.token)
            assert manager.status("ctx") is not None
            raise RuntimeError("boom")

    async def main() -> None:
        with pytest.raises(RuntimeError, match="boom"):
            await fail()
        async with manager.alock("ctx", ttl=10) as lock:
            tokens.append(lock.token)

    asyncio.run(main())
    assert tokens == sorted(set(tokens))
    assert manager.status("ctx") is None


def test_an_async_waiter_times_out_and_wakes_on_release(
    manager: LockManager, other: LockManager
) -> None:
    holder = manager.acquire("wait", ttl=30)

    async def main() -> tuple[float, Lock]:
        started = time.monotonic()
        with pytest.raises(LockNotAcquired, match="gave up after waiting"):
            await other.aacquire("wait", timeout=0.3)
        assert time.monotonic() - started >= 0.3
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, holder.release)
        started = time.monotonic()
        lock = await other.aacquire("wait", timeout=10)
        return time.monotonic() - started, lock

    waited, lock = asyncio.run(main())
    assert lock.token > holder.token
    assert waited < 5
    lock.release()


def test_many_tasks_lose_no_update(manager: LockManager) -> None:
    state = {"value": 0, "inside": 0, "overlaps": 0}

    async def work() -> None:
        for _ in range(3):
            async with manager.alock("counter", ttl=30, timeout=60):
                state["inside"] += 1
                if state["inside"] != 1:
                    state["overlaps"] += 1
                value = state["value"]
                await asyncio.sleep(0.001)
                state["value"] = value + 1
                state["inside"] -= 1

    async def main() -> None:
        await asyncio.gather(*(work() for _ in range(40)))

    asyncio.run(main())
    assert state == {"value": 120, "inside": 0, "overlaps": 0}


def test_async_shared_locks_and_semaphores(manager: LockManager) -> None:
    async def main() -> int:
        readers = [await manager.aacquire("shelf", shared=True, limit=3) for _ in range(3)]
        with pytest.raises(LockNotAcquired, match="3/3 shared holders"):
            await manager.aacquire("shelf", shared=True, limit=3, blocking=False)
        with pytest.raises(LockNotAcquired):
            await manager.aacquire("shelf", blocking=False)
        for reader in readers:
            assert await reader.arelease()
        async with manager.alock("shelf") as writer:
            return writer.token

    token = asyncio.run(main())
    assert token > 0
    assert manager.status("shelf") is None


def test_a_cancelled_waiter_leaves_nothing_held(manager: LockManager, other: LockManager) -> None:
    holder = manager.acquire("cancel", ttl=30)

    async def main() -> None:
        task = asyncio.ensure_future(other.aacquire("cancel", timeout=30))
        await asyncio.sleep(0.3)
        holder.release()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # A lock the attempt took meanwhile is given back (bounded: on a loaded machine
        # the giving back may take longer than any fixed pause).
        for _ in range(500):
            if manager.status("cancel") is None:
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    time.sleep(0.2)
    assert manager.status("cancel") is None


def test_arefresh_of_a_lost_lock_raises(manager: LockManager, other: LockManager) -> None:
    async def main() -> None:
        lock = await manager.aacquire("lost", ttl=30)
        other.force_release("lost")
        with pytest.raises(LockLost):
            await lock.arefresh()
        assert lock.lost.is_set()
        assert await lock.arelease() is False

    asyncio.run(main())


def test_the_async_api_needs_a_url(mongolock_url: str) -> None:
    from pymongo import MongoClient

    client: MongoClient[dict[str, object]] = MongoClient(mongolock_url)
    try:
        manager = LockManager(client=client, database="given_client")

        async def main() -> None:
            with pytest.raises(Exception, match="built from a URL"):
                await manager.aacquire("x")

        asyncio.run(main())
    finally:
        client.close()


def test_aclose_closes_this_loops_client(manager: LockManager) -> None:
    async def main() -> None:
        lock = await manager.aacquire("closing")
        await lock.arelease()
        await manager.aclose()
        # A new client is built on next use.
        again = await manager.aacquire("closing")
        await again.arelease()

    asyncio.run(main())


def test_a_waiter_cancelled_as_it_is_woken_ends_and_takes_nothing(
    manager: LockManager, other: LockManager
) -> None:
    """A cancellation that arrives with the wake-up is not lost (a swallowed one would leave
    the task waiting in line for good, and holding the lock once its turn came)."""
    holder = manager.acquire("woken", ttl=30)

    async def main() -> None:
        task = asyncio.ensure_future(other.aacquire("woken"))  # waits without a timeout
        async with asyncio.timeout(10):
            while (info := manager.status("woken")) is None or info.waiting < 1:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # asleep on its wake-up, past its first attempt
        other.waiters.notify("woken")  # what the watcher does on a release
        await asyncio.sleep(0)  # the wake-up is delivered: the waiter's sleep is over...
        task.cancel()  # ...just as it is cancelled
        await asyncio.wait([task], timeout=10)
        assert task.cancelled()

    asyncio.run(main())
    assert holder.release() is True
    assert manager.status("woken") is None
