"""The lock engine against the real replica set: exclusivity, leases, tokens, waiting."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from django_mongolock import Lock, LockLost, LockManager, LockNotAcquired
from tests.utils import ROOT, answer_of, finished


def test_acquire_and_release(manager: LockManager, lock_events: list[tuple[str, Any]]) -> None:
    lock = manager.acquire("job", ttl=10)
    assert isinstance(lock, Lock)
    assert lock.key == "job"
    assert lock.valid
    assert not lock.lost.is_set()
    assert lock.expires_at - lock.acquired_at == timedelta(seconds=10)
    assert lock.owner.count(":") == 2
    status = manager.status("job")
    assert status is not None
    assert (status.owner, status.token, status.live) == (lock.owner, lock.token, True)
    assert lock.release() is True
    assert not lock.valid
    assert manager.status("job") is None
    assert lock.release() is False
    assert [name for name, _ in lock_events] == ["acquired", "released"]
    assert all(event_lock is lock for _, event_lock in lock_events)


def test_busy_lock_names_holder_and_lease_end(manager: LockManager, other: LockManager) -> None:
    holder = manager.acquire("report", ttl=30)
    with pytest.raises(LockNotAcquired) as info:
        other.acquire("report", blocking=False)
    error = info.value
    assert error.key == "report"
    assert error.holder == holder.owner
    assert error.expires_at == holder.expires_at
    assert "report" in str(error)
    assert holder.owner in str(error)
    assert holder.expires_at.isoformat() in str(error)
    with pytest.raises(LockNotAcquired):
        other.acquire("report", timeout=0)
    # The refused attempt changed nothing.
    status = manager.status("report")
    assert status is not None
    assert (status.owner, status.token) == (holder.owner, holder.token)
    assert holder.valid


def test_two_handles_of_one_process_exclude_each_other(manager: LockManager) -> None:
    first = manager.acquire("same", ttl=30)
    with pytest.raises(LockNotAcquired):
        manager.acquire("same", blocking=False)
    assert first.release()


def test_tokens_grow_across_release_expiry_deletion_and_force_release(
    manager: LockManager, other: LockManager
) -> None:
    tokens = []
    lock = manager.acquire("fenced", ttl=30)
    tokens.append(lock.token)
    lock.release()  # released: the document is freed in place
    lock = other.acquire("fenced", ttl=0.2, refresh=False)
    tokens.append(lock.token)
    time.sleep(0.3)  # expired, not released
    lock = manager.acquire("fenced", ttl=30, blocking=False)
    tokens.append(lock.token)
    manager.force_release("fenced")
    lock = other.acquire("fenced", ttl=30, blocking=False)
    tokens.append(lock.token)
    manager.store.collection.delete_many({})  # as the TTL monitor would
    lock = manager.acquire("fenced", ttl=30, blocking=False)
    tokens.append(lock.token)
    assert tokens == sorted(set(tokens)), tokens
    assert all(isinstance(t, int) and 0 < t < 2**63 for t in tokens)


def test_tokens_grow_when_the_stored_token_is_ahead_of_the_cluster_time(
    manager: LockManager,
) -> None:
    lock = manager.acquire("ahead", ttl=0.05, refresh=False)
    manager.store.collection.update_one({"_id": "ahead"}, {"$set": {"token": 2**62}})
    time.sleep(0.1)
    again = manager.acquire("ahead", blocking=False)
    assert again.token == 2**62 + 1
    assert not lock.release()


def test_release_by_a_non_holder_deletes_nothing(manager: LockManager, other: LockManager) -> None:
    stale = manager.acquire("shared", ttl=0.2, refresh=False)
    time.sleep(0.3)
    holder = other.acquire("shared", blocking=False)
    assert holder.token > stale.token
    assert stale.release() is False
    assert stale.lost.is_set()
    status = manager.status("shared")
    assert status is not None
    assert (status.owner, status.token) == (holder.owner, holder.token)
    assert holder.release() is True


def test_expiry_follows_the_server_clock(manager: LockManager, other: LockManager) -> None:
    assert other.status("lease") is None  # connected before the lease starts to run
    # A 3 s lease: the round trips below must all come back while it runs.
    lock = manager.acquire("lease", ttl=3.0, refresh=False)
    status = manager.status("lease")
    assert status is not None
    assert 0 < status.remaining <= 3.0
    with pytest.raises(LockNotAcquired):
        other.acquire("lease", blocking=False)
    time.sleep(3.1)
    assert not lock.valid  # by this process's clock too
    later = manager.status("lease")
    assert later is not None
    assert later.state == "expired"
    taken = other.acquire("lease", blocking=False)
    assert taken.token > lock.token


def test_valid_turns_false_at_the_local_lease_end(
    manager: LockManager, lock_events: list[tuple[str, Any]]
) -> None:
    lock = manager.acquire("short", ttl=1.0, refresh=False)
    assert lock.valid
    time.sleep(1.05)
    assert lock.valid is False
    assert lock.lost.is_set()
    # The lock_lost receivers run on a notice worker: once, however often it is asked.
    deadline = time.monotonic() + 10
    while [name for name, _ in lock_events].count("lost") < 1:
        assert time.monotonic() < deadline, "lock_lost was never sent"
        time.sleep(0.01)
    assert lock.valid is False
    time.sleep(0.2)
    assert [name for name, _ in lock_events].count("lost") == 1


def test_refresh_extends_the_lease_and_keeps_the_token(manager: LockManager) -> None:
    lock = manager.acquire("long", ttl=2.0, refresh=False)
    first_expiry = lock.expires_at
    for _ in range(4):
        time.sleep(0.25)
        assert lock.refresh() is lock
    assert lock.valid
    assert lock.expires_at > first_expiry
    status = manager.status("long")
    assert status is not None
    assert status.token == lock.token
    lock.refresh(ttl=5)
    assert lock.ttl == 5
    assert lock.remaining > 3  # more than the 2 s lease it had
    assert lock.release()


def test_refresh_of_a_force_released_lock_raises_and_signals_once(
    manager: LockManager, other: LockManager, lock_events: list[tuple[str, Any]]
) -> None:
    called: list[Lock] = []
    lock = manager.acquire("stuck", ttl=30, on_lost=called.append)
    removed = other.force_release("stuck")
    assert removed is not None
    assert (removed.owner, removed.token) == (lock.owner, lock.token)
    with pytest.raises(LockLost, match="stuck"):
        lock.refresh()
    assert lock.lost.is_set()
    assert not lock.valid
    with pytest.raises(LockLost):
        lock.refresh()
    assert called == [lock]
    assert [name for name, _ in lock_events].count("lost") == 1
    assert lock.release() is False


def test_refresh_after_release_raises(manager: LockManager) -> None:
    lock = manager.acquire("done")
    lock.release()
    with pytest.raises(LockLost, match="released"):
        lock.refresh()


def test_context_manager_releases_also_on_error(manager: LockManager) -> None:
    seen: list[Lock] = []

    def fail() -> None:
        with manager.lock("ctx", ttl=30) as lock:
            seen.append(lock)
            assert manager.status("ctx") is not None
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail()
    assert seen[0].released
    assert manager.status("ctx") is None
    with manager.acquire("ctx2") as held:
        assert held.valid
    assert manager.status("ctx2") is None


def test_leaving_the_block_after_loss_does_not_raise(
    manager: LockManager, other: LockManager, caplog: pytest.LogCaptureFixture
) -> None:
    with manager.lock("gone", ttl=30) as lock:
        other.force_release("gone")
    assert lock.released
    assert "no longer held" in caplog.text


def test_lock_context_cannot_be_entered_twice(manager: LockManager) -> None:
    context = manager.lock("twice")
    with context, pytest.raises(RuntimeError, match="already entered"), context:
        pass


def test_blocking_acquire_times_out_with_the_holder(
    manager: LockManager, other: LockManager
) -> None:
    holder = manager.acquire("wait", ttl=30)
    started = time.monotonic()
    with pytest.raises(LockNotAcquired) as info:
        other.acquire("wait", timeout=0.5)
    waited = time.monotonic() - started
    # Given up at its timeout (0.5 s), far from the holder's lease end (30 s).
    assert 0.5 <= waited < 4.0
    assert info.value.holder == holder.owner
    assert info.value.waited is not None
    assert info.value.waited >= 0.5
    assert "gave up after waiting" in str(info.value)


def test_blocking_acquire_takes_the_lock_when_the_lease_ends(
    manager: LockManager, other: LockManager
) -> None:
    started = time.monotonic()  # before the lease begins: a stall after it cannot shorten the wait
    holder = manager.acquire("ends", ttl=2.0, refresh=False)
    taken = other.acquire("ends", timeout=10)
    waited = time.monotonic() - started
    assert taken.token > holder.token
    assert 1.9 <= waited < 10  # not before the lease ended (the server keeps milliseconds)
    # Taken at the holder's lease end, by the server's clock: not a grace period (2 s)
    # or a back-off later, whatever kept the test itself from running meanwhile.
    late = (taken.acquired_at - holder.expires_at).total_seconds()
    assert 0 <= late < 1.5


def test_waiter_in_the_same_process_wakes_on_release(manager: LockManager) -> None:
    holder = manager.acquire("handoff", ttl=30)
    got: list[Lock] = []
    waiter = threading.Thread(target=lambda: got.append(manager.acquire("handoff", timeout=10)))
    waiter.start()
    time.sleep(0.3)
    assert not got
    holder.release()
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert got
    assert got[0].token > holder.token
    got[0].release()


def test_unreachable_while_waiting_raises_promptly(manager: LockManager) -> None:
    from django_mongolock import ServerUnavailable

    started = time.monotonic()
    with (
        LockManager("mongodb://127.0.0.1:9/", server_selection_timeout=0.3) as dead,
        pytest.raises(ServerUnavailable),
    ):
        dead.acquire("k", timeout=30)
    assert time.monotonic() - started < 10  # far from the 30 s it would wait


def test_holder_ids_are_unique_per_acquisition_and_name_the_process(manager: LockManager) -> None:
    owners = [manager.new_owner() for _ in range(10_000)]
    assert len(set(owners)) == len(owners)
    host, pid, serial = owners[0].rsplit(":", 2)
    assert host
    assert int(pid) == os.getpid()
    assert len(serial) == 12
    int(serial, 16)


def test_a_forked_child_makes_holder_ids_of_its_own(manager: LockManager) -> None:
    before = manager.new_owner()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, manager.new_owner().encode())
        os._exit(0)
    os.close(write)
    child, code = answer_of(read, pid)
    assert child is not None, "the forked child did not answer within 30 s"
    assert code == 0, child
    assert child.rsplit(":", 2)[1] == str(pid)
    assert child != manager.new_owner() != before


def test_a_child_forked_without_fork_hooks_sees_it_is_not_the_holder(
    mongolock_url: str, manager: LockManager
) -> None:
    """Every fork check compares the process id asked of the system, not one kept by a
    fork hook: a worker forked without them makes holder ids of its own, and cannot
    check, refresh or release its parent's lock (``tests.hookless_fork`` forks it)."""
    key = "hookless"
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.hookless_fork", mongolock_url, manager.database, key],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the holder and its child, killed together if need be
    )
    try:
        code, out, err = finished(holder, timeout=120)
    finally:
        if holder.returncode is None:  # overran: it and its child go, and it is reaped
            with contextlib.suppress(ProcessLookupError):
                os.killpg(holder.pid, signal.SIGKILL)
            holder.communicate(timeout=30)
    assert code == 0, err
    found = json.loads(out)
    assert found["threads"] == ["MainThread"], "the holder could not fork as one thread"
    assert found["answer"] is not None, "the child forked without hooks did not answer in 30 s"
    assert found["code"] == 0, found["answer"]
    owner, checked, refreshed, child_released, child_valid = found["answer"].split("|")
    assert owner.rsplit(":", 2)[1] == str(found["child"])
    assert found["parent_owner"].rsplit(":", 2)[1] == str(found["pid"]) != str(found["child"])
    assert "forked child" in checked
    assert "belongs to process" in refreshed
    assert (child_released, child_valid) == ("False", "False")
    # Still the holder's lock, the child's release notwithstanding.
    info = manager.status(key)
    assert info is not None
    assert info.live
    assert (info.owner, info.token) == (found["owner"], found["token"])
    assert manager.store.release(key, found["owner"], found["token"]) is True


def test_releasing_an_ended_lease_says_so_and_leaves_the_document_alone(
    manager: LockManager,
) -> None:
    lock = manager.acquire("ended", ttl=0.1, refresh=False)
    time.sleep(0.2)
    before = manager.store.collection.find_one({"_id": "ended"})
    assert lock.release() is False
    assert lock.lost.is_set()
    assert manager.store.collection.find_one({"_id": "ended"}) == before
    after = manager.acquire("ended", blocking=False)
    assert after.token > lock.token
    assert after.release() is True
    freed = manager.store.collection.find_one({"_id": "ended"})
    assert freed is not None
    assert freed["owner"] is None
    assert "released_at" in freed


@pytest.mark.parametrize("shared", [False, True], ids=["exclusive", "shared"])
def test_the_same_acquisition_sent_twice_takes_one_lease(
    manager: LockManager, shared: bool
) -> None:
    """A store may send an acquisition again after a lost reply: it must find its own lease."""
    store = manager.store
    owner = manager.new_owner()
    first = store.acquire("twice", owner, 30.0, queue=True, shared=shared)
    again = store.acquire("twice", owner, 30.0, queue=True, shared=shared)
    doc = store.collection.find_one({"_id": "twice"})
    assert doc is not None
    assert doc.get("waiters") == []
    if shared:
        assert [holder["owner"] for holder in doc["holders"]] == [owner]
        mine, mine_again = first.as_holder(owner), again.as_holder(owner)
        assert mine is not None
        assert mine_again is not None
        assert (mine_again.owner, mine_again.token) == (mine.owner, mine.token)
    else:
        assert (again.owner, again.token) == (first.owner, first.token) == (owner, doc["token"])
    # A waiter sending its attempt twice keeps one place in line.
    waiter = manager.new_owner()
    for _ in range(2):
        busy = store.acquire("twice", waiter, 30.0, queue=True)
        assert busy.owner != waiter
    doc = store.collection.find_one({"_id": "twice"})
    assert doc is not None
    assert [place["owner"] for place in doc["waiters"]] == [waiter]
