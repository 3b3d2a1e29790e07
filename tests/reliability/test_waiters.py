"""Waiters in line that die or give up: the lock must still go to the next one in time."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from pymongo import MongoClient
from pymongo.collection import Collection
from pymongo.database import Database

from django_mongolock import clock
from django_mongolock.queries import LIVE_WAITERS, head_owner
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


def _live_owners(locks: Collection[dict[str, Any]], key: str) -> list[str]:
    """The owners of the live places in ``key``'s line, in line order (by server time)."""
    doc = locks.find_one(
        {"_id": key}, {"live": {"$map": {"input": LIVE_WAITERS, "as": "w", "in": "$$w.owner"}}}
    )
    return list(doc["live"]) if doc else []


def _until_line(
    locks: Collection[dict[str, Any]], key: str, wanted: Callable[[list[str]], bool]
) -> list[str]:
    """Poll ``key``'s line until its live owners are ``wanted`` (bounded)."""
    deadline = clock.now() + 30
    while not wanted(owners := _live_owners(locks, key)):
        assert clock.now() < deadline, f"the line of {key!r} is still {owners}"
        time.sleep(0.02)
    return owners


def _line_check_look(locks: Collection[dict[str, Any]], key: str, owner: str) -> None:
    """Return as soon as ``owner``, waiting in ``key``'s line, looks again at its line
    check: a renewal of its place ``LINE_CHECK`` (less a second) or more after the one
    before, by the server's clock. Its next look is then a line check away. Bounded."""
    deadline = clock.now() + 30
    renewed = {
        "$max": {
            "$map": {
                "input": LIVE_WAITERS,
                "as": "w",
                "in": {"$cond": [{"$eq": ["$$w.owner", owner]}, "$$w.at", None]},
            }
        }
    }
    last = None
    while True:
        doc = locks.find_one({"_id": key}, {"at": renewed})
        assert doc is not None
        assert doc["at"] is not None, f"{owner} is not in line for {key!r}"
        if last is not None and (doc["at"] - last).total_seconds() >= LINE_CHECK - 1:
            return
        last = doc["at"]
        assert clock.now() < deadline, f"{owner} did not look again at its line check"
        time.sleep(0.02)


def test_a_waiter_named_head_twice_in_a_row_is_woken_both_times(
    replica_set: MongoReplicaSet, database: str, spawn: Spawn, record: Record
) -> None:
    """A waiter frozen (SIGSTOP) in line is named head by a handoff; its place lapses,
    and once thawed it joins again behind a later waiter. The next handoff goes to that
    waiter, dead by then, and names the thawed one head again. It must hear of that
    second handoff too, and take the lock when the dead waiter's first lease ends.
    Unwoken, it would sleep until its next line check: the release comes just after
    one, so that is nearly 5 s later."""
    ttl = 30.0
    config = agent_config(replica_set, database)
    holder, first, frozen, doomed = (
        spawn("rpc", config, name=name) for name in ("holder", "first", "frozen", "doomed")
    )
    for agent in (holder, first, frozen, doomed):
        agent.event("ready", 30)
    client: MongoClient[dict[str, Any]] = MongoClient(replica_set.url, tz_aware=True)
    locks = client[database]["locks"]
    try:
        assert holder.call("acquire", name="job", key="job", ttl=ttl)["ok"]
        handed = first.send("acquire", name="job", key="job", ttl=ttl, timeout=60)
        _until_line(locks, "job", lambda line: len(line) == 1)
        waiting = frozen.send("acquire", name="job", key="job", ttl=ttl, timeout=60)
        frozen_owner = _until_line(locks, "job", lambda line: len(line) == 2)[1]
        frozen.kill(signal.SIGSTOP)
        # The first handoff: to the first waiter, naming the frozen one head.
        assert holder.call("release", name="job")["held"]
        got_first = first.reply(handed, timeout=30)
        assert got_first["ok"], got_first
        doomed.send("acquire", name="job", key="job", ttl=ttl, timeout=60)
        # The frozen waiter's place lapses at the grace period; the doomed one's stays.
        (doomed_owner,) = _until_line(
            locks, "job", lambda line: len(line) == 1 and line[0] != frozen_owner
        )
        frozen.kill(signal.SIGCONT)
        # Thawed, it looks again and joins behind the doomed waiter.
        _until_line(locks, "job", lambda line: line == [doomed_owner, frozen_owner])
        _line_check_look(locks, "job", frozen_owner)
        doomed.kill()  # its place, renewed at its own line checks, lasts a while yet
        # The second handoff: to the dead waiter, naming the thawed one head again.
        released = first.call("release", name="job")
        assert released["held"]
        handoff = locks.find_one({"_id": "job"})
        assert handoff is not None
        assert handoff["owner"] == doomed_owner
        assert head_owner(handoff["head"]) == frozen_owner
        got = frozen.reply(waiting, timeout=LINE_CHECK + 30)
        assert got["ok"], got
        held_back = got["done"] - released["done"]
        record(held_back_after_second_handoff_seconds=held_back)
        # The dead waiter's first lease, and the machine's delays.
        assert held_back <= PLACE_GRACE + SLACK
        assert got["token"] > handoff["token"] > got_first["token"]
    finally:
        client.close()


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
