"""Shared and exclusive locks, semaphores, lock groups and leader election on the real server."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client

from django_mongolock import (
    Election,
    LockGroup,
    LockManager,
    LockNotAcquired,
    Semaphore,
)
from tests.utils import ROOT, run_command
from tests.waiting import in_line
from tests.workers import opposite_groups, readers_writers

# -- shared and exclusive ----------------------------------------------------------------------


def test_shared_holders_overlap_but_never_with_an_exclusive_one(
    manager: LockManager, other: LockManager
) -> None:
    first = manager.acquire("catalog", shared=True, ttl=30)
    second = other.acquire("catalog", shared=True, ttl=30)
    assert first.shared
    assert second.shared
    assert second.token > first.token
    with pytest.raises(LockNotAcquired, match="2 shared holders"):
        other.acquire("catalog", blocking=False)
    status = manager.status("catalog")
    assert status is not None
    assert status.mode == "shared"
    assert [holder.owner for holder in status.live_holders] == [first.owner, second.owner]
    assert first.release()
    with pytest.raises(LockNotAcquired):
        other.acquire("catalog", blocking=False)
    assert second.release()
    writer = other.acquire("catalog", blocking=False)
    assert writer.token > second.token
    with pytest.raises(LockNotAcquired, match=writer.owner):
        manager.acquire("catalog", shared=True, blocking=False)
    assert writer.release()
    reader = manager.acquire("catalog", shared=True, blocking=False)
    assert reader.token > writer.token
    assert reader.release()


def test_a_waiting_writer_gets_in_when_the_readers_leave(
    manager: LockManager, other: LockManager
) -> None:
    readers = [manager.acquire("doc", shared=True, ttl=30) for _ in range(3)]
    got: list[float] = []

    def write() -> None:
        with other.lock("doc", timeout=20):
            got.append(time.monotonic())

    writer = threading.Thread(target=write)
    writer.start()
    in_line(manager, "doc", 1)
    # A writer in line keeps new readers out, so it cannot starve.
    with pytest.raises(LockNotAcquired):
        manager.acquire("doc", shared=True, blocking=False)
    for reader in readers:
        time.sleep(0.1)
        assert not got
        reader.release()
    writer.join(timeout=20)
    assert got


def test_expiry_of_one_shared_holder_leaves_the_others(
    manager: LockManager, other: LockManager
) -> None:
    # Room for a late refresher tick: only the unrefreshed lease may lapse here.
    kept = manager.acquire("pool", shared=True, ttl=2.0)
    lapsing = other.acquire("pool", shared=True, ttl=0.3, refresh=False)
    time.sleep(1.0)
    assert kept.valid
    assert not lapsing.valid
    status = manager.status("pool")
    assert status is not None
    assert [holder.owner for holder in status.live_holders] == [kept.owner]
    with pytest.raises(LockNotAcquired):
        other.acquire("pool", blocking=False)
    assert lapsing.release() is False
    assert kept.release() is True


def test_a_force_released_shared_holder_learns_it_within_a_tick(
    manager: LockManager, other: LockManager
) -> None:
    reader = manager.acquire("books", shared=True, ttl=0.6)
    other.force_release("books")
    assert reader.lost.wait(2.0)
    assert not reader.valid


def test_shared_refresh_and_release_by_hand(manager: LockManager) -> None:
    reader = manager.acquire("manual", shared=True, ttl=5, refresh=False)
    before = reader.expires_at
    time.sleep(0.05)
    assert reader.refresh(ttl=10) is reader
    assert reader.expires_at > before
    assert reader.ttl == 10
    assert reader.release()
    assert manager.status("manual") is None


def test_readers_and_writers_from_several_processes(
    mongolock_url: str, manager: LockManager
) -> None:
    processes, rounds, limit = 4, 25, 3
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes) as pool:
        results = [
            pool.apply_async(
                readers_writers, (mongolock_url, manager.database, rounds, seed, limit)
            )
            for seed in range(processes)
        ]
        seen = [result.get(timeout=300) for result in results]
    assert sum(item["violations"] for item in seen) == 0
    assert sum(item["reads"] + item["writes"] for item in seen) == processes * rounds
    assert sum(item["writes"] for item in seen) > 0
    # Readers did overlap (the lock is not secretly exclusive), within the limit.
    assert 1 < max(item["max_readers"] for item in seen) <= limit


# -- semaphores --------------------------------------------------------------------------------


def test_a_semaphore_admits_at_most_limit_holders(manager: LockManager, other: LockManager) -> None:
    exports = manager.semaphore("exports", limit=2)
    assert isinstance(exports, Semaphore)
    first = exports.acquire()
    second = other.semaphore("exports", limit=2).acquire()
    with pytest.raises(LockNotAcquired, match="2/2 shared holders"):
        exports.acquire(blocking=False)
    assert len(exports.holders()) == 2
    assert first.release()
    third = exports.acquire(blocking=False)
    assert third.token > second.token > first.token
    context = exports.lock(blocking=False)
    with pytest.raises(LockNotAcquired):
        context.__enter__()
    second.release()
    with exports.lock(blocking=False) as slot:
        assert slot.shared
        assert len(exports.holders()) == 2
    third.release()
    assert exports.holders() == ()


def test_semaphore_waiters_get_the_freed_slots(manager: LockManager, other: LockManager) -> None:
    slots = manager.semaphore("slots", limit=2, ttl=30)
    held = [slots.acquire(), slots.acquire()]
    entered: list[int] = []
    errors: list[BaseException] = []

    def wait_for_a_slot() -> None:
        try:
            with other.semaphore("slots", limit=2).lock(timeout=20) as lock:
                entered.append(lock.token)
        except BaseException as exc:
            errors.append(exc)

    waiters = [threading.Thread(target=wait_for_a_slot) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.3)
    assert entered == []
    for lock in held:
        lock.release()
    for waiter in waiters:
        waiter.join(timeout=30)
    assert errors == []
    assert len(entered) == 3


def test_semaphore_arguments_are_checked() -> None:
    with LockManager("mongodb://127.0.0.1:9/", server_selection_timeout=0.2) as offline:
        with pytest.raises(ValueError, match="at least 1"):
            offline.semaphore("s", limit=0)
        with pytest.raises(TypeError, match="int"):
            offline.semaphore("s", limit=2.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="shared=True"):
            offline.acquire("s", limit=3)
        with pytest.raises(TypeError, match="shared"):
            offline.acquire("s", shared="yes")  # type: ignore[arg-type]


# -- groups ------------------------------------------------------------------------------------


def test_a_group_takes_all_keys_under_one_id(manager: LockManager) -> None:
    group = manager.acquire_group(["b", "a", "c", "a"], ttl=30)
    assert isinstance(group, LockGroup)
    assert list(group.locks) == ["a", "b", "c"]
    assert group.valid
    for key in "abc":
        status = manager.status(key)
        assert status is not None
        assert status.group == group.group_id
        assert status.token == group.tokens[key]
    group.refresh()
    assert group.release()
    assert manager.count() == 0


def test_a_group_is_all_or_nothing(manager: LockManager, other: LockManager) -> None:
    blocker = other.acquire("y", ttl=30)
    with pytest.raises(LockNotAcquired, match="'y'"):
        manager.acquire_group(["x", "y", "z"], ttl=30, timeout=0.3)
    assert manager.status("x") is None
    assert manager.status("z") is None
    assert blocker.release()
    with manager.acquire_group(["x", "y", "z"], blocking=False) as group:
        assert group.valid
    assert manager.count() == 0


def test_groups_in_opposite_orders_do_not_deadlock(
    mongolock_url: str, manager: LockManager
) -> None:
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        results = [
            pool.apply_async(opposite_groups, (mongolock_url, manager.database, 20, reverse))
            for reverse in (False, True, False, True)
        ]
        done = [result.get(timeout=300) for result in results]
    assert done == [20, 20, 20, 20]


def test_group_arguments_are_checked(manager: LockManager) -> None:
    with pytest.raises(ValueError, match="at least one key"):
        manager.acquire_group([])
    with pytest.raises(TypeError, match="single key"):
        manager.acquire_group("ab")
    with pytest.raises(TypeError):
        manager.acquire_group(["a", 3])  # type: ignore[list-item]
    assert manager.count() == 0


# -- leader election ---------------------------------------------------------------------------


def test_one_leader_and_a_follower_that_takes_over(
    manager: LockManager, other: LockManager
) -> None:
    calls: list[str] = []
    # Leases long enough that a late refresher tick cannot end the first term mid-test.
    first = manager.elect(
        "scheduler",
        ttl=2.0,
        on_elected=lambda e: calls.append("first elected"),
        on_demoted=lambda e: calls.append("first demoted"),
    )
    elections = [first]
    try:
        assert isinstance(first, Election)
        assert first.changed.wait(5)
        assert first.is_leader
        first_leading: list[bool] = []

        def second_elected(election: Election) -> None:
            first_leading.append(first.is_leader)
            calls.append("second elected")

        second = other.elect("scheduler", ttl=2.0, on_elected=second_elected)
        elections.append(second)
        time.sleep(1.0)
        assert not second.is_leader
        assert first.token is not None
        assert second.token is None
        assert manager.leader("scheduler") == other.leader("scheduler") == first.leader()
        status = manager.status("scheduler")
        assert status is not None
        assert status.kind == "election"
        first.stop()
        deadline = time.monotonic() + 5
        while not second.is_leader and time.monotonic() < deadline:
            time.sleep(0.02)
        assert second.is_leader
        # The callbacks run in threads of their own: wait for the third, then look at all.
        while len(calls) < 3 and time.monotonic() < deadline + 5:
            time.sleep(0.02)
        # Each election runs its callbacks in order on a worker of its own, and the two
        # workers run side by side: what comes first is the old leader's demotion, not
        # its callback, so the new leader's callback saw it demoted.
        assert calls[0] == "first elected"
        assert sorted(calls[1:]) == ["first demoted", "second elected"]
        assert first_leading == [False]
    finally:
        # A failed assertion must not leave them campaigning into later tests.
        for election in elections:
            election.stop()
    assert manager.leader("scheduler") is None


def test_demotion_is_noticed_within_a_tick(manager: LockManager, other: LockManager) -> None:
    demoted = threading.Event()
    # What the election held when its on_demoted ran: the lost term must be over by then.
    # The lock is free again, so the next campaign may already have won a new term (a
    # greater token); asserting "not leader" after the callback would race that campaign.
    seen: list[int | None] = []

    def on_demoted(e: Election) -> None:
        seen.append(e.token)
        demoted.set()

    # A 2 s lease: a shorter one may end by a late refresh on a loaded machine before
    # the force release, a demotion this test does not make.
    election = manager.elect("cron", ttl=2.0, on_demoted=on_demoted)
    try:
        assert election.changed.wait(5)
        token = election.token
        assert token is not None
        other.force_release("cron")
        assert demoted.wait(10)
        assert len(seen) == 1
        assert seen[0] is None or seen[0] > token
        # It campaigns again and wins the next term with a greater token.
        deadline = time.monotonic() + 5
        while not election.is_leader and time.monotonic() < deadline:
            time.sleep(0.02)
        assert election.is_leader
        assert election.token is not None
        assert election.token > token
        assert election.terms == 2
    finally:
        election.stop()


def test_a_killed_leader_is_replaced_within_ttl_and_a_tick(
    mongolock_url: str, manager: LockManager
) -> None:
    ttl = 3.0  # a fresh process's refreshes must keep it on a loaded machine
    leader = subprocess.Popen(
        [sys.executable, "-m", "tests.leader", mongolock_url, manager.database, "boss", str(ttl)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert leader.stdout is not None
        line = leader.stdout.readline()
        leader.stdout.close()
        assert line.startswith("leader "), line
        old_token = int(line.split()[1])
        elected: list[float] = []
        follower = manager.elect(
            "boss", ttl=ttl, on_elected=lambda e: elected.append(time.monotonic())
        )
        time.sleep(ttl)
        assert not follower.is_leader
        os.kill(leader.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        deadline = killed_at + 10
        # Timed here, where the term begins, not on the callback worker, which may run
        # later on a loaded machine.
        while not follower.is_leader and time.monotonic() < deadline:
            time.sleep(0.02)
        assert follower.is_leader
        # The lease ends within ttl of the kill, and the follower campaigns on its next
        # tick (a third of ttl), then one write; a loaded machine may add to that.
        assert time.monotonic() - killed_at <= ttl + ttl / 3 + 1.0
        while not elected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(elected) == 1
        assert follower.token is not None
        assert follower.token > old_token
        follower.stop()
    finally:
        leader.kill()
        leader.wait(timeout=30)


# -- shown to operators --------------------------------------------------------------------------


@pytest.fixture
def shown(mongolock_settings: dict[str, Any], manager: LockManager) -> Iterator[dict[str, Any]]:
    """One lock of each kind in the settings' collection, for the admin and the CLI."""
    from django_mongolock import conf

    default = conf.get_manager()
    default.ensure_indexes()
    sem = default.semaphore("exports", limit=3)
    slots = [sem.acquire(ttl=30), sem.acquire(ttl=30)]
    group = default.acquire_group(["g-one", "g-two"], ttl=30)
    election = default.elect("scheduler", ttl=5)
    assert election.changed.wait(5)
    yield {"slots": slots, "group": group, "election": election}
    election.stop()


def test_the_admin_shows_holders_semaphore_counts_groups_and_leaders(
    admin_client: Client, shown: dict[str, Any]
) -> None:
    listing = admin_client.get("/admin/django_mongolock/lock/?state=all").content.decode()
    assert "2/3 shared holders" in listing
    assert "semaphore 2/3" in listing
    assert f"group {shown['group'].group_id}" in listing
    assert "leader" in listing
    detail = admin_client.get("/admin/django_mongolock/lock/exports/change/").content.decode()
    assert "Shared holders" in detail
    for slot in shown["slots"]:
        assert slot.owner in detail
        assert str(slot.token) in detail
    searched = admin_client.get(
        "/admin/django_mongolock/lock/", {"owner": shown["slots"][0].owner}
    ).content.decode()
    assert "exports" in searched


def test_the_cli_shows_holders_semaphore_counts_groups_and_leaders(shown: dict[str, Any]) -> None:
    out, _, code = run_command("mongolock", "list", "--all")
    assert code == 0
    assert "2/3 shared holders" in out
    assert f"(group {shown['group'].group_id})" in out
    assert "(leader)" in out
    out, _, code = run_command("mongolock", "status", "exports")
    assert code == 0
    assert "holders:" in out
    for slot in shown["slots"]:
        assert f"{slot.owner}  token {slot.token}  live" in out
    out, _, code = run_command("mongolock", "status", "scheduler", "--json")
    data = json.loads(out)
    assert data["kind"] == "election"
    assert data["owner"] == shown["election"].leader()
    out, _, code = run_command("mongolock", "status", "exports", "--json")
    data = json.loads(out)
    assert data["mode"] == "shared"
    assert data["limit"] == 3
    assert [holder["token"] for holder in data["holders"]] == [s.token for s in shown["slots"]]
