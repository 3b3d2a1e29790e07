"""A holder frozen with SIGSTOP, as by a long garbage collection or a suspended VM."""

from __future__ import annotations

import signal
import time

from django_mongolock import clock
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import SLACK, Record, Spawn, agent_config
from tests.reliability.fenced import FencedResource


def test_a_holder_paused_past_its_lease_learns_it_lost_the_lock_at_its_next_refresh(
    replica_set: MongoReplicaSet,
    database: str,
    resource: FencedResource,
    spawn: Spawn,
    record: Record,
) -> None:
    """A short pause costs nothing; a long one loses the lock, and fencing refuses the late write.

    The holder checks ``valid`` and is then frozen before its write, the window that no
    check can close: only the resource's fencing token check stops that write.
    """
    ttl = 3.0  # the short pause (0.45 of it) leaves 1.4 s for the refresh after it
    resource.create(["report"])
    config = agent_config(replica_set, database)
    holder = spawn("rpc", config, name="holder")
    successor = spawn("rpc", config, name="successor")
    holder.event("ready", 30)
    successor.event("ready", 30)
    first = holder.call("acquire", name="r", key="report", ttl=ttl)
    assert first["ok"], first
    assert holder.call("write", name="r", write_id="holder-1")["accepted"]

    # Frozen for less than the lease: nothing is lost, the refresher catches up.
    # Right after a refresh, for longer than a tick (a third of the lease) and well
    # within the lease's end as the holder counts it (a margin short of ttl).
    ticks = holder.call("refresher")["ticks"]
    deadline = time.monotonic() + 10
    while holder.call("refresher")["ticks"] == ticks:
        assert time.monotonic() < deadline, "the refresher did not tick"
        time.sleep(0.01)
    holder.kill(signal.SIGSTOP)
    time.sleep(ttl * 0.45)
    holder.kill(signal.SIGCONT)
    assert not successor.call("acquire", name="r", key="report", blocking=False)["ok"]
    kept = holder.call("hold", name="r", seconds=ttl * 1.5, wait=ttl * 1.5 + 30)
    assert kept["always_valid"], kept

    # Frozen past the lease, right after checking that it still holds the lock.
    assert holder.call("state", name="r")["valid"]
    holder.kill(signal.SIGSTOP)
    second = successor.call(
        "acquire", name="r", key="report", ttl=ttl, timeout=ttl + 20, wait=ttl + 40
    )
    assert second["ok"], second
    assert second["token"] > first["token"]
    assert successor.call("write", name="r", write_id="successor")["accepted"]
    holder.kill(signal.SIGCONT)
    resumed_at = clock.now()  # the agents report times on this clock

    late = holder.call("write", name="r", write_id="holder-2")
    assert late["ok"], late
    assert (late["accepted"], late["fence"]) == (False, second["token"])
    state = holder.call("state", name="r")
    assert not state["valid"]
    lost = holder.call("wait_lost", name="r", timeout=ttl / 3 + SLACK)
    assert lost["lost"], lost
    record(ttl=ttl, lost_known_after_resume_seconds=lost["at"] - resumed_at)
    assert lost["at"] - resumed_at <= ttl / 3 + SLACK
    refresh = holder.call("refresh", name="r")
    assert (refresh["ok"], refresh["error"]) == (False, "LockLost")
    assert holder.call("release", name="r")["held"] is False
    assert [(w["id"], w["token"]) for w in resource.log("report")] == [
        ("holder-1", first["token"]),
        ("successor", second["token"]),
    ]
    assert [event["name"] for event in holder.events("lost")] == ["r"]
    assert successor.call("release", name="r")["held"]
