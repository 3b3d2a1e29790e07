"""Why a holder lost its lock, as the events and the metrics tell it, through a real outage.

A holder behind a :class:`TcpProxy` keeps its lease with the background refresher until
the proxy drops every byte: its refreshes get no answer, and the lock is lost at the end
of the lease the holder can bound. Operators read the reason on the ``losses`` counter,
so a network fault must read "server-unreachable", not "expired" (a holder too slow to
refresh) or "force-released" (an operator).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from django_mongolock import LockManager, events
from django_mongolock.contrib.prometheus import LockMetrics
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.proxy import TcpProxy

TTL = 3.0


@pytest.fixture
def seen() -> Iterator[list[events.Lost]]:
    found: list[events.Lost] = []
    mutex = threading.Lock()

    def keep(event: events.Event) -> None:
        if isinstance(event, events.Lost):
            with mutex:
                found.append(event)

    unsubscribe = events.subscribe(keep)
    try:
        yield found
    finally:
        unsubscribe()


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = LockMetrics(registry)
    try:
        yield registry
    finally:
        metrics.close()


def test_a_holder_cut_off_from_the_server_loses_with_server_unreachable(
    lone: MongoReplicaSet,
    proxy: TcpProxy,
    seen: list[events.Lost],
    registry: CollectorRegistry,
) -> None:
    database = f"reasons_{uuid.uuid4().hex[:8]}"
    holder = LockManager(proxy.direct_url, database=database, server_selection_timeout=2.0)
    other = LockManager(lone.url, database=database)
    try:
        lock = holder.acquire("reason-outage", ttl=TTL)
        time.sleep(TTL / 2)  # a refresh or two went through
        assert not lock.lost.is_set()
        proxy.set_mode("drop")
        assert lock.lost.wait(TTL + 5), "the holder never learnt of its loss"
        # The lost flag comes first; the event follows on a notice worker, to one observer
        # after the other (the metrics' among them).
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (
            (found := [e for e in seen if e.lock is lock])
            and registry.get_sample_value("mongolock_losses_total", {"reason": found[0].reason})
        ):
            time.sleep(0.02)
        (loss,) = found
        assert loss.reason == "server-unreachable", loss
        assert (
            registry.get_sample_value("mongolock_losses_total", {"reason": "server-unreachable"})
            == 1.0
        )
        assert not registry.get_sample_value("mongolock_losses_total", {"reason": "expired"})
        # The server agrees: the lease ended, and another process takes the key at once.
        other.acquire("reason-outage", ttl=TTL, timeout=TTL + 5).release()
    finally:
        proxy.set_mode("pass")
        holder.close()
        other.client.drop_database(database)
        other.close()
