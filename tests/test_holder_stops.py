"""Holders stopped when they lose: ``lk.check()`` and ``alock(..., cancel_on_loss=True)``."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from django_mongolock import Lock, LockLost, LockManager


def _wait_lost(lock: Lock) -> None:
    assert lock.lost.wait(10), "the loss was not noticed"


# -- check() ---------------------------------------------------------------------------------


def test_check_passes_while_held_and_names_the_release(manager: LockManager) -> None:
    lock = manager.acquire("check-released", ttl=10)
    lock.check()
    lock.release()
    with pytest.raises(LockLost, match="it was released") as caught:
        lock.check()
    assert (caught.value.key, caught.value.owner, caught.value.token) == (
        "check-released",
        lock.owner,
        lock.token,
    )


def test_check_raises_once_a_force_release_is_noticed(
    manager: LockManager, other: LockManager
) -> None:
    lock = manager.acquire("check-forced", ttl=0.9)
    assert other.force_release("check-forced") is not None
    _wait_lost(lock)
    with pytest.raises(LockLost, match=r"released by somebody else|not extended|lease") as caught:
        lock.check()
    assert caught.value.token == lock.token
    assert caught.value.reason


def test_check_raises_past_the_local_deadline_without_io(manager: LockManager) -> None:
    lock = manager.acquire("check-lapsed", ttl=1.0, refresh=False)
    lock.check()  # a fresh lease passes
    deadline = time.monotonic() + 10
    # Check until it raises, then ask whether the lease had ended: reading `remaining`
    # first and checking after would race the lease's end between the two calls.
    reason = ""
    while not reason:
        try:
            lock.check()
        except LockLost as lost:
            reason = lost.reason
        assert time.monotonic() < deadline, "the lease never ended"
        time.sleep(0.01)
    assert "lease ended" in reason
    assert lock.remaining == 0
    assert lock.lost.is_set()
    with pytest.raises(LockLost, match="lease ended"):
        lock.check()


def test_check_in_a_forked_child_raises(manager: LockManager) -> None:
    lock = manager.acquire("check-fork", ttl=10)
    pid = os.fork()
    if pid == 0:  # the child: the lock is its parent's
        try:
            lock.check()
        except LockLost as lost:
            os._exit(0 if "forked child" in lost.reason else 3)
        except BaseException:
            os._exit(4)
        os._exit(5)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    lock.check()  # still the parent's
    lock.release()


# -- loss hooks --------------------------------------------------------------------------------


def test_a_loss_hook_runs_when_lost_is_set_and_not_after_removal(manager: LockManager) -> None:
    calls: list[str] = []
    lock = manager.acquire("hooks", ttl=1.0, refresh=False)
    assert lock.add_loss_hook(lambda: calls.append("kept"))
    removed = lambda: calls.append("removed")  # noqa: E731
    assert lock.add_loss_hook(removed)
    lock.remove_loss_hook(removed)
    _wait_lost(lock)
    assert calls == ["kept"]
    assert not lock.add_loss_hook(lambda: calls.append("late"))
    assert calls == ["kept"]


# -- cancel_on_loss ----------------------------------------------------------------------------


def test_a_force_release_cancels_the_block_with_lock_lost(
    manager: LockManager, other: LockManager
) -> None:
    held: list[Lock] = []

    async def block() -> None:
        async with asyncio.timeout(20):
            async with manager.alock("cancel-forced", ttl=0.9, cancel_on_loss=True) as lock:
                held.append(lock)
                await asyncio.to_thread(other.force_release, "cancel-forced")
                await asyncio.sleep(30)
                pytest.fail("the block went on after its lock was lost")

    async def main() -> tuple[Lock | None, LockLost]:
        with pytest.raises(LockLost) as caught:
            await block()
        assert isinstance(caught.value.__cause__, asyncio.CancelledError)
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        return held[0], caught.value

    lock, lost = asyncio.run(main())
    assert lock is not None
    assert (lost.key, lost.owner, lost.token) == ("cancel-forced", lock.owner, lock.token)
    assert lock.lost.is_set()


def test_the_deadline_watch_cancels_a_block_whose_lease_ends(manager: LockManager) -> None:
    async def block() -> None:
        async with asyncio.timeout(20):
            async with manager.alock("cancel-lapsed", ttl=0.4, refresh=False, cancel_on_loss=True):
                await asyncio.sleep(30)

    async def main() -> LockLost:
        with pytest.raises(LockLost) as caught:
            await block()
        return caught.value

    lost = asyncio.run(main())
    assert "lease ended" in lost.reason


def test_a_block_that_ends_in_time_completes_and_releases(manager: LockManager) -> None:
    async def main() -> Lock:
        async with manager.alock("cancel-normal", ttl=5, cancel_on_loss=True) as lock:
            await asyncio.sleep(0.05)
            assert manager.status("cancel-normal") is not None
        # Lost after the block: nothing is cancelled any more.
        await asyncio.sleep(0.05)
        return lock

    lock = asyncio.run(main())
    assert lock.released
    assert manager.status("cancel-normal") is None


def test_a_cancellation_from_outside_stays_cancelled(manager: LockManager) -> None:
    async def main() -> None:
        entered = asyncio.Event()

        async def block() -> None:
            async with manager.alock("cancel-outside", ttl=5, cancel_on_loss=True):
                entered.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(block())
        await asyncio.wait_for(entered.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert manager.status("cancel-outside") is None


def test_a_loss_and_a_cancellation_from_outside_stay_cancelled(manager: LockManager) -> None:
    async def main() -> None:
        async def block() -> None:
            async with manager.alock(
                "cancel-both", ttl=0.3, refresh=False, cancel_on_loss=True
            ) as lock:
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    assert lock.lost.is_set()
                    # Somebody else cancels the task too, before the block ends.
                    asyncio.current_task().cancel()  # type: ignore[union-attr]
                    raise

        task = asyncio.create_task(block())
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)

    asyncio.run(main())


def test_cancel_on_loss_needs_async_with(manager: LockManager) -> None:
    context = manager.lock("cancel-sync", cancel_on_loss=True)
    with pytest.raises(TypeError, match="async with"):
        context.__enter__()
    assert manager.status("cancel-sync") is None
    with pytest.raises(TypeError, match="cancel_on_loss"):
        manager.alock("cancel-sync", cancel_on_loss=1)  # type: ignore[arg-type]


def test_the_cancel_does_not_wait_for_the_loss_notices(manager: LockManager) -> None:
    """The block is cancelled when ``lost`` is set, even while a lock_lost receiver blocks."""
    from django_mongolock.signals import lock_lost

    unblock = threading.Event()
    in_receiver = threading.Event()

    def slow_receiver(sender: object, lock: Lock, **kwargs: object) -> None:
        in_receiver.set()
        unblock.wait(60)  # longer than the block's bound: a cancel behind it would time out

    lock_lost.connect(slow_receiver, weak=False)
    try:

        async def block() -> None:
            async with asyncio.timeout(20):
                async with manager.alock(
                    "cancel-first", ttl=0.4, refresh=False, cancel_on_loss=True
                ):
                    await asyncio.sleep(30)

        async def main() -> None:
            with pytest.raises(LockLost):
                await block()

        asyncio.run(main())
    finally:
        unblock.set()
        lock_lost.disconnect(slow_receiver)
    assert in_receiver.wait(10)
