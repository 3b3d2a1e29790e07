"""The primary of a three-node set cut off from the majority, with lock clients on both sides.

Every member's configured host is a :class:`TcpProxy` in front of it, so all traffic
between the members and from the clients goes through the proxies. Each proxy tells who
opened a connection (the pid behind its source port, through ``/proc``), so the test can
cut the processes into two sides: the old primary and a holder on one, the two other
members and a contender on the other. A connection across the cut is black-holed.

The checks: the old primary's side gets no acknowledged lock write (writes need a
majority), the holder there learns of its loss before the contender, on the majority's
new primary, takes the key, and once the network heals the old holder never acts as the
holder again.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pymongo
import pytest
from pymongo import MongoClient

from django_mongolock import LockManager
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import NetSpawn, Record, members_healthy
from tests.reliability.proxy import TcpProxy, pid_of_peer, socket_inode
from tests.utils import stop_and_check

TTL = 3.0
SST = 5.0


class Sides:
    """Names the origin of a connection by the process behind it."""

    def __init__(self) -> None:
        self.labels: dict[int, str] = {}
        self.unknown: list[int] = []

    def __call__(self, port: int, proxy_port: int) -> str:
        pid = pid_of_peer(port, proxy_port, list(self.labels))
        if pid is not None:
            return self.labels[pid]
        # A client that gave up on its connection before the proxy looked (a connect
        # timeout while cut off) leaves no socket to trace: not an unknown process.
        if socket_inode(port, proxy_port) is not None:
            self.unknown.append(port)
        return "other"


@pytest.fixture(scope="module")
def split() -> Iterator[tuple[MongoReplicaSet, list[TcpProxy], Sides]]:
    """A three-node set whose members know each other by their proxies' addresses only."""
    sides = Sides()
    sides.labels[os.getpid()] = "tester"  # this process's own clients, on neither side
    with ExitStack() as stack:
        replica_set = MongoReplicaSet(3, name="split")
        replica_set.start()
        stack.callback(stop_and_check, replica_set)
        proxies = []
        for index, node in enumerate(replica_set.nodes):
            proxy = TcpProxy((node.host, node.port), classify=sides, name=f"member-{index}")
            stack.enter_context(proxy)
            proxies.append(proxy)
            sides.labels[node.process.pid] = f"node{index}"  # type: ignore[union-attr]
        primary = replica_set.primary()
        client: MongoClient[dict[str, Any]]
        with (
            MongoClient(primary.direct_url, serverSelectionTimeoutMS=10000) as client,
            pymongo.timeout(60),
        ):
            config = client.admin.command("replSetGetConfig")["config"]
            for member, proxy in zip(config["members"], proxies, strict=True):
                member["host"] = proxy.address
            config["version"] += 1
            client.admin.command("replSetReconfig", config)
        wait_healthy(replica_set)
        yield replica_set, proxies, sides


def wait_healthy(replica_set: MongoReplicaSet, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not members_healthy(replica_set):
        assert time.monotonic() < deadline, f"{replica_set!r} did not become healthy"
        time.sleep(0.2)


def url(proxies: list[TcpProxy]) -> str:
    return f"mongodb://{','.join(p.address for p in proxies)}/?replicaSet=split"


@pytest.mark.timeout(300)
def test_a_primary_cut_off_from_the_majority_acknowledges_no_lock_and_its_holder_knows_first(
    split: tuple[MongoReplicaSet, list[TcpProxy], Sides], net_spawn: NetSpawn, record: Record
) -> None:
    replica_set, proxies, sides = split
    database = f"split_{uuid.uuid4().hex[:8]}"
    config = {"url": url(proxies), "database": database, "sst": SST}
    holder = net_spawn("rpc", config, name="minority-holder")
    # Named by its pid at once: its client connects before it reports ready.
    sides.labels[holder.process.pid] = "minority"
    assert holder.event("ready", 60)["pid"] == holder.process.pid
    old = replica_set.primary()
    cut_off = replica_set.nodes.index(old)
    minority = {f"node{cut_off}", "minority"}
    majority = {f"node{i}" for i in range(3) if i != cut_off} | {"majority"}

    got = holder.call("acquire", name="k", key="k", ttl=TTL)
    assert got["ok"], got
    time.sleep(random.uniform(0.05, TTL))
    for index, proxy in enumerate(proxies):
        proxy.isolate(majority if index == cut_off else minority)
    cut_at = time.monotonic()
    try:
        # The old primary's side: a new lock there is never acknowledged.
        stray = holder.send("acquire", name="stray", key="stray", ttl=60, blocking=False)
        # The majority's side elects a primary; a contender there, connected to it, takes
        # the key once the lease is over (with a longer lease of its own: majority writes
        # are slow for a while, until the other member follows the new primary).
        deadline = time.monotonic() + 60
        while (new := replica_set.primary()) is old:
            assert time.monotonic() < deadline, (
                f"the majority elected no primary\n{replica_set._status()}\n"
                f"unknown origins: {sides.unknown}\n"
                + "\n".join(f"{p!r}: {sorted(link.origin for link in p._links)}" for p in proxies)
            )
            time.sleep(0.05)
        through = proxies[replica_set.nodes.index(new)]
        contender = net_spawn(
            "rpc", {**config, "url": through.direct_url}, name="majority-contender"
        )
        sides.labels[contender.process.pid] = "majority"  # before its client connects
        assert contender.event("ready", 60)["pid"] == contender.process.pid
        deadline = time.monotonic() + 90
        while not (
            won := contender.call(
                "acquire", name="k", key="k", ttl=10, timeout=30, wait=30 + 3 * SST + 30
            )
        )["ok"]:
            assert won["error"] == "ServerUnavailable", won
            assert time.monotonic() < deadline, f"{won}\n{replica_set._status()}"
        assert won["token"] > got["token"]
        refused = holder.reply(stray, 2 * SST + 30)
        assert not refused["ok"], f"a lock acknowledged by the cut-off primary: {refused}"
        notices = {
            what: holder.event("notice", TTL + 2 * SST + 10, name="k", what=what)["at"]
            for what in ("event", "signal", "on_lost")
        }
    finally:
        for proxy in proxies:
            proxy.isolate(())
    wait_healthy(replica_set)
    late = {what: at - won["done"] for what, at in notices.items() if at >= won["done"]}
    assert not late, f"notices after the majority's contender took the lock: {late}"
    # Healed: the old holder is not a holder again, the stray lock never existed.
    deadline = time.monotonic() + 60
    while not holder.call("ping", wait=SST + 30)["ok"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    after = holder.call("after_heal", name="k")
    del after["reply"]
    assert after == {
        "valid": False,
        "lost": True,
        "refresh": "LockLost",
        "release": False,
        "valid_after": False,
    }, after
    with LockManager(replica_set.url, database=database, server_selection_timeout=30) as observer:
        status = observer.status("k")
        assert status is not None
        assert (status.owner, status.token, status.live) == (won["owner"], won["token"], True), (
            f"{status}\n{contender.events('notice')}\n{won}"
        )
        stray_status = observer.status("stray")
        assert stray_status is None or not stray_status.live, stray_status
    assert contender.call("release", name="k")["held"]
    assert not sides.unknown, f"connections from unknown processes: {sides.unknown}"
    record(
        margin_seconds=won["done"] - max(notices.values()),
        notice_after_partition_plus_ttl_seconds=max(notices.values()) - (cut_at + TTL),
        majority_acquired_after_partition_seconds=won["done"] - cut_at,
    )
