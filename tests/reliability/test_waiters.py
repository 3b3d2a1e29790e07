"""Waiters in line that die or give up: the lock must still go to the next one in time."""

from __future__ import annotations

import time
from typing import Any

from pymongo import MongoClient
from pymongo.database import Database

from django_mongolock import clock
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import SLACK, Agent, Record, Spawn, agent_config

PLACE_GRACE = 2.0
"""How long a place in line lasts past a release, unless renewed (queries.PLACE_GRACE_MS)."""
BEHIND_IN_LINE = 0.75 * PLACE_GRACE
"""How soon a waiter that a release did not wake looks again (acquirer.BEHIND_IN_LINE)."""
LINE_CHECK = 5.0
"""How often an exclusive waiter behind others looks again while the key is held
(queries.LINE_CHECK_MS)."""


def line(spawn: Spawn, replica_set: MongoReplicaSet, database: str) -> list[Agent]:
    """A holder and two waiters, each a process of its own."""
    config = agent_config(replica_set, database)
    agents = [spawn("rpc", config, name=name) for name in ("holder", "first", "second")]
    for agent in agents:
        agent.event("ready", 30)
    return agents


def wait_in_line(agent: Agent, key: str, timeout: float) -> int:
    """Start a blocking acquire and give the agent time to join the line."""
    seq = agent.send("acquire", name=key, key=key, timeout=timeout)
    time.sleep(0.5)
    return seq


def test_a_killed_waiter_holds_a_freed_lock_back_at_most_for_the_grace_period(
    replica_set: MongoReplicaSet, database: str, spawn: Spawn, record: Record
) -> None:
    """The release hands the lock to the dead waiter (a first lease of ``PLACE_GRACE``)
    and names the live one behind it head, which wakes it: it looks again within
    ``BEHIND_IN_LINE`` and takes the lock when that first lease ends, well before the
    holder's lease would have ended."""
    ttl = 30.0
    holder, first, second = line(spawn, replica_set, database)
    taken = holder.call("acquire", name="job", key="job", ttl=ttl)
    assert taken["ok"], taken
    wait_in_line(first, "job", 60)
    behind = wait_in_line(second, "job", 60)
    first.kill()
    released = holder.call("release", name="job")
    assert released["held"]
    got = second.reply(behind, timeout=PLACE_GRACE + BEHIND_IN_LINE + 30)
    assert got["ok"], got
    held_back = got["done"] - released["done"]
    record(held_back_after_release_seconds=held_back)
    assert held_back <= PLACE_GRACE + BEHIND_IN_LINE + SLACK
    assert got["token"] > taken["token"]


def test_a_waiter_that_gave_up_does_not_hold_back_the_one_behind_it(
    replica_set: MongoReplicaSet, database: str, spawn: Spawn, record: Record
) -> None:
    """The waiter behind counts one release fewer than it expected, and looks again within
    ``BEHIND_IN_LINE`` instead of sleeping until the holder's lease end."""
    ttl = 30.0
    holder, first, second = line(spawn, replica_set, database)
    taken = holder.call("acquire", name="job", key="job", ttl=ttl)
    assert taken["ok"], taken
    ahead = wait_in_line(first, "job", 1.0)
    behind = wait_in_line(second, "job", 60)
    gave_up = first.reply(ahead, timeout=30)
    assert (gave_up["ok"], gave_up["error"]) == (False, "LockNotAcquired")
    released = holder.call("release", name="job")
    assert released["held"]
    got = second.reply(behind, timeout=BEHIND_IN_LINE + 30)
    assert got["ok"], got
    free = got["done"] - released["done"]
    record(free_but_not_taken_seconds=free)
    assert free <= BEHIND_IN_LINE + SLACK
    assert got["token"] > taken["token"]


def _profile(replica_set: MongoReplicaSet, database: str) -> Database[dict[str, Any]]:
    """The test database with every operation profiled (in a profile large enough to keep
    them all), read from the primary, where the profile is written."""
    client: MongoClient[dict[str, Any]] = MongoClient(replica_set.url, tz_aware=True)
    db = client[database]
    db.command("profile", 0)
    db.drop_collection("system.profile")
    db.create_collection("system.profile", capped=True, size=64 * 2**20)
    db.command("profile", 2)
    return db


def test_waiting_behind_a_crashed_holder_and_a_dead_waiter_costs_few_writes(
    replica_set: MongoReplicaSet, database: str, spawn: Spawn, record: Record
) -> None:
    """The holder is SIGKILLed (its lease runs out by itself) and so is the first waiter:
    the waiter behind them must not try again and again, and gets the lock once the dead
    waiter's place has lapsed, the grace period after the lease end, at its next look:
    within ``BEHIND_IN_LINE`` once the key is free, or at its line check."""
    ttl = 3.0
    holder, first, second = line(spawn, replica_set, database)
    taken = holder.call("acquire", name="job", key="job", ttl=ttl)
    assert taken["ok"], taken
    wait_in_line(first, "job", 60)
    behind = wait_in_line(second, "job", 60)
    db = _profile(replica_set, database)
    try:
        holder.kill()
        first.kill()
        killed = clock.now()  # the agents report times on this clock
        got = second.reply(behind, timeout=ttl + PLACE_GRACE + BEHIND_IN_LINE + 30)
        ended = clock.now()
    finally:
        db.command("profile", 0)
    assert got["ok"], got
    assert got["token"] > taken["token"]
    writes = [
        op["ts"]
        for op in db["system.profile"].find(
            {"ns": f"{database}.locks", "op": {"$in": ["command", "update", "remove", "insert"]}}
        )
        if op["op"] != "command" or "findAndModify" in op.get("command", {})
    ]
    db.client.close()
    seconds = ended - killed
    per_second: dict[int, int] = {}
    for ts in writes:
        per_second[int(ts.timestamp())] = per_second.get(int(ts.timestamp()), 0) + 1
    record(
        writes=len(writes),
        seconds=seconds,
        writes_per_second=len(writes) / seconds,
        peak_writes_in_one_second=max(per_second.values(), default=0),
        got_lock_after_kill_seconds=got["done"] - killed,
    )
    # One waiter alive: its attempts, a few per second at most, never a stream of them.
    assert len(writes) / seconds <= 3.0, per_second
    assert max(per_second.values(), default=0) <= 5, per_second
    # The dead waiter is out of the way about one ttl after the holder's last refresh.
    assert got["done"] - killed <= ttl + max(PLACE_GRACE + BEHIND_IN_LINE, LINE_CHECK) + SLACK
