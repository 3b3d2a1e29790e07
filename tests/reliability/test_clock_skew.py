"""A client whose wall clock is an hour off, under libfaketime; the servers keep the true time.

Only the client runs under ``faketime``, never mongod. Faking a clock this way needs
``FAKETIME_DONT_FAKE_MONOTONIC=1``: by default libfaketime also shifts CLOCK_MONOTONIC, and
then every timed wait of a threaded Python program (``Event.wait``, ``Condition.wait``,
``Lock.acquire(timeout=...)``) hangs, because CPython hands the shifted deadline to
``sem_clockwait``/``pthread_cond_timedwait``. A real wrong or stepped wall clock leaves
CLOCK_MONOTONIC alone too, so this is the faithful model. The agent also works around
libfaketime issue #426 (``time.sleep`` fails with EINVAL in that mode); see
``tests/reliability/agents.py``.
"""

from __future__ import annotations

import shutil
import time

import pytest

from django_mongolock import LockManager, LockNotAcquired, clock
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import SLACK, Agent, Record, Spawn, agent_config

HOUR = 3600.0


@pytest.fixture(params=["+1h", "-1h"])
def skewed(
    request: pytest.FixtureRequest, replica_set: MongoReplicaSet, database: str, spawn: Spawn
) -> Agent:
    """A lock client whose wall clock is an hour ahead of, or behind, the servers'."""
    faketime = shutil.which("faketime")
    assert faketime, "faketime is missing: run scripts/system-deps.sh (apt-get install faketime)"
    offset: str = request.param
    agent = spawn(
        "rpc",
        agent_config(replica_set, database),
        name=f"skewed{offset}",
        prefix=[faketime, "-f", offset],
        env={"FAKETIME_DONT_FAKE_MONOTONIC": "1"},
    )
    agent.event("ready", 60)
    seen = agent.call("clock")
    expected = HOUR if offset == "+1h" else -HOUR
    assert abs(seen["local"] - seen["server"] - expected) < 60, seen
    assert abs(seen["monotonic"] - clock.now()) < 10, "the lease clock must stay real"
    return agent


def test_a_skewed_client_neither_steals_a_live_lock_nor_loses_its_own_early(
    skewed: Agent, replica_set: MongoReplicaSet, database: str
) -> None:
    with LockManager(replica_set.url, database=database) as true_clock:
        # It does not take a live lock, neither at once nor after waiting a while.
        live = true_clock.acquire("live", ttl=30)
        refused = skewed.call("acquire", name="live", key="live", blocking=False)
        assert (refused["ok"], refused["error"]) == (False, "LockNotAcquired")
        waited = skewed.call("acquire", name="live", key="live", timeout=1.0)
        assert (waited["ok"], waited["error"]) == (False, "LockNotAcquired")
        assert 1.0 <= waited["done"] - waited["sent"] <= 1.0 + SLACK
        assert live.valid
        assert live.release()

        # Its refresher keeps its lease for many lease lengths.
        kept = skewed.call("acquire", name="kept", key="kept", ttl=3.0)
        assert kept["ok"], kept
        held = skewed.call("hold", name="kept", seconds=9.0, wait=40)
        assert held["always_valid"], held
        with pytest.raises(LockNotAcquired):
            true_clock.acquire("kept", blocking=False)
        status = true_clock.status("kept")
        assert status is not None
        assert (status.token, status.live) == (kept["token"], True)
        assert status.refreshed_at > status.acquired_at
        assert skewed.call("release", name="kept")["held"]


def test_a_skewed_clients_lease_ends_by_the_servers_clock(
    skewed: Agent, replica_set: MongoReplicaSet, database: str, record: Record
) -> None:
    """Not an hour early, not an hour late: when the lease ends, by the server's clock."""
    ttl = 2.0
    with LockManager(replica_set.url, database=database) as true_clock:
        # Its own lease, not refreshed: it knows when it ends, and so does everybody else.
        own = skewed.call("acquire", name="own", key="own", ttl=ttl, refresh=False)
        assert own["ok"], own
        assert ttl / 2 < own["remaining"] <= ttl  # not an hour off; room for a stall
        assert abs(own["expires_at"] - (own["wall"] + own["remaining"])) > HOUR - 60, (
            "the lease end it reports is the server's time, not its own clock's"
        )
        taken = true_clock.acquire("own", timeout=ttl + 10)
        taken_at = clock.now()
        assert taken.token > own["token"]
        assert own["deadline"] <= taken_at <= own["deadline"] + SLACK
        assert not skewed.call("state", name="own")["valid"]
        assert skewed.call("wait_lost", name="own", timeout=1.0)["lost"]
        assert taken.release()

        # As a waiter, it takes a lock when the holder's lease ends by the server's clock.
        holder = true_clock.acquire("theirs", ttl=ttl, refresh=False)
        got = skewed.call("acquire", name="theirs", key="theirs", timeout=ttl + 10, wait=60)
        assert got["ok"], got
        assert got["token"] > holder.token
        assert holder.deadline <= got["done"] <= holder.deadline + SLACK
        assert skewed.call("release", name="theirs")["held"]
        record(
            skew_seconds=skewed.call("clock")["local"] - time.time(),
            taken_after_its_lease_end_seconds=taken_at - own["deadline"],
            it_took_after_the_lease_end_seconds=got["done"] - holder.deadline,
        )
