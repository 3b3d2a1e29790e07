"""MongoDB stopped while locks are held and waiters wait, then started again."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from django_mongolock import LockManager, clock
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import SLACK, Record, Spawn
from tests.waiting import in_line

SST = 2.0
"""The agents' server selection timeout: every operation ends within it."""
RETRY_INTERVAL = 1.0
"""How soon the refresher tries again after a failed tick (refresher.RETRY_INTERVAL)."""


@pytest.fixture
def observer(lone: MongoReplicaSet) -> Iterator[LockManager]:
    """A manager of the test's own, to look at the line and the leases."""
    with LockManager(lone.url, database="outage", server_selection_timeout=10) as manager:
        yield manager


def test_an_outage_fails_cleanly_within_the_timeouts_and_locking_recovers_by_itself(
    lone: MongoReplicaSet, spawn: Spawn, record: Record, observer: LockManager
) -> None:
    short_ttl, long_ttl, down_for = 2.0, 30.0, 8.0
    config = {"url": lone.url, "database": "outage", "sst": SST}
    holder = spawn("rpc", config, name="holder")
    gives_up = spawn("rpc", config, name="gives-up")
    patient = spawn("rpc", config, name="patient")
    for agent in (holder, gives_up, patient):
        agent.event("ready", 30)
    short = holder.call("acquire", name="short", key="short", ttl=short_ttl)
    long = holder.call("acquire", name="long", key="long", ttl=long_ttl)
    assert short["ok"], short
    assert long["ok"], long
    # The waiter that gives up waits behind the patient one: a waiter that is not next
    # sleeps longest on its stream (``LINE_CHECK``), and must not sleep on when it fails.
    persisting = patient.send(
        "persist", name="short", key="short", ttl=short_ttl, timeout=5.0, give_up_after=60
    )
    in_line(observer, "short", 1)
    waiting = gives_up.send("acquire", name="short", key="short", ttl=short_ttl, timeout=60)
    in_line(observer, "short", 2)
    time.sleep(1.0)

    node = lone.nodes[0]
    lone.kill(node, signal.SIGKILL)
    killed_at = clock.now()

    # Calls during the outage fail within the timeout, naming the server.
    refresh = holder.call("refresh", name="long")
    assert (refresh["ok"], refresh["error"]) == (False, "ServerUnavailable")
    assert refresh["done"] - refresh["sent"] <= SST + SLACK
    assert node.address in refresh["message"]
    other = holder.call("acquire", name="other", key="other", blocking=False)
    assert (other["ok"], other["error"]) == (False, "ServerUnavailable")
    assert other["done"] - other["sent"] <= SST + SLACK
    # A waiter is not left waiting for a server that is gone: its stream fails within
    # the timeout (the driver's one resume attempt), which wakes it wherever it stands
    # in line, and the attempt it then makes fails within the timeout. (That the waiter
    # tries at once when its stream fails is checked exactly, without timeouts, by
    # ``tests/test_watcher.py``.)
    gave_up = gives_up.reply(waiting, timeout=2 * SST + 30)
    assert (gave_up["ok"], gave_up["error"]) == (False, "ServerUnavailable"), gave_up
    assert gave_up["done"] - killed_at <= 2 * SST + SLACK
    # The short lease is reported lost once it has surely ended, not before.
    lost = holder.event("lost", timeout=short_ttl + 2 * SST + 10, name="short")
    assert lost["at"] >= lost["deadline"]
    assert lost["at"] <= lost["deadline"] + SST + short_ttl / 3 + SLACK
    time.sleep(max(0.0, killed_at + down_for - clock.now()))
    assert not holder.events("lost")[1:], "only the short lease may be lost"
    assert holder.call("state", name="long")["valid"]

    restarting_at = time.time()
    lone.restart(node)
    up_at = clock.now()

    # The patient waiter gets the lock once MongoDB is back, with a greater token.
    got = patient.reply(persisting, timeout=60)
    assert got["ok"], got
    assert got["token"] > short["token"]
    assert got["done"] >= up_at - SLACK
    for attempt in got["attempts"]:
        assert attempt["ok"] or attempt["error"] in ("ServerUnavailable", "LockNotAcquired")
        assert attempt["done"] - attempt["sent"] <= 5.0 + 2 * SST + SLACK, attempt
    # The refresher recovered by itself: the long lease is extended again, and kept.
    deadline = clock.now() + 20
    while True:
        status = observer.status("long")
        assert status is not None
        if status.refreshed_at > datetime.fromtimestamp(restarting_at, UTC):
            break
        assert clock.now() < deadline, "the refresher did not extend the lease again"
        time.sleep(0.05)
    recovered = clock.now() - up_at
    assert recovered <= RETRY_INTERVAL + SST + SLACK
    assert (status.owner, status.token, status.live) == (long["owner"], long["token"], True)
    with pytest.raises(Exception, match="is held"):
        observer.acquire("long", blocking=False)
    assert holder.call("state", name="long")["valid"]
    fresh = holder.call("acquire", name="fresh", key="fresh", ttl=3.0)
    assert fresh["ok"], fresh
    assert holder.call("hold", name="fresh", seconds=9.0, wait=40)["always_valid"]
    assert holder.call("refresher")["running"]
    record(
        down_seconds=up_at - killed_at,
        waiter_failed_after_kill_seconds=gave_up["done"] - killed_at,
        lost_after_lease_end_seconds=lost["at"] - lost["deadline"],
        refresher_recovered_after_restart_seconds=recovered,
        patient_acquired_after_restart_seconds=got["done"] - up_at,
        patient_attempts=len(got["attempts"]),
    )
    assert holder.call("release", name="long")["held"]
    assert holder.call("release", name="fresh")["held"]
    assert patient.call("release", name="short")["held"]
