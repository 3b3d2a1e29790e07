"""``reentrant=True``: the same thread or task taking a lock it holds gets it again, counted."""

from __future__ import annotations

import asyncio
import threading

import pytest

from django_mongolock import Lock, LockManager, LockNotAcquired


def _refused_elsewhere(manager: LockManager, key: str) -> bool:
    """Whether another thread, asking reentrantly, is refused ``key``."""
    refused: list[bool] = []

    def attempt() -> None:
        try:
            manager.acquire(key, blocking=False, reentrant=True).release()
            refused.append(False)
        except LockNotAcquired:
            refused.append(True)

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    return refused[0]


def test_nested_blocks_in_one_thread_share_the_handle_until_the_outer_exit(
    manager: LockManager,
) -> None:
    with manager.lock("re-nested", ttl=10, reentrant=True) as outer:
        assert outer.holds == 1
        with manager.lock("re-nested", ttl=10, reentrant=True, blocking=False) as inner:
            assert inner is outer
            assert inner.token == outer.token
            assert outer.holds == 2
            assert _refused_elsewhere(manager, "re-nested")
        assert outer.holds == 1
        assert outer.valid
        info = manager.status("re-nested")
        assert info is not None
        assert info.live
        assert info.token == outer.token
        assert _refused_elsewhere(manager, "re-nested")
    assert outer.released
    assert not outer.valid
    assert manager.status("re-nested") is None


def test_inner_releases_count_down_and_return_true(manager: LockManager) -> None:
    lock = manager.acquire("re-count", ttl=10, reentrant=True)
    assert manager.acquire("re-count", reentrant=True) is lock
    assert manager.acquire("re-count", reentrant=True) is lock
    assert lock.holds == 3
    assert lock.release() is True
    assert lock.release() is True
    assert manager.status("re-count") is not None
    assert lock.release() is True
    assert manager.status("re-count") is None
    assert lock.release() is False
    # Released: the next reentrant acquire takes a new lock.
    again = manager.acquire("re-count", ttl=10, reentrant=True)
    assert again is not lock
    assert again.token > lock.token
    again.release()


def test_not_reentrant_by_default(manager: LockManager) -> None:
    with manager.lock("re-default", ttl=10):
        with pytest.raises(LockNotAcquired):
            manager.acquire("re-default", blocking=False)
        # Only handles taken reentrantly are re-entered.
        with pytest.raises(LockNotAcquired):
            manager.acquire("re-default", blocking=False, reentrant=True)


def test_another_manager_is_another_holder(manager: LockManager, other: LockManager) -> None:
    with manager.lock("re-managers", ttl=10, reentrant=True), pytest.raises(LockNotAcquired):
        other.acquire("re-managers", blocking=False, reentrant=True)


def test_two_tasks_are_two_holders(manager: LockManager) -> None:
    async def main() -> tuple[Lock, Lock]:
        async with manager.alock("re-tasks", ttl=10, reentrant=True) as outer:
            async with manager.alock("re-tasks", ttl=10, reentrant=True, blocking=False) as inner:
                assert inner is outer
                assert outer.holds == 2

            async def other_task() -> None:
                await manager.aacquire("re-tasks", blocking=False, reentrant=True)

            with pytest.raises(LockNotAcquired):
                await asyncio.create_task(other_task())
            assert outer.valid
            return outer, inner

    outer, _ = asyncio.run(main())
    assert outer.released
    assert manager.status("re-tasks") is None


def test_two_tasks_calling_the_sync_acquire_are_two_holders(manager: LockManager) -> None:
    """One loop's thread runs both tasks: the sync acquire must still tell them apart."""

    async def main() -> tuple[Lock, BaseException | Lock]:
        first = manager.acquire("re-sync-tasks", ttl=10, reentrant=True, blocking=False)
        try:

            async def other_task() -> Lock:
                return manager.acquire("re-sync-tasks", ttl=10, reentrant=True, blocking=False)

            try:
                second: BaseException | Lock = await asyncio.create_task(other_task())
            except LockNotAcquired as refused:
                second = refused
            again = manager.acquire("re-sync-tasks", ttl=10, reentrant=True, blocking=False)
            assert again is first  # the task that holds it does re-enter
            first.release()
            return first, second
        finally:
            first.release()

    first, second = asyncio.run(main())
    assert isinstance(second, LockNotAcquired), "the second task was handed the first's handle"
    assert first.released
    assert manager.status("re-sync-tasks") is None


def test_a_lost_handle_is_not_handed_out_again(manager: LockManager) -> None:
    lost = manager.acquire("re-lost", ttl=0.3, refresh=False, reentrant=True)
    assert lost.lost.wait(10)
    fresh = manager.acquire("re-lost", ttl=10, reentrant=True, timeout=10)
    assert fresh is not lost
    assert fresh.token > lost.token
    assert fresh.holds == 1
    assert fresh.valid
    assert lost.release() is False
    assert fresh.valid
    fresh.release()
    assert manager.status("re-lost") is None


def test_reentrant_arguments_are_checked(manager: LockManager) -> None:
    with pytest.raises(ValueError, match="shared"):
        manager.acquire("re-bad", shared=True, reentrant=True)
    with pytest.raises(TypeError, match="reentrant"):
        manager.acquire("re-bad", reentrant=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shared"):
        manager.lock("re-bad", shared=True, reentrant=True)
    assert manager.status("re-bad") is None
