"""A holder killed with SIGKILL in the middle of its work: its lease frees the lock."""

from __future__ import annotations

import time

import pytest

from django_mongolock import clock
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import SLACK, Record, Spawn, agent_config
from tests.reliability.fenced import FencedResource


@pytest.mark.parametrize("ttl", [2.0, 4.0])
def test_a_killed_holder_is_succeeded_within_ttl_and_one_tick_with_a_greater_token(
    replica_set: MongoReplicaSet,
    database: str,
    resource: FencedResource,
    spawn: Spawn,
    record: Record,
    ttl: float,
) -> None:
    """The waiter is another process, woken at the dead holder's lease end (server time)."""
    resource.create(["job"])
    config = agent_config(replica_set, database)
    holder = spawn("rpc", config, name="holder")
    waiter = spawn("rpc", config, name="waiter")
    holder.event("ready", 30)
    waiter.event("ready", 30)
    taken = holder.call("acquire", name="job", key="job", ttl=ttl)
    assert taken["ok"], taken
    assert holder.call("write", name="job", write_id="holder")["accepted"]
    waiting = waiter.send("acquire", name="job", key="job", ttl=ttl, timeout=60)
    # The holder works on, well past its lease length: its refresher keeps the lock.
    holder.send("hold", name="job", seconds=120)
    time.sleep(ttl * 1.5)
    assert not [m for m in waiter.messages if m.get("reply") == waiting], "the waiter got it early"

    holder.kill()
    killed_at = clock.now()
    got = waiter.reply(waiting, timeout=ttl + 30)

    assert got["ok"], got
    waited = got["done"] - killed_at
    record(ttl=ttl, taken_after_kill_seconds=waited, bound_seconds=ttl + ttl / 3)
    assert waited <= ttl + ttl / 3 + SLACK, f"took {waited:.2f}s after the kill"
    assert got["token"] > taken["token"]
    assert waiter.call("write", name="job", write_id="waiter")["accepted"]
    assert [(w["id"], w["token"]) for w in resource.log("job")] == [
        ("holder", taken["token"]),
        ("waiter", got["token"]),
    ]
    assert waiter.call("release", name="job")["held"]
    assert waiter.finish(command='{"op": "exit", "seq": 0}') == 0
