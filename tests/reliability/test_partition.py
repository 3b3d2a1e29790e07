"""A network partition between one holder and MongoDB while the server stays healthy.

The holder reaches its single-node replica set through a :class:`TcpProxy` (with
``directConnection=true``: the one server behind the proxy says it is a member of a set,
so the lock manager treats it as one, and the driver never looks the member up by its
configured host, which would go around the proxy). Another process, connected directly,
contends for the same key. At a random moment of each round the proxy turns into a black
hole: connections stay open and every byte vanishes, so the holder's calls wait for
their timeouts, as behind a dead switch or a firewall that drops packets.

The guarantee: the holder learns of its loss (``lost`` event, ``lock_lost`` signal,
``on_lost``, an election's ``on_demoted``) before anybody else can hold its lock, and once
the network is back it never acts as the holder again. Both processes report on
CLOCK_MONOTONIC, which the processes of one machine share, so their reports make one
timeline.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from django_mongolock import Lock, LockManager
from django_mongolock.info import Holder, LockInfo
from django_mongolock.signals import lock_lost
from django_mongolock.testing import MongoReplicaSet
from tests.reliability.conftest import (
    REPORT,
    NetAgent,
    Record,
    net_agents,
)
from tests.reliability.proxy import TcpProxy
from tests.utils import stop_and_check

TTL = 3.0
"""The holders' lease: a refresher tick every second."""
SST = 5.0
"""Server selection timeout (and timeoutMS) of every client: longer than a lease."""
ROUNDS = 6
"""Rounds per kind of lock: 24 partitions in all, each at a random moment."""
BALLAST = 70
"""Leases held beside the round's lock in the rounds with many: above the 64 from which
the refresher keeps its write encoded (``store.holder._KEEP_FROM``)."""
BALLAST_ROUNDS = 3
"""Rounds per kind with the other leases: 6 partitions in all."""
NOTICES = {
    "plain": ("event", "signal", "on_lost"),
    "shared": ("event", "signal", "on_lost"),
    "semaphore": ("event", "signal", "on_lost"),
    "election": ("event", "signal", "demoted"),
}
SEED = int(time.time())
FIGURES = REPORT.parent / "partition.json"
RESULTS: dict[str, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def pair(
    lone: MongoReplicaSet, proxy: TcpProxy, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[NetAgent, NetAgent, str]]:
    """A holder behind the proxy and a contender connected directly (and their database),
    kept for every round."""
    database = f"partition_{uuid.uuid4().hex[:8]}"
    with net_agents(tmp_path_factory.mktemp("partition")) as spawn:
        holder = spawn(
            "rpc", {"url": proxy.direct_url, "database": database, "sst": SST}, name="holder"
        )
        contender = spawn(
            "rpc", {"url": lone.url, "database": database, "sst": SST}, name="contender"
        )
        holder.event("ready", 60)
        contender.event("ready", 60)
        yield holder, contender, database


@pytest.fixture(scope="module", autouse=True)
def publish() -> Iterator[None]:
    """Print and save the figures of every round of the module, for docs/guarantees.md."""
    yield
    rounds = [r for results in RESULTS.values() for r in results]
    if not rounds:
        return
    figures = summarize(rounds)
    figures["by_kind"] = {kind: summarize(results) for kind, results in RESULTS.items()}
    figures["seed"] = SEED
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    FIGURES.write_text(json.dumps({"figures": figures, "rounds": rounds}, indent=2) + "\n")
    print(f"\nPARTITION-FIGURES {json.dumps(figures, sort_keys=True)}")


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    complete = [r for r in rounds if r["last_notice"] is not None]
    return {
        "rounds": len(rounds),
        "late_rounds": sum(1 for r in rounds if not r["in_time"]),
        "worst_margin_seconds": min((r["margin"] for r in complete), default=None),
        "worst_notice_after_deadline_seconds": max(
            (r["after_deadline"] for r in complete), default=None
        ),
        "worst_notice_after_partition_plus_ttl_seconds": max(
            (r["after_partition_bound"] for r in complete), default=None
        ),
    }


def heal(proxy: TcpProxy, holder: NetAgent) -> None:
    """Let the traffic pass again and wait until the holder's own manager gets answers."""
    proxy.set_mode("pass")
    deadline = time.monotonic() + 60
    while not (pong := holder.call("ping", wait=SST + 30))["ok"]:
        assert time.monotonic() < deadline, f"the holder did not reconnect: {pong}"
        time.sleep(0.2)


@contextlib.contextmanager
def observed(lone: MongoReplicaSet, database: str, proxy: TcpProxy) -> Iterator[LockManager]:
    """A manager that reads the server directly (the referee of every round), and the
    proxy letting traffic pass again however the rounds end."""
    with LockManager(lone.url, database=database, server_selection_timeout=30) as observer:
        try:
            yield observer
        finally:
            proxy.set_mode("pass")


def until_kept(kind: str, holder: NetAgent) -> None:
    """Wait (bounded) until the holder's refresher keeps its write of ``kind`` encoded
    for all its leases of now: the write a partition then cuts off is the kept one."""
    wanted = "shared" if kind == "shared" else "exclusive"
    deadline = time.monotonic() + 4 * TTL
    while not (
        (kept := holder.call("kept"))[wanted] and kept["current"] and kept["leases"] == BALLAST + 1
    ):
        assert time.monotonic() < deadline, f"no kept write for every lease: {kept}"
        time.sleep(0.05)


def notices_of(
    holder: NetAgent, name: str, wanted: tuple[str, ...], **match: Any
) -> dict[str, dict[str, Any]]:
    """The first notice of each kind for ``name`` (and ``match``, such as the lock's
    token), waiting (bounded) for the missing ones. The agent keeps every message it
    printed: names are unique per round, so that no round reads another's notices."""
    found: dict[str, dict[str, Any]] = {}
    for what in wanted:
        with contextlib.suppress(AssertionError):  # missing: judged by the caller
            found[what] = holder.event("notice", TTL + SST + 10, name=name, what=what, **match)
    return found


def judge(
    kind: str,
    number: int,
    dropped: float,
    notices: dict[str, dict[str, Any]],
    successor_at: float,
    token: int,
) -> dict[str, Any]:
    """One round's timeline and figures: margin > 0 when every notice came first."""
    wanted = NOTICES[kind]
    last = max((n["at"] for n in notices.values()), default=None)
    deadlines = [n["deadline"] for n in notices.values() if "deadline" in n]
    deadline = min(deadlines) if deadlines else dropped + TTL
    return {
        "kind": kind,
        "round": number,
        "token": token,
        "partitioned_at": dropped,
        "notices": {what: n["at"] for what, n in notices.items()},
        "missing": [what for what in wanted if what not in notices],
        "successor_at": successor_at,
        "last_notice": last,
        "in_time": last is not None
        and len(notices) == len(wanted)
        and all(n["at"] < successor_at for n in notices.values()),
        "margin": None if last is None else successor_at - last,
        "after_deadline": None if last is None else last - deadline,
        "after_partition_bound": None if last is None else last - (dropped + TTL),
    }


def conclude(results: list[dict[str, Any]], record: Record) -> None:
    """Record a test's figures; every round's notices must have come in time."""
    figures = summarize(results)
    record(**{k: v for k, v in figures.items() if v is not None}, seed=SEED)
    late = [r for r in results if not r["in_time"]]
    assert not late, "notices after (or without) the next holder's acquisition:\n" + "\n".join(
        json.dumps(r, sort_keys=True) for r in late
    )


def holders(status: LockInfo) -> list[tuple[str, int]]:
    """Who holds a key by the server's clock: its exclusive holder, or its shared ones."""
    if status.owner:
        return [(status.owner, status.token)] if status.live else []
    return [(holder.owner, holder.token) for holder in status.live_holders]


def lock_round(
    kind: str,
    number: int,
    rng: random.Random,
    proxy: TcpProxy,
    holder: NetAgent,
    contender: NetAgent,
    observer: LockManager,
    many: bool = False,
) -> dict[str, Any]:
    """Hold, partition at a random moment (with ``many`` leases held, within a tick of
    the refresher's keeping its write encoded), let the contender take the key, heal,
    check."""
    key = name = f"{kind}-{number}-{uuid.uuid4().hex[:6]}"
    got = holder.call("acquire", name=name, key=key, kind=kind, ttl=TTL)
    assert got["ok"], got
    other_kind = "semaphore" if kind == "semaphore" else "plain"
    waiting = contender.send(
        "acquire", name=name, key=key, kind=other_kind, ttl=TTL, timeout=TTL + 3 * SST + 30
    )
    if many:
        until_kept(kind, holder)
        time.sleep(rng.uniform(0.0, TTL / 3))
    else:
        time.sleep(rng.uniform(0.05, TTL))
    proxy.set_mode("drop")
    dropped = time.monotonic()
    won = contender.reply(waiting, TTL + 3 * SST + 40)
    assert won["ok"], won
    assert won["token"] > got["token"]
    notices = notices_of(holder, name, NOTICES[kind], token=got["token"])
    heal(proxy, holder)
    # Once the network is back the old holder never acts as the holder again.
    after = holder.call("after_heal", name=name)
    del after["reply"]
    assert after == {
        "valid": False,
        "lost": True,
        "refresh": "LockLost",
        "release": False,
        "valid_after": False,
    }, after
    status = observer.status(key)
    assert status is not None
    assert status.live, status
    assert holders(status) == [(won["owner"], won["token"])], status
    released = contender.call("release", name=name)
    assert released["ok"], released
    assert released["held"], released
    return judge(kind, number, dropped, notices, won["done"], got["token"])


def election_round(
    number: int,
    rng: random.Random,
    proxy: TcpProxy,
    holder: NetAgent,
    contender: NetAgent,
    observer: LockManager,
) -> dict[str, Any]:
    """The leader behind the proxy is cut off; the old leader's on_demoted must come first."""
    key = name = f"election-{number}-{uuid.uuid4().hex[:6]}"
    holder.call("elect", name=name, key=key, ttl=TTL)
    first = holder.event("elected", 30, name=name)
    contender.call("elect", name=name, key=key, ttl=TTL)
    time.sleep(rng.uniform(0.05, TTL))
    proxy.set_mode("drop")
    dropped = time.monotonic()
    second = contender.event("elected", TTL + 3 * SST + 30, name=name)
    assert second["token"] > first["token"]
    notices = notices_of(holder, name, NOTICES["election"])
    heal(proxy, holder)
    # Demoted for good: the old leader campaigns again, but cannot win while the new leads.
    time.sleep(TTL / 3 + 0.2)
    assert holder.call("leading", name=name)["is_leader"] is False
    assert contender.call("leading", name=name)["is_leader"] is True
    assert observer.leader(key) is not None
    assert holder.call("resign", name=name)["was_leader"] is False
    assert contender.call("resign", name=name)["was_leader"] is True
    return judge("election", number, dropped, notices, second["at"], first["token"])


@pytest.mark.timeout(420)
@pytest.mark.parametrize("kind", ["plain", "shared", "semaphore", "election"])
def test_a_partitioned_holder_learns_of_its_loss_before_anybody_else_holds_its_lock(
    kind: str,
    lone: MongoReplicaSet,
    proxy: TcpProxy,
    pair: tuple[NetAgent, NetAgent, str],
    record: Record,
) -> None:
    holder, contender, database = pair
    rng = random.Random(f"{SEED}-{kind}")
    results = RESULTS.setdefault(kind, [])
    with observed(lone, database, proxy) as observer:
        for number in range(ROUNDS):
            if kind == "election":
                results.append(election_round(number, rng, proxy, holder, contender, observer))
            else:
                results.append(lock_round(kind, number, rng, proxy, holder, contender, observer))
    conclude(results, record)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["plain", "shared"])
def test_a_partitioned_holder_of_many_leases_learns_of_each_loss_in_time(
    kind: str,
    lone: MongoReplicaSet,
    proxy: TcpProxy,
    pair: tuple[NetAgent, NetAgent, str],
    record: Record,
) -> None:
    """The rounds above with 70 more leases held, cut off once the refresher keeps its
    write encoded for all 71: it sends that write again into the black hole. Each of
    the 70 learns of its loss too before the contender's acquire returns (their leases
    were extended by the same writes as the round's lock), and none is held once the
    network is back."""
    holder, contender, database = pair
    rng = random.Random(f"{SEED}-{kind}-many")
    results = RESULTS.setdefault(f"{kind}, {BALLAST} more", [])
    with observed(lone, database, proxy) as observer:
        for number in range(BALLAST_ROUNDS):
            prefix = f"ballast-{kind}-{number}-{uuid.uuid4().hex[:6]}"
            taken = holder.call("take_ballast", prefix=prefix, kind=kind, count=BALLAST, ttl=TTL)
            assert taken["ok"], taken
            result = lock_round(kind, number, rng, proxy, holder, contender, observer, many=True)
            results.append(result)
            late: dict[str, dict[str, Any]] = {}
            for key, token in taken["tokens"].items():
                notices = notices_of(holder, key, ("event", "signal"), token=token)
                if len(notices) < 2 or any(
                    n["at"] >= result["successor_at"] for n in notices.values()
                ):
                    late[key] = notices
            assert not late, late
            # Healed: no write after the cut kept any of them alive on the server.
            held = [
                key
                for key in taken["tokens"]
                if (status := observer.status(key)) is not None and holders(status)
            ]
            assert held == [], held
            dropped = holder.call("drop_ballast")
            assert [(d["lost"], d["released"]) for d in dropped["locks"]] == [
                (True, False)
            ] * BALLAST, dropped
    conclude(results, record)


def entry_of(status: LockInfo | None, owner: str) -> Holder | None:
    """``owner``'s shared lease in ``status`` (lapsed or not), if the document still has it."""
    if status is None:
        return None
    return next((holder for holder in status.holders if holder.owner == owner), None)


@pytest.mark.timeout(180)
def test_another_holders_refresh_keeps_no_partitioned_shared_lease_alive(
    lone: MongoReplicaSet,
    proxy: TcpProxy,
    pair: tuple[NetAgent, NetAgent, str],
) -> None:
    """A shared lease cut off from the server lapses at its own end while another
    process's shared lease of the same key is refreshed beside it, tick after tick.

    The refresher extends the leases of one update only for the owners it lists, and
    skips that test for a document's lone holder: with two holders, the other
    process's write must leave the partitioned lease as it was.
    """
    holder, contender, database = pair
    key, name = f"beside-{uuid.uuid4().hex[:6]}", "beside"
    got = holder.call("acquire", name=name, key=key, kind="shared", ttl=TTL)
    assert got["ok"], got
    with LockManager(lone.url, database=database, server_selection_timeout=30) as observer:
        beside = observer.acquire(key, shared=True, ttl=TTL)
        try:
            time.sleep(random.uniform(0.05, TTL / 3))
            proxy.set_mode("drop")
            dropped = time.monotonic()
            # A refresh sent just before the drop may still reach the server: the lease
            # end counts once two reads 0.3 s apart agree on it.
            frozen = None
            for _ in range(10):
                time.sleep(0.3)
                seen = entry_of(observer.status(key), got["owner"])
                assert seen is not None, "the partitioned lease is gone before its end"
                if frozen is not None and seen.expires_at == frozen.expires_at:
                    break
                frozen = seen
            assert frozen is not None
            waiting = contender.send(
                "acquire", name=name, key=key, kind="plain", ttl=TTL, timeout=3 * SST + 30
            )
            ours_at = entry_of(observer.status(key), beside.owner)
            assert ours_at is not None
            refreshed = 0
            deadline = time.monotonic() + TTL + 5
            while True:
                status = observer.status(key)
                assert status is not None
                entry, ours = entry_of(status, got["owner"]), entry_of(status, beside.owner)
                assert ours is not None, status
                assert ours.expires_at > status.now, status
                if ours.expires_at > ours_at.expires_at:
                    refreshed += 1
                    ours_at = ours
                if entry is not None:
                    assert entry.expires_at <= frozen.expires_at, (
                        f"the partitioned lease was extended by another holder's refresh: "
                        f"{frozen.expires_at} -> {entry.expires_at}"
                    )
                if (entry is None or entry.expires_at <= status.now) and refreshed >= 2:
                    break
                assert time.monotonic() < deadline, (
                    f"the partitioned lease is still live, or the other one was not "
                    f"refreshed twice ({refreshed}): {status}"
                )
                time.sleep(0.1)
            assert frozen.expires_at <= status.now
            beside.release()
            won = contender.reply(waiting, 3 * SST + 40)
            assert won["ok"], won
            assert won["token"] > got["token"]
            notices = notices_of(holder, name, NOTICES["shared"])
        finally:
            proxy.set_mode("pass")
            if not beside.released:
                beside.release()
    heal(proxy, holder)
    result = judge("shared", 0, dropped, notices, won["done"], got["token"])
    assert result["in_time"], result
    after = holder.call("after_heal", name=name)
    assert after["valid"] is False, after
    assert after["lost"] is True, after
    released = contender.call("release", name=name)
    assert released["ok"], released
    assert released["held"], released


# -- two servers, one cut off ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def other() -> Iterator[MongoReplicaSet]:
    """A second single-node replica set: another server, healthy while the first is cut off."""
    replica_set = MongoReplicaSet(1, name="other")
    replica_set.start()
    try:
        yield replica_set
    finally:
        stop_and_check(replica_set)


class Notices:
    """Every loss notice of some locks of this process, with its time."""

    def __init__(self, *locks: Lock) -> None:
        self.at: dict[tuple[str, str], float] = {}
        self.keys = {lock.key for lock in locks}
        lock_lost.connect(self.signal, weak=False)
        for lock in locks:
            event = lock.lost
            threading.Thread(target=self._wait, args=(lock, event), daemon=True).start()

    def close(self) -> None:
        lock_lost.disconnect(self.signal)

    def note(self, key: str, what: str) -> None:
        self.at.setdefault((key, what), time.monotonic())

    def signal(self, sender: object, lock: Lock, **kwargs: Any) -> None:
        if lock.key in self.keys:
            self.note(lock.key, "signal")

    def on_lost(self, lock: Lock) -> None:
        self.note(lock.key, "on_lost")

    def _wait(self, lock: Lock, event: threading.Event) -> None:
        while not event.wait(0.5):
            if lock.released and not event.wait(2.0):
                return
        self.note(lock.key, "event")


@pytest.mark.timeout(120)
def test_a_black_holed_server_delays_no_other_servers_locks(
    lone: MongoReplicaSet, other: MongoReplicaSet, proxy: TcpProxy, record: Record
) -> None:
    """Two managers in one process: one server cut off, the other healthy.

    The healthy server's lock stays held (and refreshed) for three leases; the cut-off
    server's lock is reported lost before another process can take it.
    """
    ttl, database = 2.0, f"two_{uuid.uuid4().hex[:8]}"
    far = LockManager(proxy.direct_url, database=database, server_selection_timeout=SST)
    near = LockManager(other.url, database=database, server_selection_timeout=SST)
    rival = LockManager(lone.url, database=database, server_selection_timeout=SST)
    notices: Notices | None = None
    try:
        cut = far.acquire("far", ttl=ttl)
        kept = near.acquire("near", ttl=ttl)
        notices = Notices(cut, kept)
        cut.on_lost = kept.on_lost = notices.on_lost
        time.sleep(random.uniform(0.05, ttl))
        proxy.set_mode("drop")
        dropped = time.monotonic()
        taken: list[tuple[float, Lock]] = []

        def take() -> None:
            successor = rival.acquire("far", ttl=ttl, timeout=30)
            taken.append((time.monotonic(), successor))

        rival_thread = threading.Thread(target=take, daemon=True)
        rival_thread.start()
        first_invalid = None
        while time.monotonic() < dropped + 3 * ttl:
            if not kept.valid and first_invalid is None:
                first_invalid = time.monotonic()
            time.sleep(0.02)
        rival_thread.join(30)
        assert taken, "the other process never took the cut-off server's lock"
        taken_at, successor = taken[0]
        held = near.status("near")
        assert first_invalid is None, (
            f"the healthy lock turned invalid at {first_invalid - dropped:.2f}s"
        )
        assert not kept.lost.is_set()
        assert held is not None
        assert (held.live, held.owner) == (True, kept.owner), held
        assert [k for k, _ in notices.at if k == "near"] == []
        cut_notices = {what: at for (key, what), at in notices.at.items() if key == "far"}
        assert set(cut_notices) == {"event", "signal", "on_lost"}, cut_notices
        late = {what: at - taken_at for what, at in cut_notices.items() if at >= taken_at}
        assert not late, f"notices after another process took the lock: {late}"
        kept.refresh()
        assert kept.release()
        proxy.set_mode("pass")
        assert successor.release()
        record(
            margin_seconds=taken_at - max(cut_notices.values()),
            notice_after_partition_plus_ttl_seconds=max(cut_notices.values()) - (dropped + ttl),
        )
    finally:
        proxy.set_mode("pass")
        if notices is not None:
            notices.close()
        for manager in (far, near, rival):
            manager.close()
